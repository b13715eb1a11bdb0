"""Seeing a run: the consumer-lag exporter, ``top`` and ``inspect``."""

from __future__ import annotations

import argparse
import json
import sys

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config, with_overrides

DEFAULT_TOP_INTERVAL_S = 2.0  # seconds between the two scrapes a rate is taken over


def cmd_lag_exporter(args: argparse.Namespace, cfg: Config) -> int:
    import signal
    import threading

    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.monitoring.lag_exporter import run_lag_exporter

    if args.port is not None:
        cfg = with_overrides(cfg, {"monitoring.lag_exporter_port": args.port})
    check_reachable(cfg.kafka)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_lag_exporter(cfg, stop, extra_trainer_groups=args.trainer_group or [])
    return 0


def cmd_top(args: argparse.Namespace, cfg: Config) -> int:
    import signal
    import threading

    from rolloutbus.monitoring.scrape import metrics_targets
    from rolloutbus.monitoring.top import run_top

    targets = metrics_targets(cfg)
    for extra in args.target or []:
        job, _, url = extra.rpartition("=")
        targets[job or url] = url
    # Ctrl-C or SIGTERM ends the view at once, between two scrapes (a handler of our own:
    # a shell starts a background job with SIGINT ignored)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_top(targets, once=args.once, interval_s=args.interval, stop=stop)
    return 0


def cmd_inspect(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.monitoring.trajectory_view import format_text, inspect_key

    check_reachable(cfg.kafka)
    tokenizer = None
    if not args.no_decode:
        from rolloutbus.models.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    view = inspect_key(cfg, args.key, tokenizer, start_offset=args.start_offset)
    if args.json:
        json.dump(view, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_text(view, show_tokens=args.tokens))
    return 0


def cmd_traces(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.monitoring.session_traces import otlp_traces, read_traces, send_otlp

    check_reachable(cfg.kafka)
    traces = read_traces(cfg, args.uid)
    if not traces:
        where = f"uid {args.uid}" if args.uid else "any session"
        print(f"no session attempts of {where} in the turn log", file=sys.stderr)
        return 1
    endpoint = args.otlp or cfg.monitoring.otlp_endpoint
    if endpoint is None:
        json.dump(otlp_traces(traces), sys.stdout)
        sys.stdout.write("\n")
        return 0
    sent = send_otlp(traces, endpoint)
    sessions = len({t.key for t in traces})
    print(f"sent {sent} spans of {sessions} sessions ({len(traces)} attempts) to {endpoint}")
    return 0


def register(sub: Subcommands) -> None:
    p = command(
        sub,
        "lag-exporter",
        cmd_lag_exporter,
        "serve every stage's consumer lag (records and seconds) for Prometheus",
    )
    p.add_argument("--port", type=int, default=None, help="override monitoring.lag_exporter_port")
    p.add_argument(
        "--trainer-group",
        action="append",
        default=None,
        help="another consumer group on the trajectory topic (repeatable; trainer.group_id "
        "is always watched)",
    )

    p = command(
        sub,
        "top",
        cmd_top,
        "a live view of the run from the processes' /metrics (the ports in the config)",
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_TOP_INTERVAL_S,
        help="seconds between scrapes (rates are taken over it)",
    )
    p.add_argument(
        "--target",
        action="append",
        default=None,
        help="another /metrics to read, as JOB=URL (repeatable)",
    )

    p = command(
        sub,
        "inspect",
        cmd_inspect,
        "show a trajectory (KEY) or a group (UID) turn by turn from the turn log",
    )
    p.add_argument("key", help="UID, UID_SESSION or a trajectory key UID_SESSION_OUTPUT")
    p.add_argument("--json", action="store_true", help="print JSON (every token and logprob)")
    p.add_argument("--tokens", action="store_true", help="list each sampled token and logprob")
    p.add_argument("--no-decode", action="store_true", help="token ids only (no tokenizer)")
    p.add_argument(
        "--start-offset",
        type=int,
        default=0,
        help="turn-log offset to start reading the uid's partition at",
    )

    p = command(
        sub,
        "traces",
        cmd_traces,
        "one OpenTelemetry trace per session, rebuilt from the turn log: sent to an OTLP "
        "receiver, or printed as OTLP JSON",
    )
    p.add_argument("uid", nargs="?", default=None, help="one group (default: every session)")
    p.add_argument(
        "--otlp",
        default=None,
        metavar="URL",
        help="OTLP/HTTP receiver, e.g. http://localhost:4318 (default: monitoring.otlp_endpoint; "
        "unset: print the JSON)",
    )
