"""Fault scenarios against the whole pipeline of real processes (the harness: ``tests/faults/``).

Each scenario runs the same workload as a fault-free reference run (computed once per
module) and must lose nothing, duplicate nothing, sample no logged turn again, and release
trajectories equal, column for column except ``attempt``, to the reference's. Every run adds
a row to the table printed at the end of the test session (``pytest_terminal_summary`` in
conftest.py).

Scenarios go through the command line and the topics only, so they keep working as the
replay buffer and the trainer client are hardened behind them.
"""

from __future__ import annotations

import importlib.util

import pytest

from rolloutbus.schemas.turns import Generation, GroupStarted, SessionStarted
from rolloutbus.streams.assembly.released import ReleasedRecord
from tests.faults import (
    PLUGINS,
    FaultContext,
    FaultRow,
    FaultRun,
    Workload,
    at_spread_moments,
    dedicated_broker,
    kill_broker,
    release_stall,
    restart_broker,
    run_fault_scenario,
    sigkill_spread,
    turn_log_counts,
)

fault_scenario = pytest.mark.slow  # and kafka, added by conftest: every scenario needs the broker

# 32 groups x 4 sessions. Every fault lands mid-run whatever the size: kills are placed by
# progress (at_spread_moments: kill i in the i-th slice of 5-85 % of the sessions released,
# each after one more group), and with sessions.concurrency 8 over 4 partitions groups are
# open on the partitions a fault moves. The rest of a row's time is mostly fixed (process
# starts, the outage, the session timeouts): at 64 groups the reference took 129 s and the
# session kills 130 s, at 32 groups 41 s and 103 s; the other rows swing with the load.
WORKLOAD = Workload(groups=32, n=4, turns=3, tokens_per_turn=2, tool_delay_s=0.25)
KILLS = 5
BROKER_OUTAGES = 3  # one graceful stop, then SIGKILLs
BROKER_OUTAGE_S = 10.0  # seconds the broker stays down after a graceful stop
BROKER_KILLED_S = 2.0  # seconds a SIGKILLed broker stays down (its JVM start adds more)
# sessions.concurrency for the replay-buffer kills: 2 groups in flight instead of 8 makes
# the run about 4x longer, so all five kills land while groups are still being released
# and each stall is a takeover, not a wait for the workload
SLOW_RELEASES_CONCURRENCY = 2


@pytest.fixture(scope="module")
def reference(kafka_bootstrap, tmp_path_factory) -> dict:
    run = run_fault_scenario(
        "no fault (reference)",
        bootstrap=kafka_bootstrap,
        workdir=tmp_path_factory.mktemp("reference"),
        workload=WORKLOAD,
    )
    assert (run.row.lost, run.row.duplicated, run.row.failed) == (0, 0, 0), run.explain()
    return run.trajectories


def _assert_exactly_once_and_as_reference(run: FaultRun) -> None:
    row = run.row
    assert row.lost == 0, f"{row.lost} trajectories lost\n{run.explain()}"
    assert row.duplicated == 0, f"{row.duplicated} trajectory keys written twice\n{run.explain()}"
    # recovery is replay: a resumed session answers its logged turns from the log, so no
    # turn is logged as sampled twice (a turn lost with a killed process was never logged)
    assert row.resampled == 0, f"{row.resampled} logged turns sampled again\n{run.explain()}"
    assert row.differ == 0, (
        f"{row.differ} trajectories differ from the fault-free run "
        f"({row.failed} failed)\n{run.explain()}"
    )


# -- scenarios ---------------------------------------------------------------------------------


@fault_scenario
def test_sigkill_sessions_x5(kafka_bootstrap, tmp_path, reference):
    """SIGKILL the session worker five times at random moments spread over the run."""
    run = run_fault_scenario(
        f"sigkill sessions x{KILLS}",
        bootstrap=kafka_bootstrap,
        workdir=tmp_path,
        workload=WORKLOAD,
        seed=5,
        scenario=sigkill_spread(lambda pipeline: pipeline.workers[0], KILLS),
        reference=reference,
    )
    _assert_exactly_once_and_as_reference(run)
    assert run.row.resumed > 0, f"no session was resumed from the log\n{run.explain()}"


