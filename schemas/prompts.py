"""What enters: a dataset row in verl's format, and the prompt group built from it."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.evolution import decode_json_record
from rolloutbus.schemas.tokens import INT32_MAX, Int64
from rolloutbus.schemas.version import SCHEMA_VERSION
from rolloutbus.topics import KEY_SEPARATOR

ROLES = {"system", "user", "assistant", "tool"}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: str
    content: Any = ""

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {sorted(ROLES)}")
        return role


class DatasetRow(BaseModel):
    """verl's row format. Extra columns are kept and passed to the agent loop.

    ``agent_name`` is different from the other optional fields: its *absence* means
    "use agent.default_agent_loop", while an explicit null is an error at routing time
    (as in verl), so the row is stored as the dict it came in, never re-serialized
    with defaults filled in.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    data_source: str = ""
    prompt: list[Message] = Field(min_length=1)
    agent_name: str | None = None
    reward_model: dict[str, Any] | None = None
    extra_info: dict[str, Any] | None = None
    uid: str | None = None  # the group's uid, when the dataset names its groups itself

    @field_validator("prompt", mode="before")
    @classmethod
    def _chat_messages(cls, prompt: Any) -> Any:
        # pydantic's own message ("Input should be a valid list") does not say what was meant
        if isinstance(prompt, str | bytes):
            raise ValueError(
                "must be a list of chat messages [{'role': ..., 'content': ...}], "
                "got a string (is data.prompt_key the messages column?)"
            )
        return prompt

    @field_validator("uid")
    @classmethod
    def _usable_uid(cls, uid: str | None) -> str | None:
        return None if uid is None else check_uid_text(uid)


class GroupSamplingParams(BaseModel):
    """How every session of a prompt group samples: verl's ``rollout.*`` (or ``val_kwargs``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    logprobs: bool = True  # rollout.calculate_log_probs
    seed: int | None = None


def group_sampling_params(rollout: RolloutConfig, validate: bool = False) -> GroupSamplingParams:
    """verl's agent-loop path: rollout.temperature/top_p/top_k, or val_kwargs' when
    validating (``val_kwargs.do_sample`` is not read there: temperature 0 is greedy)."""
    if validate:
        v = rollout.val_kwargs
        return GroupSamplingParams(
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=v.top_k,
            repetition_penalty=rollout.repetition_penalty,
            logprobs=rollout.calculate_log_probs,
        )
    return GroupSamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        repetition_penalty=rollout.repetition_penalty,
        logprobs=rollout.calculate_log_probs,
    )


# The name before the engine's and the client's sampling models got their own names; kept so
# existing imports of ``rolloutbus.schemas.SamplingParams`` still work.
SamplingParams = GroupSamplingParams


class PromptGroup(BaseModel):
    """One prompt, to be rolled out n times. Key: uid; partition: partition_for(uid)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_version: int = SCHEMA_VERSION
    uid: str
    row: dict[str, Any]  # the dataset row exactly as published (see DatasetRow)
    n: int = Field(ge=1, le=INT32_MAX)  # the trajectories' group_size column is int32
    validate_: bool = Field(default=False, alias="validate")
    sampling_params: GroupSamplingParams
    global_steps: Int64 = 0  # int64, as the trajectory's global_steps column
    policy_version: Int64 = 0
    created_at: float = Field(default_factory=time.time)

    @field_validator("uid")
    @classmethod
    def _usable_uid(cls, uid: str) -> str:
        return check_uid_text(uid)

    @field_validator("row")
    @classmethod
    def _verl_row(cls, row: dict[str, Any]) -> dict[str, Any]:
        # The publisher's own check, again where the group is read: a row that is not a
        # verl row (a string prompt, a non-dict reward_model ...) is dead-lettered by the
        # session worker instead of reaching the agent loop and, through the turn log, the
        # trajectory's typed prompt columns (where it stops the replay buffer). The row
        # itself is kept as it came (agent_name absent and null mean different things).
        DatasetRow.model_validate(row)
        return row


_PROMPT_GROUP = TypeAdapter(PromptGroup)


def decode_prompt_group(value: bytes) -> PromptGroup:
    """Raises pydantic's ValidationError for a record that is not a prompt group,
    SchemaError for one of a schema version this reader cannot read (``evolution.py``)."""
    return decode_json_record(_PROMPT_GROUP, value, "prompt_group")


def check_uid_text(uid: str) -> str:
    """A uid is the first segment of every key: non-empty, without the key separator."""
    if not uid or KEY_SEPARATOR in uid:
        raise ValueError(f"uid {uid!r} must be non-empty and contain no {KEY_SEPARATOR!r}")
    return uid
