"""Receive groups as a trainer would, print a table, and write them to an Arrow file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.schemas.trajectories import TRAJECTORY_SCHEMA, Trajectory, trajectories_to_batch

TEXT_WIDTH = 48  # characters of decoded response shown per row


def consume_and_report(
    cfg: Config,
    *,
    max_groups: int | None,
    timeout_s: float | None,
    out: Path | None,
    group_id: str,
    tokenizer: Any = None,
    stream=sys.stdout,
) -> list[TrajectoryGroup]:
    groups: list[TrajectoryGroup] = []
    with TrainerClient(cfg.kafka, group_id, config=cfg.trainer) as client:
        for group in client.groups(max_groups=max_groups, timeout_s=timeout_s):
            groups.append(group)
            client.commit(group)
            print(f"received group {group.uid} ({len(group)} trajectories)", file=sys.stderr)
    print_table(groups, tokenizer, stream)
    if out is not None:
        write_arrow(groups, out)
        print(f"wrote {sum(len(g) for g in groups)} trajectories to {out}", file=sys.stderr)
    return groups


def write_arrow(groups: list[TrajectoryGroup], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, TRAJECTORY_SCHEMA) as writer:
        for g in groups:
            writer.write_batch(g.batch)


def write_trajectories(trajectories: list[Trajectory], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, TRAJECTORY_SCHEMA) as writer:
        if trajectories:
            writer.write_batch(trajectories_to_batch(trajectories))


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
        text = tokenizer.decode(sampled, skip_special_tokens=True).replace("\n", " ")[:TEXT_WIDTH]
    elif row["error"]:
        text = f"error: {row['error']}"[:TEXT_WIDTH]
    return (
        f"{row['key']:<40} {str(row['agent_name']):<18} {row['status']:<10} "
        f"{row['prompt_len']:>6} {row['response_len']:>5} {sum(row['response_mask']):>5} "
        f"{len(logprobs) if logprobs is not None else '-':>5} {row['num_turns']:>5} "
        f"{reward:>6}  {text}"
    )
