"""Publish dataset rows as prompt groups to rollout.prompts; bad rows go to rollout.dlq."""

from __future__ import annotations

import logging
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import broker_error, idempotent_producer
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.producers.datasets import BadRow, RawRow, count_rows, read_rows
from rolloutbus.schemas.prompts import DatasetRow, GroupSamplingParams, PromptGroup
from rolloutbus.topics import Topics, partition_for

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 60.0  # seconds to drain the producer at the end of a publish
LINGER_MS = 20  # ms a record waits to batch with others; publishing is bulk, not latency-bound


@dataclass
class PublishReport:
    published: int = 0
    dead_lettered: int = 0
    uids: list[str] | None = None

    @property
    def read(self) -> int:
        return self.published + self.dead_lettered


def new_uid() -> str:
    return uuid.uuid4().hex  # no "_": the uid is the first segment of every key


def sampling_params(cfg: Config, validate: bool) -> GroupSamplingParams:
    r = cfg.rollout
    if validate:
        v = r.val_kwargs
        greedy = not v.do_sample
        return GroupSamplingParams(temperature=0.0 if greedy else v.temperature, top_p=v.top_p,
                                   top_k=v.top_k, repetition_penalty=r.repetition_penalty,
                                   logprobs=r.calculate_log_probs)
    return GroupSamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                               repetition_penalty=r.repetition_penalty,
                               logprobs=r.calculate_log_probs)


def build_group(cfg: Config, row: dict[str, Any], *, validate: bool = False, global_steps: int = 0,
                policy_version: int = 0, uid: str | None = None) -> PromptGroup:
    """Validate a row and wrap it; raises ValueError (with the reason) for a bad row."""
    row = _prompt_from_column(row, cfg.data.prompt_key)
    DatasetRow.model_validate(row)
    row = dict(row)
    n_override = row.pop("__rollout_n__", None)
    do_sample = row.pop("__do_sample__", None)
    n = int(n_override) if n_override is not None else (
        cfg.rollout.val_kwargs.n if validate else cfg.rollout.n)
    params = sampling_params(cfg, validate)
    if do_sample is False:
        params = params.model_copy(update={"temperature": 0.0})
    return PromptGroup(uid=uid or new_uid(), row=row, n=n, validate=validate,
                       sampling_params=params, global_steps=global_steps,
                       policy_version=policy_version)


def _prompt_from_column(row: dict[str, Any], prompt_key: str) -> dict[str, Any]:
    """verl's ``data.prompt_key``: the column holding the chat messages becomes ``prompt``,
    the field every agent loop reads."""
    if prompt_key == "prompt":
        return row
    if prompt_key not in row:
        raise ValueError(f"the row has no {prompt_key!r} column (data.prompt_key); "
                         f"columns: {sorted(row)}")
    if "prompt" in row:  # two candidate prompts: refuse rather than drop one silently
        raise ValueError(f"the row has both {prompt_key!r} (data.prompt_key) and 'prompt' columns")
    row = dict(row)
    row["prompt"] = row.pop(prompt_key)
    return row


class PromptPublisher:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.topics = Topics.from_config(cfg.kafka)
        self._producer = idempotent_producer(cfg.kafka, {"linger.ms": LINGER_MS})
        self.dlq = DeadLetterWriter(cfg.kafka, stage="publish", producer=self._producer)

    def publish_group(self, group: PromptGroup) -> None:
        value = group.model_dump_json(by_alias=True).encode()
        partition = partition_for(group.uid, self.cfg.kafka.partitions)
        while True:
            try:
                self._producer.produce(self.topics.prompts, key=group.uid, value=value,
                                       partition=partition, on_delivery=_raise_on_error)
                break
            except BufferError:
                self._producer.poll(0.1)
            except KafkaException as exc:
                raise broker_error(exc, f"publishing prompt group {group.uid}", topic=self.topics.prompts,
                                   partition=partition) from exc
        self._producer.poll(0)

    def flush(self) -> None:
        if self._producer.flush(FLUSH_TIMEOUT_S):
            raise BrokerError(f"prompt groups not delivered to {self.topics.prompts} "
                              f"within {FLUSH_TIMEOUT_S} s")

    def publish_file(self, path: str | Path, *, validate: bool = False, global_steps: int = 0,
                     progress: bool = True) -> PublishReport:
        report = PublishReport(uids=[])
        bar = _progress(count_rows(path), progress)
        for item in read_rows(path):
            self._publish_item(item, report, validate=validate, global_steps=global_steps)
            bar.update(1)
        bar.close()
        self.flush()
        return report

    def _publish_item(self, item: RawRow | BadRow, report: PublishReport, **kw: Any) -> None:
        if isinstance(item, BadRow):
            self.dlq.write(item.original, item.reason, source=item.source)
            report.dead_lettered += 1
            return
        try:
            group = build_group(self.cfg, item.data, **kw)
        except (ValidationError, ValueError) as exc:
            reason = _row_reason(exc, item.source)
            self.dlq.write(_json_bytes(item.data), reason, source=item.source)
            report.dead_lettered += 1
            return
        self.publish_group(group)
        report.published += 1
        assert report.uids is not None
        report.uids.append(group.uid)


def _raise_on_error(err: Any, msg: Any) -> None:
    if err is not None:  # a KafkaError, not an exception: nothing to chain
        raise broker_error(err, "delivery", topic=msg.topic(), partition=msg.partition())


def _row_reason(exc: Exception, source: str) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            field = ".".join(str(p) for p in e["loc"]) or "row"
            parts.append(f"{field}: {e['msg']}")
        return f"row {source} is not a valid verl row: " + "; ".join(parts)
    return f"row {source}: {exc}"


def _json_bytes(data: dict[str, Any]) -> bytes:
    import json

    return json.dumps(data, ensure_ascii=False, default=str).encode()


class _NoBar:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int | None, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc="publish", file=sys.stderr)
