"""The gateway as a real process for the restart tests (test_gateway.py's OpenAI agent,
test_gateway_anthropic.py's Anthropic agent): started through the ``rolloutbus`` command
line on a fixed port, SIGKILLed and started again on the same port, and a session worker
beside it; ``gateway_processes`` sets up both tests alike."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.replica.generation import Engine
from rolloutbus.replica.server import replica_in_thread
from tests.helpers import free_port
from tests.pipeline import spawn, stop, wait_http_ok, write_config

WORKER_SCAN_TIMEOUT_S = 180.0  # seconds: Faust's start and the turn-log scan on 2 cores


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
    with replica_in_thread(
        Config.model_validate({"replica_server": {"port": 0}}), engine
    ) as replica:
        cfg, config, url = on_a_fixed_port(make_config(replica.url), tmp)
        ensure_topics(cfg.kafka)
        procs = Processes(config, tmp, url)
        try:
            yield cfg, procs
        finally:
            procs.stop()
