"""Reward: verl's default_compute_score table, the arithmetic scorer, custom reward
functions (path/name, keyword calls, async), and score_outputs (verl V1 semantics)."""

import pytest

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput
from rolloutbus.streams.reward import (
    ARITHMETIC_SOURCE,
    arithmetic_score,
    default_compute_score,
    get_reward_fn,
    register_reward,
    score_outputs,
    split_result,
)

ROW = {
    "data_source": ARITHMETIC_SOURCE,
    "prompt": [{"role": "user", "content": "计算 18 * 7"}],
    "reward_model": {"style": "rule", "ground_truth": "126"},
    "extra_info": {"index": 42},
}


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


def test_selection_by_data_source():
    @register_reward("test/always_half")
    def half(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "why": data_source}

    assert get_reward_fn("test/always_half") is half
    assert get_reward_fn(ARITHMETIC_SOURCE) is arithmetic_score
    assert get_reward_fn("openai/gsm8k") is default_compute_score  # verl's table
    assert default_compute_score("test/always_half", "x", "1") == {
        "score": 0.5,
        "why": "test/always_half",
    }


def test_scores_the_last_output_and_copies_to_earlier(tok):
    seen = []

    def spy(*, data_source, solution_str, ground_truth, extra_info):  # keywords, as verl
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
        ARITHMETIC_SOURCE,
        "The answer is 126.",
        "126",
    )  # special tokens skipped
    # verl's naive reward manager: the row's extra_info updated with the output's
    # extra_fields (tool_rewards ...) and raw_prompt, then num_turns, rollout_reward_scores
    assert info == {
        "index": 42,
        "raw_prompt": ROW["prompt"],
        "tool_rewards": [0.5],
        "num_turns": 4,
        "rollout_reward_scores": {},
    }
    assert [o.reward_score for o in outs] == [1.0, 1.0]
    assert outs[0].extra_fields["reward_extra_info"] == {"acc": 1.0}
    assert outs[1].metrics.compute_score > 0 and outs[0].metrics.compute_score == 0
    rm_scores = outs[1].as_dict()["rm_scores"].tolist()  # a tensor, as verl's as_dict
    assert rm_scores[-1] == 1.0 and set(rm_scores[:-1]) == {0.0}


def test_default_scorer_is_used_for_the_seed_row(tok):
    out = output(tok, "18 * 7 = 126")
    score_outputs([out], ROW, tok)
    assert out.reward_score == 1.0 and out.extra_fields["reward_extra_info"] == {"acc": 1.0}


def test_skips_outputs_the_loop_already_scored(tok):
    def boom(**kwargs):
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


# -- verl's table -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data_source, answer, truth, expected",
    [
        ("openai/gsm8k", "She has 72 apples.", "72", 0.0),  # no "#### ": verl scores 0
        ("openai/gsm8k", "3 + 69 = 72\n#### 72", "72", 1.0),
        ("openai/gsm8k", "#### 1,000", "1000", 1.0),
        ("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("HuggingFaceH4/MATH-500", "\\boxed{3}", "4", 0.0),
        ("searchR1_nq", "<answer>The Paris</answer>", {"target": ["paris"]}, 1.0),
    ],
)
def test_default_compute_score_follows_verls_table(data_source, answer, truth, expected):
    assert default_compute_score(data_source, answer, truth) == expected


def test_dapo_sources_return_verls_dict():
    got = default_compute_score("aime_2024", "Answer: 42", "42")
    assert got == {"score": 1.0, "acc": True, "pred": "42"}
    assert default_compute_score("math_dapo", "Answer: 41", "42")["score"] == -1.0


def test_unknown_and_unported_sources_raise_not_implemented_as_verl():
    with pytest.raises(NotImplementedError, match="data_source='nobody/knows'"):
        default_compute_score("nobody/knows", "1", "1")
    with pytest.raises(NotImplementedError, match="prime_math.*custom_reward_function"):
        default_compute_score("numina_olympiads", "1", "1")
    with pytest.raises(NotImplementedError, match="running the model's program"):
        default_compute_score("apps", "print(1)", "{}")


def test_a_failing_scorer_fails_the_session_naming_the_source(tok):
    from rolloutbus.errors import AgentLoopError

    row = {**ROW, "data_source": "nobody/knows"}
    with pytest.raises(AgentLoopError, match="'nobody/knows'.*NotImplementedError"):
        score_outputs([output(tok, "1")], row, tok)


# -- custom_reward_function ---------------------------------------------------------------


def _write(tmp_path, text):
    path = tmp_path / f"reward_{abs(hash(text))}.py"
    path.write_text(text)
    return path


def test_custom_reward_function_by_path_and_name_with_reward_kwargs(tmp_path, tok):
    from rolloutbus.streams.reward import load_custom_reward_fn

    path = _write(
        tmp_path,
        "def my_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return {'score': float(solution_str.strip() == ground_truth) + bonus, 'n': 1}\n",
    )
    fn = load_custom_reward_fn(str(path), "my_score", {"bonus": 0.5})
    out = output(tok, "126")
    score_outputs([out], ROW, tok, compute_score=fn)
    assert out.reward_score == 1.5 and out.extra_fields["reward_extra_info"] == {
        "score": 1.5,
        "n": 1,
    }
    assert load_custom_reward_fn(f"file://{path}", "my_score")(
        data_source="d", solution_str="1", ground_truth="1"
    ) == {"score": 1.0, "n": 1}


def test_custom_reward_function_from_a_package():
    from rolloutbus.streams.reward import load_custom_reward_fn

    fn = load_custom_reward_fn("pkg://rolloutbus.streams.reward.gsm8k", "compute_score")
    assert fn("#### 7", "7") == 1.0


def test_async_custom_reward_function_is_awaited(tmp_path, tok):
    from rolloutbus.streams.reward import load_custom_reward_fn

    path = _write(
        tmp_path,
        "import asyncio\n"
        "async def judge(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    await asyncio.sleep(0)\n"
        "    return scale * len(extra_info['tool_rewards'])\n",
    )
    fn = load_custom_reward_fn(str(path), "judge", {"scale": 0.25})
    out = output(tok, "x", extra_fields={"tool_rewards": [1.0, 0.0]})
    score_outputs([out], ROW, tok, compute_score=fn)
    assert out.reward_score == 0.5 and out.extra_fields["reward_extra_info"] == {"acc": 0.5}


def test_config_picks_the_custom_reward_function(tmp_path):
    from rolloutbus.config import Config
    from rolloutbus.streams.reward import reward_fn_from_config

    path = _write(tmp_path, "def f(**kw):\n    return 0.125\n")
    assert reward_fn_from_config(Config()) is default_compute_score
    cfg = Config.model_validate({"reward": {"custom_reward_function": {"path": str(path)}}})
    assert cfg.reward_function.name == "compute_score"  # verl 0.9.1's default name
    legacy = Config.model_validate(  # verl's legacy top-level key wins when it is set
        {
            "custom_reward_function": {"path": str(path), "name": "f"},
            "reward": {"custom_reward_function": {"path": "elsewhere.py"}},
        }
    )
    assert reward_fn_from_config(legacy)(data_source="d", solution_str="", ground_truth="") == 0.125
