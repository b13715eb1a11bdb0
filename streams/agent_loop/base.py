"""``AgentLoopBase``: verl's per-trajectory control program, with verl's constructor and API.

A verl user's loop subclasses it and implements ``async run(sampling_params, **kwargs)``.
What verl 0.9.1's ``AgentLoopBase`` offers is here under the same names:

- ``self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``
  (token-in/token-out);
- the Continuous Token helpers ``ct_build_initial_tokens``, ``ct_merge_assistant_token``,
  ``ct_merge_context_msg`` (verl 0.9.1's name; verl main of 2026-08-22 has only
  ``ct_merge_non_assistant_msg``, which is here too), the builder as
  ``self.continuous_token_builder``;
- ``process_multi_modal_info`` (and ``process_vision_info``), ``_assert_mm_supported``,
  ``_get_mm_processor_kwargs``, ``build_sglang_video_payload``;
- ``self.loop`` (the running asyncio loop: ``run_in_executor``), ``self.config``,
  ``self.rollout_config``, ``self.data_config``, ``self.apply_chat_template_kwargs``;
- the constructor keywords ``dataset_cls``, ``data_config``, ``hf_model_type`` and
  ``tools`` (a ``ToolListWrap``), which the session runner passes as verl's worker does.

``apply_chat_template`` (the pre-CT API) still works for loops written against older verl.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from rolloutbus.config import Config
from rolloutbus.errors import AgentLoopError, PromptTooLongError
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.schemas.mrope import MROPE_INPUTS_KEY, MropeInputs
from rolloutbus.streams.agent_loop.continuous_token import (
    ContinuousTokenBuilder,
    MergeResult,
    get_builder,
    render_ids,
)

logger = logging.getLogger(__name__)


class MultimodalUnsupportedError(AgentLoopError, ValueError):
    """Images, videos or audio reached a loop that cannot render them (verl: ValueError)."""


class DictConfigWrap:
    """verl's wrapper that carries a config into a loop (``trainer_config.config``)."""

    def __init__(self, config: Any):
        self.config = config


class ToolListWrap:
    """verl's wrapper for the worker's tool list (``tools.tools``)."""

    def __init__(self, tools: list[Any]):
        self.tools = tools


def config_get(section: Any, key: str, default: Any = None) -> Any:
    """``section.get(key, default)`` for a dict, an OmegaConf node or a pydantic model."""
    if section is None:
        return default
    if isinstance(section, Mapping) or hasattr(section, "get"):
        return section.get(key, default)
    return getattr(section, key, default)


