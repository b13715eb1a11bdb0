"""Fenced policy versions, end to end: the trainer's fenced writer, a running weight sync,
and a real embedded replica (tiny Qwen3 over HTTP), on the real broker.

* A second run on the same topics supersedes the first: the running weight sync loads its
  version 0 (its initial weights) although run 1 was at version 1, the first run's writer
  is fenced, a late record of the first run is ignored, and a weight sync started afresh
  (on a restarted replica) reaches the same state.
* A stray ``{"policy_version": 7}`` does not relabel the replica, a version that goes
  backwards is never applied, and both (and junk bytes) become dead letters, written once
  even when the weight sync restarts.

Which weights a replica serves is read from its greedy tokens (each seed of the tiny
model answers differently) and its ``/weight_info`` label.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch

from rolloutbus.config import Config, ModelConfig, ReplicasConfig, ReplicaServerConfig
from rolloutbus.errors import TrainerFencedError
from rolloutbus.kafka.control import PolicyVersionPublisher, TrainerControlWriter
from rolloutbus.models.causal_lm import load_causal_lm
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.streams.inference.weight_sync import WeightSync
from rolloutbus.topics import CONTROL_PARTITION, Topics
from tests.pipeline import read_topic

PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198]
TOKENS = 6  # greedy tokens compared: enough to tell the seeds apart
WAIT_S = 60.0  # seconds; a reload of the tiny model takes well under one
SEEDS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[int, tuple[Path, list[int]]]:
    """seed -> (a checkpoint folder as the trainer writes it, its greedy tokens)."""
    out = {}
    for seed in SEEDS:
        model = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=seed))[0]
        folder = tmp_path_factory.mktemp(f"seed{seed}")
        model.save_pretrained(str(folder))
        out[seed] = (folder, _greedy(model))
    assert len({tuple(tokens) for _, tokens in out.values()}) == len(SEEDS)  # distinguishable
    return out


def _greedy(model) -> list[int]:
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def _replica_config(port: int = 0) -> Config:
    return Config(
        model=ModelConfig(name="tiny-qwen3", seed=0),
        replica_server=ReplicaServerConfig(port=port, max_model_len=256, torch_threads=1),
    )


async def _serves(url: str) -> tuple[list[int], str]:
    """The replica's greedy tokens for PROMPT and its version label."""
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        done = await http.post(
            url + "/v1/completions",
            json={
                "model": "tiny-qwen3",
                "prompt": PROMPT,
                "max_tokens": TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        info = await http.get(url + "/weight_info")
    assert done.status_code == 200, done.text
    return done.json()["choices"][0]["token_ids"], str(info.json()["weight_version"])


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@asynccontextmanager
async def _running(cfg: Config) -> AsyncIterator[WeightSync]:
    """``rolloutbus weight-sync``'s loop, in this process."""
    stop = asyncio.Event()
    async with WeightSync(cfg) as sync:
        runner = asyncio.ensure_future(sync.run(stop))
        try:
            yield sync
        finally:
            stop.set()
            await asyncio.wait_for(runner, WAIT_S)


def _version(v: int, folder: Path | None) -> PolicyVersionPublished:
    return PolicyVersionPublished(
        policy_version=v, weights_path=str(folder) if folder else None, global_step=v
    )


def _at(sync: WeightSync, epoch: int, version: int) -> Callable[[], bool]:
    def reached() -> bool:
        current = sync.current
        applied = all(r.applied == version for r in sync.replicas.values())
        return (
            current is not None
            and (current.run_epoch, current.policy_version) == (epoch, version)
            and applied
        )

    return reached


async def test_a_second_run_supersedes_the_first_in_a_running_and_a_restarted_weight_sync(
    kafka_config, weights
):
    with replica_in_thread(_replica_config()) as replica:
        cfg = Config(
            kafka=kafka_config, replicas=ReplicasConfig(urls=[replica.url], health_interval_s=0.5)
        )
        async with _running(cfg) as sync:
            run1 = await asyncio.to_thread(TrainerControlWriter, cfg)
            await asyncio.to_thread(run1.start_run, "run-1", _version(0, weights[0][0]))
            await asyncio.to_thread(run1.publish, _version(1, weights[1][0]))
            await _until(_at(sync, 1, 1), "run 1's version 1")
            assert await _serves(replica.url) == (weights[1][1], "1")

            # run 2 starts at version 0 with its own initial weights: applied, not ignored
            run2 = await asyncio.to_thread(TrainerControlWriter, cfg)  # fences run 1
            await asyncio.to_thread(run2.start_run, "run-2", _version(0, weights[2][0]))
            await _until(_at(sync, 2, 0), "run 2's version 0")
            assert await _serves(replica.url) == (weights[2][1], "0")
            with pytest.raises(TrainerFencedError):
                await asyncio.to_thread(run1.publish, _version(2, weights[1][0]))
            # a record of run 1 that got through anyway (an unfenced writer) is ignored
            late = _version(5, weights[1][0]).model_copy(update={"run_id": "run-1", "run_epoch": 1})
            await asyncio.to_thread(PolicyVersionPublisher(cfg).publish, late)
            await asyncio.to_thread(run2.publish, _version(1, weights[3][0]))
            await _until(_at(sync, 2, 1), "run 2's version 1")
            assert await _serves(replica.url) == (weights[3][1], "1")
            run1.close()
            run2.close()
        assert 5 not in {o.policy_version for o in sync.report.history}
        state = sync.current

    # a fresh replica (initial weights) and a weight sync started afresh: the same state
    with replica_in_thread(_replica_config()) as fresh:
        assert (await _serves(fresh.url))[0] == weights[0][1]
        cfg = cfg.model_copy(update={"replicas": ReplicasConfig(urls=[fresh.url])})
        async with _running(cfg) as again:
            await _until(_at(again, 2, 1), "run 2's version 1 after a restart")
            assert again.current == state
            assert await _serves(fresh.url) == (weights[3][1], "1")


async def test_a_stray_record_and_a_backwards_version_are_dead_letters_never_applied(
    kafka_config, make_producer, weights
):
    topics = Topics.from_config(kafka_config)
    producer = make_producer(kafka=kafka_config)

    def raw(value: bytes, key: str = "policy_version") -> None:
        producer.produce(topics.control, key=key, value=value, partition=CONTROL_PARTITION)
        assert producer.flush(10) == 0

    with replica_in_thread(_replica_config()) as replica:
        cfg = Config(
            kafka=kafka_config, replicas=ReplicasConfig(urls=[replica.url], health_interval_s=0.5)
        )
        async with _running(cfg) as sync:
            await asyncio.to_thread(raw, json.dumps({"policy_version": 7}).encode())
            writer = await asyncio.to_thread(TrainerControlWriter, cfg)
            await asyncio.to_thread(writer.start_run, "run-1", _version(0, weights[0][0]))
            await asyncio.to_thread(writer.publish, _version(1, weights[1][0]))
            await _until(_at(sync, 1, 1), "the real version 1")  # not hidden by the "7"
            assert await _serves(replica.url) == (weights[1][1], "1")
            assert all(o.policy_version != 7 for o in sync.report.history)

            # inside run 1, version 0 again (another folder): backwards, never applied
            assert writer.run is not None
            backwards = _version(0, weights[2][0]).model_copy(
                update={"run_id": "run-1", "run_epoch": writer.run.run_epoch}
            )
            await asyncio.to_thread(PolicyVersionPublisher(cfg).publish, backwards)
            await asyncio.to_thread(raw, b"\x00 not a control event")
            await asyncio.to_thread(writer.publish, _version(2, weights[3][0]))
            await _until(_at(sync, 1, 2), "version 2 after the bad records")
            assert await _serves(replica.url) == (weights[3][1], "2")
            writer.close()
        # never the 7, never back to 0 after 1 (a version published in between may be
        # skipped: the follower hands out the newest)
        applied = [o.policy_version for o in sync.report.history]
        assert applied == sorted(applied) and applied[-1] == 2 and 7 not in applied, applied

        letters = _dead_letters(cfg)
        # (the dead-letter topic has several partitions: its order is not the log's)
        assert sorted(reason.split(":")[0] for reason in letters) == [
            "backwards",
            "malformed",
            "no_weights",
        ], letters
        # a restarted weight sync reads the same records: no letter is written twice
        async with _running(cfg) as again:
            await _until(_at(again, 1, 2), "version 2 after a restart")
        assert sorted(_dead_letters(cfg)) == sorted(letters)


def _dead_letters(cfg: Config) -> list[str]:
    records = read_topic(cfg, Topics.from_config(cfg.kafka).dlq)
    letters = [json.loads(m.value()) for m in records]
    assert all(letter["stage"] == "control" for letter in letters), letters
    return [letter["reason"] for letter in letters]
