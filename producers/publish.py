"""Publish dataset rows as prompt groups to rollout.prompts; bad rows go to rollout.dlq.

**Idempotent publish.** A group's uid is the row's own ``uid`` column when it has one, else
derived from (dataset identity, row index, epoch, global_steps, validate): the identity is
the SHA-256 of the file's bytes, so the same file publishes the same uids wherever it lies,
and an edited file is a new dataset. Re-running a publish after a partial failure therefore
re-sends the same uids (keyed records, partition by uid) and adds no second group:

* the replay buffer folds one group per uid: a uid already released is ignored (it keeps
  the newest ``replay_buffer.max_released_uids`` releases per partition, read back from the
  released-groups topic after a restart); a uid still open gets the duplicate's sessions
  folded in, first terminal attempt per session wins;
* the trainer client drops a trajectory key it has already yielded (the last safety net).

The session worker does run a duplicate's sessions again: the cost of a re-publish is the
rollouts of the rows sent twice, never a second group. Publishing the same rows again *on
purpose* (another epoch) takes ``epoch=`` (``rolloutbus publish --epoch``).

Rows are validated where they enter: a verl row (``DatasetRow``), ``n`` within
``limits.max_n``, the record within ``kafka.max_message_bytes``, and what
``row_checks.RowChecker`` checks (a registered agent loop, a scorer for the row's
``data_source``, the prompt's length); anything else is a dead letter whose reason names the
row, and no session starts for it. ``check_file`` runs the same checks with no broker
(``rolloutbus publish --dry-run``).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import broker_error, idempotent_producer
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.producers.datasets import BadRow, RawRow, count_rows, read_rows
from rolloutbus.producers.multimodal import build_multimodal_row
from rolloutbus.producers.row_checks import (
    BAD_N,
    DUPLICATE_UID,
    NOT_A_VERL_ROW,
    TOO_LARGE,
    UNREADABLE,
    RowChecker,
    RowProblem,
    problem_kind,
)
from rolloutbus.schemas.prompts import (
    DatasetRow,
    GroupSamplingParams,
    PromptGroup,
    group_sampling_params,
)
from rolloutbus.topics import Topics, partition_for

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 60.0  # seconds to drain the producer at the end of a publish
LINGER_MS = 20  # ms a record waits to batch with others; publishing is bulk, not latency-bound
HASH_CHUNK_BYTES = 1 << 20  # bytes read at a time while hashing a dataset file
UID_BYTES = 16  # bytes of digest in a derived uid: 32 hex characters, like a uuid4's hex
UID_SCHEME = "rolloutbus-uid-v1"  # versions the derivation: changing it changes every uid


@dataclass
class PublishReport:
    """What a publish did (or, from ``check_file``, would do) with a dataset's rows."""

    published: int = 0
    dead_lettered: int = 0
    uids: list[str] | None = None
    # why rows were refused: kind -> rows, and the first such row's reason as an example
    problems: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)  # note -> rows that passed with it

    @property
    def read(self) -> int:
        return self.published + self.dead_lettered

    def refuse(self, problem: RowProblem) -> None:
        self.dead_lettered += 1
        self.problems[problem.kind] += 1
        self.examples.setdefault(problem.kind, str(problem))

    def summary(self) -> list[str]:
        """One line per reason a row was refused (most frequent first), then the notes."""
        lines = [
            f"{count:>7} {kind}; first: {self.examples[kind]}"
            for kind, count in self.problems.most_common()
        ]
        lines += [f"{count:>7} note: {note}" for note, count in self.notes.most_common()]
        return lines


@dataclass(frozen=True)
class CheckedRow:
    """One dataset row after every check: its group and record, or why it is refused."""

    source: str
    group: PromptGroup | None = None
    value: bytes | None = None  # the record of a row that passed
    problem: RowProblem | None = None
    original: bytes = b""  # a refused row's bytes, for its dead letter
    notes: tuple[str, ...] = ()


