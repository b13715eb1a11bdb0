"""The closed loop learns: trainer -> policy version -> weight sync -> replica -> rollouts
within the staleness bound -> trainer, and the reward rises.

Everything is real and runs as the README starts it, one process per command on the test
broker: the embedded replica (tiny random Qwen3), a session worker, the replay buffer, the
weight sync, the dispatcher and ``rolloutbus train``. Fixed seeds (model, trainer,
dataset). The task is a dense reward a random model can improve in a few steps: the share
of sampled token ids that are even (tests/plugins/even_token_loop.py). A low sampling
temperature (the trainer divides its logits by the same one) keeps the random model's
near-uniform distribution over 152k tokens from drowning every update.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import fmean

import pytest

from rolloutbus.config import Config
from rolloutbus.producers.datasets import write_jsonl
from rolloutbus.schemas.trajectories import batch_to_trajectories, decode_trajectory_batch
from rolloutbus.topics import Topics
from tests.helpers import unique_name
from tests.pipeline import (
    even_token_rollout,
    pipeline_config,
    pipeline_running,
    read_topic,
    spawn,
    stop,
)

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

STEPS = 16  # train steps
STALENESS = 1  # async_training.staleness_threshold, in versions
K = 3  # steps averaged at each end of the run
TRAIN_TIMEOUT_S = 600.0  # seconds for the whole run on two busy cores (~2 min when idle)


def _rows(count: int) -> list[dict]:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    return [
        {
            "data_source": "even_tokens",
            "prompt": [{"role": "user", "content": f"Say something about {words[i % 8]}."}],
            "extra_info": {"index": i},
        }
        for i in range(count)
    ]


@pytest.fixture
def loop_config(kafka_bootstrap: str, tmp_path: Path) -> Config:
    return pipeline_config(
        kafka_bootstrap,
        "learn",
        model={"seed": 0},
        rollout=even_token_rollout(tmp_path, n=4, response_length=12, temperature=0.05),
        async_training={
            "staleness_threshold": STALENESS,
            "ppo_mini_batch_size": 2,
            "require_batches": 1,
            "trigger_parameter_sync_step": 1,
        },
        actor={"optim": {"lr": 1e-3}},
        trainer={
            "group_id": unique_name("trainer"),
            "default_local_dir": str(tmp_path / "ckpt"),
            "metrics_log": str(tmp_path / "steps.jsonl"),
            "seed": 0,
            "torch_threads": 1,
        },
    )


def test_reward_rises_through_the_closed_loop(loop_config: Config, tmp_path: Path):
    cfg = loop_config
    config_path = tmp_path / "config.yaml"
    dataset = write_jsonl(_rows(8), tmp_path / "prompts.jsonl")
    beside = {
        "sync": ["weight-sync"],
        "dispatch": ["dispatch", str(dataset), "--epochs", "20"],
    }
    with pipeline_running(cfg, config_path, beside):
        trainer = spawn(["train", "--steps", str(STEPS)], config_path, tmp_path / "train.log")
        try:
            code = trainer.wait(TRAIN_TIMEOUT_S)
        finally:
            stop(trainer)
        assert code == 0, _tails(tmp_path)
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["global_step"] for s in steps] == list(range(1, STEPS + 1))

    # 1. the reward rises
    rewards = [s["reward/mean"] for s in steps]
    first, last = fmean(rewards[:K]), fmean(rewards[-K:])
    assert last > first + 0.15, f"reward did not rise: {[round(r, 3) for r in rewards]}"

    # 2. later trajectories were sampled by later policy versions (weights reloaded)
    versions = _min_versions(cfg)
    trained_at = {uid: s["global_step"] for s in steps for uid in s["uids"]}
    early = [versions[u] for u, step in trained_at.items() if step <= K]
    late = [versions[u] for u, step in trained_at.items() if step > STEPS - K]
    assert max(late) > max(early) and min(late) >= STEPS - K - 1 - STALENESS, (early, late)

    # 3. no trajectory trained beyond the staleness bound: trained at step k (version k - 1
    #    current), sampled from version k - 1 - STALENESS at the oldest
    for uid, step in trained_at.items():
        assert versions[uid] >= step - 1 - STALENESS, (uid, step, versions[uid])
    assert all(s["staleness/max"] <= STALENESS for s in steps)


def _min_versions(cfg: Config) -> dict[str, int]:
    """uid -> the oldest policy version that sampled any token of its trajectories."""
    out: dict[str, int] = {}
    for msg in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories):
        for t in batch_to_trajectories(decode_trajectory_batch(msg.value())):
            assert t.min_global_steps is not None, f"{t.key} has no policy version"
            out[t.uid] = min(out.get(t.uid, t.min_global_steps), t.min_global_steps)
    return out


def _tails(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log"))
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
