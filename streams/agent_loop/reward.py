"""Rule-based rewards, scored in the session worker as verl's streaming reward loop does.

A reward function has verl's signature ``compute_score(data_source, solution_str,
ground_truth, extra_info) -> float | dict``. A dict carries ``"score"`` plus extra info;
a float is also recorded as ``acc``. Functions are chosen by ``data_source``, with a
default: the arithmetic scorer (last number of the answer equals the ground truth).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from rolloutbus.errors import AgentLoopError
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.streams.plugins import import_object

ComputeScore = Callable[[str, str, Any, dict[str, Any] | None], float | dict[str, Any]]

_reward_registry: dict[str, ComputeScore] = {}
DEFAULT_REWARD = "default"

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def register_reward(*data_sources: str) -> Callable[[ComputeScore], ComputeScore]:
    """Decorator: score rows of these data sources with the function (``"default"``: the
    rest)."""

    def decorator(fn: ComputeScore) -> ComputeScore:
        for source in data_sources:
            _reward_registry[source] = fn
        return fn

    return decorator


def load_reward_fn(path: str, *data_sources: str) -> ComputeScore:
    """Import a ``compute_score`` function by path (verl's ``custom_reward_function``).

    ``path`` is ``package.module.fn``, ``package.module:fn`` or ``path/to/file.py:fn``.
    With ``data_sources`` (``"default"`` for the rest) it is also registered for them.
    """
    fn = import_object(path, what="reward function", kind="callable")
    return register_reward(*data_sources)(fn)


def get_reward_fn(data_source: str | None) -> ComputeScore:
    fn = _reward_registry.get(data_source or "") or _reward_registry.get(DEFAULT_REWARD)
    if fn is None:
        raise AgentLoopError(f"no reward function for data_source {data_source!r} and no default")
    return fn


def last_number(text: str) -> float | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


@register_reward(DEFAULT_REWARD)
def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """1.0 when the last number in the answer equals the ground truth, else 0.0
    ("计算 18 * 7" → "126")."""
    answer = last_number(solution_str)
    expected = last_number(str(ground_truth))
    if answer is None or expected is None:
        return 0.0
    return 1.0 if abs(answer - expected) <= 1e-9 * max(1.0, abs(expected)) else 0.0


def split_result(result: float | int | dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """verl's naive reward manager: a dict keeps all its keys as extra info; a float is also
    ``acc``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise AgentLoopError(f"a reward dict needs 'score', got keys {sorted(result)}")
        return float(result["score"]), dict(result)
    return float(result), {"acc": float(result)}


def score_outputs(
    outputs: list[AgentLoopOutput],
    row: Mapping[str, Any],
    tokenizer: Any,
    compute_score: ComputeScore | None = None,
) -> None:
    """Score the LAST output in place and copy its score to the earlier ones (verl V1).

    ``solution_str`` is the decoded response (all response tokens, observations included,
    special tokens skipped), as verl's naive reward manager decodes it. An output whose
    ``reward_score`` the loop already set is not scored again; the copy goes only to
    earlier outputs without a score. The scoring time goes to ``metrics.compute_score``.
    """
    if not outputs:
        return
    last = outputs[-1]
    if last.reward_score is None:
        start = time.perf_counter()
        data_source = row.get("data_source") or ""  # verl always passes a string
        fn = compute_score or get_reward_fn(data_source)
        solution_str = tokenizer.decode(last.response_ids, skip_special_tokens=True)
        ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        extra_info = {
            **dict(row.get("extra_info") or {}),
            "num_turns": last.num_turns,
            "tool_extra_fields": {
                k: v for k, v in last.extra_fields.items() if k != "reward_extra_info"
            },
        }
        score, info = split_result(fn(data_source, solution_str, ground_truth, extra_info))
        last.reward_score = score
        last.extra_fields["reward_extra_info"] = info
        last.metrics.compute_score += time.perf_counter() - start
    for earlier in outputs[:-1]:
        if earlier.reward_score is None:
            earlier.reward_score = last.reward_score
            if "reward_extra_info" in last.extra_fields:
                earlier.extra_fields["reward_extra_info"] = dict(
                    last.extra_fields["reward_extra_info"]
                )
