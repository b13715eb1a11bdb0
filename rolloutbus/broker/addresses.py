"""Where the embedded broker listens, checked before a JVM starts: an address clients can
connect to (never a wildcard: the broker advertises it), and ports that are free (a node
that just died may hold its own for a few seconds) and do not overlap across nodes."""

from __future__ import annotations

import ipaddress
import logging
import socket
import time

from rolloutbus.broker.properties import PORT_STRIDE, BrokerNode
from rolloutbus.config import LOOPBACK, Config
from rolloutbus.errors import BrokerError

__all__ = ["check_listen_address", "check_ports_free"]

log = logging.getLogger(__name__)

# seconds a restarted node waits for its ports: a killed JVM's sockets free them within ~1 s
RESTART_PORT_WAIT_S = 10.0


def check_listen_address(cfg: Config) -> None:
    """broker.host must be one address clients can reach; warn when it is open without SASL."""
    host = cfg.broker.host
    if _is_wildcard(host):
        raise BrokerError(
            f"broker.host {host!r} is a wildcard address: the broker advertises broker.host "
            "to its clients, so set the one address clients should connect to (e.g. this "
            "machine's LAN address), or 127.0.0.1"
        )
    if not _is_loopback(host) and not cfg.broker.sasl_users:
        log.warning(
            "the embedded broker listens on %s without authentication: anyone who "
            "reaches that address can read and write every topic (set broker.sasl_users)",
            host,
        )


def _is_wildcard(host: str) -> bool:
    return host in ("", "*") or _ip(host) in (
        ipaddress.ip_address("0.0.0.0"),
        ipaddress.ip_address("::"),
    )


def _is_loopback(host: str) -> bool:
    address = _ip(host)
    return host == "localhost" if address is None else address.is_loopback


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name


def check_ports_free(cfg: Config, nodes: list[BrokerNode], every_node: list[BrokerNode]) -> None:
    """Each of ``nodes``' ports free on its host (a node that ran before waits a moment
    for its own sockets), and no two of ``every_node``'s ports the same."""
    stride = f" + {PORT_STRIDE} x node index" if cfg.broker.nodes > 1 else ""
    for node in nodes:
        for name, host, port in (
            ("broker.port", cfg.broker.host, node.port),
            ("broker.controller_port", LOOPBACK, node.controller_port),
        ):
            if not _port_free(host, port, _restart_wait_s(node)):
                raise BrokerError(
                    f"port {port} on {host} ({name}{stride}, node {node.node_id}) is already "
                    "in use: stop what listens there (an earlier broker: `rolloutbus broker "
                    f"stop`) or set {name} to another port"
                )
    ports = [p for n in every_node for p in (n.port, n.controller_port)]
    if len(set(ports)) < len(ports):
        raise BrokerError(
            f"broker.port and broker.controller_port give the nodes overlapping ports {ports}: "
            f"node i uses port + {PORT_STRIDE}i and controller_port + {PORT_STRIDE}i"
        )


def _restart_wait_s(node: BrokerNode) -> float:
    """A node that ran before (its storage is formatted) may have died a moment ago: the
    sockets of its connections can hold its ports for a few seconds after a SIGKILL."""
    formatted = (node.data_dir / "kraft-logs" / "meta.properties").exists()
    return RESTART_PORT_WAIT_S if formatted else 0.0


def _port_free(host: str, port: int, wait_s: float = 0.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not _port_bindable(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _port_bindable(host: str, port: int) -> bool:
    # SO_REUSEADDR like the JVM's own server sockets: TIME_WAIT leftovers from a broker
    # that just stopped do not count as busy, a listening socket does.
    family = socket.AF_INET6 if isinstance(_ip(host), ipaddress.IPv6Address) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
