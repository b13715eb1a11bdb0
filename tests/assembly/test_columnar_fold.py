"""The columnar build of a group's records writes the bytes the pydantic build writes
(issue 28 item 2): random turn logs, folded from their wire bytes, through both paths."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus, record_bytes_bound
from rolloutbus.schemas.turns import (
    Generation,
    GenerationChunk,
    GroupSettings,
    Observation,
    OutputSummary,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly import trajectories
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.release_metrics import observe_release
from rolloutbus.streams.assembly.trajectories import finalize_group
from tests.builders import make_group_started, numbered, session_ids
from tests.synthetic import make_events

TOKEN_FIELDS = ("prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores")

ROLLOUT = RolloutConfig(prompt_length=48, response_length=64)
token = st.integers(-(2**31), 2**31 - 1)
logprob = st.one_of(
    st.floats(-30.0, 0.0, width=32), st.just(0.0), st.just(-0.5), st.just(float("-inf"))
)


@st.composite
def turns_of_segment(draw: Any, max_turns: int) -> list[tuple[str, list[int], Any]]:
    """(kind, tokens, extra) per turn: ``generation`` (extra: logprobs or None, chunked,
    versions) or ``observation``."""
    out = []
    for _ in range(draw(st.integers(0, max_turns))):
        tokens = draw(st.lists(token, max_size=draw(st.sampled_from([3, 12, 40]))))
        if draw(st.booleans()) or not out:
            lp = draw(st.none() | st.lists(logprob, min_size=len(tokens), max_size=len(tokens)))
            out.append(("generation", tokens, (lp, draw(st.integers(0, 3)), draw(_versions))))
        else:
            out.append(("observation", tokens, None))
    return out


_versions = st.tuples(st.none() | st.integers(0, 5), st.none() | st.integers(0, 5))


@st.composite
def session_log(draw: Any, uid: str, sid: int) -> list[Any]:
    ids = session_ids(uid, sid, draw(st.sampled_from(["a", "b7"])))
    events: list[Any] = [SessionStarted(**ids, agent_name=draw(st.none() | st.just("tool_agent")))]
    lengths = []
    for segment in range(draw(st.integers(1, 2))):
        prompt = draw(st.lists(token, min_size=0, max_size=draw(st.sampled_from([4, 50]))))
        events.append(SegmentStarted(**ids, segment=segment, prompt_ids=prompt))
        total = len(prompt)
        for turn, (kind, tokens, extra) in enumerate(draw(turns_of_segment(5))):
            total += len(tokens)
            where = {**ids, "segment": segment, "turn": turn}
            if kind == "observation":
                events.append(Observation(**where, token_ids=tokens))
                continue
            lp, chunks, (first, last) = extra
            events += _chunks(where, tokens, chunks, last)
            fields = {} if first is None else {"extra_fields": {"min_global_steps": first}}
            events.append(
                Generation(**where, token_ids=tokens, logprobs=lp, policy_version=last, **fields)
            )
        lengths.append((len(prompt), total))
    if draw(st.integers(0, 9)) == 0:
        events.append(SessionFailed(**ids, error="tool timed out", failure_class="loop"))
        return numbered(events)
    outputs = [draw(_output(lengths)) for _ in range(draw(st.integers(1, 2)))]
    events.append(SessionFinished(**ids, outputs=outputs))
    return numbered(events)


def _chunks(where: dict[str, Any], tokens: list[int], count: int, last: Any) -> list[Any]:
    out, step = [], max(1, len(tokens) // max(1, count))
    for index, start in enumerate(range(0, len(tokens) if count else 0, step)):
        version = None if last is None else last - index % 2
        out.append(
            GenerationChunk(
                **where, index=index, start=start, token_ids=tokens[start : start + step],
                policy_version=version,
            )
        )  # fmt: skip
    return out


@st.composite
def _output(draw: Any, lengths: list[tuple[int, int]]) -> OutputSummary:
    segment = draw(st.integers(0, len(lengths) - 1))
    prompt_len, total = lengths[segment]
    response_len = draw(st.integers(0, total - prompt_len + draw(st.sampled_from([0, 0, 0, 2]))))
    override = None
    if draw(st.integers(0, 9)) == 0:
        override = draw(st.lists(st.integers(0, 1), min_size=response_len, max_size=response_len))
    return OutputSummary(
        segment=segment,
        prompt_len=prompt_len,
        response_len=response_len,
        mask_override=override,
        has_logprobs=draw(st.booleans()),
        reward_score=draw(st.none() | st.floats(-2.0, 2.0) | st.just(1e39)),
        num_turns=draw(st.integers(0, 6)),
        extra_fields=draw(st.sampled_from([{}, {"reward_extra_info": {"acc": 1.0}}])),
    )


@st.composite
def turn_log(draw: Any) -> list[bytes]:
    """Wire bytes of a few groups, each with its sessions' events interleaved."""
    log = []
    for g in range(draw(st.integers(1, 3))):
        uid, n = f"g{g}", draw(st.integers(1, 3))
        settings_ = draw(st.none() | st.just(GroupSettings(prompt_length=40, response_length=30)))
        row = draw(st.sampled_from([None, {"prompt": [{"role": "user", "content": "hi"}]}]))
        log.append(make_group_started(uid, n, row=row, settings=settings_))
        streams = [draw(session_log(uid, sid)) for sid in range(n)]
        order = draw(st.permutations([i for i, s in enumerate(streams) for _ in s]))
        cursors = [0] * n
        for i in order:
            log.append(streams[i][cursors[i]])
            cursors[i] += 1
    return [encode_turn_event(event) for event in log]


