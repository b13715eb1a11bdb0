"""A preallocated KV cache with one slot per running sequence, and the attention that reads it.

Each layer keeps ``keys``/``values`` of shape ``[slots, kv_heads, capacity, head_dim]``;
batch row ``i`` lives in slot ``i`` and its token at position ``p`` in column ``p``. A
decode step writes one column per row (each row at its own position, so sequences of
different lengths need no padding and nothing is copied per step), then attends to the
columns ``[0, T)`` through a view, with a mask hiding each row's columns past its own
position. A row that leaves is replaced by the last row (one slot copy, ``move``). The
capacity grows by doubling up to ``max_model_len``: memory follows the longest sequence
seen, not the configured maximum.

The model is the Hugging Face module itself (its layers call ``update()`` as they would on a
``DynamicCache``), with its attention switched to ``slot_attention``: in a decode step the
query heads that share a KV head become that head's queries, so grouped-query attention
runs without expanding K/V (``repeat_kv`` copies them for every layer, every step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rolloutbus.errors import ReplicaError

__all__ = ["ATTENTION", "SlotKVCache", "check_supported", "use_slot_attention"]

ATTENTION = "rolloutbus_slot_sdpa"
INITIAL_CAPACITY = 256  # tokens per slot before the first doubling; ~23 KB/token for SmolLM2 bf16


class SlotKVCache:
    """Per-layer K/V for ``slots`` sequences; ``begin_prefill``/``begin_decode`` say what the
    next forward pass writes, then its layers call ``update``."""

    def __init__(self, config: Any, slots: int, max_len: int, dtype: torch.dtype) -> None:
        self.slots, self.max_len, self.dtype = slots, max_len, dtype
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_layers = config.num_hidden_layers
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._prefill_slot: int | None = None  # first slot of a prefill, else None (decode)
        self._rows = torch.arange(slots)
        self._positions = torch.zeros(slots, dtype=torch.long)
        self._width = 0  # columns a decode step attends to

    def ensure_capacity(self, needed: int) -> None:
        """Room for positions ``[0, needed)`` in every slot (copying what is cached)."""
        if needed <= self.capacity:
            return
        if needed > self.max_len:
            raise ReplicaError(
                f"KV cache: position {needed - 1} beyond max_model_len {self.max_len}"
            )
        capacity = max(self.capacity, min(INITIAL_CAPACITY, self.max_len))
        while capacity < needed:
            capacity = min(capacity * 2, self.max_len)
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        # Zeros, not empty: a masked column still enters attention as 0 x value, and
        # uninitialised memory may hold NaN (0 x NaN = NaN).
        keys = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        for new, old in zip(keys + values, self.keys + self.values, strict=False):
            new[:, :, : self.capacity] = old  # none the first time
        self.keys, self.values, self.capacity = keys, values, capacity

    def begin_prefill(self, first_slot: int) -> None:
        """The next pass prefills rows into slots ``first_slot, first_slot + 1, ...`` from
        column 0 (right-padded prompts: columns past a prompt hold padding until decode
        overwrites them, and are masked until then)."""
        self._prefill_slot = first_slot

    def begin_decode(self, positions: torch.Tensor, width: int) -> None:
        """The next pass writes row ``i``'s token at column ``positions[i]`` and attends to
        columns ``[0, width)``."""
        self._prefill_slot = None
        self._positions = positions
        self._width = width

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot ``source``'s first ``length`` columns into slot ``target``."""
        for cache in self.keys + self.values:
            cache[target, :, :length] = cache[source, :, :length]

    # -- what the model's attention layers call ------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._prefill_slot is not None:
            rows, length = key_states.shape[0], key_states.shape[2]
            first = self._prefill_slot
            keys[first : first + rows, :, :length] = key_states
            values[first : first + rows, :, :length] = value_states
            return key_states, value_states  # a prefill attends to its own tokens only
        rows = key_states.shape[0]
        index = (self._rows[:rows], slice(None), self._positions)
        keys[:rows][index] = key_states[:, :, 0]
        values[:rows][index] = value_states[:, :, 0]
        return keys[:rows, :, : self._width], values[:rows, :, : self._width]

    # What transformers' mask builder asks a cache (a prefill passes no mask: causal, from 0).

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._prefill_slot is not None else self._width - 1

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA for ``SlotKVCache``: [B, heads, q, d] queries, [B, kv_heads, T, d] keys/values."""
    batch, heads, q_len, head_dim = query.shape
    group = heads // key.shape[1]
    if q_len == 1 and group > 1:
        # Decode: the `group` query heads of a KV head attend as `group` queries of it.
        grouped = query.reshape(batch, key.shape[1], group, head_dim)
        out = F.scaled_dot_product_attention(
            grouped, key, value, attn_mask=attention_mask, scale=scaling
        ).reshape(batch, heads, 1, head_dim)
    else:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            is_causal=attention_mask is None and q_len > 1,
            scale=scaling,
            enable_gqa=group > 1,
        )
    return out.transpose(1, 2).contiguous(), None


def use_slot_attention(model: Any) -> None:
    """Switch ``model``'s attention to ``slot_attention`` (its masks stay SDPA's, so the
    model still runs plain forward passes correctly)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, slot_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def check_supported(model: Any) -> None:
    """Refuse models the slot cache would serve wrongly, naming why."""
    config = model.config
    inner = getattr(model, "model", None)
    missing = [
        name
        for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        if not hasattr(inner, name)
    ]
    if missing or not hasattr(model, "lm_head"):
        raise ReplicaError(
            f"{type(model).__name__} is not a decoder the embedded engine can drive "
            f"(needs model.embed_tokens/layers/norm/rotary_emb and lm_head; missing {missing})"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ReplicaError(
            f"{config.model_type}: layer types {sorted(layer_types)}; the embedded engine's KV "
            "cache serves full attention only (no sliding window)"
        )
    if getattr(config, "final_logit_softcapping", None):
        raise ReplicaError(f"{config.model_type}: final logit softcapping is not supported")
