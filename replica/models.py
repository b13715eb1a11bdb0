"""The old path of ``rolloutbus.models.tokenizers``, re-exported for callers outside this
branch's reach (``benchmarks/engines.py``); remove once they import ``rolloutbus.models``."""

from rolloutbus.models.tokenizers import load_processor, load_tokenizer

__all__ = ["load_processor", "load_tokenizer"]
