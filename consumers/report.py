"""Receive groups as a trainer would, print a table, and write them to an Arrow file.

**Looking never takes.** A trainer's consumer group records, by committing, which groups it
has used; a reader that commits in that group takes those groups from the trainer for good.
So ``consume_and_report`` reads in a consumer group of its own (``throwaway_group_id``) and
never commits, unless it is told to consume *as* a group (``group_id`` with ``commit``).
Given a group without ``commit``, it starts where that group stands (its committed
positions, read without joining it) and still takes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from confluent_kafka import TopicPartition

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.position import ASSIGN_TIMEOUT_S, PartitionPosition, TrainerPosition
from rolloutbus.errors import SchemaError
from rolloutbus.kafka.clients import (
    committed_offsets,
    read_committed_consumer,
    translate_kafka_errors,
)
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    Trajectory,
    trajectories_to_batch,
)
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)
TEXT_WIDTH = 48  # characters of decoded response shown per row
END_CHECK_IDLE_S = 1.0  # seconds without a group before asking whether the topic's end is read


def throwaway_group_id(purpose: str = "consume") -> str:
    """A consumer group of one reader that never commits: nobody else's position moves."""
    return f"rolloutbus-{purpose}-{uuid.uuid4().hex[:12]}"


def committed_position(kafka: KafkaConfig, group_id: str) -> TrainerPosition | None:
    """Where ``group_id`` stands on the trajectory topic (its committed offsets and the
    trainer client's commit metadata), read without joining the group; None if it has
    committed nothing there."""
    topic = Topics.from_config(kafka).trajectories
    consumer = read_committed_consumer(kafka, group_id)  # never subscribes: never joins
    try:
        with translate_kafka_errors(f"reading the offsets of group {group_id!r}", topic=topic):
            committed = committed_offsets(
                consumer,
                [TopicPartition(topic, p) for p in range(kafka.partitions)],
                ASSIGN_TIMEOUT_S,
            )
    finally:
        consumer.close()
    partitions = {
        tp.partition: PartitionPosition.from_commit(tp.offset, tp.metadata)
        for tp in committed
        if tp.offset >= 0
    }
    return TrainerPosition(topic=topic, partitions=partitions) if partitions else None


def consume_and_report(
    cfg: Config,
    *,
    max_groups: int | None,
    timeout_s: float | None,
    out: Path | None,
    group_id: str | None = None,
    commit: bool = False,
    tokenizer: Any = None,
    stream=sys.stdout,
    follow: bool = True,
) -> list[TrajectoryGroup]:
    """Receive up to ``max_groups`` complete groups (stopping after ``timeout_s`` without
    one, or, unless ``follow``, at the end of the topic), print them as a table on
    ``stream`` and write them to ``out``.

    Takes nothing from anyone unless ``commit``: then it consumes as ``group_id``, and the
    groups it receives are used up for that group (a trainer in it never gets them).
    """
    if commit and group_id is None:
        raise ValueError("commit needs the group_id to commit in")
    groups: list[TrajectoryGroup] = []
    with _client(cfg, group_id, commit) as client:
        received = (
            client.groups(max_groups=max_groups, timeout_s=timeout_s)
            if follow
            else _to_the_end(client, max_groups, timeout_s)
        )
        try:
            for group in received:
                groups.append(group)
                if commit:
                    client.commit(group)
                print(f"received group {group.uid} ({len(group)} trajectories)", file=sys.stderr)
        except KeyboardInterrupt:  # how --follow ends (SIGTERM too): show what came
            print(f"stopped after {len(groups)} groups", file=sys.stderr)
    print_table(groups, tokenizer, stream)
    if out is not None:
        write_arrow(groups, out)
        print(f"wrote {sum(len(g) for g in groups)} trajectories to {out}", file=sys.stderr)
    return groups


def _to_the_end(
    client: TrainerClient, max_groups: int | None, timeout_s: float | None
) -> Iterator[TrajectoryGroup]:
    """Groups until the client has read the whole topic (as ``kcat -e``), ``max_groups``,
    or ``timeout_s`` without a group; whether it is at the end is asked when idle."""
    got, idle_since = 0, time.monotonic()
    while max_groups is None or got < max_groups:
        left = None if max_groups is None else max_groups - got
        for group in client.groups(max_groups=left, timeout_s=END_CHECK_IDLE_S):
            got, idle_since = got + 1, time.monotonic()
            yield group
        if timeout_s is not None and time.monotonic() - idle_since > timeout_s:
            return
        if client.at_end():
            return


def _client(cfg: Config, group_id: str | None, commit: bool) -> TrainerClient:
    if commit and group_id is not None:
        _warn_if_a_trainers_group(cfg, group_id)
        return TrainerClient(cfg.kafka, group_id, config=cfg.trainer)
    start = committed_position(cfg.kafka, group_id) if group_id is not None else None
    if group_id is not None:
        log.info(
            "reading from where group %r stands (%s), without joining it or committing",
            group_id,
            "its committed offsets" if start else "it has committed nothing: the beginning",
        )
    return TrainerClient(cfg.kafka, throwaway_group_id(), config=cfg.trainer, resume_from=start)


