"""Run in the verl 0.9.1 side environment: verl's V1 control plane consumes the bus
(tests/verl_compat/test_verl_trainer_tq.py).

Ray on CPUs, a real TransferQueue (one SimpleStorage unit), and verl's own ``PPOTrainer``
methods bound to a minimal trainer object (as verl's CPU tests do):
``_submit_batch_to_rollout`` through ``BusAgentLoopManager``, the bus sampler's ``sample``,
verl's ``_compute_advantage`` (the actor's ``old_log_probs`` stood in for by the rollout's).
Then a stray uid (published, never registered in TransferQueue), a re-dispatched one
(``generate_sequences`` twice for the same uid), and a restart: a new sampler re-reading the
topic from the start, TransferQueue saved and loaded, verl's ``_reissue_inflight_prompts``.
Usage: ``verl_v1_tq.py BUS_CONFIG VERL_YAML``; prints one JSON line of what it saw.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray
import torch
import transfer_queue as tq
import verl.utils.tensordict_utils as tu
from omegaconf import OmegaConf
from prometheus_client import REGISTRY
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils.dataset.rl_dataset import collate_fn
from verl.utils.import_utils import load_extern_type

from rolloutbus.verl import BusAgentLoopManager

N = 2  # rollout.n
WAIT_S = 300  # the longest this waits for one group
TQ_CONFIG = OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})


def _batch(count: int, global_steps: int) -> Any:
    """``_fetch_one_gen_batch``'s batch: RLHFDataset rows, verl's collate_fn, uuid4 uids."""
    items = [
        {
            "raw_prompt": [{"role": "user", "content": f"Say something about item {i}."}],
            "data_source": "even_tokens",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i},
            "index": i,
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
        }
        for i in range(count)
    ]
    batch_dict = collate_fn(items)
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in items], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    return batch


def _layout(meta: Any) -> dict[str, Any]:
    """The fields of a sampled batch, checked against AgentLoopWorkerTQ's layout."""
    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id)
    tags = tq.kv_list(partition_id=meta.partition_id)[meta.partition_id]
    rows = []
    for i, key in enumerate(meta.keys):
        prompts, responses = data["prompts"][i], data["responses"][i]
        scores, tag = data["rm_scores"][i], tags[key]
        rows.append(
            {
                "key": key,
                "uid": data["uid"][i],
                "input_ids_is_prompts_then_responses": torch.equal(
                    data["input_ids"][i], torch.cat([prompts, responses])
                ),
                "loss_mask_is_response_mask": torch.equal(
                    data["loss_mask"][i], data["response_mask"][i]
                ),
                "position_ids_len_is_input_len": len(data["position_ids"][i])
                == len(data["input_ids"][i]),
                "logprobs_len_is_response_len": len(data["rollout_log_probs"][i]) == len(responses),
                "rm_scores_zero_before_last": bool((scores[:-1] == 0).all()),
                "dtypes": [str(prompts.dtype), str(scores.dtype)],
                "tag": {k: tag.get(k) for k in ("status", "seq_len", "global_steps")},
                "seq_len": len(prompts) + len(responses),
            }
        )
    return {"rows": rows}


def _group_means(meta: Any) -> list[float]:
    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id)
    by_uid: dict[str, list[float]] = {}
    for i in range(len(meta.keys)):
        advantage = data["advantages"][i]
        by_uid.setdefault(data["uid"][i], []).append(float(advantage[-1]))
    return [sum(v) / len(v) for v in by_uid.values()]


def _stand_in_for_the_actor(meta: Any) -> None:
    """What ``_compute_old_log_prob``'s actor forward writes (the one step not run here):
    ``old_log_probs``, taken as the rollout's own, as verl's bypass mode does."""
    data = tq.kv_batch_get(
        keys=meta.keys, partition_id=meta.partition_id, select_fields=["rollout_log_probs"]
    )
    fields = TensorDict({"old_log_probs": data["rollout_log_probs"]}, batch_size=len(meta.keys))
    tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=fields)


