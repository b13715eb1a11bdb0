"""Stop sequences (Anthropic's ``stop_sequences``, OpenAI's ``stop``), found by the gateway
as the replica streams a turn, as vLLM finds them.

The engines stop on token ids only, so the gateway reads the text of each token as it
comes: the turn ends at the token that completes a stop string. That token and the ones
before it are the turn, logged as sampled (mask 1, their logprobs); the rest of the
replica's stream is dropped and the request cut, which aborts it on the replica (the
embedded replica and vLLM both abort a request whose client hangs up). The reply's text
ends before the stop string (``cut_at_stop``); the matched string is kept in the logged
generation's ``extra_fields["stop_sequence"]``, so a retry answered from the log, a
restarted gateway and the next request's alignment all build the same reply from the
logged turn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STOP_FIELD", "StopMatchedError", "StopWatch", "cut_at_stop", "partial_stop_end"]

STOP_FIELD = "stop_sequence"  # the generation's extra_fields key holding the matched stop
# tokens per character at most: a byte-level tokenizer spells a character in up to 4 tokens
_TOKENS_PER_CHAR = 4


class StopMatchedError(Exception):
    """Raised from a streamed turn's token sink to end the replica's stream: a stop string
    was sampled (caught by the gateway's streaming client; never an API error)."""


class StopWatch:
    """Finds the first token of a turn that completes one of ``stops``."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self._tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        # tokens: a window that holds the longest stop whole, even spelled byte by byte,
        # and one more token in case the window starts inside a character
        self._window = _TOKENS_PER_CHAR * max((len(s) for s in self.stops), default=0) + 1
        self._tokens: list[int] = []
        self.matched: str | None = None

    def scan(self, token_ids: list[int]) -> int | None:
        """How many of ``token_ids`` (the turn's next tokens) to keep when one completes a
        stop string (``matched`` then says which); None when none does."""
        for index, token in enumerate(token_ids):
            self._tokens.append(token)
            tail = self._tokenizer.decode(self._tokens[-self._window :], skip_special_tokens=False)
            found = [(tail.find(s), s) for s in self.stops if s in tail]
            if found:
                self.matched = min(found)[1]  # the one that starts first
                return index + 1
        return None


def cut_at_stop(text: str, stop: str | None) -> str:
    """The reply's text before the stop string it ended with (the whole text without one)."""
    if not stop:
        return text
    at = text.find(stop)
    return text if at < 0 else text[:at].rstrip()


def partial_stop_end(text: str, stops: list[str]) -> str:
    """``text`` cut at the first stop string in it, or without an end that may be the start
    of one: what a streamed reply may show before the turn ends."""
    found = [at for at in (text.find(s) for s in stops if s) if at >= 0]
    if found:
        return text[: min(found)]
    for size in range(min(max((len(s) for s in stops), default=1) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-size:]) for s in stops if s):
            return text[:-size]
    return text
