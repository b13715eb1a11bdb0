"""The replica's HTTP server: vLLM's and SGLang's token-in/token-out subset over an engine.

Endpoints:
- ``POST /v1/completions`` (vLLM ``CompletionRequest`` with ``prompt`` as token ids)
- ``POST /inference/v1/generate`` (vLLM's token-in/token-out ``GenerateRequest``)
- ``POST /generate`` (SGLang)
- ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus, ``rolloutbus_replica_*``)
- vLLM's RL control surface (what ``vllm serve`` offers with ``VLLM_SERVER_DEV_MODE=1``):
  ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused``,
  ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  and ``POST /update_weight_version {"new_version": ...}``; plus a lease on a pause
  (``/pause?lease_s=``, renewed by pausing again in the same mode: see ``pause_gate``), and
  ``/health`` says whether the replica is paused, since when, and its weights' label

Requests and responses are the wire models of ``rolloutbus.schemas.inference``, the same
ones the LLM client builds and reads. A client mistake is an HTTP 400 whose JSON
``error.message`` names the field: an unknown field, an invalid value, or a value the engine
cannot honour (``n > 1``, ``stream``, stop strings, images...), so a client never
silently gets something other than it asked for. An engine failure is a 500; a dead engine
makes ``/health`` answer 503.

One module per job: ``app`` (the routes and middlewares), ``generate`` (the three
generation routes), ``control`` (weights and pause), ``health`` (``/health``, ``/v1/models``,
``/metrics``), ``validation`` (request bodies and error answers), ``keys`` (what handlers
find on the app) and ``service`` (starting, serving and stopping a replica).
"""

from rolloutbus.replica.server.app import build_app
from rolloutbus.replica.server.keys import REGISTRY_KEY
from rolloutbus.replica.server.service import (
    ReplicaHandle,
    replica_in_thread,
    serve_replica,
    start_replica,
)
from rolloutbus.replica.server.validation import HTTPProblem, validate_request_body

__all__ = [
    "REGISTRY_KEY",
    "HTTPProblem",
    "ReplicaHandle",
    "build_app",
    "replica_in_thread",
    "serve_replica",
    "start_replica",
    "validate_request_body",
]
