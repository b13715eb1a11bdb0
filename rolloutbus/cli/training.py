"""`rolloutbus train` and `rolloutbus demo`: the runs that tie every service together."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config, with_overrides


def cmd_train(args: argparse.Namespace, cfg: Config) -> int:
    import threading

    from rolloutbus.cli.console import stop_on_signals
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
    # Ctrl-C/SIGTERM: finish the step in progress, save a checkpoint, exit 0; again: abort
    stop_on_signals(stop, "this step")
    summary = run_training(cfg, stop)
    print(summary.line(), file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.demo import run_demo
    from rolloutbus.monitoring.demo_picture import demo_monitoring

    if args.n is not None:
        cfg = with_overrides(cfg, {"rollout.n": args.n})
    with demo_monitoring(cfg, args.out) as cfg:  # metrics on; out/demo.png afterwards
        return run_demo(
            cfg, rows=args.rows, out=args.out, timeout_s=args.timeout, verbose=args.verbose
        )


def register(sub: Subcommands) -> None:
    p = command(
        sub,
        "train",
        cmd_train,
        "asynchronous off-policy GRPO on the trajectory topic; publishes policy versions",
    )
    p.add_argument("--steps", type=int, default=None, help="override trainer.total_training_steps")
    p.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="override trainer.default_local_dir"
    )
    p.add_argument(
        "--metrics-log", type=Path, default=None, help="override trainer.metrics_log (.jsonl/.csv)"
    )

    p = command(
        sub, "demo", cmd_demo, "the main job: broker, replica, workers, publish, consume, stop"
    )
    p.add_argument("--rows", type=int, default=6, help="prompt rows to publish")
    p.add_argument(
        "--n", type=int, default=2, help="sessions per prompt group (overrides rollout.n)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out/trajectories.arrow"),
        help="the Arrow file the received trajectories are written to",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for all groups")
