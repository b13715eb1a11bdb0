"""Runs in the verl 0.9.1 side environment (tests/verl_compat/test_verl_weights.py): builds
the ``rolloutbus`` checkpoint engine the way verl's actor worker does
(``verl/workers/engine_workers.py:679-688``: ``CheckpointEngineConfig``,
``import_external_libs(custom_backend_module)``, ``CheckpointEngineRegistry.new(backend,
is_master=, bucket_size=, **engine_kwargs[backend])``), once as rank 0 and once as rank 1,
and feeds both tiny-qwen3's seed-1 state dict as verl's per-tensor generator.

argv: bus config, model folder (verl's model.path), weights root, run id. Prints one JSON
line: what each rank did. With a fifth argument ``receive``: the rollout side instead, as
``CheckpointEngineWorker`` builds it (``verl/checkpoint_engine/base.py:320-330``, no
``is_master``) with ``wait_applied_s``: its ``receive_weights(global_steps=4)`` returns once
the weight sync has said every replica serves version 4.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Any


def per_tensor(state: dict[str, Any], taken: list[str]) -> Iterator[tuple[str, Any]]:
    """verl's ``get_per_tensor_param()``: (HF name, full tensor), counted as taken."""
    for name, tensor in state.items():
        taken.append(name)
        yield name, tensor


async def per_tensor_async(state: dict[str, Any], taken: list[str]) -> Any:
    for name, tensor in per_tensor(state, taken):
        yield name, tensor


def main() -> None:
    config_path, model_path, weights_root, run_id = sys.argv[1:5]
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    from rolloutbus.config import ModelConfig
    from rolloutbus.models.causal_lm import load_causal_lm

    options = {"config": config_path, "weights_root": weights_root, "model_path": model_path}
    ce = CheckpointEngineConfig(
        backend="rolloutbus",
        update_weights_bucket_megabytes=1,  # MB: tiny-qwen3 spans several shards
        engine_kwargs={"rolloutbus": {**options, "run_id": run_id}},
        custom_backend_module="rolloutbus.verl.weights",
    )
    import_external_libs(ce.custom_backend_module)
    if sys.argv[5:] == ["receive"]:
        waiting = CheckpointEngineRegistry.new(
            ce.backend, bucket_size=1 << 20, **{**options, "wait_applied_s": 120}
        )

        async def receive() -> list[Any]:
            return [pair async for pair in waiting.receive_weights(global_steps=4)]

        print(json.dumps({"received": len(asyncio.run(receive()))}))
        return

    def engine(rank: int) -> Any:
        return CheckpointEngineRegistry.new(
            ce.backend,
            is_master=rank == 0,
            bucket_size=ce.update_weights_bucket_megabytes << 20,
            **ce.engine_kwargs.get(ce.backend, {}),
        )

    state = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=1))[0].state_dict()
    rank0, rank1 = engine(0), engine(1)
    taken0: list[str] = []
    taken1: list[str] = []
    actor_kwargs, rollout_kwargs = type(rank0).build_topology(2, 1, [rank0.prepare()] * 3)
    rank0.init_process_group(**actor_kwargs)

    async def two_steps() -> list[Any]:
        step3 = await asyncio.gather(
            rank0.send_weights(per_tensor(state, taken0), global_steps=3),
            rank1.send_weights(per_tensor_async(state, taken1), global_steps=3),
        )
        step4 = await rank0.send_weights(per_tensor_async(state, []), global_steps=4)
        received = [pair async for pair in rank0.receive_weights(global_steps=4)]
        return [*step3, step4, received]

    metrics0, metrics1, metrics4, received = asyncio.run(two_steps())
    rank0.finalize()
    print(
        json.dumps(
            {
                "names": sorted(state),
                "taken": [sorted(taken0), sorted(taken1)],
                "metrics": [sorted(metrics0), metrics1, sorted(metrics4)],
                "topology": [actor_kwargs, rollout_kwargs],
                "received": len(received),
            }
        )
    )


if __name__ == "__main__":
    main()
