"""What a row must pass before its prompt group is published, so that no rollout is spent
on a row that can only fail afterwards.

Beyond the verl row schema, ``n`` and the record size (``publish.build_group``):

* **agent loop**: the row's ``agent_name`` (or ``rollout.agent.default_agent_loop`` when
  the column is absent) names a registered loop: a built-in one, or one from
  ``rollout.agent.agent_loop_config_path``, loaded here as the session workers load it;
* **scorer**: a row with a ``reward_model`` is scored by the session workers, so its
  ``data_source`` needs a scorer: ``custom_reward_function`` when configured (loaded here,
  so a broken one is a config error before anything is published), else verl's table or a
  ``register_reward`` registration. verl would raise NotImplementedError after generating;
* **prompt length**: the prompt rendered with the model's chat template. A text prompt over
  ``rollout.prompt_length`` is left-truncated by the agent loop, as verl does: a note, not a
  problem. A multimodal prompt cannot be truncated (verl raises), and its text alone is a
  lower bound of its length: over the limit, it is refused.

A refused row is a :class:`RowProblem`: a ValueError with a short ``kind`` that the
publisher's per-reason summary counts, and a reason that names the row's fault.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from rolloutbus.config import Config
from rolloutbus.errors import ConfigError, RolloutBusError
from rolloutbus.schemas.prompts import PromptGroup

__all__ = ["RowChecker", "RowProblem", "problem_kind"]

# kinds of refused rows, as the per-reason summary names them
UNREADABLE = "unreadable row"
NOT_A_VERL_ROW = "not a verl row"
BAD_N = "n out of range"
TOO_LARGE = "record over kafka.max_message_bytes"
DUPLICATE_UID = "uid used twice"
NO_AGENT_LOOP = "agent loop not registered"
NO_SCORER = "no scorer for data_source"
PROMPT_TOO_LONG = "multimodal prompt over rollout.prompt_length"
UNRENDERABLE = "prompt the chat template cannot render"
# what the summary says of rows that pass with a note
TRUNCATED_NOTE = "prompt over rollout.prompt_length: the agent loop keeps its last tokens"


class RowProblem(ValueError):
    """A row that is not published: ``kind`` for the summary, the message for its letter."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


def problem_kind(exc: Exception) -> str:
    """The summary's name for why a row was refused."""
    return exc.kind if isinstance(exc, RowProblem) else NOT_A_VERL_ROW


class RowChecker:
    """The checks above, for one config; the tokenizer is loaded on the first row."""

    def __init__(self, cfg: Config, tokenizer: Any = None):
        self.cfg = cfg
        self._tokenizer = tokenizer
        self.agent_loops = _registered_agent_loops(cfg)
        self.custom_reward = _custom_reward_function(cfg)

    def check(self, group: PromptGroup) -> list[str]:
        """Raise RowProblem for a row that would fail; return the notes for one that passes."""
        row = group.row
        self._check_agent_loop(row)
        if row.get("reward_model") is not None:  # the session runner scores only these
            self._check_scorer(row)
        return self._check_prompt_length(row)

    def _check_agent_loop(self, row: dict[str, Any]) -> None:
        from rolloutbus.streams.agent_loop.registry import resolve_agent_name

        default = self.cfg.rollout.agent.default_agent_loop
        name = resolve_agent_name(row, default)
        registered = ", ".join(self.agent_loops) or "none"
        if name is None:
            raise RowProblem(
                NO_AGENT_LOOP,
                "agent_name is null; a null does not fall back to "
                f"rollout.agent.default_agent_loop (as in verl); registered: {registered}",
            )
        if name not in self.agent_loops:
            where = "agent_name" if "agent_name" in row else "rollout.agent.default_agent_loop"
            raise RowProblem(
                NO_AGENT_LOOP,
                f"agent loop {name!r} ({where}) is not registered; registered: {registered} "
                "(custom loops: rollout.agent.agent_loop_config_path)",
            )

    def _check_scorer(self, row: dict[str, Any]) -> None:
        from rolloutbus.streams.reward.default import unscored_reason

        if self.custom_reward:
            return
        data_source = row.get("data_source") or ""
        reason = unscored_reason(data_source)
        if reason is not None:
            raise RowProblem(
                NO_SCORER,
                f"data_source {data_source!r} has no scorer ({reason}); the session would "
                "fail in the reward after generating. Set custom_reward_function, or drop "
                "the row's reward_model to roll it out unscored",
            )

    def _check_prompt_length(self, row: dict[str, Any]) -> list[str]:
        limit = self.cfg.rollout.prompt_length
        multimodal = bool(row.get("images"))
        tokens = self._prompt_tokens(row["prompt"], multimodal)
        if tokens <= limit:
            return []
        if multimodal:
            raise RowProblem(
                PROMPT_TOO_LONG,
                f"the prompt's text alone is {tokens} tokens, over rollout.prompt_length "
                f"({limit}); a multimodal prompt cannot be truncated (verl raises too)",
            )
        return [TRUNCATED_NOTE]

    def _prompt_tokens(self, messages: list[Any], multimodal: bool) -> int:
        from jinja2 import TemplateError

        tokenizer = self.tokenizer
        try:
            if multimodal:  # a text tokenizer cannot render image parts: count the text
                return len(tokenizer.encode(_text_of(messages), add_special_tokens=False))
            from rolloutbus.streams.agent_loop.continuous_token import render_ids

            return len(render_ids(tokenizer, messages, add_generation_prompt=True))
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise RowProblem(
                UNRENDERABLE,
                f"the chat template of model {self.cfg.model.name!r} cannot render the "
                f"prompt: {exc}",
            ) from exc

    @cached_property
    def tokenizer(self) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer
        from rolloutbus.models.tokenizers import load_tokenizer

        return load_tokenizer(self.cfg.model)


def _registered_agent_loops(cfg: Config) -> list[str]:
    """The loops a session worker under ``cfg`` knows: the built-in ones and the config's."""
    from rolloutbus.streams.agent_loop import registry

    path = cfg.rollout.agent.agent_loop_config_path
    if path:
        try:
            registry.load_agent_loop_config(path)
        except RolloutBusError as exc:
            raise ConfigError(f"rollout.agent.agent_loop_config_path: {exc}") from exc
    return registry.registered_agent_loops()


def _custom_reward_function(cfg: Config) -> bool:
    """Whether a custom reward function scores every row; loads it, as the workers will, so
    a wrong path or name is a config error now rather than a failed session later."""
    if not cfg.reward_function.path:
        return False
    from rolloutbus.streams.reward.manager import reward_fn_from_config

    try:
        reward_fn_from_config(cfg)
    except RolloutBusError as exc:
        raise ConfigError(f"custom_reward_function: {exc}") from exc
    return True


def _text_of(messages: list[Any]) -> str:
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text", "") for p in content if isinstance(p, dict)]
    return "\n".join(parts)
