"""verl's own trainer on the bus: plug-ins that verl 0.9.1 loads by dotted path
(docs/verl-trainer.md).

* ``BusAgentLoopManagerV0``: ``trainer.use_v1=false`` (RayPPOTrainer); blocking
  ``generate_sequences(DataProto) -> DataProto`` through the bus, in verl's own layout.
* ``BusAgentLoopManager``: the V1 trainer's slot; publishes verl's prompts as groups
  (the TransferQueue side is not built yet).
* ``v0_output`` and ``rows_in_input_order``: the pure conversion behind V0.
* ``BusCheckpointCallback``: ``trainer.checkpoint_callback_class`` (V1 only in verl);
  writes ``rolloutbus.json`` (run id, consumer position) beside ``global_step_N/``.
* ``rolloutbus.verl.weights``: the ``rolloutbus`` checkpoint-engine backend (verl imports it
  as ``custom_backend_module``; it needs verl, so it is no name here); ``BusWeightPublisher``
  is its verl-free half, ``wait_for_applied`` waits until every replica serves a version.

Importing this package needs no verl: names load on first use, and a plug-in that needs
verl's types raises ``VerlNotInstalledError`` saying ``pip install rolloutbus[verl]``.
"""

from __future__ import annotations

import typing

from rolloutbus.runtime import lazy_exports

if typing.TYPE_CHECKING:
    from rolloutbus.verl.applied import WeightsNotAppliedError, wait_for_applied
    from rolloutbus.verl.checkpoint import (
        BusCheckpointCallback,
        BusCheckpointState,
        read_bus_state,
        write_bus_state,
    )
    from rolloutbus.verl.extra import INSTALL_HINT, VerlNotInstalledError, require_verl
    from rolloutbus.verl.manager import BusAgentLoopManager
    from rolloutbus.verl.settings import bus_config
    from rolloutbus.verl.v0_batch import V0Output, rows_in_input_order, v0_output
    from rolloutbus.verl.v0_manager import BusAgentLoopManagerV0
    from rolloutbus.verl.weights_publish import BusWeightPublisher

__all__ = [
    "INSTALL_HINT",
    "BusAgentLoopManager",
    "BusAgentLoopManagerV0",
    "BusCheckpointCallback",
    "BusCheckpointState",
    "BusWeightPublisher",
    "V0Output",
    "VerlNotInstalledError",
    "WeightsNotAppliedError",
    "bus_config",
    "read_bus_state",
    "require_verl",
    "rows_in_input_order",
    "v0_output",
    "wait_for_applied",
    "write_bus_state",
]

_LAZY = {
    "INSTALL_HINT": "rolloutbus.verl.extra",
    "BusAgentLoopManager": "rolloutbus.verl.manager",
    "BusAgentLoopManagerV0": "rolloutbus.verl.v0_manager",
    "BusCheckpointCallback": "rolloutbus.verl.checkpoint",
    "BusCheckpointState": "rolloutbus.verl.checkpoint",
    "BusWeightPublisher": "rolloutbus.verl.weights_publish",
    "V0Output": "rolloutbus.verl.v0_batch",
    "VerlNotInstalledError": "rolloutbus.verl.extra",
    "WeightsNotAppliedError": "rolloutbus.verl.applied",
    "bus_config": "rolloutbus.verl.settings",
    "read_bus_state": "rolloutbus.verl.checkpoint",
    "require_verl": "rolloutbus.verl.extra",
    "rows_in_input_order": "rolloutbus.verl.v0_batch",
    "v0_output": "rolloutbus.verl.v0_batch",
    "wait_for_applied": "rolloutbus.verl.applied",
    "write_bus_state": "rolloutbus.verl.checkpoint",
}

__getattr__ = lazy_exports(__name__, _LAZY)
