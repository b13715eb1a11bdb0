"""``FoldSegment`` (the fold's segment: the events' chunks kept, numpy or lists) holds what
``SegmentStream`` (the recorder's and the gateway's, Python lists) holds, in lists when
read as lists and in numpy for the columnar build."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutbus.streams.token_stream import FoldSegment, SegmentStream

token = st.integers(-(2**31), 2**31 - 1)
logprob = st.floats(-30.0, 0.0, width=32)


@st.composite
def steps(draw: Any) -> list[tuple[str, list[int], list[float] | None, bool]]:
    """(kind, tokens, logprobs, as numpy) per step of one segment."""
    out = []
    for _ in range(draw(st.integers(0, 6))):
        tokens = draw(st.lists(token, max_size=20))
        kind = draw(st.sampled_from(["generation", "observation"]))
        lp = None
        if kind == "generation" and draw(st.booleans()):
            lp = draw(st.lists(logprob, min_size=len(tokens), max_size=len(tokens)))
        out.append((kind, tokens, lp, draw(st.booleans())))
    return out


def _fold(seg: Any, prompt: list[int], plan: list[Any], numpy: bool, read_at: int) -> Any:
    for i, (kind, tokens, lp, as_numpy) in enumerate(plan):
        if i == read_at:
            assert seg.tokens is not None  # materialised midway: later steps extend the lists
        ids: Any = np.array(tokens, np.int32) if numpy and as_numpy else tokens
        lps: Any = lp
        if lp is not None and numpy and as_numpy:
            lps = np.array(lp, np.float32)
        if kind == "observation":
            seg.add_observation(ids)
        else:
            seg.add_generation(ids, lps, i, i - 1 if i % 3 == 0 else None)
    return seg


@settings(max_examples=300, deadline=None)
@given(st.lists(token, max_size=10), steps(), st.integers(-1, 6))
def test_a_fold_segment_holds_what_a_segment_stream_holds(
    prompt: list[int], plan: list[Any], read_at: int
) -> None:
    lists = _fold(SegmentStream.start(prompt), prompt, plan, numpy=False, read_at=-1)
    fast = _fold(FoldSegment(prompt), prompt, plan, numpy=True, read_at=read_at)
    tokens, mask, logprobs = fast.arrays()
    assert tokens.tolist() == lists.tokens and mask.tolist() == lists.mask
    assert logprobs.tolist() == np.array(lists.logprobs, np.float32).tolist()
    assert fast.length == len(lists.tokens) and fast.prompt_len == lists.prompt_len
    assert fast.versions == lists.versions
    assert fast.tokens == lists.tokens and fast.mask == lists.mask
    assert fast.logprobs == lists.logprobs
    for end in range(len(lists.tokens) + 1):
        assert fast.versions_until(end) == lists.versions_until(end)
    fast.add_observation(np.array([5, 6], np.int32))  # after the lists are made: extended
    lists.add_observation([5, 6])
    assert (fast.tokens, fast.mask, fast.logprobs) == (lists.tokens, lists.mask, lists.logprobs)
    assert fast.arrays()[0].tolist() == lists.tokens
