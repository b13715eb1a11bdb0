"""Every benchmark runs at its ``--quick`` size, so that none rots.

Their figures are not checked here: speed is shown by the benchmarks themselves (ratios to
a baseline measured in the same run), never by timed asserts. What is checked: each exits
0, prints its table (a line every full run prints too), and writes no librdkafka error:
a client that outlives its broker writes ``%3|...|FAIL|`` lines at exit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# scripts in benchmarks/ that are not benchmarks: shared code, a baseline's child process,
# the learning curve's reward function
NOT_BENCHMARKS = {"bench_harness.py", "plain_consume.py", "short_answer_reward.py"}
# benchmark -> a line of its table (a regular expression); None: needs no broker
WITH_BROKER = {
    "pipeline_throughput.py": r"ratio pipeline/baseline throughput: \d",
    "latency.py": r"moderate +\d+ +\d",
    "replay_speed.py": r"ratio replay/baseline throughput: \d",
    "durability_tax.py": r"ratio bus/in-process sessions/s: \d",
    "recovery.py": r"sessions +1 +\d",
    "capacity.py": r"replay buffers +\d",
    "soak.py": r"groups published \d+, released \d+",
    "learning_curve.py": r"\| async \| \d+",
}
WITHOUT_BROKER = {
    "encoding.py": r"4096 +\d+",
    "tensors.py": r"padded, row slices \(now\) +\d",
    "engines.py": r"\| 2 \| \d+",
}
QUICK_TIMEOUT_S = 900  # seconds for one benchmark at its quick size on two busy cores
LIBRDKAFKA_ERROR = re.compile(r"^%[0-3]\|", re.MULTILINE)  # syslog levels 0-3: errors


def test_every_benchmark_is_run_at_its_quick_size() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - NOT_BENCHMARKS
    assert scripts == set(WITH_BROKER) | set(WITHOUT_BROKER), (
        "add a new benchmark to WITH_BROKER or WITHOUT_BROKER (or NOT_BENCHMARKS)"
    )


def run_quick(script: str, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *extra],
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(WITHOUT_BROKER))
def test_benchmark_without_broker_runs(script: str) -> None:
    done = run_quick(script)
    assert re.search(WITHOUT_BROKER[script], done.stdout), done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(WITH_BROKER))
def test_benchmark_runs_on_the_test_broker(script: str, kafka_bootstrap: str) -> None:
    done = run_quick(script, "--bootstrap", kafka_bootstrap)
    assert re.search(WITH_BROKER[script], done.stdout), done.stdout[-3000:]
    assert not LIBRDKAFKA_ERROR.search(done.stderr), done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.kafka
def test_benchmark_with_its_own_broker_exits_cleanly() -> None:
    """The benchmark starts and stops its own broker: no client may outlive it."""
    done = run_quick("pipeline_throughput.py")
    assert re.search(WITH_BROKER["pipeline_throughput.py"], done.stdout), done.stdout
    assert not LIBRDKAFKA_ERROR.search(done.stderr), done.stderr[-4000:]
