"""The ``rolloutbus`` command line. Data goes to stdout, logs and progress to stderr.

Exit codes: 0 success, 1 a runtime failure (broker down, replica error), 2 bad usage or
configuration (argparse's convention). One module per group of subcommands; each adds its
parsers in ``register`` and imports what its commands need inside them, so ``--help``
stays fast.

Every command takes hydra-style ``dotted.key=value`` overrides anywhere on its command line,
in verl's or our key names (``rolloutbus train actor_rollout_ref.rollout.n=8``). They are
taken out before argparse sees the line, so a subcommand's positionals never swallow one;
any other unknown token is still a usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rolloutbus import __version__
from rolloutbus.cli import configuration, console, data, gateway, monitoring, services, training
from rolloutbus.config import load_config
from rolloutbus.config_loading import split_overrides
from rolloutbus.errors import ConfigError, RolloutBusError

__all__ = ["build_parser", "main"]

log = logging.getLogger("rolloutbus")
_COMMAND_GROUPS = (services, data, training, monitoring, configuration, gateway)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolloutbus",
        description="verl's Agent Loop as an event-sourced streaming system on Kafka",
        epilog="Every command also takes KEY=VALUE config overrides (rollout.n=8, or verl's "
        "actor_rollout_ref.rollout.n=8); precedence: config file < ROLLOUTBUS__SECTION__KEY "
        "env vars < KEY=VALUE.",
    )
    parser.add_argument("--version", action="version", version=f"rolloutbus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in _COMMAND_GROUPS:
        group.register(sub)
    return parser


# options whose value may start with '-' (a relative time: --since -2h), which argparse
# would otherwise take for an option
_TIME_OPTIONS = ("--since", "--until")


def _join_relative_times(argv: list[str]) -> list[str]:
    """``--since -2h`` as ``--since=-2h`` (issue 30 item 6)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _TIME_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _join_relative_times(sys.argv[1:] if argv is None else argv)
    overrides, rest = split_overrides(argv)
    if not argv:  # a bare `rolloutbus` prints the help, as kubectl does (issue 30)
        build_parser().print_help()
        return 0
    args = build_parser().parse_args(rest)
    console.setup_logging(args.verbose)
    console.sigterm_as_ctrl_c()
    try:
        cfg = load_config(args.config, overrides=overrides)
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
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (console.sigterm_as_ctrl_c)
        print("rolloutbus: interrupted", file=sys.stderr)
        return 130
