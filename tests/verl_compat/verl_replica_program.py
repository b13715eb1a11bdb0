"""Runs in the verl 0.9.1 side environment (tests/verl_compat/test_verl_replica_stub.py):
Ray on CPUs, a ``rolloutbus`` replica built by verl's own ``get_rollout_replica_class`` from
the vendored trainer YAML and started with ``init_standalone`` (no GPU), and verl's own
``CheckpointEngineManager.update_weights`` between it and a two-rank actor group.

The actor group is a test double: verl's ``ActorRolloutRefWorker`` runs FSDP, which needs a
GPU (docs/verl-trainer.md). It builds the backend as that worker does
(``engine_workers.py:679-688``) and serves ``update_weights`` as it does on the non-naive
path (``:757-765``), from tiny-qwen3's seed-1 state dict.

argv: bus config, verl YAML, weights root, run id. Prints one JSON line.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

WAIT_S = 240  # seconds; Ray and three worker processes start in about one on two cores


def actor_double() -> Any:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.utils.import_utils import import_external_libs

    class ActorDouble(Worker):  # type: ignore[misc]
        def __init__(self, ce: Any) -> None:
            super().__init__()
            from rolloutbus.config import ModelConfig
            from rolloutbus.models.causal_lm import load_causal_lm

            import_external_libs(ce.custom_backend_module)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce.backend,
                is_master=self.rank == 0,
                bucket_size=ce.update_weights_bucket_megabytes << 20,
                **ce.engine_kwargs.get(ce.backend, {}),
            )
            self.state = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=1))[0].state_dict()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
            per_tensor = iter(self.state.items())
            return await self.checkpoint_engine.send_weights(per_tensor, global_steps=global_steps)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    return ActorDouble


def main() -> None:
    signal.alarm(WAIT_S)  # never hang a test session
    bus, verl_yaml, weights_root, run_id = sys.argv[1:5]
    import asyncio

    import ray
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.replica import get_rollout_replica_class

    import rolloutbus.verl.weights  # noqa: F401  # what VERL_USE_EXTERNAL_MODULES imports

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    backend = {"config": bus, "weights_root": weights_root, "run_id": run_id}
    config = OmegaConf.merge(
        OmegaConf.load(verl_yaml),
        {
            "actor_rollout_ref": {
                "rollout": {
                    "name": "rolloutbus",
                    "nnodes": 1,
                    "n_gpus_per_node": 1,
                    "checkpoint_engine": {
                        "backend": "rolloutbus",
                        "custom_backend_module": "rolloutbus.verl.weights",
                        "engine_kwargs": {"rolloutbus": backend},
                    },
                }
            }
        },
    )
    rollout = config.actor_rollout_ref.rollout
    ce = omega_conf_to_dataclass(rollout.checkpoint_engine)
    replica = get_rollout_replica_class(rollout.name)(
        replica_rank=0, config=rollout, model_config={}, gpus_per_node=1
    )
    asyncio.run(replica.init_standalone())
    pool = RayResourcePool(
        process_on_nodes=[2], use_gpu=False, name_prefix="actor_double", max_colocate_count=1
    )
    actor_wg = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(actor_double()), ce=ce),
        use_gpu=False,
    )
    manager = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=[replica])
    metrics = manager.update_weights(global_steps=5)
    manager.sleep_replicas()
    manager.wake_up_replicas()
    print(
        json.dumps(
            {
                "replica": type(replica).__name__,
                "rollout_workers": len(replica.workers),
                "world_size": replica.world_size,
                "address": replica.server_address,
                "metrics": sorted(metrics),
            }
        )
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
