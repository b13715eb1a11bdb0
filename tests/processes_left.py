"""Child processes a test session leaves running, named when it ends.

Full CI runs print a few ``ResourceWarning: subprocess N is still running`` as pytest-xdist's
workers exit: a ``Popen`` still referenced at interpreter exit, its process never waited
for. The warning names only a pid; this names the command on stderr at exit (``atexit``:
after the session's fixtures are torn down, before the final garbage collection)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys


def name_processes_left_running(when: str) -> None:
    for obj in gc.get_objects():
        # type(), not isinstance(): that reads __class__, which some lazy objects warn on
        if not issubclass(type(obj), subprocess.Popen):
            continue
        if obj.returncode is None and obj.poll() is None:
            command = obj.args if isinstance(obj.args, str) else " ".join(map(str, obj.args))
            print(
                f"[tests] {when} (pytest pid {os.getpid()}): child pid {obj.pid} still "
                f"running, never waited for: {command[:240]}",
                file=sys.stderr,
            )