def _released(wire: list[bytes]) -> list[Any]:
    fold, out = PartitionFold(0), []
    for offset, value in enumerate(wire):
        out += fold.fold(offset, decode_turn_event(value))
    return out


COLUMNAR_GROUPS = {"taken": 0, "left": 0}  # which path the generated groups took


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn_log(), st.sampled_from([None, 4000, 6500, 7000, 1 << 20]))  # near a record's size
def test_columnar_records_are_byte_identical(wire: list[bytes], record_limit: int | None) -> None:
    for released in _released(wire):
        old = finalize_group(released, ROLLOUT, max_record_bytes=record_limit, columnar=False)
        new = finalize_group(released, ROLLOUT, max_record_bytes=record_limit, columnar=True)
        taken = trajectories._columnar(released, ROLLOUT, record_limit) is not None
        COLUMNAR_GROUPS["taken" if taken else "left"] += 1
        assert new.records == old.records
        assert new.trajectories == old.trajectories
        assert new.letters == old.letters
        assert new.batch.equals(old.batch)
        lean = finalize_group(released, ROLLOUT, max_record_bytes=record_limit, token_lists=False)
        assert lean.records == old.records and lean.letters == old.letters
        assert [_without_token_lists(t) for t in old.trajectories] == [
            _without_token_lists(t) for t in lean.trajectories
        ]
        # no records asked for (replay --out): the same rows, the same failures for size
        bare = finalize_group(
            released, ROLLOUT, max_record_bytes=record_limit, token_lists=False, records=False
        )
        assert bare.records == [] and bare.letters == old.letters
        assert bare.batch.equals(old.batch)
        assert [t.status for t in bare.trajectories] == [t.status for t in old.trajectories]
        if old.records:
            assert max(map(len, old.records)) <= record_bytes_bound(old.batch)


def _without_token_lists(t: Trajectory) -> Trajectory:
    """``t`` with its token lists emptied, as ``token_lists=False`` returns a columnar
    group's trajectories (a null list stays null)."""
    return t.model_copy(update={name: [] for name in TOKEN_FIELDS if getattr(t, name) is not None})


