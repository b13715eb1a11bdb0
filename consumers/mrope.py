"""M-RoPE position ids for the padded conversion of multimodal trajectories (Qwen2-VL family).

verl's ``AgentLoopWorker._compute_position_ids`` gives a vision-language sample position ids
of shape ``(4, L)``: row 0 the text positions (``0..valid-1`` over the attention mask,
``1`` on padding), rows 1-3 the model's 3-D rope index (temporal, height, width; ``0`` on
padding) from the processor's ``get_rope_index``. A padded batch stacks them to
``(B, 4, L)``.

This computes the same without a processor object, from the token ids that mark the vision
tokens and each item's ``(t, h, w)`` patch grid, as transformers 5.17's
``Qwen2VLModel.get_rope_index`` does (tests/consumers/test_mrope.py checks it against that
function): text runs advance by one per token, a vision run gets a (t, h/m, w/m) grid of positions
offset by the position where it starts, and the text after it resumes at that start plus
``max(h, w) / m``.

Kept apart from ``consumers/tensors.py`` (the text path) so the text conversion stays
free of vision concerns; ``mrope_position_ids`` takes the padded ``input_ids`` and
``attention_mask`` that conversion builds, and ``padded_mrope_position_ids`` is what
``to_padded`` calls: the grids come from what each trajectory recorded
(``rolloutbus.schemas.mrope.MropeInputs`` in its ``extra_fields``). A batch where no
trajectory recorded any is a text batch and keeps its ``(B, L)`` position ids.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import torch

from rolloutbus.schemas.mrope import MROPE_INPUTS_KEY, MropeInputs

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids values


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    spatial_merge_size: int = 2,
) -> torch.Tensor:
    """``(B, 4, L)`` position ids for a padded batch, as verl lays them out.

    ``image_grid_thw``/``video_grid_thw``: one ``(t, h, w)`` row per image/video of the
    batch, in order (the processor's ``image_grid_thw``). A sample without vision tokens
    gets its text positions in all four rows.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be (batch, length)"
        )
    token_types = torch.zeros_like(input_ids)
    token_types[input_ids == image_token_id] = IMAGE
    if video_token_id is not None:
        token_types[input_ids == video_token_id] = VIDEO
    grids = {
        IMAGE: iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(()),
        VIDEO: iter(video_grid_thw.tolist()) if video_grid_thw is not None else iter(()),
    }
    batch, length = input_ids.shape
    out = torch.zeros(batch, 4, length, dtype=torch.long)
    for b in range(batch):
        valid = attention_mask[b].bool()
        n_valid = int(valid.sum())
        out[b, 0] = 1  # verl's text row is 1 on padding
        out[b, 0, valid] = torch.arange(n_valid)
        out[b, 1:, valid] = _rope_index(token_types[b, valid].tolist(), grids, spatial_merge_size)
    return out


def _rope_index(
    types: list[int], grids: dict[int, Iterator[list[int]]], merge: int
) -> torch.Tensor:
    """(3, n) positions of one sample's unpadded tokens."""
    pieces: list[torch.Tensor] = []
    position = 0
    for kind, run in itertools.groupby(types):
        count = len(list(run))
        if kind == TEXT:
            pieces.append(torch.arange(count).view(1, -1).expand(3, -1) + position)
            position += count
            continue
        grid = next(grids[kind], None)
        if grid is None:
            name = "image" if kind == IMAGE else "video"
            raise ValueError(f"more {name} token runs than {name}_grid_thw rows")
        t, h, w = grid
        vision = _vision_positions(position, t, h // merge, w // merge)
        if vision.shape[1] != count:
            raise ValueError(
                f"a vision run of {count} tokens does not match its grid {grid} "
                f"({vision.shape[1]} tokens at spatial_merge_size {merge})"
            )
        pieces.append(vision)
        position += max(h, w) // merge
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1)


def _vision_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    grid_t, grid_h, grid_w = torch.meshgrid(
        torch.arange(t), torch.arange(h) + start, torch.arange(w) + start, indexing="ij"
    )
    positions = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1)
    positions[0] += start
    return positions


def recorded_mrope_inputs(batch: pa.RecordBatch) -> list[MropeInputs | None] | None:
    """Each trajectory's recorded ``MropeInputs`` (None for a text one), or None when no
    trajectory of the batch has any: then nothing is parsed (a substring scan of the
    ``extra_fields`` JSON column, so a text batch pays microseconds)."""
    column = batch.column("extra_fields")
    if column.null_count == len(column):
        return None
    marked = pc.match_substring(column, f'"{MROPE_INPUTS_KEY}"')
    if not pc.any(marked).as_py():
        return None
    out: list[MropeInputs | None] = []
    for text, has in zip(column.to_pylist(), marked.to_pylist(), strict=True):
        recorded = json.loads(text).get(MROPE_INPUTS_KEY) if has else None
        out.append(None if recorded is None else MropeInputs.model_validate(recorded))
    return out


def padded_mrope_position_ids(
    batch: pa.RecordBatch, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor | None:
    """``(B, 4, L)`` position ids of a padded batch whose trajectories recorded M-RoPE
    inputs, one row at a time with that row's own grids; None for a text batch. A text
    row of a multimodal batch gets its text positions in all four rows, as in verl."""
    recorded = recorded_mrope_inputs(batch)
    if recorded is None:
        return None
    known = [r for r in recorded if r is not None]
    token_ids = {(r.image_token_id, r.spatial_merge_size) for r in known}
    if len(token_ids) != 1:
        raise ValueError(
            "trajectories of one batch recorded different (image_token_id, "
            f"spatial_merge_size): {sorted(token_ids)}; pad batches of one model"
        )
    ((image_token_id, merge),) = token_ids
    keys = batch.column("key").to_pylist()
    rows = []
    for b, inputs in enumerate(recorded):
        grid = torch.tensor(inputs.image_grid_thw) if inputs is not None else None
        try:
            rows.append(
                mrope_position_ids(
                    input_ids[b : b + 1],
                    attention_mask[b : b + 1],
                    image_token_id=image_token_id,
                    image_grid_thw=grid,
                    spatial_merge_size=merge,
                )
            )
        except ValueError as exc:
            raise ValueError(f"trajectory {keys[b]}: M-RoPE position ids: {exc}") from exc
    return torch.cat(rows)
