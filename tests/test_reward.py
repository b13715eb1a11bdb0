"""Reward: the arithmetic scorer, selection by data_source, and score_outputs (verl V1
semantics)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures.scripted_server import qwen3_tokenizer  # noqa: E402

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput  # noqa: E402
from rolloutbus.streams.agent_loop.reward import (  # noqa: E402
    arithmetic_score,
    get_reward_fn,
    register_reward,
    score_outputs,
    split_result,
)

ROW = {
    "data_source": "my/math",
    "prompt": [{"role": "user", "content": "计算 18 * 7"}],
    "reward_model": {"style": "rule", "ground_truth": "126"},
    "extra_info": {"index": 42},
}


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def output(tok, text, **fields):
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return AgentLoopOutput(
        prompt_ids=[1],
        response_ids=ids,
        response_mask=[1] * len(ids),
        metrics=AgentLoopMetrics(),
        **fields,
    )


@pytest.mark.parametrize(
    "answer, score",
    [
        ("18 * 7 = 126", 1.0),
        ("The answer is 126.", 1.0),
        ("126.0", 1.0),
        ("about 125", 0.0),
        ("no idea", 0.0),
        ("1,260 / 10 = 126", 1.0),
        ("126 then 127", 0.0),
    ],
)
def test_arithmetic_score(answer, score):
    assert arithmetic_score("my/math", answer, "126", None) == score


def test_split_result():
    assert split_result(1.0) == (1.0, {"acc": 1.0})
    assert split_result({"score": 0.5, "pred": "x"}) == (0.5, {"score": 0.5, "pred": "x"})


def test_selection_by_data_source_with_default():
    @register_reward("test/always_half")
    def half(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "why": data_source}

    assert get_reward_fn("test/always_half") is half
    assert get_reward_fn("anything/else") is arithmetic_score
    assert get_reward_fn(None) is arithmetic_score


def test_scores_the_last_output_and_copies_to_earlier(tok):
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return arithmetic_score(data_source, solution_str, ground_truth, extra_info)

    outs = [
        output(tok, "wrong 5"),
        output(tok, "The answer is 126.", num_turns=4, extra_fields={"tool_rewards": [0.5]}),
    ]
    score_outputs(outs, ROW, tok, compute_score=spy)
    assert len(seen) == 1
    data_source, solution, truth, info = seen[0]
    assert (data_source, solution, truth) == (
        "my/math",
        "The answer is 126.",
        "126",
    )  # special tokens skipped
    assert (
        info["index"] == 42
        and info["num_turns"] == 4
        and info["tool_extra_fields"]["tool_rewards"] == [0.5]
    )
    assert [o.reward_score for o in outs] == [1.0, 1.0]
    assert outs[0].extra_fields["reward_extra_info"] == {"acc": 1.0}
    assert outs[1].metrics.compute_score > 0 and outs[0].metrics.compute_score == 0
    assert outs[1].as_dict()["rm_scores"][-1] == 1.0 and set(
        outs[1].as_dict()["rm_scores"][:-1]
    ) == {0.0}


def test_default_scorer_is_used_for_the_seed_row(tok):
    out = output(tok, "18 * 7 = 126")
    score_outputs([out], ROW, tok)
    assert out.reward_score == 1.0 and out.extra_fields["reward_extra_info"] == {"acc": 1.0}


def test_skips_outputs_the_loop_already_scored(tok):
    def boom(*args):
        raise AssertionError("must not be called")

    outs = [
        output(tok, "a", reward_score=0.25),
        output(tok, "b"),
        output(tok, "c", reward_score=0.75),
    ]
    score_outputs(outs, ROW, tok, compute_score=boom)
    assert [o.reward_score for o in outs] == [0.25, 0.75, 0.75]


def test_empty_outputs_is_a_no_op(tok):
    score_outputs([], ROW, tok)
