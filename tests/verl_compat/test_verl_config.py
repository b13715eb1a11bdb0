"""A verl config and a verl dataset row move over unchanged: a whole verl 0.9.1 trainer
config loads (its generated ppo_trainer.yaml, a user's GRPO yaml): keys that apply are read
under our names, verl's other keys are listed once as ignored, any other key is still an
error suggesting the nearest; OmegaConf interpolations resolve; ``key=value`` overrides
take verl's or our names. ``data.*`` keys are honoured, validation samples as verl's
agent-loop path does, and every column of a row reaches the trajectory.

The tests marked ``verl`` read verl's own file from the side environment
(ops/contract/setup_verl_env.sh) and skip, saying why, without it."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rolloutbus.config import VERL_KEYS_IGNORED, VERL_KEYS_READ, Config, key_tree, load_config
from rolloutbus.consumers.training.grpo import GRPOTrainer
from rolloutbus.errors import ConfigError
from rolloutbus.producers.publish import build_group
from rolloutbus.schemas.trajectories import (
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectory,
)
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from tests.builders import make_group_started, make_session_failed, make_trajectory
from tests.source_tree import TEST_DATA

VERL_DATA = TEST_DATA / "verl"  # verl's own config files
VERL_BLOCK = VERL_DATA / "verl_0_9_1_rollout.yaml"
# verl 0.9.1's verl/trainer/config/_generated_ppo_trainer.yaml, byte for byte (checked
# against the installed verl by test_the_vendored_generated_config_is_verls)
VERL_TRAINER = VERL_DATA / "verl_0_9_1_generated_ppo_trainer.yaml"
USER_GRPO = VERL_DATA / "verl_grpo_user.yaml"


@pytest.fixture(scope="module")
def verl_configs(verl_site: Path) -> Path:
    """verl's own trainer config folder in its side environment; skips without it."""
    folder = verl_site / "verl" / "trainer" / "config"
    if not (folder / "_generated_ppo_trainer.yaml").is_file():
        pytest.skip(f"verl's generated trainer configs are not in {verl_site}")
    return folder


def _verl_config(tmp_path: Path, edit=None) -> Path:
    raw = yaml.safe_load(VERL_BLOCK.read_text())
    if edit:
        edit(raw)
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _listed_ignored(caplog) -> set[str]:
    """The keys of the one "accepted and ignored" record, ``a.{x, y}`` expanded."""
    listed = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert len(listed) == 1, listed  # listed once
    keys: set[str] = set()
    for line in listed[0].splitlines()[1:]:
        names = line.strip().split(": ", 1)[0]
        for part in re.findall(r"[\w.]+\{[^}]*\}|[\w.]+", names):
            if "{" in part:
                prefix, inner = part[:-1].split("{")
                keys.update(prefix + leaf.strip() for leaf in inner.split(","))
            else:
                keys.add(part)
    return keys


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
    # listed once, every ignored key by the name the file gives it
    listed = _listed_ignored(caplog)
    for key in ("name", "agent.custom_async_server", "engine_kwargs"):
        assert f"actor_rollout_ref.rollout.{key}" in listed
    assert "data.train_batch_size" in listed
    assert not any("_target_" in key for key in listed)


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
    "dotted, nearest",
    [
        (("actor_rollout_ref", "rollout", "temprature"), "temperature"),
        (("actor_rollout_ref", "rollout", "multi_turn", "fromat"), "format"),
        (("data", "promt_key"), "prompt_key"),
        (("actor_rollout_ref", "actor", "ppo_mini_batch_sise"), "ppo_mini_batch_size"),
        (("actor_rollout_ref", "actor", "optim", "lrr"), "lr"),
        (("actor_rollout_ref", "model", "pth"), "path"),
        (("trainer", "total_trainig_steps"), "total_training_steps"),
        (("algorithm", "use_kl_in_rewrd"), "use_kl_in_reward"),
        (("trainr",), "trainer"),
    ],
)
def test_a_key_in_neither_set_is_still_an_error_naming_it(tmp_path, dotted, nearest):
    def edit(raw):
        node = raw
        for part in dotted[:-1]:
            node = node.setdefault(part, {})
        node[dotted[-1]] = 1

    key = ".".join(dotted)
    with pytest.raises(ConfigError, match=rf"unknown config key '{re.escape(key)}'") as err:
        load_config(_verl_config(tmp_path, edit), env={})
    assert f"did you mean `{nearest}`?" in str(err.value)


