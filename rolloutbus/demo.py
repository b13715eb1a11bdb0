"""The main job on the embedded defaults: every part real, started and stopped here.

broker (if the config points at the embedded one) → replica → session worker →
replay buffer → publish the bundled arithmetic rows → receive them as the trainer client
does → print a table, write an Arrow file, check the token invariants → stop everything.

**Apart from training.** The demo's records go to topics of their own (the configured
prefix plus ``-demo``), its workers use consumer groups of their own, and it reads the
trajectories in a throwaway group that never commits: a ``rolloutbus train`` started
afterwards on the same broker sees none of the demo's groups.

**Stopping.** Ctrl-C or SIGTERM (the CLI turns it into KeyboardInterrupt) stops what the
demo started, workers first and the broker last; a second signal while it does so is
answered with a line, not obeyed, so nothing is left running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import yaml

from rolloutbus.config import Config, with_overrides
from rolloutbus.errors import ReplicaError, RolloutBusError

if TYPE_CHECKING:  # imported lazily at run time: `rolloutbus --help` stays fast
    from rolloutbus.consumers.groups import TrajectoryGroup

REPLICA_READY_TIMEOUT_S = 300.0  # seconds; the first run dequantizes SmolLM2 (~15 s) on 2 cores
DEMO_SUFFIX = "-demo"  # added to the topic prefix and to the workers' group ids
STOP_TIMEOUT_S = 30.0  # seconds a started process gets to stop on SIGTERM before SIGKILL
QUIET_LEVEL = "WARNING"  # the log level of the demo and its workers without -v


def run_demo(cfg: Config, *, rows: int, out: Path, timeout_s: float, verbose: bool = False) -> int:
    from rolloutbus.kafka.admin import ensure_topics
    from rolloutbus.models.tokenizers import load_tokenizer

    cfg = demo_config(cfg)
    if not verbose:  # the [demo] lines tell the story; warnings and errors still show
        logging.getLogger().setLevel(QUIET_LEVEL)
    _say(
        f"records go to topics {cfg.kafka.topic_prefix}.* (not the "
        f"{cfg.kafka.topic_prefix.removesuffix(DEMO_SUFFIX)}.* that `rolloutbus train` reads)"
    )
    started = contextlib.ExitStack()
    try:
        _maybe_start_broker(cfg, started)
        ensure_topics(cfg.kafka)
        tmp = Path(started.enter_context(tempfile.TemporaryDirectory(prefix="rolloutbus-demo-")))
        config_path = _write_config(cfg, tmp / "config.yaml")
        env = _worker_env(verbose)
        replica = _spawn("replica", ["replica", "serve"], config_path, env, started)
        _wait_for_replica(cfg.replicas.urls[0], replica)
        _spawn("sessions", ["sessions", "run"], config_path, env, started)
        _spawn("replay-buffer", ["replay-buffer", "run"], config_path, env, started)
        uids = _publish_demo_rows(cfg, rows, tmp / "arithmetic.jsonl")
        groups = _receive(cfg, set(uids), out, timeout_s, load_tokenizer(cfg.model))
        return _check_invariants(groups, len(uids))
    finally:
        with _signals_answered():
            started.close()


def demo_config(cfg: Config) -> Config:
    """``cfg`` with topics and consumer groups of the demo's own."""
    overrides = {
        "kafka.topic_prefix": cfg.kafka.topic_prefix + DEMO_SUFFIX,
        "sessions.app_id": cfg.sessions.app_id + DEMO_SUFFIX,
        "replay_buffer.group_id": cfg.replay_buffer.group_id + DEMO_SUFFIX,
    }
    if cfg.replay_buffer.transactional_id is not None:  # a pinned id would fence a real one
        overrides["replay_buffer.transactional_id"] = (
            cfg.replay_buffer.transactional_id + DEMO_SUFFIX
        )
    return with_overrides(cfg, overrides)


@contextlib.contextmanager
def _signals_answered() -> Iterator[None]:
    """While the demo stops what it started, Ctrl-C or SIGTERM again must not cut that
    short (a broker left running holds its ports and data dir)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        signal.signal(sig, _answer_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _answer_signal(signum: int, frame: object) -> None:
    # os.write, not print: a handler that interrupts a print to stderr must not re-enter it
    os.write(sys.stderr.fileno(), b"[demo] stopping what the demo started; one moment\n")


def _say(text: str) -> None:
    print(f"[demo] {text}", file=sys.stderr, flush=True)


def _maybe_start_broker(cfg: Config, started: contextlib.ExitStack) -> None:
    embedded = f"127.0.0.1:{cfg.broker.port}"
    if cfg.kafka.bootstrap_servers not in (embedded, f"localhost:{cfg.broker.port}"):
        _say(f"using the configured cluster at {cfg.kafka.bootstrap_servers}")
        return
    from rolloutbus.broker.embedded import broker_status, start_broker

    if broker_status(cfg).running:
        _say(f"broker already running at {embedded}; leaving it running afterwards")
        return
    _say("starting the embedded Kafka broker (first run fetches its jars from Maven Central)")
    # registered before the start: a signal during it must still stop the half-started JVM
    started.callback(_stop_broker, cfg)
    status = start_broker(cfg)
    _say(f"broker ready: pid {status.pid} at {status.bootstrap}")


def _stop_broker(cfg: Config) -> None:
    from rolloutbus.broker.embedded import stop_broker

    if stop_broker(cfg):
        _say("broker stopped")


def _write_config(cfg: Config, path: Path) -> Path:
    data = cfg.model_dump(mode="json")
    if cfg.kafka.sasl_password is not None:
        data["kafka"]["sasl_password"] = cfg.kafka.sasl_password.get_secret_value()
    path.write_text(yaml.safe_dump(data))
    return path


def _worker_env(verbose: bool) -> dict[str, str]:
    from rolloutbus.cli.console import LOG_LEVEL_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not verbose:
        env[LOG_LEVEL_ENV] = QUIET_LEVEL
    return env


def _spawn(
    name: str,
    argv: list[str],
    config_path: Path,
    env: dict[str, str],
    started: contextlib.ExitStack,
) -> subprocess.Popen:
    _say(f"starting {name}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutbus.cli", *argv, "--config", str(config_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=sys.stderr,
    )
    started.callback(_stop, proc)  # stopped in reverse order: workers before the broker
    return proc


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
    from rolloutbus.consumers.report import print_table, throwaway_group_id, write_arrow

    received: list[TrajectoryGroup] = []
    deadline = time.monotonic() + timeout_s
    # a group of its own that never commits: the demo only looks (see consumers.report)
    with TrainerClient(cfg.kafka, throwaway_group_id("demo")) as client:
        while len(received) < len(uids) and time.monotonic() < deadline:
            for group in client.groups(max_groups=1, timeout_s=5.0):
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
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
