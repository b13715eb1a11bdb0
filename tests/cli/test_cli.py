"""The command line as a user meets it: --help everywhere, exit codes, the main job."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from confluent_kafka.admin import AdminClient

from rolloutbus.cli import build_parser
from rolloutbus.cli.data import log_time
from rolloutbus.config import Config
from rolloutbus.config_loading import split_overrides
from tests.helpers import free_port, run_cli, unique_name
from tests.pipeline import write_config

SUBCOMMANDS = [
    "broker",
    "topics",
    "replica",
    "sessions",
    "replay-buffer",
    "publish",
    "dispatch",
    "weight-sync",
    "consume",
    "train",
    "replay",
    "dataset",
    "demo",
    "lag-exporter",
    "top",
    "inspect",
    "traces",
    "config",
    "gateway",
]


def test_every_subcommand_is_listed_and_has_help():
    parser = build_parser()
    listed = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    assert sorted(listed) == sorted(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([name, "--help"])
        assert exit_.value.code == 0


def test_every_subcommands_help_says_what_it_does():
    """``rolloutbus X --help`` opens with what X does, as the command list says it (before,
    18 of 19 showed only usage and options)."""
    parser = build_parser()
    listed = parser._subparsers._group_actions[0]  # noqa: SLF001
    summaries = {choice.dest: choice.help for choice in listed._choices_actions}  # noqa: SLF001
    for name in SUBCOMMANDS:
        sub = listed.choices[name]
        assert sub.description, f"rolloutbus {name} --help says nothing of what it does"
        opening = " ".join(sub.format_help().split("\n\n")[1].split())
        assert opening.lower().startswith(summaries[name][:40].lower()) or name == "publish"


def test_unknown_config_key_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n: 2\n  respone_length: 10\n")
    result = run_cli("topics", "--config", str(bad))
    assert result.returncode == 2
    assert "unknown config key 'rollout.respone_length'" in result.stderr
    assert result.stdout == ""


def test_config_prints_the_resolved_config_with_key_value_overrides_anywhere(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor_rollout_ref:\n  rollout: {n: 2, response_length: 64}\n")
    result = run_cli("config", "rollout.response_length=32", "-c", str(path), "kafka.partitions=2")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert (printed["rollout"]["n"], printed["rollout"]["response_length"]) == (2, 32)
    assert printed["kafka"]["partitions"] == 2
    # verl's names too, and the command line wins over the environment
    env = {"ROLLOUTBUS__ROLLOUT__N": "4"}
    result = run_cli("config", "-c", str(path), "actor_rollout_ref.rollout.n=8", env=env)
    assert yaml.safe_load(result.stdout)["rollout"]["n"] == 8
    assert yaml.safe_load(run_cli("config", "-c", str(path), env=env).stdout)["rollout"]["n"] == 4


def test_an_override_never_lands_in_a_positional_and_other_tokens_are_usage_errors():
    overrides, rest = split_overrides(
        ["publish", "rollout.n=8", "rows.jsonl", "+trainer.logger=[file]", "--", "a.b=c"]
    )
    assert overrides == ["rollout.n=8", "+trainer.logger=[file]"]
    args = build_parser().parse_args(rest[:-2])
    assert args.dataset == Path("rows.jsonl")
    unknown = run_cli("config", "rollout.n=8", "bogus")
    assert unknown.returncode == 2 and "unrecognized arguments: bogus" in unknown.stderr
    typo = run_cli("config", "rollout.nn=8")
    assert typo.returncode == 2 and "did you mean `n`?" in typo.stderr and typo.stdout == ""


def test_replay_times_are_epoch_seconds_iso_or_ago_and_anything_else_is_a_usage_error():
    now = time.time()
    assert log_time("1700000000.5") == 1700000000.5
    assert log_time("2026-12-01T10:00:00+00:00") == 1796119200.0
    assert now - 7200 - 5 < log_time("-2h") <= time.time() - 7200
    assert log_time("-30m") < log_time("-30s")
    with pytest.raises(argparse.ArgumentTypeError, match="not a time"):
        log_time("yesterday")
    bad = run_cli("replay", "--since", "yesterday")
    assert bad.returncode == 2 and "not a time" in bad.stderr


def test_dataset_command_writes_verl_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    result = run_cli("dataset", str(out), "--count", "4", "--tool-fraction", "1.0")
    assert result.returncode == 0 and result.stdout.strip() == str(out)
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and all('"agent_name": "tool_agent"' in line for line in lines)


@pytest.mark.slow
def test_demo_main_job_prints_trajectories_and_writes_arrow(kafka_bootstrap, tmp_path):
    port = free_port()
    cfg = Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("d"),
                "partitions": 2,
            },
            "model": {"name": "tiny-qwen3"},
            "replica_server": {"port": port},
            "replicas": {"urls": [f"http://127.0.0.1:{port}"]},
            "rollout": {"n": 2, "response_length": 12},
            "sessions": {"app_id": unique_name("demo")},
            "replay_buffer": {"group_id": unique_name("rb"), "transactional_id": unique_name("tx")},
        }
    )
    out = tmp_path / "traj.arrow"
    result = run_cli(
        "demo",
        "--rows",
        "2",
        "--n",
        "2",
        "--out",
        str(out),
        "--config",
        str(write_config(cfg, tmp_path / "c.yaml")),
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table_rows = [
        line for line in result.stdout.splitlines() if line[:32].isalnum() and "_" in line[:40]
    ]
    assert len(table_rows) == 4  # 2 groups x n=2
    with pa.memory_map(str(out)) as source:
        table = pa.ipc.open_file(source).read_all()
    assert table.num_rows == 4
    assert "equal lengths" in result.stderr
    # the demo's records are apart: a `rolloutbus train` on the configured topics sees none
    prefix = cfg.kafka.topic_prefix
    assert f"[demo] records go to topics {prefix}-demo.*" in result.stderr
    topics = AdminClient(cfg.kafka.client_settings()).list_topics(timeout=30).topics
    assert f"{prefix}-demo.trajectories" in topics
    assert not [t for t in topics if t.startswith(f"{prefix}.")]


def test_missing_dataset_and_unreachable_broker_are_clear_errors(tmp_path):
    result = run_cli("publish", str(tmp_path / "nope.jsonl"))
    assert result.returncode == 2 and "dataset not found" in result.stderr
    assert "Traceback" not in result.stderr
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"kafka: {{bootstrap_servers: '127.0.0.1:{free_port()}'}}\n")
    result = run_cli("publish", str(rows), "--config", str(cfg), timeout=60)
    assert result.returncode == 1 and "cannot reach Kafka" in result.stderr
    assert "rolloutbus broker start" in result.stderr and "Traceback" not in result.stderr


def test_publish_without_a_dataset_reads_data_train_files(kafka_bootstrap, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"question": [{"role": "user", "content": "two"}]}\n'
        '{"question": [{"role": "user", "content": "three"}]}\n'
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {train_files: []}\n")
    result = run_cli("publish", "--config", str(cfg))
    assert result.returncode == 2 and "give a DATASET or set data.train_files" in result.stderr
    cfg.write_text(f"data: {{train_files: [{rows}, {tmp_path / 'missing.jsonl'}]}}\n")
    result = run_cli("publish", "--config", str(cfg))
    assert (
        result.returncode == 2 and "dataset not found" in result.stderr
    )  # checked before publishing
    config = Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("p"),
                "partitions": 1,
            },
            "data": {"train_files": [str(rows)], "prompt_key": "question"},
        }
    )
    path = write_config(config, tmp_path / "real.yaml")
    assert run_cli("topics", "--config", str(path)).returncode == 0
    result = run_cli("publish", "-q", "--config", str(path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.split()) == 2  # one uid per row of the configured file
    assert f"{rows}: read 2 rows: 2 published" in result.stderr


def test_publish_again_prints_the_same_uids_and_a_new_epoch_new_ones(kafka_bootstrap, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": [{"role": "user", "content": "two"}]}\n'
        '{"prompt": [{"role": "user", "content": "three"}]}\n'
    )
    config = Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("p"),
                "partitions": 1,
            }
        }
    )
    path = write_config(config, tmp_path / "c.yaml")
    assert run_cli("topics", "--config", str(path)).returncode == 0
    runs = [
        run_cli("publish", str(rows), "-q", *extra, "--config", str(path))
        for extra in ([], [], ["--epoch", "1"])
    ]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr[-2000:]
    first, again, next_epoch = (run.stdout.split() for run in runs)
    assert first == again and len(first) == 2 and not set(first) & set(next_epoch)


def test_replay_since_takes_a_relative_time_as_its_own_argument(kafka_bootstrap, tmp_path):
    """Issue 30 item 6: ``--since -2h`` (the documented form) works, as ``--since=-2h`` does."""
    config = Config.model_validate(
        {"kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": unique_name("p")}}
    )
    path = write_config(config, tmp_path / "c.yaml")
    assert run_cli("topics", "--config", str(path)).returncode == 0
    for argv in (["--since", "-2h", "--until", "-1s"], ["--since=-2h"]):
        result = run_cli("replay", *argv, "--config", str(path), timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "expected one argument" not in result.stderr


def test_every_help_gives_the_defaults():
    """Issue 30 item 11: ``--help`` shows each option's default (``consume --timeout``,
    ``dataset --count``)."""
    consume = run_cli("consume", "--help")
    assert consume.returncode == 0
    assert re.search(r"--timeout TIMEOUT .*\(default: no limit\)", " ".join(consume.stdout.split()))
    dataset = run_cli("dataset", "--help")
    assert re.search(r"--count COUNT .*\(default: 8\)", " ".join(dataset.stdout.split()))


def test_where_tiny_qwen3_is_offered_it_says_its_weights_are_random():
    """Issue 30 item 15: ``--model tiny-qwen3`` is offered with what it is."""
    shown = " ".join(run_cli("replica", "serve", "--help").stdout.split())
    assert "tiny-qwen3 (random weights: junk text, every reward 0" in shown


def test_a_bare_rolloutbus_prints_the_help_and_exits_0():
    """Issue 30 polish: no command is a request for help (kubectl's convention)."""
    bare = run_cli()
    assert bare.returncode == 0 and bare.stderr == ""
    assert bare.stdout.startswith("usage: rolloutbus") and "inspect" in bare.stdout
