"""Multimodal rows in verl's format: an ``images`` column (``data.image_key``) and ``<image>``
placeholders in the messages.

verl's ``RLHFDataset._build_messages`` turns each ``<image>`` of a message's text into a
``{"type": "image", "image": ...}`` content part, in order, so that the processor's chat
template and ``process_multi_modal_info`` find the images in the messages. The publisher
does the same before a row goes to Kafka, with one difference forced by the wire: a prompt
group is JSON, so an image that is bytes (a parquet ``{"bytes": ..., "path": ...}`` struct)
travels as a ``data:`` URL, which verl's and vLLM's image loaders both read. Paths and URLs
stay as they are.

Videos and audio are refused with the reason (not supported here yet), and so is a row
whose ``<image>`` placeholders and images do not pair up (verl asserts the same).
"""

from __future__ import annotations

import base64
import re
from typing import Any

PLACEHOLDER = re.compile(r"(<image>|<video>|<audio>)")
IMAGE_COLUMN = "images"  # the column verl's agent loops and our trajectories carry
UNSUPPORTED_COLUMNS = ("videos", "audios", "video", "audio")


def build_multimodal_row(row: dict[str, Any], image_key: str = IMAGE_COLUMN) -> dict[str, Any]:
    """``row`` with its images in the messages (verl's ``_build_messages``); unchanged when
    it has none. Raises ValueError, naming the problem, for what cannot be carried."""
    for column in UNSUPPORTED_COLUMNS:
        if row.get(column):
            raise ValueError(
                f"the row has a {column!r} column: video and audio rows are not supported "
                "(images are)"
            )
    images = row.get(image_key) or []
    if not isinstance(images, list):
        raise ValueError(f"column {image_key!r} (data.image_key) must be a list of images")
    messages = row.get("prompt")
    if not images or not isinstance(messages, list):
        return row
    carried = [_json_image(image, i) for i, image in enumerate(images)]
    out = {k: v for k, v in row.items() if k != image_key}
    out[IMAGE_COLUMN] = carried
    out["prompt"] = _with_image_parts(messages, carried)
    return out


def _with_image_parts(messages: list[Any], images: list[str]) -> list[Any]:
    used = 0
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str) or not PLACEHOLDER.search(content):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for segment in (s for s in PLACEHOLDER.split(content) if s):
            if segment in ("<video>", "<audio>"):
                raise ValueError(f"the prompt has a {segment} placeholder: not supported")
            if segment == "<image>":
                if used >= len(images):
                    raise ValueError(
                        f"the prompt has more <image> placeholders than {len(images)} images"
                    )
                parts.append({"type": "image", "image": images[used]})
                used += 1
            else:
                parts.append({"type": "text", "text": segment})
        out.append({**message, "content": parts})
    if used != len(images):
        raise ValueError(f"the row has {len(images)} images but {used} <image> placeholders")
    return out


def _json_image(image: Any, index: int) -> str:
    """A JSON-safe image: a path or URL as it is, bytes as a ``data:`` URL."""
    if isinstance(image, str):
        return image
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            return data_url(image["bytes"])
        if isinstance(image.get("image"), str):
            return image["image"]
        if isinstance(image.get("path"), str):
            return image["path"]
    if isinstance(image, bytes | bytearray):
        return data_url(bytes(image))
    raise ValueError(
        f"image {index} is a {type(image).__name__}: expected a path, a URL, bytes or "
        "{'bytes': ..., 'path': ...}"
    )


def data_url(data: bytes) -> str:
    """``data:image/<kind>;base64,...`` with the kind read from the file's magic bytes."""
    kind = "png"
    if data[:3] == b"\xff\xd8\xff":
        kind = "jpeg"
    elif data[:4] == b"GIF8":
        kind = "gif"
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "webp"
    return f"data:image/{kind};base64,{base64.b64encode(data).decode('ascii')}"
