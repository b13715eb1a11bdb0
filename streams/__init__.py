"""What transforms: agent loops, the LLM client and router, the session and replay-buffer
processors. Agent loops live in ``rolloutbus.streams.agent_loop`` (verl's API)."""

from rolloutbus.streams.llm_client import LLMClient, per_turn_max_tokens
from rolloutbus.streams.routing import LoadBalancer

__all__ = ["LLMClient", "LoadBalancer", "per_turn_max_tokens"]
