"""The learning-curve task's reward (``custom_reward_function``, verl's signature): short,
finished answers. Dense: 1 for an answer of one word, falling linearly to 0 at
``MAX_WORDS`` words; SmolLM2-135M-Instruct starts around a sentence or two per answer."""

from __future__ import annotations

from typing import Any

MAX_WORDS = 24  # words; a two-sentence answer scores ~0


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> float:
    words = len(solution_str.split())
    if words == 0:
        return 0.0  # an empty answer is no answer
    return max(0.0, 1.0 - (words - 1) / (MAX_WORDS - 1))