def new_uid() -> str:
    return uuid.uuid4().hex  # no "_": the uid is the first segment of every key


def dataset_identity(path: str | Path) -> str:
    """SHA-256 of the file's bytes: the dataset's identity for derived uids."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def derive_uid(
    dataset_id: str,
    row_index: int,
    *,
    epoch: int = 0,
    global_steps: int = 0,
    validate: bool = False,
) -> str:
    """The uid of row ``row_index`` of a dataset in one epoch: the same inputs, the same uid
    (hex, so it never holds the key separator ``_``)."""
    parts = [
        UID_SCHEME,
        dataset_id,
        str(row_index),
        str(epoch),
        str(global_steps),
        "validate" if validate else "train",
    ]
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=UID_BYTES).hexdigest()


def sampling_params(cfg: Config, validate: bool) -> GroupSamplingParams:
    """verl's agent-loop path: rollout.temperature/top_p/top_k, or val_kwargs' when
    validating (``val_kwargs.do_sample`` is not read there: temperature 0 is greedy)."""
    return group_sampling_params(cfg.rollout, validate)


def build_group(
    cfg: Config,
    row: dict[str, Any],
    *,
    validate: bool = False,
    global_steps: int = 0,
    policy_version: int = 0,
    uid: str | None = None,
) -> PromptGroup:
    """Validate a row and wrap it; raises ValueError (with the reason) for a bad row.

    The uid is the row's ``uid`` column if it has one, else ``uid``, else a random one.
    """
    row = _prompt_from_column(row, cfg.data.prompt_key)
    row = build_multimodal_row(row, cfg.data.image_key)  # verl's <image> → content parts
    checked = DatasetRow.model_validate(row)
    row = dict(row)
    n = _group_size(cfg, row.pop("__rollout_n__", None), validate)
    do_sample = row.pop("__do_sample__", None)
    params = sampling_params(cfg, validate)
    if do_sample is False and not validate:  # verl: a per-row greedy override, training only
        params = params.model_copy(update={"temperature": 0.0, "top_p": 1.0, "top_k": -1})
    return PromptGroup(
        uid=checked.uid or uid or new_uid(),
        row=row,
        n=n,
        validate=validate,
        sampling_params=params,
        global_steps=global_steps,
        policy_version=policy_version,
    )


def encode_group(cfg: Config, group: PromptGroup) -> bytes:
    """The record value; ValueError if it is over ``kafka.max_message_bytes``."""
    value = group.model_dump_json(by_alias=True).encode()
    if len(value) > cfg.kafka.max_message_bytes:
        raise RowProblem(
            TOO_LARGE,
            f"the prompt group is {len(value)} bytes, over kafka.max_message_bytes "
            f"({cfg.kafka.max_message_bytes})",
        )
    return value


def _group_size(cfg: Config, override: Any, validate: bool) -> int:
    """``n``: the row's ``__rollout_n__``, else rollout.n (val_kwargs.n when validating)."""
    if override is None:
        n = cfg.rollout.val_kwargs.n if validate else cfg.rollout.n
    elif isinstance(override, int) and not isinstance(override, bool):
        n = override
    else:
        raise RowProblem(BAD_N, f"__rollout_n__ must be an integer, got {override!r}")
    if not 1 <= n <= cfg.limits.max_n:
        raise RowProblem(BAD_N, f"n = {n} is outside 1..{cfg.limits.max_n} (limits.max_n)")
    return n


def _prompt_from_column(row: dict[str, Any], prompt_key: str) -> dict[str, Any]:
    """verl's ``data.prompt_key``: the column holding the chat messages becomes ``prompt``,
    the field every agent loop reads."""
    if prompt_key == "prompt":
        return row
    if prompt_key not in row:
        raise RowProblem(
            NOT_A_VERL_ROW,
            f"the row has no {prompt_key!r} column (data.prompt_key); columns: {sorted(row)}",
        )
    if "prompt" in row:  # two candidate prompts: refuse rather than drop one silently
        raise RowProblem(
            NOT_A_VERL_ROW,
            f"the row has both {prompt_key!r} (data.prompt_key) and 'prompt' columns",
        )
    row = dict(row)
    row["prompt"] = row.pop(prompt_key)
    return row


