"""Data in and out: datasets, publish, dispatch, consume, replay."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config
from rolloutbus.errors import ConfigError

log = logging.getLogger(__name__)


def cmd_dataset(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl

    rows = make_arithmetic_rows(args.count, seed=args.seed, tool_fraction=args.tool_fraction)
    path = write_jsonl(rows, args.out)
    print(path)
    return 0


def cmd_publish(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.producers.datasets import check_dataset
    from rolloutbus.producers.row_checks import RowChecker

    val = _val_flag(args)
    files = cfg.data.val_files if val else cfg.data.train_files  # as verl
    datasets = [args.dataset] if args.dataset is not None else [Path(p).expanduser() for p in files]
    if not datasets:
        key = "data.val_files" if val else "data.train_files"
        raise ConfigError(f"nothing to publish: give a DATASET or set {key}")
    for dataset in datasets:  # every file checked before anything is published
        check_dataset(dataset)
    checker = RowChecker(cfg)  # a broken loop config or reward function: exit 2 here
    if args.dry_run:
        return _dry_run(cfg, datasets, checker, val)
    return _publish(cfg, args, datasets, checker, val)


def _val_flag(args: argparse.Namespace) -> bool:
    if args.validate_deprecated:
        log.warning("--validate is deprecated: use --val (validation rows: val_kwargs apply)")
    return bool(args.val or args.validate_deprecated)


# publish's exit codes (docs/cli.md), a dry run's for the rows it would refuse
SOME_REFUSED = 3  # some rows published, the rest refused (dead-lettered)
ALL_REFUSED = 4  # rows were read and every one was refused: nothing published


def _publish(
    cfg: Config, args: argparse.Namespace, datasets: list[Path], checker: Any, val: bool
) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.producers.publish import PromptPublisher

    check_reachable(cfg.kafka)
    # each refused row is printed once below ("rows.jsonl:4: why"), not logged again
    logging.getLogger("rolloutbus.kafka.dead_letters").setLevel(logging.ERROR)
    publisher = PromptPublisher(cfg, checker)
    reports = []
    for dataset in datasets:
        report = publisher.publish_file(
            dataset,
            validate=val,
            global_steps=args.global_steps,
            epoch=args.epoch,
            progress=not args.quiet,
            on_refused=_print_refused,
        )
        for uid in report.uids or []:
            print(uid)
        _print_summary(
            f"{dataset}: read {report.read} rows: {report.published} published, "
            f"{report.dead_lettered} to the dead-letter topic",
            report,
        )
        reports.append(report)
    return _publish_exit_code(reports, "was published")


def _dry_run(cfg: Config, datasets: list[Path], checker: Any, val: bool) -> int:
    """Every check of a publish, no broker: what a publish would print, on the same streams
    (the uids on stdout, each refused row and the summary on stderr), and its exit code."""
    from rolloutbus.producers.publish import check_file

    reports = []
    for dataset in datasets:
        report = check_file(cfg, dataset, validate=val, checker=checker, on_refused=_print_refused)
        for uid in report.uids or []:
            print(uid)
        _print_summary(
            f"{dataset}: {report.read} rows: {report.published} would be published, "
            f"{report.dead_lettered} refused",
            report,
        )
        reports.append(report)
    return _publish_exit_code(reports, "would be published")


def _print_refused(row: Any) -> None:
    print(f"{row.source}: {row.problem}", file=sys.stderr)


def _print_summary(head: str, report: Any) -> None:
    """The file's line, then the refused rows counted per reason, then the notes."""
    print(head, file=sys.stderr)
    for kind, count in report.problems.most_common():
        print(f"{count:>7} refused: {kind}", file=sys.stderr)
    for note, count in report.notes.most_common():
        print(f"{count:>7} note: {note}", file=sys.stderr)


def _publish_exit_code(reports: list[Any], done: str) -> int:
    """0 when no row was refused, else SOME_REFUSED or ALL_REFUSED, said in a last line."""
    published = sum(r.published for r in reports)
    refused = sum(r.dead_lettered for r in reports)
    if refused == 0:
        return 0
    if published == 0:
        print(f"rolloutbus: no row {done}: all {refused} refused", file=sys.stderr)
        return ALL_REFUSED
    print(f"rolloutbus: {refused} of {published + refused} rows refused", file=sys.stderr)
    return SOME_REFUSED


