"""The ``rolloutbus`` checkpoint-engine backend, built by verl 0.9.1's own registry in the
verl side environment (tests/verl_compat/verl_weights_program.py) and fed tiny-qwen3's
seed-1 state dict as verl's per-tensor generator, on the real broker: every rank drains the
generator, rank 0 alone writes the HF folder and publishes it, its first publish fences an
older trainer and starts a run, and the embedded replica (seed 0) loads the folder through
the weight sync and then samples as seed 1 does; the sync then says so
(``PolicyVersionApplied``)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from rolloutbus.config import Config, ModelConfig, ReplicasConfig
from rolloutbus.errors import TrainerFencedError
from rolloutbus.kafka.control import TrainerControlWriter, read_control_log
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.streams.inference.weight_sync import WeightSync
from rolloutbus.verl import INSTALL_HINT, VerlNotInstalledError
from rolloutbus.verl.applied import wait_for_applied
from rolloutbus.verl.weights_publish import write_folder
from tests.pipeline import write_config
from tests.replica_http import greedy_reference, greedy_turn

PROGRAM = Path(__file__).with_name("verl_weights_program.py")
WAIT_S = 120.0  # seconds; a reload of the tiny model takes well under one


def test_the_folder_is_sharded_by_size_and_renamed_into_place(tmp_path):
    embed = torch.ones(4, 8)
    pairs = [("embed.weight", embed), ("lm_head.weight", embed), ("big", torch.zeros(64))]
    folder = write_folder(
        iter(pairs), tmp_path / "v1", shard_bytes=300
    )  # bytes: the two 128-byte tensors, then "big"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + [
        "model.safetensors.index.json"
    ]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["big"] == "model-00002-of-00002.safetensors"  # 256 bytes alone
    assert index["metadata"]["total_size"] == 2 * 128 + 256
    again = write_folder(iter(pairs[:1]), tmp_path / "v1")  # the same step again replaces it
    assert sorted(p.name for p in again.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]  # no temporary left
    with pytest.raises(ValueError, match="given twice"):
        write_folder(iter(pairs[:1] * 2), tmp_path / "v2")


def test_the_backend_without_verl_says_what_to_install():
    try:
        import verl  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("verl is installed here")
    with pytest.raises(VerlNotInstalledError, match=INSTALL_HINT.replace("[", r"\[")):
        import rolloutbus.verl.weights  # noqa: F401


@pytest.mark.verl
async def test_the_backend_publishes_a_folder_the_replica_loads(
    run_in_verl, tiny_replica, seed1, seed1_folder, kafka_config, tmp_path
):
    cfg = Config(
        kafka=kafka_config,
        model=ModelConfig(name="tiny-qwen3"),
        replicas=ReplicasConfig(urls=[tiny_replica.url]),
    )
    config_path = write_config(cfg, tmp_path / "bus.yaml")
    older = TrainerControlWriter(cfg)  # a trainer that ran before verl's
    older.start_run("older-run", PolicyVersionPublished(policy_version=0))
    run_id, root = uuid.uuid4().hex, tmp_path / "weights"

    seen = await asyncio.to_thread(
        run_in_verl, str(PROGRAM), str(config_path), str(seed1_folder), str(root), run_id
    )

    # every rank drained the whole generator; only rank 0 wrote and published
    assert seen["taken"] == [seen["names"], seen["names"]]
    assert seen["metrics"] == [
        ["rolloutbus/weights_publish_s"],
        {},
        ["rolloutbus/weights_publish_s"],
    ]
    assert seen["topology"] == [{}, {}] and seen["received"] == 0
    assert sorted(p.name for p in root.iterdir()) == ["global_step_3", "global_step_4"]
    folder = root / "global_step_4"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == seen["names"]  # lm_head too, tied or not
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    with safe_open(str(folder / shards[0]), "pt") as f:
        name = next(iter(f.keys()))
        assert f.get_tensor(name).equal(seed1.state_dict()[name])
    assert (folder / "config.json").read_text() == (seed1_folder / "config.json").read_text()

    # the first publish fenced the older trainer and started a run; the second stayed in it
    with pytest.raises(TrainerFencedError):
        older.publish(PolicyVersionPublished(policy_version=1, weights_path=str(seed1_folder)))
    older.close()
    ledger = await asyncio.to_thread(read_control_log, cfg)
    assert ledger.run is not None and ledger.run.run_id == run_id
    version = ledger.current
    assert version is not None and (version.policy_version, version.global_step) == (4, 4)
    assert version.weights_path == str(folder.resolve())
    assert (version.run_id, version.run_epoch) == (run_id, ledger.run.run_epoch)
    assert version.model_name == "tiny-qwen3" and not ledger.refused

    # the weight sync loads it into the replica, which then samples as seed 1 does
    async with WeightSync(cfg) as sync:
        [outcome] = await sync.apply(version)
        announced = await sync.announce_if_served()
    assert outcome.outcome == "applied", outcome.error
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        turn = await greedy_turn(http, 8, url=tiny_replica.url)
    assert turn.token_ids == greedy_reference(seed1, 8)
    assert turn.extra_fields["min_global_steps"] == 4
    applied = await asyncio.to_thread(wait_for_applied, cfg, 4, run_id=run_id, timeout_s=WAIT_S)
    assert announced == applied
    # the rollout side's receive_weights with wait_applied_s returns on that announcement
    argv = (str(PROGRAM), str(config_path), str(seed1_folder), str(root), run_id, "receive")
    assert await asyncio.to_thread(run_in_verl, *argv) == {"received": 0}
