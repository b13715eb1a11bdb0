"""SIGTERM (what CI, ``timeout``, ``docker stop`` send) stops the demo as Ctrl-C does: every
process it started and the broker it started are gone when it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rolloutbus.broker.embedded import broker_status, stop_broker
from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from tests.helpers import free_port, unique_name
from tests.pipeline import write_config

# the demo starts a broker JVM of its own (not the session's), then a replica and workers
pytestmark = [pytest.mark.slow, pytest.mark.kafka]

UP_TIMEOUT_S = 400.0  # seconds until the broker, the replica and both workers are up
EXIT_TIMEOUT_S = 180.0  # seconds for the demo to stop everything after SIGTERM
READY_LINE = "[demo] published"  # printed once the broker is up and both workers started


def _free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def _demo_config(tmp_path: Path) -> Config:
    broker_port, controller_port, replica_port = _free_ports(3)
    return Config.model_validate(
        {
            "broker": BrokerConfig(
                data_dir=tmp_path / "kafka",
                port=broker_port,
                controller_port=controller_port,
                start_timeout_s=120.0,  # seconds; a JVM start on two busy cores
            ).model_dump(),
            "kafka": KafkaConfig(
                bootstrap_servers=f"127.0.0.1:{broker_port}", partitions=1
            ).model_dump(),
            "model": {"name": "tiny-qwen3"},
            "replica_server": {"port": replica_port},
            "replicas": {"urls": [f"http://127.0.0.1:{replica_port}"]},
            "rollout": {"n": 1, "response_length": 8},
            "sessions": {"app_id": unique_name("demo"), "data_dir": str(tmp_path / "faust")},
        }
    )


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status  # a zombie has exited; only its entry remains


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _alive(int(entry.name)):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_sigterm_of_the_demo_leaves_no_process_and_no_broker_behind(tmp_path):
    cfg = _demo_config(tmp_path)
    config = write_config(cfg, tmp_path / "c.yaml")
    scratch = tmp_path / "tmp"  # the demo's temporary folder (its workers' config) lies here
    scratch.mkdir()
    with subprocess.Popen(  # on leaving: its pipe closed, the process waited for
        [sys.executable, "-m", "rolloutbus.cli", "demo", "--rows", "2", "--n", "1"]
        + ["--out", str(tmp_path / "t.arrow"), "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    ) as demo:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(demo.stderr or []), daemon=True)
        reader.start()
        started: set[int] = set()
        broker_pid = None
        try:
            deadline = time.monotonic() + UP_TIMEOUT_S
            while not any(READY_LINE in line for line in lines):
                assert demo.poll() is None, "".join(lines)[-3000:]
                assert time.monotonic() < deadline, "".join(lines)[-3000:]
                time.sleep(0.5)
            broker_pid = broker_status(cfg).pid
            started = _children(demo.pid)
            assert broker_pid is not None and len(started) >= 3  # broker, replica, two workers

            demo.send_signal(signal.SIGTERM)
            demo.wait(timeout=EXIT_TIMEOUT_S)
            reader.join(timeout=30)
            output = "".join(lines)
            assert demo.returncode == 130, output[-3000:]
            assert "[demo] broker stopped" in output and "rolloutbus: interrupted" in output
            assert not [pid for pid in started | {broker_pid} if _alive(pid)], output[-3000:]
            assert not broker_status(cfg).running
            assert not _processes_mentioning(str(tmp_path))
        finally:
            for pid in started:  # only if the test failed: leave nothing behind on this machine
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            if demo.poll() is None:
                demo.kill()
            stop_broker(cfg)
