"""Fault injector: a replay buffer whose group consumer stops answering.

Run as ``python stalled_replay_buffer.py CONFIG LIMIT_S``. The consumer's sixth ``consume()``
never returns, as a librdkafka poll did after a broker restart in CI; the main-loop watch's
limit is LIMIT_S instead of MAIN_LOOP_LIMIT_S. Everything else is the real ``rolloutbus
replay-buffer run``: its MainLoopWatch has to notice and end the process (exit 75).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from rolloutbus.cli import main
from rolloutbus.kafka.group_member import GroupMember
from rolloutbus.streams.assembly import replay_buffer

ANSWERED = 5  # consume() calls answered before the one that never returns
_real_consume = GroupMember.consume
_calls = [0]


def _consume_that_hangs(self: GroupMember, max_records: int, timeout_s: float) -> Any:
    _calls[0] += 1
    if _calls[0] > ANSWERED:
        threading.Event().wait()
    return _real_consume(self, max_records, timeout_s)


GroupMember.consume = _consume_that_hangs  # type: ignore[method-assign]

if __name__ == "__main__":
    replay_buffer.MAIN_LOOP_LIMIT_S = float(sys.argv[2])
    sys.exit(main(["replay-buffer", "run", "--config", sys.argv[1]]))
