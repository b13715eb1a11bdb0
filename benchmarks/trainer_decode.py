"""The trainer client's decode, µs per trajectory: the records of complete groups (as the
replay buffer writes them) to the groups a trainer gets, before issue 28 and now, in the
same run (CPU time of this process).

Before, each group's rows were concatenated into its batch when the group completed; now a
group keeps its decoded rows and concatenates them where its batch is first read, and
``build_train_batch`` concatenates the rows of all its groups at once. Both paths take the
records through the same ``PartitionProgress`` (no broker: the records are in memory), so
the difference is what the group carries. Three stages, each a median over rounds with
before and now interleaved (the machine is shared and noisy):

* client: records → the yielded group, with what the client reads of it (keys, successful
  members);
* + batch: and each group's batch read (a trainer that reads groups one by one);
* + train batch: and ``build_train_batch`` over ``--groups-per-batch`` groups (the padded
  tensors the project's trainer learns from).

Trajectories are P1's shape: 256 prompt tokens, 448 response tokens (three turns of 128
and two observations of 32), logprobs, a reward and policy versions.

    python benchmarks/trainer_decode.py [--groups 256] [--group-size 4] [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from rolloutbus.consumers.groups import PartitionProgress, TrajectoryGroup
from rolloutbus.consumers.position import PartitionPosition
from rolloutbus.consumers.training.batch import build_train_batch
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus, encode_trajectories
from rolloutbus.topics import trajectory_key, uid_of_key

PROMPT_TOKENS, RESPONSE_TOKENS = 256, 3 * 128 + 2 * 32  # P1's sessions (tests/synthetic.py)
QUICK = {"groups": 16, "rounds": 2}
Record = tuple[str, bytes]
Carry = Callable[[list[Record], list[int]], list[TrajectoryGroup]]


def make_records(groups: int, size: int, seed: int = 0) -> list[Record]:
    """``groups`` complete groups of ``size`` trajectories, encoded as the replay buffer does."""
    rng = random.Random(seed)
    out: list[Record] = []
    for g in range(groups):
        uid = f"bench{g:05d}"
        members = []
        for s in range(size):
            response = [rng.randrange(151_936) for _ in range(RESPONSE_TOKENS)]
            members.append(
                Trajectory(
                    key=trajectory_key(uid, s, 0),
                    uid=uid,
                    session_id=s,
                    output_index=0,
                    num_outputs=1,
                    group_size=size,
                    status=TrajectoryStatus.COMPLETED,
                    prompts=list(range(PROMPT_TOKENS)),
                    responses=response,
                    response_mask=[1] * 128 + [0] * 32 + [1] * 128 + [0] * 32 + [1] * 128,
                    rollout_log_probs=[-rng.random() for _ in response],
                    reward_score=float(rng.randrange(2)),
                    num_turns=6,
                    min_global_steps=3,
                    max_global_steps=4,
                )
            )
        out.extend(zip([t.key for t in members], encode_trajectories(members), strict=True))
    return out


def received(records: list[Record], carry: str) -> list[TrajectoryGroup]:
    """The groups as the trainer client yields them, carrying their rows (now) or the
    batch concatenated on completion (before), with what the client reads of each."""
    progress = PartitionProgress(PartitionPosition(offset=0), max_interleaved=1_000)
    out = []
    for offset, (key, value) in enumerate(records):
        pending = progress.add(offset, key, value)
        if pending is None:
            continue
        rows = pending.batch() if carry == "before" else pending.rows
        group = TrajectoryGroup(uid_of_key(key), rows, 0, offset, resume=progress.snapshot())
        group.keys, group.successful  # noqa: B018 (what the client reads: dedupe, admission)
        out.append(group)
    return out


def stage(records: list[Record], carry: str, name: str, per_batch: int) -> float:
    """CPU seconds of one pass of ``name`` over the records (CPU, not wall: the machine is
    shared, and a wall clock counts the other processes' turns too)."""
    start = time.process_time()
    groups = received(records, carry)
    if name == "+ batch":
        for group in groups:
            group.batch  # noqa: B018
    elif name == "+ train batch":
        for first in range(0, len(groups), per_batch):
            build_train_batch(groups[first : first + per_batch], pad_token_id=0)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} (checks the script runs)")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.rounds = QUICK["groups"], QUICK["rounds"]
    records = make_records(args.groups, args.group_size)
    stages = ("client", "+ batch", "+ train batch")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name in stages:
            for carry in ("before", "now"):
                seconds = stage(records, carry, name, args.groups_per_batch)
                times.setdefault((name, carry), []).append(seconds)
    trajectories = len(records)
    print(
        f"{args.groups} groups of {args.group_size} trajectories, {args.rounds} rounds; "
        f"train batches of {args.groups_per_batch} groups"
    )
    print(f"{'stage':<15} {'before us/traj':>15} {'now us/traj':>12} {'before/now':>11}")
    for name in stages:
        before = statistics.median(times[(name, "before")]) / trajectories * 1e6
        now = statistics.median(times[(name, "now")]) / trajectories * 1e6
        print(f"{name:<15} {before:>15.1f} {now:>12.1f} {before / now:>10.2f}x")


if __name__ == "__main__":
    main()
