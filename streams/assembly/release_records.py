"""What the replay buffer writes for a released group, and its dead letters: the records of
one transaction, built without touching Kafka (``replay_buffer.py`` commits them)."""

from __future__ import annotations

from confluent_kafka import Message

from rolloutbus.config import RolloutConfig
from rolloutbus.kafka.clients import message_location
from rolloutbus.kafka.dead_letters import dead_letter_record
from rolloutbus.kafka.transactions import ANY_PARTITION
from rolloutbus.kafka.transactions import OutgoingRecord as Outgoing
from rolloutbus.schemas.trajectories import TrajectoryStatus
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.partition_fold import ReleasedGroup
from rolloutbus.streams.assembly.release_metrics import last_turn_timestamp_ms, observe_release
from rolloutbus.streams.assembly.released import BadRecord, released_record
from rolloutbus.streams.assembly.trajectories import RECORD_HEADROOM_BYTES, finalize_group
from rolloutbus.topics import Topics


class ReleaseRecords:
    """Builds the outgoing records of released groups and of bad input, counting them."""

    def __init__(
        self,
        topics: Topics,
        rollout: RolloutConfig,
        metrics: ReplayBufferMetrics,
        *,
        max_record_bytes: int,
    ):
        self.topics = topics
        self.rollout = rollout
        self.metrics = metrics
        self.max_record_bytes = max_record_bytes

    def group(self, part: int, released: ReleasedGroup) -> list[Outgoing]:
        """Trajectories, dead letters and the released record of one group."""
        # only the trajectories' scalars are read here: no Python int per token
        done = finalize_group(
            released, self.rollout, max_record_bytes=self.max_record_bytes, token_lists=False
        )
        lengths = done.batch.column("response_len").to_pylist()
        observe_release(released, done.trajectories, self.rollout, response_lens=lengths)
        stamp = last_turn_timestamp_ms(released)  # trainer clients measure last turn -> trainer
        uid = released.group.uid
        self.metrics.groups.inc()
        if released.kind != "completed":
            self.metrics.groups_released_early.labels(kind=released.kind).inc()
        # a letter about one trajectory names its key; one about the group, the event that
        # released it
        group_source = f"{self.topics.turns}[{part}]@{released.last_offset} uid {uid}"
        out = [
            self.letter(
                letter.original,
                letter.reason,
                key=letter.key,
                source=group_source
                if letter.key == uid
                else f"{self.topics.trajectories} key {letter.key}",
            )
            for letter in done.letters
        ]
        for t, value in zip(done.trajectories, done.records, strict=True):
            self.metrics.trajectories.labels(status=t.status.value).inc()
            out.append(Outgoing(self.topics.trajectories, t.key, value, part, stamp))
        record = released_record(
            uid,
            part,
            trajectories=len(done.trajectories),
            failed=sum(t.status == TrajectoryStatus.FAILED for t in done.trajectories),
            kind=released.kind,
            turns_first_offset=released.first_offset,
            turns_last_offset=released.last_offset,
        )
        out.append(Outgoing(self.topics.released, uid, record.encode(), part))
        return out

    def bad_turn(self, msg: Message, reason: str) -> Outgoing:
        """The dead letter of a turn event that cannot be folded."""
        key = (msg.key() or b"").decode("utf-8", "replace")
        return self.letter(msg.value() or b"", reason, source=message_location(msg), key=key)

    def bad_released(self, bad: BadRecord) -> Outgoing:
        """The dead letter of a released record refused on recovery (``released.py``)."""
        key = (bad.key or b"").decode("utf-8", "replace")
        return self.letter(bad.value, bad.reason, source=bad.source, key=key)

    def letter(self, original: bytes, reason: str, *, source: str, key: str) -> Outgoing:
        self.metrics.dead_letters.inc()
        return sized_dead_letter(
            self.topics.dlq, original, reason, source=source, key=key, limit=self.max_record_bytes
        )


def sized_dead_letter(
    topic: str, original: bytes, reason: str, *, source: str, key: str, limit: int
) -> Outgoing:
    """A dead letter that fits the topic (``limit`` bytes): an original too large to carry
    in base64 is cut, and the reason says so (a record over the limit would abort every
    retry of its transaction)."""
    letter = dead_letter_record(
        topic, original, stage="replay_buffer", reason=reason, source=source, key=key
    )
    if len(letter.value) > limit:
        keep = max(
            0,
            (limit - len(letter.value) + len(original) * 4 // 3) * 3 // 4 - RECORD_HEADROOM_BYTES,
        )
        letter = dead_letter_record(
            topic,
            original[:keep],
            stage="replay_buffer",
            source=source,
            key=key,
            reason=f"{reason} (original cut to its first {keep} of {len(original)} bytes)",
        )
    return Outgoing(letter.topic, letter.key or "", letter.value, ANY_PARTITION)
