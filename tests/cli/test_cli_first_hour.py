"""Issue 30, a newcomer's first hour: what the commands say and when they stop, through the
CLI as a user runs it, on a private pipeline (its own topics, ports and groups on the test
broker; the random tiny-qwen3 replica).

One test per item: ``consume`` stops at the end of the topic unless ``--follow``;
tiny-qwen3 says it is random where it is offered and when the replica starts; ``sessions
run`` writes no terminal escape to a stdout that is a file; the workers print a stop line;
``publish`` prints each refused row once, with its exit codes; ``replay`` fills its text
column; no warning names the deprecated ``--validate``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from tests.helpers import free_port, run_cli, unique_name
from tests.pipeline import receive_groups, running, stop, wait_http_ok, write_config

GROUPS = 2  # prompt groups published to the pipeline
N = 2  # sessions per group
CLI_S = 180.0  # seconds for one command (torch imports on busy shared cores)
FOLLOW_WAIT_S = 5.0  # seconds a --follow consume must keep running after the last group
STOP_S = 30.0  # seconds a worker may take to stop on SIGINT/SIGTERM here (busy cores)


class Pipeline:
    """A replica, a session worker and a replay buffer, each a ``rolloutbus`` process whose
    stdout and stderr go to files of their own."""

    def __init__(self, cfg: Config, folder: Path):
        self.cfg, self.folder = cfg, folder
        self.config = write_config(cfg, folder / "config.yaml")
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.out(name).open("wb") as out, self.err(name).open("wb") as err:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "rolloutbus.cli", *argv, "-c", str(self.config)],
                stdout=out,
                stderr=err,
                env=env,
            )
        return self.procs[name]

    def out(self, name: str) -> Path:
        return self.folder / f"{name}.out"

    def err(self, name: str) -> Path:
        return self.folder / f"{name}.err"

    def stopped(self, name: str, sig: signal.Signals) -> str:
        """Send ``sig`` to the service; its stderr once it has exited."""
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=STOP_S)
        return self.err(name).read_text()


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    folder = tmp_path_factory.mktemp("first_hour")
    port = free_port()
    cfg = Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("fh"),
                "partitions": 2,
            },
            "model": {"name": "tiny-qwen3"},
            "replica_server": {"port": port},
            "replicas": {"urls": [f"http://127.0.0.1:{port}"], "request_timeout_s": 120},
            "rollout": {"n": N, "prompt_length": 64, "response_length": 12},
            "sessions": {"app_id": unique_name("sessions"), "data_dir": str(folder / "faust")},
            "replay_buffer": {"group_id": unique_name("rb"), "transactional_id": unique_name("tx")},
        }
    )
    ensure_topics(cfg.kafka)
    stack = Pipeline(cfg, folder)
    replica = stack.start("replica", "replica", "serve")
    with running([replica]):
        wait_http_ok(f"http://127.0.0.1:{port}/health", replica, stack.err("replica"))
        workers = [stack.start("sessions", "sessions", "run")]
        workers.append(stack.start("replay-buffer", "replay-buffer", "run"))
        with running(workers):
            rows = write_jsonl(
                make_arithmetic_rows(GROUPS, seed=3, tool_fraction=0), folder / "r.jsonl"
            )
            published = run_cli("publish", str(rows), "-q", "-c", str(stack.config), timeout=CLI_S)
            assert published.returncode == 0, published.stderr[-3000:]
            uids = set(published.stdout.split())
            assert len(uids) == GROUPS
            receive_groups(cfg, uids)  # in a group of its own: takes nothing from consume
            yield stack


def _received(stderr: str) -> list[str]:
    return [line.split()[2] for line in stderr.splitlines() if line.startswith("received group")]


def test_consume_stops_at_the_end_of_the_topic_unless_follow(pipeline: Pipeline):
    """Item 1 (was item 11): no silent 30 s wait; ``--follow`` keeps waiting (kcat's -e)."""
    done = run_cli("consume", "-c", str(pipeline.config), timeout=CLI_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_received(done.stderr)) == GROUPS, done.stderr[-3000:]
    help_text = " ".join(run_cli("consume", "--help").stdout.split())
    assert "--follow" in help_text and "(default: no limit)" in help_text

    follow = pipeline.start("consume-follow", "consume", "--follow")
    deadline = time.monotonic() + CLI_S
    while len(_received(pipeline.err("consume-follow").read_text())) < GROUPS:
        assert follow.poll() is None, pipeline.err("consume-follow").read_text()[-3000:]
        assert time.monotonic() < deadline, "consume --follow received no groups"
        time.sleep(0.5)
    time.sleep(FOLLOW_WAIT_S)  # at the end of the topic, and it still waits for more
    assert follow.poll() is None, pipeline.err("consume-follow").read_text()[-3000:]
    stderr = pipeline.stopped("consume-follow", signal.SIGINT)
    assert follow.returncode == 0, stderr[-3000:]
    assert f"stopped after {GROUPS} groups" in stderr
    table = pipeline.out("consume-follow").read_text().splitlines()[2:]
    assert len(table) == GROUPS * N  # what it received is printed, as without --follow


def test_tiny_qwen3_says_it_is_random_where_offered_and_at_the_replica_start(pipeline: Pipeline):
    """Item 2 (was item 15): ``--help``, the catalog's error, and one start line."""
    offered = " ".join(run_cli("replica", "serve", "--help").stdout.split())
    assert "tiny-qwen3 (random weights: junk text, every reward 0" in offered
    unknown = run_cli(
        "replica", "serve", "--model", "tiny-qwen", "--port", str(free_port()), timeout=CLI_S
    )
    assert unknown.returncode == 2, unknown.stderr[-3000:]
    assert "tiny-qwen3: random weights: junk text, every reward 0" in unknown.stderr
    started = pipeline.err("replica").read_text()
    [line] = [line for line in started.splitlines() if "replica ready on" in line]
    assert "model=tiny-qwen3 (random weights: junk text, every reward 0" in line
    assert started.count("random weights") == 1


def test_workers_print_a_stop_line_of_what_they_did(pipeline: Pipeline):
    """Item 4: one line in words on stderr at SIGINT (sessions) and SIGTERM (replay buffer)."""
    sessions = pipeline.stopped("sessions", signal.SIGINT)
    assert pipeline.procs["sessions"].returncode == 0, sessions[-3000:]
    last = sessions.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"session worker stopped: {GROUPS} groups rolled out \({GROUPS * N} sessions: "
        rf"{GROUPS * N} finished, 0 failed\), \d+ turns, \d+ tokens sampled",
        last,
    ), sessions[-3000:]
    buffer = pipeline.stopped("replay-buffer", signal.SIGTERM)
    assert pipeline.procs["replay-buffer"].returncode == 0, buffer[-3000:]
    last = buffer.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"replay buffer stopped: {GROUPS} groups released \({GROUPS * N} trajectories\), "
        r"\d+ turn events folded",
        last,
    ), buffer[-3000:]