def _warn_if_a_trainers_group(cfg: Config, group_id: str) -> None:
    if group_id == cfg.trainer.group_id:
        why = "it is trainer.group_id"
    elif committed_position(cfg.kafka, group_id) is not None:
        why = "it has committed offsets on the trajectory topic, as a trainer's group has"
    else:
        return
    log.warning(
        "consuming as group %r with --commit: %s, so a trainer in that group will never "
        "train on the groups received here",
        group_id,
        why,
    )


def write_arrow(groups: list[TrajectoryGroup], path: Path) -> None:
    with BatchFile(path) as out:
        for g in groups:
            out.write(g.batch)


def write_trajectories(trajectories: list[Trajectory], path: Path) -> None:
    with BatchFile(path) as out:
        if trajectories:
            out.write(trajectories_to_batch(trajectories))


class BatchFile:
    """An Arrow file of trajectory rows, written as their batches arrive: joined into record
    batches of about ``rows`` rows (a file of thousands of one-group batches reads slowly),
    so only those rows are held in memory, however long the input. The file appears at
    ``path`` when closed without an error (written beside it until then); after an error
    there is none."""

    def __init__(self, path: Path, *, rows: int = 4096):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.rows_per_batch = path, rows
        self._partial = path.with_name(f".{path.name}.partial")
        self._sink = pa.OSFile(str(self._partial), "wb")
        try:
            self._writer = pa.ipc.new_file(self._sink, TRAJECTORY_SCHEMA)
        except BaseException:
            self._discard()
            raise
        self._pending: list[pa.RecordBatch] = []
        self.held = 0  # rows in memory, not yet written (fewer than about `rows`)
        self.rows = 0  # rows written or held

    def write(self, batch: pa.RecordBatch) -> None:
        if not batch.schema.equals(TRAJECTORY_SCHEMA):
            raise SchemaError(
                f"{self.path}: a batch of another schema than the trajectories' "
                f"(columns {batch.schema.names[:5]}...) cannot be written to it"
            )
        self._pending.append(batch)
        self.held += batch.num_rows
        self.rows += batch.num_rows
        if self.held >= self.rows_per_batch:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_batch(pa.concat_batches(self._pending))
        self._pending, self.held = [], 0

    def __enter__(self) -> BatchFile:
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        if error is not None:
            self._discard()
            return
        try:
            self._flush()
            self._writer.close()
        except BaseException:
            self._discard()  # a full disk, say: no file rather than a truncated one
            raise
        self._sink.close()
        self._partial.replace(self.path)

    def _discard(self) -> None:
        writer = getattr(self, "_writer", None)  # None: new_file itself failed
        with contextlib.suppress(pa.ArrowException, OSError):  # the error that led here wins
            if writer is not None:
                writer.close()
        self._sink.close()
        self._partial.unlink(missing_ok=True)


def print_table(
    groups: list[TrajectoryGroup],
    tokenizer: Any,
    stream,
    trajectories: list[Trajectory] | None = None,
) -> None:
    header = (
        f"{'key':<40} {'agent':<18} {'status':<10} {'prompt':>6} {'resp':>5} "
        f"{'mask1':>5} {'lp':>5} {'turns':>5} {'reward':>6}  text"
    )
    print(header, file=stream)
    print("-" * len(header), file=stream)
    rows = [row for g in groups for row in g.batch.to_pylist()]
    if trajectories:
        rows += trajectories_to_batch(trajectories).to_pylist()
    for row in rows:
        print(_format_row(row, tokenizer), file=stream)


def _format_row(row: dict[str, Any], tokenizer: Any) -> str:
    logprobs = row["rollout_log_probs"]
    reward = "" if row["reward_score"] is None else f"{row['reward_score']:.2f}"
    text = ""
    if tokenizer is not None and row["responses"]:
        sampled = [t for t, m in zip(row["responses"], row["response_mask"], strict=True) if m]
        text = one_line(tokenizer.decode(sampled, skip_special_tokens=True))[:TEXT_WIDTH]
    elif row["error"]:
        text = one_line(f"error: {row['error']}")[:TEXT_WIDTH]
    return (
        f"{row['key']:<40} {str(row['agent_name']):<18} {row['status']:<10} "
        f"{row['prompt_len']:>6} {row['response_len']:>5} {sum(row['response_mask']):>5} "
        f"{len(logprobs) if logprobs is not None else '-':>5} {row['num_turns']:>5} "
        f"{reward:>6}  {text}"
    )


# line and paragraph separators, control and format characters: str.splitlines breaks on
# some, a terminal acts on others (ESC), and a random model's text holds them all
_NOT_ON_ONE_LINE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def one_line(text: str) -> str:
    """``text`` as one line of a table: a line break as a space, any other character that is
    not printable text escaped (``\\x1b``, ``\\u2028``)."""
    return "".join(
        " "
        if c in "\r\n"
        else c.encode("unicode_escape").decode("ascii")
        if unicodedata.category(c) in _NOT_ON_ONE_LINE
        else c
        for c in text
    )
