"""Every benchmark runs at its ``--quick`` size, so that none rots.

Their figures are not checked here: speed is shown by the benchmarks themselves (ratios to
a baseline measured in the same run), never by timed asserts. What is checked: each exits
0, prints its table (a line every full run prints too), and writes no librdkafka error:
a client that outlives its broker writes ``%3|...|FAIL|`` lines at exit.

CI runs the light ones (the whole file in about a minute). The heavy ones start replicas,
a model, a supervisor or a trainer and take 20-70 s each even at their quick size; they
run with ``ROLLOUTBUS_BENCHMARKS=all`` (run that before changing a benchmark or what it
drives) and skip, saying so, without it. ``pipeline_throughput.py`` runs once, on a broker
of its own (the clean-exit check), not again on the test broker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.source_tree import ROOT

BENCHMARKS = ROOT / "benchmarks"
# scripts in benchmarks/ that are not benchmarks: shared code, a baseline's child process,
# the learning curve's reward function, and a loop over fault rows (it runs the fault suite
# itself, counting passes) with its pytest plugin
NOT_BENCHMARKS = {
    "bench_harness.py",
    "plain_consume.py",
    "short_answer_reward.py",
    "fault_row_loop.py",
    "repeat_items.py",
}
# benchmark -> a line of its table (a regular expression); None: needs no broker
WITH_BROKER = {
    "pipeline_throughput.py": r"ratio pipeline/baseline throughput: \d",
    "latency.py": r"moderate +\d+ +\d",
    "replay_speed.py": r"replay peak RSS: \d+ MB over a quarter of the log, \d+ MB",
    "durability_tax.py": r"ratio bus/in-process sessions/s: \d",
    "recovery.py": r"sessions +1 +\d",
    "capacity.py": r"replay buffers +\d",
    "compression.py": r"lz4 +\d",
    "soak.py": r"groups published \d+, released \d+",
    "learning_curve.py": r"\| async \| \d+",
}
WITHOUT_BROKER = {
    "encoding.py": r"4096 +\d+",
    "tensors.py": r"padded, row slices \(now\) +\d",
    "engines.py": r"\| 2 \| \d+",
    "worker_concurrency.py": r"aiohttp +4 +\d+ +\d+ +\d+ +\d+ +[\d.]+x",
    "trainer_decode.py": r"\+ train batch +[\d.]+ +[\d.]+ +[\d.]+x",
    "fold_cpu.py": r"columnar: -?\d+ ns per sampled token",
}
HEAVY = {"durability_tax.py", "recovery.py", "soak.py", "learning_curve.py", "engines.py"}
ALL_ENV = "ROLLOUTBUS_BENCHMARKS"  # "all": run the heavy ones too
ON_ITS_OWN_BROKER = "pipeline_throughput.py"  # run once, starting and stopping its broker
QUICK_TIMEOUT_S = 900  # seconds for one benchmark at its quick size on two busy cores
# librdkafka's errors: its own stderr lines (``%3|...|FAIL|``: syslog levels 0-3), or, from
# the clients routed to Python logging (kafka/clients.py), lines of its facilities for
# failed connections and errors (``FAIL [rdkafka#producer-1] [thrd:...]: ...``)
LIBRDKAFKA_ERROR = re.compile(r"^(%[0-3]\||(FAIL|ERROR) \[rdkafka#)", re.MULTILINE)


def test_every_benchmark_is_run_at_its_quick_size() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - NOT_BENCHMARKS
    assert scripts == set(WITH_BROKER) | set(WITHOUT_BROKER), (
        "add a new benchmark to WITH_BROKER or WITHOUT_BROKER (or NOT_BENCHMARKS)"
    )


def quick_params(scripts: dict[str, str]) -> list[object]:
    """The scripts as parameters; a heavy one skips unless ``ROLLOUTBUS_BENCHMARKS=all``."""
    heavy = pytest.mark.skipif(
        os.environ.get(ALL_ENV) != "all",
        reason=f"a heavy benchmark (a replica, model or trainer; 7-70 s at --quick): {ALL_ENV}=all",
    )
    return [pytest.param(s, marks=heavy) if s in HEAVY else s for s in sorted(scripts)]


def on_the_test_broker() -> dict[str, str]:
    return {s: line for s, line in WITH_BROKER.items() if s != ON_ITS_OWN_BROKER}


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
@pytest.mark.parametrize("script", quick_params(WITHOUT_BROKER))
def test_benchmark_without_broker_runs(script: str) -> None:
    done = run_quick(script)
    assert re.search(WITHOUT_BROKER[script], done.stdout), done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", quick_params(on_the_test_broker()))
def test_benchmark_runs_on_the_test_broker(script: str, kafka_bootstrap: str) -> None:
    done = run_quick(script, "--bootstrap", kafka_bootstrap)
    assert re.search(WITH_BROKER[script], done.stdout), done.stdout[-3000:]
    assert not LIBRDKAFKA_ERROR.search(done.stderr), done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.kafka
def test_benchmark_with_its_own_broker_exits_cleanly() -> None:
    """The benchmark starts and stops its own broker: no client may outlive it."""
    done = run_quick(ON_ITS_OWN_BROKER)
    assert re.search(WITH_BROKER[ON_ITS_OWN_BROKER], done.stdout), done.stdout
    assert not LIBRDKAFKA_ERROR.search(done.stderr), done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(ALL_ENV) != "all", reason=f"a heavy benchmark: {ALL_ENV}=all")
def test_recovery_long_turns_runs_on_the_test_broker(kafka_bootstrap: str) -> None:
    """``recovery.py --long-turns`` (a kill mid-turn, chunking off then on) at its quick
    size: 256-token turns, chunks of 32; its table has a row per mode."""
    done = run_quick("recovery.py", "--long-turns", "--bootstrap", kafka_bootstrap)
    assert re.search(r"^ +off +\d", done.stdout, re.MULTILINE), done.stdout[-3000:]
    assert re.search(r"^ +32 +\d", done.stdout, re.MULTILINE), done.stdout[-3000:]
    assert not LIBRDKAFKA_ERROR.search(done.stderr), done.stderr[-4000:]
