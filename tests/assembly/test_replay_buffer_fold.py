"""Pure tests of the replay buffer's fold: duplicates by seq, bad logs as failed records,
deadlines in log time, memory bounds, and the released-groups record (no broker)."""

from __future__ import annotations

import logging

import pytest

from rolloutbus.config import Config, RolloutConfig, load_config
from rolloutbus.errors import ConfigError, SchemaError
from rolloutbus.kafka.admin import topic_configs
from rolloutbus.schemas.trajectories import TrajectoryStatus
from rolloutbus.schemas.turns import (
    Generation,
    GroupSettings,
    OutputSummary,
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly import invariants
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.released import ReleasedRecord
from rolloutbus.streams.assembly.replay_buffer import default_transactional_id
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import finalize_group
from rolloutbus.topics import Topics, parse_trajectory_key, uid_of_key
from tests.builders import make_group_started, make_session_failed, make_turns, session_ids

ROLLOUT = RolloutConfig(prompt_length=64, response_length=64)


def _fold_all(fold: PartitionFold, events: list, start: int = 0) -> list:
    out = []
    for offset, event in enumerate(events, start=start):
        out.extend(fold.fold(offset, event))
    return out


def _records(released: list) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for group in released:
        done = finalize_group(group, ROLLOUT)
        out.update(zip((t.key for t in done.trajectories), done.records, strict=True))
    return out


# --- 1. duplicates are folded once ---------------------------------------------------------


def test_duplicated_generation_is_folded_once():
    started, segment, first, second, finished = make_turns("g", 0, [[1, 2], [3, 4]])
    fold = SessionFold(0, "a")
    for event in [started, segment, first, first, second, second, finished]:
        fold.apply(event)
    assert fold.segments[0].tokens == [9, 1, 2, 3, 4] and fold.ignored == 2
    [t] = finalize_group(
        _released_one(
            [make_group_started("g", 1), started, started, segment, first, first, second, finished]
        ),
        ROLLOUT,
    ).trajectories
    assert t.responses == [1, 2, 3, 4]  # not [1, 2, 1, 2] released as completed
    assert t.status == TrajectoryStatus.COMPLETED


def _released_one(events: list):
    [released] = _fold_all(PartitionFold(0), events)
    return released


def test_duplicate_group_started_and_terminal_events_do_not_confuse_the_partition_fold():
    fold = PartitionFold(0)
    s0, s1 = make_turns("g", 0, [[1]]), make_turns("g", 1, [[2]])
    events = [
        make_group_started("g", 2),
        make_group_started("g", 2),
        *s0,
        s0[-1],
        *s1[:-1],
        # a session id outside 0..n-1 settling must not complete the group
        *make_turns("g", 5, [[7]]),
    ]
    assert _fold_all(fold, events) == []
    assert "g" in fold.open
    [released] = fold.fold(len(events), s1[-1])
    assert [s.session_id for s in released.sessions] == [0, 1]
    # every later duplicate of the released group is ignored; nothing reopens it
    assert _fold_all(fold, [make_group_started("g", 2), s1[-1], s0[-1]], start=100) == []
    assert fold.open == {} and fold.low_watermark() == 103


def test_event_after_a_gap_waits_for_the_rewritten_events():
    started, segment, first, second, finished = make_turns("g", 0, [[1, 2], [3, 4]])
    stale = second.model_copy(update={"token_ids": [8, 8]})  # seq 3, written before a crash
    fold = SessionFold(0, "a")
    for event in [started, segment, stale, first, second, finished]:
        fold.apply(event)
    assert fold.error is None and fold.segments[0].tokens == [9, 1, 2, 3, 4]


def test_finished_after_a_gap_fails_the_session_but_a_failure_keeps_its_own_error():
    started, segment, first, _, finished = make_turns("g", 0, [[1, 2], [3, 4]])
    fold = SessionFold(0, "a")
    for event in [started, segment, first, finished]:  # the second generation is missing
        fold.apply(event)
    assert fold.failed and "seq 3..3" in fold.error
    failed = make_session_failed("g", 1, error="tool timed out", seq=5)
    fold = SessionFold(1, "a")
    for event in [started.model_copy(update={"session_id": 1}), failed]:
        fold.apply(event)
    assert fold.error is None and fold.terminal.error == "tool timed out"


def test_a_log_without_seq_numbers_still_folds():
    events = [e.model_copy(update={"seq": 0}) for e in make_turns("g", 0, [[1, 2], [3, 4]])]
    [t] = finalize_group(_released_one([make_group_started("g", 1), *events]), ROLLOUT).trajectories
    assert t.responses == [1, 2, 3, 4] and t.status == TrajectoryStatus.COMPLETED


# --- 5. poison never raises: failed records and dead letters ---------------------------------


def test_generation_before_its_segment_is_a_failed_record_not_an_exception():
    ids = session_ids("g")
    orphan = Generation(**ids, segment=0, turn=0, token_ids=[1], seq=0)  # head not in the log
    finished = SessionFinished(
        **ids, outputs=[OutputSummary(segment=0, prompt_len=0, response_len=1)], seq=1
    )
    done = finalize_group(_released_one([make_group_started("g", 1), orphan, finished]), ROLLOUT)
    [t] = done.trajectories
    assert t.status == TrajectoryStatus.FAILED and "segment_started" in t.error
    assert [letter.key for letter in done.letters] == ["g_0_0"]


def test_row_with_a_string_prompt_releases_failed_records_and_a_dead_letter():
    events = [
        make_group_started("g", 2, row={"prompt": "a string prompt"}),
        *make_turns("g", 0, [[1]]),
        make_session_failed("g", 1),
    ]
    done = finalize_group(_released_one(events), ROLLOUT)
    assert [t.key for t in done.trajectories] == ["g_0_0", "g_1_0"]
    assert all(
        t.status == TrajectoryStatus.FAILED and "row cannot be carried" in t.error
        for t in done.trajectories
    )
    assert all(t.group_size == 2 and t.raw_prompt == [] for t in done.trajectories)
    assert len(done.records) == 2
    [letter] = done.letters
    assert (
        letter.key == "g" and "row.prompt must be a list of chat messages, got str" in letter.reason
    )


def test_output_naming_tokens_never_logged_fails_only_its_session():
    bad = make_turns("g", 1, [[2]])
    bad[-1] = bad[-1].model_copy(
        update={"outputs": [OutputSummary(segment=0, prompt_len=1, response_len=50)]}
    )
    done = finalize_group(
        _released_one([make_group_started("g", 2), *make_turns("g", 0, [[1]]), *bad]), ROLLOUT
    )
    assert [t.status for t in done.trajectories] == [
        TrajectoryStatus.COMPLETED,
        TrajectoryStatus.FAILED,
    ]
    assert "holds 2 tokens" in done.trajectories[1].error and len(done.letters) == 1


def test_a_record_over_the_topic_limit_is_a_failed_record_without_tokens():
    rollout = RolloutConfig(prompt_length=64, response_length=4096)
    events = [
        make_group_started("g", 1),
        *make_turns("g", 0, [list(range(2000))]),
    ]  # ~20 kB as Arrow
    done = finalize_group(_released_one(events), rollout, max_record_bytes=10_000)
    [t] = done.trajectories
    assert t.status == TrajectoryStatus.FAILED and "over 10000" in t.error and t.responses == []
    assert len(done.records[0]) < 10_000 and len(done.letters) == 1


def test_unusable_uid_is_refused_before_the_fold_changes():
    fold = PartitionFold(0)
    with pytest.raises(SchemaError, match="uid"):
        fold.fold(0, make_group_started("u" * 600, 1))
    assert fold.open == {} and fold.next_offset == 1


def test_uid_with_the_key_separator_is_released_and_keys_parse_back():
    done = finalize_group(
        _released_one([make_group_started("a_b", 1), *make_turns("a_b", 0, [[1]])]), ROLLOUT
    )
    [t] = done.trajectories
    assert t.key == "a_b_0_0" and t.uid == "a_b"
    assert parse_trajectory_key(t.key) == ("a_b", 0, 0) and uid_of_key(t.key) == "a_b"
    assert uid_of_key("abc_1_0") == "abc" and uid_of_key("not-a-key") == "not-a-key"


# --- 6. deadlines in log time ----------------------------------------------------------------


def test_group_past_the_deadline_is_released_with_unsettled_sessions_failed():
    limits = FoldLimits(group_deadline_s=10.0)
    old = [
        make_group_started("old", 2, ts=100.0),
        *make_turns("old", 0, [[1]], ts=101.0),
        *make_turns("old", 1, [[2]], ts=102.0)[:-1],
    ]  # session 1 never finishes
    later = [make_group_started("new", 1, ts=111.0)]  # 11 s after "old" opened
    fold = PartitionFold(0, limits=limits)
    assert _fold_all(fold, old) == []
    [released] = _fold_all(fold, later, start=len(old))
    assert released.kind == "deadline" and released.group.uid == "old"
    done = finalize_group(released, ROLLOUT)
    statuses = {t.key: t.status for t in done.trajectories}
    assert statuses == {"old_0_0": TrajectoryStatus.COMPLETED, "old_1_0": TrajectoryStatus.FAILED}
    assert "deadlines.group_s = 10 s" in done.trajectories[1].error
    assert done.trajectories[1].group_size == 2
    assert [letter.key for letter in done.letters] == ["old"]
    assert fold.open.keys() == {"new"} and fold.low_watermark() == len(old)


def test_deadline_decisions_are_the_same_from_the_watermark_as_from_the_start():
    """A restart folds from the low watermark with the released uids read back; the offline
    replay folds from offset 0: both release the same records, byte for byte."""
    limits = FoldLimits(group_deadline_s=10.0, max_open_groups=3)
    events = [
        make_group_started("a", 1, ts=0.0),
        *make_turns("a", 0, [[1]], ts=1.0),
        make_group_started("b", 2, ts=2.0),
        *make_turns("b", 0, [[2]], ts=3.0),  # b never completes
        make_group_started("c", 1, ts=50.0),  # releases b past its deadline
        *make_turns("c", 0, [[3]], ts=51.0),
        make_group_started("d", 1, ts=52.0),
        *make_turns("d", 0, [[4]], ts=53.0),
    ]
    whole = PartitionFold(0, limits=limits)
    from_start = _records(_fold_all(whole, events))
    # stop after "a" was released; a restart resumes at the watermark with "a" remembered
    first = PartitionFold(0, limits=limits)
    cut = 7
    before = _records(_fold_all(first, events[:cut]))
    resumed = PartitionFold(first.low_watermark(), released=first.released, limits=limits)
    after = _records(
        _fold_all(resumed, events[first.low_watermark() :], start=first.low_watermark())
    )
    assert {**before, **after} == from_start
    assert set(from_start) == {"a_0_0", "b_0_0", "b_1_0", "c_0_0", "d_0_0"}


def test_events_of_a_group_whose_head_is_gone_are_released_as_failed():
    limits = FoldLimits(group_deadline_s=10.0, max_n=4)
    headless = make_turns("lost", 1, [[1]], ts=5.0)[2:]  # generation and finished only
    fold = PartitionFold(0, limits=limits)
    assert fold.fold(0, headless[0]) == [] and fold.opened_headless == "lost"  # dead-lettered
    assert fold.fold(1, headless[1]) == [] and fold.opened_headless is None
    [released] = fold.fold(10, make_group_started("later", 1, ts=20.0))
    assert released.kind == "head_missing"
    done = finalize_group(released, ROLLOUT)
    [t] = done.trajectories
    assert t.key == "lost_1_0" and t.status == TrajectoryStatus.FAILED and t.group_size == 1
    assert "group_started of lost is not in the turn log" in t.error


# --- 9. memory bounds ------------------------------------------------------------------------


def test_too_many_open_groups_releases_the_oldest_as_failed():
    fold = PartitionFold(0, limits=FoldLimits(max_open_groups=2))
    assert _fold_all(fold, [make_group_started("a", 1), make_group_started("b", 1)]) == []
    [released] = fold.fold(2, make_group_started("c", 1))
    assert released.group.uid == "a" and released.kind == "too_many_open_groups"
    done = finalize_group(released, ROLLOUT)
    assert [t.status for t in done.trajectories] == [TrajectoryStatus.FAILED]
    assert "too many open groups" in done.trajectories[0].error
    assert len(done.letters) == 1 and "too many open groups" in done.letters[0].reason
    assert list(fold.open) == ["b", "c"]
    assert fold.fold(3, make_session_failed("a", error="late")) == []


def test_released_memory_keeps_the_newest_uids():
    fold = PartitionFold(0, released=["r1", "r2"], limits=FoldLimits(max_released=2))
    _fold_all(
        fold,
        [make_group_started("g", 1), make_session_failed("g")],
        start=10,
    )
    assert list(fold.released) == ["r2", "g"] and fold.forgotten == 1


def test_group_over_max_n_is_rejected_without_trajectories():
    fold = PartitionFold(0, limits=FoldLimits(max_n=4))
    [released] = fold.fold(0, make_group_started("big", 5000))
    done = finalize_group(released, ROLLOUT)
    assert (
        released.rejected
        and done.trajectories == []
        and "limits.max_n = 4" in done.letters[0].reason
    )
    assert fold.fold(1, make_session_failed("big")) == []


# --- config, topics, transactional ids -------------------------------------------------------


def test_limits_and_deadlines_come_from_the_config(tmp_path):
    cfg = Config()
    assert cfg.replay_buffer.transactional_id is None and cfg.deadlines.group_s == 3600.0
    limits = FoldLimits.from_config(cfg)
    assert (limits.group_deadline_s, limits.max_open_groups, limits.max_released, limits.max_n) == (
        3600.0,
        cfg.replay_buffer.max_open_groups,
        cfg.replay_buffer.max_released_uids,
        cfg.limits.max_n,
    )
    path = tmp_path / "c.yaml"
    path.write_text("replay_buffer: {rescan_lookback_s: 60}\n")
    with pytest.raises(ConfigError, match="rescan_lookback_s"):
        load_config(path)


def test_released_topic_is_compacted_and_outlives_the_turn_log():
    cfg = Config()
    released = topic_configs(cfg.kafka, Topics.from_config(cfg.kafka).released)
    assert released["cleanup.policy"] == "compact,delete"
    assert int(released["retention.ms"]) > cfg.kafka.retention_ms
    assert (
        topic_configs(cfg.kafka, Topics.from_config(cfg.kafka).turns)["cleanup.policy"] == "delete"
    )
    record = ReleasedRecord(uid="a_b", partition=1, trajectories=2, failed=1)
    assert ReleasedRecord.model_validate_json(record.encode()).uid == "a_b"


def test_every_process_gets_its_own_transactional_id():
    first, second = default_transactional_id("rb"), default_transactional_id("rb")
    assert first != second and first.startswith("rb-")


# --- the log decides a group's budgets, not the folding process's config ----------------------


def test_a_groups_recorded_budgets_decide_its_status_whatever_the_config_says():
    """A group logged with response_length 4 (four tokens: truncated) folds the same under a
    config with a shorter and with a longer response_length: the same records, byte for byte."""
    settings = GroupSettings(prompt_length=8, response_length=4)
    group = make_group_started("g", 1).model_copy(update={"settings": settings})
    events = [group, *make_turns("g", 0, [[1, 2], [3, 4]])]
    by_config = {}
    for length in (2, 4, 4096):
        done = finalize_group(_released_one(events), RolloutConfig(response_length=length))
        [t] = done.trajectories
        assert t.status == TrajectoryStatus.TRUNCATED, t.error
        by_config[length] = done.records
    assert by_config[2] == by_config[4] == by_config[4096]
    # over the recorded budget: failed, naming the recorded number, whatever the config says
    over = [group, *make_turns("g", 0, [[1, 2, 3], [4, 5]])]
    [t] = finalize_group(_released_one(over), RolloutConfig(response_length=4096)).trajectories
    assert t.status == TrajectoryStatus.FAILED and "over response_length 4" in (t.error or "")


def test_a_group_logged_without_settings_falls_back_to_the_config_with_one_warning(caplog):
    invariants._WARNED.clear()  # once per process: this test counts from zero
    old = [make_group_started("old1", 1), *make_turns("old1", 0, [[1, 2]])]
    older = [make_group_started("old2", 1), *make_turns("old2", 0, [[1, 2, 3]])]
    with caplog.at_level(logging.WARNING, logger=invariants.__name__):
        [short] = finalize_group(_released_one(old), RolloutConfig(response_length=2)).trajectories
        [long] = finalize_group(
            _released_one(older), RolloutConfig(response_length=99)
        ).trajectories
    assert short.status == TrajectoryStatus.TRUNCATED  # the config's 2
    assert long.status == TrajectoryStatus.COMPLETED  # the config's 99
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "logged before groups recorded their settings" in warned[0]


def test_group_settings_are_add_only_a_log_without_them_still_decodes():
    started = make_group_started("g", 2)
    written = encode_turn_event(started)
    assert b'"settings":null' in written
    legacy = written.replace(b',"settings":null', b"")  # as logged before the field existed
    assert decode_turn_event(legacy) == started
    recorded = started.model_copy(
        update={"settings": GroupSettings(prompt_length=3, response_length=5)}
    )
    assert decode_turn_event(encode_turn_event(recorded)).settings == recorded.settings
