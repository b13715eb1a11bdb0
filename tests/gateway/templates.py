"""Chat templates that are TEST DOUBLES: real templates changed where a test needs another
model family's behaviour and that family's tokenizer is not at hand.

- ``open_think_template``: Qwen3's template with the generation prompt that Qwen3-thinking-
  2507's, QwQ's (and, in its own tokens, DeepSeek-R1's) template has: it opens the think
  (``<|im_start|>assistant\\n<think>\\n``), so the model samples its reasoning first, with no
  open marker of its own, and closes it with ``</think>``.
"""

from __future__ import annotations

from typing import Any

QWEN3_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' }}"
OPEN_THINK_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n<think>\\n' }}"


def open_think_template(tokenizer: Any) -> str:
    """Qwen3's chat template (``tokenizer``'s) whose generation prompt opens the think."""
    template = str(tokenizer.chat_template)
    assert template.count(QWEN3_GENERATION_PROMPT) == 1, "not Qwen3's chat template"
    return template.replace(QWEN3_GENERATION_PROMPT, OPEN_THINK_GENERATION_PROMPT)
