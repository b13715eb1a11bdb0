"""``BusAgentLoopManagerV0``: verl's V0 trainer (``trainer.use_v1=false``, RayPPOTrainer)
rolls out through the bus.

verl calls ``generate_sequences(DataProto) -> DataProto`` and blocks on it. Here it publishes
each prompt (its rows share verl's uid) as a prompt group, waits on the trajectory topic for
exactly those groups through the trainer client, and returns one row per input row in input
order, in the layout of verl's own ``AgentLoopManager`` (``v0_output``). Groups of other
uids that arrive meanwhile (an earlier run's, a crashed step's) are dropped and counted:
V0 issues fresh uids every step, so no group is trained twice.

With a processor (verl's ``hf_processor`` for a local ``actor_rollout_ref.model.path``, or
``processor=``) each row's ``multi_modal_inputs`` is the processor's output on the row's
images, as verl's agent loop builds it (``rolloutbus.verl.v0_vision``).

Set it with ``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=
rolloutbus.verl.BusAgentLoopManagerV0`` (docs/verl-trainer.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.errors import ConfigError, RolloutBusError
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.verl.extra import require_verl
from rolloutbus.verl.publishing import publish_requests
from rolloutbus.verl.rows import v0_requests
from rolloutbus.verl.settings import bus_config
from rolloutbus.verl.v0_batch import V0Output, rows_in_input_order, v0_output
from rolloutbus.verl.v0_vision import load_processor, multi_modal_column, row_images

__all__ = ["BusAgentLoopManagerV0", "to_data_proto"]

log = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 3600.0  # seconds one step may wait for its groups: long agentic rollouts
POLL_WINDOW_S = 5.0  # seconds of an idle topic before the deadline is checked again


class BusAgentLoopManagerV0:
    """verl's V0 agent-loop manager on the bus (see the module docstring).

    ``bus``: the bus config (default: ``settings.bus_config(config)``); ``pad_token_id``:
    the tokenizer's (default: the bus model's tokenizer); ``wait_timeout_s``: how long one
    call waits for its groups before it raises, naming the missing uids.
    """

    def __init__(
        self,
        config: Any = None,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        bus: Config | None = None,
        pad_token_id: int | None = None,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
        processor: Any = None,
    ):
        self.config = config
        # verl merges the input's non-tensor columns into its output only when it was handed
        # no reward-loop workers; the same rule keeps ``batch.union(output)`` consistent
        self.reward_loop_worker_handles = reward_loop_worker_handles
        self.bus = bus if bus is not None else bus_config(config)
        self.wait_timeout_s = wait_timeout_s
        self.pad_token_id = pad_token_id if pad_token_id is not None else _pad_token_id(self.bus)
        self.processor = processor if processor is not None else load_processor(config)
        self.strays = 0  # groups of uids no call asked for, dropped
        self._publisher = PromptPublisher(self.bus)
        self._client = TrainerClient(
            self.bus.kafka, self.bus.trainer.group_id, config=self.bus.trainer
        )

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> BusAgentLoopManagerV0:
        """verl's constructor call (``AgentLoopManager.create(config=, llm_client=, ...)``)."""
        return cls(*args, **kwargs)

    def generate_sequences(self, prompts: Any) -> Any:
        """Roll out ``prompts`` (a verl ``DataProto``) on the bus; verl's output ``DataProto``."""
        require_verl("verl.protocol", what="BusAgentLoopManagerV0.generate_sequences")
        return to_data_proto(self.roll_out(prompts.non_tensor_batch, prompts.meta_info))

    def roll_out(self, non_tensor_batch: dict[str, Any], meta_info: dict[str, Any]) -> V0Output:
        """The call without verl's types: publish, wait, convert, commit."""
        uids, requests = v0_requests(non_tensor_batch)
        publish_requests(
            self.bus,
            self._publisher,
            requests,
            validate=bool(meta_info.get("validate", False)),
            global_steps=int(meta_info.get("global_steps", 0)),
        )
        groups = self._collect({r.uid for r in requests})
        out = v0_output(
            rows_in_input_order(uids, groups),
            inputs=non_tensor_batch,
            merge_inputs=self.reward_loop_worker_handles is None,
            prompt_length=self.bus.rollout.prompt_length,
            response_length=self.bus.rollout.response_length,
            pad_token_id=self.pad_token_id,
        )
        if self.processor is not None:
            out.non_tensor_batch["multi_modal_inputs"] = self._multi_modal(non_tensor_batch, out)
        self._client.commit(list(groups.values()))
        return out

    def _multi_modal(self, non_tensor_batch: dict[str, Any], out: V0Output) -> Any:
        """verl's ``multi_modal_inputs`` column: the processor on each row's images."""
        from omegaconf import DictConfig, OmegaConf

        tree = self.config if isinstance(self.config, DictConfig) else None
        data = OmegaConf.select(tree, "data", default=None) if tree is not None else None
        raw = non_tensor_batch.get("raw_prompt")
        rows = len(out.non_tensor_batch["__num_turns__"])
        images = [
            row_images(raw[i], self.processor, data) if raw is not None else None
            for i in range(rows)
        ]
        kwargs = OmegaConf.select(data, "mm_processor_kwargs", default=None) if data else None
        return multi_modal_column(self.processor, out.batch["input_ids"], images, kwargs)

    def _collect(self, wanted: set[str]) -> dict[str, TrajectoryGroup]:
        """The complete groups of ``wanted``, however they interleave with others."""
        found: dict[str, TrajectoryGroup] = {}
        deadline = time.monotonic() + self.wait_timeout_s
        while len(found) < len(wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - set(found))
                raise RolloutBusError(
                    f"{len(missing)} of {len(wanted)} prompt groups did not arrive on "
                    f"{self._client.topic} within {self.wait_timeout_s:.0f} s: {missing[:8]}"
                )
            polled = self._client.groups(timeout_s=min(POLL_WINDOW_S, left))
            self._take(polled, wanted, found, deadline)
        return found

    def _take(
        self,
        groups: Iterable[TrajectoryGroup],
        wanted: set[str],
        found: dict[str, TrajectoryGroup],
        deadline: float,
    ) -> None:
        for group in groups:
            if group.uid in wanted:
                found[group.uid] = group
            else:
                self.strays += 1
                log.info(
                    "dropped group %s: no call asked for it (strays: %d)", group.uid, self.strays
                )
            if len(found) == len(wanted) or time.monotonic() > deadline:
                return

    def close(self) -> None:
        self._client.close()


def to_data_proto(out: V0Output) -> Any:
    """``out`` as verl's ``DataProto`` (its batch a ``TensorDict`` of the row count)."""
    protocol = require_verl("verl.protocol", what="BusAgentLoopManagerV0.generate_sequences")
    tensordict = require_verl("tensordict", what="BusAgentLoopManagerV0.generate_sequences")
    rows = len(out.non_tensor_batch["__num_turns__"])
    return protocol.DataProto(
        batch=tensordict.TensorDict(out.batch, batch_size=rows),
        non_tensor_batch=out.non_tensor_batch,
        meta_info=out.meta_info,
    )


def _pad_token_id(cfg: Config) -> int:
    from rolloutbus.models.tokenizers import load_tokenizer

    pad = load_tokenizer(cfg.model).pad_token_id
    if pad is None:
        raise ConfigError(f"model {cfg.model.name!r}: its tokenizer has no pad token")
    return int(pad)
