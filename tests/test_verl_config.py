"""A verl config and a verl dataset row move over unchanged: verl 0.9.1's generated rollout
block loads (keys that apply are read, verl's other keys are listed once as ignored, any
other key is still an error), ``data.*`` keys are honoured, validation samples as verl's
agent-loop path does, and every column of a row reaches the trajectory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from rolloutbus.config import VERL_KEYS_IGNORED, Config, load_config
from rolloutbus.errors import ConfigError
from rolloutbus.producers.publish import build_group
from rolloutbus.schemas.trajectories import (
    Trajectory,
    TrajectoryStatus,
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectory,
)
from rolloutbus.schemas.turns import GroupStarted, SessionFailed
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories

VERL_BLOCK = Path(__file__).parent / "fixtures" / "verl_0_9_1_rollout.yaml"


def _verl_config(tmp_path: Path, edit=None) -> Path:
    raw = yaml.safe_load(VERL_BLOCK.read_text())
    if edit:
        edit(raw)
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_verls_generated_rollout_block_loads_as_it_is(caplog):
    with caplog.at_level(logging.WARNING, logger="rolloutbus.config"):
        cfg = load_config(VERL_BLOCK, env={})
    r = cfg.rollout
    # read: including the ${oc.select:data.max_prompt_length,512} interpolations
    assert (r.prompt_length, r.response_length, r.n, r.temperature) == (512, 512, 1, 1.0)
    assert (r.multi_turn.format, r.multi_turn.max_tool_response_length) == ("hermes", 256)
    assert r.agent.default_agent_loop == "single_turn_agent"
    assert cfg.data.prompt_key == "prompt" and cfg.data.train_files == [
        "~/data/rlhf/gsm8k/train.parquet"
    ]
    # listed once, every ignored key by name
    listed = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert len(listed) == 1
    for key in ("rollout.name", "rollout.agent.custom_async_server", "rollout.engine_kwargs"):
        assert key in listed[0]
    assert "data.train_batch_size" in listed[0] and "_target_" not in listed[0]


def test_data_lengths_reach_the_rollout_as_verls_interpolation_does(tmp_path):
    def edit(raw):
        raw["data"]["max_prompt_length"] = 1024
        raw["data"]["max_response_length"] = 2048

    cfg = load_config(_verl_config(tmp_path, edit), env={})
    assert (cfg.rollout.prompt_length, cfg.rollout.response_length) == (1024, 2048)
    # without the rollout block too (verl's default block interpolates them)
    path = tmp_path / "data_only.yaml"
    path.write_text("data: {max_prompt_length: 64, max_response_length: 32}\n")
    cfg = load_config(path, env={})
    assert (cfg.rollout.prompt_length, cfg.rollout.response_length) == (64, 32)


@pytest.mark.parametrize(
    "dotted, key",
    [
        (("actor_rollout_ref", "rollout", "temprature"), "rollout.temprature"),
        (("actor_rollout_ref", "rollout", "multi_turn", "fromat"), "rollout.multi_turn.fromat"),
        (("data", "promt_key"), "data.promt_key"),
    ],
)
def test_a_key_in_neither_set_is_still_an_error_naming_it(tmp_path, dotted, key):
    def edit(raw):
        node = raw
        for part in dotted[:-1]:
            node = node[part]
        node[dotted[-1]] = 1

    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(_verl_config(tmp_path, edit), env={})


def test_an_interpolation_without_a_target_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: {n: '${data.no_such_key}'}\n")
    with pytest.raises(ConfigError, match="no key 'data.no_such_key'"):
        load_config(path, env={})


def test_ignored_keys_are_verls_and_not_ours():
    ours = {f"rollout.{name}" for name in Config.model_fields["rollout"].annotation.model_fields}
    ours |= {f"data.{name}" for name in Config.model_fields["data"].annotation.model_fields}
    assert not ours & set(VERL_KEYS_IGNORED)


# -- sampling ---------------------------------------------------------------------------


def _row(**extra):
    return {"data_source": "d", "prompt": [{"role": "user", "content": "q"}], **extra}


def test_validation_samples_with_val_kwargs_temperature_as_verl():
    cfg = Config.model_validate(
        {"rollout": {"temperature": 0.9, "val_kwargs": {"temperature": 0.6, "top_p": 0.95}}}
    )
    params = build_group(cfg, _row(), validate=True).sampling_params
    # do_sample stays False (the default): verl's agent-loop path does not read it
    assert (params.temperature, params.top_p) == (0.6, 0.95)
    assert build_group(cfg, _row()).sampling_params.temperature == 0.9


def test_a_rows_do_sample_false_is_greedy_in_training_only():
    cfg = Config.model_validate(
        {"rollout": {"top_p": 0.8, "top_k": 20, "val_kwargs": {"temperature": 0.5}}}
    )
    train = build_group(cfg, _row(__do_sample__=False)).sampling_params
    assert (train.temperature, train.top_p, train.top_k) == (0.0, 1.0, -1)
    val = build_group(cfg, _row(__do_sample__=False), validate=True).sampling_params
    assert val.temperature == 0.5


# -- rows -------------------------------------------------------------------------------


def test_every_column_of_a_row_reaches_the_trajectory():
    row = _row(
        index=7,
        ability="math",
        tools_kwargs={"calculator": {}},
        my_dataset_column={"nested": [1, 2]},
        agent_name="tool_agent",
        reward_model={"ground_truth": "1"},
        extra_info={"split": "train"},
    )
    group = build_group(Config(), row)
    assert group.row["my_dataset_column"] == {"nested": [1, 2]}
    started = GroupStarted(uid=group.uid, attempt="a", n=1, row=group.row)
    fold = PartitionFold(0, 0)
    fold.apply(0, started)
    released = fold.apply(1, SessionFailed(uid=group.uid, session_id=0, attempt="a", error="x"))
    [t] = build_group_trajectories(released.group, released.sessions)
    assert t.extra_columns == {
        "index": 7,
        "ability": "math",
        "tools_kwargs": {"calculator": {}},
        "my_dataset_column": {"nested": [1, 2]},
    }
    assert t.extra_info == {"split": "train"} and t.reward_model == {"ground_truth": "1"}
    again = batch_to_trajectories(decode_trajectory_batch(encode_trajectory(t)))[0]
    assert again.extra_columns == t.extra_columns


def test_reward_extra_info_round_trips_on_the_trajectory():
    t = Trajectory(
        key="u_0_0",
        uid="u",
        session_id=0,
        output_index=0,
        num_outputs=1,
        group_size=1,
        status=TrajectoryStatus.COMPLETED,
        reward_score=1.0,
        reward_extra_info={"score": 1.0, "acc": True, "pred": "42"},
    )
    again = batch_to_trajectories(decode_trajectory_batch(encode_trajectory(t)))[0]
    assert again.reward_extra_info == {"score": 1.0, "acc": True, "pred": "42"}
    assert again.extra_columns == {}
