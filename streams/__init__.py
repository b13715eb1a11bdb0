"""What transforms, grouped by job:

* ``agent_loop`` — verl's agent-loop API with its tools, tool parsers and reward;
* ``inference`` — the LLM client, engine backends and the replica router;
* ``sessions`` — the session processor that runs agent loops and logs every turn;
* ``assembly`` — turns → trajectories: the folds, the invariant checks, the replay buffer;
* ``gateway`` — the OpenAI-compatible endpoint: agents outside the bus, every call a turn;
* ``token_stream`` — the token stream that both the recorder and the fold build.
"""

from rolloutbus.streams.inference import LLMClient, LoadBalancer, per_turn_max_tokens

__all__ = ["LLMClient", "LoadBalancer", "per_turn_max_tokens"]