def test_sessions_run_writes_no_terminal_escape_to_a_stdout_that_is_a_file(pipeline: Pipeline):
    """Item 3: Faust's spinner wrote ``\\x1b[?25h`` (show the cursor) to stdout."""
    stop(pipeline.procs["sessions"])  # stopped by the test before, or now: atexit writes too
    assert "\x1b" not in pipeline.out("sessions").read_text()
    assert "\x1b" not in pipeline.err("sessions").read_text()


def test_replay_without_out_fills_the_text_column(pipeline: Pipeline):
    """Item 6: the table's text column was empty (no tokenizer given)."""
    done = run_cli("replay", "-c", str(pipeline.config), timeout=CLI_S)
    assert done.returncode == 0, done.stderr[-3000:]
    header, _, *rows = done.stdout.splitlines()
    assert len(rows) == GROUPS * N
    texts = [row[header.index("text") :].strip() for row in rows]
    # the bug left the column empty on every row; tiny-qwen3's random weights can sample 12
    # tokens of whitespace for one (seen once in CI, 12-05), so one row with text shows it
    assert any(texts), done.stdout


def test_publish_prints_each_refused_row_once_and_exits_by_what_it_published(
    kafka_bootstrap: str, tmp_path: Path
):
    """Item 5: ``FILE:LINE: why`` once per refused row, one line number for a JSON error, the
    dry run printing what the publish prints; exit 0 all published, 3 some, 4 all refused."""
    cfg = Config.model_validate(
        {
            "kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": unique_name("pb")},
            "model": {"name": "tiny-qwen3"},
        }
    )
    ensure_topics(cfg.kafka)
    config = str(write_config(cfg, tmp_path / "c.yaml"))
    good = [json.dumps(row) for row in make_arithmetic_rows(2, seed=1)]
    bad_rows = [
        "{not json",
        json.dumps({"prompt": [{"role": "user", "content": "hi"}], "agent_name": "nope"}),
    ]
    mixed = tmp_path / "bad.jsonl"
    mixed.write_text("\n".join([good[0], bad_rows[0], good[1], bad_rows[1]]) + "\n")

    dry = run_cli("publish", str(mixed), "--dry-run", "-c", config, timeout=CLI_S)
    real = run_cli("publish", str(mixed), "-q", "-c", config, timeout=CLI_S)
    assert (dry.returncode, real.returncode) == (3, 3), real.stderr[-3000:]
    assert dry.stdout == real.stdout and len(real.stdout.split()) == 2  # the same uids
    for result in (dry, real):
        refused = [line for line in result.stderr.splitlines() if line.startswith("bad.jsonl:")]
        assert [line.split(": ", 1)[0] for line in refused] == ["bad.jsonl:2", "bad.jsonl:4"]
        json_error = "Expecting property name enclosed in double quotes (column 2)"
        assert refused[0] == f"bad.jsonl:2: not valid JSON: {json_error}"
        assert "line" not in refused[0]  # one line number: the location's
        assert "'nope'" in refused[1] and "bad.jsonl" not in refused[1].split(": ", 1)[1]
        assert result.stderr.count("'nope'") == 1  # each refused row printed once
        assert "rolloutbus: 2 of 4 rows refused" in result.stderr
    assert "WARNING" not in real.stderr  # the rows are not logged a second time

    refused_only = tmp_path / "all_bad.jsonl"
    refused_only.write_text("\n".join(bad_rows) + "\n")
    for argv in (["--dry-run"], ["-q"]):
        result = run_cli("publish", str(refused_only), *argv, "-c", config, timeout=CLI_S)
        assert result.returncode == 4, result.stderr[-3000:]
        assert "all 2 refused" in result.stderr and result.stdout == ""
    clean = tmp_path / "good.jsonl"
    clean.write_text("\n".join(good) + "\n")
    result = run_cli("publish", str(clean), "-q", "-c", config, timeout=CLI_S)
    assert result.returncode == 0 and len(result.stdout.split()) == 2, result.stderr[-3000:]
    assert "refused:" not in result.stderr


def test_no_warning_names_the_deprecated_validate(tmp_path: Path):
    """Item 7: the warning for verl's schedule keys named ``publish --validate``."""
    verl = tmp_path / "verl.yaml"
    verl.write_text("trainer:\n  val_before_train: true\n  test_freq: 5\n")
    result = run_cli("config", "-c", str(verl))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val_before_train" in result.stderr and "`rolloutbus publish --val`" in result.stderr
    assert "--validate" not in result.stderr
