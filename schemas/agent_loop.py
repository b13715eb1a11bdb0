"""verl's agent-loop data models, with verl's field names and defaults.

These are the boundary between an agent loop and Rollout Bus: a verl user's custom loop
builds ``AgentLoopOutput`` exactly as it does in verl
(``verl/experimental/agent_loop/agent_loop.py``), and the LLM client returns
``TokenOutput`` exactly as verl's replica does (``verl/workers/rollout/replica.py``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.schemas.tokens import Int32


class TokenOutput(BaseModel):
    """What one token-in/token-out generate() call returns."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any | None = None
    # "completed" (stop or length) or "aborted", as verl maps vLLM's finish reasons.
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = Field(default_factory=dict)


class AgentLoopMetrics(BaseModel):
    """Per-trajectory timings (seconds, summed over turns) and preemptions."""

    generate_sequences: float = 0
    tool_calls: float = 0
    compute_score: float = 0
    num_preempted: Int32 = -1  # -1: the backend did not report it; the int32 Arrow column


class AgentLoopOutput(BaseModel):
    """One trajectory as the policy lived it: prompt, then everything after it."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    response_ids: list[int]  # LLM tokens and observation tokens
    response_mask: list[int]  # 1 = sampled by the policy, 0 = tool/user/boundary
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] | None = None
    # verl 0.9.1: SGLang's video payload, reused by its teacher (OPD) path; None otherwise
    mm_processor_output: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """verl V1's storage view: renamed fields plus ``rm_scores`` (reward on the last token)."""
        out: dict[str, Any] = {
            "prompts": list(self.prompt_ids),
            "responses": list(self.response_ids),
            "response_mask": list(self.response_mask),
        }
        if self.response_logprobs is not None:
            out["rollout_log_probs"] = list(self.response_logprobs)
        if self.reward_score is not None:
            scores = [0.0] * len(self.response_ids)
            if scores:
                scores[-1] = float(self.reward_score)
            out["rm_scores"] = scores
        return out
