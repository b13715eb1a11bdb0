"""P10: a session worker's CPU per turn event as the sessions in flight grow (issue 28).

At each level L of sessions in flight (default 1, 16, 256, 1,024), a fresh process runs the
session runner (``run_group``, every turn through ``LLMClient`` over HTTP, events handed
to a no-op as durability_tax.py's in-process way does; the start-up heap settled as the
worker settles it, ``streams/sessions/heap.py``) against a scripted replica in
another process (a test double: fixed tokens after a delay). The delay grows with L
(``--cpu-budget-us`` x L per turn), so the replica holds about L requests at once while the
worker stays below one core: what is measured is the worker's cost per turn, not a queue.

Printed per level: the sessions in flight (mean of the client's in-flight count, sampled),
turns/s, the worker's CPU in microseconds per turn event and per generate call, and the
ratio of each to the smallest level's. Goal (issue 28): <= 300 us per turn event at every
level, the largest at most 1.5x the smallest.

    python benchmarks/worker_concurrency.py [--levels 1 16 256 1024] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from bench_harness import ROOT, machine_line, own_cpu_s
from durability_tax import FIXTURES, INSTANT_TOKEN, LOOP_NAME, LOOP_TARGET

from rolloutbus.config import Config
from tests.helpers import free_port

N = 4  # sessions per group
WAVES = 3  # measured groups per slot: each slot runs this many groups one after another
MIN_TURNS = 400  # generate calls measured at the least, so a small level is not noise
SAMPLE_EVERY_S = 0.05  # seconds between samples of the client's in-flight count


def serve(port: int, tokens: int, turn_s: float) -> None:
    """A scripted replica (a test double): ``tokens`` fixed ids over ``turn_s`` seconds."""
    from rolloutbus.config import ReplicaServerConfig
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
    from rolloutbus.replica.server import start_replica

    turn = ScriptedTurn(list(range(INSTANT_TOKEN, INSTANT_TOKEN + tokens)), finish_reason="length")
    engine = ScriptedEngine(
        lambda prompt: turn, max_model_len=1 << 20, token_delay_s=turn_s / tokens
    )
    cfg = Config(replica_server=ReplicaServerConfig(port=port, max_batch_size=4096))

    async def run() -> None:
        await start_replica(cfg, engine)
        await asyncio.Event().wait()

    asyncio.run(run())


def config(port: int, level: int, work: Path) -> dict[str, Any]:
    registry = work / "loops.yaml"
    registry.write_text(yaml.safe_dump([{"name": LOOP_NAME, "_target_": LOOP_TARGET}]))
    return {
        "model": {"name": "tiny-qwen3"},
        "replicas": {"urls": [f"http://127.0.0.1:{port}"], "request_timeout_s": 600},
        "rollout": {
            "n": N,
            "prompt_length": 256,
            "response_length": 4096,
            "agent": {"agent_loop_config_path": str(registry)},
        },
        "sessions": {"concurrency": max(1, level // N)},
    }


def rows(count: int, n: int, turns: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "uid": f"p10-{i:05d}",
            "__rollout_n__": n,
            "data_source": "p10",
            "agent_name": LOOP_NAME,
            "prompt": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            "extra_info": {"turns": turns, "tokens_per_turn": tokens, "tool_delay_s": 0.0},
        }
        for i in range(count)
    ]


def measure_main(config_path: Path, request_path: Path) -> None:
    """The child process: run the groups at one level, print one JSON line."""
    from rolloutbus.producers.publish import build_group

    cfg = Config.model_validate(yaml.safe_load(config_path.read_text()))
    spec = json.loads(request_path.read_text())
    groups = [build_group(cfg, r) for r in spec["rows"]]
    print(json.dumps(asyncio.run(_measure(cfg, groups, spec["warmup"], spec["client"]))))


def _transport(client: str) -> Any:
    """The HTTP transport under LLMClient: its default (aiohttp's pool) or, as the
    baseline, httpx's own pool with the limits LLMClient used before."""
    import httpx

    if client == "aiohttp":
        return None
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)
    )


