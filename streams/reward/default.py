"""``default_compute_score``: verl 0.9.1's dispatch by ``data_source``, plus this project's
own registered sources.

The verl table (``verl/utils/reward_score/__init__.py``), branch for branch:

=====================================================================  ======================
data_source                                                            scorer
=====================================================================  ======================
``openai/gsm8k``                                                       ``gsm8k`` (``#### 72``)
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,            ``math_reward``
``HuggingFaceH4/MATH-500``
``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``            ``math_dapo``
``searchR1_nq`` ... ``searchR1_bamboogle``                             ``search_r1_like_qa_em``
``numina_*`` (prime_math), ``hiyouga/geometry3k`` (geo3k),             not ported: see below
``codecontests``/``apps``/``codeforces``/``taco`` (code execution)
anything else                                                          ``NotImplementedError``
=====================================================================  ======================

verl's MATH branch uses ``math_reward``; its math-verify scorer is a commented-out option
there, so it is not used here either. The sources that are not ported raise
``NotImplementedError`` too, with the reason: ``prime_math`` needs ``pylatexenc`` and
sympy's ANTLR LaTeX parser, ``geo3k`` needs ``mathruler`` (neither is a dependency of this
project), and the code sources run the model's program in a sandbox (a sandbox-fusion
server or verl's ``prime_code`` subprocess runner). Use ``custom_reward_function`` to score
them (it can import verl's own scorer).

A result is returned as verl returns it: a dict as it is, a number as ``float``, a
sequence's first element as ``float``.

Rollout Bus addition: ``register_reward(*data_sources)`` adds a source (the bundled
arithmetic dataset's ``rolloutbus/arithmetic`` is one); verl's table wins for its own
names, and ``"default"`` registers a fallback for every source no one knows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rolloutbus.streams.reward import gsm8k, math_dapo, math_reward, search_r1_like_qa_em

ComputeScore = Callable[..., Any]

DEFAULT_REWARD = "default"  # register_reward's name for "every source no one else scores"
ARITHMETIC_SOURCE = "rolloutbus/arithmetic"  # the bundled dataset (producers.datasets)

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every "aime*"
PRIME_MATH_SOURCES = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
GEO3K_SOURCES = ("hiyouga/geometry3k",)
SEARCH_R1_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)
_NOT_PORTED = {
    **dict.fromkeys(
        PRIME_MATH_SOURCES,
        "verl scores it with prime_math, which needs pylatexenc and sympy's ANTLR LaTeX parser",
    ),
    **dict.fromkeys(GEO3K_SOURCES, "verl scores it with geo3k, which needs mathruler"),
    **dict.fromkeys(
        CODE_SOURCES,
        "verl scores it by running the model's program (sandbox fusion or prime_code)",
    ),
}

_registry: dict[str, ComputeScore] = {}


def register_reward(*data_sources: str) -> Callable[[ComputeScore], ComputeScore]:
    """Decorator: score rows of these data sources with the function (``"default"``: every
    source that neither verl's table nor another registration knows)."""

    def decorator(fn: ComputeScore) -> ComputeScore:
        for source in data_sources:
            _registry[source] = fn
        return fn

    return decorator


def get_reward_fn(data_source: str | None) -> ComputeScore:
    """The function that scores ``data_source``: the registered one (or the ``"default"``
    registration) for a source outside verl's table, else ``default_compute_score``."""
    source = data_source or ""
    if not is_verl_source(source):
        fn = _registry.get(source) or _registry.get(DEFAULT_REWARD)
        if fn is not None:
            return fn
    return default_compute_score


def is_verl_source(data_source: str) -> bool:
    """Whether verl 0.9.1's own table has a branch for this source (ported or not)."""
    return (
        data_source == "openai/gsm8k"
        or data_source in MATH_SOURCES
        or data_source in DAPO_SOURCES
        or data_source.startswith("aime")
        or data_source in SEARCH_R1_SOURCES
        or data_source in _NOT_PORTED
    )


def unscored_reason(data_source: str) -> str | None:
    """Why ``default_compute_score`` would raise NotImplementedError for ``data_source``
    (None: it scores it), so the publisher refuses such a row before it costs a rollout."""
    if data_source in _NOT_PORTED:
        return _NOT_PORTED[data_source]
    if is_verl_source(data_source) or data_source in _registry or DEFAULT_REWARD in _registry:
        return None
    return "neither verl's table nor a registered scorer (register_reward) knows it"


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score ``solution_str`` as verl 0.9.1's ``default_compute_score`` does.

    ``**kwargs`` takes what verl's reward managers may pass besides (``sandbox_fusion_url``,
    ``reward_router_address`` ...), unused by the ported scorers, as in verl.
    """
    res: Any
    if data_source == "openai/gsm8k":
        res = gsm8k.compute_score(solution_str, ground_truth)
    elif data_source in MATH_SOURCES:
        res = math_reward.compute_score(solution_str, ground_truth)
    elif data_source in DAPO_SOURCES or data_source.startswith("aime"):
        res = math_dapo.compute_score(solution_str, ground_truth)
    elif data_source in SEARCH_R1_SOURCES:
        res = search_r1_like_qa_em.compute_score(solution_str, ground_truth)
    elif data_source in _NOT_PORTED:
        raise NotImplementedError(
            f"Reward function is not implemented here for {data_source=}: "
            f"{_NOT_PORTED[data_source]}; set custom_reward_function to score it"
        )
    elif (fn := _registry.get(data_source) or _registry.get(DEFAULT_REWARD)) is not None:
        res = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
    else:  # verl's words, so a log search for verl's message finds ours too
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    return _as_verl_returns(res)


def _as_verl_returns(res: Any) -> float | dict[str, Any]:
    if isinstance(res, dict):
        return res
    if isinstance(res, int | float | bool):
        return float(res)
    return float(res[0])


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


@register_reward(ARITHMETIC_SOURCE)
def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """The bundled arithmetic dataset's scorer: 1.0 when the last number in the answer
    equals the ground truth, else 0.0 ("What is 18 * 7?" → "126")."""
    answer = last_number(solution_str)
    expected = last_number(str(ground_truth))
    if answer is None or expected is None:
        return 0.0
    return 1.0 if abs(answer - expected) <= 1e-9 * max(1.0, abs(expected)) else 0.0
