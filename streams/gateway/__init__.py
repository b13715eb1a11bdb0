"""The OpenAI-compatible gateway: agents written outside the bus (an OpenAI-SDK program, a
LangGraph graph, a coding agent in a sandbox) call ``/v1/chat/completions`` and every call
becomes a turn on the turn log, folded and released like a session worker's
(docs/gateway.md)."""

from rolloutbus.streams.gateway.alignment import Alignment, HistoryAligner, Transcript
from rolloutbus.streams.gateway.service import (
    GatewayHandle,
    gateway_in_thread,
    serve_gateway,
    start_gateway,
)
from rolloutbus.streams.gateway.session import GATEWAY_AGENT_NAME, GatewayContext, GatewaySession
from rolloutbus.streams.gateway.sessions import GatewaySessions

__all__ = [
    "GATEWAY_AGENT_NAME",
    "Alignment",
    "GatewayContext",
    "GatewayHandle",
    "GatewaySession",
    "GatewaySessions",
    "HistoryAligner",
    "Transcript",
    "gateway_in_thread",
    "serve_gateway",
    "start_gateway",
]
