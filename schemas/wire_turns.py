"""Turn events' token arrays decoded at the wire by msgspec, kept as numpy (issue 28 item 2).

``decode_token_event`` reads a ``generation``, ``generation_chunk``, ``observation`` or
``segment_started`` record (its prompt ids) into a ``WireTokens``: the ids (and logprobs) as
read-only numpy arrays straight from the base64 bytes, with no Python int per token. It
returns None for anything it does not cover (another event type, another schema version,
routed experts, JSON lists of ids, a record msgspec rejects), so the caller falls back to
``turns.decode_turn_event`` and schema evolution and dead-letter reasons stay exactly as
they are there.

What the fold reads of a generation's ``extra_fields`` is kept: ``min_global_steps`` (the
turn's first policy version, ``token_stream.generation_versions``), when it is an integer or
a string; any other value of it falls back. The rest of ``extra_fields`` (finish reason,
replica, ...) is for a resumed session, which reads the log with pydantic, not for the fold.
A record without ``ts`` falls back too (pydantic stamps the clock's time there).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from rolloutbus.schemas.turns import GENERATION_CHUNK_VERSION
from rolloutbus.schemas.version import SCHEMA_VERSION

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_VERSION_OF_TYPE = {
    "generation": SCHEMA_VERSION,
    "observation": SCHEMA_VERSION,
    "generation_chunk": GENERATION_CHUNK_VERSION,
    "segment_started": SCHEMA_VERSION,
}


class WireTokens(msgspec.Struct, frozen=True):
    """What the fold needs from a token-carrying turn event; the arrays are numpy."""

    type: str
    uid: str
    session_id: int
    attempt: str
    seq: int
    ts: float
    segment: int
    turn: int | None  # None for a segment_started, whose token_ids are its prompt ids
    token_ids: np.ndarray
    logprobs: np.ndarray | None
    policy_version: int | None
    index: int | None  # a chunk's place in its turn; None for another event
    start: int | None  # a chunk's first token within its turn; None for another event
    # a generation's extra_fields["min_global_steps"], as logged (int, str or None)
    min_global_steps: int | str | None = None


class _Session(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    # Each event's fields, typed as pydantic reads them, and no other: a record pydantic
    # would refuse (an unknown field, a wrong type) is refused here too and falls back, so
    # its dead-letter reason stays pydantic's.
    uid: str
    session_id: int
    attempt: str
    segment: int
    schema_version: int = SCHEMA_VERSION
    seq: int = 0
    ts: float  # required: a record without it takes pydantic's default, the clock's time


class _SegmentStarted(_Session, tag="segment_started"):
    prompt_ids: bytes  # base64 in the JSON, decoded by msgspec (~4x binascii's speed)


class _Base(_Session):
    turn: int
    token_ids: bytes


class _Observation(_Base, tag="observation"):
    pass


class _Chunk(_Base, tag="generation_chunk"):
    index: int
    start: int
    logprobs: bytes | None = None
    policy_version: int | None = None
    replica: str = ""


class _Generation(_Base, tag="generation"):
    logprobs: bytes | None = None
    policy_version: int | None = None
    replica: str = ""
    engine_request_id: str = ""
    stop_reason: str | None = None
    num_preempted: int | None = None
    latency_s: float = 0.0
    extra_fields: dict[str, msgspec.Raw] = {}
    routed_experts: None = None  # routed experts: pydantic's path reads them


_Event = _Generation | _Chunk | _Observation | _SegmentStarted
_DECODER = msgspec.json.Decoder(_Event)
_MIN_GLOBAL_STEPS = msgspec.json.Decoder(int | str | None)


def _array(raw: bytes, dtype: np.dtype) -> np.ndarray | None:
    if len(raw) % dtype.itemsize:
        return None
    return np.frombuffer(raw, dtype=dtype)


def _covered(event: _Event) -> bool:
    if _VERSION_OF_TYPE[_tag(event)] != event.schema_version:
        return False
    ranges = [event.seq, event.segment, getattr(event, "turn", 0), getattr(event, "index", 0)]
    ranges.append(getattr(event, "start", 0))
    version = getattr(event, "policy_version", None)
    return (
        min(ranges) >= 0
        and math.isfinite(event.ts)
        and 0 <= event.session_id <= 2**31 - 1
        and (version is None or -(2**63) <= version < 2**63)
    )


def _tag(event: _Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def _min_global_steps(event: _Event) -> tuple[bool, int | str | None]:
    """(readable, value) of a generation's extra_fields["min_global_steps"]: readable when
    absent, null, an integer or a string (``as_policy_version`` reads those alike)."""
    raw = getattr(event, "extra_fields", {}).get("min_global_steps")
    if raw is None:
        return True, None
    try:
        return True, _MIN_GLOBAL_STEPS.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False, None


def decode_token_event(data: bytes) -> WireTokens | None:
    """The record's tokens as numpy, or None when ``turns.decode_turn_event`` must read it."""
    try:
        event = _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if not _covered(event):
        return None
    if isinstance(event, _SegmentStarted):
        raw_ids, turn = event.prompt_ids, None
    else:
        raw_ids, turn = event.token_ids, event.turn
    token_ids = _array(raw_ids, _I32)
    logprobs_raw = getattr(event, "logprobs", None)
    logprobs = None if logprobs_raw is None else _array(logprobs_raw, _F32)
    if token_ids is None or (logprobs_raw is not None and logprobs is None):
        return None
    readable, min_global_steps = _min_global_steps(event)
    if not readable:
        return None
    return WireTokens(
        type=_tag(event),
        uid=event.uid,
        session_id=event.session_id,
        attempt=event.attempt,
        seq=event.seq,
        ts=event.ts,
        segment=event.segment,
        turn=turn,
        token_ids=token_ids,
        logprobs=logprobs,
        policy_version=getattr(event, "policy_version", None),
        index=getattr(event, "index", None),
        start=getattr(event, "start", None),
        min_global_steps=min_global_steps,
    )
