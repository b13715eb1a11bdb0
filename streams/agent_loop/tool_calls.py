"""One tool call of ``tool_agent``, as verl 0.9.1's ``ToolAgentLoop._call_tool`` makes it.

The pieces of the tool loop that do not depend on the loop's state: running a tool (a
function tool directly, a ``BaseTool`` through create → execute → release), verl's
truncation of a tool's text, the per-turn merge of a ``TokenOutput``'s preemptions and
extra fields into the trajectory's, and telling a subclass that still overrides
``_call_tool`` with this project's earlier ``(call, agent_data)`` signature.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.streams.agent_loop.tools import (
    FunctionTool,
    ToolResponse,
    normalize_function_tool_return,
)

logger = logging.getLogger(__name__)

# verl's markers: "left" keeps the tail, "right" keeps the head (verl PR #6313)
TRUNCATED_HEAD = "(truncated)..."  # in front of the kept tail ("left")
TRUNCATED_TAIL = "...(truncated)"  # after the kept head ("right")
TRUNCATED_MIDDLE = "...(truncated)..."

SPEC_DECODE_EXTRA_KEYS = (
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_num_verify_steps",
)

ToolResult = tuple[ToolResponse, float | None, dict[str, Any]]


async def execute_tool(
    tool: Any,
    name: str,
    args: Any,
    tools_kwargs: dict[str, Any],
    agent_data: Any,
    truncate: Callable[[str | None], str | None],
) -> ToolResult:
    """verl's dispatch: a function tool is called directly (``tools_kwargs`` unused, as in
    verl); a ``BaseTool`` is created with ``tools_kwargs[name]["create_kwargs"]``, executed
    with ``agent_data`` and released. A failure is verl's error text for the model, reward
    0.0; a tool's own text is truncated, the error text is not."""
    instance_id = None
    try:
        if is_function_tool(tool):
            response, reward, metrics = normalize_function_tool_return(await tool.call(args))
        else:
            create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs", {})
            instance_id, _ = await tool.create(create_kwargs=create_kwargs)
            result, reward, metrics = await tool.execute(instance_id, args, agent_data=agent_data)
            response = ToolResponse(text=result) if isinstance(result, str) else result
    except Exception as exc:  # noqa: BLE001 - any tool failure is data for the model, not a crash
        logger.warning("Error executing tool '%s': %s", name, exc)
        return ToolResponse(text=f"Error executing tool '{name}': {exc}"), 0.0, {}
    finally:
        if instance_id and not is_function_tool(tool):
            await tool.release(instance_id)
    return response.model_copy(update={"text": truncate(response.text)}), reward, metrics or {}


def truncate_text(text: str | None, limit: int, side: str) -> str | None:
    """Cap ``text`` at ``limit`` characters with verl's markers: ``left`` keeps the tail,
    ``right`` the head, ``middle`` both ends."""
    if not text or len(text) <= limit:
        return text
    if side == "left":
        return TRUNCATED_HEAD + text[-limit:]
    if side == "right":
        return text[:limit] + TRUNCATED_TAIL
    half = limit // 2
    return text[:half] + TRUNCATED_MIDDLE + text[-half:]


def merge_turn_fields(
    metrics: dict[str, Any], extra_fields: dict[str, Any], output: TokenOutput
) -> None:
    """verl's per-turn bookkeeping: ``num_preempted`` summed (-1 while unknown); the first
    turn's extra fields, then later turns' newest ``max_global_steps`` and the summed
    speculative-decoding counters."""
    preempted = output.num_preempted
    if metrics.get("num_preempted") is None:
        metrics["num_preempted"] = preempted if preempted is not None else -1
    else:
        metrics["num_preempted"] += preempted if preempted is not None else 0
    if not extra_fields:
        extra_fields.update(output.extra_fields)
        return
    newest = output.extra_fields.get("max_global_steps")
    if newest:
        extra_fields["max_global_steps"] = newest
    for key in SPEC_DECODE_EXTRA_KEYS:
        if key in output.extra_fields and key in extra_fields:
            extra_fields[key] = int(extra_fields[key]) + int(output.extra_fields[key])


def is_function_tool(tool: Any) -> bool:
    """Ours, or verl's ``FunctionTool`` carrier (a dataclass with ``fn`` and no life cycle)."""
    return isinstance(tool, FunctionTool) or (hasattr(tool, "fn") and not hasattr(tool, "create"))


def overrides_with_old_signature(cls: type, base: type) -> bool:
    """True when ``cls`` overrides ``base._call_tool`` with the earlier ``(call, agent_data)``."""
    method = None
    for klass in cls.__mro__:  # the nearest definition, unless it is the base's
        if klass is base:
            return False
        method = klass.__dict__.get("_call_tool")
        if method is not None:
            break
    if method is None:
        return False
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    return len(positional) == 2 and not variadic


def legacy_call_arguments(agent_data: Any, agent_data_type: type) -> tuple[dict[str, Any], Any]:
    """``(tools_kwargs, agent_data)`` for a call in the earlier ``(call, agent_data)`` form,
    with a DeprecationWarning; anything else is a TypeError naming verl's signature."""
    if not isinstance(agent_data, agent_data_type):
        raise TypeError("_call_tool(tool_call, tools_kwargs, agent_data) needs agent_data")
    warnings.warn(
        "_call_tool(call, agent_data) is deprecated: call "
        "_call_tool(tool_call, agent_data.tools_kwargs, agent_data) as verl does",
        DeprecationWarning,
        stacklevel=3,
    )
    kwargs: dict[str, Any] = getattr(agent_data, "tools_kwargs", None) or {}
    return kwargs, agent_data


def with_stop_tokens(sampling_params: dict[str, Any], stops: list[int]) -> dict[str, Any]:
    """The parser's stop tokens added to the request's own (verl stops after a call)."""
    if not stops:
        return sampling_params
    existing = list(sampling_params.get("stop_token_ids") or [])
    return {**sampling_params, "stop_token_ids": existing + [t for t in stops if t not in existing]}
