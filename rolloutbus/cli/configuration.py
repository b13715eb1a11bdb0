"""`rolloutbus config`: the configuration as every other command would run with it."""

from __future__ import annotations

import argparse
import sys

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config


def cmd_config(args: argparse.Namespace, cfg: Config) -> int:
    import yaml

    # json mode: paths and tuples as plain YAML, secrets as "**********"
    yaml.safe_dump(cfg.model_dump(mode="json"), sys.stdout, sort_keys=False)
    return 0


def register(sub: Subcommands) -> None:
    command(
        sub,
        "config",
        cmd_config,
        "print the resolved configuration as YAML (file, env vars and KEY=VALUE overrides "
        "applied; a verl trainer file read into our keys, the ignored ones listed on stderr)",
    )
