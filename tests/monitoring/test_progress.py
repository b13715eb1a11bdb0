"""The progress line of the long-running processes (rolloutbus/progress.py): counts and
rates since the last line at a steady interval, what is open now, one line when idle."""

from __future__ import annotations

import logging

from rolloutbus.progress import ProgressLine


class Clock:
    """A clock the test moves (the interval is 60 s of it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_interval_with_counts_rates_and_what_is_open(caplog):
    clock = Clock()
    progress = ProgressLine("replay buffer", 60.0, logging.getLogger("t"), clock)
    progress.add("groups", 12)
    progress.add("trajectories", 48)
    clock.now += 30
    assert not progress.due() and progress.maybe_log({"open groups": 3}) is None  # not yet
    clock.now += 30
    assert progress.due()
    with caplog.at_level(logging.INFO):
        line = progress.maybe_log({"open groups": 3, "paused partitions": 0})
    assert line == (
        "replay buffer: 12 groups (0.20/s), 48 trajectories (0.80/s) in the last 60 s; "
        "3 open groups"
    )
    assert caplog.messages == [line]
    clock.now += 60  # nothing done since, but a group is still open
    assert progress.maybe_log({"open groups": 1}) == (
        "replay buffer: nothing done in the last 60 s; 1 open groups"
    )


def test_an_idle_process_says_so_once_then_stays_quiet_until_work_comes():
    clock = Clock()
    progress = ProgressLine("sessions", 60.0, logging.getLogger("t"), clock)
    lines = []
    for _ in range(3):
        clock.now += 60
        lines.append(progress.maybe_log({"groups in flight": 0}))
    assert lines == ["sessions: idle (nothing done in the last 60 s, nothing open)", None, None]
    progress.add("turns", 6)
    clock.now += 60
    assert progress.maybe_log() == "sessions: 6 turns (0.10/s) in the last 60 s"
    clock.now += 60
    assert progress.maybe_log() == "sessions: idle (nothing done in the last 60 s, nothing open)"


def test_zero_interval_never_logs():
    clock = Clock()
    progress = ProgressLine("sessions", 0.0, logging.getLogger("t"), clock)
    progress.add("turns", 6)
    clock.now += 3600
    assert progress.maybe_log() is None
