"""One token stream as the turn log describes it: a prompt, then sampled and observed tokens.

Shared by the session recorder (which checks each new prompt against what it logged) and the
session fold (which rebuilds the stream from the log), so both sides agree on masks,
logprobs and policy versions by construction.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutbus.schemas.control import as_policy_version
from rolloutbus.schemas.routed_experts import RoutedExperts


class _SpanLookups:
    """What an output ending at a position holds of a stream's ``versions`` and ``routed``
    (``(end, value)`` spans, in order): shared by ``SegmentStream`` and ``FoldSegment``."""

    versions: list[tuple[int, int | None]]
    routed: list[tuple[int, RoutedExperts]]

    def routed_experts_until(self, end: int) -> RoutedExperts | None:
        """The routed experts an output ending at ``end`` holds, as verl's loops keep them:
        those of the last generation that ends within it, cut at ``end`` tokens (the engine
        recorded every token it fed through the model, the whole prefix included)."""
        found = None
        for stop, experts in self.routed:
            if stop <= end:
                found = experts
        return None if found is None else found.head(end)

    def versions_until(self, end: int) -> list[int]:
        return [v for stop, v in self.versions if v is not None and stop - 1 < end]


def _mid_turn_versions(
    start: int,
    n: int,
    version: int | None,
    first_version: int | None,
    chunk_versions: Sequence[tuple[int, int | None]],
) -> list[tuple[int, int | None]]:
    """The spans a generation of ``n`` tokens at ``start`` adds before its own (``version``,
    ending at its last token): its first token's version where the weights changed mid-turn,
    and each logged chunk sampled by another version (``SegmentStream.add_generation``)."""
    spans: list[tuple[int, int | None]] = []
    if first_version is not None and first_version != version and n:
        spans.append((start + 1, first_version))
    for end, chunk_version in chunk_versions:
        if chunk_version is not None and chunk_version != version and 0 < end <= n:
            spans.append((start + end, chunk_version))
    return spans


@dataclass
class SegmentStream(_SpanLookups):
    """One token stream: its prompt, then generations (mask 1) and observations (mask 0)."""

    prompt_len: int
    tokens: list[int]
    mask: list[int] = field(default_factory=list)  # aligned to tokens; prompt positions 0
    logprobs: list[float] = field(default_factory=list)  # aligned to tokens; 0.0 off-policy
    versions: list[tuple[int, int | None]] = field(default_factory=list)  # (end, version)
    # (end, routed experts) of each generation that carried them (routing replay), in order
    routed: list[tuple[int, RoutedExperts]] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_ids: list[int]) -> SegmentStream:
        n = len(prompt_ids)
        return cls(prompt_len=n, tokens=list(prompt_ids), mask=[0] * n, logprobs=[0.0] * n)

    def add_generation(
        self,
        token_ids: list[int],
        logprobs: list[float] | None,
        version: int | None,
        first_version: int | None = None,
        routed_experts: RoutedExperts | None = None,
        chunk_versions: Sequence[tuple[int, int | None]] = (),
    ) -> None:
        """``version`` sampled the turn's last token; ``first_version``, when another, its
        first (the weights changed mid-turn): recorded as a span ending at the first token,
        so any output holding the turn counts both in its min/max policy version.

        ``chunk_versions``: ``(end, version)`` of each chunk logged while the turn was in
        flight (``end``: the turn's tokens through the chunk). A chunk sampled by another
        version than the turn's last token (a turn resumed after a crash, the weights
        changed in between) is recorded as a span ending at its last token; chunks of the
        turn's own version add nothing, so a chunked turn folds as an unchunked one."""
        self.versions += _mid_turn_versions(
            len(self.tokens), len(token_ids), version, first_version, chunk_versions
        )
        self.tokens.extend(token_ids)
        self.mask.extend([1] * len(token_ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(token_ids))
        self.versions.append((len(self.tokens), version))
        if routed_experts is not None:
            self.routed.append((len(self.tokens), routed_experts))

    def add_observation(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self.mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))


def generation_versions(
    policy_version: int | None, extra_fields: dict[str, Any]
) -> tuple[int | None, int | None]:
    """``(first, last)`` policy version of one logged generation: ``last`` is the event's
    ``policy_version``; ``first`` is verl's ``min_global_steps`` of the turn when the engine
    reported spans (None otherwise: the turn had one version)."""
    return as_policy_version(extra_fields.get("min_global_steps")), policy_version


def turn_version(extra_fields: dict[str, Any]) -> int | None:
    """The version that sampled a turn's last token, from a TokenOutput's extra_fields:
    verl's ``max_global_steps``, else ``global_steps``, else the engine's ``weight_version``."""
    for key in ("max_global_steps", "global_steps", "weight_version"):
        if extra_fields.get(key) is not None:
            return as_policy_version(extra_fields[key])
    return None