def cmd_dispatch(args: argparse.Namespace, cfg: Config) -> int:
    import threading

    from rolloutbus.cli.console import stop_on_signals
    from rolloutbus.kafka.admin import check_reachable, ensure_topics
    from rolloutbus.monitoring.serving import serve_dispatch_metrics
    from rolloutbus.producers.datasets import check_dataset
    from rolloutbus.producers.dispatch import Dispatcher

    check_dataset(args.dataset)
    check_reachable(cfg.kafka)
    ensure_topics(cfg.kafka)
    dispatcher = Dispatcher(
        cfg, args.dataset, epochs=args.epochs, run_name=args.run_name, progress=not args.quiet
    )
    serve_dispatch_metrics(cfg, dispatcher)
    stop = threading.Event()
    # Ctrl-C/SIGTERM: stop after the group being published; what is out stays counted
    stop_on_signals(stop, "the group being published")
    report = dispatcher.run(stop)
    print(
        f"{args.dataset}: {report.started} groups started ({report.published} now, "
        f"{report.found_on_topic} found on the topic), {report.dead_lettered} rows to the "
        f"dead-letter topic, policy version {report.policy_version}, bound {report.bound}"
        + ("" if report.finished else " (stopped before the last epoch)"),
        file=sys.stderr,
    )
    return 0


