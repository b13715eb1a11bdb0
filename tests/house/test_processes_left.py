"""The suite's report of child processes left running (``tests/processes_left.py``): a live
process is named with its command; one that has ended is not, waited for or not."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes_left import name_processes_left_running

ENDED_WITHIN_S = 30.0  # seconds for a child that only starts Python to end


def test_a_running_process_is_named_and_an_ended_one_is_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # left"])
    waited = subprocess.Popen([sys.executable, "-c", "pass  # waited for"])
    waited.wait()
    ended = subprocess.Popen([sys.executable, "-c", "pass  # ended, never waited for"])
    _until_ended(ended.pid)  # a zombie: its Popen still says returncode None
    try:
        name_processes_left_running("now")
        lines = [line for line in capsys.readouterr().err.splitlines() if "child pid" in line]
        named = [line for line in lines if f"child pid {sleeper.pid} " in line]
        assert len(named) == 1 and "time.sleep(60)  # left" in named[0]
        assert not any(f"child pid {p.pid} " in line for line in lines for p in (waited, ended))
    finally:
        sleeper.kill()
        sleeper.wait()


def _until_ended(pid: int) -> None:
    """Wait, without reaping it, until the process has exited (state Z in /proc)."""
    deadline = time.monotonic() + ENDED_WITHIN_S
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"pid {pid} still running"
        time.sleep(0.02)
