"""What transforms, grouped by job:

* ``agent_loop`` — verl's agent-loop API with its tools, tool parsers and reward;
* ``inference`` — the LLM client, engine backends and the replica router;
* ``sessions`` — the session processor that runs agent loops and logs every turn;
* ``assembly`` — turns → trajectories: the folds, the invariant checks, the replay buffer;
* ``gateway`` — the OpenAI-compatible endpoint: agents outside the bus, every call a turn;
* ``token_stream`` — the token stream that both the recorder and the fold build.
"""

from __future__ import annotations

import typing

from rolloutbus.runtime import lazy_exports

if typing.TYPE_CHECKING:
    from rolloutbus.streams.inference import LLMClient, LoadBalancer, per_turn_max_tokens

__all__ = ["LLMClient", "LoadBalancer", "per_turn_max_tokens"]

# Imported on first use: importing a room (the pure fold in ``assembly``, say) must not load
# the inference client and httpx.
_LAZY = {name: "rolloutbus.streams.inference" for name in __all__}


__getattr__ = lazy_exports(__name__, _LAZY)
