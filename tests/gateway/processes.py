"""The gateway tests' setup: the scripted replica behind the replica's own HTTP server in a
thread of the test process, with the gateway beside it either in a thread too
(``gateway_stack``) or as a real process for the restart tests (test_gateway.py's OpenAI
agent, test_gateway_anthropic.py's Anthropic agent: ``gateway_processes``), started through
the ``rolloutbus`` command line on a fixed port, SIGKILLed and started again on the same
port, and a session worker beside it. ``gateway_config`` is their config."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.replica.generation import Engine
from rolloutbus.replica.server import ReplicaHandle, replica_in_thread
from rolloutbus.streams.gateway import GatewayHandle, gateway_in_thread
from tests.helpers import free_port, unique_name
from tests.pipeline import spawn, stop, wait_http_ok, write_config

WORKER_SCAN_TIMEOUT_S = 180.0  # seconds: Faust's start and the turn-log scan on 2 cores
# tokens: a short reply's budget (the agent tests, with a tool call and its answer, ask more)
SHORT_ROLLOUT = {"prompt_length": 512, "response_length": 128}


def gateway_config(
    bootstrap: str,
    replica_url: str,
    topic_prefix: str,
    *,
    rollout: dict[str, int] = SHORT_ROLLOUT,
    gateway: dict[str, Any] | None = None,
    **sections: Any,
) -> Config:
    """A gateway test's config: topics of 2 partitions under a new ``topic_prefix``, new
    session app and replay-buffer ids, tiny-qwen3's tokenizer, ``replica_url`` the one
    replica, the gateway on any free port (``gateway`` adds to its section, ``sections``
    to the top level)."""
    return Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": bootstrap,
                "topic_prefix": unique_name(topic_prefix),
                "partitions": 2,
            },
            "model": {"name": "tiny-qwen3"},
            "replicas": {"urls": [replica_url]},
            "rollout": rollout,
            "gateway": {"port": 0, **(gateway or {})},
            "sessions": {"app_id": unique_name("s")},
            "replay_buffer": {"group_id": unique_name("rb"), "transactional_id": unique_name("tx")},
            **sections,
        }
    )


@contextmanager
def _replica_and_topics(
    engine: Engine, make_config: Callable[[str], Config]
) -> Iterator[tuple[Config, ReplicaHandle]]:
    """``engine`` behind the replica's own HTTP server (in this process) and the config
    ``make_config`` makes for the replica's URL, its topics made."""
    with replica_in_thread(
        Config.model_validate({"replica_server": {"port": 0}}), engine
    ) as replica:
        cfg = make_config(replica.url)
        ensure_topics(cfg.kafka)
        yield cfg, replica


@contextmanager
def gateway_stack(
    engine: Engine, make_config: Callable[[str], Config]
) -> Iterator[tuple[Config, GatewayHandle]]:
    """``engine`` behind the replica's own HTTP server and the gateway, each in a thread of
    this process, on the config ``make_config`` makes for the replica's URL (its topics
    made); on the way out it stops the gateway, then the replica."""
    with _replica_and_topics(engine, make_config) as (cfg, _), gateway_in_thread(cfg) as gateway:
        yield cfg, gateway


def on_a_fixed_port(cfg: Config, tmp: Path) -> tuple[Config, Path, str]:
    """``cfg`` with the gateway on a free port that a restarted gateway takes again: the
    config, its file for the processes, and the gateway's URL."""
    port = free_port()
    gateway = cfg.gateway.model_copy(update={"port": port})
    cfg = cfg.model_copy(update={"gateway": gateway})
    return cfg, write_config(cfg, tmp / "config.yaml"), f"http://127.0.0.1:{port}"


class Processes:
    """The gateway and session worker processes of a restart test."""

    def __init__(self, config: Path, tmp: Path, url: str):
        self.config, self.tmp, self.url = config, tmp, url
        self.gateway: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.starts = 0

    def start_gateway(self) -> None:
        self.starts += 1
        log = self.tmp / f"gateway{self.starts}.log"
        self.gateway = spawn(["gateway"], self.config, log)
        wait_http_ok(f"{self.url}/health", self.gateway, log)

    def crash_and_restart_gateway(self) -> None:
        assert self.gateway is not None, "start_gateway first"
        os.kill(self.gateway.pid, signal.SIGKILL)
        self.gateway.wait()
        self.start_gateway()

    def start_session_worker(self) -> None:
        log = self.tmp / "sessions.log"
        self.worker = spawn(["sessions", "run"], self.config, log)
        deadline = time.monotonic() + WORKER_SCAN_TIMEOUT_S
        while log.read_text().count("events scanned") < 2:  # both partitions scanned
            assert self.worker.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the session worker did not scan the turn log"
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in (self.worker, self.gateway):
            if proc is not None:
                stop(proc)


@contextmanager
def gateway_processes(
    engine: Engine, make_config: Callable[[str], Config], tmp: Path
) -> Iterator[tuple[Config, Processes]]:
    """``engine`` behind the replica's own HTTP server (in this process), the config that
    ``make_config`` makes for the replica's URL with the gateway on a fixed port
    (``on_a_fixed_port``) and its topics made, and the restart test's processes on it, none
    started yet; on the way out it stops the processes, then the replica."""
    with _replica_and_topics(engine, make_config) as (cfg, _):
        cfg, config, url = on_a_fixed_port(cfg, tmp)
        procs = Processes(config, tmp, url)
        try:
            yield cfg, procs
        finally:
            procs.stop()
