"""``rollout.name=rolloutbus``: the GPU-less replica (rolloutbus.verl.replica) in verl 0.9.1's
own bookkeeping, in the verl side environment (tests/verl_compat/verl_replica_program.py):
verl resolves the class by name and starts it standalone on a CPU pool, and verl's own
``CheckpointEngineManager.update_weights`` runs its whole non-naive protocol (abort, release,
prepare, topology, process groups, send and receive, finalize, resume) between it and a
two-rank actor group, whose rank 0 publishes the step on the real broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rolloutbus.config import Config, ModelConfig, ReplicasConfig
from rolloutbus.kafka.control import read_control_log
from tests.pipeline import write_config
from tests.source_tree import ROOT

PROGRAM = ROOT / "tests" / "verl_compat" / "verl_replica_program.py"
VERL_YAML = ROOT / "tests" / "data" / "verl" / "verl_0_9_1_generated_ppo_trainer.yaml"


@pytest.mark.verl
async def test_verls_checkpoint_manager_drives_the_stub_replica_and_publishes(
    run_in_verl, kafka_config, tmp_path
):
    cfg = Config(
        kafka=kafka_config,
        model=ModelConfig(name="tiny-qwen3"),
        replicas=ReplicasConfig(urls=["http://127.0.0.1:9"]),  # named only, never called
    )
    bus = write_config(cfg, tmp_path / "bus.yaml")
    run_id, root = uuid.uuid4().hex, tmp_path / "weights"
    argv = (str(PROGRAM), str(bus), str(VERL_YAML), str(root), run_id)

    seen = await asyncio.to_thread(run_in_verl, *argv, timeout=600)

    assert seen["replica"] == "BusRolloutReplica"
    assert seen["rollout_workers"] == seen["world_size"]  # one CPU worker per rollout rank
    assert seen["metrics"] == ["rolloutbus/weights_publish_s"]  # rank 0's, as verl merges them
    ledger = await asyncio.to_thread(read_control_log, cfg)
    assert ledger.run is not None and ledger.run.run_id == run_id
    assert ledger.current is not None and ledger.current.policy_version == 5
    assert ledger.current.weights_path == str((root / "global_step_5").resolve())
    assert any((root / "global_step_5").glob("*.safetensors"))
