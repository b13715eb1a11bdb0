"""``rollout.name=rolloutbus``: a rollout replica that needs no GPU, for verl's replica
bookkeeping when the bus's own replicas serve the rollouts.

verl's ``separate_async`` trainer builds standalone replicas of ``rollout.name``
(``LLMServerManager.create``, ``verl/workers/rollout/llm_server.py:455-483``) and hands them to
``standalone_checkpoint_manager``, which on each ``update_weights`` aborts them, releases
their KV cache, runs ``update_weights`` on each replica's ``CheckpointEngineWorker`` and
resumes them (``verl/checkpoint_engine/base.py:510-560``). With the bus, rollouts come from
the bus's replicas and weights reach them through ``rolloutbus weight-sync``, so:

* :class:`BusRolloutReplica` puts its ``CheckpointEngineWorker`` on a CPU pool
  (``use_gpu=False``; verl's ``init_standalone`` hard-codes a GPU pool) and launches one
  server actor that owns no engine: sleep, wake-up, abort, resume and the KV-cache calls
  change nothing, since the bus's weight sync pauses its replicas itself. Its address is the
  first of the bus's ``replicas.urls`` when the bus config names one.
* :class:`BusServerAdapter` (``_ROLLOUT_REGISTRY[("rolloutbus", "async")]``) is what that
  worker hands the received weights to: the ``rolloutbus`` backend's ``receive_weights``
  yields none (the replicas load the published folder), and waits for
  ``PolicyVersionApplied`` when ``wait_applied_s`` is set.

``rollout.nnodes`` and ``rollout.n_gpus_per_node`` must still be above 0 (asserted by
``trainer_separate_async.py:65-67``); they only count these CPU workers.
"""

from __future__ import annotations

import logging
from typing import Any

from rolloutbus.verl.extra import require_verl
from rolloutbus.verl.weights_publish import drain

require_verl("verl.workers.rollout.replica", what="the rolloutbus rollout replica")

# verl is not in the checked environment (the side env has it): no types to find
import ray  # type: ignore[import-not-found]  # noqa: E402
from verl.single_controller.ray import (  # type: ignore[import-not-found]  # noqa: E402
    RayResourcePool,
    RayWorkerGroup,
)
from verl.workers.rollout import base as rollout_base  # type: ignore[import-not-found]  # noqa: E402
from verl.workers.rollout.replica import (  # type: ignore[import-not-found]  # noqa: E402
    RolloutMode,
    RolloutReplica,
    RolloutReplicaRegistry,
)

__all__ = ["NAME", "BusRolloutReplica", "BusServerAdapter", "BusServerStub"]

log = logging.getLogger(__name__)
NAME = "rolloutbus"


class BusServerAdapter(rollout_base.BaseRollout):
    """The rollout side of a weight sync: nothing to load; see the module docstring."""

    def __init__(self, *args: Any, config: Any, model_config: Any, **kwargs: Any):
        # BaseRollout.__init__ would resolve model_config (it reads the model's folder);
        # nothing here uses it
        self.config, self.model_config = config, model_config
        self.replica_rank = int(kwargs.get("replica_rank", 0))
        self.is_leader_rank = True
        self.updates = 0

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        async for _ in drain(weights):
            pass
        self.updates += 1


@ray.remote(num_cpus=0)
class BusServerStub:
    """The replica's server actor: verl calls these on every replica; none has work here."""

    async def wake_up(self) -> None: ...

    async def sleep(self) -> None: ...

    async def abort_all_requests(self, reject_request: bool = False) -> None: ...

    async def resume_generation(self) -> None: ...

    async def clear_kv_cache(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def start_profile(self, **kwargs: Any) -> None: ...

    async def stop_profile(self) -> None: ...


class BusRolloutReplica(RolloutReplica):
    """See the module docstring."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        prefix = f"rolloutbus_{self.replica_rank}{self.name_suffix}"
        self.resource_pool = RayResourcePool(
            process_on_nodes=[self.gpus_per_replica_node] * self.nnodes,
            use_gpu=False,
            name_prefix=f"{prefix}_pool",
            max_colocate_count=1,  # a bundle per worker, of 1 CPU (verl's default asks 10)
        )
        group = RayWorkerGroup(
            resource_pool=self.resource_pool,
            ray_cls_with_init=self.get_ray_class_with_init_args(),
            bin_pack=False,
            name_prefix=f"{prefix}_standalone",
            use_gpu=False,
        )
        self.workers = group.workers
        await self.launch_servers()

    async def launch_servers(self) -> None:
        server = BusServerStub.remote()  # type: ignore[attr-defined]
        self.servers = [server]
        self._server_handle = server
        self._server_address = _bus_replica_url()


def _bus_replica_url() -> str:
    """The first of the bus's replicas (verl logs it as the server's address), else a name."""
    from rolloutbus.config import load_config
    from rolloutbus.verl.settings import config_paths

    urls = load_config(config_paths({}) or None).replicas.urls
    return urls[0] if urls else NAME


RolloutReplicaRegistry.register(NAME, lambda: BusRolloutReplica)
rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.BusServerAdapter"
