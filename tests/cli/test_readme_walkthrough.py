"""The README cannot drift from behaviour: its "Run the pieces by hand" commands, run as a new
user runs them, each in its own process, on a private stack.

The commands are taken from README.md's block as written. What the test changes, and why:

- ``-c mine.yaml`` gets a second file, ``private.yaml``: this stack's own ports and folders
  (docs/configuration.md, "A second stack on one machine"), the small random tiny-qwen3 and
  32-token responses, so the walkthrough takes minutes on two shared cores;
- ``--steps 100`` becomes ``--steps 2`` and ``--count 64`` becomes ``--count 8``;
- Prometheus is left out (``tests/monitoring/test_monitoring_prometheus.py`` runs it).

Checked: every command exits 0 or keeps running; the trainer trains its steps from the
groups; ``inspect``, ``consume`` and ``replay`` agree about a group token for token; ``top
--once`` shows every stage; every service stops on SIGINT, and again on SIGTERM, within
10 s and without a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
import yaml

from tests.helpers import free_port
from tests.source_tree import ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STOP_S = 10.0  # seconds a service may take to stop on SIGINT or SIGTERM (the bound)
START_S = 180.0  # seconds for a service to answer on its port (torch imports, busy cores)
TRAIN_S = 600.0  # seconds for the two training steps, rollouts included
SERVICES = (
    "replica",
    "sessions",
    "replay-buffer",
    "weight-sync",
    "dispatch",
    "lag-exporter",
    "top",
)


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the pieces by hand", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def _adapted(command: str) -> str:
    return (
        command.replace("-c mine.yaml", "-c mine.yaml -c private.yaml")
        .replace("--steps 100", "--steps 2")
        .replace("--count 64", "--count 8")
    )


def _private_config() -> dict:
    return {
        "broker": {
            "port": free_port(),
            "controller_port": free_port(),
            "data_dir": "var/kafka",
            "heap": "384m",
        },
        "kafka": {"partitions": 2},
        "model": {"name": "tiny-qwen3"},
        "replica_server": {"port": free_port()},
        "rollout": {"prompt_length": 256, "response_length": 32},
        "sessions": {"data_dir": "var/faust", "metrics_port": free_port()},
        "replay_buffer": {"metrics_port": free_port()},
        "trainer": {"metrics_port": free_port(), "default_local_dir": "checkpoints"},
        "monitoring": {
            "weight_sync_metrics_port": free_port(),
            "dispatch_metrics_port": free_port(),
            "lag_exporter_port": free_port(),
            "progress_log_s": 5,
        },
        "gateway": {"port": free_port()},
        "async_training": {"ppo_mini_batch_size": 2},
    }


class Walkthrough:
    """The user's checkout: a folder with ops/metrics-on.yaml, where every command runs."""

    def __init__(self, folder: Path):
        self.folder = folder
        (folder / "ops").mkdir()
        (folder / "ops" / "metrics-on.yaml").write_text(
            (ROOT / "ops" / "metrics-on.yaml").read_text()
        )
        self.private = _private_config()
        (folder / "private.yaml").write_text(yaml.safe_dump(self.private))
        bin_dir = str(Path(sys.executable).parent)  # where `rolloutbus` is installed
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.services: dict[str, subprocess.Popen] = {}

    def run(self, command: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"$ {command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done

    def start(self, name: str, command: str) -> None:
        with (self.folder / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            self.services[name] = subprocess.Popen(
                shlex.split(command), cwd=self.folder, env=self.env, stdout=log, stderr=log
            )

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def port_of(self, name: str) -> int | None:
        p, m = self.private, self.private["monitoring"]
        return {
            "replica": p["replica_server"]["port"],
            "sessions": p["sessions"]["metrics_port"],
            "replay-buffer": p["replay_buffer"]["metrics_port"],
            "weight-sync": m["weight_sync_metrics_port"],
            "dispatch": m["dispatch_metrics_port"],
            "lag-exporter": m["lag_exporter_port"],
        }.get(name)

    def wait_up(self, name: str) -> None:
        """Until the service answers on its port (top, which has none: prints a snapshot)."""
        port, deadline = self.port_of(name), time.monotonic() + START_S
        while time.monotonic() < deadline:
            proc = self.services[name]
            assert proc.poll() is None, (
                f"{name} exited {proc.returncode}:\n{self.log(name)[-3000:]}"
            )
            if port is None and "consumer lag" in self.log(name):
                return
            if port is not None and _answers(port, "/health" if name == "replica" else "/metrics"):
                return
            time.sleep(0.5)
        pytest.fail(f"{name} did not come up in {START_S:.0f} s:\n{self.log(name)[-3000:]}")

    def stop_each(self, sig: signal.Signals) -> dict[str, float]:
        """Send ``sig`` to every service; the seconds each took to exit."""
        sent = {}
        for name, proc in self.services.items():
            proc.send_signal(sig)
            sent[name] = time.monotonic()
        took = {}
        for name, proc in self.services.items():
            try:
                proc.wait(timeout=max(0.0, sent[name] + STOP_S + 5 - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(
                    f"{name} still ran {STOP_S:.0f} s after {sig.name}:\n{self.log(name)[-2000:]}"
                )
            took[name] = time.monotonic() - sent[name]
        self.services = {}
        return took

    def kill_all(self) -> None:
        for proc in self.services.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _answers(port: int, path: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def walkthrough(tmp_path: Path) -> Iterator[Walkthrough]:
    user = Walkthrough(tmp_path)
    try:
        yield user
    finally:
        user.kill_all()
        subprocess.run(
            ["bash", "-c", "rolloutbus broker stop -c mine.yaml -c private.yaml"],
            cwd=tmp_path,
            env=user.env,
            capture_output=True,
            timeout=120,
        )


def _service_name(command: str) -> str | None:
    words = command.split()
    if words[:1] != ["rolloutbus"]:
        return None
    name = words[1]
    return name if name in SERVICES else None


def test_the_readme_by_hand_commands_work_as_written(walkthrough: Walkthrough):
    commands = [_adapted(c) for c in _readme_commands()]
    assert commands[0].startswith("cp ops/metrics-on.yaml mine.yaml"), commands[0]
    started: list[str] = []
    for command in commands:
        name = _service_name(command)
        if command.startswith("prometheus "):
            continue  # tests/monitoring/test_monitoring_prometheus.py
        if name is not None:
            walkthrough.start(name, command)
            started.append(command)
            if name == "replica":
                walkthrough.wait_up(name)  # the workers probe it at their start
            continue
        timeout = TRAIN_S if " train " in command else 180.0
        done = walkthrough.run(command, timeout=timeout)
        if command.startswith("rolloutbus broker start"):
            assert "broker running" in done.stdout, done.stdout
        if " train " in command:
            # a fresh run: this run's groups are all the groups since step 0
            line = (
                r"trained 2 step\(s\), 1\.\.2, on (\d+) groups; \d+ stale groups dropped; \1 groups"
            )
            assert re.search(line, done.stdout + done.stderr), done.stderr[-2000:]
    assert sorted(walkthrough.services) == sorted(SERVICES)
    for name in SERVICES:
        walkthrough.wait_up(name)

    uid = _one_group_agrees_everywhere(walkthrough)
    top = walkthrough.run("rolloutbus top --once -c mine.yaml -c private.yaml").stdout
    for stage in ("sessions", "replay_buffer", "trainer"):
        assert re.search(rf"^\s*{stage}\s+\d+ records", top, re.M), top
    down = [line for line in top.splitlines() if line.rstrip().endswith("DOWN")]
    assert [line.split()[0] for line in down] == ["trainer"], top  # train has finished

    sigint = walkthrough.stop_each(signal.SIGINT)
    for command in started:  # the same commands again, stopped with SIGTERM this time
        walkthrough.start(_service_name(command) or "", command)
    for name in SERVICES:
        walkthrough.wait_up(name)
    sigterm = walkthrough.stop_each(signal.SIGTERM)
    for name in SERVICES:
        assert "Traceback" not in walkthrough.log(name), walkthrough.log(name)[-3000:]
    # says what it did in words (it printed a Python dict)
    assert re.search(
        r"weight sync stopped: (\d+ \w+|no version synced)", walkthrough.log("weight-sync")
    )
    print(f"\nstopped ({uid}): SIGINT {_seconds(sigint)}; SIGTERM {_seconds(sigterm)}")


def _seconds(took: dict[str, float]) -> str:
    return ", ".join(f"{name} {s:.1f} s" for name, s in took.items())


def _one_group_agrees_everywhere(user: Walkthrough) -> str:
    """``consume``, ``replay --uid`` and ``inspect --json`` of one group: the same sampled
    tokens, session by session. Returns the uid."""
    config = "-c mine.yaml -c private.yaml"
    user.run(f"rolloutbus consume {config} --max-groups 1 --out consumed.arrow")
    consumed = _rows(user.folder / "consumed.arrow")
    uid = consumed[0]["key"].rsplit("_", 2)[0]
    user.run(f"rolloutbus replay {config} --uid {uid} --out replayed.arrow")
    replayed = _rows(user.folder / "replayed.arrow")
    assert _sampled(consumed) == _sampled(replayed), uid
    view = json.loads(user.run(f"rolloutbus inspect {uid} {config} --json").stdout)
    inspected = {
        f"{uid}_{s['session_id']}_0": [
            t for b in s["turns"] if b["type"] == "generation" for t in b["token_ids"]
        ]
        for s in view["sessions"]
    }
    assert inspected == _sampled(consumed), uid
    assert len(inspected) == 4  # rollout.n from mine.yaml
    return uid


def _rows(path: Path) -> list[dict]:
    with pa.ipc.open_file(path) as reader:
        return reader.read_all().to_pylist()


def _sampled(rows: list[dict]) -> dict[str, list[int]]:
    """key -> the policy-sampled tokens of the trajectory (response mask 1)."""
    return {
        r["key"]: [t for t, m in zip(r["responses"], r["response_mask"], strict=True) if m]
        for r in rows
    }
