"""A watch on the session worker's Faust consumer: a worker whose consumer stopped
delivering prompts while prompts wait for it ends itself, so that its supervisor restarts it.

Faust runs its Kafka consumer (aiokafka) in a thread with an event loop of its own. Seen on
this project's two shared cores under load: that thread stopped answering ("Thread keepalive
is not responding"), the consumer's group session expired, and the worker took no prompt for
ten minutes, logging nothing more. The stall watch (``stall.py``) could not see it: it
watches groups and sessions, and none had started.

So this judges the consumer from outside, by what the broker holds: the session workers'
consumer group (``sessions.app_id``), its committed offsets on the prompts topic and its
live members (:class:`~rolloutbus.kafka.consumer_lag.LagReader`). The worker is stalled when,
for ``sessions.consumer_stall_s``, it has not been inside ``take()`` (a prompt waiting for a
free group slot is being taken, not stalled) and not been given or lost a partition, and

- prompts wait past the committed offset on a partition this worker owns, or
- prompts wait and the group has no live member at all (this worker's membership is gone).

A partition owned by another worker is that worker's to watch. Leaving is the designed
recovery path: the worker flushes what it logged and exits ``EXIT_CONSUMER_STALLED``; the
restarted one resumes every unfinished group from the turn log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.consumer_lag import GroupLag, LagReader

log = logging.getLogger(__name__)

EXIT_CONSUMER_STALLED = 75  # EX_TEMPFAIL: restart the worker; it resumes from the log
LAG_QUERY_TIMEOUT_S = 10.0


def consumer_stalled(lag: GroupLag, owned: set[int], idle_s: float) -> str | None:
    """Why the consumer behind ``lag`` is stalled, or None. ``owned``: the prompts partitions
    this worker holds; ``idle_s``: how long it has taken no prompt and seen no rebalance."""
    waiting = {p.partition: p.lag_records for p in lag.partitions if p.lag_records > 0}
    mine = {p: n for p, n in waiting.items() if p in owned}
    if mine:
        return (
            f"{sum(mine.values())} prompt group(s) wait on {lag.topic} partition(s) "
            f"{sorted(mine)}, which this worker owns, and its consumer delivered none "
            f"for {idle_s:.0f} s"
        )
    if waiting and lag.members == 0:
        return (
            f"{sum(waiting.values())} prompt group(s) wait on {lag.topic} partition(s) "
            f"{sorted(waiting)} and consumer group {lag.group!r} has no live member: this "
            f"worker's consumer left the group and has not rejoined for {idle_s:.0f} s"
        )
    return None


class ConsumerWatch:
    """Tracks when the worker last took a prompt or saw a rebalance; ``run()`` checks the
    broker once that is ``stall_s`` ago, and calls ``on_stalled(reason)`` when it is stalled."""

    def __init__(
        self,
        cfg: Config,
        prompts_topic: str,
        owned: Callable[[], set[int]],
        on_stalled: Callable[[str], None],
    ):
        self.cfg = cfg
        self.stall_s = cfg.sessions.consumer_stall_s
        self.topic = prompts_topic
        self.owned = owned
        self.on_stalled = on_stalled
        self._taking = 0
        self._last_progress = time.monotonic()
        self._reader: LagReader | None = None  # made on the first check, kept after it

    def progressed(self) -> None:
        """A rebalance gave or took partitions: the consumer is alive."""
        self._last_progress = time.monotonic()

    @contextmanager
    def taking(self) -> Iterator[None]:
        """Around ``take()``: a prompt delivered, however long its slot takes to come."""
        self._taking += 1
        self.progressed()
        try:
            yield
        finally:
            self._taking -= 1
            self.progressed()

    def idle_s(self) -> float:
        """Seconds without a prompt in hand or a rebalance; 0 while a prompt is being taken."""
        return 0.0 if self._taking else time.monotonic() - self._last_progress

    async def run(self) -> None:
        check_every_s = min(15.0, self.stall_s / 4)
        while True:
            await asyncio.sleep(check_every_s)
            reason = await self.check()
            if reason is not None:
                self.on_stalled(reason)
                return

    async def check(self) -> str | None:
        """Why the consumer is stalled now, or None."""
        if self.idle_s() < self.stall_s:
            return None
        lag = await asyncio.to_thread(self._read_lag)
        if lag is None:
            # the broker did not answer: the consumer cannot fetch either, so it is judged
            # over a whole window after the broker is back, not on the first answer
            self.progressed()
            return None
        idle = self.idle_s()  # again: a prompt may have come while the broker answered
        return consumer_stalled(lag, self.owned(), idle) if idle >= self.stall_s else None

    def _read_lag(self) -> GroupLag | None:
        """The group's lag on the prompts topic; None when the broker does not answer (a
        broker outage is not the consumer's fault: the check is made again later)."""
        try:
            if self._reader is None:
                self._reader = LagReader(self.cfg.kafka, timeout_s=LAG_QUERY_TIMEOUT_S)
            [lag] = self._reader.read({self.cfg.sessions.app_id: self.topic})
            return lag
        except BrokerError as exc:
            log.warning("consumer watch: cannot read the prompts lag (%s); checking later", exc)
            self.close()
            return None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


__all__ = ["EXIT_CONSUMER_STALLED", "ConsumerWatch", "consumer_stalled"]
