"""Multimodal rows in verl's format: the publisher puts the ``images`` column into the
messages as verl's dataset does, refuses what it cannot carry, a token-only backend refuses
images by name, and M-RoPE position ids match transformers' Qwen2-VL rope index."""

from __future__ import annotations

import base64
import functools
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from rolloutbus.config import Config
from rolloutbus.consumers.mrope import mrope_position_ids
from rolloutbus.producers.multimodal import build_multimodal_row
from rolloutbus.producers.publish import build_group
from rolloutbus.streams.inference.multimodal import (
    ImagesNotSupportedError,
    check_backend_takes_images,
    vllm_content_parts,
)

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def _row(**extra):
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "<image>What is x? Compare <image>."}],
        **extra,
    }


def test_images_go_into_the_messages_as_verls_dataset_puts_them():
    row = _row(images=[{"bytes": PNG, "path": None}, "https://example.com/b.jpg"])
    group = build_group(Config(), row)
    [message] = group.row["prompt"]
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert message["content"] == [
        {"type": "image", "image": url},
        {"type": "text", "text": "What is x? Compare "},
        {"type": "image", "image": "https://example.com/b.jpg"},
        {"type": "text", "text": "."},
    ]
    assert group.row["images"] == [url, "https://example.com/b.jpg"]  # JSON-safe on Kafka


def test_data_image_key_names_the_column():
    cfg = Config.model_validate({"data": {"image_key": "pictures"}})
    group = build_group(cfg, _row(pictures=["a.png", "b.png"]))
    assert group.row["images"] == ["a.png", "b.png"] and "pictures" not in group.row


@pytest.mark.parametrize(
    "row, reason",
    [
        (_row(images=["a.png"]), "more <image> placeholders than 1 images"),
        (_row(images=["a.png", "b.png", "c.png"]), "3 images but 2"),
        (_row(videos=["v.mp4"]), "video and audio rows are not supported"),
        (_row(images=[3.5, 1]), "image 0 is a float"),
    ],
)
def test_rows_that_cannot_be_carried_are_refused_with_the_reason(row, reason):
    with pytest.raises(ValueError, match=reason):
        build_multimodal_row(row)


def test_a_token_only_backend_refuses_images_by_name():
    with pytest.raises(ImagesNotSupportedError, match="'sglang' takes token ids only"):
        check_backend_takes_images("sglang", ["a.png"])
    check_backend_takes_images("sglang", None)  # text rows pass
    check_backend_takes_images("vllm_generate", ["a.png"])
    assert vllm_content_parts(["data:image/png;base64,AA", PNG])[1]["url"].startswith(
        "data:image/png;base64,"
    )


IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653


def _transformers_rope_index(input_ids, attention_mask, image_grid_thw, merge):
    model = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge))
    )
    model.get_vision_position_ids = functools.partial(Qwen2VLModel.get_vision_position_ids, model)
    types = (input_ids == IMAGE).long()
    positions, _ = Qwen2VLModel.get_rope_index(
        model, input_ids, types, image_grid_thw, None, attention_mask
    )
    return positions.transpose(0, 1)  # (3, B, L) -> (B, 3, L)


def test_mrope_position_ids_match_transformers_qwen2_vl():
    merge = 2
    grids = torch.tensor([[1, 4, 6], [1, 2, 2]])  # 6 and 1 merged tokens
    first = [1, 2, START] + [IMAGE] * 6 + [END, 3, START] + [IMAGE] * 1 + [END, 4, 5]
    second = [7, 8, 9, 10]  # text only, left-padded
    length = len(first) + 2
    input_ids = torch.zeros(2, length, dtype=torch.long)
    attention_mask = torch.zeros(2, length, dtype=torch.long)
    input_ids[0, 2:] = torch.tensor(first)
    attention_mask[0, 2:] = 1
    input_ids[1, -len(second) :] = torch.tensor(second)
    attention_mask[1, -len(second) :] = 1
    ours = mrope_position_ids(
        input_ids,
        attention_mask,
        image_token_id=IMAGE,
        image_grid_thw=grids,
        spatial_merge_size=merge,
    )
    assert ours.shape == (2, 4, length)
    theirs = _transformers_rope_index(input_ids, attention_mask, grids, merge)
    assert torch.equal(ours[:, 1:], theirs)
    # row 0: text positions over the mask, 1 on padding (verl's layout)
    assert ours[0, 0].tolist() == [1, 1] + list(range(len(first)))
    assert ours[1, 0].tolist()[-4:] == [0, 1, 2, 3] and torch.equal(ours[1, 1], ours[1, 3])
    # the image really has 3-D positions: height and width differ inside it
    assert not torch.equal(ours[0, 2], ours[0, 3])


def test_mrope_refuses_a_grid_that_does_not_fit_its_tokens():
    input_ids = torch.tensor([[1, START, IMAGE, IMAGE, END]])
    with pytest.raises(ValueError, match="does not match its grid"):
        mrope_position_ids(
            input_ids,
            torch.ones_like(input_ids),
            image_token_id=IMAGE,
            image_grid_thw=torch.tensor([[1, 4, 4]]),
        )
