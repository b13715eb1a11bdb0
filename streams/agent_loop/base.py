"""``AgentLoopBase``: verl's per-trajectory control program, with verl's constructor shape.

A verl user's loop subclasses it and implements ``async run(sampling_params, **kwargs)``;
``self.server_manager.generate(...)`` is token-in/token-out and ``self.apply_chat_template``
builds the initial prompt within ``rollout.prompt_length``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from abc import ABC, abstractmethod
from typing import Any

from rolloutbus.config import Config
from rolloutbus.errors import AgentLoopError, PromptTooLongError
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.streams.agent_loop.continuous_token import (
    ContinuousTokenBuilder,
    get_builder,
    render_ids,
)

logger = logging.getLogger(__name__)


class DictConfigWrap:
    """verl's wrapper that carries the trainer config into a loop (``trainer_config.config``)."""

    def __init__(self, config: Config):
        self.config = config


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
        self.data_config = data_config
        self.hf_model_type = hf_model_type
        self.apply_chat_template_kwargs: dict[str, Any] = dict(
            kwargs.pop("apply_chat_template_kwargs", None) or {}
        )
        self.extra_kwargs = kwargs  # YAML kwargs of a custom loop that a subclass did not take

    @abstractmethod
    async def run(
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Run one trajectory; kwargs are the dataset row columns plus uid, session_id, ..."""

    # ---- prompts -------------------------------------------------------------------

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        remove_system_prompt: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt token ids with the generation prompt, within ``rollout.prompt_length``.

        A text prompt that is too long keeps its last ``prompt_length`` tokens (left
        truncation, with a warning); a multimodal prompt that is too long raises
        ``PromptTooLongError``: cutting tokens would orphan image/video placeholders.
        """
        kwargs = {**self.apply_chat_template_kwargs, **template_kwargs}
        multimodal = bool(images) or bool(videos)
        self._assert_mm_supported(multimodal)
        ids = await asyncio.to_thread(self._render_prompt, messages, tools, images, videos, kwargs)
        if remove_system_prompt:
            ids = self._strip_system_prompt(ids)
        return self._fit_prompt(ids, multimodal)

    def _assert_mm_supported(self, multimodal: bool) -> None:
        if multimodal and self.processor is None:
            raise AgentLoopError(
                "the prompt has images or videos but this loop has no processor (a VL model)"
            )

    def _render_prompt(self, messages, tools, images, videos, kwargs) -> list[int]:
        if self.processor is None:
            return render_ids(
                self.tokenizer, messages, tools=tools, add_generation_prompt=True, **kwargs
            )
        text = self.processor.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
        )
        inputs = self.processor(
            text=[text], images=images or None, videos=videos or None, return_tensors="pt"
        )
        input_ids = inputs["input_ids"]
        first = input_ids[0]
        return first.tolist() if hasattr(first, "tolist") else list(first)

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

    @property
    def ct_builder(self) -> ContinuousTokenBuilder:
        return get_builder(self.tokenizer, **self.apply_chat_template_kwargs)

    def trajectory_request_id(self, kwargs: dict[str, Any]) -> str:
        """One id per trajectory (sticky routing); ``det-{priority}`` under full determinism."""
        if self.rollout_config.full_determinism:
            priority = kwargs.get("priority")
            if priority is None:
                priority = f"{kwargs.get('uid', '')}_{kwargs.get('session_id', 0)}"
            return f"det-{priority}"
        return uuid.uuid4().hex


def multi_modal_inputs(kwargs: dict[str, Any]) -> tuple[list[Any] | None, list[Any] | None]:
    """Images and videos of a row (``multi_modal_data`` column: images/image, videos/video)."""
    data = kwargs.get("multi_modal_data") or {}
    images = data.get("images", data.get("image"))
    videos = data.get("videos", data.get("video"))
    return images or None, videos or None