@fault_scenario
def test_sigkill_replay_buffer_x5_during_releases(kafka_bootstrap, tmp_path, reference):
    """SIGKILL the replay buffer five times while it releases groups; the supervisor starts
    it again each time. The row's ``stall s`` is the median time from a kill to the next
    group released (the takeover)."""
    run = run_fault_scenario(
        f"sigkill replay buffer x{KILLS}",
        bootstrap=kafka_bootstrap,
        workdir=tmp_path,
        workload=WORKLOAD,
        seed=7,
        scenario=sigkill_spread(lambda pipeline: pipeline.buffers[0], KILLS),
        concurrency=SLOW_RELEASES_CONCURRENCY,
        reference=reference,
    )
    _assert_exactly_once_and_as_reference(run)
    assert run.row.stall_s is not None, f"no release after a kill\n{run.explain()}"


@fault_scenario
@pytest.mark.kafka  # a broker of its own (the session broker only runs the reference)
def test_broker_stopped_then_sigkilled_twice(tmp_path, reference):
    """Three broker outages mid-run: first a graceful stop (the broker writes its state and
    tells its clients), ``BROKER_OUTAGE_S`` down; then its JVM SIGKILLed twice (no shutdown:
    transactions open, the coordinators' state as a power cut leaves it), started again
    each time. No replay buffer may exit for a transaction error (a fatal one replaces its
    producer); other workers that exit are restarted by the supervisor (the row counts
    them)."""
    with dedicated_broker(tmp_path / "broker") as broker:

        def outage(ctx: FaultContext, i: int) -> None:
            if i == 0:
                ctx.note("stopping the broker")
                restart_broker(broker, BROKER_OUTAGE_S)
                ctx.note(f"broker started again after {BROKER_OUTAGE_S:.0f} s down")
                return
            ctx.note(f"SIGKILL the broker ({i} of {BROKER_OUTAGES - 1})")
            kill_broker(broker, BROKER_KILLED_S)
            ctx.note("broker started again")

        run = run_fault_scenario(
            f"broker stop + sigkill x{BROKER_OUTAGES - 1}",
            bootstrap=broker.kafka.bootstrap_servers,
            workdir=tmp_path,
            workload=WORKLOAD,
            seed=3,
            scenario=at_spread_moments(BROKER_OUTAGES, outage),
            reference=reference,
            broker=broker,
        )
    _assert_exactly_once_and_as_reference(run)
    buffer_exits = {name: codes for name, codes in run.exits.items() if name.startswith("replay")}
    assert not any(buffer_exits.values()), (
        f"the replay buffer exited on its own: {buffer_exits}\n{run.explain()}"
    )


@fault_scenario
def test_replica_restart(kafka_bootstrap, tmp_path, reference):
    """SIGKILL the replica mid-run; the supervisor starts it again on the same port."""

    def scenario(ctx: FaultContext) -> None:
        ctx.wait_for_fraction(0.3)
        ctx.kill(ctx.pipeline.replica)

    run = run_fault_scenario(
        "replica restart",
        bootstrap=kafka_bootstrap,
        workdir=tmp_path,
        workload=WORKLOAD,
        scenario=scenario,
        reference=reference,
    )
    _assert_exactly_once_and_as_reference(run)


@fault_scenario
def test_two_buffers_two_workers_rebalance(kafka_bootstrap, tmp_path, reference):
    """One session worker and one replay buffer on 4 partitions; a second of each joins
    mid-run (partitions move while groups are open), then the first of each is killed for
    good, so the newcomers own every partition and resume what the dead ones left."""

    def scenario(ctx: FaultContext) -> None:
        ctx.wait_for_fraction(0.2)
        ctx.note("adding a session worker and a replay buffer")
        ctx.pipeline.add_session_worker()
        ctx.pipeline.add_replay_buffer()
        ctx.wait_for_fraction(0.55)
        ctx.retire(ctx.pipeline.workers[0])
        ctx.retire(ctx.pipeline.buffers[0])

    run = run_fault_scenario(
        "2 buffers 2 workers rebalance",
        bootstrap=kafka_bootstrap,
        workdir=tmp_path,
        workload=WORKLOAD,
        scenario=scenario,
        partitions=4,
        reference=reference,
    )
    _assert_exactly_once_and_as_reference(run)


# -- the harness's own arithmetic (no broker) ---------------------------------------------------


