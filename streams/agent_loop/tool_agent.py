"""``tool_agent``: verl 0.9.1's tool-calling state machine over one append-only token stream.

PENDING → GENERATING ↔ PROCESSING_TOOLS → TERMINATED. ``rollout.response_length`` is a
budget for the whole trajectory (assistant turns + observations); an observation that
would reach it is dropped and the loop ends. verl's rules, kept here as verl has them:

- ``extra_info.tool_selection`` keeps the named tools that exist (unknown names are
  ignored); an empty or missing selection keeps all tools;
- a call that does not parse is dropped by the parser, so a turn whose only call is
  malformed ends the trajectory;
- unknown tools, invalid JSON and tool exceptions become verl's error texts, reward 0.0;
- tool text is capped at ``max_tool_response_length`` characters: ``left`` keeps the tail
  (``"(truncated)..." + tail``, verl PR #6313), ``right`` the head, ``middle`` both ends;
- ``extra_fields`` is ``agent_data.extra_fields``: the first turn's ``TokenOutput`` fields,
  later turns' ``max_global_steps`` and summed ``spec_*`` counters, plus whatever tools
  stored there during the trajectory.

verl's override points, with verl's signatures: ``_build_assistant_message(content,
agent_data)`` and ``_call_tool(tool_call, tools_kwargs, agent_data)``; a subclass that
still overrides ``_call_tool(call, agent_data)`` (this project's earlier signature) is
called that way, with a DeprecationWarning.

One addition: ``rollout.multi_turn.tool_timeout_s`` bounds each call (verl has none), an
overridden ``_call_tool`` included; a call that runs past it is answered with an error
text, reward 0.0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import warnings
from enum import Enum
from typing import Any

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop.base import (
    AgentLoopBase,
    DictConfigWrap,
    MultimodalUnsupportedError,
    ToolListWrap,
    mrope_inputs,
    multi_modal_inputs,
)
from rolloutbus.streams.agent_loop.continuous_token import ContinuousTokenError
from rolloutbus.streams.agent_loop.registry import register
from rolloutbus.streams.agent_loop.timing import simple_timer
from rolloutbus.streams.agent_loop.tool_calls import (  # noqa: F401 - markers re-exported
    TRUNCATED_HEAD,
    TRUNCATED_MIDDLE,
    TRUNCATED_TAIL,
    execute_tool,
    legacy_call_arguments,
    merge_turn_fields,
    overrides_with_old_signature,
    truncate_text,
    with_stop_tokens,
)
from rolloutbus.streams.agent_loop.tool_metrics import timed_tool_call
from rolloutbus.streams.agent_loop.tool_parser import (
    FunctionCall,
    ToolParser,
    assistant_tool_calls,
    rendered_tool_schema,
)
from rolloutbus.streams.agent_loop.tools import ToolResponse, load_tool_catalog
from rolloutbus.streams.agent_loop.tracing import rollout_trace_op, trace_span

logger = logging.getLogger(__name__)


class AgentState(Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


class AgentData:
    """All state of one trajectory; tools receive it as ``agent_data`` (verl's AgentData,
    with verl's constructor: ``messages, image_data, video_data, audio_data,
    mm_processor_kwargs, metrics, request_id, tools_kwargs``).

    Tools may keep session data in ``extra_fields``: it is the output's ``extra_fields``.
    ``tools`` (also verl's ``_active_tools``) are the tools this trajectory may call, after
    ``extra_info.tool_selection``.
    """

    def __init__(
        self,
        messages: list[dict[str, Any]],
        image_data: Any,
        video_data: Any,
        audio_data: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        request_id: str = "",
        tools_kwargs: dict[str, Any] | None = None,
        tools: dict[str, Any] | None = None,
    ):
        self.messages: list[dict[str, Any]] = messages
        self.image_data = image_data
        self.video_data = video_data
        self.audio_data = audio_data
        self.mm_processor_kwargs: dict[str, Any] = mm_processor_kwargs or {}
        self.metrics: dict[str, Any] = {} if metrics is None else metrics  # timings, preempted
        self.request_id: str = request_id
        self.tools_kwargs: dict[str, Any] = tools_kwargs or {}
        self.tools: dict[str, Any] = dict(tools or {})
        self.tool_schemas: list[dict[str, Any]] = [
            rendered_tool_schema(t.tool_schema) for t in self.tools.values()
        ]
        self.prompt_ids: list[int] = []  # the whole stream: prompt, then every turn
        self.mm_processor_output: list[dict[str, Any]] | None = None  # verl's SGLang payload
        self.response_ids: list[int] = []  # the last turn's sampled tokens
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.routed_experts: Any = None
        self.turn_scores: list[float] = []
        self.tool_rewards: list[float] = []
        self.user_turns = 0
        self.assistant_turns = 0
        self.tool_calls: list[FunctionCall] = []
        self.extra_fields: dict[str, Any] = {}

    @property
    def timings(self) -> dict[str, Any]:
        return self.metrics

    # verl's names of the per-trajectory tool selection
    @property
    def _active_tools(self) -> dict[str, Any]:
        return self.tools

    @property
    def _active_tool_schemas(self) -> list[dict[str, Any]]:
        return self.tool_schemas


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(
        self,
        trainer_config: DictConfigWrap,
        server_manager: Any,
        tokenizer: Any,
        processor: Any = None,
        tools: ToolListWrap | list[Any] | None = None,
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
        if isinstance(tools, ToolListWrap):
            tool_list = list(tools.tools)
        elif tools is not None:
            tool_list = list(tools)
        else:  # built outside the session runner (which loads them once): load them here
            tool_list = load_tool_catalog(mt.tool_config_path, mt.function_tool_path)
        self.tools = {tool.name: tool for tool in tool_list}
        self.tool_schemas = [rendered_tool_schema(tool.tool_schema) for tool in tool_list]
        self.tool_parser = ToolParser.get_tool_parser(mt.format, self.tokenizer)
        self.tool_parser_name = mt.format
        self._legacy_call_tool = overrides_with_old_signature(type(self), ToolAgentLoop)

    # ---- the loop ------------------------------------------------------------------------

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        images, videos = multi_modal_inputs(kwargs)
        if images is None and videos is None:
            media = await self.process_multi_modal_info(messages)
            images, videos = media.get("images"), media.get("videos")
        data = AgentData(
            messages=messages,
            image_data=images,
            video_data=videos,
            mm_processor_kwargs=self._get_mm_processor_kwargs(None),
            request_id=self.trajectory_request_id(kwargs),
            tools_kwargs=dict(kwargs.get("tools_kwargs") or {}),
            tools=self._selected_tools(kwargs.get("extra_info") or {}),
        )
        state = AgentState.PENDING
        while state != AgentState.TERMINATED:
            if state == AgentState.PENDING:
                state = await self._handle_pending_state(data, sampling_params)
            elif state == AgentState.GENERATING:
                state = await self._handle_generating_state(data, sampling_params)
            elif state == AgentState.PROCESSING_TOOLS:
                state = await self._handle_processing_tools_state(data)
        return self._build_output(data)

    def _selected_tools(self, extra_info: dict[str, Any]) -> dict[str, Any]:
        """verl: the named tools that exist; all tools when the selection is empty/missing."""
        selection = extra_info.get("tool_selection")
        if selection and self.tools:
            unknown = [name for name in selection if name not in self.tools]
            if unknown:
                logger.warning("tool_selection names unknown tools %s: ignored", unknown)
            return {name: self.tools[name] for name in selection if name in self.tools}
        return dict(self.tools)

    def _with_stop_tokens(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        return with_stop_tokens(sampling_params, self.tool_parser.stop_token_ids)

    async def _handle_pending_state(
        self, data: AgentData, sampling_params: dict[str, Any] | None = None
    ) -> AgentState:
        self._assert_mm_supported(bool(data.image_data or data.video_data))
        data.prompt_ids = await self.ct_build_initial_tokens(
            data.messages,
            tools=data.tool_schemas or None,
            images=data.image_data,
            videos=data.video_data,
        )
        return AgentState.GENERATING

    async def _handle_generating_state(
        self, data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        with simple_timer("generate_sequences", data.metrics):
            output: TokenOutput = await self.server_manager.generate(
                data.request_id,
                prompt_ids=list(data.prompt_ids),
                sampling_params=self._with_stop_tokens(sampling_params),
                image_data=data.image_data,
                video_data=data.video_data,
                mm_processor_kwargs=data.mm_processor_kwargs,
            )
        await self._record_turn(data, output)

        # verl's three checks, in verl's order
        if not ignore_termination and len(data.response_mask) >= self.response_length:
            return AgentState.TERMINATED
        if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
            return AgentState.TERMINATED
        if self.max_user_turns and data.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED

        schemas = [tool.tool_schema for tool in data.tools.values()]
        content, data.tool_calls = await self.tool_parser.extract_tool_calls(
            list(data.response_ids), schemas
        )
        data.messages.append(self._build_assistant_message(content, data))
        return AgentState.PROCESSING_TOOLS if data.tool_calls else AgentState.TERMINATED

    def _build_assistant_message(self, content: str, agent_data: AgentData) -> dict[str, Any]:
        """verl's override point: the assistant message appended for the turn just parsed
        (its text, and the first ``max_parallel_calls`` calls in OpenAI format)."""
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if agent_data.tool_calls:
            message["tool_calls"] = assistant_tool_calls(
                agent_data.tool_calls[: self.max_parallel_calls]
            )
        return message

    async def _record_turn(self, data: AgentData, output: TokenOutput) -> None:
        """Append the sampled tokens verbatim (mask 1, with their logprobs), as verl does."""
        merge_turn_fields(data.metrics, data.extra_fields, output)
        data.assistant_turns += 1
        data.response_ids = list(output.token_ids)
        logprobs = list(output.log_probs) if output.log_probs else None
        if data.assistant_turns > 1 and bool(logprobs) != bool(data.response_logprobs):
            # verl raises (a ValueError) when they stop, and misaligns when they start
            raise ContinuousTokenError(
                "the replica returned logprobs for some turns only; they cannot be aligned"
            )
        merge, mask, aligned = await self.ct_merge_assistant_token(
            data.prompt_ids,
            data.response_ids,
            data.response_mask,
            data.response_logprobs if (data.response_logprobs or logprobs) else None,
            assistant_logprobs=logprobs,
        )
        data.prompt_ids = merge.token_ids
        data.response_mask = mask
        if aligned is not None:
            data.response_logprobs = aligned
        if output.routed_experts is not None:
            data.routed_experts = output.routed_experts

    async def _handle_processing_tools_state(self, data: AgentData) -> AgentState:
        previous_messages = list(data.messages)
        calls = data.tool_calls[: self.max_parallel_calls]
        with simple_timer("tool_calls", data.metrics):
            responses = await asyncio.gather(
                *(timed_tool_call(call.name, self._timed_tool_call(call, data)) for call in calls)
            )

        new_messages = []
        for call, (response, reward, _metrics) in zip(calls, responses, strict=True):
            if response.video:
                raise NotImplementedError(
                    "Multimedia type 'video' is not currently supported. Only 'image' is supported."
                )
            if response.image:
                raise MultimodalUnsupportedError(
                    "a tool returned images: rolloutbus does not send tool images to the "
                    "model (text-only observations)"
                )
            message: dict[str, Any] = {"role": "tool", "content": response.text or ""}
            if call.tool_call_id is not None:
                message["tool_call_id"] = call.tool_call_id
            new_messages.append(message)
            if reward is not None:
                data.tool_rewards.append(reward)
        data.messages.extend(new_messages)

        merge, mask, logprobs = await self.ct_merge_context_msg(
            previous_messages,
            data.messages,
            data.prompt_ids,
            data.response_mask,
            data.response_logprobs if data.response_logprobs else None,
            tools=data.tool_schemas or None,
        )
        if len(mask) >= self.response_length:
            return AgentState.TERMINATED  # the observation would spend the budget: drop it
        data.prompt_ids = merge.token_ids
        data.response_mask = mask
        if data.response_logprobs:
            data.response_logprobs = logprobs or []
        data.user_turns += 1
        return AgentState.GENERATING

    # ---- tools ---------------------------------------------------------------------------

    async def _timed_tool_call(
        self, call: FunctionCall, data: AgentData
    ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        """One call through ``_call_tool`` (an override's too), within ``tool_timeout_s``
        (a rolloutbus addition), as one trace span."""
        with trace_span("tool_call", tool=call.name) as span:
            try:  # not wait_for, which swallows a cancellation as the tool returns (3.11)
                async with asyncio.timeout(self.tool_timeout_s):
                    result = await self._invoke_call_tool(call, data)
            except TimeoutError:
                logger.warning("tool %s timed out after %s s", call.name, self.tool_timeout_s)
                text = (
                    f"Error executing tool '{call.name}': timed out after {self.tool_timeout_s} s"
                )
                result = ToolResponse(text=text), 0.0, {}
            span["reward"] = result[1]
            return result

    def _invoke_call_tool(self, call: FunctionCall, data: AgentData) -> Any:
        if self._legacy_call_tool:
            warnings.warn(
                f"{type(self).__qualname__}._call_tool(call, agent_data) is deprecated: "
                "override verl's _call_tool(tool_call, tools_kwargs, agent_data)",
                DeprecationWarning,
                stacklevel=2,
            )
            return self._call_tool(call, data)
        return self._call_tool(call, data.tools_kwargs, data)

    async def _call_tool(
        self, tool_call: FunctionCall, tools_kwargs: Any, agent_data: AgentData | None = None
    ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        """verl's override point and dispatch: a function tool is called directly (its
        ``tools_kwargs`` unused, as in verl); a ``BaseTool`` is created with
        ``tools_kwargs[name]["create_kwargs"]``, executed and released. Every failure is
        verl's text for the model, reward 0.0; a tool's own text is truncated, verl's error
        texts are not. ``_call_tool(call, agent_data)`` (the earlier signature) still works,
        with a DeprecationWarning."""
        if agent_data is None:  # the earlier (call, agent_data): deprecated
            tools_kwargs, agent_data = legacy_call_arguments(tools_kwargs, AgentData)
        active = getattr(agent_data, "_active_tools", self.tools)
        if tool_call.name not in active:
            text = f"Unknown function '{tool_call.name}'. Available tools: {list(active)}"
            logger.warning(text)
            return ToolResponse(text=text), 0.0, {}
        try:
            args = json.loads(tool_call.arguments)
        except (json.JSONDecodeError, TypeError) as exc:
            text = f"Invalid JSON in arguments for '{tool_call.name}': {exc}"
            logger.warning(text)
            return ToolResponse(text=text), 0.0, {}
        tool = active[tool_call.name]
        return await execute_tool(
            tool, tool_call.name, args, tools_kwargs or {}, agent_data, self.truncate_tool_text
        )

    def truncate_tool_text(self, text: str | None) -> str | None:
        """Cap tool text at ``max_tool_response_length`` characters with verl's markers."""
        return truncate_text(text, self.max_tool_response_length, self.tool_response_truncate_side)

    # ---- output --------------------------------------------------------------------------

    def _build_output(self, data: AgentData) -> AgentLoopOutput:
        n_response = len(data.response_mask)
        split = len(data.prompt_ids) - n_response
        prompt_ids, response_ids = data.prompt_ids[:split], data.prompt_ids[split:]
        limit = self.response_length
        routed = data.routed_experts
        if routed is not None:
            routed = routed[: len(prompt_ids) + limit]
        preempted = data.metrics.get("num_preempted")
        metrics = AgentLoopMetrics(
            generate_sequences=data.metrics.get("generate_sequences", 0.0),
            tool_calls=data.metrics.get("tool_calls", 0.0),
            num_preempted=preempted if preempted is not None else -1,
        )
        multi_modal_data = {
            k: v
            for k, v in (
                ("images", data.image_data),
                ("videos", data.video_data),
                ("audios", data.audio_data),
            )
            if v is not None
        }
        extra_fields = data.extra_fields  # tools' session data stays (verl)
        extra_fields.update({"turn_scores": data.turn_scores, "tool_rewards": data.tool_rewards})
        extra_fields.update(mrope_inputs(self.processor, data.image_data))
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:limit],
            response_mask=data.response_mask[:limit],
            response_logprobs=data.response_logprobs[:limit] if data.response_logprobs else None,
            routed_experts=routed,
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=data.mm_processor_kwargs,
            num_turns=data.user_turns + data.assistant_turns + 1,
            metrics=metrics,
            extra_fields=extra_fields,
        )
