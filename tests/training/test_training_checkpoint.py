"""Pure tests of the trainer's data path: padded conversion against a per-row reference,
train batches from groups, and checkpoints (weights, AdamW state, position) round trips."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rolloutbus.config import ModelConfig
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.position import PartitionPosition, TrainerPosition
from rolloutbus.consumers.tensors import to_padded
from rolloutbus.consumers.training.batch import build_train_batch
from rolloutbus.consumers.training.checkpoint import (
    LATEST,
    TrainerState,
    latest_checkpoint,
    load_optimizer,
    load_state,
    save_checkpoint,
    step_folder,
    weights_folder,
)
from rolloutbus.consumers.training.policy import load_policy, response_log_probs
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.trajectories import Trajectory, trajectories_to_batch
from tests.builders import make_trajectory


def _traj(uid, i, prompt, response, *, mask=None, lp=None, reward=1.0, status="completed"):
    return make_trajectory(
        uid,
        i,
        group_size=2,
        status=status,
        prompts=prompt,
        responses=response,
        response_mask=mask,
        rollout_log_probs=lp,
        reward_score=reward,
        data_source="even",
        min_global_steps=0,
        max_global_steps=1,
    )


def _reference_padded(rows, prompt_length, response_length, pad):
    """The per-row definition: left-pad (keep the end) prompts, right-pad responses."""
    n = len(rows)
    out = {
        "prompts": torch.full((n, prompt_length), pad),
        "responses": torch.full((n, response_length), pad),
        "response_mask": torch.zeros((n, response_length), dtype=torch.long),
        "rollout_log_probs": torch.zeros((n, response_length)),
    }
    for i, t in enumerate(rows):
        p = t.prompts[-prompt_length:]
        r = t.responses[:response_length]
        out["prompts"][i, prompt_length - len(p) :] = torch.tensor(p, dtype=torch.long)
        out["responses"][i, : len(r)] = torch.tensor(r, dtype=torch.long)
        m = t.response_mask[: min(response_length, len(r))]
        out["response_mask"][i, : len(m)] = torch.tensor(m, dtype=torch.long)
        lp = (t.rollout_log_probs or [])[:response_length]
        out["rollout_log_probs"][i, : len(lp)] = torch.tensor(lp)
    return out


@pytest.mark.parametrize(("prompt_length", "response_length"), [(9, 12), (3, 4)])
def test_vectorised_padding_equals_the_per_row_definition(prompt_length, response_length):
    rng = np.random.default_rng(1)
    rows = []
    for i in range(40):
        p = rng.integers(0, 1000, rng.integers(1, 9)).tolist()
        r = rng.integers(0, 1000, rng.integers(1, 12)).tolist()
        lp = None if i % 7 == 3 else (-rng.random(len(r))).round(3).tolist()
        rows.append(_traj("u", i, p, r, mask=rng.integers(0, 2, len(r)).tolist(), lp=lp))
    batch = trajectories_to_batch(rows).slice(3, 30)  # a slice: offsets not starting at 0
    got = to_padded(
        batch, prompt_length=prompt_length, response_length=response_length, pad_token_id=5
    )
    want = _reference_padded(rows[3:33], prompt_length, response_length, 5)
    for key in ("prompts", "responses", "response_mask"):
        assert torch.equal(got[key], want[key]), key
    assert torch.allclose(got["rollout_log_probs"], want["rollout_log_probs"])
    assert torch.equal(got["input_ids"], torch.cat([want["prompts"], want["responses"]], 1))
    attention = torch.cat([want["prompts"] != -1, want["responses"] != -1], 1)  # shape only
    assert got["attention_mask"].shape == attention.shape


def test_response_mask_shorter_than_the_response_is_zero_past_its_end():
    t = Trajectory.model_construct(**_traj("u", 0, [1], [7, 8, 9], mask=[1, 1, 1]).__dict__)
    batch = trajectories_to_batch([t])
    short = batch.set_column(
        batch.schema.get_field_index("response_mask"),
        "response_mask",
        pa.array([[1, 1]], type=pa.large_list(pa.int8())),
    )
    out = to_padded(short, prompt_length=1, response_length=4, pad_token_id=0)
    assert out["response_mask"].tolist() == [[1, 1, 0, 0]]


def _group(uid, trajs):
    return TrajectoryGroup(uid, trajectories_to_batch(trajs), partition=0, last_offset=0)


def test_train_batch_drops_failed_rows_and_keeps_groups():
    a = _group("a", [_traj("a", 0, [1, 2], [3], lp=[-0.1]), _traj("a", 1, [1], [4, 5], reward=0)])
    failed = _traj("b", 1, [], [], status="failed", reward=None)
    b = _group("b", [_traj("b", 0, [9], [8, 7, 6], lp=[-1.0, -2.0, -3.0]), failed])
    b.loss_weight = 0.5  # down-weighted as stale by the trainer client
    batch = build_train_batch([a, b], pad_token_id=0)
    assert batch.loss_weights.tolist() == [1.0, 1.0, 0.5]
    assert batch.uids == ["a", "a", "b"] and batch.group_uids == ["a", "b"]
    assert batch.dropped_failed == 1
    assert batch.tensors["responses"].shape == (3, 3) and batch.prompt_length == 2
    assert batch.has_rollout_log_probs.tolist() == [True, False, True]
    assert batch.scores.tolist() == [1.0, 0.0, 1.0]
    assert batch.select([2]).uids == ["b"]


def test_train_batch_needs_a_reward_on_every_row():
    with pytest.raises(SchemaError, match="no reward_score"):
        build_train_batch([_group("a", [_traj("a", 0, [1], [2], reward=None)])], pad_token_id=0)


def _small_lm():
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def _stepped(lm):
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    lm(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    return optimizer


def test_checkpoint_round_trip(tmp_path):
    lm = _small_lm()
    optimizer = _stepped(lm)
    position = TrainerPosition(
        topic="t.trajectories", partitions={0: PartitionPosition(offset=7, yielded={"g": 9})}
    )
    state = TrainerState(global_step=3, policy_version=1, position=position, groups_trained=12)
    folder = save_checkpoint(tmp_path, lm, optimizer, state, keep=2)
    assert folder == step_folder(tmp_path, 3) == latest_checkpoint(tmp_path)
    assert (weights_folder(folder) / "config.json").is_file()

    loaded = load_state(folder)
    assert loaded.position == position and loaded.global_step == 3
    restored = load_policy(ModelConfig(), weights_folder(folder))
    for (name, a), b in zip(lm.state_dict().items(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    fresh = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    load_optimizer(fresh, folder, loaded)
    saved, back = optimizer.state_dict(), fresh.state_dict()
    assert back["param_groups"] == saved["param_groups"]
    for p, entry in saved["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(back["state"][p][k]), torch.as_tensor(v)), (p, k)


def test_checkpoints_are_pruned_and_a_partial_one_is_ignored(tmp_path):
    lm = _small_lm()
    optimizer = _stepped(lm)
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path, lm, optimizer, TrainerState(global_step=step, policy_version=0), 2
        )
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [
        "global_step_2",
        "global_step_3",
    ]
    # a trainer killed while writing step 4 leaves a temporary folder: never the latest
    (tmp_path / f".tmp_global_step_4_{os.getpid()}").mkdir()
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 3)
    assert (tmp_path / LATEST).read_text() == "3"


def test_response_log_probs_are_the_models_next_token_logprobs():
    lm = _small_lm().eval()
    batch = trajectories_to_batch([_traj("u", 0, [1, 2], [3, 4, 5]), _traj("u", 1, [6], [7])])
    tensors = to_padded(batch, prompt_length=2, response_length=3, pad_token_id=0)
    got = response_log_probs(lm, tensors)
    with torch.no_grad():
        full = torch.log_softmax(lm(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits, -1)
    want = [full[0, 1, 3], full[0, 2, 4], full[0, 3, 5]]
    assert torch.allclose(got[0], torch.stack(want), atol=1e-5)
    with torch.no_grad():
        alone = torch.log_softmax(lm(input_ids=torch.tensor([[6, 7]])).logits, -1)[0, 0, 7]
    assert torch.allclose(got[1, 0], alone, atol=1e-5)  # left padding changes nothing


def test_step_log_writes_jsonl_csv_prometheus_and_a_progress_line(tmp_path):
    import io

    from prometheus_client import CollectorRegistry

    from rolloutbus.consumers.training.metrics import TrainerMetrics
    from rolloutbus.consumers.training.step_log import StepLog

    record = {
        "global_step": 3,
        "policy_version": 2,
        "groups": 2,
        "tokens": 40,
        "reward/mean": 0.75,
        "reward/mean/even": 0.75,
        "actor/pg_clipfrac": 0.125,
        "timing/step_s": 1.5,
        "timing/wait_s": 0.5,
        "uids": ["a", "b"],
    }
    registry = CollectorRegistry()
    for name in ("steps.jsonl", "steps.csv"):
        out = io.StringIO()
        log = StepLog(tmp_path / name, TrainerMetrics(registry), out)
        log.write(record)
        log.close()
        assert out.getvalue().startswith("[train] step 3 v2 | reward 0.750")
    assert json.loads((tmp_path / "steps.jsonl").read_text()) == record
    header, row = (tmp_path / "steps.csv").read_text().splitlines()
    assert header.split(",")[:2] == ["global_step", "policy_version"]
    assert row.endswith('"[""a"", ""b""]"')  # lists as JSON inside the CSV cell
    assert registry.get_sample_value("rolloutbus_trainer_global_step") == 3
    assert registry.get_sample_value("rolloutbus_trainer_groups_total") == 4  # two writes
    assert (
        registry.get_sample_value("rolloutbus_trainer_reward_mean", {"data_source": "even"}) == 0.75
    )
    assert registry.get_sample_value("rolloutbus_trainer_pg_clipfrac") == 0.125
    # no aggregate hides in a label: the whole batch's mean is a gauge of its own
    assert registry.get_sample_value("rolloutbus_trainer_batch_reward_mean") == 0.75
    assert registry.get_sample_value("rolloutbus_trainer_wait_seconds") == 0.5
    assert (
        registry.get_sample_value("rolloutbus_trainer_reward_mean", {"data_source": "all"}) is None
    )
    # without verl's "console" in trainer.logger: no progress line, the file and series stay
    out = io.StringIO()
    quiet = StepLog(
        tmp_path / "quiet.jsonl", TrainerMetrics(CollectorRegistry()), out, console=False
    )
    quiet.write(record)
    quiet.close()
    assert out.getvalue() == "" and (tmp_path / "quiet.jsonl").read_text().strip()