async def _measure(cfg: Config, groups: list, warmup: int, http_client: str) -> dict[str, Any]:
    from rolloutbus.models.tokenizers import load_tokenizer
    from rolloutbus.streams.agent_loop import registry
    from rolloutbus.streams.inference.llm_client import LLMClient
    from rolloutbus.streams.sessions.heap import settle_start_up_heap
    from rolloutbus.streams.sessions.runner import SessionContext, run_group

    sys.path.insert(0, str(FIXTURES))
    registry.load_agent_loop_config(cfg.rollout.agent.agent_loop_config_path)
    client = LLMClient(cfg.replicas, cfg.rollout, transport=_transport(http_client))
    ctx = SessionContext(config=cfg, tokenizer=load_tokenizer(cfg.model), llm_client=client)
    settle_start_up_heap()  # as the worker does once it is built (streams/sessions/heap.py)
    slots = asyncio.Semaphore(cfg.sessions.concurrency)
    counts = {"events": 0, "generations": 0}

    async def count(event: Any) -> None:
        counts["events"] += 1
        counts["generations"] += getattr(event, "type", "") == "generation"

    async def one(group: Any) -> None:
        async with slots:
            await run_group(ctx, group, count)

    await asyncio.gather(*(one(g) for g in groups[:warmup]))
    counts.update(events=0, generations=0)
    in_flight: list[float] = []
    sampling = asyncio.create_task(_sample_in_flight(client.metrics.in_flight, in_flight))
    cpu0, wall0 = own_cpu_s(), time.perf_counter()
    await asyncio.gather(*(one(g) for g in groups[warmup:]))
    cpu, wall = own_cpu_s() - cpu0, time.perf_counter() - wall0
    sampling.cancel()
    await client.close()
    busy = sorted(in_flight)[len(in_flight) // 10 :]  # drop the ramp down at the end
    return {
        **counts,
        "cpu_s": cpu,
        "wall_s": wall,
        "in_flight": sum(busy) / max(1, len(busy)),
    }


async def _sample_in_flight(gauge: Any, samples: list[float]) -> None:
    """The client's own gauge of generate calls in flight, summed over replicas. Only that
    gauge is read: collecting the whole registry (process and GC collectors included) cost
    about a tenth of the worker's CPU at 1 session in flight, and it is no worker cost."""
    while True:
        await asyncio.sleep(SAMPLE_EVERY_S)
        samples.append(sum(s.value for family in gauge.collect() for s in family.samples))


def run_level(level: int, client: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    port = free_port()
    turn_s = max(0.005, level * args.cpu_budget_us * 1e-6)
    replica = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), str(args.tokens_per_turn), str(turn_s)],
        stdout=(work / f"replica-{level}.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        cfg_path = work / f"config-{level}.yaml"
        cfg_path.write_text(yaml.safe_dump(config(port, level, work)))
        slots = max(1, level // N)
        n = level if level < N else N
        measured = max(slots * WAVES, math.ceil(args.min_turns / (n * args.turns)))
        spec = {
            "rows": rows(slots + measured, n, args.turns, args.tokens_per_turn),
            "warmup": slots,
            "client": client,
        }
        request = work / f"request-{level}.json"
        request.write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, __file__, "--measure", str(cfg_path), str(request)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if done.returncode != 0:
            raise SystemExit(f"level {level} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        replica.terminate()
        replica.wait()


def _wait_http(url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s")


def report(results: dict[tuple[str, int], dict[str, Any]]) -> None:
    """A row per client and level; each against its client's first level, and aiohttp's
    (the default) against the httpx baseline at the same level when both ran."""
    print(machine_line())
    print(
        f"{'client':>8} {'sessions':>8} {'in flight':>9} {'turns/s':>8} {'us/event':>9} "
        f"{'us/turn':>8} {'vs first':>8} {'vs httpx':>8}"
    )
    first: dict[str, float] = {}
    for (client, level), r in results.items():
        per_event = _per_event(r)
        per_turn = r["cpu_s"] * 1e6 / max(1, r["generations"])
        first.setdefault(client, per_event)
        baseline = results.get(("httpx", level))
        versus = f"{per_event / _per_event(baseline):>7.2f}x" if baseline else f"{'':>8}"
        print(
            f"{client:>8} {level:>8} {r['in_flight']:>9.0f} {r['generations'] / r['wall_s']:>8.0f} "
            f"{per_event:>9.0f} {per_turn:>8.0f} {per_event / first[client]:>7.2f}x {versus}"
        )


def _per_event(result: dict[str, Any]) -> float:
    return float(result["cpu_s"]) * 1e6 / max(1, result["events"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--turns", type=int, default=4, help="generations per session")
    ap.add_argument("--tokens-per-turn", type=int, default=16)
    ap.add_argument(
        "--min-turns", type=int, default=MIN_TURNS, help="generate calls measured at the least"
    )
    ap.add_argument(
        "--cpu-budget-us",
        type=float,
        default=2000.0,
        help="replica delay per turn per session in flight (us): keeps the worker under a core",
    )
    ap.add_argument(
        "--clients",
        nargs="+",
        choices=["aiohttp", "httpx"],
        default=["aiohttp", "httpx"],
        help="HTTP pools to measure: aiohttp (LLMClient's default) and httpx's (the baseline)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="2 small levels, aiohttp only: a smoke run"
    )
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), int(args.serve[1]), float(args.serve[2]))
        return 0
    if args.measure:
        measure_main(*args.measure)
        return 0
    if args.quick:
        args.levels, args.turns, args.min_turns, args.clients = [1, 4], 1, 4, ["aiohttp"]
    if any(level < 1 for level in args.levels):
        ap.error("--levels must be at least 1")
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for level in args.levels:
            for client in args.clients:
                print(
                    f"[p10] {level} sessions in flight, {client} ...", file=sys.stderr, flush=True
                )
                results[(client, level)] = run_level(level, client, args, Path(tmp))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
