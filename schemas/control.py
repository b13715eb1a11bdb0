"""What flows on ``rollout.control``: the trainer's runs and their policy versions.

A policy version is an event, not a setting: the trainer writes its weights to a folder
(Hugging Face format, safetensors) and then publishes ``PolicyVersionPublished``. Whatever
acts on versions reads them from the log: the weight sync that loads them into the
replicas, the dispatcher that bounds staleness, the trainer client that drops stale groups.
So a process that restarts catches up by reading the topic, never by being told again.

**Runs.** Every version belongs to the run that published it: ``run_id`` names a training
run (it survives the trainer's restarts, stored in its checkpoints) and ``run_epoch``
counts trainer starts on these topics. Each start of ``rolloutbus train`` fences the
previous trainer (a transactional producer with the trainer role's fixed id) and writes
``RunStarted`` with ``run_epoch`` = the highest epoch on the topic + 1, before any version
of its own. Readers follow the newest epoch (``rolloutbus.kafka.version_ledger``): an older
epoch's records are ignored, and inside an epoch a version never goes backwards.

**Evolution.** Fields are only added, with defaults: a record written before runs existed
has no ``run_id``/``run_epoch`` and decodes as run epoch 0, which any real run supersedes.

Every record is keyed by ``topics.control_key(type, run_epoch)``: one key per event type
and run epoch, so a compacted topic keeps the latest version of every run (and a stray
record without a run cannot compact a real run's version away).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from rolloutbus.schemas.evolution import decode_json_record
from rolloutbus.schemas.version import SCHEMA_VERSION

POLICY_VERSION_TYPE: Literal["policy_version"] = "policy_version"
RUN_STARTED_TYPE: Literal["run_started"] = "run_started"
POLICY_VERSION_APPLIED_TYPE: Literal["policy_version_applied"] = "policy_version_applied"
INT64_MAX = 2**63 - 1  # the trajectories' min/max_global_steps columns are int64

__all__ = [
    "POLICY_VERSION_APPLIED_TYPE",
    "POLICY_VERSION_TYPE",
    "RUN_STARTED_TYPE",
    "AnyControlEvent",
    "ControlEvent",
    "PolicyVersionApplied",
    "PolicyVersionPublished",
    "RunStarted",
    "as_policy_version",
    "decode_control_event",
    "encode_control_event",
]


class PolicyVersionPublished(BaseModel):
    """The trainer has weights for ``policy_version`` in ``weights_path``.

    ``policy_version`` is what the replicas report per token (vLLM's weight version, the
    ``weight_versions`` spans) and what the trajectories' ``min_global_steps`` /
    ``max_global_steps`` hold; ``global_step`` is the trainer's optimizer step that
    produced the weights (verl's ``global_steps``: with ``trigger_parameter_sync_step`` k,
    version v is published after step v·k). Version 0 is a run's initial weights: with a
    ``weights_path`` (what ``rolloutbus train`` publishes, from its step-0 checkpoint) the
    replicas load them; without one they keep the weights they serve and only relabel.
    A version above 0 always names its weights.
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
    # the run that published it (see the module docstring); "" and 0: written before runs
    # existed, or by a publisher without one: superseded by any run
    run_id: str = ""
    run_epoch: int = Field(default=0, ge=0, le=INT64_MAX)


class RunStarted(BaseModel):
    """A trainer started (or restarted): from here on, ``run_epoch`` is the newest run.

    Written by the trainer, fenced (its transactional producer's ``init_transactions``
    came first), in the same transaction as the version it starts from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    type: Literal["run_started"] = RUN_STARTED_TYPE
    run_id: str = Field(min_length=1)
    run_epoch: int = Field(ge=1, le=INT64_MAX)
    trainer_id: str = ""
    started_at: float = Field(default_factory=time.time)  # seconds since the epoch
    # the prompt topic's end offsets (partition -> offset) when the run first started (kept
    # across the trainer's restarts): the groups dispatched before the run, which the
    # dispatcher does not count against the run's staleness bound; {}: unknown
    prompt_offsets: dict[int, int] = Field(default_factory=dict)


class PolicyVersionApplied(BaseModel):
    """``rolloutbus weight-sync`` has moved every replica in ``replicas.urls`` to
    ``policy_version`` of run ``run_epoch`` (the folder ``weights_path``): what an on-policy
    trainer waits for before it samples again (``rolloutbus.verl.applied``).

    Add-only: the version ledger ignores it (it changes no version), so readers that know
    it skip it. A reader older than this event refuses its type (schema-evolution.md: new
    event types need the readers upgraded first).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    type: Literal["policy_version_applied"] = POLICY_VERSION_APPLIED_TYPE
    policy_version: int = Field(ge=0, le=INT64_MAX)
    weights_path: str | None = None
    run_id: str = ""
    run_epoch: int = Field(default=0, ge=0, le=INT64_MAX)
    replicas: list[str] = Field(default_factory=list)  # the URLs that serve it
    applied_at: float = Field(default_factory=time.time)  # seconds since the epoch


def _event_type(value: Any) -> str | None:
    """The discriminator: a record without ``type`` is a policy version (the first and,
    for a while, the only control event)."""
    if isinstance(value, dict):
        found = value.get("type", POLICY_VERSION_TYPE)
        return found if isinstance(found, str) else None
    return getattr(value, "type", None)


ControlEvent = Annotated[
    Annotated[PolicyVersionPublished, Tag(POLICY_VERSION_TYPE)]
    | Annotated[RunStarted, Tag(RUN_STARTED_TYPE)]
    | Annotated[PolicyVersionApplied, Tag(POLICY_VERSION_APPLIED_TYPE)],
    Discriminator(_event_type),
]
AnyControlEvent = PolicyVersionPublished | RunStarted | PolicyVersionApplied
_CONTROL_EVENT: TypeAdapter[AnyControlEvent] = TypeAdapter(ControlEvent)


def encode_control_event(event: AnyControlEvent) -> bytes:
    return event.model_dump_json().encode()


def decode_control_event(value: bytes) -> AnyControlEvent:
    """Raises pydantic's ValidationError for a record that is not a control event (an
    unknown ``type`` included), SchemaError for one of a schema version this reader cannot
    read (``evolution.py``)."""
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
