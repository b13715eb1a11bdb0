"""One token stream as the turn log describes it: a prompt, then sampled and observed tokens.

Shared by the session recorder (which checks each new prompt against what it logged) and the
session fold (which rebuilds the stream from the log), so both sides agree on masks,
logprobs and policy versions by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutbus.schemas.control import as_policy_version
from rolloutbus.schemas.routed_experts import RoutedExperts


@dataclass
class SegmentStream:
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
        if first_version is not None and first_version != version and token_ids:
            self.versions.append((len(self.tokens) + 1, first_version))
        for end, chunk_version in chunk_versions:
            if chunk_version is not None and chunk_version != version and 0 < end <= len(token_ids):
                self.versions.append((len(self.tokens) + end, chunk_version))
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
