"""P2: the durability tax. The same prompt groups run two ways against the same replica:

* in-process: the session runner in one asyncio process (a fresh one, as a worker is), no
  Kafka, as verl's AgentLoopWorker runs its loops: ``run_group`` for every group, at most
  ``--concurrency`` groups at a time, turns handed to a no-op;
* through the bus: the same groups published to rollout.prompts; a session worker
  (``rolloutbus sessions run``) runs them with the same concurrency and logs every turn
  durably, a replay buffer (``rolloutbus replay-buffer run``) folds them, and a trainer
  client in this process receives the groups.

Two replicas: the embedded SmolLM2 replica decoding for real (``rolloutbus replica
serve``), and an instant scripted one (a test double: fixed tokens at once, served by this
script with ``--serve-instant``), which leaves only the bus's own overhead. The loop is the
paced multi-turn loop of ``tests/plugins/paced_loop.py`` (``--turns`` generations per
session, a constant observation between them, no tool delay).

Printed per replica: sessions/s both ways and their ratio (bus/in-process, goal >= 0.98
with real decoding); the mean group time (slot taken → last turn; bus: ``group_started`` →
last turn, from the log's timestamps), the added time per group and per turn, the delivery
(last turn → trainer) and CPU seconds per turn event of the bus processes.

    python benchmarks/durability_tax.py [--replicas smollm2 instant] [--groups 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from bench_harness import ROOT, CpuMeter, add_common_args, broker, drop_topics, machine_line, median

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.prompts import PromptGroup
from rolloutbus.schemas.turns import TERMINAL_TYPES, SessionFailed, decode_turn_event
from rolloutbus.topics import Topics
from tests.helpers import free_port

FIXTURES = ROOT / "tests" / "plugins"
LOOP_NAME, LOOP_TARGET = "benchpaced", "paced_loop.PacedToolLoop"
WARMUP_GROUPS = 1  # groups through each path before the clock starts
READY_TIMEOUT_S = 600.0  # seconds; the first SmolLM2 start dequantizes its GGUF
INSTANT_TOKEN = 1000  # the instant replica's token ids start here


@dataclass
class Way:
    """One way of running the groups: its wall time, per-group times, CPU."""

    name: str
    wall_s: float = 0.0
    group_s: list[float] = field(default_factory=list)  # slot taken (group_started) → last turn
    delivery_s: list[float] = field(default_factory=list)  # last turn → trainer (bus only)
    cpu_s: dict[str, float] = field(default_factory=dict)
    events: int = 0  # turn events logged (bus only)


def rows(count: int, args: argparse.Namespace, tag: str) -> list[dict[str, Any]]:
    return [
        {
            "uid": f"{tag}{i:05d}",
            "__rollout_n__": args.n,
            "data_source": "tax",
            "agent_name": LOOP_NAME,
            "prompt": [{"role": "user", "content": f"Count from {i} to {i + 20}, slowly."}],
            "extra_info": {
                "turns": args.turns,
                "tokens_per_turn": args.tokens_per_turn,
                "tool_delay_s": 0.0,
            },
        }
        for i in range(count)
    ]


def raw_config(bootstrap: str, port: int, model: str, args, work: Path) -> dict[str, Any]:
    registry = work / "loops.yaml"
    registry.write_text(yaml.safe_dump([{"name": LOOP_NAME, "_target_": LOOP_TARGET}]))
    tag = uuid.uuid4().hex[:6]
    return {
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": f"tax{tag}", "partitions": 2},
        "model": {"name": model},
        "replica_server": {"port": port, "max_batch_size": args.concurrency * args.n},
        "replicas": {"urls": [f"http://127.0.0.1:{port}"], "request_timeout_s": 600},
        "rollout": {
            "n": args.n,
            "prompt_length": 256,
            "response_length": 4096,
            "agent": {"agent_loop_config_path": str(registry)},
        },
        "sessions": {
            "app_id": f"tax{tag}-sessions",
            "concurrency": args.concurrency,
            "data_dir": str(work / "faust"),
        },
        "replay_buffer": {"group_id": f"tax{tag}-rb"},
    }


# -- the instant replica (a test double) -----------------------------------------------


def serve_instant(port: int, tokens: int) -> None:
    """Serve a scripted engine (a test double: ``tokens`` fixed ids at once) until killed."""
    from rolloutbus.config import ReplicaServerConfig
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
    from rolloutbus.replica.server import start_replica

    turn = ScriptedTurn(list(range(INSTANT_TOKEN, INSTANT_TOKEN + tokens)), finish_reason="length")
    engine = ScriptedEngine(lambda prompt: turn, max_model_len=1 << 20)
    cfg = Config(replica_server=ReplicaServerConfig(port=port))

    async def run() -> None:
        await start_replica(cfg, engine)
        await asyncio.Event().wait()

    asyncio.run(run())


def start_replica_process(kind: str, cfg: Config, config_path: Path, work: Path, args):
    from tests.pipeline import spawn, wait_http_ok

    port = cfg.replica_server.port
    log = work / f"replica-{kind}.log"
    if kind == "instant":
        argv = [sys.executable, __file__, "--serve-instant", str(port), str(args.tokens_per_turn)]
        import subprocess

        proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    else:
        proc = spawn(["replica", "serve"], config_path, log)
    wait_http_ok(f"http://127.0.0.1:{port}/health", proc, log)
    return proc


# -- in-process ----------------------------------------------------------------------------


def in_child_process(
    config: Path, measured: list, warmup: list, replica_pid: int, work: Path
) -> Way:
    """The in-process way in a fresh process of its own, as a session worker is (this
    process imports much more, whose objects the garbage collector would walk)."""
    import subprocess

    request = work / f"inproc-{uuid.uuid4().hex[:6]}.json"
    request.write_text(json.dumps({"measured": measured, "warmup": warmup, "replica": replica_pid}))
    done = subprocess.run(
        [sys.executable, __file__, "--run-in-process", str(config), str(request)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the in-process run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Way("in-process", result["wall_s"], result["group_s"], [], result["cpu_s"])


def run_in_process_main(config: Path, request: Path) -> None:
    """The child process: run the groups, print what it measured as one JSON line."""
    from rolloutbus.producers.publish import build_group

    cfg = Config.model_validate(yaml.safe_load(config.read_text()))
    spec = json.loads(request.read_text())
    groups = [build_group(cfg, r) for r in spec["measured"]]
    warmup = [build_group(cfg, r) for r in spec["warmup"]]
    way = asyncio.run(run_in_process(cfg, groups, warmup, spec["replica"]))
    print(json.dumps({"wall_s": way.wall_s, "group_s": way.group_s, "cpu_s": way.cpu_s}))


async def run_in_process(
    cfg: Config, groups: list[PromptGroup], warmup: list[PromptGroup], replica_pid: int
) -> Way:
    from rolloutbus.replica.models import load_tokenizer
    from rolloutbus.streams.agent_loop import registry
    from rolloutbus.streams.inference.llm_client import LLMClient
    from rolloutbus.streams.sessions.runner import SessionContext, run_group

    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))  # the paced loop, as the worker gets it
    registry.load_agent_loop_config(cfg.rollout.agent.agent_loop_config_path)
    client = LLMClient(cfg.replicas, cfg.rollout)
    ctx = SessionContext(config=cfg, tokenizer=load_tokenizer(cfg.model), llm_client=client)
    slots = asyncio.Semaphore(cfg.sessions.concurrency)
    way = Way("in-process")

    async def discard(event: Any) -> None:
        return None  # no turn log: what an in-memory rollout keeps is what run() returns

    async def one(group: PromptGroup, times: list[float]) -> None:
        async with slots:
            started = time.time()
            results = await run_group(ctx, group, discard)
            times.append(time.time() - started)
        failed = [r for r in results if isinstance(r, SessionFailed)]
        if failed:
            raise SystemExit(f"in-process: {failed[0].uid} failed: {failed[0].error}")

    await asyncio.gather(*(one(g, []) for g in warmup))
    meter = CpuMeter({"replica": replica_pid}).start()
    await asyncio.gather(*(one(g, way.group_s) for g in groups))
    meter.stop()
    await client.close()
    way.wall_s, way.cpu_s = meter.wall_s, {"this process": meter.own_s, **meter.others_s}
    return way


# -- through the bus -----------------------------------------------------------------------


def run_through_bus(cfg: Config, config_path: Path, work: Path, groups, warmup, replica) -> Way:
    from rolloutbus.consumers.client import TrainerClient
    from rolloutbus.producers.publish import PromptPublisher
    from tests.pipeline import spawn, stop

    worker = spawn(["sessions", "run"], config_path, work / "sessions.log", [FIXTURES])
    buffer = spawn(["replay-buffer", "run"], config_path, work / "replay-buffer.log")
    publisher = PromptPublisher(cfg)
    way = Way("bus")
    yielded: dict[str, float] = {}
    try:
        with TrainerClient(cfg.kafka, f"tax-trainer-{uuid.uuid4().hex[:6]}") as client:
            received = client.groups(timeout_s=READY_TIMEOUT_S)
            _publish(publisher, warmup)
            _take(received, {g.uid for g in warmup}, {})
            pids = {"session worker": worker.pid, "replay buffer": buffer.pid}
            meter = CpuMeter({**pids, "replica": replica.pid}).start()
            _publish(publisher, groups)
            _take(received, {g.uid for g in groups}, yielded)
            meter.stop()
    finally:
        publisher.flush()
        del publisher
        for proc in (worker, buffer):
            stop(proc)
    way.wall_s = meter.wall_s
    way.cpu_s = {"this process": meter.own_s, **meter.others_s}
    started, last_turn, way.events = _group_times(cfg, {g.uid for g in groups})
    way.group_s = [last_turn[uid] - started[uid] for uid in yielded]
    way.delivery_s = [yielded[uid] - last_turn[uid] for uid in yielded]
    return way


def _publish(publisher, groups: list[PromptGroup]) -> None:
    for group in groups:
        publisher.publish_group(group)
    publisher.flush()


def _take(received, uids: set[str], yielded: dict[str, float]) -> None:
    """Until every group of ``uids`` came (a client reads the topic from its start: the
    earlier rounds' groups come first and are skipped)."""
    missing = set(uids)
    for group in received:
        if group.uid not in missing:
            continue
        missing.discard(group.uid)
        yielded[group.uid] = time.time()
        if "failed" in group.batch.column("status").to_pylist():
            raise SystemExit(f"bus: group {group.uid} has failed sessions")
        if not missing:
            return
    raise SystemExit(f"the trainer client never received {len(missing)} of {len(uids)} groups")


def _group_times(cfg: Config, uids: set[str]) -> tuple[dict[str, float], dict[str, float], int]:
    """From the turn log: each group's group_started ts, its last terminal event's ts, and
    how many turn events the measured groups logged."""
    started: dict[str, float] = {}
    last: dict[str, float] = {}
    events = 0
    topic = Topics.from_config(cfg.kafka).turns
    for part in range(cfg.kafka.partitions):
        for msg in read_partition(cfg.kafka, topic, part, 0):
            event = decode_turn_event(msg.value() or b"")
            if event.uid not in uids:
                continue
            events += 1
            if event.type == "group_started":
                started[event.uid] = event.ts
            elif event.type in TERMINAL_TYPES:
                last[event.uid] = max(last.get(event.uid, 0.0), event.ts)
    return started, last, events


# -- one replica, both ways ----------------------------------------------------------------


def run_replica(kind: str, bootstrap: str, args, work: Path) -> tuple[Way, Way]:
    from rolloutbus.producers.publish import build_group
    from tests.pipeline import stop

    model = "smollm2-135m" if kind == "smollm2" else "tiny-qwen3"
    raw = raw_config(bootstrap, free_port(), model, args, work)
    cfg = Config.model_validate(raw)
    config_path = work / f"{kind}.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    ensure_topics(cfg.kafka)
    replica = start_replica_process(kind, cfg, config_path, work, args)
    try:
        make = lambda rows_: [build_group(cfg, r) for r in rows_]  # noqa: E731
        inprocs, buses = [], []
        for r in range(args.rounds):  # alternating: a change of the machine's load hits both
            tag = f"{kind[:3]}{r}{uuid.uuid4().hex[:4]}"
            inprocs.append(
                in_child_process(
                    config_path,
                    rows(args.groups, args, f"{tag}i"),
                    rows(WARMUP_GROUPS, args, f"{tag}w"),
                    replica.pid,
                    work,
                )
            )
            buses.append(
                run_through_bus(
                    cfg,
                    config_path,
                    work,
                    make(rows(args.groups, args, f"{tag}b")),
                    make(rows(WARMUP_GROUPS, args, f"{tag}v")),
                    replica,
                )
            )
    finally:
        stop(replica)
        drop_topics(cfg.kafka, Topics.from_config(cfg.kafka).all())
    return combined(inprocs), combined(buses)


def combined(ways: list[Way]) -> Way:
    """Rounds of one way: the median wall and CPU, every group's times."""
    return Way(
        ways[0].name,
        wall_s=median([w.wall_s for w in ways]),
        group_s=[g for w in ways for g in w.group_s],
        delivery_s=[d for w in ways for d in w.delivery_s],
        cpu_s={name: median([w.cpu_s[name] for w in ways]) for name in ways[0].cpu_s},
        events=int(median([w.events for w in ways])),
    )


def report(kind: str, inproc: Way, bus: Way, args) -> None:
    sessions = args.groups * args.n
    turns = args.turns
    print(
        f"\nreplica: {kind}; {args.groups} groups x n={args.n}, {turns} turns of "
        f"{args.tokens_per_turn} tokens, concurrency {args.concurrency} groups; "
        f"median of {args.rounds} rounds"
    )
    print(f"{'way':<12} {'sessions/s':>10} {'group s (mean)':>15} {'delivery ms p50':>16}")
    for way in (inproc, bus):
        delivery = median(way.delivery_s) * 1000 if way.delivery_s else float("nan")
        group = sum(way.group_s) / len(way.group_s)
        print(f"{way.name:<12} {sessions / way.wall_s:>10.2f} {group:>15.3f} {delivery:>16.1f}")
    ratio = inproc.wall_s / bus.wall_s
    goal = " (goal >= 0.98)" if kind == "smollm2" else ""
    print(f"ratio bus/in-process sessions/s: {ratio:.3f}{goal}")
    # what the bus adds: wall time per unit of work at this throughput, and CPU per event
    per_session_ms = (bus.wall_s - inproc.wall_s) * 1000 / sessions
    events_per_session = bus.events / sessions
    cpu_ms = (sum(bus.cpu_s.values()) - sum(inproc.cpu_s.values())) * 1000 / bus.events
    print(
        f"added by the bus: {per_session_ms / turns:.2f} ms per turn and "
        f"{per_session_ms * args.n:.1f} ms per group of wall time at this throughput; "
        f"{cpu_ms:.3f} ms of CPU per turn event ({cpu_ms * events_per_session * args.n:.1f} "
        f"ms per group); delivery, last turn -> trainer: {median(bus.delivery_s) * 1000:.1f} ms "
        f"(p50); a group's time from group_started to its last turn: "
        f"{sum(bus.group_s) / len(bus.group_s) * 1000:.0f} ms (in-process: "
        f"{sum(inproc.group_s) / len(inproc.group_s) * 1000:.0f} ms)"
    )
    for way in (inproc, bus):
        cpu = ", ".join(f"{name} {s * 1e6 / bus.events:.0f}" for name, s in way.cpu_s.items())
        print(f"CPU us per turn event ({bus.events} events), {way.name}: {cpu}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--replicas", nargs="+", default=["smollm2", "instant"], choices=["smollm2", "instant"]
    )
    # the default sizes decode ~1,500 tokens per way with SmolLM2: a few minutes on two
    # busy cores, where the embedded replica samples 10-20 tokens/s
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="groups in flight")
    ap.add_argument("--rounds", type=int, default=2, help="of each way, alternating (2)")
    ap.add_argument("--serve-instant", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--run-in-process", nargs=2, type=Path, help=argparse.SUPPRESS)
    add_common_args(ap)
    args = ap.parse_args()
    if args.serve_instant:
        serve_instant(*args.serve_instant)
        return 0
    if args.run_in_process:
        run_in_process_main(*args.run_in_process)
        return 0
    if args.quick:
        args.replicas, args.groups, args.concurrency, args.rounds = ["instant"], 4, 2, 1
    results = {}
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        for kind in args.replicas:
            work = Path(tmp) / kind
            work.mkdir()
            results[kind] = run_replica(kind, bus.bootstrap, args, work)
    print(machine_line())
    for kind, (inproc, bus_way) in results.items():
        report(kind, inproc, bus_way, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
