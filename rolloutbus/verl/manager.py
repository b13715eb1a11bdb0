"""``BusAgentLoopManager``: verl's V1 trainer's agent-loop slot, publishing side.

verl 0.9.1's V1 ``PPOTrainer`` builds the class named by
``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` with
``create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`` and calls
``generate_sequences(prompts: TensorDict) -> None``, which must not block
(``trainer_base.py:1496-1511``). Each row is one prompt with verl's ``uid``; this publishes
it as a prompt group: n from the row's ``__rollout_n__``, else ``rollout.n``, else
``rollout.val_kwargs.n`` when validating; ``__do_sample__`` false makes a training group
greedy; the group carries ``global_steps`` and ``validate``. It returns once the broker has
the groups, not when they are rolled out.

The bus sampler (``rolloutbus.verl.sampler``) moves the rolled-out groups from the trajectory
topic into TransferQueue. Not done here: tagging the prompt ``running`` in TransferQueue (the
sampler writes ``pending`` and ``running`` prompts alike).
"""

from __future__ import annotations

import logging
from typing import Any

from rolloutbus.config import Config
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.schemas.prompts import PromptGroup
from rolloutbus.verl.extra import require_verl
from rolloutbus.verl.publishing import publish_requests
from rolloutbus.verl.rows import PromptRequest, dataset_row
from rolloutbus.verl.settings import bus_config

__all__ = ["BusAgentLoopManager", "tensordict_rows"]

log = logging.getLogger(__name__)

# the columns verl's V1 dispatch adds for the whole batch, not per row
_BATCH_COLUMNS = ("global_steps", "validate")


class BusAgentLoopManager:
    """verl's V1 agent-loop manager on the bus (see the module docstring). ``bus``: the bus
    config (default: ``settings.bus_config(config)``)."""

    def __init__(
        self,
        config: Any = None,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        bus: Config | None = None,
    ):
        self.config = config
        self.reward_loop_worker_handles = reward_loop_worker_handles
        self.bus = bus if bus is not None else bus_config(config)
        self._publisher = PromptPublisher(self.bus)

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> BusAgentLoopManager:
        """verl's constructor call (``AgentLoopManager.create(config=, llm_client=, ...)``)."""
        return cls(*args, **kwargs)

    def generate_sequences(self, prompts: Any) -> None:
        """Publish every row of ``prompts`` (verl's TensorDict) as a prompt group."""
        self.publish(prompts)

    def publish(self, prompts: Any) -> list[PromptGroup]:
        """``generate_sequences``, returning the groups it published."""
        rows = tensordict_rows(prompts)
        validate = bool(rows[0].get("validate", False)) if rows else False
        global_steps = int(rows[0].get("global_steps", 0)) if rows else 0
        n_default = self.bus.rollout.val_kwargs.n if validate else self.bus.rollout.n
        requests = []
        for columns in rows:
            row = dataset_row({k: v for k, v in columns.items() if k not in _BATCH_COLUMNS})
            asked = row.get("__rollout_n__")
            n = n_default if asked is None else int(asked)
            row["__rollout_n__"] = n
            requests.append(PromptRequest(uid=str(row["uid"]), row=row, n=n))
        return publish_requests(
            self.bus, self._publisher, requests, validate=validate, global_steps=global_steps
        )


def tensordict_rows(prompts: Any) -> list[dict[str, Any]]:
    """The rows of verl's V1 batch as ``AgentLoopWorkerTQ.generate_sequences`` reads them:
    a tensor's row, a ``NonTensorStack``'s item, a ``NonTensorData``'s one value for all."""
    tensordict = require_verl("tensordict", what="BusAgentLoopManager.generate_sequences")
    torch = require_verl("torch", what="BusAgentLoopManager.generate_sequences")
    rows: list[dict[str, Any]] = [{} for _ in range(len(prompts))]
    for key, value in prompts.items():
        for i, row in enumerate(rows):
            if isinstance(value, torch.Tensor):
                row[key] = value[i]
            elif isinstance(value, tensordict.NonTensorStack):
                row[key] = value[i].data
            elif isinstance(value, tensordict.NonTensorData):
                row[key] = value.data
            else:
                raise TypeError(f"column {key!r}: unsupported type {type(value).__name__}")
    return rows
