"""Run in the verl 0.9.1 side environment: ``BusAgentLoopManager`` publishes batches built
as verl's V1 trainer builds them (tests/verl_compat/test_verl_trainer_v1.py).

Each batch is what ``PPOTrainer._fetch_one_gen_batch`` / ``_validate`` hand
``generate_sequences``: RLHFDataset-shaped rows through verl's ``collate_fn``, a uuid4 ``uid``
per row, ``tu.get_tensordict``, then ``global_steps`` (and ``validate``) assigned as
``NonTensorData``. Usage: ``verl_v1_publish.py BUS_CONFIG``; prints one JSON line: the uids
of each batch, by name.
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

import numpy as np
import torch
import verl.utils.tensordict_utils as tu
from omegaconf import OmegaConf
from verl.utils.dataset.rl_dataset import collate_fn

from rolloutbus.verl import BusAgentLoopManager


def _item(i: int, **extra: Any) -> dict[str, Any]:
    """One RLHFDataset ``__getitem__`` row."""
    return {
        "raw_prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
        "data_source": "openai/gsm8k",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i, "split": "train"},
        "index": i,
        "tools_kwargs": {},
        "interaction_kwargs": {},
        "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
        **extra,
    }


def _batch(items: list[dict[str, Any]], global_steps: int, validate: bool = False) -> Any:
    batch_dict = collate_fn(items)
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in items], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    if validate:
        tu.assign_non_tensor_data(batch, "validate", True)
    return batch


def main() -> None:
    verl_config = OmegaConf.create(
        {
            "rolloutbus": {"config": sys.argv[1]},
            "actor_rollout_ref": {
                "rollout": {"n": 3, "temperature": 0.9, "val_kwargs": {"n": 2, "temperature": 0.0}}
            },
        }
    )
    manager = BusAgentLoopManager.create(
        config=verl_config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None
    )
    batches = {
        "train": _batch([_item(0), _item(1)], global_steps=7),
        "per_row": _batch(
            [
                _item(2, __rollout_n__=4, __do_sample__=True),
                _item(3, __rollout_n__=1, __do_sample__=False),
            ],
            global_steps=8,
        ),
        "val": _batch([_item(4)], global_steps=8, validate=True),
    }
    uids = {}
    for name, batch in batches.items():
        uids[name] = [str(u) for u in batch["uid"]]
        assert manager.generate_sequences(batch) is None  # non-blocking: nothing returned
    print(json.dumps(uids))


if __name__ == "__main__":
    main()
