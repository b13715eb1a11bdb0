"""M-RoPE position ids for the padded conversion of multimodal trajectories (Qwen2-VL family).

verl's ``AgentLoopWorker._compute_position_ids`` gives a vision-language sample position ids
of shape ``(4, L)``: row 0 the text positions (``0..valid-1`` over the attention mask,
``1`` on padding), rows 1-3 the model's 3-D rope index (temporal, height, width; ``0`` on
padding) from the processor's ``get_rope_index``. A padded batch stacks them to
``(B, 4, L)``.

This computes the same without a processor object, from the token ids that mark the vision
tokens and each item's ``(t, h, w)`` patch grid, as transformers 5.17's
``Qwen2VLModel.get_rope_index`` does (tests/test_mrope.py checks it against that function):
text runs advance by one per token, a vision run gets a (t, h/m, w/m) grid of positions
offset by the position where it starts, and the text after it resumes at that start plus
``max(h, w) / m``.

Kept apart from ``consumers/tensors.py`` (the text path) so the text conversion stays
free of vision concerns; ``mrope_position_ids`` takes the padded ``input_ids`` and
``attention_mask`` that conversion builds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

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
