"""Topic names, keys and the partitioning rule: the one place they are spelled out.

Every record about a prompt group goes to the same partition number on every topic,
``partition_for(uid)``, so one worker owns a group end to end and decides its
completion locally, and a trainer receives a group's trajectories together.

``released`` is the replay buffer's durable record of released groups (compacted, key
uid): written in the same transaction as the group's trajectories, read back on partition
assignment, so no restart, lost offset or re-run releases a group twice.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import SchemaError

KEY_SEPARATOR = "_"
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Topics:
    prompts: str
    turns: str
    trajectories: str
    dlq: str
    control: str
    released: str

    @classmethod
    def from_config(cls, kafka: KafkaConfig) -> Topics:
        p = kafka.topic_prefix
        return cls(
            prompts=f"{p}.prompts",
            turns=f"{p}.turns",
            trajectories=f"{p}.trajectories",
            dlq=f"{p}.dlq",
            control=f"{p}.control",
            released=f"{p}.released",
        )

    def all(self) -> list[str]:
        return [self.prompts, self.turns, self.trajectories, self.dlq, self.control, self.released]

    def partitioned_by_uid(self) -> list[str]:
        """The topics whose partition p holds the records of the uids with partition_for == p:
        their partition counts must agree."""
        return [self.prompts, self.turns, self.trajectories, self.released]


# rollout.control has one partition (kafka/admin.py), and every record on it is keyed by its
# event type and run epoch, so compaction keeps the latest event of each type per run (the
# latest policy version of every run; schemas/control.py).
CONTROL_PARTITION = 0


def control_key(event_type: str, run_epoch: int | None = None) -> str:
    """``policy_version`` (no run: records written before runs existed) or
    ``policy_version@3`` (run epoch 3)."""
    return event_type if run_epoch is None else f"{event_type}@{run_epoch}"


def partition_for(uid: str, num_partitions: int) -> int:
    """Stable across processes and languages (CRC-32), unlike Python's salted hash()."""
    return zlib.crc32(uid.encode("utf-8")) % num_partitions


def check_uid(uid: str) -> str:
    """A uid is the first segment of every key, so it may not contain the separator."""
    if not uid or KEY_SEPARATOR in uid:
        raise SchemaError(f"uid {uid!r} must be non-empty and contain no {KEY_SEPARATOR!r}")
    return uid


def session_key(uid: str, session_id: int) -> str:
    return f"{uid}{KEY_SEPARATOR}{session_id}"


def trajectory_key(uid: str, session_id: int, output_index: int) -> str:
    return f"{uid}{KEY_SEPARATOR}{session_id}{KEY_SEPARATOR}{output_index}"


def uid_of_key(key: str) -> str:
    """The uid of a trajectory key ``{uid}_{session_id}_{output_index}``.

    Agrees with verl's rule, ``split("_")[0]``, for every uid the publisher accepts (no
    ``_``), and stays right for one that reached the log some other way: the last two
    segments are the integers, so the uid is everything before them. Readers that hold
    the record's value should take the uid from it (the ``uid`` column) instead. A key of
    another shape maps by verl's rule.
    """
    try:
        return parse_trajectory_key(key)[0]
    except SchemaError:
        return key.split(KEY_SEPARATOR, 1)[0]


def parse_trajectory_key(key: str) -> tuple[str, int, int]:
    """``(uid, session_id, output_index)`` of a trajectory key; SchemaError if it is none."""
    parts = key.rsplit(KEY_SEPARATOR, 2)
    if len(parts) != 3 or not parts[0] or not all(map(_DIGITS.fullmatch, parts[1:])):
        raise SchemaError(
            f"{key!r} is not a trajectory key {{uid}}_{{session_id}}_{{output_index}}"
        )
    return parts[0], int(parts[1]), int(parts[2])
