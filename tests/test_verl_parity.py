"""Parity with the real verl 0.9.1 package, on the same inputs: its reward scorers against
``rolloutbus.streams.reward.default_compute_score``, its ``AgentLoopOutput``/
``AgentLoopMetrics``/``TokenOutput`` defaults against ``rolloutbus.schemas.agent_loop``,
its rollout config keys against ours (read or listed as ignored), and its tool-response
truncation against our tool agent's.

verl runs in one subprocess (tests/fixtures/verl_parity_probe.py) with the side environment
from ops/contract/setup_verl_env.sh (or ``$ROLLOUTBUS_VERL_SITE``) on its PYTHONPATH, so
nothing of verl enters this process. Without the environment the tests skip and say why.
The tool parsers and verl's own loop classes are compared in tests/test_verl_loops.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from rolloutbus.config import VERL_KEYS_ACCEPTED_NOT_USED, VERL_KEYS_IGNORED, Config
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop.tool_agent import ToolAgentLoop
from rolloutbus.streams.reward import default_compute_score
from rolloutbus.verl_keys import ignored_reason, read_as, verl_sections

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "ops" / "contract" / "setup_verl_env.sh"
PROBE = ROOT / "tests" / "fixtures" / "verl_parity_probe.py"

pytestmark = pytest.mark.verl

LONG = "The model thought for a long time. " * 12  # > 300 characters: the scorers clip
# (data_source, solution_str, ground_truth): every branch of verl's table that is ported
SCORE_TABLE: list[tuple[str, str, Any]] = [
    ("openai/gsm8k", "She has 72 apples.", "72"),
    ("openai/gsm8k", "3 + 69 = 72\n#### 72", "72"),
    ("openai/gsm8k", "#### 1,234", "1234"),
    ("openai/gsm8k", "#### $72", "72"),
    ("openai/gsm8k", "#### 72.0", "72"),
    ("openai/gsm8k", "#### -5", "-5"),
    ("openai/gsm8k", "#### 72\n" + LONG, "72"),
    ("openai/gsm8k", "#### 7 then #### 8", "8"),
    ("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "\\frac12"),
    ("lighteval/MATH", "\\boxed{0.5}", "\\frac{1}{2}"),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed 5$ done", "5"),
    ("HuggingFaceH4/MATH-500", "\\fbox{7}", "7"),
    ("HuggingFaceH4/MATH-500", "no box at all", "7"),
    ("HuggingFaceH4/MATH-500", "\\boxed{x = 3}", "3"),
    ("HuggingFaceH4/MATH-500", "\\boxed{10\\%}", "10"),
    ("math_dapo", "Answer: 42", "42"),
    ("math", "Answer: \\frac{1}{2}", "\\frac{1}{2}"),
    ("math_dapo_reasoning", "Answer: 12 dollars", "12"),
    ("aime2024", "so \\boxed{7}", "7"),
    ("aime_2025", "nothing", "7"),
    ("math_dapo", LONG + "Answer: 41", "42"),
    ("searchR1_nq", "<answer>The Paris</answer>", {"target": ["paris"]}),
    ("searchR1_hotpotqa", "<answer>London</answer>", {"target": ["Paris", "Lyon"]}),
    ("searchR1_bamboogle", "no tags", {"target": ["x"]}),
    ("searchR1_musique", "<answer>x</answer>" * 11, {"target": ["x"]}),
    ("nobody/knows", "1", "1"),
]
# verl scores these with modules not ported here; ours raise NotImplementedError saying why
NOT_PORTED_TABLE: list[tuple[str, str, Any]] = [
    ("numina_cn_k12", "\\boxed{2}", "2"),
    ("hiyouga/geometry3k", "<think>x</think>\\boxed{2}", "2"),
]
TRUNCATIONS: list[tuple[str, int, str]] = [
    (side, limit, text)
    for side in ("left", "right", "middle")
    for limit, text in ((5, "0123456789"), (7, "abcdefghijklmnop"), (10, "short"), (4, "abcd"))
]


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    """verl's answers on every case of this module (one subprocess)."""
    site = os.environ.get("ROLLOUTBUS_VERL_SITE")
    if not site:
        env = {**os.environ, "PYTHON": sys.executable}
        built = subprocess.run(
            ["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=900
        )
        if built.returncode != 0:
            pytest.skip(f"the verl side environment did not build: {built.stderr[-2000:]}")
        site = built.stdout.strip().splitlines()[-1]
    cases = {
        "scores": [list(c) for c in SCORE_TABLE + NOT_PORTED_TABLE],
        "truncations": [list(c) for c in TRUNCATIONS],
    }
    run = subprocess.run(
        [sys.executable, str(PROBE)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": site},
        cwd="/tmp",  # the checkout's folders must not shadow anything
        timeout=600,
    )
    if run.returncode != 0 and "ModuleNotFoundError" in run.stderr:
        pytest.skip(f"verl does not import in {site}: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _ours(data_source: str, solution: str, truth: Any) -> Any:
    try:
        return default_compute_score(data_source, solution, truth)
    except NotImplementedError as exc:
        return {"NotImplementedError": str(exc)}


def test_default_compute_score_agrees_with_verls_scorers(verl):
    theirs = verl["scores"][: len(SCORE_TABLE)]
    for case, their in zip(SCORE_TABLE, theirs, strict=True):
        assert _ours(*case) == their, case
    # the table is not trivially all-zero: both right and wrong answers are in it
    assert {0.0, 1.0} <= {s for s in theirs if isinstance(s, float)}
    assert theirs[0] == 0.0 and theirs[1] == 1.0  # "She has 72 apples." vs "#### 72"


def test_unported_sources_are_named_where_verl_scores_them(verl):
    theirs = verl["scores"][len(SCORE_TABLE) :]
    for case, their in zip(NOT_PORTED_TABLE, theirs, strict=True):
        assert not isinstance(their, dict) or "NotImplementedError" not in their  # verl scores
        with pytest.raises(NotImplementedError, match="custom_reward_function"):
            default_compute_score(*case)


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    out = {}
    for name, field in model.model_fields.items():
        if field.is_required():
            out[name] = "<required>"
        else:
            value = field.get_default(call_default_factory=True)
            out[name] = value.model_dump() if isinstance(value, BaseModel) else value
    return out


@pytest.mark.parametrize("model", [AgentLoopMetrics, AgentLoopOutput, TokenOutput])
def test_agent_loop_models_have_verls_fields_and_defaults(verl, model):
    theirs = verl["defaults"][model.__name__]
    ours = _defaults(model)
    assert {k: ours.get(k, "<missing>") for k in theirs} == theirs
    assert set(ours) == set(theirs), f"fields verl does not have: {set(ours) - set(theirs)}"


def _our_keys() -> set[str]:
    keys: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            keys.add(prefix + name)
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                walk(kind, f"{prefix}{name}.")

    walk(Config, "")
    return keys


def _ignored(key: str) -> bool:
    return ignored_reason(key) is not None


def _placed(key: str, ours: set[str]) -> bool:
    """Read as one of our keys, under one, ignored, or a verl section above such keys."""
    return key in ours or read_as(key) is not None or _ignored(key) or key in verl_sections()


@pytest.mark.parametrize("source", ["yaml", "dataclasses"])
def test_every_verl_rollout_key_is_read_or_listed_as_ignored(verl, source):
    ours = _our_keys()
    unplaced = [
        key
        for key in verl["keys"][source]
        if key.rsplit(".", 1)[-1] != "_target_" and not _placed(key, ours)
    ]
    assert unplaced == [], "verl keys that would be rejected as unknown"
    both = [key for key in VERL_KEYS_IGNORED if key in ours]
    assert both == [], "a key cannot be both read and ignored"


def test_ignored_keys_all_exist_in_verl(verl):
    verl_keys = set(verl["keys"]["yaml"]) | set(verl["keys"]["dataclasses"])
    assert sorted(set(VERL_KEYS_IGNORED) - verl_keys) == []
    assert sorted(set(VERL_KEYS_ACCEPTED_NOT_USED) - verl_keys) == []


def test_tool_response_truncation_matches_verls(verl):
    for (side, limit, text), theirs in zip(TRUNCATIONS, verl["truncations"], strict=True):
        loop = ToolAgentLoop.__new__(ToolAgentLoop)  # only the truncation's attributes
        loop.max_tool_response_length = limit
        loop.tool_response_truncate_side = side
        assert loop.truncate_tool_text(text) == theirs, (side, limit, text)
    assert verl["truncations"][0] == "(truncated)...56789"  # PR #6313: left keeps the tail
