"""One token stream as the turn log describes it: a prompt, then sampled and observed tokens.

Shared by the session recorder (which checks each new prompt against what it logged) and the
session fold (which rebuilds the stream from the log), so both sides agree on masks,
logprobs and policy versions by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SegmentStream:
    """One token stream: its prompt, then generations (mask 1) and observations (mask 0)."""

    prompt_len: int
    tokens: list[int]
    mask: list[int] = field(default_factory=list)  # aligned to tokens; prompt positions 0
    logprobs: list[float] = field(default_factory=list)  # aligned to tokens; 0.0 off-policy
    versions: list[tuple[int, int | None]] = field(default_factory=list)  # (end, version)

    @classmethod
    def start(cls, prompt_ids: list[int]) -> SegmentStream:
        n = len(prompt_ids)
        return cls(prompt_len=n, tokens=list(prompt_ids), mask=[0] * n, logprobs=[0.0] * n)

    def add_generation(
        self, token_ids: list[int], logprobs: list[float] | None, version: int | None
    ) -> None:
        self.tokens.extend(token_ids)
        self.mask.extend([1] * len(token_ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(token_ids))
        self.versions.append((len(self.tokens), version))

    def add_observation(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self.mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))

    def versions_until(self, end: int) -> list[int]:
        return [v for stop, v in self.versions if v is not None and stop - 1 < end]