def _generation(attempt: str, turn: int, request: str, tokens: list[int], seq: int) -> Generation:
    return Generation(
        uid="u",
        session_id=0,
        attempt=attempt,
        segment=0,
        turn=turn,
        token_ids=tokens,
        engine_request_id=request,
        seq=seq,
    )


def test_turn_log_counts_tell_replayed_turns_from_resampled_ones():
    events = [
        GroupStarted(uid="u", attempt="a", n=1, row={"prompt": [{"role": "user", "content": "x"}]}),
        SessionStarted(uid="u", session_id=0, attempt="a", agent_name="p"),
        _generation("a", 0, "r0", [1, 2], seq=2),
        _generation("a", 0, "r0", [1, 2], seq=2),  # a duplicate write: ignored
        # resumed: turn 0 replayed as logged, turn 1 sampled live
        SessionStarted(uid="u", session_id=0, attempt="b", agent_name="p", resumed_from="a"),
        _generation("b", 0, "r0", [1, 2], seq=2),
        _generation("b", 1, "r1", [3, 4], seq=4),
        # resumed again, but turn 1 was sampled a second time (another engine request)
        SessionStarted(uid="u", session_id=0, attempt="c", agent_name="p", resumed_from="b"),
        _generation("c", 0, "r0", [1, 2], seq=2),
        _generation("c", 1, "r9", [3, 4], seq=4),
    ]
    row = FaultRow("unit", expected=1)
    turn_log_counts(events, row)
    assert (row.attempts, row.resumed, row.resampled) == (3, 1, 1)
    assert row.notes == ["1 resumed sessions did not replay what was logged"]


def test_turn_log_counts_tell_a_resume_cut_short_from_one_that_resampled():
    """A worker killed part way through replaying a session's log re-logged only a prefix of
    it; the next attempt resumes from the whole log (recovery.LoggedAttempt.history)."""
    events = [
        GroupStarted(uid="u", attempt="a", n=1, row={"prompt": [{"role": "user", "content": "x"}]}),
        SessionStarted(uid="u", session_id=0, attempt="a", agent_name="p"),
        _generation("a", 0, "r0", [1, 2], seq=2),
        _generation("a", 1, "r1", [3, 4], seq=4),
        # resumed, killed after replaying turn 0 of 2
        SessionStarted(uid="u", session_id=0, attempt="b", agent_name="p", resumed_from="a"),
        _generation("b", 0, "r0", [1, 2], seq=2),
        # resumed from b, whose history is b's turn 0 then a's turn 1: both replayed
        SessionStarted(uid="u", session_id=0, attempt="c", agent_name="p", resumed_from="b"),
        _generation("c", 0, "r0", [1, 2], seq=2),
        _generation("c", 1, "r1", [3, 4], seq=4),
        _generation("c", 2, "r2", [5, 6], seq=6),
    ]
    row = FaultRow("unit", expected=1)
    turn_log_counts(events, row)
    assert (row.attempts, row.resumed, row.resampled) == (3, 1, 0)
    assert row.notes == [
        "1 resumed sessions stopped part way through replaying their log (their worker was "
        "stopped; a later attempt resumes them)"
    ]


def test_turn_seeds_are_stable_and_distinct(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))  # as the workers' PYTHONPATH has it
    loop = importlib.import_module("seeded_paced_loop")
    turn_seed = loop.turn_seed
    assert turn_seed("fault00001", 0, 0) == turn_seed("fault00001", 0, 0)
    seeds = {
        turn_seed(f"fault{g:05d}", s, t) for g in range(100) for s in range(4) for t in range(3)
    }
    assert len(seeds) == 1200 and all(0 <= seed < 2**31 for seed in seeds)


def test_the_release_stall_waits_for_every_partition_to_release_again():
    def released(partition: int, at_s: float) -> ReleasedRecord:
        return ReleasedRecord(
            uid=f"u{partition}{at_s}",
            partition=partition,
            trajectories=1,
            released_at_ms=int(at_s * 1000),
        )

    records = [released(0, 99.0), released(0, 103.0), released(1, 107.5), released(0, 104.0)]
    assert release_stall(records, killed_at=100.0) == 7.5  # partition 1 came back last
    assert release_stall(records, killed_at=110.0) is None  # nothing released after it
