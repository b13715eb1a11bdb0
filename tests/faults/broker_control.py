"""A broker of a scenario's own: started on free ports, stopped, or killed outright."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rolloutbus.broker.embedded import broker_status, start_broker, stop_broker
from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from rolloutbus.errors import BrokerError
from tests.helpers import free_port

PORT_RETRIES = 3  # a free port can be taken before the broker's JVM binds it
KILL_WAIT_S = 30.0  # seconds for a SIGKILLed JVM to be gone (the kernel frees its memory)


@contextmanager
def dedicated_broker(data_root: Path) -> Iterator[Config]:
    """A broker of its own on free ports (as tests/conftest.py starts the session's), for a
    scenario that stops and starts it; stopped at the end."""
    cfg = _start_dedicated(data_root)
    try:
        yield cfg
    finally:
        stop_broker(cfg)


def _start_dedicated(data_root: Path) -> Config:
    for attempt in range(PORT_RETRIES):
        port = controller = free_port()
        while controller == port:
            controller = free_port()
        broker = BrokerConfig(
            data_dir=data_root / f"kafka{attempt}",
            port=port,
            controller_port=controller,
            start_timeout_s=120.0,
        )
        cfg = Config(broker=broker, kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"))
        try:
            start_broker(cfg)
        except BrokerError as exc:
            if "already in use" in str(exc) and attempt < PORT_RETRIES - 1:
                continue
            raise
        return cfg
    raise AssertionError("unreachable")


def restart_broker(cfg: Config, outage_s: float) -> None:
    """A graceful stop (the broker writes its state and tells its clients), then a start."""
    stop_broker(cfg)
    time.sleep(outage_s)
    start_broker(cfg)


def kill_broker(cfg: Config, outage_s: float) -> None:
    """SIGKILL the broker's JVM (no shutdown of any kind: open transactions, unflushed log
    segments and coordinators are left as a power cut leaves them), then start it again."""
    pid = broker_status(cfg).pid
    if pid is None:
        raise AssertionError("the dedicated broker is not running: nothing to kill")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while broker_status(cfg).pid is not None:  # also reaps the JVM, which this process started
        if time.monotonic() > deadline:
            raise AssertionError(f"the broker's JVM {pid} outlived SIGKILL by {KILL_WAIT_S:.0f} s")
        time.sleep(0.2)
    time.sleep(outage_s)
    start_broker(cfg)


__all__ = ["dedicated_broker", "kill_broker", "restart_broker"]
