"""What every subcommand shares: the config options and the handler's signature."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutbus.config import Config

Handler = Callable[[argparse.Namespace, Config], int]
# argparse's private _SubParsersAction: what add_subparsers() returns
Subcommands = Any


def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="YAML config file (ROLLOUTBUS__SECTION__KEY env vars override it)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def command(
    sub: Subcommands, name: str, handler: Handler, help: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand with the config options and its handler; the caller adds the rest."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, **kwargs)
    add_config(p)
    p.set_defaults(handler=handler)
    return p
