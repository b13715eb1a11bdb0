"""The consume and replay tables keep one trajectory per line whatever text the model
sampled: a random model's text holds line separators and terminal escapes."""

from __future__ import annotations

from rolloutbus.consumers.report import _format_row, one_line

AWKWARD = "a\nb\r\nc\u2028d\u2029e\x85f\x1b[31mg\x0bh\x1ci\u200bj\té ü 中"


def test_awkward_text_stays_on_one_line_and_escapes_what_a_terminal_would_act_on():
    line = one_line(AWKWARD)
    assert line.splitlines() == [line]
    assert "\x1b" not in line and "\\x1b[31m" in line
    assert "\\u2028" in line and "\\u200b" in line and "\\t" in line
    assert line.startswith("a b  c") and line.endswith("é ü 中")  # text as it is


def test_an_error_cell_with_a_line_separator_keeps_the_row_on_one_line():
    row = {
        "key": "u_0_0",
        "agent_name": "tool_agent",
        "status": "failed",
        "prompt_len": 3,
        "response_len": 0,
        "response_mask": [],
        "rollout_log_probs": None,
        "num_turns": 1,
        "reward_score": None,
        "responses": [],
        "error": f"tool said {AWKWARD}",
    }
    formatted = _format_row(row, tokenizer=None)
    assert formatted.splitlines() == [formatted]
    assert "error: tool said a b" in formatted
