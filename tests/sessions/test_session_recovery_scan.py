"""The session worker's turn-log scan: which groups started and did not finish (pure)."""

from __future__ import annotations

from rolloutbus.schemas.turns import (
    Generation,
    SegmentStarted,
    SessionFinished,
)
from rolloutbus.streams.sessions.recovery import TurnLogScan
from tests.builders import (
    make_group_started,
    make_session_failed,
    make_session_started,
    session_ids,
)


def _scan(events) -> TurnLogScan:
    scan = TurnLogScan()
    for offset, event in enumerate(events):
        scan.apply(offset, event)
    return scan


def test_finished_groups_are_dropped_and_unfinished_sessions_listed():
    events = [
        make_group_started("g1", 2),
        make_group_started("g2", 2),
        make_session_started("g1", 0, agent_name="a"),
        SessionFinished(**session_ids("g1", 0), outputs=[], seq=1),
        make_session_started("g1", 1, agent_name="a"),
        make_session_failed("g1", 1, seq=1),
        make_session_started("g2", 0, agent_name="a"),
        SegmentStarted(**session_ids("g2", 0), segment=0, prompt_ids=[1, 2], seq=1),
        Generation(**session_ids("g2", 0), segment=0, turn=0, token_ids=[3], seq=2),
    ]
    scan = _scan(events)
    [unfinished] = scan.unfinished()
    assert unfinished.group.uid == "g2" and unfinished.first_offset == 1
    assert set(unfinished.sessions) == {0, 1}
    assert unfinished.sessions[1] is None  # never started: runs from scratch
    attempt = unfinished.sessions[0]
    assert attempt is not None
    assert [e.type for e in attempt.events] == ["segment_started", "generation"]
    assert attempt.next_seq == 3
    assert scan.started_uids == {"g1", "g2"}


def test_duplicate_writes_are_folded_once():
    gen = Generation(**session_ids("g", 0), segment=0, turn=0, token_ids=[3], seq=2)
    events = [
        make_group_started("g", 1),
        make_session_started("g", 0, agent_name="a"),
        SegmentStarted(**session_ids("g", 0), segment=0, prompt_ids=[1], seq=1),
        gen,
        gen,  # a producer retry wrote the generation twice
    ]
    [unfinished] = _scan(events).unfinished()
    attempt = unfinished.sessions[0]
    assert attempt is not None and [e.seq for e in attempt.events] == [1, 2]


def test_the_latest_started_attempt_is_the_one_to_resume():
    events = [
        make_group_started("g", 1),
        make_session_started("g", 0, attempt="old", agent_name="a"),
        SegmentStarted(**session_ids("g", 0, "old"), segment=0, prompt_ids=[1], seq=1),
        make_session_started("g", 0, attempt="new", agent_name="a"),  # superseded "old"
        SegmentStarted(**session_ids("g", 0, "new"), segment=0, prompt_ids=[1], seq=1),
        Generation(**session_ids("g", 0, "old"), segment=0, turn=0, token_ids=[9], seq=2),  # zombie
    ]
    [unfinished] = _scan(events).unfinished()
    attempt = unfinished.sessions[0]
    assert attempt is not None and attempt.attempt == "new"
    assert [e.type for e in attempt.events] == ["segment_started"]


def test_events_of_a_group_started_before_the_scan_are_not_a_group():
    events = [make_session_started("early", 0, agent_name="a")]
    assert _scan(events).unfinished() == []
