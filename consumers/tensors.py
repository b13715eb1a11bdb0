"""Arrow trajectory batches → torch tensors: jagged (no padding) or verl-V0 padding.

``to_padded`` returns verl V0's batch keys (``prompts``, ``responses``, ``input_ids``,
``attention_mask``, ``position_ids``, ``response_mask``, ``rollout_log_probs``,
``rm_scores``, and ``routed_experts`` when the trajectories carry them): what verl's
``DataProto.batch`` holds after its agent loop pads a batch, so a verl trainer reads the
bus's groups without a conversion of its own.

How the padding is fast: every output is allocated once with ``np.empty`` and each of
its cells written exactly once, a row at a time, by contiguous slice copies from the
Arrow values (memcpy speed, the dtype cast folded into the copy), and handed to torch
without a copy. The per-row Python work is a dozen slice assignments; the time left is
writing the output bytes (36 MB for 256 rows of 4k tokens) and the kernel's first touch of
freshly allocated pages. A numpy boolean-mask placement of all rows at once was measured
too and was slower: it walks the whole mask once per column. ``benchmarks/tensors.py``
prints this path, the per-row torch loop it replaced, and the cost of only writing the
same output bytes to fresh memory, with their ratios.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from rolloutbus.consumers.mrope import padded_mrope_position_ids
from rolloutbus.schemas.trajectories import routed_experts_of_row


def _ragged(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a large_list column, also when it is a slice of a bigger batch:
    ``flatten()`` returns only the slice's values (``.values`` would return the whole child
    array), and the offsets are rebased to start at 0."""
    offsets = column.offsets.to_numpy()
    values = column.flatten().to_numpy(zero_copy_only=False)
    return values, offsets - offsets[0]


