"""Agent loops: verl's public API, so a verl user's custom loop ports by changing imports.

verl: ``from verl.experimental.agent_loop.agent_loop import AgentLoopBase, register``
here: ``from rolloutbus.streams.agent_loop import AgentLoopBase, AgentLoopOutput, register``
(``rolloutbus.streams.agent_loop.agent_loop`` also works, mirroring verl's module path).
Importing this package registers the built-ins ``single_turn_agent`` and ``tool_agent``.
verl's own loop classes run through ``rolloutbus.streams.agent_loop.verl_adapter`` (which
imports verl only when used, so it is not imported here).
"""

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop.base import AgentLoopBase, DictConfigWrap, ToolListWrap
from rolloutbus.streams.agent_loop.continuous_token import (
    ContinuousTokenBuilder,
    MergeResult,
    ObservationTokens,
)
from rolloutbus.streams.agent_loop.registry import (
    _agent_loop_registry,
    create_agent_loop,
    load_agent_loop_config,
    register,
    registered_agent_loops,
    resolve_agent_name,
)
from rolloutbus.streams.agent_loop.single_turn import SingleTurnAgentLoop
from rolloutbus.streams.agent_loop.timing import simple_timer
from rolloutbus.streams.agent_loop.tool_agent import AgentData, AgentState, ToolAgentLoop
from rolloutbus.streams.agent_loop.tool_parser import FunctionCall, ToolParser
from rolloutbus.streams.agent_loop.tools import (
    BaseTool,
    FunctionTool,
    ToolResponse,
    function_tool,
)

__all__ = [
    "AgentData",
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AgentState",
    "BaseTool",
    "ContinuousTokenBuilder",
    "DictConfigWrap",
    "FunctionCall",
    "FunctionTool",
    "MergeResult",
    "ObservationTokens",
    "SingleTurnAgentLoop",
    "TokenOutput",
    "ToolAgentLoop",
    "ToolListWrap",
    "ToolParser",
    "ToolResponse",
    "_agent_loop_registry",
    "create_agent_loop",
    "function_tool",
    "load_agent_loop_config",
    "register",
    "registered_agent_loops",
    "resolve_agent_name",
    "simple_timer",
]
