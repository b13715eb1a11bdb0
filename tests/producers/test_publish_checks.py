"""Every row is checked before its group is published (no broker here): a registered agent
loop, a scorer for its data_source, its prompt's length; ``publish --dry-run`` runs the same
checks with nothing running and says, per reason, what it would refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutbus.config import Config
from rolloutbus.errors import ConfigError
from rolloutbus.producers.datasets import make_arithmetic_rows
from rolloutbus.producers.publish import build_group, check_file
from rolloutbus.producers.row_checks import (
    NO_AGENT_LOOP,
    NO_SCORER,
    PROMPT_TOO_LONG,
    TRUNCATED_NOTE,
    RowChecker,
    RowProblem,
)
from rolloutbus.streams.reward import register_reward
from tests.helpers import free_port, run_cli, unique_name

PUBLISH_CLI_S = 120.0  # seconds; the dry run loads the tokenizer for the prompt-length check


def _row(**extra):
    return {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], **extra}


def _scored(data_source: str, **extra):
    return _row(data_source=data_source, reward_model={"ground_truth": "4"}, **extra)


def _write(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_broker_config(tmp_path: Path, extra: str = "") -> Path:
    """A config whose broker address answers nothing: a dry run must not need one."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"kafka: {{bootstrap_servers: '127.0.0.1:{free_port()}'}}\n{extra}")
    return cfg


def test_dry_run_catches_an_unscored_data_source_with_no_broker_running(tmp_path):
    good = make_arithmetic_rows(2, seed=1, tool_fraction=0.5)
    rows = [
        *good,
        _scored("my/unscored_source"),  # no scorer anywhere: verl raises after generating
        _scored("codecontests"),  # verl's table, not ported here: needs a sandbox
        _row(data_source="my/unscored_source"),  # no reward_model: not scored, publishable
        _scored("openai/gsm8k", agent_name="no_such_loop"),
    ]
    dataset = _write(rows, tmp_path / "rows.jsonl")
    result = run_cli(
        "publish",
        str(dataset),
        "--dry-run",
        "--config",
        str(_no_broker_config(tmp_path)),
        timeout=PUBLISH_CLI_S,
    )
    assert result.returncode == 3, result.stderr[-2000:]  # some rows refused
    assert f"{dataset}: 6 rows: 3 would be published, 3 refused" in result.stderr
    assert len(result.stdout.split()) == 3  # the uids a publish would print
    summary = result.stderr.splitlines()
    [scorer_line] = [line for line in summary if line.endswith(f"refused: {NO_SCORER}")]
    assert scorer_line.split()[0] == "2"
    assert any(
        line.startswith("rows.jsonl:3: ") and "'my/unscored_source'" in line for line in summary
    )
    [loop_line] = [line for line in summary if line.endswith(f"refused: {NO_AGENT_LOOP}")]
    assert loop_line.split()[0] == "1"
    assert any(line.startswith("rows.jsonl:6: ") and "'no_such_loop'" in line for line in summary)
    assert "cannot reach Kafka" not in result.stderr and "Traceback" not in result.stderr

    clean = _write([*good, _row(data_source="my/unscored_source")], tmp_path / "clean.jsonl")
    result = run_cli(
        "publish",
        str(clean),
        "--dry-run",
        "--config",
        str(_no_broker_config(tmp_path)),
        timeout=PUBLISH_CLI_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "3 would be published, 0 refused" in result.stderr


def test_validate_is_a_deprecated_alias_of_val(tmp_path):
    train = _write([_row()], tmp_path / "train.jsonl")
    val = _write([_row(), _row()], tmp_path / "val.jsonl")
    extra = f"data: {{train_files: ['{train}'], val_files: ['{val}']}}\n"
    cfg = _no_broker_config(tmp_path, extra)
    new = run_cli("publish", "--val", "--dry-run", "--config", str(cfg), timeout=PUBLISH_CLI_S)
    old = run_cli("publish", "--validate", "--dry-run", "--config", str(cfg), timeout=PUBLISH_CLI_S)
    assert new.returncode == old.returncode == 0, old.stderr[-2000:]
    assert new.stdout == old.stdout and f"{val}: 2 rows" in new.stderr
    assert "--validate is deprecated: use --val" in old.stderr
    assert "is deprecated" not in new.stderr


def test_a_scorer_may_come_from_verl_a_registration_or_custom_reward_function(tmp_path):
    checker = RowChecker(Config())
    checker.check(build_group(Config(), _scored("openai/gsm8k")))  # verl's table
    source = unique_name("mine/source")
    with pytest.raises(RowProblem, match=source) as refused:
        checker.check(build_group(Config(), _scored(source)))
    assert refused.value.kind == NO_SCORER
    register_reward(source)(lambda **_: 1.0)
    checker.check(build_group(Config(), _scored(source)))  # registered now

    scorer = tmp_path / "my_reward.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, **kw):\n    return 1.0\n"
    )
    custom = Config.model_validate(
        {"custom_reward_function": {"path": str(scorer), "name": "compute_score"}}
    )
    RowChecker(custom).check(build_group(custom, _scored("codecontests")))
    wrong = Config.model_validate({"custom_reward_function": {"path": str(scorer), "name": "nope"}})
    with pytest.raises(ConfigError, match="custom_reward_function"):
        RowChecker(wrong)


def test_agent_loops_from_the_config_file_count_as_registered(tmp_path):
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: my_loop\n  _target_: some.module.MyLoop\n")
    cfg = Config.model_validate({"rollout": {"agent": {"agent_loop_config_path": str(loops)}}})
    RowChecker(cfg).check(build_group(cfg, _row(agent_name="my_loop")))
    with pytest.raises(RowProblem, match="agent_name is null"):
        RowChecker(cfg).check(build_group(cfg, _row(agent_name=None)))
    bad_default = Config.model_validate({"rollout": {"agent": {"default_agent_loop": "nope"}}})
    with pytest.raises(RowProblem, match="rollout.agent.default_agent_loop") as refused:
        RowChecker(bad_default).check(build_group(bad_default, _row()))
    assert refused.value.kind == NO_AGENT_LOOP


def test_prompt_length_truncates_text_with_a_note_and_refuses_multimodal(tmp_path):
    cfg = Config.model_validate({"rollout": {"prompt_length": 64}})
    checker = RowChecker(cfg)
    assert checker.check(build_group(cfg, _row())) == []
    long = _row(prompt=[{"role": "user", "content": "seven " * 100}])
    assert checker.check(build_group(cfg, long)) == [TRUNCATED_NOTE]
    image = _row(
        prompt=[{"role": "user", "content": "<image> " + "seven " * 100}], images=["a.png"]
    )
    with pytest.raises(RowProblem, match="cannot be truncated") as refused:
        checker.check(build_group(cfg, image))
    assert refused.value.kind == PROMPT_TOO_LONG

    dataset = _write([_row(), long, image], tmp_path / "rows.jsonl")
    report = check_file(cfg, dataset)
    assert (report.published, report.dead_lettered) == (2, 1)
    assert report.notes == {TRUNCATED_NOTE: 1} and report.problems == {PROMPT_TOO_LONG: 1}
