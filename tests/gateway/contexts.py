"""The context a gateway gives its sessions, made for the tests that drive a
``GatewaySession`` in this process (no gateway server): ``gateway_context``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from rolloutbus.config import Config
from rolloutbus.streams.agent_loop.continuous_token import get_builder
from rolloutbus.streams.agent_loop.tool_parser import ToolParser
from rolloutbus.streams.gateway.session import GatewayContext
from rolloutbus.streams.reward import default_compute_score


def gateway_context(
    tok: Any,
    cfg: Config,
    llm_client: Any,
    emit: Callable[[BaseModel], Awaitable[None]],
    **template_kwargs: Any,
) -> GatewayContext:
    """As the gateway makes it for ``tok``'s model: prompts built by its chat template (with
    ``template_kwargs``), tool calls read by the hermes parser, the default scorer."""
    return GatewayContext(
        config=cfg,
        tokenizer=tok,
        llm_client=llm_client,
        emit=emit,
        builder=get_builder(tok, **template_kwargs),
        parser=ToolParser.get_tool_parser("hermes", tok),
        scorer=default_compute_score,
    )
