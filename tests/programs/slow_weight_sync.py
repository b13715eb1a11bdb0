"""Fault injector: a weight sync that holds a replica paused for HOLD_S after its reload.

Run as ``python slow_weight_sync.py weight-sync --config CONFIG``. After each reload step the
sync waits HOLD_S seconds before it labels and resumes the replica, so a fault row can catch
it between its pause and its resume: the tiny model's reload pauses a replica for ~0.1 s,
and a look at ``/health`` missed that 20 times in a row in a CI run on a loaded machine.
Everything else is the real ``rolloutbus weight-sync`` (its lease renewals go on meanwhile).
"""

from __future__ import annotations

import asyncio
import sys

import httpx

from rolloutbus.cli import main
from rolloutbus.streams.inference.weight_sync import SyncStep, WeightSync

HOLD_S = 2.0  # seconds the replica stays paused on its new weights, unlabelled
_real_call = WeightSync._call


async def _call_then_hold(
    self: WeightSync, url: str, step: SyncStep, timeout_s: float | None = None
) -> httpx.Response:
    response = await _real_call(self, url, step, timeout_s)
    if step.name == "reload":
        await asyncio.sleep(HOLD_S)
    return response


WeightSync._call = _call_then_hold  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
