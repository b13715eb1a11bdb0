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
        """verl's ``AgentLoopOutput.as_dict``, field for field: the fields that were set
        (pydantic's ``exclude_unset``), token fields renamed to verl V1's storage names as
        torch tensors (``prompts``/``responses``/``response_mask`` int64,
        ``rollout_log_probs`` float32), ``routed_experts`` as int16 aligned to the whole
        sequence (rows past what the engine recorded are zeros), ``rm_scores`` (the reward
        on the last token), ``extra_fields`` always present, and ``teacher_ids`` /
        ``teacher_logprobs`` moved out of ``extra_fields`` to the top level."""
        import torch  # only a caller of as_dict pays for torch (verl's return types)

        output = self.model_dump(exclude_unset=True)
        output["prompts"] = torch.tensor(output.pop("prompt_ids"), dtype=torch.int64)
        output["responses"] = torch.tensor(output.pop("response_ids"), dtype=torch.int64)
        output["response_mask"] = torch.tensor(output.pop("response_mask"), dtype=torch.int64)
        response_logprobs = output.pop("response_logprobs", None)
        if response_logprobs is not None:
            output["rollout_log_probs"] = torch.tensor(response_logprobs, dtype=torch.float32)
        routed_experts = output.pop("routed_experts", None)
        if routed_experts is not None:
            total = output["prompts"].size(0) + output["responses"].size(0)
            output["routed_experts"] = _aligned_routed_experts(routed_experts, total)
        reward_score = output.pop("reward_score", None)
        if reward_score is not None:
            rm_scores = torch.zeros_like(output["response_mask"], dtype=torch.float32)
            rm_scores[-1] = reward_score
            output["rm_scores"] = rm_scores
        # a default dict mutated in place is not in pydantic's fields-set (verl's comment)
        extra_fields = output.setdefault("extra_fields", self.extra_fields.copy())
        for key in ("teacher_ids", "teacher_logprobs"):
            value = extra_fields.pop(key, None)
            if value is not None:
                output[key] = value
        return output


def _aligned_routed_experts(routed_experts: Any, total_length: int) -> Any:
    """verl's alignment: int16 rows for every position of the sequence; the engine
    recorded only the tokens it fed through the model, the rest stay zero."""
    import numpy as np
    import torch

    experts = torch.as_tensor(np.asarray(routed_experts), dtype=torch.int16)
    aligned = experts.new_zeros((total_length, *experts.shape[1:]))
    rows = min(experts.size(0), total_length)
    aligned[:rows] = experts[:rows]
    return aligned
