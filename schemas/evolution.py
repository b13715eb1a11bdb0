"""How a reader treats a record written by another version (``docs/schema-evolution.md``).

* **Same ``SCHEMA_VERSION``, older writer** (an add-only change since): a field the record
  lacks takes its default. The models do that themselves (every new field has one).
* **Same ``SCHEMA_VERSION``, newer writer** (it added fields this reader does not know):
  the unknown fields are ignored, with one warning per field and process. An add-only
  field is, by the rule, safe to ignore; so producers and consumers can be upgraded in
  either order within a version.
* **Older ``SCHEMA_VERSION``** (a breaking change since): the record is upcast one version
  at a time by the upcasters registered here (``register_upcaster``), then read as usual.
  A reader keeps the upcaster from N-1 to N; a missing step is a ``SchemaError``.
* **Newer ``SCHEMA_VERSION``**: a ``SchemaError`` that names both versions (the record goes
  to the dead-letter topic, unchanged: upgrade the reader, then replay it).

JSON records (prompt groups, turn events, control events, dead letters) are read by
:func:`decode_json_record`; the trajectory's Arrow record by
``trajectories.decode_trajectory_batch``, with the same rules. A current record takes the
fast path: one pydantic ``validate_json``, nothing more.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from rolloutbus.errors import SchemaError
from rolloutbus.schemas import version

__all__ = [
    "RECORD_KINDS",
    "check_record_version",
    "decode_json_record",
    "register_upcaster",
    "upcast",
    "upcaster_steps",
    "warn_ignored",
]

T = TypeVar("T")
log = logging.getLogger(__name__)

# the records on the topics, by the name the upcasters are registered under
RECORD_KINDS = ("prompt_group", "turn_event", "control_event", "dead_letter", "trajectory")

# (kind, N): the function that turns a record of version N into one of version N + 1. JSON
# kinds get and return the record's dict; "trajectory" gets and returns a pa.RecordBatch.
_UPCASTERS: dict[tuple[str, int], Callable[[Any], Any]] = {}
_WARNED: set[tuple[str, str]] = set()  # (kind, field) ignored fields already warned about
# (kind, field) pairs remembered; past it unknown fields are still skipped, without a warning
# (a stream of ever new field names must not grow the process)
MAX_WARNED_FIELDS = 1024


def register_upcaster(
    kind: str, from_version: int
) -> Callable[[Callable[[T], T]], Callable[[T], T]]:
    """Decorator: ``fn`` upcasts a ``kind`` record of ``from_version`` to the next version."""
    if kind not in RECORD_KINDS:
        raise ValueError(f"record kind {kind!r} is not one of {RECORD_KINDS}")

    def register(fn: Callable[[T], T]) -> Callable[[T], T]:
        _UPCASTERS[(kind, from_version)] = fn
        return fn

    return register


def upcaster_steps(kind: str) -> set[int]:
    """The versions N that ``kind`` has an upcaster from (N to N + 1)."""
    return {n for k, n in _UPCASTERS if k == kind}


def check_record_version(kind: str, record_version: Any, record_type: Any = None) -> int:
    """The record's version as an int; SchemaError if it is not one or is newer than ours.
    ``record_type`` (an event's ``type``), when given, is named in the error."""
    what = f"{kind} record" if record_type is None else f"{kind} record of type {record_type!r}"
    if isinstance(record_version, bool) or not isinstance(record_version, int):
        raise SchemaError(f"a {what}'s schema version is {record_version!r}, not an integer")
    if record_version > version.SCHEMA_VERSION:
        raise SchemaError(
            f"a {what} was written with schema version {record_version}, newer than "
            f"this reader's {version.SCHEMA_VERSION}: upgrade the reader (the record is kept "
            "unchanged on its topic and in the dead-letter topic)"
        )
    return record_version


def upcast(kind: str, record: T, record_version: int) -> T:
    """``record`` (of ``record_version``) brought to ``SCHEMA_VERSION``, one step at a time
    (a dict record's ``schema_version`` is set to each step's version)."""
    for step in range(record_version, version.SCHEMA_VERSION):
        upcaster = _UPCASTERS.get((kind, step))
        if upcaster is None:
            raise SchemaError(
                f"a {kind} record of schema version {record_version} cannot be read: no "
                f"upcaster from version {step} to {step + 1} (see docs/schema-evolution.md)"
            )
        record = upcaster(record)
        if isinstance(record, dict):
            record["schema_version"] = step + 1
    return record


def warn_ignored(kind: str, fields: list[str]) -> None:
    """One warning per field and process: a newer writer's field this reader skips."""
    new = [f for f in fields if (kind, f) not in _WARNED]
    if new and len(_WARNED) < MAX_WARNED_FIELDS:
        _WARNED.update((kind, f) for f in new)
        log.warning(
            "ignoring %s field(s) %s: written by a newer version of the same schema version "
            "(%d); upgrade this process to read them",
            kind,
            ", ".join(new),
            version.SCHEMA_VERSION,
        )


def decode_json_record(adapter: TypeAdapter[T], data: bytes | str, kind: str) -> T:
    """A JSON record of ``kind`` as ``adapter``'s type, whatever version of the same
    ``SCHEMA_VERSION`` wrote it (see the module docstring). Raises pydantic's
    ValidationError for a record that is not one, SchemaError for a version it cannot read.
    """
    try:
        record = adapter.validate_json(data)
    except ValidationError as exc:
        return _decode_other_version(adapter, data, kind, exc)
    if getattr(record, "schema_version", version.SCHEMA_VERSION) == _written_version(record):
        return record
    return _decode_other_version(adapter, data, kind, None)


def _decode_other_version(
    adapter: TypeAdapter[T], data: bytes | str, kind: str, error: ValidationError | None
) -> T:
    fields = _json_object(data)
    if fields is None:
        if error is None:  # validated, yet not a JSON object: cannot happen for our models
            raise SchemaError(f"a {kind} record is not a JSON object")
        raise error
    record_version = check_record_version(
        kind, fields.get("schema_version", version.SCHEMA_VERSION), fields.get("type")
    )
    if record_version < version.SCHEMA_VERSION:
        return adapter.validate_json(json.dumps(upcast(kind, fields, record_version)))
    if error is None:  # the current version, already read: only the fast path gets here
        return adapter.validate_json(data)
    unknown = [e["loc"] for e in error.errors() if e["type"] == "extra_forbidden"]
    if len(unknown) < error.error_count() or not all(_drop(fields, loc) for loc in unknown):
        raise error  # not (only) a newer writer's fields: the record is bad
    warn_ignored(kind, [".".join(str(step) for step in loc) for loc in unknown])
    return adapter.validate_json(json.dumps(fields))


def _written_version(record: object) -> Any:
    """The version this code writes ``record``'s model with: ``SCHEMA_VERSION``, or a newer
    one for an event type that a reader of ``SCHEMA_VERSION`` must refuse rather than skip
    (``turns.GenerationChunk``: its model's own ``schema_version`` default)."""
    stamp = _version_default(type(record))
    return version.SCHEMA_VERSION if stamp is None else stamp


def _version_default(model: type) -> Any:
    """The default of ``model``'s ``schema_version`` field; None without one. Cached per
    type: pydantic's ``model_fields`` costs microseconds per read, and every record asks."""
    if model not in _VERSION_DEFAULTS:
        field = getattr(model, "model_fields", {}).get("schema_version")
        _VERSION_DEFAULTS[model] = None if field is None else field.default
    return _VERSION_DEFAULTS[model]


_VERSION_DEFAULTS: dict[type, Any] = {}


def _json_object(data: bytes | str) -> dict[str, Any] | None:
    try:
        fields = json.loads(data)
    except (ValueError, TypeError):  # not JSON (UnicodeDecodeError is a ValueError)
        return None
    return fields if isinstance(fields, dict) else None


def _drop(fields: dict[str, Any], loc: tuple[str | int, ...]) -> bool:
    """Delete the value at pydantic error location ``loc``; False if it is not there.

    A location may hold labels that are not keys (a tagged union's member, e.g. the
    ``generation`` of ``('generation', 'new_field')``): they are stepped over.
    """
    node: Any = fields
    for step in loc[:-1]:
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
        elif not isinstance(step, str):
            return False
    if isinstance(node, dict) and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False
