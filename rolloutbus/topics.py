"""Topic names, keys and the partitioning rule: the one place they are spelled out.

Every record about a prompt group goes to the same partition number on every topic,
``partition_for(uid)``, so one worker owns a group end to end and decides its
completion locally, and a trainer receives a group's trajectories together.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import SchemaError

KEY_SEPARATOR = "_"


@dataclass(frozen=True)
class Topics:
    prompts: str
    turns: str
    trajectories: str
    dlq: str
    control: str

    @classmethod
    def from_config(cls, kafka: KafkaConfig) -> Topics:
        p = kafka.topic_prefix
        return cls(
            prompts=f"{p}.prompts",
            turns=f"{p}.turns",
            trajectories=f"{p}.trajectories",
            dlq=f"{p}.dlq",
            control=f"{p}.control",
        )

    def all(self) -> list[str]:
        return [self.prompts, self.turns, self.trajectories, self.dlq, self.control]


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
    """verl's rule: a trajectory key maps to its uid by ``split("_")[0]``."""
    return key.split(KEY_SEPARATOR, 1)[0]
