"""``single_turn_agent``: one generate() call; every response token is an action."""

from __future__ import annotations

from typing import Any

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput
from rolloutbus.streams.agent_loop.base import AgentLoopBase, multi_modal_inputs
from rolloutbus.streams.agent_loop.registry import register
from rolloutbus.streams.agent_loop.timing import simple_timer


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        images, videos = multi_modal_inputs(kwargs)
        prompt_ids = await self.apply_chat_template(messages, images=images, videos=videos)

        timings: dict[str, float] = {}
        extra: dict[str, Any] = {}
        if kwargs.get("priority") is not None:
            extra["priority"] = kwargs["priority"]
        with simple_timer("generate_sequences", timings):
            token_output = await self.server_manager.generate(
                self.trajectory_request_id(kwargs),
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                image_data=images,
                video_data=videos,
                **extra,
            )

        limit = self.rollout_config.response_length
        response_ids = list(token_output.token_ids[:limit])
        logprobs = token_output.log_probs[: len(response_ids)] if token_output.log_probs else None
        routed = token_output.routed_experts
        if routed is not None:
            routed = routed[: len(prompt_ids) + len(response_ids)]
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
            response_ids=response_ids,
            response_mask=[1] * len(response_ids),
            response_logprobs=list(logprobs) if logprobs is not None else None,
            routed_experts=routed,
            multi_modal_data=multi_modal_data or None,
            num_turns=2,
            metrics=metrics,
            extra_fields={**token_output.extra_fields, "turn_scores": [], "tool_rewards": []},
        )