def to_jagged(batch: pa.RecordBatch, column: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A nested (jagged) tensor of one ragged column: rows keep their own lengths."""
    values, offsets = _ragged(batch.column(column))
    lengths = np.diff(offsets)
    t_values = torch.from_numpy(np.array(values))  # writable copy: torch refuses read-only
    if dtype is not None:
        t_values = t_values.to(dtype)
    max_len = int(lengths.max()) if len(lengths) else 0
    return torch.nested.nested_tensor_from_jagged(
        t_values, torch.from_numpy(offsets.astype(np.int64)), max_seqlen=max_len
    )


class PaddedBuffers:
    """Output memory that ``to_padded`` may reuse from one call to the next.

    Writing to freshly allocated pages costs the kernel a page fault each; on the 2-core VM
    the benchmarks ran on, writing 24 MB of fresh memory took ~30 ms against ~1.5 ms for
    the same bytes reused, so a trainer converting one batch per step should pass one of
    these. The tensors of the previous call share its memory: pass it only once they are no
    longer needed (verl's trainer copies a batch to the device first)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, int], dtype: type) -> np.ndarray:
        array = self._arrays.get(name)
        if array is None or array.shape != shape or array.dtype != dtype:
            array = self._arrays[name] = np.empty(shape, dtype=dtype)
        return array


def to_padded(
    batch: pa.RecordBatch,
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    buffers: PaddedBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """verl V0 layout: prompt left-padded, response right-padded, masks to match.

    ``attention_mask`` is 1 on every real token (observations included: the model must
    read them); ``response_mask`` is 1 only on policy-sampled tokens and is multiplied by
    the response attention mask; ``position_ids`` count real tokens, as verl computes them,
    except in a batch whose trajectories recorded image grids (``schemas.mrope``): there
    they are verl's ``(B, 4, L)`` M-RoPE ids (``consumers.mrope``).
    A prompt longer than ``prompt_length`` keeps its end, a response longer than
    ``response_length`` its start. ``prompts`` and ``responses`` are views of ``input_ids``.
    With ``buffers``, the outputs are written into its memory (see ``PaddedBuffers``).
    """
    buffers = buffers or PaddedBuffers()
    width = prompt_length + response_length
    rows = batch.num_rows
    prompt_values, prompt_offsets = _ragged(batch.column("prompts"))
    response_values, response_offsets = _ragged(batch.column("responses"))
    prompt_lens = np.minimum(np.diff(prompt_offsets), prompt_length).tolist()
    response_lens = np.minimum(np.diff(response_offsets), response_length).tolist()
    # np.empty, each cell written exactly once below: zero-filling first would write
    # every output byte twice, and writing is what this function's time is made of
    input_ids = buffers.get("input_ids", (rows, width), np.int64)
    attention = buffers.get("attention_mask", (rows, width), np.int64)
    position_ids = buffers.get("position_ids", (rows, width), np.int64)
    counting = np.arange(width, dtype=np.int64)
    for i, p_len, r_len, p_end, r_start in zip(
        range(rows),
        prompt_lens,
        response_lens,
        prompt_offsets[1:].tolist(),
        response_offsets[:-1].tolist(),
        strict=True,
    ):
        first, end = prompt_length - p_len, prompt_length + r_len
        ids, mask, pos = input_ids[i], attention[i], position_ids[i]
        ids[:first] = pad_token_id
        ids[first:prompt_length] = prompt_values[p_end - p_len : p_end]  # a prompt keeps its end
        ids[prompt_length:end] = response_values[r_start : r_start + r_len]
        ids[end:] = pad_token_id
        mask[:first] = 0
        mask[first:end] = 1
        mask[end:] = 0
        # verl's compute_position_id_with_mask (cumsum of the mask - 1, at least 0):
        # left padding gets 0, right padding repeats the last position
        pos[:first] = 0
        pos[first:end] = counting[: p_len + r_len]
        pos[end:] = max(p_len + r_len - 1, 0)
    ids_t = torch.from_numpy(input_ids)
    attention_t = torch.from_numpy(attention)
    # trajectories that recorded image grids get verl's (B, 4, L) M-RoPE ids; a text batch
    # keeps the (B, L) ids above (the check is a substring scan of one column)
    mrope = padded_mrope_position_ids(batch, ids_t, attention_t)
    shape = (rows, response_length)
    out = {
        "prompts": ids_t[:, :prompt_length],
        "responses": ids_t[:, prompt_length:],
        "input_ids": ids_t,
        "attention_mask": attention_t,
        "position_ids": torch.from_numpy(position_ids) if mrope is None else mrope,
        "response_mask": _padded_response(
            batch.column("response_mask"),
            buffers.get("response_mask", shape, np.int64),
            response_lens,
        ),
    }
    out.update(_optional_columns(batch, buffers, response_lens, prompt_length, response_length))
    return out


def _optional_columns(
    batch: pa.RecordBatch,
    buffers: PaddedBuffers,
    response_lens: list[int],
    prompt_length: int,
    response_length: int,
) -> dict[str, torch.Tensor]:
    """``rollout_log_probs``, ``rm_scores`` and ``routed_experts`` where the batch has them."""
    out = {}
    rows, shape = batch.num_rows, (batch.num_rows, response_length)
    if batch.column("rollout_log_probs").null_count < rows:
        out["rollout_log_probs"] = _padded_response(
            _fill_nulls(batch.column("rollout_log_probs")),
            buffers.get("rollout_log_probs", shape, np.float32),
            response_lens,
        )
    if batch.column("rm_scores").null_count == 0 and rows:
        out["rm_scores"] = _padded_response(
            batch.column("rm_scores"), buffers.get("rm_scores", shape, np.float32), response_lens
        )
    routed = _padded_routed_experts(batch, prompt_length, prompt_length + response_length)
    if routed is not None:
        out["routed_experts"] = routed
    return out


def _padded_routed_experts(
    batch: pa.RecordBatch, prompt_length: int, width: int
) -> torch.Tensor | None:
    """verl's ``(B, prompt_length + response_length, layers, top_k)`` int16 routed experts:
    zeros, each row's experts placed from its first (left-padded) prompt token, as verl's
    ``_agent_loop_postprocess`` places them; a prompt kept by its end here loses the rows
    of its cut tokens. None when no trajectory carries them (routing replay off)."""
    if "routed_experts" not in batch.schema.names:
        return None
    column = batch.column("routed_experts")
    if column.null_count == len(column):
        return None
    experts = [routed_experts_of_row(column, i) for i in range(batch.num_rows)]
    shapes = {e.shape[1:] for e in experts if e is not None and e.num_tokens}
    if len(shapes) > 1:
        raise ValueError(f"routed_experts of one batch have different (layers, top_k): {shapes}")
    layers, top_k = shapes.pop() if shapes else (0, 0)
    out = torch.zeros((batch.num_rows, width, layers, top_k), dtype=torch.int16)
    prompt_lens = np.diff(batch.column("prompts").offsets.to_numpy()).tolist()
    for row, (found, p_len) in enumerate(zip(experts, prompt_lens, strict=True)):
        if found is None or not found.num_tokens:
            continue
        values = found.to_numpy()[max(0, p_len - prompt_length) :]  # a cut prompt's rows go
        start = prompt_length - min(p_len, prompt_length)
        end = min(start + len(values), width)
        out[row, start:end] = torch.from_numpy(values[: end - start])
    return out


def _padded_response(column: pa.Array, out: np.ndarray, response_lens: list[int]) -> torch.Tensor:
    """A right-padded per-response-token column (mask, logprobs, scores) written into
    ``out``, 0 on padding. A row keeps at most as many values as its response has tokens
    in the padded matrix (verl multiplies response_mask by the response's attention mask)."""
    values, offsets = _ragged(column)
    kept = np.minimum(np.diff(offsets), response_lens).tolist()
    for row, n, start in zip(out, kept, offsets[:-1].tolist(), strict=True):
        row[:n] = values[start : start + n]
        row[n:] = 0
    return torch.from_numpy(out)


def _fill_nulls(column: pa.Array) -> pa.Array:
    """Null logprob rows (logprobs off for that trajectory) become empty lists."""
    if column.null_count == 0:
        return column
    rows = [r if r is not None else [] for r in column.to_pylist()]
    return pa.array(rows, type=column.type)
