"""What flows on ``rollout.control``: the trainer's policy versions.

A policy version is an event, not a setting: the trainer writes its weights to a folder
(Hugging Face format, safetensors) and then publishes ``PolicyVersionPublished``. Whatever
acts on versions reads them from the log: the weight sync that loads them into the
replicas, the dispatcher that bounds staleness, the trainer client that drops stale groups.
So a process that restarts catches up by reading the topic, never by being told again.

Every record is keyed by ``topics.control_key(type)``: one key per event type, so a
compacted read of the topic keeps the latest version (and the latest offset wins in a full
read, too: see ``rolloutbus.kafka.control.latest_policy_version``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rolloutbus.schemas.evolution import decode_json_record
from rolloutbus.schemas.version import SCHEMA_VERSION

POLICY_VERSION_TYPE: Literal["policy_version"] = "policy_version"
INT64_MAX = 2**63 - 1  # the trajectories' min/max_global_steps columns are int64

__all__ = [
    "POLICY_VERSION_TYPE",
    "as_policy_version",
    "PolicyVersionPublished",
    "decode_control_event",
    "encode_control_event",
]


class PolicyVersionPublished(BaseModel):
    """The trainer has weights for ``policy_version`` in ``weights_path``.

    ``policy_version`` is what the replicas report per token (vLLM's weight version, the
    ``weight_versions`` spans) and what the trajectories' ``min_global_steps`` /
    ``max_global_steps`` hold; ``global_step`` is the trainer's optimizer step that
    produced the weights (verl's ``global_steps``: with ``trigger_parameter_sync_step`` k,
    version v is published after step v·k). Version 0 with ``weights_path`` None is the
    initial weights: the replicas already serve them, nothing is loaded.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    type: Literal["policy_version"] = POLICY_VERSION_TYPE
    policy_version: int = Field(ge=0, le=INT64_MAX)
    # a folder the replicas can read (config.json + *.safetensors); None: initial weights
    weights_path: str | None = None
    global_step: int = Field(default=0, ge=0, le=INT64_MAX)
    trainer_id: str = ""
    published_at: float = Field(default_factory=time.time)  # seconds since the epoch
    # the model the weights belong to (``model.name``), so a replica serving another model
    # refuses the load by name instead of failing on a shape mismatch; "" when unknown
    model_name: str = ""


# One event type today; a union (``Field(discriminator="type")``) when a second one comes.
ControlEvent = PolicyVersionPublished


def encode_control_event(event: ControlEvent) -> bytes:
    return event.model_dump_json().encode()


_CONTROL_EVENT: TypeAdapter[ControlEvent] = TypeAdapter(ControlEvent)


def decode_control_event(value: bytes) -> ControlEvent:
    """Raises pydantic's ValidationError for a record that is not a control event,
    SchemaError for one of a schema version this reader cannot read (``evolution.py``)."""
    return decode_json_record(_CONTROL_EVENT, value, "control_event")


# vLLM's weight version label before any /update_weight_version: the initial weights
VLLM_INITIAL_LABEL = "default"


def as_policy_version(value: Any) -> int | None:
    """Policy versions are integers; an engine may report one as a string (vLLM's weight
    version labels are strings, and ``"default"`` until the first update: the initial
    weights, version 0). Anything else (None, a bool, another label) is no version."""
    if isinstance(value, bool):
        return None
    if value == VLLM_INITIAL_LABEL:
        return 0
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
