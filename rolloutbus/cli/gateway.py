"""``rolloutbus gateway``: the OpenAI-compatible endpoint for agents written outside the bus."""

from __future__ import annotations

import argparse

from rolloutbus.cli.common import Subcommands, command
from rolloutbus.config import Config, with_overrides


def cmd_gateway(args: argparse.Namespace, cfg: Config) -> int:
    from rolloutbus.kafka.admin import check_reachable
    from rolloutbus.streams.gateway.service import serve_gateway

    overrides = {"gateway.host": args.host, "gateway.port": args.port}
    cfg = with_overrides(cfg, {k: v for k, v in overrides.items() if v is not None})
    check_reachable(cfg.kafka)
    serve_gateway(cfg)  # prints its URL on stdout once listening; logs on stderr
    return 0


def register(sub: Subcommands) -> None:
    p = command(
        sub,
        "gateway",
        cmd_gateway,
        "serve OpenAI's /v1/chat/completions and Anthropic's /v1/messages to agents outside "
        "the bus: every call a turn on the turn log (docs/gateway.md)",
    )
    p.add_argument("--host", default=None, help="override gateway.host")
    p.add_argument("--port", type=int, default=None, help="override gateway.port (0: any free)")
