"""Records built one way for every test: trajectories as the replay buffer releases them, and
turn events as the session recorder logs them.

Each builder fills in what a test does not care about with a small valid value and takes
any field of the record by keyword, so a test spells out only what it checks. Keys come from
``rolloutbus.topics`` (``uid_session_output``), never written by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import Producer

from rolloutbus.config import KafkaConfig
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus, encode_trajectories
from rolloutbus.schemas.turns import (
    Generation,
    GroupStarted,
    OutputSummary,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionIds,
    SessionStarted,
)
from rolloutbus.topics import Topics, partition_for, trajectory_key

__all__ = [
    "ROW",
    "make_group",
    "make_group_started",
    "make_session_failed",
    "make_session_started",
    "make_trajectory",
    "make_turns",
    "numbered",
    "produce_trajectories",
    "session_ids",
    "trajectory_records",
]

ROW = {"prompt": [{"role": "user", "content": "q"}]}  # a verl row with a one-message prompt
PRODUCE_FLUSH_S = 30.0  # seconds a test's producer may take to deliver what it wrote

# ---- trajectories ----------------------------------------------------------------------


def make_trajectory(
    uid: str = "u",
    session_id: int = 0,
    *,
    output_index: int = 0,
    group_size: int = 1,
    status: TrajectoryStatus | str = TrajectoryStatus.COMPLETED,
    prompts: Sequence[int] = (1, 2),
    responses: Sequence[int] | None = None,
    response_mask: Sequence[int] | None = None,
    **fields: Any,
) -> Trajectory:
    """One trajectory record: its key from (uid, session, output), a response mask of ones
    unless given, and any other field of ``Trajectory`` by keyword. The response is one
    token ([3]) unless given; a failed record's is empty."""
    if responses is None:
        responses = [] if TrajectoryStatus(status) is TrajectoryStatus.FAILED else [3]
    responses = list(responses)
    return Trajectory(
        key=trajectory_key(uid, session_id, output_index),
        uid=uid,
        session_id=session_id,
        output_index=output_index,
        num_outputs=fields.pop("num_outputs", 1),
        group_size=group_size,
        status=status,
        prompts=list(prompts),
        responses=responses,
        response_mask=[1] * len(responses) if response_mask is None else list(response_mask),
        **fields,
    )


def make_group(uid: str, size: int, **fields: Any) -> list[Trajectory]:
    """The ``size`` trajectories of one group (sessions 0..size-1), the same ``fields`` each."""
    return [make_trajectory(uid, s, group_size=size, **fields) for s in range(size)]


def trajectory_records(trajectories: list[Trajectory]) -> list[tuple[str, bytes]]:
    """(key, value) of each trajectory, as the replay buffer writes them."""
    return list(zip([t.key for t in trajectories], encode_trajectories(trajectories), strict=True))


def produce_trajectories(
    producer: Producer, kafka: KafkaConfig, trajectories: Iterable[Trajectory]
) -> None:
    """Write ``trajectories`` to the trajectories topic, each group in its uid's partition,
    as the replay buffer does (without its transaction), and wait until they are written."""
    topic = Topics.from_config(kafka).trajectories
    batch = list(trajectories)
    for t, value in zip(batch, encode_trajectories(batch), strict=True):
        producer.produce(
            topic, key=t.key, value=value, partition=partition_for(t.uid, kafka.partitions)
        )
    assert producer.flush(PRODUCE_FLUSH_S) == 0, "trajectories not delivered"


# ---- turn events -----------------------------------------------------------------------


def make_group_started(
    uid: str = "g",
    n: int = 1,
    *,
    attempt: str = "a",
    row: dict[str, Any] | None = None,
    **fields: Any,
) -> GroupStarted:
    """A worker took prompt group ``uid`` of ``n`` sessions (the row: ``ROW`` unless given)."""
    return GroupStarted(uid=uid, attempt=attempt, n=n, row=ROW if row is None else row, **fields)


def session_ids(uid: str = "g", session_id: int = 0, attempt: str = "a") -> SessionIds:
    """The fields that stamp every event of one session attempt."""
    return {"uid": uid, "session_id": session_id, "attempt": attempt}


def make_session_started(
    uid: str = "g",
    session_id: int = 0,
    *,
    attempt: str = "a",
    agent_name: str | None = "x",
    **fields: Any,
) -> SessionStarted:
    return SessionStarted(**session_ids(uid, session_id, attempt), agent_name=agent_name, **fields)


def make_session_failed(
    uid: str = "g", session_id: int = 0, *, attempt: str = "a", error: str = "x", **fields: Any
) -> SessionFailed:
    return SessionFailed(**session_ids(uid, session_id, attempt), error=error, **fields)


def make_turns(
    uid: str = "g",
    session_id: int = 0,
    tokens: Sequence[Sequence[int]] = ((1, 2),),
    *,
    attempt: str = "a",
    prompt: Sequence[int] = (9,),
    logprob: float | None = -0.5,
    finished: bool = True,
    **fields: Any,
) -> list[SessionStarted | SegmentStarted | Generation | SessionFinished]:
    """One session attempt as the recorder logs it, numbered by ``seq``: started, one segment
    with ``prompt``, a generation per entry of ``tokens`` (each token's logprob ``logprob``,
    none when None), and, when ``finished``, its one output. ``fields`` (``ts``, ...) go into
    every event."""
    ids = {**session_ids(uid, session_id, attempt), **fields}
    events: list[SessionStarted | SegmentStarted | Generation | SessionFinished] = [
        SessionStarted(**ids, agent_name="x"),
        SegmentStarted(**ids, segment=0, prompt_ids=list(prompt)),
    ]
    for turn, toks in enumerate(tokens):
        logprobs = None if logprob is None else [logprob] * len(toks)
        events.append(
            Generation(**ids, segment=0, turn=turn, token_ids=list(toks), logprobs=logprobs)
        )
    if finished:
        summary = OutputSummary(
            segment=0,
            prompt_len=len(prompt),
            response_len=sum(len(t) for t in tokens),
            has_logprobs=logprob is not None,
        )
        events.append(SessionFinished(**ids, outputs=[summary]))
    return numbered(events)


def numbered(events: Sequence[Any]) -> list[Any]:
    """``events`` with ``seq`` 0, 1, 2 ... in order, as one stream of the log numbers them."""
    return [event.model_copy(update={"seq": seq}) for seq, event in enumerate(events)]
