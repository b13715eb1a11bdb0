"""Scoring a session's outputs as verl's streaming reward loop does (naive reward manager).

verl 0.9.1 (``experimental/agent_loop/agent_loop.py::_compute_score`` and
``experimental/reward_loop/reward_manager/naive.py``):

* only the LAST output of a session is scored; its score and ``reward_extra_info`` are
  copied to the earlier outputs (V1 ``_agent_loop_postprocess``);
* ``solution_str`` is the decoded response (every response token, observations included,
  special tokens skipped);
* ``extra_info`` is the row's ``extra_info`` updated with every item of the output's
  ``extra_fields`` (verl's ``tool_extra_fields``: ``tool_rewards``, ``turn_scores``, what
  tools wrote, and ``raw_prompt``), then ``num_turns`` and ``rollout_reward_scores`` (the
  row's ``reward_scores`` column, else ``{}``);
* the function is called with keywords, ``compute_score(data_source=..., solution_str=...,
  ground_truth=..., extra_info=...)``; an ``async def`` one is awaited, a plain one runs in
  a worker thread;
* a dict result is the score (``"score"``) plus extra info (all its keys); a number is
  also recorded as ``acc``. The extra info lands in ``extra_fields["reward_extra_info"]``
  (and the trajectory's ``reward_extra_info`` column); the time in
  ``metrics.compute_score``.

Which function: ``custom_reward_function.path``/``.name`` when configured (verl's
``get_custom_reward_fn``, ``reward_kwargs`` merged into every call), else
``default_compute_score``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolloutbus.config import Config
from rolloutbus.errors import AgentLoopError
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.streams.plugins import import_object
from rolloutbus.streams.reward.default import ComputeScore, default_compute_score, register_reward

PKG_PREFIX = "pkg://"  # verl's load_module: a module by dotted (or slashed) name
FILE_PREFIX = "file://"  # verl's load_module: a file path


def load_reward_fn(path: str, *data_sources: str) -> ComputeScore:
    """Import a ``compute_score`` function by path.

    ``path`` is ``package.module.fn``, ``package.module:fn`` or ``path/to/file.py:fn``.
    With ``data_sources`` (``"default"`` for the rest) it is also registered for them.
    """
    fn = import_object(path, what="reward function", kind="callable")
    return register_reward(*data_sources)(fn)


def load_custom_reward_fn(
    path: str, name: str, reward_kwargs: Mapping[str, Any] | None = None
) -> ComputeScore:
    """verl's ``custom_reward_function``: ``path`` as verl's ``load_module`` takes it (a
    ``.py`` file, ``file://file.py`` or ``pkg://package.module``) and the function's
    ``name``; ``reward_kwargs`` are merged into every call, taking precedence (verl's
    ``_call_with_kwargs``). An ``async def`` function stays awaitable."""
    if path.startswith(PKG_PREFIX):
        spec = f"{path[len(PKG_PREFIX) :].replace('/', '.')}:{name}"
    else:
        file = path.removeprefix(FILE_PREFIX)
        if not Path(file).is_file():
            raise AgentLoopError(f"custom_reward_function.path: file not found: {file}")
        spec = f"{file}:{name}"
    raw_fn = import_object(spec, what="custom_reward_function", kind="callable")
    extra = dict(reward_kwargs or {})
    if not extra:
        return raw_fn
    if inspect.iscoroutinefunction(raw_fn):

        async def call_async(*args: Any, **kwargs: Any) -> Any:
            return await raw_fn(*args, **{**kwargs, **extra})

        return functools.wraps(raw_fn)(call_async)

    def call(*args: Any, **kwargs: Any) -> Any:
        return raw_fn(*args, **{**kwargs, **extra})

    return functools.wraps(raw_fn)(call)


@functools.cache
def reward_fn_for(path: str | None, name: str | None, reward_kwargs: str = "") -> ComputeScore:
    """The function a worker scores with, loaded once per process: the custom one when
    ``path`` is set (``reward_kwargs`` as sorted JSON, to be hashable), else
    ``default_compute_score``."""
    if not path:
        return default_compute_score
    if not name:
        raise AgentLoopError("custom_reward_function.path is set but .name is not")
    return load_custom_reward_fn(path, name, json.loads(reward_kwargs) if reward_kwargs else None)


def reward_fn_from_config(cfg: Config) -> ComputeScore:
    """The function the session workers score with under ``cfg`` (loaded once per process)."""
    spec = cfg.reward_function
    kwargs = json.dumps(spec.reward_kwargs, sort_keys=True) if spec.reward_kwargs else ""
    return reward_fn_for(spec.path, spec.name, kwargs)


def split_result(result: Any) -> tuple[float, dict[str, Any]]:
    """verl's naive reward manager: a dict keeps all its keys as extra info; a number is
    also ``acc``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise AgentLoopError(f"a reward dict needs 'score', got keys {sorted(result)}")
        return float(result["score"]), dict(result)
    return float(result), {"acc": float(result)}


def reward_extra_info_of(output: AgentLoopOutput) -> dict[str, Any] | None:
    """What the reward function returned besides the score, as verl stores it."""
    info = output.extra_fields.get("reward_extra_info")
    return dict(info) if isinstance(info, Mapping) else None


def reward_call_kwargs(
    output: AgentLoopOutput, row: Mapping[str, Any], tokenizer: Any
) -> dict[str, Any]:
    """The keyword arguments verl's naive reward manager passes for ``output``."""
    extra_info = dict(row.get("extra_info") or {})
    extra_info.setdefault("raw_prompt", row.get("prompt"))  # verl: extra_fields["raw_prompt"]
    extra_info.update((k, v) for k, v in output.extra_fields.items() if k != "reward_extra_info")
    extra_info["num_turns"] = output.num_turns
    extra_info["rollout_reward_scores"] = row.get("reward_scores") or {}
    return {
        "data_source": row.get("data_source") or "",  # verl always passes a string
        "solution_str": tokenizer.decode(output.response_ids, skip_special_tokens=True),
        "ground_truth": (row.get("reward_model") or {}).get("ground_truth"),
        "extra_info": extra_info,
    }


async def score_outputs_async(
    outputs: list[AgentLoopOutput],
    row: Mapping[str, Any],
    tokenizer: Any,
    compute_score: ComputeScore | None = None,
) -> None:
    """Score the LAST output in place and copy its score to the earlier ones (verl V1).

    An output whose ``reward_score`` the loop already set is not scored again; the copy goes
    only to earlier outputs without a score. A failing reward function raises an
    ``AgentLoopError`` naming the data source (the session fails with it).
    """
    if not outputs:
        return
    last = outputs[-1]
    if last.reward_score is None:
        fn = compute_score or default_compute_score
        start = time.perf_counter()
        kwargs = await asyncio.to_thread(reward_call_kwargs, last, row, tokenizer)
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(**kwargs)
            else:
                result = await asyncio.to_thread(functools.partial(fn, **kwargs))
                if inspect.isawaitable(result):  # a callable object or partial of an async def
                    result = await result
        except Exception as exc:  # the user's function: name what was being scored
            raise AgentLoopError(
                f"reward function {getattr(fn, '__name__', fn)!r} failed for data_source "
                f"{kwargs['data_source']!r}: {type(exc).__name__}: {exc}"
            ) from exc
        score, info = split_result(result)
        last.reward_score = score
        last.extra_fields["reward_extra_info"] = info
        last.metrics.compute_score += time.perf_counter() - start
    _copy_to_earlier(outputs)


def score_outputs(
    outputs: list[AgentLoopOutput],
    row: Mapping[str, Any],
    tokenizer: Any,
    compute_score: ComputeScore | None = None,
) -> None:
    """``score_outputs_async`` for callers without an event loop."""
    asyncio.run(score_outputs_async(outputs, row, tokenizer, compute_score))


def _copy_to_earlier(outputs: list[AgentLoopOutput]) -> None:
    last = outputs[-1]
    for earlier in outputs[:-1]:
        if earlier.reward_score is None:
            earlier.reward_score = last.reward_score
            if "reward_extra_info" in last.extra_fields:
                earlier.extra_fields["reward_extra_info"] = dict(
                    last.extra_fields["reward_extra_info"]
                )