class AgentLoopBase(ABC):
    """Base of every agent loop. One instance runs one trajectory."""

    def __init__(
        self,
        trainer_config: DictConfigWrap,
        server_manager: Any,
        tokenizer: Any,
        processor: Any = None,
        dataset_cls: Any = None,
        data_config: Any = None,
        hf_model_type: str | None = None,
        **kwargs: Any,
    ):
        self.trainer_config = trainer_config
        self.config: Config = trainer_config.config
        self.rollout_config = self.config.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        # verl unwraps ``data_config`` (a DictConfigWrap of ``config.data``)
        if isinstance(data_config, DictConfigWrap):
            data_config = data_config.config
        self.data_config = data_config if data_config is not None else self.config.data
        self.hf_model_type = hf_model_type
        self.apply_chat_template_kwargs: dict[str, Any] = {
            **dict(config_get(self.data_config, "apply_chat_template_kwargs", None) or {}),
            **dict(kwargs.pop("apply_chat_template_kwargs", None) or {}),
        }
        self.mm_processor_kwargs: dict[str, Any] = dict(
            config_get(self.data_config, "mm_processor_kwargs", None) or {}
        )
        kwargs.pop("tools", None)  # the worker's tools; only a tool-using loop keeps them
        self.extra_kwargs = kwargs  # YAML kwargs of a custom loop that a subclass did not take
        self._continuous_token_builder: ContinuousTokenBuilder | None = None
        self.loop = _event_loop()

    @abstractmethod
    async def run(
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Run one trajectory; kwargs are the dataset row columns plus uid, session_id, ..."""

    # ---- Continuous Token (verl's CT API) ------------------------------------------------

    @property
    def continuous_token_builder(self) -> ContinuousTokenBuilder:
        """The CT builder of this tokenizer, built on first use (cached per tokenizer,
        ``data.apply_chat_template_kwargs`` and ``data.mm_processor_kwargs``, which it
        applies to every render, as verl's); a loop may assign its own, as in verl."""
        if self._continuous_token_builder is None:
            self._continuous_token_builder = get_builder(
                self.tokenizer,
                self.processor,
                mm_processor_kwargs=self.mm_processor_kwargs,
                **self.apply_chat_template_kwargs,
            )
        return self._continuous_token_builder

    @continuous_token_builder.setter
    def continuous_token_builder(self, builder: ContinuousTokenBuilder) -> None:
        self._continuous_token_builder = builder

    @property
    def ct_builder(self) -> ContinuousTokenBuilder:
        return self.continuous_token_builder

    async def ct_build_initial_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        audios: list[Any] | None = None,
        mm_inputs_out: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids with the generation prompt, within ``rollout.prompt_length``.

        A text prompt that is too long keeps its last ``prompt_length`` tokens (left
        truncation, with a warning); a multimodal prompt that is too long raises
        ``PromptTooLongError`` (a ValueError, as in verl): cutting tokens would orphan
        image/video placeholders.
        """
        builder = self.continuous_token_builder
        prompt_ids = await self.loop.run_in_executor(
            None,
            lambda: builder.build_initial_tokens(
                messages,
                tools=tools,
                images=images,
                videos=videos,
                audios=audios,
                mm_inputs_out=mm_inputs_out,
            ),
        )
        return self._fit_prompt(prompt_ids, bool(images or videos or audios))

    async def ct_merge_context_msg(
        self,
        previous_messages: list[dict[str, Any]],
        updated_messages: list[dict[str, Any]],
        runtime_token_ids: list[int],
        response_mask: list[int],
        response_logprobs: list[float] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append the new (tool/user/system) messages' tokens; mask 0, logprob 0.0."""
        builder = self.continuous_token_builder
        merge = await self.loop.run_in_executor(
            None,
            lambda: builder.merge_context_tokens(
                previous_messages, updated_messages, runtime_token_ids, tools=tools
            ),
        )
        mask, logprobs = builder.align_response_metadata(merge, response_mask, response_logprobs)
        return merge, mask, logprobs

    # verl main's name (2026-08-22); verl 0.9.1 calls it ct_merge_context_msg
    ct_merge_non_assistant_msg = ct_merge_context_msg

    async def ct_merge_assistant_token(
        self,
        runtime_token_ids: list[int],
        assistant_token_ids: list[int],
        response_mask: list[int],
        response_logprobs: list[float] | None = None,
        assistant_logprobs: list[float] | None = None,
    ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append sampled tokens verbatim; mask 1 and their logprobs."""
        builder = self.continuous_token_builder
        merge = await self.loop.run_in_executor(
            None, lambda: builder.merge_assistant_tokens(runtime_token_ids, assistant_token_ids)
        )
        mask, logprobs = builder.align_response_metadata(
            merge, response_mask, response_logprobs, assistant_logprobs=assistant_logprobs
        )
        return merge, mask, logprobs

    def _cap_text_prompt_length(self, prompt_ids: list[int]) -> list[int]:
        return self._fit_prompt(prompt_ids, multimodal=False)

    # ---- multimodal ------------------------------------------------------------------------

    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        """verl: multimodal input needs a builder that renders it and a processor."""
        if has_multi_modal and not (
            self.continuous_token_builder.supports_multimodal() and self.processor is not None
        ):
            raise MultimodalUnsupportedError(
                "the prompt has images, videos or audio but this loop has no processor "
                "(use a VL model with its processor, or remove the multimodal inputs)"
            )

    def _get_mm_processor_kwargs(self, audio_data: list[Any] | None = None) -> dict[str, Any]:
        kwargs = dict(self.mm_processor_kwargs or {})
        if audio_data is not None and "sampling_rate" not in kwargs:
            extractor = getattr(self.processor, "feature_extractor", None)
            rate = getattr(extractor, "sampling_rate", None)
            if rate is not None:
                kwargs["sampling_rate"] = int(rate)
        return kwargs

    async def process_vision_info(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """verl's backward-compatible name of ``process_multi_modal_info``."""
        return await self.process_multi_modal_info(messages)

    async def process_multi_modal_info(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Images, videos and audios of ``messages``: ``{"images": [...], ...}``; ``{}`` when
        the loop has no processor (as in verl). With a ``dataset_cls`` that extracts them
        (verl's RLHFDataset), it is asked, as verl asks it; else the content items
        ``{"type": "image", "image": ...}`` / ``video`` / ``audio`` are collected."""
        if self.processor is None:
            return {}
        patch = getattr(getattr(self.processor, "image_processor", None), "patch_size", 14)
        if hasattr(self.dataset_cls, "process_multi_modal_info"):
            images, videos, audios = await self.dataset_cls.process_multi_modal_info(
                messages, image_patch_size=patch, config=self.data_config
            )
        elif hasattr(self.dataset_cls, "process_vision_info"):
            images, videos = await self.dataset_cls.process_vision_info(
                messages, image_patch_size=patch, config=self.data_config
            )
            audios = None
        else:
            images, videos, audios = _content_media(messages)
        found = {"images": images, "videos": videos, "audios": audios}
        return {key: value for key, value in found.items() if value is not None}

    @staticmethod
    def build_sglang_video_payload(
        videos: Any, mm_inputs: dict[str, Any]
    ) -> list[dict[str, Any]] | None:
        """verl's video features for SGLang's ``video_data``; None without a video."""
        if not videos or "pixel_values_videos" not in mm_inputs:
            return None
        payload = {
            "format": "processor_output",
            "pixel_values_videos": mm_inputs["pixel_values_videos"],
            "video_grid_thw": mm_inputs["video_grid_thw"],
        }
        if "second_per_grid_ts" in mm_inputs:
            payload["second_per_grid_ts"] = mm_inputs["second_per_grid_ts"]
        return [payload]

    # ---- prompts (pre-CT API) ----------------------------------------------------------------

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        remove_system_prompt: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """verl's pre-CT prompt builder; ``ct_build_initial_tokens`` is the current one."""
        kwargs = {**self.apply_chat_template_kwargs, **template_kwargs}
        multimodal = bool(images) or bool(videos)
        self._assert_mm_supported(multimodal)
        builder = get_builder(
            self.tokenizer, self.processor, mm_processor_kwargs=self.mm_processor_kwargs, **kwargs
        )
        ids = await asyncio.to_thread(
            builder.build_initial_tokens, messages, tools=tools, images=images, videos=videos
        )
        if remove_system_prompt:
            ids = self._strip_system_prompt(ids)
        return self._fit_prompt(ids, multimodal)

    def _strip_system_prompt(self, ids: list[int]) -> list[int]:
        """Drop the default system prefix the template adds to a headless render (pre-CT verl)."""
        system = self.system_prompt_ids
        return ids[len(system) :] if system and ids[: len(system)] == system else ids

    @property
    def system_prompt_ids(self) -> list[int]:
        """verl's ``initialize_system_prompt``: what one user turn renders beyond its own tokens."""
        one = render_ids(self.tokenizer, [{"role": "user", "content": ""}])
        two = render_ids(self.tokenizer, [{"role": "user", "content": ""}] * 2)
        per_turn = len(two) - len(one)
        return one[: len(one) - per_turn]

    def _fit_prompt(self, ids: list[int], multimodal: bool) -> list[int]:
        limit = self.rollout_config.prompt_length
        if len(ids) <= limit:
            return ids
        if multimodal:
            raise PromptTooLongError(
                f"multimodal prompt has {len(ids)} tokens, over rollout.prompt_length={limit}; "
                "it cannot be truncated without breaking its image/video placeholders"
            )
        logger.warning(
            "prompt has %d tokens, over rollout.prompt_length=%d: keeping the last %d",
            len(ids),
            limit,
            limit,
        )
        return ids[-limit:]

    # ---- helpers shared by the built-in loops -------------------------------------------

    def trajectory_request_id(self, kwargs: dict[str, Any]) -> str:
        """One id per trajectory (sticky routing); ``det-{priority}`` under full determinism."""
        if self.rollout_config.full_determinism:
            priority = kwargs.get("priority")
            if priority is None:
                priority = f"{kwargs.get('uid', '')}_{kwargs.get('session_id', 0)}"
            return f"det-{priority}"
        return uuid.uuid4().hex


def _event_loop() -> asyncio.AbstractEventLoop:
    """The running loop (loops are built inside the session's coroutine), as verl's
    ``get_event_loop`` gives; a new one when built outside any loop."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        try:
            return asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop


def _content_media(
    messages: list[dict[str, Any]],
) -> tuple[list[Any] | None, list[Any] | None, list[Any] | None]:
    found: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            kind = item.get("type") if isinstance(item, Mapping) else None
            if kind in found and item.get(kind) is not None:
                found[kind].append(item[kind])
    images, videos, audios = (found[k] or None for k in ("image", "video", "audio"))
    return images, videos, audios


def multi_modal_inputs(kwargs: dict[str, Any]) -> tuple[list[Any] | None, list[Any] | None]:
    """Images and videos of a row (``multi_modal_data`` column: images/image, videos/video)."""
    data = kwargs.get("multi_modal_data") or {}
    images = data.get("images", data.get("image"))
    videos = data.get("videos", data.get("video"))
    return images or None, videos or None


def mrope_inputs(processor: Any, images: list[Any] | None) -> dict[str, Any]:
    """``{MROPE_INPUTS_KEY: MropeInputs}`` for an output with images, so the padded
    conversion can compute verl's M-RoPE position ids (``schemas/mrope.py``); ``{}`` for a
    text output or a processor without Qwen2-VL's image grid (``merge_size``,
    ``image_token_id``). The grid comes from the processor's image processor called as the
    Continuous Token builder calls the processor (no extra kwargs), so it matches the
    prompt's placeholder runs."""
    image_processor = getattr(processor, "image_processor", None)
    merge = getattr(image_processor, "merge_size", None)
    token_id = getattr(processor, "image_token_id", None)
    if not images or image_processor is None or merge is None or token_id is None:
        return {}
    grid = image_processor(images=list(images), return_tensors="pt")
    inputs = MropeInputs(
        image_grid_thw=[tuple(row) for row in grid["image_grid_thw"].tolist()],
        image_token_id=int(token_id),
        spatial_merge_size=int(merge),
    )
    return {MROPE_INPUTS_KEY: inputs.model_dump(mode="json")}
