"""``single_turn_agent``: one generate() call; every response token is an action.

verl 0.9.1's ``SingleTurnAgentLoop`` step for step: media from the row (or the messages),
the CT prompt, one ``generate`` with ``priority`` and ``data.mm_processor_kwargs``, the
sampled tokens merged as assistant tokens, and the output capped at
``rollout.response_length`` (with verl's ``multi_modal_data`` and ``mm_processor_kwargs``).
"""

from __future__ import annotations

from typing import Any

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput
from rolloutbus.streams.agent_loop.base import AgentLoopBase, mrope_inputs, multi_modal_inputs
from rolloutbus.streams.agent_loop.registry import register
from rolloutbus.streams.agent_loop.timing import simple_timer
from rolloutbus.streams.agent_loop.tracing import rollout_trace_op


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        images, videos = multi_modal_inputs(kwargs)
        if images is None and videos is None:
            media = await self.process_multi_modal_info(messages)
            images, videos = media.get("images"), media.get("videos")
        mm_processor_kwargs = self._get_mm_processor_kwargs(None)
        self._assert_mm_supported(bool(images or videos))
        prompt_ids = await self.ct_build_initial_tokens(messages, images=images, videos=videos)

        timings: dict[str, float] = {}
        extra: dict[str, Any] = {}
        if kwargs.get("priority") is not None:
            extra["priority"] = int(kwargs["priority"])  # np.int64 from a dataset: plain int
        with simple_timer("generate_sequences", timings):
            token_output = await self.server_manager.generate(
                self.trajectory_request_id(kwargs),
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                image_data=images,
                video_data=videos,
                mm_processor_kwargs=mm_processor_kwargs,
                **extra,
            )
        logprobs_in = list(token_output.log_probs) if token_output.log_probs else None
        merge, mask, logprobs = await self.ct_merge_assistant_token(
            prompt_ids,
            list(token_output.token_ids),
            [],
            [] if logprobs_in else None,
            assistant_logprobs=logprobs_in,
        )
        split = len(merge.token_ids) - len(mask)
        prompt_ids, response_ids = merge.token_ids[:split], merge.token_ids[split:]

        limit = self.rollout_config.response_length
        routed = token_output.routed_experts
        if routed is not None:
            routed = routed[: len(prompt_ids) + limit]
        metrics = AgentLoopMetrics(
            generate_sequences=timings["generate_sequences"],
            num_preempted=token_output.num_preempted
            if token_output.num_preempted is not None
            else -1,
        )
        multi_modal_data = {
            k: v for k, v in (("images", images), ("videos", videos)) if v is not None
        }
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:limit],
            response_mask=mask[:limit],
            response_logprobs=logprobs[:limit] if logprobs else None,
            routed_experts=routed,
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=mm_processor_kwargs,
            num_turns=2,
            metrics=metrics,
            extra_fields={
                **token_output.extra_fields,
                "turn_scores": [],
                "tool_rewards": [],
                **mrope_inputs(self.processor, images),
            },
        )