def test_an_interpolation_without_a_target_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: {n: '${data.no_such_key}'}\n")
    with pytest.raises(ConfigError, match=r"'rollout.n' in .*'data.no_such_key' not found"):
        load_config(path, env={})


def test_ignored_keys_are_verls_and_not_ours():
    ours = set(_dotted_keys(key_tree()))
    assert not ours & set(VERL_KEYS_IGNORED)
    assert not ours & set(VERL_KEYS_READ)
    # every verl key that is read lands on one of our keys
    assert set(VERL_KEYS_READ.values()) <= ours


def _dotted_keys(tree, prefix=""):
    for name, sub in tree.items():
        yield prefix + name
        if sub is not None:
            yield from _dotted_keys(sub, f"{prefix}{name}.")


# -- a whole verl trainer config ----------------------------------------------------------


def test_verls_whole_generated_trainer_config_loads_with_an_override(caplog):
    with caplog.at_level(logging.WARNING, logger="rolloutbus.config"):
        cfg = load_config(VERL_TRAINER, env={}, overrides=["actor_rollout_ref.rollout.n=8"])
    _assert_verls_generated_trainer_config(cfg)
    listed = _listed_ignored(caplog)
    for key in ("critic", "reward_model", "actor_rollout_ref.ref", "trainer.nnodes"):
        assert key in listed
    assert "algorithm.gamma" in listed and "actor_rollout_ref.actor.use_kl_loss" in listed
    warned = " | ".join(r.getMessage() for r in caplog.records)
    # verl's default estimator is GAE: it loads, and `rolloutbus train` refuses it
    assert "'algorithm.adv_estimator' = 'gae' is not supported here" in warned
    assert "trainer.logger ['wandb']: not supported here" in warned


def _assert_verls_generated_trainer_config(cfg: Config) -> None:
    """What verl 0.9.1's generated ppo_trainer.yaml says, read with rollout.n=8."""
    assert cfg.rollout.n == 8
    assert (cfg.rollout.prompt_length, cfg.rollout.response_length) == (512, 512)
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.optim.betas == (0.9, 0.999)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.2)
    assert cfg.async_training.ppo_mini_batch_size == 256
    assert cfg.model.name == "~/models/deepseek-llm-7b-chat"  # as verl, no ~ expansion
    # ${trainer.project_name}/${trainer.experiment_name}, names that are otherwise ignored
    assert cfg.trainer.default_local_dir == Path("checkpoints/verl_examples/gsm8k")
    assert cfg.trainer.total_training_steps is None and cfg.trainer.logger == ["console", "wandb"]
    assert cfg.algorithm.rollout_correction.rollout_is is None  # verl's default: metrics only
    assert cfg.algorithm.adv_estimator == "gae"


@pytest.mark.verl
def test_the_vendored_generated_config_is_verls(verl_configs):
    """The fixture the fast tests load is verl 0.9.1's file, byte for byte; the real file
    loads with the override as the fixture does."""
    theirs = verl_configs / "_generated_ppo_trainer.yaml"
    assert theirs.read_bytes() == VERL_TRAINER.read_bytes()
    cfg = load_config(theirs, env={}, overrides=["actor_rollout_ref.rollout.n=8"])
    _assert_verls_generated_trainer_config(cfg)


