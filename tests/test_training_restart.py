"""A `rolloutbus train` process killed with SIGKILL after a checkpoint and started again
neither re-trains nor skips a group: the groups of the checkpointed steps of the first run
and the groups of the second run are every group on the topic, each exactly once.

Real parts: the test broker, the trainer process with the tiny random Qwen3, its
checkpoints. The trajectories are written straight to the trajectory topic (random tokens,
random rewards): what is tested is the trainer's position, not the rollouts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer
from pipeline import spawn, write_config

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.consumers.training.checkpoint import latest_checkpoint, load_state
from rolloutbus.kafka.control import latest_policy_version
from rolloutbus.schemas.trajectories import Trajectory, encode_trajectory
from rolloutbus.topics import Topics, partition_for, trajectory_key

pytestmark = pytest.mark.slow

GROUPS, N, PER_STEP = 12, 2, 2  # 6 train steps of 2 groups
KILL_AFTER_STEP = 2  # SIGKILL once a checkpoint at least this far exists
WAIT_S = 240.0  # seconds for each run on two shared cores (torch import, model build)


def _write_groups(kafka: KafkaConfig) -> list[str]:
    rng = np.random.default_rng(0)
    topic = Topics.from_config(kafka).trajectories
    producer = Producer({**kafka.client_settings(), "enable.idempotence": True})
    uids = [f"g{i:02d}" for i in range(GROUPS)]
    for uid in uids:
        for s in range(N):
            response = rng.integers(0, 151_000, 6).tolist()
            t = Trajectory(
                key=trajectory_key(uid, s, 0),
                uid=uid,
                session_id=s,
                output_index=0,
                num_outputs=1,
                group_size=N,
                status="completed",
                prompts=rng.integers(0, 151_000, 5).tolist(),
                responses=response,
                response_mask=[1] * len(response),
                rollout_log_probs=[-11.9] * len(response),  # ~ uniform over Qwen3's vocab
                reward_score=float(rng.random()),
                data_source="synthetic",
                min_global_steps=0,
                max_global_steps=0,
            )
            producer.produce(
                topic,
                key=t.key,
                value=encode_trajectory(t),
                partition=partition_for(uid, kafka.partitions),
            )
    assert producer.flush(30) == 0
    return uids


def _steps(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def test_killed_trainer_resumes_at_its_checkpoint(kafka_config: KafkaConfig, tmp_path: Path):
    cfg = Config.model_validate(
        {
            "kafka": kafka_config.model_dump(),
            "model": {"name": "tiny-qwen3"},
            "trainer": {
                "group_id": f"trainer-{tmp_path.name}",
                "default_local_dir": str(tmp_path / "ckpt"),
                "metrics_log": str(tmp_path / "steps.jsonl"),
                "torch_threads": 1,
            },
            # every synthetic group is from version 0: no staleness bound here (what the
            # bound drops is the trainer client's test), only the position
            "async_training": {
                "ppo_mini_batch_size": PER_STEP,
                "trigger_parameter_sync_step": 1,
                "staleness_threshold": 1000,
            },
            "actor": {"optim": {"lr": 1e-3}},
        }
    )
    uids = _write_groups(cfg.kafka)
    config_path = write_config(cfg, tmp_path / "config.yaml")
    steps_log = tmp_path / "steps.jsonl"

    first = spawn(["train"], config_path, tmp_path / "train1.log")
    deadline = time.monotonic() + WAIT_S
    try:
        while time.monotonic() < deadline and first.poll() is None:
            ckpt = latest_checkpoint(cfg.trainer.default_local_dir)
            if ckpt is not None and load_state(ckpt).global_step >= KILL_AFTER_STEP:
                break
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "train1.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    ckpt = latest_checkpoint(cfg.trainer.default_local_dir)
    assert ckpt is not None
    saved = load_state(ckpt).global_step
    assert KILL_AFTER_STEP <= saved < GROUPS // PER_STEP, "the first run was not cut short"
    first_run = _steps(steps_log)
    kept = [uid for rec in first_run if rec["global_step"] <= saved for uid in rec["uids"]]

    second = subprocess.run(
        [*_cli(), "train", "--config", str(config_path), "--steps", str(GROUPS // PER_STEP)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    second_run = _steps(steps_log)[len(first_run) :]
    assert second_run[0]["global_step"] == saved + 1  # resumed at the checkpoint's step
    again = [uid for rec in second_run for uid in rec["uids"]]
    trained = kept + again
    assert sorted(trained) == uids, "a group was skipped or trained twice"
    # the log holds the version of the last checkpoint: the restarted trainer published on
    latest = latest_policy_version(cfg)
    assert latest is not None and latest.policy_version == GROUPS // PER_STEP


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "rolloutbus.cli"]
