"""The trainer client: complete prompt groups from rollout.trajectories as Arrow batches.

Delivery: the replay buffer commits a group's trajectories in one transaction, so with
``isolation.level=read_committed`` a group is seen whole or not at all. Offsets are
committed only when the trainer says it has used a group (``commit``); a trainer that
crashes before that gets the group again, one that crashes after never does — and a key
seen twice within one client (a redelivery during a rebalance) is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.schemas.trajectories import TRAJECTORY_SCHEMA, decode_trajectory_batch
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)
SEEN_KEYS_MEMORY = 1_000_000  # keys; dedupe window of one client


@dataclass
class TrajectoryGroup:
    """All trajectories of one prompt group, as one ragged Arrow RecordBatch."""

    uid: str
    batch: pa.RecordBatch
    partition: int
    last_offset: int

    @property
    def keys(self) -> list[str]:
        return self.batch.column("key").to_pylist()

    def __len__(self) -> int:
        return self.batch.num_rows


@dataclass
class _Pending:
    rows: list[pa.RecordBatch] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    group_size: int = 0


class TrainerClient:
    def __init__(self, kafka: KafkaConfig, group_id: str, *, from_beginning: bool = True):
        self.topic = Topics.from_config(kafka).trajectories
        self._consumer = Consumer({
            **kafka.client_settings(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "fetch.max.bytes": kafka.max_message_bytes,
            "max.partition.fetch.bytes": kafka.max_message_bytes,
        })
        self._consumer.subscribe([self.topic], on_revoke=self._on_revoke, on_lost=self._on_revoke)
        self._pending: dict[str, _Pending] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()

    def groups(self, *, max_groups: int | None = None, timeout_s: float | None = None,
               poll_s: float = 0.5) -> Iterator[TrajectoryGroup]:
        """Yield complete groups as they arrive; stop after max_groups or timeout_s idle."""
        yielded, idle_since = 0, time.monotonic()
        while max_groups is None or yielded < max_groups:
            msg = self._consumer.poll(poll_s)
            if msg is None:
                if timeout_s is not None and time.monotonic() - idle_since > timeout_s:
                    return
                continue
            idle_since = time.monotonic()
            group = self._accept(msg)
            if group is not None:
                yielded += 1
                yield group

    def batches(self, groups_per_batch: int, **kwargs) -> Iterator[list[TrajectoryGroup]]:
        """Groups in lists of ``groups_per_batch`` (a train batch of prompts)."""
        chunk: list[TrajectoryGroup] = []
        for group in self.groups(**kwargs):
            chunk.append(group)
            if len(chunk) == groups_per_batch:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def commit(self, used: TrajectoryGroup | list[TrajectoryGroup]) -> None:
        """Mark groups as used by the trainer: they will not be delivered again."""
        groups = used if isinstance(used, list) else [used]
        latest: dict[int, int] = {}
        for g in groups:
            latest[g.partition] = max(latest.get(g.partition, -1), g.last_offset)
        offsets = [TopicPartition(self.topic, p, o + 1) for p, o in latest.items()]
        if offsets:
            self._consumer.commit(offsets=offsets, asynchronous=False)

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self, msg) -> TrajectoryGroup | None:
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                return None
            raise BrokerError(f"consuming {self.topic}: {msg.error()}")
        key = msg.key().decode()
        if key in self._seen:
            return None
        row = decode_trajectory_batch(msg.value())
        uid = row.column("uid")[0].as_py()
        pending = self._pending.setdefault(uid, _Pending())
        if key in pending.keys:
            return None
        pending.keys.add(key)
        pending.rows.append(row)
        pending.group_size = row.column("group_size")[0].as_py()
        if len(pending.rows) < pending.group_size:
            return None
        del self._pending[uid]
        for k in pending.keys:
            self._remember(k)
        batch = pa.Table.from_batches(pending.rows, TRAJECTORY_SCHEMA).combine_chunks().to_batches()[0]
        return TrajectoryGroup(uid, batch, msg.partition(), msg.offset())

    def _remember(self, key: str) -> None:
        self._seen[key] = None
        while len(self._seen) > SEEN_KEYS_MEMORY:
            self._seen.popitem(last=False)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._pending.clear()  # partial groups are re-read by the next owner
