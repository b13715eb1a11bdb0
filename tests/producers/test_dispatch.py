"""The dispatcher on the real broker: it never starts more groups than AReaL's bound allows
while the trainer's version stands still, starts more when a version is published, goes
epoch after epoch with new uids, a restarted dispatcher publishes nothing twice, and a new
training run bounds the groups started since it began."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter

from rolloutbus.config import Config, with_overrides
from rolloutbus.consumers.position import end_offsets
from rolloutbus.kafka.control import TrainerControlWriter, publish_policy_version
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from rolloutbus.producers.dispatch import Dispatcher, DispatchReport
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.topics import Topics
from tests.pipeline import read_topic, write_config

WAIT_S = 30.0  # seconds; each step takes well under a second on the test broker
ROWS = 3
EPOCHS = 3


def _cfg(kafka_config) -> Config:
    # groups_per_version = 2 * 1 * 1 = 2; staleness 1: bound (v + 2) * 2
    return with_overrides(
        Config(kafka=kafka_config),
        {
            "async_training.ppo_mini_batch_size": 2,
            "async_training.staleness_threshold": 1,
        },
    )


def _prompt_keys(cfg: Config) -> list[str]:
    return [m.key().decode() for m in read_topic(cfg, Topics.from_config(cfg.kafka).prompts)]


def _start(dispatcher: Dispatcher) -> tuple[threading.Thread, threading.Event, list]:
    stop, out = threading.Event(), []
    thread = threading.Thread(target=lambda: out.append(dispatcher.run(stop)), daemon=True)
    thread.start()
    return thread, stop, out


def _wait_until_held(dispatcher: Dispatcher, cfg: Config, expected: int) -> list[str]:
    """Wait until the dispatcher waits for the trainer, then the topic holds ``expected``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if dispatcher.waiting.is_set() and len(keys := _prompt_keys(cfg)) >= expected:
            return keys
        time.sleep(0.1)
    raise AssertionError(f"dispatcher did not reach {expected} groups: {_prompt_keys(cfg)}")


def _publish_version(cfg: Config, v: int) -> None:
    publish_policy_version(
        cfg, PolicyVersionPublished(policy_version=v, weights_path=f"/ckpt/{v}", global_step=v)
    )


def test_bound_holds_until_a_version_is_published_then_epochs_finish(kafka_config, tmp_path):
    cfg = _cfg(kafka_config)
    assert cfg.async_training.groups_per_version == 2
    path = write_jsonl(make_arithmetic_rows(ROWS, seed=3), tmp_path / "rows.jsonl")
    dispatcher = Dispatcher(cfg, path, epochs=EPOCHS, progress=False)
    thread, stop, out = _start(dispatcher)
    try:
        # no version yet: version 0, bound (0 + 1 + 1) * 2 = 4, and not one more
        keys = _wait_until_held(dispatcher, cfg, 4)
        time.sleep(1.0)  # the dispatcher polls the control topic meanwhile
        assert _prompt_keys(cfg) == keys and len(keys) == 4
        _publish_version(cfg, 1)  # bound 6
        assert len(_wait_until_held(dispatcher, cfg, 6)) == 6
        _publish_version(cfg, 5)  # bound 14 > 9 groups in 3 epochs: all go out, then it ends
        thread.join(WAIT_S)
        assert not thread.is_alive()
    finally:
        stop.set()
        thread.join(WAIT_S)
    report: DispatchReport = out[0]
    assert report.finished and (report.started, report.published) == (9, 9)
    keys = _prompt_keys(cfg)
    assert len(keys) == 9 and len(set(keys)) == 9  # each epoch publishes new uids
    assert keys.count(dispatcher.uid(0)) == 1
    groups = [m.value() for m in read_topic(cfg, Topics.from_config(cfg.kafka).prompts)]
    assert all(b'"policy_version"' in g for g in groups)


