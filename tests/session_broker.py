"""The test session's Kafka broker: the embedded broker on free ports with its data in a
temporary folder (``tests/conftest.py``'s ``embedded_broker``; the security and cluster
tests start theirs the same way), and a watchdog that stops it if the session is killed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rolloutbus.broker.embedded import start_broker
from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from rolloutbus.errors import BrokerError
from tests.helpers import free_port

__all__ = ["embedded_config", "reap_watchdogs", "start_on_free_ports", "watch_for_killed_session"]

PORT_RETRIES = 3  # a free port can be taken by another process before the JVM binds it
WATCHDOG_EXIT_S = 10.0  # seconds; the watchdog polls once a second


def start_on_free_ports(tmp_path_factory: pytest.TempPathFactory) -> Config:
    # A free port can be taken by another process before the JVM binds it: retry then,
    # with fresh ports and a fresh data dir (KRaft storage records the controller port).
    for _ in range(PORT_RETRIES - 1):
        cfg = embedded_config(tmp_path_factory)
        try:
            start_broker(cfg)
        except BrokerError as exc:
            if "already in use" not in str(exc):
                raise
            continue
        return cfg
    cfg = embedded_config(tmp_path_factory)
    start_broker(cfg)
    return cfg


def embedded_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    port = controller_port = free_port()
    while controller_port == port:  # the OS may hand out a just-released port again
        controller_port = free_port()
    broker = BrokerConfig(
        data_dir=tmp_path_factory.mktemp("kafka"),
        port=port,
        controller_port=controller_port,
        start_timeout_s=120.0,  # seconds; two cores shared with other test sessions
    )
    return Config(broker=broker, kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"))


# The broker runs detached, so a test session killed with SIGKILL (a CI timeout, the OOM
# killer) would leave it behind. This watchdog, a detached Python process of its own,
# sends it SIGTERM once the session's pid is gone; it exits when the broker does.
_WATCHDOG = """
import os, signal, sys, time
session, jvm = int(sys.argv[1]), int(sys.argv[2])
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
while alive(jvm):
    if not alive(session):
        os.kill(jvm, signal.SIGTERM)
        break
    time.sleep(1.0)
"""


_watchdogs: list[subprocess.Popen[bytes]] = []  # referenced, so never collected while running


def watch_for_killed_session(jvm_pid: int | None) -> None:
    if jvm_pid is None:
        return
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(jvm_pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _watchdogs.append(watchdog)


def reap_watchdogs() -> None:
    """The broker is stopped, so each watchdog exits at its next poll: wait for it (a
    process never waited for is a ResourceWarning, an error in this suite)."""
    for watchdog in _watchdogs:
        try:
            watchdog.wait(timeout=WATCHDOG_EXIT_S)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()
