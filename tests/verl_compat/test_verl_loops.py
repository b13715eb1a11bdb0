"""verl's own agent-loop classes, unchanged, run as Rollout Bus sessions through Kafka and
produce the same trajectories as our built-ins on the same inputs.

verl 0.9.1's ``SingleTurnAgentLoop`` and ``ToolAgentLoop`` import on CPU once verl and its
imports are on the path (verl itself with ``--no-deps``, plus ray, hydra-core, omegaconf,
tensordict, datasets<5, pandas, fastapi, opentelemetry-api and a few small ones; torch and
transformers come from the project's venv). The side environment is found at
``$ROLLOUTBUS_VERL_SITE`` (``os.pathsep``-separated folders) or built by
``ops/contract/setup_verl_env.sh``; without either, or when the agent-loop modules do not
import there, the tests skip and say why. The run happens in a subprocess
(``tests/programs/verl_parity_run.py``) so nothing of verl enters this test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rolloutbus.config import KafkaConfig
from rolloutbus.kafka.admin import delete_topics, ensure_topics
from rolloutbus.topics import Topics
from tests.helpers import unique_name
from tests.source_tree import ROOT

RUNNER = ROOT / "tests" / "programs" / "verl_parity_run.py"
EXIT_VERL_DOES_NOT_IMPORT = 3  # verl_parity_run.py: the agent-loop modules do not import

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def parity(verl_site: Path, kafka_bootstrap: str, tmp_path_factory) -> dict:
    """Both loops' trajectories of every case, as read back from the turns topic."""
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=unique_name("v"))
    ensure_topics(kafka)
    out = tmp_path_factory.mktemp("verl") / "parity.json"
    keep = os.environ.get("ROLLOUTBUS_VERL_PARITY_OUT")  # keep the readings to look at them
    if keep:
        out = Path(keep)
    try:
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, str(RUNNER), kafka_bootstrap, kafka.topic_prefix, str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(verl_site)])},
            cwd=ROOT,
            timeout=600,
        )
        if run.returncode == EXIT_VERL_DOES_NOT_IMPORT:
            last = (run.stderr.strip().splitlines() or ["?"])[-1]
            pytest.skip(f"side env {verl_site}: {last}")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        print(f"verl parity run: {time.monotonic() - started:.1f} s")
    finally:
        delete_topics(kafka, Topics.from_config(kafka).all())
    return json.loads(out.read_text())


def _sessions(parity: dict, prefix: str) -> list[dict]:
    return [t for uid, ts in sorted(parity.items()) if uid.startswith(prefix) for t in ts]


def _comparable(t: dict) -> dict:
    """A trajectory without what names it and the engine's per-turn request id (fresh
    for every turn, in verl too)."""
    extra = {k: v for k, v in t["extra_fields"].items() if k != "engine_request_id"}
    return {k: v for k, v in t.items() if k not in ("key", "agent_name")} | {"extra_fields": extra}


def test_verl_single_turn_agent_loop_matches_ours(parity):
    ours = _sessions(parity, "s-ours")
    theirs = _sessions(parity, "s-verl")
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs, strict=True):
        assert a["status"] == b["status"] != "failed", (a["error"], b["error"])
        assert a["responses"] and a["response_mask"] == [1] * len(a["responses"])
        assert _comparable(a) == _comparable(b)
    assert ours[0]["responses"] != ours[1]["responses"]  # two seeds, two samples
    assert theirs[0]["agent_name"] == "verl_single_turn_agent"
    assert ours[0]["extra_fields"]["turn_scores"] == [] == theirs[0]["extra_fields"]["turn_scores"]


def test_verl_tool_agent_loop_matches_ours(parity):
    ours = _sessions(parity, "t-ours")
    theirs = _sessions(parity, "t-verl")
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs, strict=True):
        assert _comparable(a) == _comparable(b)
        mask = a["response_mask"]
        assert a["num_turns"] == 6  # 2 tool turns + 3 assistant turns + 1
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1
        assert a["extra_fields"]["tool_rewards"] == [0.0]  # the function tool's None → 0.0
        assert a["reward_score"] == 1.0
    assert parity["_meta"]["events"] > 0


def test_verl_tool_parsers_read_model_output_as_ours(parity):
    """All nine of verl's formats over one table of outputs (well-formed, malformed,
    unterminated, typed by the tool schema): the same content and the same calls."""
    readings = parity["_parsers"]
    assert set(readings["cases"]) == {
        "hermes",
        "qwen3_coder",
        "gpt-oss",
        "glm",
        "seed",
        "minimax",
        "kimi",
        "deepseek_v4",
        "gemma4",
    }
    for fmt, theirs, ours in zip(
        readings["cases"], readings["verl"], readings["ours"], strict=True
    ):
        assert ours == theirs, fmt
    calls = [call for _, found in readings["ours"] for call in found]
    assert len(calls) >= 12  # the table really exercises calls, not only empty readings


def test_both_loops_render_with_the_data_chat_template_kwargs(parity):
    """data.apply_chat_template_kwargs ({enable_thinking: false}) reaches our loops and,
    through the verl adapter, verl's: the equal prompts above carry Qwen3's empty think."""
    for t in _sessions(parity, "s-") + _sessions(parity, "t-"):
        assert t["prompt_text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), t["key"]


def test_routed_experts_reach_both_loops_trajectories_aligned(parity):
    """Routing replay on a MoE engine (the scripted one, a test double): the last turn's
    experts, one row per token fed through the model, in our trajectories and verl's."""
    from rolloutbus.replica.scripted import scripted_expert

    layers, top_k = 2, 2  # verl_parity_run.ROUTED_EXPERTS
    for t in _sessions(parity, "t-"):
        fed = (t["prompts"] + t["responses"])[:-1]  # the last sampled token is never fed
        expected = [
            [[scripted_expert(x, i, k) for k in range(top_k)] for i in range(layers)] for x in fed
        ]
        assert t["routed_experts"] == expected, t["key"]


def test_a_verl_style_subclass_runs_on_verls_loop_and_ours_alike(parity):
    """tests/plugins/verl_style_tool_loop.py overrides _build_assistant_message and
    _call_tool(tool_call, tools_kwargs, agent_data): unchanged on verl 0.9.1's ToolAgentLoop,
    ported by its imports onto ours, the same trajectory."""
    [ours] = _sessions(parity, "a-ours")
    [theirs] = _sessions(parity, "a-verl")
    assert ours["status"] == theirs["status"] == "completed", (ours["error"], theirs["error"])
    assert _comparable(ours) == _comparable(theirs)
    assert ours["extra_fields"]["assistant_messages"] == 3
    assert ours["extra_fields"]["tools_called"] == ["calculator", "lookup"]
    assert ours["response_text"].count("<tool_response>\n[checked] ") == 2
