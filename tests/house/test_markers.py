"""The ``kafka`` marker reaches every test that needs a broker, so ``-m "not kafka"`` is a
fast suite that never starts one. Checked on a real collection (no test runs, no broker)."""

from __future__ import annotations

import subprocess
import sys

from tests.source_tree import TESTS

COLLECT_TIMEOUT_S = 120.0  # seconds; collection imports torch-free modules only, 2 shared cores


def _collected(*args: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=COLLECT_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_kafka_marker_follows_broker_fixtures_and_explicit_marks() -> None:
    broker, recovery = "tests/kafka/test_broker.py", "tests/assembly/test_replay_buffer_recovery.py"
    kafka = _collected("-m", "kafka", broker, recovery)
    assert f"{broker}::test_ensure_topics_is_idempotent" in kafka  # kafka_config
    assert f"{broker}::test_status_reports_running" in kafka  # embedded_broker
    assert f"{broker}::test_jvm_that_exits_is_reported_with_its_log" in kafka  # explicit
    assert f"{recovery}::test_group_waits_for_all_sessions" in kafka
    assert f"{broker}::test_java_version_parsing" not in kafka  # pure
    assert f"{broker}::test_unreachable_bootstrap_gives_broker_error" not in kafka
