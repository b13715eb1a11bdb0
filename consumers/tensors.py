"""Arrow trajectory batches → torch tensors: jagged (no padding) or verl-V0 padding."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch


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


def _pad_rows(
    column: pa.Array, width: int, pad: float, left: bool, dtype: torch.dtype
) -> torch.Tensor:
    values, offsets = _ragged(column)
    out = torch.full((len(offsets) - 1, width), pad, dtype=dtype)
    for i in range(len(offsets) - 1):
        values_i = np.array(values[offsets[i] : offsets[i + 1]])  # a writable copy for torch
        row = torch.from_numpy(values_i[-width:] if left else values_i[:width])
        if left:
            out[i, width - len(row) :] = row.to(dtype)
        else:
            out[i, : len(row)] = row.to(dtype)
    return out


def to_padded(
    batch: pa.RecordBatch, *, prompt_length: int, response_length: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """verl V0 layout: prompt left-padded, response right-padded, masks to match.

    ``attention_mask`` is 1 on every real token (observations included: the model must
    read them); ``response_mask`` is 1 only on policy-sampled tokens and is multiplied by
    the response attention mask; ``position_ids`` count real tokens, as verl computes them.
    """
    prompts = _pad_rows(batch.column("prompts"), prompt_length, pad_token_id, True, torch.long)
    responses = _pad_rows(
        batch.column("responses"), response_length, pad_token_id, False, torch.long
    )
    prompt_attn = _pad_rows(_ones_like(batch.column("prompts")), prompt_length, 0, True, torch.long)
    response_attn = _pad_rows(
        _ones_like(batch.column("responses")), response_length, 0, False, torch.long
    )
    response_mask = _pad_rows(batch.column("response_mask"), response_length, 0, False, torch.long)
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    # verl's compute_position_id_with_mask: left padding gets 0, right padding repeats the
    # last position (masked out by attention_mask either way)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    out = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask * response_attn,
    }
    if batch.column("rollout_log_probs").null_count < batch.num_rows:
        out["rollout_log_probs"] = _pad_rows(
            _fill_nulls(batch.column("rollout_log_probs")),
            response_length,
            0.0,
            False,
            torch.float32,
        )
    if batch.column("rm_scores").null_count == 0 and batch.num_rows:
        out["rm_scores"] = _pad_rows(
            batch.column("rm_scores"), response_length, 0.0, False, torch.float32
        )
    return out


def _ones_like(column: pa.Array) -> pa.Array:
    offsets = column.offsets
    n = offsets[-1].as_py() - offsets[0].as_py()
    values = pa.array(np.ones(n, dtype=np.int8))
    rebased = pa.array(column.offsets.to_numpy() - column.offsets[0].as_py(), type=pa.int64())
    return pa.LargeListArray.from_arrays(rebased, values)


def _fill_nulls(column: pa.Array) -> pa.Array:
    """Null logprob rows (logprobs off for that trajectory) become empty lists."""
    if column.null_count == 0:
        return column
    rows = [r if r is not None else [] for r in column.to_pylist()]
    return pa.array(rows, type=column.type)
