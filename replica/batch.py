"""The decode engine's running state: each request while the engine holds it (its tokens,
logprobs and weight versions so far), and the batch of running rows.

Touched only by the decode thread, except ``DecodeSequence.aborted`` (set by a caller that
gives up) and the caller's future, which is always completed in the caller's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rolloutbus.replica.generation import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Timings,
    version_spans,
)

__all__ = ["DecodeBatch", "DecodeSequence", "WaitingRequests"]


@dataclass(eq=False)
class DecodeSequence:
    """One request while the engine holds it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    generator: torch.Generator | None  # None for greedy requests
    stop_ids: frozenset[int]
    submitted: float
    started: float = 0.0
    first_token: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    aborted: bool = False  # set from the caller's thread when it gives up
    # (weight version, index of the first token it sampled), one entry per version change
    version_starts: list[tuple[int | str, int]] = field(default_factory=list)

    def record(
        self, token: int, logprob: float, top: dict[int, float] | None, version: int | str
    ) -> None:
        """One sampled token under weight ``version``; finishes the sequence on a stop token
        or at ``max_tokens``."""
        if not self.version_starts or self.version_starts[-1][0] != version:
            self.version_starts.append((version, len(self.token_ids)))
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs = (self.top_logprobs or []) + [top]
        if token in self.stop_ids:
            self.finish_reason = "stop"
            self.stop_reason = token if token in self.request.stop_token_ids else None
        elif len(self.token_ids) >= self.request.max_tokens:
            self.finish_reason = "length"

    def result(self, reason: FinishReason) -> GenerationResult:
        """What the caller gets back: the tokens so far, ended for ``reason``."""
        now = time.monotonic()
        return GenerationResult(
            request_id=self.request.request_id,
            prompt_ids=list(self.request.prompt_ids),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            finish_reason=reason,
            stop_reason=self.stop_reason,
            weight_versions=version_spans(self.version_starts, len(self.token_ids)),
            timings=Timings(
                queue_s=(self.started or now) - self.submitted,
                ttft_s=(self.first_token or now) - self.submitted,
                e2e_s=now - self.submitted,
            ),
        )

    def resolve(self, result: GenerationResult) -> None:
        """Hand ``result`` to the caller, in its event loop (from the decode thread)."""

        def deliver() -> None:
            if not self.future.done():
                self.future.set_result(result)

        self._call_in_loop(deliver)

    def reject(self, error: BaseException) -> None:
        """Fail the caller's request with ``error``, in its event loop."""

        def deliver() -> None:
            if not self.future.done():
                self.future.set_exception(error)

        self._call_in_loop(deliver)

    def _call_in_loop(self, callback: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
            pass


@dataclass
class DecodeBatch:
    """The running rows (row i in KV-cache slot i) and what each row feeds next."""

    rows: list[DecodeSequence]
    pending: torch.Tensor  # [B] long, the last sampled token (not yet in the cache)
    positions: torch.Tensor  # [B] long, tokens of each row in the cache = next position
    lengths: list[int]  # the same, as ints: the width a step attends to, without a sync

    def join(self, joining: DecodeBatch) -> DecodeBatch:
        """``joining``'s rows (prefilled into the slots after this batch's) appended."""
        return DecodeBatch(
            rows=self.rows + joining.rows,
            pending=torch.cat([self.pending, joining.pending]),
            positions=torch.cat([self.positions, joining.positions]),
            lengths=self.lengths + joining.lengths,
        )

    def keep_rows(self, index: list[int]) -> None:
        """Keep only rows ``index``, in that order (their cache slots already moved)."""
        self.rows = [self.rows[i] for i in index]
        self.lengths = [self.lengths[i] for i in index]
        selector = torch.tensor(index, dtype=torch.long)
        self.pending = self.pending[selector]
        self.positions = self.positions[selector]


class WaitingRequests:
    """Requests waiting for a row in the batch, first come first served; keeps
    ``stats.waiting`` current. Used under the engine's condition."""

    def __init__(self, stats: EngineStats) -> None:
        self._queue: deque[DecodeSequence] = deque()
        self._stats = stats

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, seq: DecodeSequence) -> None:
        self._queue.append(seq)
        self._stats.waiting = len(self._queue)

    def admit(self, room: int) -> tuple[list[DecodeSequence], list[DecodeSequence]]:
        """Up to ``room`` requests for the batch, and those whose caller gave up meanwhile
        (met on the way: they take no room)."""
        admitted: list[DecodeSequence] = []
        gave_up: list[DecodeSequence] = []
        while self._queue and len(admitted) < room:
            seq = self._queue.popleft()
            (gave_up if seq.aborted else admitted).append(seq)
        self._stats.waiting = len(self._queue)
        return admitted, gave_up

    def take_all(self) -> list[DecodeSequence]:
        """Every waiting request, the queue emptied."""
        taken = list(self._queue)
        self._queue.clear()
        self._stats.waiting = 0
        return taken