def _drain_until(sampler: Any, seen: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not seen() and time.monotonic() < deadline:
        sampler.drain_bus()


def _restart(trainer: Any, sampler: Any) -> dict[str, Any]:
    """An async-mode step's prompts in flight when verl checkpoints: TransferQueue's
    save_checkpoint, close, a fresh init, load_checkpoint, then verl's own
    ``_reissue_inflight_prompts`` (it re-dispatches the same uids). ``sampler``: a new one,
    whose trainer client starts from the beginning of the trajectory topic."""
    trainer.trainer_mode, trainer.global_steps = "separate_async", 3
    fresh = _batch(2, global_steps=3)
    PPOTrainer._submit_batch_to_rollout(trainer, fresh)  # async: the prompts' fields stored
    uids = [str(u) for u in fresh["uid"]]
    folder = tempfile.mkdtemp(prefix="tq-ckpt-")
    tq.save_checkpoint(folder)
    tq.close()
    tq.init(TQ_CONFIG)
    tq.load_checkpoint(folder)
    reissued = PPOTrainer._reissue_inflight_prompts(trainer, "train")
    meta, _ = sampler.sample(3, "train", 2)
    deadline = time.monotonic() + 20  # a second copy, if any, arrives within this
    while time.monotonic() < deadline:
        sampler.drain_bus()
    return {
        "uids": uids,
        "reissued": reissued,
        "sampled_keys": sorted(meta.keys),
        "written": {u: [s for w, s in sampler.drained.written if w == u] for u in uids},
        "dropped": {u: [r for d, r in sampler.drained.dropped if d == u] for u in uids},
    }


def main() -> None:
    signal.alarm(WAIT_S * 3)  # never hang a test session
    bus, verl_yaml = sys.argv[1], sys.argv[2]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(TQ_CONFIG)
    config = OmegaConf.merge(
        OmegaConf.load(verl_yaml),
        {
            "rolloutbus": {"config": bus},
            "actor_rollout_ref": {"rollout": {"n": N}},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        },
    )
    manager = BusAgentLoopManager.create(
        config=config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None
    )
    trainer = SimpleNamespace(
        config=config, trainer_mode="sync", global_steps=1, agent_loop_manager=manager
    )
    # as PPOTrainer._build_replay_buffer loads trainer.v1.sampler.custom_sampler.{path,name}
    sampler_class = load_extern_type("pkg://rolloutbus.verl.sampler", "BusReplayBuffer")
    options = OmegaConf.create({"rolloutbus": {"config": bus, "run_id": "run-v1"}})

    def make_sampler() -> Any:
        return sampler_class(
            trainer_mode="sync",
            trainer_config=OmegaConf.create({}),
            max_off_policy_threshold=None,
            max_off_policy_strategy="drop",
            sampler_kwargs=options,
            poll_interval=0.5,
        )

    sampler = make_sampler()
    out: dict[str, Any] = {}
    batch = _batch(4, global_steps=1)
    out["submitted"] = PPOTrainer._submit_batch_to_rollout(trainer, batch)
    out["uids"] = [str(u) for u in batch["uid"]]
    meta, _ = sampler.sample(1, "train", 4)
    out["sampled_keys"] = list(meta.keys)
    out["layout"] = _layout(meta)
    _stand_in_for_the_actor(meta)
    PPOTrainer._compute_advantage(trainer, meta, {})
    out["advantage_group_means"] = _group_means(meta)

    stray = _batch(1, global_steps=2)  # published, never registered in TransferQueue
    manager.generate_sequences(stray)
    stray_uid = str(stray["uid"][0])
    _drain_until(sampler, lambda: any(u == stray_uid for u, _ in sampler.drained.dropped))
    out["stray"] = [r for u, r in sampler.drained.dropped if u == stray_uid]

    trainer.global_steps = 2
    again = _batch(1, global_steps=2)
    PPOTrainer._submit_batch_to_rollout(trainer, again)
    manager.generate_sequences(again)  # the same uid again: _reissue_inflight_prompts
    again_uid = str(again["uid"][0])
    meta2, _ = sampler.sample(2, "train", 1)
    deadline = time.monotonic() + 20  # a second copy, if any, arrives within this
    while time.monotonic() < deadline:
        sampler.drain_bus()
    out["redispatched"] = {
        "sampled_keys": list(meta2.keys),
        "written": [s for u, s in sampler.drained.written if u == again_uid],
        "dropped": [r for u, r in sampler.drained.dropped if u == again_uid],
        "keys_in_tq": sorted(
            k for k in tq.kv_list(partition_id="train")["train"] if k.startswith(again_uid)
        ),
        "uid": again_uid,
    }
    sampler.close()  # the trainer process ends; its sampler committed nothing
    sampler = make_sampler()  # the restarted trainer's: it re-reads the topic from the start
    out["restart"] = _restart(trainer, sampler)
    earlier = {*out["uids"], again_uid}
    out["restart"]["reread_written"] = [u for u, _ in sampler.drained.written if u in earlier]
    out["restart"]["reread_dropped"] = sorted({u for u, _ in sampler.drained.dropped} & earlier)
    out["dropped_metric"] = {
        reason: REGISTRY.get_sample_value(
            "rolloutbus_verl_sampler_dropped_groups_total", {"reason": reason}
        )
        for reason in ("not_requested", "settled")
    }
    out["sampler_bases"] = [c.__name__ for c in sampler_class.__mro__[:2]]
    out["source"] = {
        "run_id": sampler.rolloutbus_source.run_id,
        "partitions": sorted(sampler.rolloutbus_source.position().partitions),
    }
    sampler.close()
    tq.close()
    ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