@pytest.mark.verl
@pytest.mark.parametrize("engine", ["", "_megatron", "_torchtitan", "_veomni"])
def test_every_generated_verl_trainer_config_loads(verl_configs, engine):
    """verl's generated configs for each of its training engines load whole."""
    path = verl_configs / f"_generated_ppo{engine}_trainer.yaml"
    cfg = load_config(path, env={}, overrides=["actor_rollout_ref.rollout.n=8"])
    assert (cfg.rollout.n, cfg.rollout.prompt_length) == (8, 512)
    assert (
        cfg.actor.optim.lr
        == yaml.safe_load(path.read_text())["actor_rollout_ref"]["actor"]["optim"]["lr"]
    )


@pytest.mark.verl
def test_rolloutbus_config_prints_verls_generated_config_resolved(verl_configs):
    theirs = verl_configs / "_generated_ppo_trainer.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "config", "-c", str(theirs)]
        + ["actor_rollout_ref.rollout.n=8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["rollout"]["n"] == 8 and printed["rollout"]["prompt_length"] == 512
    assert printed["actor"]["optim"]["lr"] == 1e-6
    assert Config.model_validate(printed) is not None  # what it prints loads back
    assert "accepted and ignored" in done.stderr  # the list goes to stderr, not stdout


def test_a_users_grpo_config_loads_whole(caplog, monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.delenv("ROLLOUTBUS_TEST_MODEL_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="rolloutbus.config"):
        cfg = load_config(USER_GRPO, env={})
    r = cfg.rollout
    assert (r.n, r.temperature, r.prompt_length, r.response_length) == (5, 0.9, 256, 1024)
    assert r.max_model_len == 2048  # a nested oc.select default
    assert r.multi_turn.max_assistant_turns == 4
    assert cfg.actor.optim.lr == 3e-6 and cfg.actor.optim.weight_decay == 0.0
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)  # ${.clip_ratio}
    assert cfg.actor.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.async_training.ppo_mini_batch_size == 64
    # ${oc.env:HOME}, and an oc.env default that is itself an interpolation
    assert cfg.model.name == "/home/someone/models/Qwen2.5-0.5B-Instruct"
    assert cfg.data.train_files == ["/home/someone/data/gsm8k/train.parquet"]
    assert cfg.trainer.default_local_dir == Path(
        "/home/someone/ckpts/verl_grpo_example_gsm8k/qwen2.5_0.5b_grpo"
    )
    assert cfg.trainer.total_training_steps == 200
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo
    listed = _listed_ignored(caplog)  # critic's ??? values are fine: nothing reads them
    assert {"critic", "reward_model", "actor_rollout_ref.ref", "trainer.save_freq"} <= listed
    assert "algorithm.use_kl_in_reward" in listed
    warned = [r.getMessage() for r in caplog.records]
    assert any("'actor_rollout_ref.actor.use_kl_loss' = True" in m for m in warned)
    assert not any("'actor_rollout_ref.actor.entropy_coeff' =" in m for m in warned)  # 0: as here


def test_a_missing_value_that_is_read_is_an_error_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "actor_rollout_ref:\n  model:\n    path: ???\ncritic:\n  model:\n    path: ???\n"
    )
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.model.path' in .* is '\?\?\?'"):
        load_config(path, env={})


def test_hydras_defaults_list_is_refused_with_what_to_give_instead(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("defaults:\n  - ppo_trainer\n  - _self_\nrollout: {n: 2}\n")
    with pytest.raises(ConfigError, match="hydra 'defaults' list.*--cfg job"):
        load_config(path, env={})


def test_a_setting_given_under_both_names_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "actor: {optim: {lr: 1.0e-5}}\nactor_rollout_ref: {actor: {optim: {lr: 1.0e-6}}}\n"
    )
    with pytest.raises(ConfigError, match="both set actor.optim.lr: keep one"):
        load_config(path, env={})


def test_train_refuses_an_estimator_other_than_grpo():
    cfg = Config.model_validate({"algorithm": {"adv_estimator": "gae"}})
    with pytest.raises(ConfigError, match="implements grpo only"):
        GRPOTrainer(cfg)  # before it loads any model


# -- overrides ------------------------------------------------------------------------------


def test_overrides_take_verls_or_our_names_and_land_where_the_file_keeps_them(tmp_path):
    ours = tmp_path / "ours.yaml"
    ours.write_text("rollout: {n: 2, response_length: 64}\nactor: {optim: {lr: 1.0e-5}}\n")
    cfg = load_config(
        ours,
        env={},
        overrides=["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.optim.lr=2e-6"],
    )
    assert (cfg.rollout.n, cfg.rollout.response_length, cfg.actor.optim.lr) == (8, 64, 2e-6)
    # our names on a verl file; interpolations see the override (verl's prompt_length is
    # ${oc.select:data.max_prompt_length,512})
    cfg = load_config(
        VERL_TRAINER,
        env={},
        overrides=["rollout.n=3", "actor.optim.lr=5e-6", "data.max_prompt_length=1024"],
    )
    assert (cfg.rollout.n, cfg.actor.optim.lr, cfg.rollout.prompt_length) == (3, 5e-6, 1024)


def test_precedence_is_file_then_env_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout: {n: 2, temperature: 0.5, top_p: 0.9}\n")
    env = {"ROLLOUTBUS__ROLLOUT__N": "4", "ROLLOUTBUS__ROLLOUT__TEMPERATURE": "0.7"}
    cfg = load_config(path, env=env, overrides=["rollout.n=6"])
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.rollout.top_p) == (6, 0.7, 0.9)


