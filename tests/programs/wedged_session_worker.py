"""Fault injector: a session worker whose Faust consumer never delivers a record.

Run as ``python wedged_session_worker.py CONFIG``. Faust's fetch (``getmany`` of its aiokafka
consumer thread) is replaced by one that never returns, as when that thread stopped
answering on a starved host; the consumer's heartbeats go on, so the worker keeps its
partitions and looks alive to the broker. Everything else is the real ``rolloutbus sessions
run``: its consumer watch has to notice and end the process (exit 75).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

from rolloutbus.cli import main


async def _fetch_that_never_returns(self: Any, active_partitions: Any, timeout: float) -> Any:
    await asyncio.Event().wait()


faust_aiokafka.AIOKafkaConsumerThread.getmany = _fetch_that_never_returns  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["sessions", "run", "--config", sys.argv[1]]))
