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

``--long-turns`` measures instead one session-worker SIGKILL in the middle of long turns
(``--n`` sessions of one group, one ``ignore_eos`` turn of ``--long-tokens`` tokens each),
on a pipeline of its own per mode: chunking off, then ``sessions.chunk_tokens`` =
each of ``--chunk-tokens`` (``streams/sessions/chunking.py``). The kill comes once the
replica has sampled ``--kill-at`` (0.55) of every turn: 563 of 1,024 tokens, 51 into a
chunk of 64 or of 128. Per mode: tokens sampled again per in-flight
session (the replica's ``generation_tokens`` minus the released turns' tokens: what the
killed worker's requests sampled and nobody logged), kill -> the replica's first token for
a resumed session (its counter moves again after the killed worker's requests were
aborted), and what chunking costs the turn log: events and bytes per released token.
Medians over ``--repeats`` runs per mode, each beside its ratio to chunking off.

    python benchmarks/recovery.py --long-turns [--n 2] [--long-tokens 1024] [--chunk-tokens 64 128]
"""

from __future__ import annotations

import argparse
import os
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
from rolloutbus.schemas.turns import Generation, decode_turn_event
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


# --- one kill in the middle of long turns, chunking off and on (--long-turns) ---

LONG_POLL_S = 0.1  # seconds between reads of the replica's /metrics while a long run waits
RUNNING = "requests_running"  # the replica's gauge (its /metrics)
QUIET_S = 1.0  # seconds the replica stands still after a kill before a resumed token counts


@dataclass
class LongTurnOutcome:
    chunk_tokens: int  # sessions.chunk_tokens; 0: off
    sessions: int = 0
    again_per_session: float = 0.0  # tokens sampled and never released, per in-flight session
    first_resumed_s: float | None = None  # kill -> the replica samples for a resumed session
    events_per_ktoken: float = 0.0  # turn-log events per 1,000 released tokens
    bytes_per_token: float = 0.0  # turn-log bytes per released token
    wall_s: float = 0.0


def replica_metric(pipeline: Pipeline, suffix: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{pipeline.port}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.endswith(suffix)
    )


def _long_pipeline(chunk_tokens: int, args, work: Path) -> Pipeline:
    """A pipeline whose every process (and every restart of it: Service copies os.environ
    when it is made) reads ``sessions.chunk_tokens`` and the long response length."""
    env = {
        "ROLLOUTBUS__SESSIONS__CHUNK_TOKENS": str(chunk_tokens),
        "ROLLOUTBUS__ROLLOUT__RESPONSE_LENGTH": str(args.long_tokens),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:  # the session worker and replay buffer are made in start(): keep env until then
        pipeline = Pipeline(
            bootstrap=args.bus,
            workdir=work,
            partitions=1,
            concurrency=args.n,
            replica_batch=args.n,
        )
        pipeline.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return pipeline


def run_long_turns(chunk_tokens: int, args, work: Path) -> LongTurnOutcome:
    """SIGKILL the session worker once the replica has sampled ``kill_at`` of every turn; the
    supervisor restarts it and the sessions resume from the turn log."""
    workload = Workload(
        groups=1, n=args.n, turns=1, tokens_per_turn=args.long_tokens, tool_delay_s=0.0
    )
    started = time.monotonic()
    pipeline = _long_pipeline(chunk_tokens, args, work)
    try:
        before = replica_metric(pipeline, GENERATION_TOKENS)
        pipeline.publish(workload)
        target = before + args.n * int(args.long_tokens * args.kill_at)
        _wait_until(
            f"{args.kill_at:g} of every turn sampled",
            pipeline,
            lambda: replica_metric(pipeline, GENERATION_TOKENS) >= target,
        )
        killed_at = time.time()
        pipeline.workers[0].kill(signal.SIGKILL)  # the supervisor restarts it
        first_resumed_s = _first_resumed_token(pipeline, killed_at)
        _wait_until(
            "every trajectory released",
            pipeline,
            lambda: sum(pipeline.watcher.keys.values()) >= args.n,
        )
        sampled = replica_metric(pipeline, GENERATION_TOKENS) - before
    finally:
        pipeline.close()
    outcome = _analyse_long_turns(pipeline, chunk_tokens, int(sampled))
    outcome.first_resumed_s = first_resumed_s
    outcome.wall_s = time.monotonic() - started
    pipeline.delete_topics()
    return outcome


def _wait_until(what: str, pipeline: Pipeline, ready) -> None:
    """Every wait of the run has a deadline: a run that cannot go on says why and exits
    (the attempt before this one waited for half of 1,024-token turns from workers that
    never read the long response length: they were made after the env was restored)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            tails = "\n".join(s.log_tail() for s in pipeline.services())
            raise SystemExit(f"{what}: not within {SETTLE_TIMEOUT_S:g} s\n{tails}")
        time.sleep(LONG_POLL_S)


def _first_resumed_token(pipeline: Pipeline, killed_at: float) -> float:
    """Seconds from the kill to the replica's first token for a resumed session. The
    killed worker's requests end when its connections close (the replica aborts a request
    whose client hung up); once nothing runs and the token counter has stood still for
    ``QUIET_S`` (a restarted worker takes longer than that to start), the counter moves
    again only for the new worker's sessions."""
    idle = -1.0

    def quiet() -> bool:
        nonlocal idle
        tokens = replica_metric(pipeline, GENERATION_TOKENS)
        time.sleep(QUIET_S)
        still = replica_metric(pipeline, GENERATION_TOKENS) == tokens
        idle = tokens
        return still and replica_metric(pipeline, RUNNING) == 0

    _wait_until("the killed worker's requests ended", pipeline, quiet)
    _wait_until(
        "a resumed session sampling",
        pipeline,
        lambda: replica_metric(pipeline, GENERATION_TOKENS) > idle,
    )
    return time.time() - killed_at


def _analyse_long_turns(pipeline: Pipeline, chunk_tokens: int, sampled: int) -> LongTurnOutcome:
    cfg = pipeline.cfg
    sizes: list[int] = []
    final: dict[int, Generation] = {}
    for part in range(cfg.kafka.partitions):
        for msg in read_partition(cfg.kafka, pipeline.topics.turns, part, 0):
            sizes.append(len(msg.value() or b""))
            event = decode_turn_event(msg.value() or b"")
            if isinstance(event, Generation):
                final[event.session_id] = event
    tokens = sum(len(g.token_ids) for g in final.values())
    return LongTurnOutcome(
        chunk_tokens=chunk_tokens,
        sessions=len(final),
        again_per_session=(sampled - tokens) / max(1, len(final)),
        events_per_ktoken=1000 * len(sizes) / max(1, tokens),
        bytes_per_token=sum(sizes) / max(1, tokens),
    )


def report_long_turns(runs: dict[int, list[LongTurnOutcome]], args) -> None:
    """Medians over the repeats of each mode, and each mode's ratio to chunking off."""
    print(
        f"recovery, long turns: one session-worker SIGKILL once {args.kill_at:g} of "
        f"{args.n} turns of {args.long_tokens} tokens (ignore_eos) is sampled; medians of "
        f"{args.repeats} run(s) per mode; {machine_line()}"
    )
    print(
        f"{'chunk_tokens':>12} {'re-sampled/session':>18} {'x off':>6} "
        f"{'-> resumed token s':>18} {'x off':>6} {'events/1k tok':>13} {'x off':>6} "
        f"{'bytes/tok':>9} {'x off':>6}"
    )
    off = _medians(runs[0])
    for chunk_tokens, outcomes in runs.items():
        m = _medians(outcomes)
        cells = []
        for key, width, fmt in (
            ("again", 18, ".1f"),
            ("first", 18, ".2f"),
            ("events", 13, ".2f"),
            ("bytes", 9, ".1f"),
        ):
            ratio = m[key] / off[key] if off[key] else float("nan")
            cells.append(f"{m[key]:>{width}{fmt}} {ratio:>6.3f}")
        print(f"{chunk_tokens or 'off':>12} " + " ".join(cells))
    print("goal: at most chunk_tokens tokens sampled again per in-flight session")


def _medians(outcomes: list[LongTurnOutcome]) -> dict[str, float]:
    return {
        "again": median([o.again_per_session for o in outcomes]),
        "first": median([o.first_resumed_s for o in outcomes if o.first_resumed_s is not None]),
        "events": median([o.events_per_ktoken for o in outcomes]),
        "bytes": median([o.bytes_per_token for o in outcomes]),
    }


def main_long_turns(args) -> int:
    if args.quick:
        args.long_tokens, args.chunk_tokens, args.repeats = 256, [32], 1
    runs: dict[int, list[LongTurnOutcome]] = {}
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        args.bus = bus.bootstrap
        for repeat in range(args.repeats):
            for chunk_tokens in (0, *args.chunk_tokens):  # interleaved: the load drifts
                work = Path(tmp) / f"chunks{chunk_tokens}-{repeat}"
                work.mkdir()
                outcome = run_long_turns(chunk_tokens, args, work)
                print(f"[recovery] chunk_tokens={chunk_tokens}: {outcome}", file=sys.stderr)
                runs.setdefault(chunk_tokens, []).append(outcome)
    report_long_turns(runs, args)
    return 0


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
    ap.add_argument("--long-turns", action="store_true", help="one kill mid-way, long turns")
    ap.add_argument("--long-tokens", type=int, default=1024, help="tokens per long turn (1024)")
    ap.add_argument(
        "--chunk-tokens", type=int, nargs="+", default=[64, 128], help="sessions.chunk_tokens"
    )
    ap.add_argument(
        "--kill-at",
        type=float,
        default=0.55,
        help="the kill comes once this share of every long turn is sampled (0.55: mid-chunk)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="long-turn runs per mode (1)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.long_turns:
        return main_long_turns(args)
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
