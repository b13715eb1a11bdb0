"""The dead-letter record: what could not be processed, where, and why. Nothing is lost."""

from __future__ import annotations

import base64
import time

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rolloutbus.schemas.evolution import decode_json_record
from rolloutbus.schemas.version import SCHEMA_VERSION


class DeadLetter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    stage: str  # "publish", "sessions", "replay_buffer", ...
    reason: str  # a sentence a person can act on
    source: str = ""  # file:line, or topic[partition]@offset
    original_b64: str  # the original bytes, exactly as received
    ts: float = Field(default_factory=time.time)

    @classmethod
    def of(cls, original: bytes, *, stage: str, reason: str, source: str = "") -> DeadLetter:
        return cls(
            stage=stage,
            reason=reason,
            source=source,
            original_b64=base64.b64encode(original).decode("ascii"),
        )

    @property
    def original(self) -> bytes:
        return base64.b64decode(self.original_b64)


_DEAD_LETTER = TypeAdapter(DeadLetter)


def decode_dead_letter(value: bytes) -> DeadLetter:
    """Raises pydantic's ValidationError for a record that is not a dead letter,
    SchemaError for one of a schema version this reader cannot read (``evolution.py``)."""
    return decode_json_record(_DEAD_LETTER, value, "dead_letter")