def test_a_restarted_dispatcher_publishes_nothing_twice(kafka_config, tmp_path):
    cfg = _cfg(kafka_config)
    path = write_jsonl(make_arithmetic_rows(ROWS, seed=4), tmp_path / "rows.jsonl")
    first = Dispatcher(cfg, path, epochs=EPOCHS, progress=False)
    thread, stop, out = _start(first)
    _wait_until_held(first, cfg, 4)
    stop.set()  # as SIGTERM would
    thread.join(WAIT_S)
    assert out[0].published == 4 and not out[0].finished

    # same dataset, same run: the 4 groups on the topic count as started
    second = Dispatcher(cfg, path, epochs=EPOCHS, progress=False)
    thread, stop, out = _start(second)
    try:
        keys = _wait_until_held(second, cfg, 4)
        assert len(keys) == 4
        _publish_version(cfg, 1)
        keys = _wait_until_held(second, cfg, 6)
    finally:
        stop.set()
        thread.join(WAIT_S)
    report = out[0]
    assert (report.found_on_topic, report.published, report.started) == (4, 2, 6)
    assert max(Counter(keys).values()) == 1 and len(keys) == 6

    # a named run is a new run of the same file: new uids, its own count
    named = Dispatcher(cfg, path, epochs=1, run_name="again", progress=False)
    assert named.uid(0) != second.uid(0)


def test_the_command_stops_cleanly_on_sigterm_and_says_where_it_stands(kafka_config, tmp_path):
    cfg = _cfg(kafka_config)
    path = write_jsonl(make_arithmetic_rows(ROWS, seed=5), tmp_path / "rows.jsonl")
    config_path = write_config(cfg, tmp_path / "c.yaml")
    missing = subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "dispatch", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert missing.returncode == 2 and "dataset not found" in missing.stderr

    with subprocess.Popen(  # on leaving: its pipe closed, the process waited for
        [sys.executable, "-m", "rolloutbus.cli", "dispatch", str(path), "-c", str(config_path)],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stderr is not None
            lines = []
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:  # forever (no --epochs) until the bound holds it
                lines.append(proc.stderr.readline())
                if "waiting" in lines[-1]:
                    break
            assert "4 groups started at version 0 (bound 4); waiting" in lines[-1], lines
            proc.send_signal(signal.SIGTERM)
            rest = proc.communicate(timeout=WAIT_S)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, rest
    assert "4 groups started (4 now, 0 found on the topic)" in rest
    assert "stopped before the last epoch" in rest
    assert len(_prompt_keys(cfg)) == 4


def test_a_new_run_bounds_the_groups_started_since_it_began(kafka_config, tmp_path):
    """Run 2 starts again at version 0: the bound counts from the groups started before
    it (the prompt offsets its RunStarted recorded), in the running dispatcher and in a
    restarted one; the dispatcher neither stalls nor runs ahead."""
    cfg = _cfg(kafka_config)  # bound within a run: (v + 2) * 2
    path = write_jsonl(make_arithmetic_rows(ROWS, seed=6), tmp_path / "rows.jsonl")
    prompts = Topics.from_config(cfg.kafka).prompts
    run1 = TrainerControlWriter(cfg)
    run1.start_run("run-1", _weights(0), prompt_offsets=end_offsets(cfg.kafka, prompts))
    run1.publish(_weights(2))
    dispatcher = Dispatcher(cfg, path, epochs=6, progress=False)
    thread, stop, out = _start(dispatcher)
    try:
        assert len(_wait_until_held(dispatcher, cfg, 8)) == 8
        run2 = TrainerControlWriter(cfg)  # a new run on the same topics, at version 0
        run2.start_run("run-2", _weights(0), prompt_offsets=end_offsets(cfg.kafka, prompts))
        keys = _wait_until_held(dispatcher, cfg, 12)  # 8 before it + (0 + 2) * 2
        time.sleep(1.0)  # the dispatcher polls the control topic meanwhile
        assert sorted(_prompt_keys(cfg)) == sorted(keys) and len(keys) == 12
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert (out[0].run_id, out[0].groups_before_run, out[0].bound) == ("run-2", 8, 12)

    again = Dispatcher(cfg, path, epochs=6, progress=False)
    thread, stop, out = _start(again)
    try:
        _wait_until_held(again, cfg, 12)
        run2.publish(_weights(1))  # 8 + (1 + 2) * 2
        keys = _wait_until_held(again, cfg, 14)
    finally:
        stop.set()
        thread.join(WAIT_S)
    report = out[0]
    assert (report.found_on_topic, report.groups_before_run, report.published) == (12, 8, 2)
    assert len(keys) == 14 and max(Counter(keys).values()) == 1
    run1.close()
    run2.close()


def _weights(v: int) -> PolicyVersionPublished:
    return PolicyVersionPublished(policy_version=v, weights_path=f"/ckpt/{v}", global_step=v)
