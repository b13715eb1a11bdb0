"""The main job on the embedded defaults: every part real, started and stopped here.

broker (if the config points at the embedded one) → replica → session worker →
replay buffer → publish the bundled arithmetic rows → receive them as the trainer client
does → print a table, write an Arrow file, check the token invariants → stop everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError, RolloutBusError

REPLICA_READY_TIMEOUT_S = 300.0  # seconds; the first run dequantizes SmolLM2 (~15 s) on 2 cores


def run_demo(cfg: Config, *, rows: int, out: Path, timeout_s: float) -> int:
    from rolloutbus.kafka.admin import ensure_topics
    from rolloutbus.replica.models import load_tokenizer

    started_broker = _maybe_start_broker(cfg)
    ensure_topics(cfg.kafka)
    procs: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="rolloutbus-demo-") as tmp:
            config_path = _write_config(cfg, Path(tmp) / "config.yaml")
            procs.append(_spawn("replica", ["replica", "serve"], config_path))
            _wait_for_replica(cfg.replicas.urls[0], procs[-1])
            procs.append(_spawn("sessions", ["sessions", "run"], config_path))
            procs.append(_spawn("replay-buffer", ["replay-buffer", "run"], config_path))
            uids = _publish_demo_rows(cfg, rows, Path(tmp) / "arithmetic.jsonl")
            groups = _receive(cfg, set(uids), out, timeout_s, load_tokenizer(cfg.model))
        return _check_invariants(groups, len(uids))
    finally:
        for proc in reversed(procs):
            _stop(proc)
        if started_broker:
            from rolloutbus.kafka.broker import stop_broker

            stop_broker(cfg)
            _say("broker stopped")


def _say(text: str) -> None:
    print(f"[demo] {text}", file=sys.stderr, flush=True)


def _maybe_start_broker(cfg: Config) -> bool:
    embedded = f"127.0.0.1:{cfg.broker.port}"
    if cfg.kafka.bootstrap_servers not in (embedded, f"localhost:{cfg.broker.port}"):
        _say(f"using the configured cluster at {cfg.kafka.bootstrap_servers}")
        return False
    from rolloutbus.kafka.broker import broker_status, start_broker

    if broker_status(cfg).running:
        _say(f"broker already running at {embedded}; leaving it running afterwards")
        return False
    _say("starting the embedded Kafka broker (first run fetches its jars from Maven Central)")
    status = start_broker(cfg)
    _say(f"broker ready: pid {status.pid} at {status.bootstrap}")
    return True


def _write_config(cfg: Config, path: Path) -> Path:
    data = cfg.model_dump(mode="json")
    if cfg.kafka.sasl_password is not None:
        data["kafka"]["sasl_password"] = cfg.kafka.sasl_password.get_secret_value()
    path.write_text(yaml.safe_dump(data))
    return path


def _spawn(name: str, argv: list[str], config_path: Path) -> subprocess.Popen:
    _say(f"starting {name}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rolloutbus.cli", *argv, "--config", str(config_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=sys.stderr,
    )


def _wait_for_replica(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + REPLICA_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ReplicaError(
                f"the replica exited with code {proc.returncode} before it was ready"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                _say(f"replica ready at {url}")
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise ReplicaError(f"the replica at {url} was not ready within {REPLICA_READY_TIMEOUT_S:.0f} s")


def _publish_demo_rows(cfg: Config, rows: int, path: Path) -> list[str]:
    from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
    from rolloutbus.producers.publish import PromptPublisher

    write_jsonl(make_arithmetic_rows(rows, seed=7), path)
    # the bundled rows are the same every run: a dataset id of its own per run keeps a rerun
    # on a persistent broker from being taken for a re-publish of the last run's groups
    report = PromptPublisher(cfg).publish_file(
        path, progress=False, dataset_id=f"demo-{time.time_ns()}"
    )
    _say(
        f"published {report.published} prompt groups (n={cfg.rollout.n}); "
        f"{report.dead_lettered} rows to the dead-letter topic"
    )
    return list(report.uids or [])


def _receive(cfg: Config, uids: set[str], out: Path, timeout_s: float, tokenizer):
    from rolloutbus.consumers.client import TrainerClient
    from rolloutbus.consumers.report import print_table, write_arrow

    received = []
    deadline = time.monotonic() + timeout_s
    group_id = f"rolloutbus-demo-{int(time.time())}"
    with TrainerClient(cfg.kafka, group_id) as client:
        while len(received) < len(uids) and time.monotonic() < deadline:
            for group in client.groups(max_groups=1, timeout_s=5.0):
                client.commit(group)
                if group.uid in uids:
                    received.append(group)
                    _say(f"trainer received group {group.uid} ({len(received)}/{len(uids)})")
    if len(received) < len(uids):
        raise RolloutBusError(
            f"only {len(received)} of {len(uids)} groups arrived within {timeout_s:.0f} s"
        )
    print_table(received, tokenizer, sys.stdout)
    write_arrow(received, out)
    _say(f"wrote {sum(len(g) for g in received)} trajectories to {out}")
    return received


def _check_invariants(groups, expected: int) -> int:
    bad = []
    for g in groups:
        for row in g.batch.to_pylist():
            lp = row["rollout_log_probs"]
            lengths = {len(row["responses"]), len(row["response_mask"])} | (
                {len(lp)} if lp is not None else set()
            )
            if row["status"] != "failed" and len(lengths) != 1:
                bad.append(row["key"])
    if bad:
        _say(f"length invariant broken for {bad}")
        return 1
    _say(f"{expected} groups received; responses, response_mask and logprobs have equal lengths")
    return 0


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
