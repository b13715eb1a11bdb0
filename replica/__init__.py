"""The embedded inference replica: a torch causal LM behind vLLM's token-in/token-out API.

``DecodeEngine`` (continuous batching over a KV cache) or ``ScriptedEngine`` (a test
double) sits behind one aiohttp server (``start_replica`` / ``serve_replica``). Names
that need torch are imported on first use, so a client importing the scripted double
does not pay for torch.
"""

from __future__ import annotations

import typing

from rolloutbus.replica.generation import (
    Engine,
    EngineSampling,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestRejectedError,
    Timings,
)
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.runtime import lazy_exports

if typing.TYPE_CHECKING:
    from rolloutbus.replica.engine import DecodeEngine
    from rolloutbus.replica.server import (
        ReplicaHandle,
        build_app,
        replica_in_thread,
        serve_replica,
        start_replica,
    )

__all__ = [
    "DecodeEngine",
    "Engine",
    "EngineSampling",
    "EngineStats",
    "GenerationRequest",
    "GenerationResult",
    "ReplicaHandle",
    "RequestRejectedError",
    "ScriptedEngine",
    "ScriptedTurn",
    "Timings",
    "build_app",
    "replica_in_thread",
    "serve_replica",
    "start_replica",
]

_LAZY = {
    "DecodeEngine": "rolloutbus.replica.engine",
    "ReplicaHandle": "rolloutbus.replica.server",
    "build_app": "rolloutbus.replica.server",
    "replica_in_thread": "rolloutbus.replica.server",
    "serve_replica": "rolloutbus.replica.server",
    "start_replica": "rolloutbus.replica.server",
}


__getattr__ = lazy_exports(__name__, _LAZY)
