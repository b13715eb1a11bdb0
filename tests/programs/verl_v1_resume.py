"""Run in the verl 0.9.1 side environment: a verl V1 trainer (``separate_async``) that saves
at step 1 with groups in flight, goes on producing, dies, and is restarted from the save
(tests/verl_compat/test_verl_trainer_resume.py).

Each life is verl's own ``PPOTrainer`` methods bound to a minimal trainer object, as verl's
CPU tests do: ``_build_replay_buffer`` (the bus sampler from
``trainer.v1.sampler.custom_sampler``), ``_load_checkpoint``, ``_submit_batch_to_rollout``,
``_save_checkpoint`` (which calls ``BusCheckpointCallback`` through
``trainer.checkpoint_callback_class``) and ``_reissue_inflight_prompts``; Ray on CPUs and a
real TransferQueue. Test doubles stand in for what needs a GPU: the actor worker group's
``save_checkpoint``/``load_checkpoint``, and the dataloader's state.

Life 1: step 1 trains A; B completes into TransferQueue (not sampled); C is submitted; verl
saves ``global_step_1``; then D is submitted and every group of C and D is read; the
process dies (nothing committed after the save). Life 2 uses a new consumer group, so only
``rolloutbus.json`` can say where to re-read: verl's ``_load_checkpoint`` restores
TransferQueue, ``_reissue_inflight_prompts`` re-dispatches C, step 2 samples B and C, then E
(fresh prompts) is submitted and sampled, and the sampler reads the topic to its end.

Usage: ``verl_v1_resume.py BUS_CONFIG_LIFE1 BUS_CONFIG_LIFE2 VERL_YAML CKPT_DIR``;
prints one JSON line of what it saw.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from types import SimpleNamespace
from typing import Any

import ray
import transfer_queue as tq
from omegaconf import OmegaConf
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl_v1_tq import TQ_CONFIG, WAIT_S, N, _batch  # this folder, first on sys.path

from rolloutbus.verl import BusAgentLoopManager, read_bus_state

RUN_ID = "run-resume"


class ActorGroupDouble:
    """Stands in for the actor worker group (a GPU): its checkpoint calls do nothing."""

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass


class LoaderDouble:
    """Stands in for verl's StatefulDataLoader: an empty state (prompts come from _batch)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _verl_config(verl_yaml: str, bus: str, ckpt_dir: str) -> Any:
    return OmegaConf.merge(
        OmegaConf.load(verl_yaml),
        {
            "rolloutbus": {"config": bus},
            "actor_rollout_ref": {"rollout": {"n": N}},
            "trainer": {
                "default_local_dir": ckpt_dir,
                "resume_mode": "auto",
                "checkpoint_callback_class": "rolloutbus.verl.BusCheckpointCallback",
                "v1": {
                    "trainer_mode": "separate_async",
                    "sampler": {
                        "max_off_policy_threshold": None,
                        "custom_sampler": {
                            "path": "pkg://rolloutbus.verl.sampler",
                            "name": "BusReplayBufferAsync",
                        },
                        "sampler_kwargs": {"rolloutbus": {"config": bus, "run_id": RUN_ID}},
                    },
                },
            },
        },
    )


def _trainer(config: Any) -> Any:
    """What verl's ``PPOTrainer.__init__`` builds, in its order: the callback, the replay
    buffer (the bus sampler), then (by the caller) ``_load_checkpoint``."""
    trainer = SimpleNamespace(
        config=config,
        trainer_mode="separate_async",
        global_steps=0,
        use_critic=False,
        actor_rollout_wg=ActorGroupDouble(),
        train_dataloader=LoaderDouble(),
        checkpoint_callback=build_checkpoint_callback(config),
        _add_prompts_to_generate=None,
    )
    trainer.replay_buffer = PPOTrainer._build_replay_buffer(trainer)
    trainer.agent_loop_manager = BusAgentLoopManager.create(
        config=config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None
    )
    return trainer


def _submit(trainer: Any, count: int) -> list[str]:
    batch = _batch(count, trainer.global_steps)
    PPOTrainer._submit_batch_to_rollout(trainer, batch)
    return [str(u) for u in batch["uid"]]


def _drain_until_written(sampler: Any, uids: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not set(uids) <= {u for u, _ in sampler.drained.written}:
        assert time.monotonic() < deadline, f"groups {uids} never reached TransferQueue"
        sampler.drain_bus()


def life_one(config: Any) -> dict[str, Any]:
    tq.init(TQ_CONFIG)
    trainer = _trainer(config)
    PPOTrainer._load_checkpoint(trainer)  # resume_mode=auto, nothing saved: from scratch
    sampler = trainer.replay_buffer
    trainer.global_steps = 1
    a = _submit(trainer, 2)
    meta, _ = sampler.sample(1, "train", 2)
    b = _submit(trainer, 2)
    _drain_until_written(sampler, b)  # finished in TransferQueue, not sampled
    c = _submit(trainer, 2)  # running: no drain before the save
    PPOTrainer._save_checkpoint(trainer)
    trainer.global_steps = 2
    d = _submit(trainer, 2)  # produced after the save
    _drain_until_written(sampler, c + d)  # read by this life, then lost with it
    out = {
        "uids": {"A": a, "B": b, "C": c, "D": d},
        "started_fresh": sampler.resumed_from is None,
        "sampled": list(meta.keys),
        "written": [u for u, _ in sampler.drained.written],
    }
    sampler.close()  # the process dies: nothing is committed after the save
    tq.close()
    return out


def life_two(config: Any, saved: Any) -> dict[str, Any]:
    tq.init(TQ_CONFIG)
    trainer = _trainer(config)
    sampler = trainer.replay_buffer
    PPOTrainer._load_checkpoint(trainer)
    trainer.global_steps += 1  # fit(): "we start from step 1"
    reissued = PPOTrainer._reissue_inflight_prompts(trainer)
    meta, _ = sampler.sample(trainer.global_steps, "train", 4)
    e = _submit(trainer, 2)  # the restored dataloader's next prompts, fresh uids
    meta_e, _ = sampler.sample(trainer.global_steps, "train", 2)
    deadline = time.monotonic() + WAIT_S
    while not sampler.bus_client.at_end():  # every record on the topic has been read
        assert time.monotonic() < deadline, "the sampler never reached the end of the topic"
        sampler.drain_bus()
    resumed = sampler.resumed_from
    out = {
        "uids": {"E": e},
        "global_steps": trainer.global_steps,
        "reissued": reissued,
        "resumed": None if resumed is None else resumed.model_dump(mode="json"),
        "resumed_equals_saved": resumed is not None and resumed.position == saved.position,
        "sampled": list(meta.keys) + list(meta_e.keys),
        "written": [[u, s] for u, s in sampler.drained.written],
        "dropped": [[u, r] for u, r in sampler.drained.dropped],
    }
    sampler.close()
    tq.close()
    return out


def main() -> None:
    signal.alarm(WAIT_S * 4)  # never hang a test session
    bus_one, bus_two, verl_yaml, ckpt_dir = sys.argv[1:5]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    first = life_one(_verl_config(verl_yaml, bus_one, ckpt_dir))
    saved = read_bus_state(f"{ckpt_dir}/global_step_1")
    assert saved is not None, "verl's save wrote no rolloutbus.json"
    second = life_two(_verl_config(verl_yaml, bus_two, ckpt_dir), saved)
    ray.shutdown()
    print(
        json.dumps(
            {"saved": saved.model_dump(mode="json"), "first": first, "second": second},
        )
    )


if __name__ == "__main__":
    main()
