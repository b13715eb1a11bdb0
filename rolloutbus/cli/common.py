"""What every subcommand shares: the config options and the handler's signature."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutbus.config import Config

OVERRIDES_HELP = (
    "KEY=VALUE arguments override config keys, in our or verl's names (rollout.n=8, "
    "actor_rollout_ref.actor.optim.lr=1e-6); precedence: --config file < "
    "ROLLOUTBUS__SECTION__KEY env vars < KEY=VALUE. `rolloutbus config` prints the result."
)
Handler = Callable[[argparse.Namespace, Config], int]
# argparse's private _SubParsersAction: what add_subparsers() returns
Subcommands = Any


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` gives every option's default (issue 30 item 11), except the empty ones
    (None, False, []) that would only add noise."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or action.default is False or action.default == []
        if empty or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        type=Path,
        action="append",
        default=None,
        help="YAML config file: ours, or a whole verl trainer config; repeatable: files merge "
        "in order, a later one winning key by key (as Hydra and kubectl); "
        "ROLLOUTBUS__SECTION__KEY env vars override them, and KEY=VALUE arguments (anywhere "
        "on the line, our or verl's key names: rollout.n=8, actor_rollout_ref.rollout.n=8) "
        "override all",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def command(
    sub: Subcommands, name: str, handler: Handler, help: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand with the config options and its handler; the caller adds the rest.
    Its own ``--help`` opens with ``help`` as a sentence unless ``description`` says more."""
    kwargs.setdefault("description", help[:1].upper() + help[1:] + ".")
    kwargs.setdefault("epilog", OVERRIDES_HELP)
    kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, **kwargs)
    add_config(p)
    p.set_defaults(handler=handler)
    return p
