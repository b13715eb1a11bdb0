"""``tool_agent``: verl's tool-calling state machine over one append-only token stream.

PENDING → GENERATING ↔ PROCESSING_TOOLS → TERMINATED. ``rollout.response_length`` is a
budget for the whole trajectory (assistant turns + observations); an observation that
would reach it is dropped and the loop ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from enum import Enum
from typing import Any

from rolloutbus.errors import AgentLoopError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop.base import AgentLoopBase, DictConfigWrap, multi_modal_inputs
from rolloutbus.streams.agent_loop.registry import register
from rolloutbus.streams.agent_loop.timing import simple_timer
from rolloutbus.streams.agent_loop.tool_parser import FunctionCall, ToolParser, assistant_tool_calls
from rolloutbus.streams.agent_loop.tools import (
    BaseTool,
    FunctionTool,
    ToolResponse,
    load_tool_catalog,
)

logger = logging.getLogger(__name__)

# verl's markers, verl's sides: "left" keeps the head, "right" keeps the tail.
TRUNCATED_TAIL = "...(truncated)"
TRUNCATED_HEAD = "(truncated)..."
TRUNCATED_MIDDLE = "...(truncated)..."


class AgentState(Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


class AgentData:
    """All state of one trajectory; tools receive it as ``agent_data`` (verl's AgentData)."""

    def __init__(self, messages, image_data, video_data, request_id, tools_kwargs, tools):
        self.messages: list[dict[str, Any]] = messages
        self.image_data = image_data
        self.video_data = video_data
        self.request_id: str = request_id
        self.tools_kwargs: dict[str, Any] = tools_kwargs
        self.tools: dict[str, BaseTool] = tools  # after extra_info.tool_selection
        self.timings: dict[str, float] = {}
        self.num_preempted: int | None = None
        self.prompt_ids: list[int] = []  # the whole stream: prompt, then every turn
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.has_logprobs = False
        self.routed_experts: Any = None
        self.turn_scores: list[float] = []
        self.tool_rewards: list[float] = []
        self.user_turns = 0
        self.assistant_turns = 0
        self.tool_calls: list[FunctionCall] = []
        self.token_extra_fields: dict[str, Any] | None = None
        self.extra_fields: dict[str, Any] = {}  # free space for tools' session data


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(
        self,
        trainer_config: DictConfigWrap,
        server_manager: Any,
        tokenizer: Any,
        processor: Any = None,
        tools: list[BaseTool] | None = None,
        **kwargs: Any,
    ):
        super().__init__(trainer_config, server_manager, tokenizer, processor, **kwargs)
        mt = self.rollout_config.multi_turn
        self.max_user_turns = mt.max_user_turns
        self.max_assistant_turns = mt.max_assistant_turns
        self.max_parallel_calls = mt.max_parallel_calls
        self.max_tool_response_length = mt.max_tool_response_length
        self.tool_response_truncate_side = mt.tool_response_truncate_side
        self.tool_timeout_s = mt.tool_timeout_s
        self.prompt_length = self.rollout_config.prompt_length
        self.response_length = self.rollout_config.response_length
        tool_list = (
            list(tools)
            if tools is not None
            else load_tool_catalog(mt.tool_config_path, mt.function_tool_path)
        )
        self.tools = {tool.name: tool for tool in tool_list}
        self.tool_parser = ToolParser.get_tool_parser(mt.format, self.tokenizer)

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        images, videos = multi_modal_inputs(kwargs)
        data = AgentData(
            messages=list(kwargs["raw_prompt"]),
            image_data=images,
            video_data=videos,
            request_id=self.trajectory_request_id(kwargs),
            tools_kwargs=dict(kwargs.get("tools_kwargs") or {}),
            tools=self._selected_tools(kwargs.get("extra_info") or {}),
        )
        params = self._with_stop_tokens(sampling_params)
        state = AgentState.PENDING
        while state != AgentState.TERMINATED:
            if state == AgentState.PENDING:
                state = await self._handle_pending_state(data)
            elif state == AgentState.GENERATING:
                state = await self._handle_generating_state(data, params, kwargs)
            elif state == AgentState.PROCESSING_TOOLS:
                state = await self._handle_processing_tools_state(data)
        return self._build_output(data)

    def _selected_tools(self, extra_info: dict[str, Any]) -> dict[str, BaseTool]:
        selection = extra_info.get("tool_selection")
        if selection is None:
            return dict(self.tools)
        unknown = [name for name in selection if name not in self.tools]
        if unknown:
            raise AgentLoopError(
                f"extra_info.tool_selection names unknown tools {unknown}; known: "
                f"{sorted(self.tools)}"
            )
        return {name: self.tools[name] for name in selection}

    def _with_stop_tokens(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        stops = self.tool_parser.stop_token_ids
        if not stops:
            return sampling_params
        existing = list(sampling_params.get("stop_token_ids") or [])
        return {
            **sampling_params,
            "stop_token_ids": existing + [t for t in stops if t not in existing],
        }

    async def _handle_pending_state(self, data: AgentData) -> AgentState:
        schemas = [tool.get_openai_tool_schema() for tool in data.tools.values()]
        data.prompt_ids = await self.apply_chat_template(
            data.messages, tools=schemas or None, images=data.image_data, videos=data.video_data
        )
        return AgentState.GENERATING

    async def _handle_generating_state(
        self, data: AgentData, params: dict[str, Any], kwargs
    ) -> AgentState:
        extra = {"priority": kwargs["priority"]} if kwargs.get("priority") is not None else {}
        with simple_timer("generate_sequences", data.timings):
            output: TokenOutput = await self.server_manager.generate(
                data.request_id,
                prompt_ids=list(data.prompt_ids),
                sampling_params=params,
                image_data=data.image_data,
                video_data=data.video_data,
                **extra,
            )
        self._record_turn(data, output)

        # verl's three checks, in verl's order
        if len(data.response_mask) >= self.response_length:
            return AgentState.TERMINATED
        if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
            return AgentState.TERMINATED
        if self.max_user_turns and data.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED

        content, data.tool_calls = await self.tool_parser.extract_tool_calls(list(output.token_ids))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if data.tool_calls:
            message["tool_calls"] = assistant_tool_calls(data.tool_calls)
        data.messages.append(message)
        return AgentState.PROCESSING_TOOLS if data.tool_calls else AgentState.TERMINATED

    def _record_turn(self, data: AgentData, output: TokenOutput) -> None:
        """Append the sampled tokens verbatim (mask 1, with their logprobs)."""
        data.assistant_turns += 1
        tokens = list(output.token_ids)
        if data.assistant_turns > 1 and bool(output.log_probs) != data.has_logprobs:
            raise AgentLoopError(
                "the replica returned logprobs for some turns only; they cannot be aligned"
            )
        if output.log_probs:
            data.has_logprobs = True
            data.response_logprobs += list(output.log_probs)
        data.prompt_ids += tokens
        data.response_mask += [1] * len(tokens)
        if output.routed_experts is not None:
            data.routed_experts = output.routed_experts
        if output.num_preempted is not None:
            data.num_preempted = (data.num_preempted or 0) + output.num_preempted
        if data.token_extra_fields is None:
            data.token_extra_fields = dict(output.extra_fields)
        else:  # later turns update only the newest model version and the spec-decoding counters
            for key, value in output.extra_fields.items():
                if key == "max_global_steps" or key.startswith("spec_"):
                    data.token_extra_fields[key] = value

    async def _handle_processing_tools_state(self, data: AgentData) -> AgentState:
        calls = data.tool_calls[: self.max_parallel_calls]
        with simple_timer("tool_calls", data.timings):
            responses = await asyncio.gather(*(self._call_tool(call, data) for call in calls))

        new_messages = []
        for response, reward, _metrics in responses:
            if response.image is not None or response.video is not None:
                raise AgentLoopError("tools that return images or videos are not supported yet")
            new_messages.append({"role": "tool", "content": response.text or ""})
            if reward is not None:
                data.tool_rewards.append(reward)
        data.messages.extend(new_messages)

        observation = self.ct_builder.observation(data.prompt_ids, new_messages).token_ids
        if len(data.response_mask) + len(observation) >= self.response_length:
            return AgentState.TERMINATED  # the observation would spend the budget: drop it
        data.prompt_ids += observation
        data.response_mask += [0] * len(observation)
        if data.has_logprobs:
            data.response_logprobs += [0.0] * len(observation)
        data.user_turns += 1
        return AgentState.GENERATING

    # ---- tools ---------------------------------------------------------------------------

    async def _call_tool(
        self, call: FunctionCall, data: AgentData
    ) -> tuple[ToolResponse, float | None, dict]:
        """Run one call; every failure becomes error text with reward 0.0 for the model to read."""
        if self.tool_timeout_s is None:
            response = await self._run_tool_safely(call, data)
        else:
            try:
                response = await asyncio.wait_for(
                    self._run_tool_safely(call, data), self.tool_timeout_s
                )
            except TimeoutError:
                logger.warning("tool %s timed out after %s s", call.name, self.tool_timeout_s)
                text = (
                    f"Error when executing tool {call.name}: "
                    f"timed out after {self.tool_timeout_s} s"
                )
                return ToolResponse(text=text), 0.0, {}
        tool_response, reward, metrics = response
        tool_response = tool_response.model_copy(
            update={"text": self.truncate_tool_text(tool_response.text)}
        )
        return tool_response, reward, metrics

    async def _run_tool_safely(self, call: FunctionCall, data: AgentData):
        tool, instance_id = None, None
        try:
            tool = data.tools.get(call.name)
            if tool is None:
                raise AgentLoopError(f"unknown tool {call.name!r}; available: {sorted(data.tools)}")
            try:
                args = json.loads(call.arguments)
            except json.JSONDecodeError as exc:
                raise AgentLoopError(f"arguments of {call.name} are not valid JSON: {exc}") from exc
            if not isinstance(args, dict):
                raise AgentLoopError(f"arguments of {call.name} must be a JSON object")
            if isinstance(tool, FunctionTool):
                return await tool.call(args)
            create_kwargs = (data.tools_kwargs.get(call.name) or {}).get("create_kwargs", {})
            instance_id, _ = await tool.create(create_kwargs=create_kwargs)
            result, reward, metrics = await tool.execute(instance_id, args, agent_data=data)
            response = ToolResponse(text=result) if isinstance(result, str) else result
            return response, reward, metrics or {}
        except Exception as exc:  # noqa: BLE001 - any tool failure is data for the model, not a crash
            logger.warning("tool %s failed: %s", call.name, exc)
            return ToolResponse(text=f"Error when executing tool: {exc}"), 0.0, {}
        finally:
            if tool is not None and instance_id is not None:
                await tool.release(instance_id)

    def truncate_tool_text(self, text: str | None) -> str | None:
        """Cap tool text at ``max_tool_response_length`` characters with verl's markers."""
        limit = self.max_tool_response_length
        if not text or len(text) <= limit:
            return text
        if self.tool_response_truncate_side == "left":
            return text[:limit] + TRUNCATED_TAIL
        if self.tool_response_truncate_side == "right":
            return TRUNCATED_HEAD + text[len(text) - limit :]
        half = limit // 2
        return text[:half] + TRUNCATED_MIDDLE + text[len(text) - half :]

    # ---- output --------------------------------------------------------------------------

    def _build_output(self, data: AgentData) -> AgentLoopOutput:
        n_response = len(data.response_mask)
        split = len(data.prompt_ids) - n_response
        prompt_ids, response_ids = data.prompt_ids[:split], data.prompt_ids[split:]
        limit = self.response_length
        response_ids = response_ids[:limit]
        routed = data.routed_experts
        if routed is not None:
            routed = routed[: len(prompt_ids) + len(response_ids)]
        metrics = AgentLoopMetrics(
            generate_sequences=data.timings.get("generate_sequences", 0.0),
            tool_calls=data.timings.get("tool_calls", 0.0),
            num_preempted=data.num_preempted if data.num_preempted is not None else -1,
        )
        multi_modal_data = {
            k: v for k, v in (("images", data.image_data), ("videos", data.video_data)) if v
        }
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=data.response_mask[:limit],
            response_logprobs=data.response_logprobs[:limit] if data.has_logprobs else None,
            routed_experts=routed,
            multi_modal_data=multi_modal_data or None,
            num_turns=data.user_turns + data.assistant_turns + 1,
            metrics=metrics,
            extra_fields={
                **(data.token_extra_fields or {}),
                "turn_scores": data.turn_scores,
                "tool_rewards": data.tool_rewards,
            },
        )
