"""End to end on real parts: broker, replica over HTTP (tiny Qwen3, real tokenizer),
the Faust session worker and the transactional replay buffer as separate processes."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from confluent_kafka import Producer

from rolloutbus.config import Config, with_overrides
from rolloutbus.consumers.log_replay import replay_turns
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from rolloutbus.producers.publish import PromptPublisher, build_group
from rolloutbus.schemas.trajectories import (
    TrajectoryStatus,
    batch_to_trajectories,
    decode_trajectory_batch,
)
from rolloutbus.schemas.turns import GroupSettings, decode_turn_event
from rolloutbus.topics import Topics, uid_of_key
from tests.helpers import free_port, unique_name
from tests.pipeline import (
    agent_loop_registry,
    dead_letters,
    pipeline_config,
    pipeline_running,
    read_topic,
    receive_groups,
)

pytestmark = pytest.mark.kafka  # worker processes on the test broker

N = 2


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("pipeline")
    registry_yaml = agent_loop_registry(
        tmp / "agent_loops.yaml",
        {
            "my_single_turn": "my_agent_loop.MySingleTurnLoop",
            "over_budget": "bad_loops.OverBudgetLoop",
        },
    )
    cfg = pipeline_config(
        kafka_bootstrap,
        "p",
        rollout={
            "n": N,
            "response_length": 16,
            "agent": {"agent_loop_config_path": str(registry_yaml)},
        },
        sessions={"metrics_port": free_port()},
        replay_buffer={"transactional_id": unique_name("rbtx"), "metrics_port": free_port()},
        monitoring={"progress_log_s": 2},
    )
    with pipeline_running(cfg, tmp / "config.yaml") as logs:
        yield cfg, tmp, logs


@pytest.fixture(scope="module")
def logged_work(pipeline):
    """Groups the replay tests need in the log whatever else ran before them: plain ones
    (random tiny-qwen3 runs to the 16-token limit: truncated) and one of the over-budget
    loop (failed records), in two waves, so that groups start at distinct times."""
    cfg, tmp, _ = pipeline
    plain = make_arithmetic_rows(3, seed=5, tool_fraction=0)
    over = [dict(r, agent_name="over_budget") for r in make_arithmetic_rows(1, seed=6)]
    for wave, rows in enumerate((plain[:2], plain[2:] + over)):
        report = _publish(cfg, rows, tmp / f"logged{wave}.jsonl")
        receive_groups(cfg, set(report.uids))
    return pipeline


def _publish(cfg: Config, rows: list[dict], path: Path):
    return PromptPublisher(cfg).publish_file(write_jsonl(rows, path), progress=False)


def test_prompt_groups_become_complete_trajectory_groups(pipeline):
    cfg, tmp, _ = pipeline
    rows = make_arithmetic_rows(3, seed=1, tool_fraction=0.0)
    report = _publish(cfg, rows, tmp / "plain.jsonl")
    groups = receive_groups(cfg, set(report.uids))
    tok = load_tokenizer(cfg.model)
    for uid, group in groups.items():
        assert len(group) == N
        rows_out = group.batch.to_pylist()
        assert sorted(r["key"] for r in rows_out) == [f"{uid}_{i}_0" for i in range(N)]
        for r in rows_out:
            assert r["status"] in ("completed", "truncated")
            assert r["agent_name"] == "single_turn_agent" and r["num_turns"] == 2
            assert 0 < len(r["responses"]) <= 16
            assert len(r["responses"]) == len(r["response_mask"]) == len(r["rollout_log_probs"])
            assert set(r["response_mask"]) == {1}
            assert all(lp <= 0.0 for lp in r["rollout_log_probs"])
            assert (
                r["prompt_len"] <= 64
                and r["prompts"][-3:] == tok.encode("<|im_start|>assistant\n")[-3:]
            )
            assert r["num_preempted"] == -1  # the embedded replica does not report preemptions
            assert r["reward_score"] in (0.0, 1.0)  # scored by the arithmetic rule
    # each key exactly once on the topic
    keys = [m.key().decode() for m in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories)]
    mine = [k for k in keys if k.split("_")[0] in groups]
    assert len(mine) == len(set(mine)) == N * len(groups)


def test_seed_custom_loop_registered_through_yaml_runs_end_to_end(pipeline):
    cfg, tmp, _ = pipeline
    rows = [
        dict(r, agent_name="my_single_turn")
        for r in make_arithmetic_rows(2, seed=2, tool_fraction=0)
    ]
    report = _publish(cfg, rows, tmp / "custom.jsonl")
    groups = receive_groups(cfg, set(report.uids))
    for group in groups.values():
        for r in group.batch.to_pylist():
            assert r["agent_name"] == "my_single_turn" and r["status"] != "failed", r["error"]
            assert len(r["responses"]) == len(r["rollout_log_probs"]) > 0


def test_bad_input_goes_to_dead_letters_and_counts_add_up(pipeline):
    cfg, tmp, _ = pipeline
    good = make_arithmetic_rows(1, seed=3, tool_fraction=0)[0]
    long_prompt = dict(good, prompt=[{"role": "user", "content": "seven " * 400}])
    path = tmp / "bad.jsonl"
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"data_source": "x", "reward_model": {"ground_truth": "1"}}),  # no prompt
        json.dumps(dict(good, agent_name=None)),
        json.dumps(dict(good, agent_name="no_such_loop")),
        json.dumps(long_prompt),
    ]
    path.write_text("\n".join(lines) + "\n")
    before = len(dead_letters(cfg))
    publisher = PromptPublisher(cfg)
    report = publisher.publish_file(path, progress=False)
    # the rows whose agent loop is unknown are refused at publish, before any rollout
    assert (report.published, report.dead_lettered) == (2, 4)
    assert report.problems["agent loop not registered"] == 2
    # a producer that skips those checks: the session worker records the failure
    unchecked = [build_group(cfg, dict(good, agent_name=name)) for name in (None, "no_such_loop")]
    for group in unchecked:
        publisher.publish_group(group)
    publisher.flush()
    groups = receive_groups(cfg, {*(report.uids or []), *(g.uid for g in unchecked)})
    by_agent: dict = {}
    for g in groups.values():
        rows_out = g.batch.to_pylist()
        assert len(rows_out) == N  # failed sessions are explicit records, never a short group
        by_agent.setdefault(rows_out[0]["agent_name"], []).append(rows_out)
    by_agent = {name: [r for rows in groups_ for r in rows] for name, groups_ in by_agent.items()}
    assert all(
        r["status"] == "failed" and "no_such_loop" in r["error"] for r in by_agent["no_such_loop"]
    )
    null_rows = by_agent[None]
    assert all(r["status"] == "failed" and "agent_name" in r["error"] for r in null_rows)
    plain = by_agent["single_turn_agent"]
    assert (
        sorted(r["prompt_len"] for r in plain)[-N:] == [64] * N
    )  # the long prompt, left-truncated
    assert all(r["status"] != "failed" for r in plain)
    letters = dead_letters(cfg)[before:]
    reasons = " | ".join(d["reason"] for d in letters)
    assert "not valid JSON" in reasons and "prompt" in reasons
    assert "no_such_loop" in reasons and "agent_name is null" in reasons
    # in = out + dlq: 6 rows read; 2 groups out, 4 rows dead-lettered (plus the 2 unchecked)
    assert report.read == len(groups) - len(unchecked) + report.dead_lettered


def test_invariant_breaking_loop_yields_failed_records_and_dead_letters(pipeline):
    cfg, tmp, _ = pipeline
    rows = [
        dict(r, agent_name="over_budget") for r in make_arithmetic_rows(1, seed=4, tool_fraction=0)
    ]
    report = _publish(cfg, rows, tmp / "over.jsonl")
    [group] = receive_groups(cfg, set(report.uids)).values()
    for r in group.batch.to_pylist():
        assert r["status"] == "failed"
        assert "over response_length 16" in r["error"]
        assert r["response_len"] > 16  # the tokens are kept for inspection
    letters = [d for d in dead_letters(cfg) if group.uid in d["source"]]
    assert len(letters) == N and all("over response_length" in d["reason"] for d in letters)


def test_replaying_the_turn_log_yields_byte_identical_trajectories(logged_work):
    """Replaying the turn log yields byte-identical trajectories, on everything this module
    logged (``logged_work`` and the tests before)."""
    cfg, tmp, _ = logged_work
    live = {
        m.key().decode(): m.value()
        for m in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories)
    }
    replayed = replay_turns(cfg)
    assert live, "nothing to replay: no trajectory was released"
    assert set(replayed.records) == set(live)
    assert all(replayed.records[k] == live[k] for k in live)  # byte for byte
    assert replayed.open_groups == []
    # keeping only the batches (as `replay --out` does): the same rows, no model per trajectory
    lean = replay_turns(cfg, keep_trajectories=False)
    assert lean.trajectories == [] and lean.records == {} and lean.released == len(live)
    assert pa.Table.from_batches(lean.batches).equals(pa.Table.from_batches(replayed.batches))
    sunk: list[pa.RecordBatch] = []  # handed over as released (replay --out's file), not kept
    streamed = replay_turns(cfg, keep_trajectories=False, batch_sink=sunk.append)
    assert streamed.batches == [] and pa.Table.from_batches(sunk).equals(
        pa.Table.from_batches(replayed.batches)
    )
    # the same through the command line, into an Arrow file
    out = tmp / "replay.arrow"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rolloutbus.cli",
            "replay",
            "--out",
            str(out),
            "--config",
            str(tmp / "config.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{len(live)} trajectories" in done.stderr
    with pa.memory_map(str(out)) as source:
        written = pa.ipc.open_file(source).read_all()
    released = pa.Table.from_batches(
        [decode_trajectory_batch(replayed.records[k]) for k in replayed.records]
    )
    assert written.num_rows == len(live) and written.equals(released)  # the released rows


def test_inspect_gives_each_output_the_status_consume_gets(logged_work):
    """Issue 30 item 3: a response that fills rollout.response_length is ``truncated`` in
    ``inspect`` as in the released trajectory, although the engine's stop was ``completed``."""
    cfg, tmp, _ = logged_work
    released: dict[str, list[tuple[int, int, str]]] = {}
    for m in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories):
        for t in batch_to_trajectories(decode_trajectory_batch(m.value())):
            if t.status != TrajectoryStatus.FAILED:
                released.setdefault(t.uid, []).append(
                    (t.session_id, t.output_index, t.status.value)
                )
    uid = next(u for u, rows in released.items() if any(r[2] == "truncated" for r in rows))
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "rolloutbus.cli",
            "inspect",
            uid,
            "--config",
            str(tmp / "config.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    statuses = re.findall(r"output \d+: (\w+)  reward", shown.stdout)
    assert sorted(statuses) == sorted(r[2] for r in released[uid]), shown.stdout[-3000:]
    assert "engine stop completed" in shown.stdout  # the engine's own reason, named as such


def test_a_replay_under_other_lengths_is_byte_identical_and_selects_by_uid_and_time(logged_work):
    """The log alone decides: replayed under configs whose rollout lengths are shorter and
    longer than the workers' (64/16), the records are the live ones byte for byte: the
    truncated ones, and the over-budget loop's failed ones. ``--uid`` and ``--since``/
    ``--until`` select groups."""
    cfg, tmp, _ = logged_work
    topics = Topics.from_config(cfg.kafka)
    live = {m.key().decode(): m.value() for m in read_topic(cfg, topics.trajectories)}
    statuses = {t.status for v in live.values() for t in _decoded(v)}
    assert {TrajectoryStatus.TRUNCATED, TrajectoryStatus.FAILED} <= statuses  # both at stake
    for lengths in ((8, 4), (8192, 4096)):
        other = with_overrides(
            cfg, {"rollout.prompt_length": lengths[0], "rollout.response_length": lengths[1]}
        )
        replayed = replay_turns(other)
        assert replayed.records == live  # every key, byte for byte
        assert replayed.groups_without_settings == 0
    # what the workers ran with is in the log
    heads = [
        (m, decode_turn_event(m.value()))
        for m in read_topic(cfg, topics.turns)
        if b'"group_started"' in m.value()
    ]
    for _, started in heads:
        assert started.settings == GroupSettings(
            prompt_length=64, response_length=16, calculate_log_probs=True
        )
    # by uid, on the command line too, with a config override that changes nothing
    uid = uid_of_key(sorted(live)[0])
    mine = {k: v for k, v in live.items() if uid_of_key(k) == uid}
    by_uid = replay_turns(cfg, uids=[uid, "nosuchuid"])
    assert by_uid.records == mine and by_uid.missing_uids == ["nosuchuid"]
    out = tmp / "one.arrow"
    done = _replay_cli(tmp, "--uid", uid, "--out", str(out), "rollout.response_length=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not in the turn log range" not in done.stderr
    with pa.memory_map(str(out)) as source:
        rows = pa.ipc.open_file(source).read_all().to_pylist()
    assert sorted((r["key"], r["status"]) for r in rows) == sorted(
        (t.key, t.status.value) for v in mine.values() for t in _decoded(v)
    )
    # by the time groups started (the Kafka timestamps of their group_started records)
    stamps = sorted(m.timestamp()[1] for m, _ in heads)
    since, until = stamps[1] / 1000, stamps[-2] / 1000
    picked = {
        started.uid
        for m, started in heads
        if int(since * 1000) <= m.timestamp()[1] < int(until * 1000)
    }
    by_time = replay_turns(cfg, since=since, until=until)
    assert picked and {uid_of_key(k) for k in by_time.records} == picked & {
        uid_of_key(k) for k in live
    }
    assert all(by_time.records[k] == live[k] for k in by_time.records)


def _decoded(record: bytes) -> list:
    return batch_to_trajectories(decode_trajectory_batch(record))


def _replay_cli(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "replay", "--config", str(tmp / "config.yaml")]
        + list(argv),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _progress(log: Path, name: str, what: str) -> int:
    """The sum of ``what`` over the progress lines of ``name`` in a process's log."""
    pattern = rf"{name}: .*?(\d+) {what} \("
    return sum(int(n) for line in log.read_text().splitlines() for n in re.findall(pattern, line))


def test_workers_serve_prometheus_metrics_of_the_work_done(pipeline):
    cfg, _, logs = pipeline
    sessions = httpx.get(f"http://127.0.0.1:{cfg.sessions.metrics_port}/metrics", timeout=5).text
    buffer = httpx.get(f"http://127.0.0.1:{cfg.replay_buffer.metrics_port}/metrics", timeout=5).text

    def value(text: str, series: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series)
        )

    assert value(sessions, 'rolloutbus_sessions_tokens_total{kind="sampled"}') > 0
    assert value(sessions, 'rolloutbus_sessions_total{outcome="finished"}') > 0
    assert value(sessions, "rolloutbus_client_requests_total{") > 0  # the router's view
    assert value(buffer, "rolloutbus_replay_buffer_groups_released_total") > 0
    assert value(buffer, 'rolloutbus_replay_buffer_trajectories_total{status="failed"}') > 0
    # the progress lines (monitoring.progress_log_s: 2) say the same, at most a line behind
    time.sleep(2.5)
    sampled = value(sessions, 'rolloutbus_sessions_tokens_total{kind="sampled"}')
    assert 0 < _progress(logs["sessions"], "sessions", "tokens sampled") <= sampled
    released = value(buffer, "rolloutbus_replay_buffer_groups_released_total")
    assert 0 < _progress(logs["rb"], "replay buffer", "groups") <= released


def test_malformed_prompt_group_on_the_topic_is_dead_lettered_and_the_worker_goes_on(pipeline):
    cfg, tmp, _ = pipeline
    producer = Producer(cfg.kafka.client_settings())
    producer.produce(
        Topics.from_config(cfg.kafka).prompts, key=b"junk", value=b'{"uid": 5}', partition=0
    )
    assert producer.flush(10) == 0
    deadline = time.monotonic() + 60
    letters = []
    while time.monotonic() < deadline and not letters:
        letters = [
            d for d in dead_letters(cfg) if d["stage"] == "sessions" and "schema" in d["reason"]
        ]
        time.sleep(0.5)
    assert letters and base64.b64decode(letters[0]["original_b64"]) == b'{"uid": 5}'
    # the worker is still alive and serving
    report = _publish(cfg, make_arithmetic_rows(1, seed=9, tool_fraction=0), tmp / "after.jsonl")
    assert len(receive_groups(cfg, set(report.uids))) == 1
