"""Supervised processes: one ``rolloutbus`` command each, restarted when it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.faults.workload import PLUGINS

RESTART_DELAY_S = 1.0  # seconds before a supervisor restarts a process that exited
RESTART_DELAY_MAX_S = 8.0  # seconds; the delay doubles while a process keeps exiting fast
CRASH_LOOP_S = 15.0  # seconds; an exit sooner than this after a start doubles the delay
STOP_TIMEOUT_S = 30.0  # seconds for a SIGTERMed process to exit before SIGKILL


class Service:
    """One ``rolloutbus ARGV --config CONFIG`` process, restarted by the supervisor when it
    exits (unless retired). Each incarnation logs to ``{name}.{incarnation}.log``.
    ``program``: a script that runs the command line itself (a fault injector,
    ``tests/programs/``) instead of ``python -m rolloutbus.cli``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        config_path: Path,
        workdir: Path,
        env: dict[str, str] | None = None,
        program: Path | None = None,
    ):
        self.name, self.argv, self.config_path = name, argv, config_path
        self.command = [sys.executable, *([str(program)] if program else ["-m", "rolloutbus.cli"])]
        self.workdir = workdir / name  # its own cwd: Faust writes {app_id}-data there
        self.workdir.mkdir(parents=True, exist_ok=True)
        # PYTHONFAULTHANDLER: SIGABRT writes every thread's stack to the log (dump_stacks)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])
        self.popen: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.exits: list[int] = []  # return codes of every incarnation that ended
        self.restarts = 0
        self.retired = False
        self.metrics_port: int | None = None
        self.lock = threading.Lock()
        self._started_at = 0.0
        self._down_since: float | None = None
        self._delay = RESTART_DELAY_S
        self._injected = False  # the running incarnation was killed by the fault injector

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.{self.incarnation}.log"

    def start(self) -> None:
        self.incarnation += 1
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [*self.command, *self.argv, "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.workdir,
            )
        self._started_at = time.monotonic()
        self._down_since = None
        self._injected = False

    def running(self) -> bool:
        with self.lock:
            return self.popen is not None and self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with self.lock:
            if self.popen is not None and self.popen.poll() is None:
                self.popen.send_signal(sig)
                self.popen.wait()
                self._injected = True

    def retire(self) -> None:
        """Kill it for good: the supervisor leaves it down."""
        self.retired = True
        self.kill()

    def supervise(self) -> None:
        """Restart the process if it exited (after a delay that grows while it crash-loops;
        a kill by the fault injector is no crash of its own: restarted after the base delay,
        so the injector's kills in quick succession measure the takeover, not a backoff)."""
        with self.lock:
            if self.retired or self.popen is None or self.popen.poll() is None:
                return
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                self.exits.append(self.popen.returncode)
                fast = now - self._started_at < CRASH_LOOP_S and not self._injected
                self._delay = min(self._delay * 2, RESTART_DELAY_MAX_S) if fast else RESTART_DELAY_S
            if now - self._down_since >= self._delay:
                self.restarts += 1
                self.start()

    def dump_stacks(self) -> bool:
        """SIGABRT a live process: faulthandler writes its threads' stacks to its log, then
        it dies (for a run that hangs). Returns whether it was alive."""
        with self.lock:
            self.retired = True
            if self.popen is None or self.popen.poll() is not None:
                return False
            self.popen.send_signal(signal.SIGABRT)
            self.popen.wait()
            return True

    def stop(self) -> None:
        with self.lock:
            self.retired = True
            if self.popen is None or self.popen.poll() is not None:
                return
            self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def log_tail(self, chars: int = 2000) -> str:
        """The end of its last log. A log that ends in a stack dump (dump_stacks) gives
        ``chars`` of the lines before the dump, then the dump's threads (a CI failure once
        showed only the dump, which filled the tail, and one log line)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        dump_at = text.rfind("Fatal Python error")
        if dump_at < 0:
            return text[-chars:]
        threads = text[dump_at:].split("\nExtension modules:")[0]
        return text[max(0, dump_at - chars) : dump_at] + threads