def check_rows(
    cfg: Config,
    path: str | Path,
    checker: RowChecker,
    *,
    validate: bool = False,
    global_steps: int = 0,
    epoch: int = 0,
    dataset_id: str | None = None,
) -> Iterator[CheckedRow]:
    """Every row of the file (up to ``data.*_max_samples``), checked, with its derived uid:
    the same file, epoch, global_steps and validate flag give the same uids
    (``dataset_id`` replaces the file's content hash as its identity)."""
    identity = dataset_id or dataset_identity(path)
    rows_by_uid: dict[str, str] = {}  # a row's own uid -> that row, within this file
    data = cfg.data
    limit = data.val_max_samples if validate else data.train_max_samples  # verl: > 0 caps
    for index, item in enumerate(read_rows(path)):
        if 0 < limit <= index:  # the first `limit` rows (verl draws them at random)
            break
        uid = derive_uid(identity, index, epoch=epoch, global_steps=global_steps, validate=validate)
        yield _check_row(
            cfg, checker, item, rows_by_uid, uid=uid, validate=validate, global_steps=global_steps
        )


def _check_row(
    cfg: Config,
    checker: RowChecker,
    item: RawRow | BadRow,
    rows_by_uid: dict[str, str],
    **kw: Any,
) -> CheckedRow:
    if isinstance(item, BadRow):
        return CheckedRow(
            item.source, problem=RowProblem(UNREADABLE, item.reason), original=item.original
        )
    try:
        group = build_group(cfg, item.data, **kw)
        value = encode_group(cfg, group)
        if "uid" in item.data:  # derived uids are distinct by construction
            _check_unused(group.uid, item.source, rows_by_uid)
        notes = checker.check(group)
    except (ValidationError, ValueError) as exc:
        original, cut = _letter_original(_json_bytes(item.data), cfg.kafka.max_message_bytes)
        reason = _row_reason(exc) + cut
        return CheckedRow(
            item.source, problem=RowProblem(problem_kind(exc), reason), original=original
        )
    return CheckedRow(item.source, group=group, value=value, notes=tuple(notes))


def check_file(
    cfg: Config,
    path: str | Path,
    *,
    validate: bool = False,
    checker: RowChecker | None = None,
    on_refused: Callable[[CheckedRow], None] | None = None,
) -> PublishReport:
    """``rolloutbus publish --dry-run``: every check a publish makes, with no broker; nothing
    is published. ``published`` counts the rows that would be, ``dead_lettered`` the rest;
    ``on_refused`` is called with each refused row as it is found."""
    report = PublishReport(uids=[])
    for row in check_rows(cfg, path, checker or RowChecker(cfg), validate=validate):
        _tally(row, report, on_refused)
    return report


def _tally(
    row: CheckedRow, report: PublishReport, on_refused: Callable[[CheckedRow], None] | None
) -> None:
    if row.problem is not None:
        report.refuse(row.problem)
        if on_refused is not None:
            on_refused(row)
        return
    assert row.group is not None and report.uids is not None
    report.published += 1
    report.uids.append(row.group.uid)
    report.notes.update(row.notes)


