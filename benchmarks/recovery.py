"""Recovery: repeated SIGKILLs of a session worker (and, separately, of a replay buffer)
during a steady run; what each kill costs.

Each target gets a pipeline of real processes on its own topics (``tests/faults/``:
one embedded replica with tiny-qwen3, one session worker, one replay buffer, each started
through the ``rolloutbus`` command line and restarted by a supervisor ``RESTART_DELAY_S``
after it exits, as systemd or Kubernetes would). A dispatcher publishes prompt groups of
the seeded paced loop (``--turns`` turns, ``--tool-delay`` seconds between them) at
``--rate`` groups/s. After ``--warmup`` seconds it SIGKILLs the target every ``--interval``
seconds, ``--kills`` times, then stops publishing and waits until every group is released.
The harness is a fault injector: nothing in it stands in for the product.

Per kill, from the logs themselves (record timestamps of rollout.turns and of the released
groups topic, so nothing relies on the killed process):

* kill → first turn: the first generation event written after the kill (a session worker
  kill: the restarted worker's first sampled turn; the kill stops every session of the
  worker);
* kill → first release: the first group released after the kill.

Over the run: tokens re-sampled (a (session, turn) sampled under more than one engine
request id: the replayed ones keep theirs), tokens lost in flight (sampled by the replica,
never logged: requests running when their worker died; the replica's
``generation_tokens`` counter minus the tokens logged), and the generation-seconds these
two cost (the logged latencies of re-sampled turns, plus lost tokens at the run's mean
seconds per token). Goal: 0 tokens re-sampled, 0 generation-seconds lost.

    python benchmarks/recovery.py [--targets sessions replay-buffer] [--kills 3] [--interval 30]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_harness import add_common_args, broker, machine_line, median
from prometheus_client.parser import text_string_to_metric_families
from soak import Dispatcher

from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.turns import decode_turn_event
from tests.faults import Pipeline, Workload

SETTLE_TIMEOUT_S = 600.0  # seconds for every published group to be released after the kills
POLL_S = 1.0
GENERATION_TOKENS = "generation_tokens_total"  # the replica's counter (its /metrics)


@dataclass
class Kill:
    at: float  # time.time() of the SIGKILL
    first_turn_s: float | None = None
    first_release_s: float | None = None


@dataclass
class Outcome:
    target: str
    kills: list[Kill] = field(default_factory=list)
    published: int = 0
    released: int = 0
    sessions: int = 0
    resampled_turns: int = 0
    resampled_tokens: int = 0
    resampled_s: float = 0.0
    lost_tokens: int = 0
    lost_s: float = 0.0
    restarts: int = 0
    wall_s: float = 0.0


def replica_generated_tokens(pipeline: Pipeline) -> int:
    text = httpx.get(f"http://127.0.0.1:{pipeline.port}/metrics", timeout=10).text
    return int(
        sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.endswith(GENERATION_TOKENS)
        )
    )


def run_target(target: str, bootstrap: str, args, work: Path) -> Outcome:
    workload = Workload(
        groups=1,
        n=args.n,
        turns=args.turns,
        tokens_per_turn=args.tokens_per_turn,
        tool_delay_s=args.tool_delay,
    )
    pipeline = Pipeline(bootstrap, work, partitions=2, concurrency=8, replica_batch=8)
    dispatcher = Dispatcher(pipeline, workload, args.rate)
    outcome = Outcome(target)
    started = time.monotonic()
    try:
        pipeline.start()
        tokens_before = replica_generated_tokens(pipeline)
        dispatcher.start()
        time.sleep(args.warmup)
        victim = pipeline.workers[0] if target == "sessions" else pipeline.buffers[0]
        for _ in range(args.kills):
            outcome.kills.append(Kill(time.time()))
            victim.kill(signal.SIGKILL)  # the supervisor restarts it after RESTART_DELAY_S
            print(f"[recovery] {target}: killed at {outcome.kills[-1].at:.1f}", file=sys.stderr)
            time.sleep(args.interval)
        dispatcher.stop()
        outcome.published = dispatcher.published
        _wait_released(pipeline, outcome.published * args.n)
        outcome.lost_tokens = replica_generated_tokens(pipeline) - tokens_before
    finally:
        dispatcher.stop()
        pipeline.close()
    outcome.restarts = sum(s.restarts for s in pipeline.services())
    outcome.wall_s = time.monotonic() - started
    _analyse_logs(pipeline, outcome)
    pipeline.delete_topics()
    return outcome


def _wait_released(pipeline: Pipeline, keys: int) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while len(pipeline.watcher.keys) < keys:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"only {len(pipeline.watcher.keys)} of {keys} trajectories were released"
            )
        time.sleep(POLL_S)


def _analyse_logs(pipeline: Pipeline, outcome: Outcome) -> None:
    """Per kill: the first turn and the first release after it; over the run: what was
    sampled twice or never logged. ``outcome.lost_tokens`` holds the replica's count of
    sampled tokens on entry."""
    cfg, topics = pipeline.cfg, pipeline.topics
    turn_times: list[float] = []
    samples: dict[tuple[str, int, int], dict[str, tuple[int, float]]] = defaultdict(dict)
    for part in range(cfg.kafka.partitions):
        for msg in read_partition(cfg.kafka, topics.turns, part, 0):
            event = decode_turn_event(msg.value() or b"")
            if event.type == "generation":
                turn_times.append(msg.timestamp()[1] / 1000)
                turn = samples[(event.uid, event.session_id, event.turn)]
                turn.setdefault(event.engine_request_id, (len(event.token_ids), event.latency_s))
    release_times = [
        msg.timestamp()[1] / 1000
        for part in range(cfg.kafka.partitions)
        for msg in read_partition(cfg.kafka, topics.released, part, 0)
    ]
    for kill in outcome.kills:
        kill.first_turn_s = _first_after(turn_times, kill.at)
        kill.first_release_s = _first_after(release_times, kill.at)
    logged_tokens = sum(tokens for turn in samples.values() for tokens, _ in turn.values())
    logged_s = sum(s for turn in samples.values() for _, s in turn.values())
    for turn in samples.values():
        extra = list(turn.values())[1:]  # every sample past the first of a turn
        outcome.resampled_turns += bool(extra)
        outcome.resampled_tokens += sum(tokens for tokens, _ in extra)
        outcome.resampled_s += sum(s for _, s in extra)
    outcome.lost_tokens -= logged_tokens
    seconds_per_token = logged_s / logged_tokens if logged_tokens else 0.0
    outcome.lost_s = max(0, outcome.lost_tokens) * seconds_per_token
    outcome.released = len(pipeline.watcher.keys)
    outcome.sessions = len({(uid, sid) for uid, sid, _ in samples})


def _first_after(times: list[float], t: float) -> float | None:
    later = [x for x in times if x > t]
    return min(later) - t if later else None


def report(outcomes: list[Outcome], args) -> None:
    print(
        f"recovery: {args.kills} SIGKILLs per target, {args.interval:g} s apart, at "
        f"{args.rate:g} groups/s (n={args.n}, {args.turns} turns of {args.tokens_per_turn} "
        f"tokens, {args.tool_delay:g} s tool delay); {machine_line()}"
    )
    print(f"{'target':<14} {'kill':>4} {'-> first turn s':>16} {'-> first release s':>19}")
    for o in outcomes:
        for i, kill in enumerate(o.kills, 1):
            print(
                f"{o.target:<14} {i:>4} {_s(kill.first_turn_s):>16} {_s(kill.first_release_s):>19}"
            )
        turns = [k.first_turn_s for k in o.kills if k.first_turn_s is not None]
        releases = [k.first_release_s for k in o.kills if k.first_release_s is not None]
        print(f"{o.target:<14} {'med':>4} {_s(median(turns)):>16} {_s(median(releases)):>19}")
    print(
        f"\n{'target':<14} {'groups':>6} {'trajectories':>12} {'restarts':>8} "
        f"{'resampled turns':>15} {'tokens':>7} {'gen-s':>6} {'lost tokens':>11} {'gen-s':>6}"
    )
    for o in outcomes:
        print(
            f"{o.target:<14} {o.published:>6} {o.released:>12} {o.restarts:>8} "
            f"{o.resampled_turns:>15} {o.resampled_tokens:>7} {o.resampled_s:>6.2f} "
            f"{o.lost_tokens:>11} {o.lost_s:>6.2f}"
        )
    print("goal: 0 tokens re-sampled and 0 generation-seconds lost per kill")


def _s(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--targets",
        nargs="+",
        default=["sessions", "replay-buffer"],
        choices=["sessions", "replay-buffer"],
    )
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between kills (30)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the first kill")
    ap.add_argument("--rate", type=float, default=1.0, help="groups published per second (1)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens-per-turn", type=int, default=8)
    ap.add_argument("--tool-delay", type=float, default=0.5, help="seconds between turns (0.5)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:  # one kill of a session worker (a replay buffer's takes ~80 s to release)
        args.targets, args.kills, args.interval, args.warmup = ["sessions"], 1, 15.0, 8.0
    outcomes = []
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        for target in args.targets:
            work = Path(tmp) / target
            work.mkdir()
            outcomes.append(run_target(target, bus.bootstrap, args, work))
    report(outcomes, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
