"""verl's V1 control plane consumes the bus: everything real but the actor's forward and
backward.

The bus side runs as processes on the test session's broker: a tiny-qwen3 replica, a
session worker and the replay buffer. The verl side (tests/programs/verl_v1_tq.py, in the
verl 0.9.1 side environment): Ray on CPUs, a real TransferQueue, verl's own
``PPOTrainer._submit_batch_to_rollout`` through ``BusAgentLoopManager``, the bus sampler's
``sample``, verl's ``_compute_advantage``; then a stray uid and a re-dispatched one.
"""

from __future__ import annotations

import pytest

from tests.source_tree import ROOT
from tests.verl_compat.bus_stack import bus_running, even_token_config

PROGRAM = ROOT / "tests" / "programs" / "verl_v1_tq.py"
VERL_YAML = ROOT / "tests" / "data" / "verl" / "verl_0_9_1_generated_ppo_trainer.yaml"

pytestmark = [pytest.mark.verl, pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def seen(run_in_verl, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("verl_tq")
    cfg = even_token_config(kafka_bootstrap, tmp_path, "verltq", "verl")
    with bus_running(cfg, tmp_path) as (config_path, logs):
        argv = (str(PROGRAM), str(config_path), str(VERL_YAML))
        return run_in_verl(*argv, timeout=900, logs=logs.values())


def test_verls_submit_and_the_bus_sampler_give_n_outputs_per_prompt(seen):
    assert seen["submitted"] == 4
    expected = sorted(f"{uid}_{i}_0" for uid in seen["uids"] for i in range(2))
    assert sorted(seen["sampled_keys"]) == expected


def test_the_fields_follow_agent_loop_worker_tqs_layout(seen):
    for row in seen["layout"]["rows"]:
        assert row["key"].startswith(row["uid"] + "_")
        assert row["input_ids_is_prompts_then_responses"]
        assert row["loss_mask_is_response_mask"]
        assert row["position_ids_len_is_input_len"]
        assert row["logprobs_len_is_response_len"]
        assert row["rm_scores_zero_before_last"]
        assert row["dtypes"] == ["torch.int64", "torch.float32"]
        assert row["tag"] == {"status": "success", "seq_len": row["seq_len"], "global_steps": 1}


def test_verls_grpo_advantages_have_zero_mean_per_group(seen):
    means = seen["advantage_group_means"]
    assert len(means) == 4
    assert all(abs(m) < 1e-5 for m in means), means


def test_a_stray_uid_is_dropped_and_counted(seen):
    assert seen["stray"] == ["not_requested"]
    assert seen["dropped_metric"]["not_requested"] >= 1


def test_a_redispatched_uid_arrives_once(seen):
    again = seen["redispatched"]
    uid = again["uid"]
    assert again["written"] == ["finished"]
    assert sorted(again["sampled_keys"]) == [f"{uid}_0_0", f"{uid}_1_0"]
    assert again["keys_in_tq"] == [f"{uid}_0_0", f"{uid}_1_0"]


def test_after_transfer_queues_save_and_load_the_reissued_groups_arrive_once(seen):
    """verl's _reissue_inflight_prompts re-dispatches the checkpointed in-flight uids; each
    group is written to TransferQueue once and sampled once."""
    restart = seen["restart"]
    assert restart["reissued"] == 2
    expected = sorted(f"{uid}_{i}_0" for uid in restart["uids"] for i in range(2))
    assert restart["sampled_keys"] == expected
    assert restart["written"] == {uid: ["finished"] for uid in restart["uids"]}


def test_a_restarted_sampler_rereads_the_topic_and_writes_no_earlier_group(seen):
    """The new sampler's client starts at the topic's beginning (nothing was committed):
    every group trained before the restart comes back and is dropped, none is written."""
    restart = seen["restart"]
    assert restart["reread_written"] == []
    assert len(restart["reread_dropped"]) == 5  # the first batch's 4 uids and the re-dispatched


def test_verls_loader_finds_the_sampler_as_a_subclass_of_its_replay_buffer(seen):
    assert seen["sampler_bases"] == ["BusReplayBuffer", "ReplayBuffer"]


def test_the_sampler_is_the_checkpoint_callbacks_position_source(seen):
    assert seen["source"]["run_id"] == "run-v1"
    assert seen["source"]["partitions"]  # the partitions its trainer client read