class PromptPublisher:
    def __init__(self, cfg: Config, checker: RowChecker | None = None):
        self.cfg = cfg
        self.topics = Topics.from_config(cfg.kafka)
        self._checker = checker
        self._producer = idempotent_producer(cfg.kafka, {"linger.ms": LINGER_MS})
        self.dlq = DeadLetterWriter(cfg.kafka, stage="publish", producer=self._producer)

    @property
    def checker(self) -> RowChecker:
        """Made on first use: it loads the agent-loop config, the custom reward function
        and the tokenizer, which ``publish_group`` alone does not need."""
        if self._checker is None:
            self._checker = RowChecker(self.cfg)
        return self._checker

    def publish_group(self, group: PromptGroup) -> None:
        """Send one group (keyed and partitioned by uid); ValueError if it is too large."""
        self._produce(group.uid, encode_group(self.cfg, group))

    def _produce(self, uid: str, value: bytes) -> None:
        partition = partition_for(uid, self.cfg.kafka.partitions)
        while True:
            try:
                self._producer.produce(
                    self.topics.prompts,
                    key=uid,
                    value=value,
                    partition=partition,
                    on_delivery=_raise_on_error,
                )
                break
            except BufferError:
                self._producer.poll(0.1)
            except KafkaException as exc:
                raise broker_error(
                    exc,
                    f"publishing prompt group {uid}",
                    topic=self.topics.prompts,
                    partition=partition,
                ) from exc
        self._producer.poll(0)

    def flush(self) -> None:
        if self._producer.flush(FLUSH_TIMEOUT_S):
            raise BrokerError(
                f"prompt groups not delivered to {self.topics.prompts} within {FLUSH_TIMEOUT_S} s"
            )

    def publish_file(
        self,
        path: str | Path,
        *,
        validate: bool = False,
        global_steps: int = 0,
        epoch: int = 0,
        dataset_id: str | None = None,
        progress: bool = True,
        on_refused: Callable[[CheckedRow], None] | None = None,
    ) -> PublishReport:
        """Publish every row that passes the checks; dead-letter the rest with the reason
        (and call ``on_refused`` with each). The same file, epoch, global_steps and validate
        flag give the same uids (``dataset_id`` replaces the file's content hash as its
        identity)."""
        report = PublishReport(uids=[])
        bar = _progress(count_rows(path), progress)  # checks the path first
        checked = check_rows(
            self.cfg,
            path,
            self.checker,
            validate=validate,
            global_steps=global_steps,
            epoch=epoch,
            dataset_id=dataset_id,
        )
        for row in checked:
            if row.problem is not None:
                self.dlq.write(row.original, str(row.problem), source=row.source)
            else:
                assert row.group is not None and row.value is not None
                self._produce(row.group.uid, row.value)
            _tally(row, report, on_refused)
            bar.update(1)
        bar.close()
        self.flush()
        return report


def _check_unused(uid: str, source: str, rows_by_uid: dict[str, str]) -> None:
    """Two rows of one file naming the same uid would silently make one group downstream."""
    if uid in rows_by_uid:
        raise RowProblem(DUPLICATE_UID, f"uid {uid!r} is already used by row {rows_by_uid[uid]}")
    rows_by_uid[uid] = source


def _raise_on_error(err: Any, msg: Any) -> None:
    if err is not None:  # a KafkaError, not an exception: nothing to chain
        raise broker_error(err, "delivery", topic=msg.topic(), partition=msg.partition())


def _row_reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            field = ".".join(str(p) for p in e["loc"]) or "row"
            parts.append(f"{field}: {e['msg']}")
        return "not a valid verl row: " + "; ".join(parts)
    return str(exc)  # the row's location is the letter's source, said once where it is shown


def _letter_original(original: bytes, max_message_bytes: int) -> tuple[bytes, str]:
    """The row's bytes for its dead letter, cut so the letter (base64 inside JSON, ~4/3 the
    size) still fits in a record; the note says when it was cut."""
    limit = max_message_bytes // 2
    if len(original) <= limit:
        return original, ""
    return original[:limit], f" (original cut to its first {limit} of {len(original)} bytes)"


def _json_bytes(data: dict[str, Any]) -> bytes:
    import json

    return json.dumps(data, ensure_ascii=False, default=str).encode()


class _NoBar:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int | None, enabled: bool):
    if not enabled or not sys.stderr.isatty():  # a bar redraws with \r: noise in a log file
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc="publish", file=sys.stderr)
