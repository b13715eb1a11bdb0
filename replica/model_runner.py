"""The decode engine's forward passes: the running batch on the model and its KV cache.

Prefill puts joining rows' prompts into the slots after the running rows (right-padded,
causal) and returns the logits of their last prompt token; a decode step feeds every row's
pending token at that row's own position and returns the next logits; when rows leave,
the last rows' slots move into the holes, so the batch stays slots ``0..B-1``
(``kv_cache.SlotKVCache``). Nothing is padded or copied per step: the cache is
preallocated per slot, and attention reads a view of it. Runs in the decode thread only.
"""

from __future__ import annotations

from typing import Any

import torch

from rolloutbus.replica.batch import DecodeBatch, DecodeSequence
from rolloutbus.replica.kv_cache import SlotKVCache, check_supported, use_slot_attention

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs the model over a ``DecodeBatch`` whose row i lives in KV-cache slot i."""

    def __init__(self, model: Any, max_batch_size: int, max_model_len: int) -> None:
        check_supported(model)
        use_slot_attention(model)
        self.model = model
        self._cache = SlotKVCache(model.config, max_batch_size, max_model_len, model.dtype)
        self._columns = torch.arange(max_model_len)

    def prefill(self, first_slot: int, seqs: list[DecodeSequence]) -> torch.Tensor:
        """Prefill ``seqs``' prompts into slots ``first_slot...``; the logits [len(seqs), V]
        of each one's last prompt token."""
        lengths = [len(s.request.prompt_ids) for s in seqs]
        width = max(lengths)
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):  # right padding: causal attention never looks at it
            input_ids[i, : lengths[i]] = torch.tensor(seq.request.prompt_ids, dtype=torch.long)
        self._cache.ensure_capacity(width)
        self._cache.begin_prefill(first_slot)
        hidden = self.model.model(
            input_ids=input_ids,
            position_ids=self._columns[:width].expand(len(seqs), width),
            past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state
        last = torch.tensor(lengths) - 1
        logits: torch.Tensor = self.model.lm_head(hidden[torch.arange(len(seqs)), last])
        return logits

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """One step: every row's pending token into the cache at its position (the batch
        advances by one); the next logits [B, V]."""
        rows = len(batch.rows)
        width = max(batch.lengths) + 1  # the pending tokens go in at their positions
        self._cache.ensure_capacity(width)
        self._cache.begin_decode(batch.positions, width)
        # mask[i, j]: row i attends to column j, i.e. its own tokens up to its position;
        # none when every row is as long as the widest (SDPA then skips the masking).
        mask = None
        if min(batch.lengths) + 1 < width:
            mask = (self._columns[:width] <= batch.positions[:, None]).view(rows, 1, 1, width)
        hidden = self.model.model(
            input_ids=batch.pending[:, None],
            attention_mask=mask,
            position_ids=batch.positions[:, None],
            past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state
        batch.positions = batch.positions + 1
        batch.lengths = [n + 1 for n in batch.lengths]
        logits: torch.Tensor = self.model.lm_head(hidden[:, -1])
        return logits

    def compact(self, batch: DecodeBatch, keep: list[int], done: list[int]) -> None:
        """Drop rows ``done``: the last kept rows move (with their cache slots) into the
        holes below ``len(keep)``, so the batch stays slots ``0..len(keep)-1``."""
        holes = [i for i in done if i < len(keep)]
        movers = [i for i in keep if i >= len(keep)]
        order = list(range(len(batch.rows)))
        for hole, mover in zip(holes, movers, strict=True):
            self._cache.move(mover, hole, batch.lengths[mover])
            order[hole] = mover
        batch.keep_rows(order[: len(keep)])
