"""Images for an engine: which backends take them, and vLLM's wire form.

vLLM's token-in/token-out ``POST /inference/v1/generate`` takes a turn's images next to its
token ids as ``content_parts`` (``[{"type": "image_url", "url": ...}]``; vLLM resolves the
media and pairs it with the prompt's image placeholder tokens). Its completions endpoint
and SGLang's ``/generate`` as this client drives them take token ids only, so a session
with images on those backends fails, saying so, instead of generating from the text alone.

vLLM wants each image's placeholder **unexpanded** in those token ids: its renderer
replaces the first ``<|image_pad|>`` after each image's start by as many pads as the image
has tokens, so a prompt already expanded by the processor (what the agent loop builds and
the trajectory keeps, as verl's) grew by that count minus one per image on a real vLLM
0.32 Qwen2-VL server (28 prompt tokens became 31, with 3 pads that were no image). The
backend therefore sends ``vllm_token_prompt``: each Qwen-VL image run collapsed to one pad.
The trajectory keeps the expanded ids, which are the positions vLLM computed after its own
expansion (tests/replica/test_vllm_real.py).

The LLM client resolves a turn's images to URLs once (``image_urls``), carries them on its
``EngineCall`` and sends them again with every resumed piece of an aborted turn. The
contract test (tests/contract/test_vllm_multimodal_contract.py) validates the generate
request the backend builds with vLLM's own ``GenerateRequest`` model.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from rolloutbus.errors import AgentLoopError

IMAGE_BACKENDS = frozenset({"vllm_generate"})  # backends whose requests can carry images
# Qwen-VL's image placeholder tokens; Qwen2-VL, Qwen2.5-VL and Qwen3-VL share these ids
VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653


class MediaNotSupportedError(AgentLoopError):
    """A turn's media (images, videos, audio) cannot reach the engine: the session fails
    with this reason (an ``AgentLoopError``: not retried, since a retry fails the same way)."""


class ImagesNotSupportedError(MediaNotSupportedError):
    """The configured backend, or the replica behind it, cannot take the session's images."""


def check_backend_takes_images(backend: str, images: list[Any] | None) -> None:
    """Raise, naming the backend and the way out, when ``images`` cannot reach it."""
    if images and backend not in IMAGE_BACKENDS:
        raise ImagesNotSupportedError(
            f"the prompt has {len(images)} image(s) but replicas.backend {backend!r} takes "
            f"token ids only; use one of {sorted(IMAGE_BACKENDS)} for multimodal rows"
        )


def refuse_video_and_audio(video_data: Any, audio_data: Any) -> None:
    """Videos and audio are not sent: say so instead of generating from the text alone.

    vLLM's generate endpoint would take ``video_url``/``audio_url`` parts, but verl hands
    a loop decoded video frames and audio waveforms (tensors, arrays), which have no URL
    form here, and the publisher refuses video/audio rows already."""
    for name, data in (("video_data", video_data), ("audio_data", audio_data)):
        if data is not None and (not hasattr(data, "__len__") or len(data) > 0):
            raise MediaNotSupportedError(
                f"generate() got {name}: this client sends images only (vLLM content_parts "
                "of type image_url); videos and audio are not forwarded to any backend"
            )


def vllm_token_prompt(prompt_ids: list[int], num_images: int) -> list[int]:
    """``prompt_ids`` as vLLM's token-in endpoint takes them next to ``num_images`` images:
    the first ``num_images`` runs ``<|vision_start|> <|image_pad|>*k <|vision_end|>`` with
    one pad each (vLLM expands it again from the image). A prompt whose images are not
    Qwen-VL runs, or whose runs hold one pad already, is returned as it is."""
    if num_images == 0:
        return list(prompt_ids)  # a text turn: no per-token walk
    out: list[int] = []
    i, left = 0, num_images
    while i < len(prompt_ids):
        token = prompt_ids[i]
        out.append(token)
        i += 1
        if token != VISION_START or left == 0:
            continue
        end = i
        while end < len(prompt_ids) and prompt_ids[end] == IMAGE_PAD:
            end += 1
        if end > i and end < len(prompt_ids) and prompt_ids[end] == VISION_END:
            out.append(IMAGE_PAD)  # the run of this image, collapsed
            i, left = end, left - 1
    return out


def vllm_content_parts(images: list[Any]) -> list[dict[str, str]]:
    """vLLM's ``content_parts`` for a turn's images, in prompt order."""
    return [{"type": "image_url", "url": image_url(image)} for image in images]


def image_urls(images: list[Any] | None) -> tuple[str, ...]:
    """A turn's images as URLs, in prompt order; ``()`` for a text turn."""
    return tuple(image_url(image) for image in images or ())


def image_url(image: Any) -> str:
    """A URL vLLM's media connector reads: http(s) and ``data:`` URLs as they are, a local
    path as ``file://`` (the server must allow it: ``--allowed-local-media-path``), a PIL
    image or bytes as a PNG/bytes ``data:`` URL, verl's ``{"image": ...}`` dict by its
    ``image``."""
    if isinstance(image, dict):
        inner = image.get("image", image.get("url", image.get("bytes")))
        if inner is None:
            raise AgentLoopError(
                f"an image dict needs 'image', 'url' or 'bytes', got {sorted(image)}"
            )
        return image_url(inner)
    if isinstance(image, str):
        if image.startswith(("http://", "https://", "data:", "file://")):
            return image
        return Path(image).resolve().as_uri()
    if isinstance(image, bytes | bytearray):
        return "data:image/png;base64," + base64.b64encode(bytes(image)).decode("ascii")
    if hasattr(image, "save"):  # a PIL image, as verl's dataset hands them to the loop
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    raise AgentLoopError(f"cannot send an image of type {type(image).__name__} to vLLM")
