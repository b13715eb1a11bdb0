"""``rolloutbus top`` as a user runs it: live output to a file or pipe, and Ctrl-C (SIGINT)
or SIGTERM stop it at once, also when started as a background job with SIGINT ignored."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import free_port

STOP_WITHIN_S = 10.0  # seconds; the bound for every command


def _start_top(tmp_path, ignore_sigint: bool) -> tuple[subprocess.Popen[str], object]:
    out = (tmp_path / "top.txt").open("w")
    # a metrics port nothing listens on: every target reads DOWN, the view still prints
    argv = [sys.executable, "-m", "rolloutbus.cli", "top", "--interval", "0.5"]
    argv += [f"sessions.metrics_port={free_port()}"]
    process = subprocess.Popen(
        argv,
        stdout=out,
        stderr=subprocess.PIPE,
        text=True,
        # as `cmd &` in a non-interactive shell starts it: SIGINT ignored
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if ignore_sigint
        else None,
    )
    return process, out


@pytest.mark.parametrize(
    ("sig", "ignore_sigint"),
    [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
)
def test_live_top_writes_to_a_file_and_stops_on_a_signal(tmp_path, sig, ignore_sigint):
    process, out = _start_top(tmp_path, ignore_sigint)
    try:
        deadline = time.monotonic() + 60  # seconds; the interpreter's start on a busy host
        text = ""
        while time.monotonic() < deadline and text.count("rolloutbus top") < 2:
            time.sleep(0.3)
            text = (tmp_path / "top.txt").read_text()
        assert text.count("rolloutbus top") >= 2, "no snapshots written to a non-TTY stdout"
        assert "consumer lag" in text and "sessions" in text and "DOWN" in text
        process.send_signal(sig)
        assert process.wait(timeout=STOP_WITHIN_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        out.close()  # type: ignore[attr-defined]
        assert process.stderr is not None
        process.stderr.close()