def test_the_random_logs_take_both_paths() -> None:
    """The property above compared columnar groups, not only fallbacks."""
    if COLUMNAR_GROUPS["taken"] + COLUMNAR_GROUPS["left"] == 0:
        test_columnar_records_are_byte_identical()
    assert COLUMNAR_GROUPS["taken"] > 50 and COLUMNAR_GROUPS["left"] > 20, COLUMNAR_GROUPS


def test_records_not_asked_for_are_still_checked_against_the_limit() -> None:
    """``records=False`` (``replay --out``): under a limit below the group's bound, each row
    is encoded to check that it fits; a row over the limit is failed, as with records."""
    (released,) = _released([value for _, _, value in make_events(1, 128)])
    full = finalize_group(released, ROLLOUT)
    keys = max(len(t.key) for t in full.trajectories)
    largest = max(len(r) for r in full.records) + keys  # the longest record with its key
    assert largest < record_bytes_bound(full.batch) + keys  # four rows: the bound is loose
    for limit, any_failed in ((largest, False), (largest - 1, True)):
        listed = finalize_group(released, ROLLOUT, max_record_bytes=limit)
        bare = finalize_group(released, ROLLOUT, max_record_bytes=limit, records=False)
        assert bare.records == [] and bare.letters == listed.letters
        assert bare.batch.equals(listed.batch)
        statuses = [t.status for t in bare.trajectories]
        assert (TrajectoryStatus.FAILED in statuses) == any_failed, statuses
        assert statuses == [t.status for t in listed.trajectories]


def test_a_large_group_at_128_tokens_per_turn() -> None:
    rng = np.random.default_rng(7)
    events: list[Any] = [make_group_started("big", 4)]
    for sid in range(4):
        ids = session_ids("big", sid)
        session: list[Any] = [SessionStarted(**ids, agent_name="a")]
        session.append(SegmentStarted(**ids, segment=0, prompt_ids=[1, 2, 3]))
        for turn in range(8):
            tokens = rng.integers(0, 150_000, 128).tolist()
            lp = rng.uniform(-5, 0, 128).astype(np.float32).tolist()
            where = {**ids, "segment": 0, "turn": turn}
            session.append(Generation(**where, token_ids=tokens, logprobs=lp, policy_version=3))
            session.append(Observation(**where, token_ids=[7] * 5))
        summary = OutputSummary(segment=0, prompt_len=3, response_len=8 * 133, reward_score=1.0)
        session.append(SessionFinished(**ids, outputs=[summary]))
        events += numbered(session)
    rollout = RolloutConfig(prompt_length=8, response_length=2048)
    [released] = _released([encode_turn_event(e) for e in events])
    new = trajectories._columnar(released, rollout, None)
    assert new is not None
    assert new.records == finalize_group(released, rollout, columnar=False).records


def test_trajectories_without_token_lists_give_the_same_release_figures() -> None:
    """The replay buffer observes its releases from trajectories without token lists and
    the batch's lengths (``ReleaseRecords.group``): the Prometheus figures are those of the
    full trajectories."""
    rollout = RolloutConfig()
    fold, registries = PartitionFold(0), (CollectorRegistry(), CollectorRegistry())
    released = []
    for offset, (_, _, value) in enumerate(make_events(6, 40)):
        released += fold.fold(offset, decode_turn_event(value))
    assert len(released) == 6
    for group in released:
        full = finalize_group(group, rollout)
        lean = finalize_group(group, rollout, token_lists=False)
        assert lean.records == full.records
        assert all(t.responses == [] for t in lean.trajectories)
        lengths = lean.batch.column("response_len").to_pylist()
        observe_release(group, full.trajectories, rollout, registries[0])
        observe_release(group, lean.trajectories, rollout, registries[1], response_lens=lengths)
    figures = [_release_figures(r) for r in registries]
    tokens = [
        v
        for k, v in figures[0].items()
        if k.startswith("rolloutbus_rollout_response_length_tokens_sum")
    ]
    assert tokens and min(tokens) > 0
    assert figures[0] == figures[1]


def _release_figures(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample but the group latency's (it reads the clock)."""
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
        if "latency" not in sample.name
    }
