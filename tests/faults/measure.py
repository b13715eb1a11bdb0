"""What a finished run left on the topics, as the numbers of its row.

- ``expected``: G x n sessions (one output each, so one trajectory key each);
- ``attempts``: session attempts started in the turn log (more than expected when
  sessions were resumed or run again);
- ``lost``: expected keys missing from rollout.trajectories (read_committed); the notes
  say where the first few stand in the turn log;
- ``duplicated``: keys on rollout.trajectories more than once;
- ``resumed``: resumed sessions (``session_started.resumed_from``) that replayed at least
  one logged generation, each replayed one equal to the logged one by engine_request_id
  and token ids: resumed without re-sampling;
- ``resampled``: turns sampled more than once, from the turn log: for each (uid,
  session, turn) the distinct engine request ids beyond the first (the LLM client draws a
  fresh engine request id per call, and a replayed turn keeps the logged one);
- ``failed``: trajectories released with status ``failed``;
- ``dead letters``: records on rollout.dlq;
- ``restarts``: processes the harness restarted after they exited, as a supervisor
  (systemd, Kubernetes) would;
- ``differ``: trajectories not equal, column for column, to the fault-free reference run;
- ``stall s``: per replay-buffer kill, the seconds from the SIGKILL until every partition
  released a group again (the latest of the partitions' first releases after the kill; a
  partition with no release after it does not count), by the ``released_at_ms`` of the
  records on the released-groups topic (set when the group is released, in the transaction
  that commits it: a record built before the kill died with the process); median over the
  kills.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from typing import Any

from rolloutbus.schemas.trajectories import decode_trajectory_batch
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.assembly.released import ReleasedRecord
from rolloutbus.topics import parse_trajectory_key
from tests.faults.processes import Pipeline
from tests.faults.scenario import FaultContext
from tests.faults.table import FaultRow
from tests.faults.workload import Workload
from tests.pipeline import read_topic

NOT_COMPARED = ("attempt",)  # random by design: see the package docstring
ERROR_CHARS = 200  # characters of a failed trajectory's error kept in a row's notes
LOST_EXPLAINED = 4  # lost keys whose place in the turn log a row's notes give


def measure_run(
    pipeline: Pipeline,
    workload: Workload,
    row: FaultRow,
    reference: dict[str, dict[str, Any]] | None,
    ctx: FaultContext,
) -> dict[str, dict[str, Any]]:
    """Fill ``row`` from the topics; returns the trajectories (key -> the first record's
    columns but ``attempt``)."""
    cfg, topics = pipeline.cfg, pipeline.topics
    records = read_topic(cfg, topics.trajectories)
    keys = Counter((m.key() or b"").decode() for m in records)
    trajectories: dict[str, dict[str, Any]] = {}
    for msg in records:
        trajectories.setdefault((msg.key() or b"").decode(), _columns(msg.value()))
    expected = workload.expected_keys()
    lost = expected - set(keys)
    row.lost = len(lost)
    row.duplicated = sum(1 for count in keys.values() if count > 1)
    unexpected = set(keys) - expected
    if unexpected:
        row.notes.append(f"{len(unexpected)} unexpected keys, e.g. {sorted(unexpected)[:3]}")
    _count_failed(trajectories, row)
    row.dead_letters = len(read_topic(cfg, topics.dlq))
    events = [decode_turn_event(m.value()) for m in read_topic(cfg, topics.turns)]
    turn_log_counts(events, row)
    row.notes += [explain_lost(events, key) for key in sorted(lost)[:LOST_EXPLAINED]]
    _count_restarts(pipeline, row, ctx)
    _release_stalls(pipeline, row, ctx)
    if reference is not None:
        row.differ, first = _compare(trajectories, reference, expected)
        if first:
            row.notes.append(first)
    return trajectories


def _count_failed(trajectories: dict[str, dict[str, Any]], row: FaultRow) -> None:
    row.failed = sum(1 for t in trajectories.values() if t["status"] == "failed")
    if row.failed:
        errors = Counter(
            _error_kind(t["error"]) for t in trajectories.values() if t["status"] == "failed"
        )
        row.notes.append(f"failed trajectories by error: {dict(errors.most_common(3))}")


def _count_restarts(pipeline: Pipeline, row: FaultRow, ctx: FaultContext) -> None:
    row.restarts = sum(s.restarts for s in pipeline.services())
    exits = Counter(code for s in pipeline.services() for code in s.exits)
    if exits:
        row.notes.append(f"exit codes {dict(exits)} (-9: SIGKILL), {ctx.kills} injected kills")


def _release_stalls(pipeline: Pipeline, row: FaultRow, ctx: FaultContext) -> None:
    kills = [at for name, at in ctx.killed_at if name.startswith("replaybuffer")]
    if not kills:
        return
    records = [
        ReleasedRecord.model_validate_json(m.value())
        for m in read_topic(pipeline.cfg, pipeline.topics.released)
    ]
    stalls = [s for s in (release_stall(records, at) for at in kills) if s is not None]
    if stalls:
        row.stall_s = statistics.median(stalls)
        row.notes.append(f"release stall after each replay-buffer kill (s): {_seconds(stalls)}")
    if len(stalls) < len(kills):
        row.notes.append(f"{len(kills) - len(stalls)} replay-buffer kills after the last release")


def release_stall(records: list[ReleasedRecord], killed_at: float) -> float | None:
    """Seconds from ``killed_at`` (wall clock) until every partition with a release after
    it released again; None if none did."""
    first: dict[int, int] = {}
    for record in records:
        if record.released_at_ms > killed_at * 1000:
            first[record.partition] = min(first.get(record.partition, 2**63), record.released_at_ms)
    return max(first.values()) / 1000 - killed_at if first else None


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def explain_lost(events: list[Any], key: str) -> str:
    """Where a lost trajectory's session stands in the turn log: its group's starts and its
    session's attempts, each with its last event."""
    uid, session_id, _ = parse_trajectory_key(key)
    starts = sum(1 for e in events if e.type == "group_started" and e.uid == uid)
    if not starts:
        return f"lost {key}: its group never started (no group_started in the turn log)"
    attempts: dict[str, list[str]] = defaultdict(list)
    resumed_from: dict[str, str | None] = {}
    for e in events:
        if e.uid == uid and getattr(e, "session_id", None) == session_id:
            attempts[e.attempt].append(e.type)
            if e.type == "session_started":
                resumed_from[e.attempt] = e.resumed_from
    described = [
        f"{attempt} ({len(types)} events, last {types[-1]}"
        + (f", resumed from {resumed_from[attempt]}" if resumed_from.get(attempt) else "")
        + ")"
        for attempt, types in attempts.items()
    ]
    return f"lost {key}: group started {starts}x; session attempts: " + (
        "; ".join(described) or "none started"
    )


