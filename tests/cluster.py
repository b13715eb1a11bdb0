"""A local 3-node KRaft cluster for tests: the embedded broker with ``broker.nodes: 3``.

Three combined broker+controller JVMs on loopback, from the same jars as the session
broker, each with its own ports and data dir; heaps small (256 MB each: six JVMs on two
shared cores is what CI can afford). ``with local_cluster(root) as cfg:`` yields the
Config whose ``kafka.bootstrap_servers`` names all three nodes; every node is stopped at
the end (SIGTERM, then SIGKILL), also when the test fails.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rolloutbus.broker.embedded import broker_status, start_broker, stop_broker
from rolloutbus.broker.properties import PORT_STRIDE
from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from rolloutbus.errors import BrokerError
from tests.helpers import free_port
from tests.session_broker import watch_for_killed_session

NODES = 3
HEAP = "256m"  # per node: a dev cluster's metadata and a few thousand small records
START_TIMEOUT_S = 240.0  # seconds: three JVMs starting at once on two busy cores
PORT_TRIES = 20  # draws of a base port whose strided neighbours are free too
START_RETRIES = 3  # a free port can be taken before a JVM binds it


def _strided_free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` ports base, base+2, ... that nothing listens on now (and not in ``taken``)."""
    for _ in range(PORT_TRIES):
        base = free_port()
        ports = [base + PORT_STRIDE * i for i in range(count)]
        if taken.isdisjoint(ports) and all(_bindable(p) for p in ports[1:]):
            return ports
    raise AssertionError(f"no {count} free ports {PORT_STRIDE} apart in {PORT_TRIES} draws")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_config(data_dir: Path, nodes: int = NODES, **broker: Any) -> Config:
    ports = _strided_free_ports(nodes, set())
    controllers = _strided_free_ports(nodes, set(ports))
    cfg = BrokerConfig(
        data_dir=data_dir,
        port=ports[0],
        controller_port=controllers[0],
        nodes=nodes,
        heap=HEAP,
        start_timeout_s=START_TIMEOUT_S,
        **broker,
    )
    bootstrap = ",".join(f"127.0.0.1:{p}" for p in ports)
    return Config(broker=cfg, kafka=KafkaConfig(bootstrap_servers=bootstrap))


@contextmanager
def local_cluster(data_root: Path, nodes: int = NODES, **broker: Any) -> Iterator[Config]:
    cfg = None
    for attempt in range(START_RETRIES):
        cfg = cluster_config(data_root / f"cluster{attempt}", nodes, **broker)
        try:
            start_broker(cfg)
            break
        except BrokerError as exc:
            stop_broker(cfg)
            if "already in use" not in str(exc) or attempt == START_RETRIES - 1:
                raise
    assert cfg is not None
    for pid in broker_status(cfg).node_pids:
        watch_for_killed_session(pid)
    try:
        yield cfg
    finally:
        stop_broker(cfg)
