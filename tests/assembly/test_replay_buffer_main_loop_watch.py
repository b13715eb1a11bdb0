"""A replay-buffer process whose main loop stalls in a call into librdkafka ends itself with
exit 75 and the loop's stack, for its supervisor to start it again (MainLoopWatch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rolloutbus.config import Config, KafkaConfig, with_overrides
from rolloutbus.kafka.watchdog import EXIT_STALLED
from tests.helpers import unique_name
from tests.pipeline import write_config
from tests.source_tree import PROGRAMS

STALLED = PROGRAMS / "stalled_replay_buffer.py"  # the fault injector, a real buffer in it
LIMIT_S = 30.0  # the watch's limit in the child: past a recovery's steps on two busy cores
TXN_STALL_S = LIMIT_S / 4  # the limit is at least four transactional stall limits
EXIT_WAIT_S = 180.0  # seconds for the child to start, stall and be ended


@pytest.mark.slow
def test_a_buffer_whose_main_loop_stalls_exits_75_with_its_stack(
    kafka_config: KafkaConfig, tmp_path: Path
):
    cfg = with_overrides(
        Config(kafka=kafka_config),
        {"replay_buffer.group_id": unique_name("rb"), "replay_buffer.txn_stall_s": TXN_STALL_S},
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    child = subprocess.run(
        [sys.executable, str(STALLED), str(config), str(LIMIT_S)],
        capture_output=True,
        text=True,
        timeout=EXIT_WAIT_S,  # without the watch the child never exits: TimeoutExpired
    )
    assert child.returncode == EXIT_STALLED, child.stderr[-3000:]
    [stalled] = [line for line in child.stderr.splitlines() if "no progress for" in line]
    assert f"(limit {LIMIT_S:g} s); exiting with 75" in stalled
    assert "_consume_that_hangs" in child.stderr  # the main thread's stack, where it hung
