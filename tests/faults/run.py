"""One fault run: start the pipeline, publish, hand it to the scenario, wait, measure."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutbus.config import Config
from tests.faults.measure import measure_run
from tests.faults.processes import POLL_S, Pipeline, end_offsets
from tests.faults.scenario import FaultContext, Scenario, ScenarioTimeout
from tests.faults.table import ROWS, FaultRow
from tests.faults.workload import Workload

COMPLETION_TIMEOUT_S = 600.0  # seconds for every key to arrive (restarts, rebalances)
SETTLE_TIMEOUT_S = 90.0  # seconds for the replay buffer to fold the whole turn log
SETTLE_STABLE_S = 3.0  # seconds the turn log must stay unchanged to count as settled


@dataclass
class FaultRun:
    row: FaultRow
    trajectories: dict[str, dict[str, Any]]  # key -> the first record's columns but attempt
    timeline: list[str]
    logs: dict[str, str]  # service -> the tail of its last log, for failure messages
    exits: dict[str, list[int]]  # service -> exit codes of its incarnations that ended early

    def explain(self) -> str:
        lines = [f"{self.row}", "timeline:", *self.timeline]
        for name, tail in self.logs.items():
            lines += [f"--- {name} (last log) ---", tail]
        return "\n".join(lines)


def run_fault_scenario(
    name: str,
    *,
    bootstrap: str,
    workdir: Path,
    workload: Workload,
    scenario: Scenario | None = None,
    seed: int = 0,
    partitions: int = 2,
    session_workers: int = 1,
    replay_buffers: int = 1,
    concurrency: int = 8,
    reference: dict[str, dict[str, Any]] | None = None,
    broker: Config | None = None,
) -> FaultRun:
    """Run the pipeline under ``scenario`` and record its row in ``ROWS``. ``concurrency``
    is each session worker's ``sessions.concurrency`` (fewer: a longer run, same records)."""
    started = time.monotonic()
    row = FaultRow(name, expected=workload.sessions)
    pipeline = Pipeline(bootstrap, workdir, partitions=partitions, concurrency=concurrency)
    ctx = FaultContext(
        pipeline, workload, random.Random(seed), started + COMPLETION_TIMEOUT_S, broker=broker
    )
    try:
        pipeline.start(session_workers, replay_buffers)
        ctx.note("pipeline started")
        pipeline.publish(workload)
        ctx.note(f"published {workload.groups} groups x {workload.n}")
        _run_to_the_end(pipeline, ctx, scenario, row)
    finally:
        pipeline.close()
    trajectories = measure_run(pipeline, workload, row, reference, ctx)
    logs = {s.name: s.log_tail() for s in pipeline.services()}
    exits = {s.name: list(s.exits) for s in pipeline.services()}
    row.wall_s = time.monotonic() - started
    ROWS.append(row)
    # the row and its notes beside the logs at once (the table prints only at the end)
    (workdir / "row.txt").write_text("\n".join([f"{row}", *row.notes]) + "\n")
    pipeline.delete_topics()
    return FaultRun(row, trajectories, ctx.timeline, logs, exits)


def _run_to_the_end(
    pipeline: Pipeline, ctx: FaultContext, scenario: Scenario | None, row: FaultRow
) -> None:
    try:
        if scenario is not None:
            scenario(ctx)
        ctx.wait_for_released(ctx.workload.sessions)
        ctx.note("every key arrived")
        row.notes += _settle(pipeline, ctx)
    except ScenarioTimeout as exc:
        row.notes.append(f"timed out: {exc}")
        ctx.note(f"timed out: {exc}")
        dumped = [s.name for s in pipeline.services() if s.dump_stacks()]
        row.notes.append(f"Python stacks of {dumped} are at the end of their logs")


def _settle(pipeline: Pipeline, ctx: FaultContext) -> list[str]:
    """Wait until the replay buffer folded the whole turn log and nothing more is written,
    so a group released twice late would still be seen."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    stable_since, last_ends = time.monotonic(), None
    while time.monotonic() < deadline:
        ends = end_offsets(pipeline.cfg, pipeline.topics.turns)
        if ends != last_ends:
            stable_since, last_ends = time.monotonic(), ends
        elif time.monotonic() - stable_since >= SETTLE_STABLE_S and pipeline.turn_log_settled():
            ctx.note("turn log folded to its end")
            return []
        time.sleep(POLL_S)
    ctx.note("the replay buffer never committed the turn log to its end")
    return [
        f"not settled within {SETTLE_TIMEOUT_S:.0f} s (replay buffer offsets behind the turn log)"
    ]


__all__ = ["FaultRun", "run_fault_scenario"]
