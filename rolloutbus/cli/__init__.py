"""The ``rolloutbus`` command line. Data goes to stdout, logs and progress to stderr.

Exit codes: 0 success, 1 a runtime failure (broker down, replica error), 2 bad usage or
configuration (argparse's convention). One module per group of subcommands; each adds its
parsers in ``register`` and imports what its commands need inside them, so ``--help``
stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rolloutbus import __version__
from rolloutbus.cli import data, services, training
from rolloutbus.cli.console import setup_logging, sigterm_as_ctrl_c
from rolloutbus.config import load_config
from rolloutbus.errors import ConfigError, RolloutBusError

__all__ = ["build_parser", "main"]

log = logging.getLogger("rolloutbus")
COMMAND_GROUPS = (services, data, training)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolloutbus",
        description="verl's Agent Loop as an event-sourced streaming system on Kafka",
    )
    parser.add_argument("--version", action="version", version=f"rolloutbus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    sigterm_as_ctrl_c()
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"rolloutbus: {exc}", file=sys.stderr)
        return 2
    try:
        handled: int = args.handler(args, cfg)
        return handled
    except ConfigError as exc:
        print(f"rolloutbus: {exc}", file=sys.stderr)
        return 2
    except RolloutBusError as exc:
        print(f"rolloutbus: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (sigterm_as_ctrl_c)
        print("rolloutbus: interrupted", file=sys.stderr)
        return 130