def _error_kind(error: str | None) -> str:
    """An error message without the quoted names (request ids) that make each one unique."""
    return re.sub(r"'[^']*'", "'..'", error or "")[:ERROR_CHARS]


def _columns(value: bytes | None) -> dict[str, Any]:
    columns = decode_trajectory_batch(value or b"").to_pylist()[0]
    for name in NOT_COMPARED:
        columns.pop(name, None)
    return columns


def _compare(
    got: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]], expected: set[str]
) -> tuple[int, str]:
    """Trajectories that differ from the reference's (a missing one counts as lost, not here)."""
    differ, first = 0, ""
    for key in sorted(expected & set(got)):
        mine, theirs = got[key], reference.get(key)
        if mine == theirs:
            continue
        differ += 1
        if not first:
            columns = sorted(c for c in mine if theirs is None or mine[c] != theirs.get(c))
            first = f"first difference from the reference: {key} in {columns}"
    return differ, first


def turn_log_counts(events: list[Any], row: FaultRow) -> None:
    """attempts, resumed (without re-sampling) and re-sampled turns, from the turn log's
    events in log order."""
    generations: dict[tuple[str, int, str], list[Any]] = defaultdict(list)
    request_ids: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    seen: set[tuple[str, int, str, int]] = set()
    starts, group_starts = [], Counter()
    for event in events:
        if event.type == "group_started":
            group_starts[event.uid] += 1
            continue
        if (event.uid, event.session_id, event.attempt, event.seq) in seen:
            continue  # a duplicate write: the fold ignores it too
        seen.add((event.uid, event.session_id, event.attempt, event.seq))
        if event.type == "session_started":
            starts.append(event)
        elif event.type == "generation":
            generations[(event.uid, event.session_id, event.attempt)].append(event)
            request_ids[(event.uid, event.session_id, event.turn)].add(event.engine_request_id)
    row.attempts = len(starts)
    row.resumed = sum(1 for s in starts if s.resumed_from and _replayed_as_logged(s, generations))
    row.resampled = sum(len(ids) - 1 for ids in request_ids.values())
    again = sum(1 for count in group_starts.values() if count > 1)
    if again:
        row.notes.append(f"{again} groups started twice")
    resumed = [s for s in starts if s.resumed_from]
    nothing = sum(1 for s in resumed if not generations.get((s.uid, s.session_id, s.resumed_from)))
    if nothing:
        row.notes.append(f"{nothing} more sessions resumed with no generation logged yet")
    cut = sum(1 for s in resumed if _cut_short(s, generations))
    if cut:
        row.notes.append(
            f"{cut} resumed sessions stopped part way through replaying their log (their "
            "worker was stopped; a later attempt resumes them)"
        )
    mismatched = len(resumed) - nothing - cut - row.resumed
    if mismatched:
        row.notes.append(f"{mismatched} resumed sessions did not replay what was logged")


def _turns(generations: list[Any]) -> list[tuple[str, list[int]]]:
    return [(g.engine_request_id, list(g.token_ids)) for g in generations]


def _replayed_as_logged(start: Any, generations: dict[tuple[str, int, str], list[Any]]) -> bool:
    old = _turns(generations.get((start.uid, start.session_id, start.resumed_from), []))
    new = _turns(generations.get((start.uid, start.session_id, start.attempt), []))
    return bool(old) and new[: len(old)] == old


def _cut_short(start: Any, generations: dict[tuple[str, int, str], list[Any]]) -> bool:
    """Resumed, replayed as logged as far as it went, but stopped before the end of its log."""
    old = _turns(generations.get((start.uid, start.session_id, start.resumed_from), []))
    new = _turns(generations.get((start.uid, start.session_id, start.attempt), []))
    return len(new) < len(old) and new == old[: len(new)]


__all__ = ["explain_lost", "measure_run", "release_stall", "turn_log_counts"]
