"""The inference client: token-in/token-out calls to replicas (vLLM, SGLang, the embedded
replica), with sticky least-in-flight routing, retries and partial-rollout resumes."""

from rolloutbus.streams.inference.llm_client import LLMClient, per_turn_max_tokens
from rolloutbus.streams.inference.routing import LoadBalancer

__all__ = ["LLMClient", "LoadBalancer", "per_turn_max_tokens"]
