"""verl's V0 trainer on the bus: ``BusAgentLoopManagerV0``'s output equals verl 0.9.1's own.

The comparison runs in the verl side environment (tests/programs/verl_v0_parity.py): for the
same agent-loop outputs, verl's ``_agent_loop_postprocess`` + ``_postprocess`` + the
manager's timing against the bus's trajectory records (encoded, decoded, sessions out of
order) through ``rows_in_input_order``, ``v0_output`` and ``to_data_proto``; key by key,
dtype by dtype, shape by shape, value by value, ``meta_info`` and its timing included.
"""

from __future__ import annotations

import pytest

from tests.source_tree import ROOT

PROGRAM = ROOT / "tests" / "programs" / "verl_v0_parity.py"

pytestmark = pytest.mark.verl

V0_BATCH_KEYS = [
    "attention_mask",
    "input_ids",
    "position_ids",
    "prompts",
    "response_mask",
    "responses",
]
TIMING_FIGURES = 18  # 4 figures x min/max/mean, 4 of the slowest row, its two lengths


@pytest.fixture(scope="module")
def parity(run_in_verl) -> dict:
    return run_in_verl(str(PROGRAM))


def test_scored_groups_match_verl_with_its_reward_loop(parity):
    case = parity["scored_with_reward_workers"]
    assert case["differences"] == []
    assert case["batch"] == sorted([*V0_BATCH_KEYS, "rm_scores", "rollout_log_probs"])
    assert {"__num_turns__", "multi_modal_inputs", "raw_prompt", "acc", "score"} <= set(
        case["non_tensor_batch"]
    )
    assert case["meta_info"] == ["reward_extra_keys", "timing"]
    assert case["timing"] == TIMING_FIGURES


def test_unscored_groups_match_verl_without_a_reward_loop(parity):
    """No reward-loop workers: verl merges the input's columns, and nothing is scored."""
    case = parity["unscored_without_reward_workers"]
    assert case["differences"] == []
    assert case["batch"] == sorted(V0_BATCH_KEYS)
    assert {"uid", "data_source", "reward_model", "index"} <= set(case["non_tensor_batch"])
    assert case["meta_info"] == ["timing"]


def test_a_full_and_an_empty_response_match_verl(parity):
    case = parity["edge_lengths"]
    assert case["differences"] == []
    assert "rm_scores" in case["batch"]
