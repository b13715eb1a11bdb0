"""Pure tests: Arrow trajectories to torch (verl-V0 padding, jagged), and the config loader."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError

from rolloutbus.config import VERL_KEYS_ACCEPTED_NOT_USED, load_config, with_overrides
from rolloutbus.consumers.tensors import PaddedBuffers, to_jagged, to_padded
from rolloutbus.errors import ConfigError
from rolloutbus.schemas.trajectories import Trajectory, trajectories_to_batch
from tests.builders import make_trajectory

PAD = 0


def _traj(i: int, prompt: list[int], response: list[int], mask: list[int], lp=None) -> Trajectory:
    return make_trajectory(
        "u",
        i,
        group_size=2,
        prompts=prompt,
        responses=response,
        response_mask=mask,
        rollout_log_probs=lp,
        reward_score=1.0,
        rm_scores=[0.0] * (len(response) - 1) + [1.0],
    )


@pytest.fixture
def batch():
    a = _traj(0, [11, 12, 13], [21, 31, 22], [1, 0, 1], [-0.5, 0.0, -0.25])
    b = _traj(1, [14], [23, 24], [1, 1], [-1.0, -2.0])
    # slice so the batch does not start at offset 0 (the ragged slicing trap)
    full = trajectories_to_batch([_traj(9, [1], [2], [1], [-0.1]), a, b])
    return full.slice(1, 2)


def test_v0_padding_layout(batch):
    out = to_padded(batch, prompt_length=4, response_length=4, pad_token_id=PAD)
    assert out["prompts"].tolist() == [[0, 11, 12, 13], [0, 0, 0, 14]]  # left-padded
    assert out["responses"].tolist() == [[21, 31, 22, 0], [23, 24, 0, 0]]  # right-padded
    assert out["input_ids"].tolist() == [
        [0, 11, 12, 13, 21, 31, 22, 0],
        [0, 0, 0, 14, 23, 24, 0, 0],
    ]
    # observations are attended to (the model reads them) but never in the loss
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 5, 5], [0, 0, 0, 0, 1, 2, 2, 2]]
    assert torch.allclose(
        out["rollout_log_probs"], torch.tensor([[-0.5, 0.0, -0.25, 0.0], [-1.0, -2.0, 0.0, 0.0]])
    )
    assert out["rm_scores"].tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]


def test_v0_padding_truncates_to_the_budgets(batch):
    out = to_padded(batch, prompt_length=2, response_length=2, pad_token_id=PAD)
    assert out["prompts"].tolist() == [[12, 13], [0, 14]]  # keeps the prompt's end
    assert out["responses"].tolist() == [[21, 31], [23, 24]]


def test_reused_buffers_hold_only_the_latest_batch(batch):
    """A second, shorter batch written into the first one's memory leaves nothing behind."""
    buffers = PaddedBuffers()
    widths = dict(prompt_length=4, response_length=4, pad_token_id=PAD)
    written = to_padded(batch, **widths, buffers=buffers)
    memory = written["input_ids"].data_ptr()
    first = {k: v.clone() for k, v in written.items()}
    assert all(torch.equal(first[k], v) for k, v in to_padded(batch, **widths).items())
    short = trajectories_to_batch([_traj(5, [7], [8], [1], [-0.3]), _traj(6, [9], [], [], [])])
    again = to_padded(short, **widths, buffers=buffers)
    fresh = to_padded(short, **widths)
    assert again.keys() == fresh.keys()
    assert all(torch.equal(again[k], fresh[k]) for k in fresh), "stale values in a reused buffer"
    assert again["input_ids"].data_ptr() == memory  # same shape: the memory was reused


def test_jagged_keeps_true_lengths(batch):
    nt = to_jagged(batch, "responses", dtype=torch.long)
    assert [t.tolist() for t in nt.unbind()] == [[21, 31, 22], [23, 24]]


def test_config_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  multi_turn:\n    max_tool_response_lenght: 10\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'rollout\.multi_turn\.max_tool_response_lenght'"
    ):
        load_config(path, env={})


def test_config_env_overrides_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 2\n  val_kwargs: {n: 3}\n")
    cfg = load_config(
        path, env={"ROLLOUTBUS__ROLLOUT__N": "8", "ROLLOUTBUS__KAFKA__TOPIC_PREFIX": "exp1"}
    )
    assert (cfg.rollout.n, cfg.rollout.val_kwargs.n, cfg.kafka.topic_prefix) == (8, 3, "exp1")
    assert cfg.rollout.agent.default_agent_loop == "single_turn_agent"
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(None, env={"ROLLOUTBUS__ROLLOUT__N": "0"})


def test_verl_rollout_block_can_be_pasted_and_read_the_verl_way(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    n: 5\n    response_length: 77\n"
        "    agent: {default_agent_loop: tool_agent}\n"
    )
    cfg = load_config(path, env={})
    assert cfg.rollout.n == 5 and cfg.rollout.agent.default_agent_loop == "tool_agent"
    assert cfg.actor_rollout_ref.rollout.response_length == 77  # as a ported loop reads it
    # the rest of actor_rollout_ref loads too (tests/verl_compat/test_verl_config.py); one section
    # under both names is still an error
    path.write_text("actor_rollout_ref:\n  actor: {}\n  rollout: {n: 2}\n")
    assert load_config(path, env={}).rollout.n == 2
    path.write_text("rollout: {n: 3}\nactor_rollout_ref:\n  rollout: {n: 2}\n")
    with pytest.raises(ConfigError, match="both 'rollout' and 'actor_rollout_ref.rollout'"):
        load_config(path, env={})


def test_config_is_frozen_and_adjusted_by_validated_copies():
    cfg = load_config(None, env={})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.replica_server.port = 0
    with pytest.raises(ValidationError, match="frozen"):
        cfg.rollout = cfg.rollout
    with pytest.raises(ValidationError, match="frozen"):
        cfg.actor_rollout_ref.rollout.n = 3  # the verl alias is the same frozen section
    moved = with_overrides(cfg, {"replica_server.port": 0, "replicas.urls": ["http://h:1"]})
    assert (moved.replica_server.port, moved.replicas.urls) == (0, ["http://h:1"])
    assert (cfg.replica_server.port, cfg.replicas.urls) == (8000, ["http://127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="unknown config key 'replica'"):
        with_overrides(cfg, {"replica.port": 0})  # the old name of replica_server
    with pytest.raises(ConfigError, match="rollout.n"):
        with_overrides(cfg, {"rollout.n": 0})


def test_verl_keys_with_no_meaning_here_are_accepted_with_a_warning(tmp_path, caplog):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    agent: {num_workers: 8}\n"
        "    multi_turn: {enable: true}\n"
    )
    with caplog.at_level(logging.WARNING, logger="rolloutbus.config"):
        cfg = load_config(path, env={})
    assert cfg.rollout.multi_turn.enable is True  # kept, for a ported loop that reads it
    warned = [r.getMessage() for r in caplog.records]
    assert (
        len(warned) == 1 and "'rollout.multi_turn.enable' = True" in warned[0]
    )  # 8 is verl's default
    assert "agent_name" in warned[0]
    assert set(VERL_KEYS_ACCEPTED_NOT_USED) == {
        "rollout.agent.num_workers",
        "rollout.multi_turn.enable",
        "rollout.val_kwargs.do_sample",
    }


def test_data_train_files_takes_one_path_or_a_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {train_files: ~/data/gsm8k/train.parquet, prompt_key: question}\n")
    cfg = load_config(path, env={})
    assert (
        cfg.data.train_files == ["~/data/gsm8k/train.parquet"] and cfg.data.prompt_key == "question"
    )