def cmd_consume(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.consumers.report import consume_and_report
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.models.tokenizers import load_tokenizer

    if args.commit and args.group_id is None:
        raise ConfigError("--commit needs --group-id: the consumer group to commit in")
    check_reachable(cfg.kafka)
    consume_and_report(
        cfg,
        max_groups=args.max_groups,
        timeout_s=args.timeout,
        out=args.out,
        group_id=args.group_id,
        commit=args.commit,
        tokenizer=load_tokenizer(cfg.model),
        follow=args.follow,
    )
    return 0


def cmd_replay(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.consumers.log_replay import replay_turns
    from rolloutbus.consumers.report import BatchFile, print_table
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.models.tokenizers import load_tokenizer
    from rolloutbus.streams.assembly.replay_buffer import tune_gc_for_folding

    check_reachable(cfg.kafka)
    tune_gc_for_folding()  # it folds as the replay buffer does
    with contextlib.ExitStack() as stack:
        # the file is written as groups are released: a long replay holds no batches
        out = None if args.out is None else stack.enter_context(BatchFile(args.out))
        result = replay_turns(
            cfg,
            partitions=args.partition,
            start_offset=args.start_offset,
            end_offset=args.end_offset,
            uids=args.uid,
            since=args.since,
            until=args.until,
            keep_trajectories=out is None,  # the table needs them, the file only the batches
            batch_sink=None if out is None else out.write,
        )
    if args.out is None:
        # the text column decoded as consume decodes it (it was empty: issue 30)
        tokenizer = load_tokenizer(cfg.model) if result.trajectories else None
        print_table([], tokenizer, sys.stdout, trajectories=result.trajectories)
    print(
        f"replayed {result.events} turn events: {result.released} trajectories, "
        f"{len(result.open_groups)} groups not settled in range, {result.undecodable} undecodable",
        file=sys.stderr,
    )
    if result.groups_without_settings:
        print(
            f"{result.groups_without_settings} groups were logged without their settings: "
            "folded with this config's rollout.prompt_length/response_length",
            file=sys.stderr,
        )
    if result.missing_uids:
        print(f"not in the turn log range: {', '.join(result.missing_uids)}", file=sys.stderr)
    return 0


def log_time(text: str) -> float:
    """A point in time for ``--since``/``--until``: seconds since the epoch, an ISO 8601 time
    (without a zone: local time), or a time ago: ``-30s``, ``-15m``, ``-2h``, ``-1d``."""
    import re
    import time
    from datetime import datetime

    ago = re.fullmatch(r"-(\d+(?:\.\d+)?)([smhd])", text.strip())
    if ago:
        unit_s = {"s": 1, "m": 60, "h": 3600, "d": 86400}[ago[2]]
        return time.time() - float(ago[1]) * unit_s
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: give seconds since the epoch, an ISO 8601 time "
            "(2026-12-01T10:00:00, local unless it names a zone) or a time ago (-30m, -2h)"
        ) from None


def register(sub: Subcommands) -> None:
    _register_publish(sub)
    _register_dispatch(sub)
    _register_consume(sub)
    _register_replay(sub)
    _register_dataset(sub)


def _register_publish(sub: Subcommands) -> None:
    p = command(
        sub,
        "publish",
        cmd_publish,
        "publish a parquet/jsonl dataset (verl row format) as prompt groups",
        description="Publish each row as a prompt group: its uid on stdout; each refused row "
        "(FILE:LINE: why) and a summary on stderr. Exit 0: every row published; "
        f"{SOME_REFUSED}: some refused; {ALL_REFUSED}: all refused (nothing published); 1: a "
        "runtime failure (broker down); 2: bad usage or configuration.",
    )
    p.add_argument(
        "dataset",
        type=Path,
        nargs="?",
        default=None,
        help="a .parquet or .jsonl file (default: every file in data.train_files)",
    )
    p.add_argument(
        "--val", action="store_true", help="validation rows: val_kwargs apply (data.val_files)"
    )
    p.add_argument(
        "--validate",
        dest="validate_deprecated",
        action="store_true",
        help="deprecated alias of --val",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check on every row with no broker and publish nothing: the output "
        "and exit code a publish would give",
    )
    p.add_argument("--global-steps", type=int, default=0, help="trainer step at dispatch")
    p.add_argument(
        "--epoch",
        type=int,
        default=0,
        help="pass over the dataset: the same file, epoch and --global-steps publish the "
        "same uids, so a re-run adds nothing twice; a new epoch publishes new groups",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _register_dispatch(sub: Subcommands) -> None:
    p = command(
        sub,
        "dispatch",
        cmd_dispatch,
        "feed a dataset's prompt groups, epoch after epoch, within the staleness bound "
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


def _register_consume(sub: Subcommands) -> None:
    p = command(
        sub,
        "consume",
        cmd_consume,
        "look at complete groups as a trainer receives them; print a table (takes nothing "
        "from any trainer unless --commit)",
    )
    p.add_argument(
        "--max-groups", type=int, default=None, help="stop after this many groups (default: all)"
    )
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep waiting for new groups until Ctrl-C/SIGTERM; without it, stop at the end "
        "of the topic (as kcat -e, kafka-console-consumer --timeout-ms)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="also stop after this many seconds without a new group (default: no limit)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write the trajectories to this Arrow file"
    )
    p.add_argument(
        "--group-id",
        default=None,
        help="start where this consumer group stands (read without joining it); default: "
        "the beginning of the topic, in a throwaway group",
    )
    p.add_argument(
        "--commit",
        action="store_true",
        help="consume AS --group-id and commit: the groups received are used up for that "
        "group (a trainer in it never trains on them)",
    )


def _register_replay(sub: Subcommands) -> None:
    p = command(
        sub, "replay", cmd_replay, "rebuild trajectories from a range of the turn log (read-only)"
    )
    p.add_argument(
        "--partition",
        type=int,
        action="append",
        default=None,
        help="partition to replay (repeatable; default all)",
    )
    p.add_argument(
        "--start-offset", type=int, default=0, help="first offset of each partition to replay"
    )
    p.add_argument(
        "--end-offset", type=int, default=None, help="exclusive; default the current end"
    )
    p.add_argument(
        "--uid",
        action="append",
        default=None,
        help="replay only this prompt group (repeatable); only its partition is read",
    )
    p.add_argument(
        "--since",
        type=log_time,
        default=None,
        help="only groups started at or after this time (epoch seconds, ISO 8601, or -2h)",
    )
    p.add_argument(
        "--until",
        type=log_time,
        default=None,
        help="only groups started before this time (same forms as --since)",
    )
    p.add_argument("--out", type=Path, default=None, help="write an Arrow file instead of a table")


def _register_dataset(sub: Subcommands) -> None:
    p = command(
        sub, "dataset", cmd_dataset, "write the bundled arithmetic dataset (verl rows) as jsonl"
    )
    p.add_argument("out", type=Path, help="the .jsonl file to write")
    p.add_argument("--count", type=int, default=8, help="rows to write")
    p.add_argument("--seed", type=int, default=0, help="random seed of the questions")
    p.add_argument(
        "--tool-fraction",
        type=float,
        default=0.5,
        help="share of rows routed to tool_agent (the rest: single_turn_agent)",
    )