class FoldSegment(_SpanLookups):
    """A ``SegmentStream`` as the replay buffer's fold keeps it: the tokens (and logprobs) as
    the chunks the events held (numpy arrays from the wire decoder, lists from pydantic's),
    not extended into Python lists per token. ``tokens``, ``mask`` and ``logprobs`` are the
    lists ``SegmentStream`` holds, made on first use (then kept, and extended as there);
    ``arrays()`` is the same three as numpy, concatenated once, for the columnar build."""

    def __init__(self, prompt_ids: list[int] | np.ndarray):
        self.prompt_len = len(prompt_ids)
        self.versions: list[tuple[int, int | None]] = []
        self.routed: list[tuple[int, RoutedExperts]] = []
        self.length = self.prompt_len
        self.list_logprobs = False  # a chunk's logprobs came as a list (not float32 arrays)
        # (token ids, logprobs or None: zeros, mask value)
        self._chunks: list[tuple[Any, Any, int]] | None = [(prompt_ids, None, 0)]
        self._lists: tuple[list[int], list[int], list[float]] | None = None
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add_generation(
        self,
        token_ids: Any,
        logprobs: Any,
        version: int | None,
        first_version: int | None = None,
        routed_experts: RoutedExperts | None = None,
        chunk_versions: Sequence[tuple[int, int | None]] = (),
    ) -> None:
        """``SegmentStream.add_generation``; ``token_ids`` and ``logprobs`` may be numpy."""
        self.versions += _mid_turn_versions(
            self.length, len(token_ids), version, first_version, chunk_versions
        )
        if isinstance(logprobs, list):
            self.list_logprobs = True
        self._add(token_ids, logprobs, 1)
        self.versions.append((self.length, version))
        if routed_experts is not None:
            self.routed.append((self.length, routed_experts))

    def add_observation(self, token_ids: Any) -> None:
        self._add(token_ids, None, 0)

    def _add(self, token_ids: Any, logprobs: Any, mask: int) -> None:
        n = len(token_ids)
        self.length += n
        self._arrays = None
        if self._lists is not None:
            _extend(self._lists, (token_ids, logprobs, mask))
        else:
            assert self._chunks is not None
            self._chunks.append((token_ids, logprobs, mask))

    def _materialised(self) -> tuple[list[int], list[int], list[float]]:
        if self._lists is None:
            lists: tuple[list[int], list[int], list[float]] = ([], [], [])
            for chunk in self._chunks or ():
                _extend(lists, chunk)
            self._lists, self._chunks = lists, None
        return self._lists

    @property
    def tokens(self) -> list[int]:
        return self._materialised()[0]

    @property
    def mask(self) -> list[int]:
        return self._materialised()[1]

    @property
    def logprobs(self) -> list[float]:
        return self._materialised()[2]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32, mask int8, logprobs float32) as numpy, made once."""
        if self._arrays is None:
            self._arrays = _segment_arrays(self)
        return self._arrays


def _extend(lists: tuple[list[int], list[int], list[float]], chunk: tuple[Any, Any, int]) -> None:
    """Extend (tokens, mask, logprobs) by one chunk, as ``SegmentStream`` extends its lists."""
    ids, logprobs, mask = chunk
    n = len(ids)
    lists[0].extend(_as_list(ids))
    lists[1].extend([mask] * n)
    lists[2].extend(_as_list(logprobs) if logprobs is not None else [0.0] * n)


def _as_list(values: Any) -> list[Any]:
    return values if isinstance(values, list) else values.tolist()


def _segment_arrays(seg: FoldSegment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if seg._chunks is None:
        return _from_lists(seg)
    chunks = seg._chunks
    ids = [c[0] if isinstance(c[0], np.ndarray) else np.array(c[0], np.int32) for c in chunks]
    tokens = (np.concatenate(ids) if len(ids) > 1 else ids[0]).astype(np.int32, copy=False)
    mask = np.zeros(len(tokens), np.int8)
    logprobs = np.zeros(len(tokens), np.float32)
    at = 0
    for (_, chunk_lps, chunk_mask), part in zip(chunks, ids, strict=True):
        end = at + len(part)
        if chunk_mask:
            mask[at:end] = chunk_mask
        if chunk_lps is not None:
            if isinstance(chunk_lps, list):
                chunk_lps = _float32(chunk_lps)
            if len(chunk_lps) != end - at:
                # logprobs of another length than their tokens shift what follows, as
                # ``SegmentStream``'s extended lists do: made from those lists
                return _from_lists(seg)
            logprobs[at:end] = chunk_lps
        at = end
    return tokens, mask, logprobs


def _from_lists(seg: FoldSegment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens, masks, lps = seg._materialised()
    return np.array(tokens, np.int32), np.frombuffer(bytes(masks), np.int8), _float32(lps)


def _float32(values: list[float]) -> np.ndarray:
    flat = array.array("f")
    flat.fromlist(values)  # a float beyond float32: inf, as in arrow_layout
    return np.frombuffer(flat, np.float32)
