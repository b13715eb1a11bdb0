"""Exactly once across a verl restart: the bus sampler resumes at the position that
``global_step_N/rolloutbus.json`` saved, and verl's TransferQueue registry gates each group.

The bus side runs as processes on the test session's broker (a tiny-qwen3 replica, a
session worker, the replay buffer); the verl side is tests/programs/verl_v1_resume.py
in the verl 0.9.1 side environment (two trainer lives in one process, see its docstring).
The second life uses a new consumer group: the group's commits cannot place its reader, only
``rolloutbus.json`` can. The first tests need no broker: where ``resume_state`` finds the
folder, as verl's ``_load_checkpoint`` does.
"""

from __future__ import annotations

from collections import Counter

import pytest
from omegaconf import OmegaConf

from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.errors import RolloutBusError
from rolloutbus.verl import BusCheckpointState, write_bus_state
from rolloutbus.verl.checkpoint import resume_folder, resume_state
from tests.helpers import unique_name
from tests.pipeline import write_config
from tests.source_tree import ROOT
from tests.verl_compat.bus_stack import bus_running, even_token_config

PROGRAM = ROOT / "tests" / "programs" / "verl_v1_resume.py"
VERL_YAML = ROOT / "tests" / "data" / "verl" / "verl_0_9_1_generated_ppo_trainer.yaml"
POSITION = TrainerPosition(topic="rollout.trajectories", partitions={0: {"offset": 9}})


def _trainer_config(mode: str, **keys: str) -> object:
    return OmegaConf.create({"trainer": {"resume_mode": mode, **keys}})


def test_resume_disabled_starts_from_the_groups_commits(tmp_path):
    assert resume_folder(_trainer_config("disable", default_local_dir=str(tmp_path))) is None


def test_resume_path_reads_the_state_of_that_folder(tmp_path):
    folder = tmp_path / "global_step_4"
    write_bus_state(
        folder, BusCheckpointState(run_id="r", global_step=4, position=POSITION, committed=True)
    )
    state = resume_state(_trainer_config("resume_path", resume_from_path=str(folder)))
    assert state is not None and state.position == POSITION and state.global_step == 4


def test_a_resume_folder_without_the_bus_state_fails_fast(tmp_path):
    folder = tmp_path / "global_step_2"
    folder.mkdir()
    with pytest.raises(RolloutBusError, match="no rolloutbus.json"):
        resume_state(_trainer_config("resume_path", resume_from_path=str(folder)))


def test_a_state_copied_from_another_step_fails_fast(tmp_path):
    folder = tmp_path / "global_step_5"
    write_bus_state(
        folder, BusCheckpointState(run_id="r", global_step=4, position=POSITION, committed=True)
    )
    with pytest.raises(RolloutBusError, match="step 4, not 5"):
        resume_state(_trainer_config("resume_path", resume_from_path=str(folder)))


@pytest.fixture(scope="module")
def lives(run_in_verl, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("verl_resume")
    cfg = even_token_config(kafka_bootstrap, tmp_path, "verlresume", "verl-life1")
    second = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"group_id": unique_name("verl-life2")})}
    )
    second_path = write_config(second, tmp_path / "bus-life2.yaml")
    with bus_running(cfg, tmp_path) as (config_path, logs):
        argv = (PROGRAM, config_path, second_path, VERL_YAML, tmp_path / "checkpoints")
        return run_in_verl(*map(str, argv), timeout=900, logs=logs.values())


def _keys(uids: list[str]) -> list[str]:
    return [f"{uid}_{i}_0" for uid in uids for i in range(2)]


@pytest.mark.verl
@pytest.mark.kafka
@pytest.mark.slow
def test_each_group_is_sampled_exactly_once_across_both_lives(lives):
    first, second = lives["first"], lives["second"]
    uids = {**first["uids"], **second["uids"]}
    sampled = Counter(first["sampled"] + second["sampled"])
    assert sorted(first["sampled"]) == sorted(_keys(uids["A"]))
    assert sorted(second["sampled"]) == sorted(_keys(uids["B"] + uids["C"] + uids["E"]))
    assert set(sampled.values()) == {1}
    # D was produced after the save: its prompts are verl's to issue again (data.pt), fresh
    assert not {k.split("_", 1)[0] for k in sampled} & set(uids["D"])


@pytest.mark.verl
@pytest.mark.kafka
@pytest.mark.slow
def test_the_restarted_sampler_starts_at_the_saved_position(lives):
    first, second, saved = lives["first"], lives["second"], lives["saved"]
    read = {u for u, _ in second["written"]} | {u for u, _ in second["dropped"]}
    # A was trained and B held in TransferQueue before the save: not one record re-read
    assert not read & set(first["uids"]["A"] + first["uids"]["B"])
    assert first["started_fresh"]
    assert (saved["run_id"], saved["global_step"], saved["committed"]) == ("run-resume", 1, True)
    assert second["resumed"]["global_step"] == 1 and second["resumed_equals_saved"]
    assert second["global_steps"] == 2


@pytest.mark.verl
@pytest.mark.kafka
@pytest.mark.slow
def test_in_flight_groups_are_written_once_and_later_ones_dropped(lives):
    first, second = lives["first"], lives["second"]
    assert second["reissued"] == 2  # verl re-dispatched C, the groups running at the save
    written = Counter(u for u, _ in second["written"])
    assert {u: written[u] for u in first["uids"]["C"]} == {u: 1 for u in first["uids"]["C"]}
    dropped = {u: r for u, r in second["dropped"]}
    assert {u: dropped.get(u) for u in first["uids"]["D"]} == {
        u: "not_requested" for u in first["uids"]["D"]
    }