def test_override_values_are_yaml_and_hydras_prefixes_are_accepted():
    cfg = load_config(
        None,
        env={},
        overrides=[
            "trainer.logger=[console,file]",
            "+trainer.metrics_log=steps.jsonl",
            "++replicas.urls=[http://a:1,http://b:2]",
            "trainer.total_training_steps=null",
            "kafka.topic_prefix=${oc.env:ROLLOUTBUS_NO_SUCH_VAR,exp}-1",
        ],
    )
    assert cfg.trainer.logger == ["console", "file"] and cfg.trainer.metrics_log == Path(
        "steps.jsonl"
    )
    assert cfg.replicas.urls == ["http://a:1", "http://b:2"]
    assert cfg.trainer.total_training_steps is None and cfg.kafka.topic_prefix == "exp-1"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "rollout.nn=8",
            r"unknown config key 'rollout.nn' \(from override 'rollout.nn=8'\): did you mean `n`\?",
        ),
        (
            "rollout.n=zero",
            r"config key 'rollout.n' \(from override 'rollout.n=zero'\): Input should be a valid",
        ),
        (
            "rollout.n.x=1",
            r"config key 'rollout.n' \(from override 'rollout.n.x=1'\): Input should be a valid",
        ),
        ("rollout.n=[1", r"not valid YAML"),
    ],
)
def test_a_bad_override_is_an_error_naming_it(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, env={}, overrides=[override])


def test_verls_file_logger_becomes_the_trainers_metrics_log(tmp_path):
    cfg = load_config(
        VERL_TRAINER,
        env={"VERL_FILE_LOGGER_ROOT": str(tmp_path)},
        overrides=["trainer.logger=[file]"],
    )
    assert cfg.trainer.metrics_log == tmp_path / "verl_examples" / "gsm8k.jsonl"
    cfg = load_config(None, env={}, overrides=["trainer.logger=file"])  # one name, as verl
    assert cfg.trainer.logger == ["file"] and cfg.trainer.metrics_log == Path(
        "rolloutbus/train.jsonl"
    )
    with pytest.raises(ConfigError, match="did you mean `tensorboard`"):
        load_config(None, env={}, overrides=["trainer.logger=[tensorbord]"])


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
    fold = PartitionFold(0, 0)
    fold.apply(0, make_group_started(group.uid, row=group.row))
    released = fold.apply(1, make_session_failed(group.uid))
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
    t = make_trajectory(
        reward_score=1.0, reward_extra_info={"score": 1.0, "acc": True, "pred": "42"}
    )
    again = batch_to_trajectories(decode_trajectory_batch(encode_trajectory(t)))[0]
    assert again.reward_extra_info == {"score": 1.0, "acc": True, "pred": "42"}
    assert again.extra_columns == {}
