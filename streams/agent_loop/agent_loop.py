"""verl's module path, ``verl.experimental.agent_loop.agent_loop``, as an alias."""

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput
from rolloutbus.streams.agent_loop.base import AgentLoopBase, DictConfigWrap, ToolListWrap
from rolloutbus.streams.agent_loop.registry import _agent_loop_registry, register

__all__ = [
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "DictConfigWrap",
    "ToolListWrap",
    "_agent_loop_registry",
    "register",
]
