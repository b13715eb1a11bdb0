"""The embedded Kafka broker: a real Apache Kafka 4.x node, on 127.0.0.1 by default.

One JVM is broker and KRaft controller at once. Its jars come from Maven Central through
``ops/kafka/pom.xml`` into ``.cache/kafka/libs``; its data (``log.dirs``), config, pid
file and logs live in ``broker.data_dir``, so topics and records survive a restart.

Security: the client listener binds ``broker.host`` (loopback unless configured) and is
PLAINTEXT, or ``SASL_PLAINTEXT`` when ``broker.sasl_users`` is set (mechanism PLAIN; the
first user is the broker's own identity). The controller listener is PLAINTEXT on
127.0.0.1 only. ``server.properties`` then holds the passwords: it is written mode 0600.

This is a convenience for one machine and for tests. A user with their own cluster sets
``kafka.bootstrap_servers`` and never calls anything here; nothing else in Rollout Bus
depends on this module.

Layout of ``data_dir``::

    server.properties   written on every start from the config (mode 0600)
    kraft-logs/         log.dirs and the KRaft metadata log (formatted once)
    logs/server.log     the broker's own log (log4j2, ops/kafka/log4j2.yaml)
    logs/stdout.log     the JVM's stdout and stderr
    broker.pid          while running
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException

from rolloutbus.broker.addresses import check_listen_address, check_ports_free
from rolloutbus.broker.jars import fetch_kafka_jars, java_major_version
from rolloutbus.broker.properties import (
    SASL_LISTENER,
    BrokerNode,
    broker_nodes,
    server_properties,
)
from rolloutbus.config import Config, KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import admin_client

__all__ = [
    "BrokerStatus",
    "admin_kafka_config",
    "broker_status",
    "kill_node",
    "node_pid",
    "server_properties",
    "start_broker",
    "stop_broker",
]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG4J_CONFIG = REPO_ROOT / "ops" / "kafka" / "log4j2.yaml"
KAFKA_MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL_CLASS = "kafka.tools.StorageTool"

STOP_TIMEOUT_S = 30.0  # seconds; a clean single-node shutdown takes ~1-5 s, then SIGKILL
FORMAT_TIMEOUT_S = 120.0  # seconds; one short JVM run, slow only on a starved machine
PROBE_TIMEOUT_S = 1.0  # seconds per readiness probe (AdminClient.list_topics)
LOG_TAIL_LINES = 30  # lines of the broker log quoted in a start failure

# The same flags as Kafka's kafka-run-class.sh, for the same reasons (short GC pauses).
JVM_FLAGS = [
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
]
_HEAP_RE = re.compile(r"^\d+[kKmMgG]?$")

# Brokers this process launched: kept so that they can be reaped (no zombies) and so that
# Popen never warns "subprocess still running" about a broker meant to outlive a call.
_launched: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class BrokerStatus:
    running: bool  # the JVM is alive and answers Kafka metadata requests
    pid: int | None  # the JVM's pid while it is alive (also when not yet answering)
    bootstrap: str  # host:port for bootstrap.servers
    data_dir: Path
    # every node's pid while alive, in node order (one entry for a single node)
    node_pids: tuple[int | None, ...] = field(default=(), compare=False)


# --- status -----------------------------------------------------------------------------


def broker_status(cfg: Config) -> BrokerStatus:
    """Whether the broker of ``cfg.broker.data_dir`` (every node of it) is alive and answering."""
    cfg = _as_on_disk(cfg)
    nodes = broker_nodes(cfg, _data_dir(cfg))
    pids = tuple(_live_broker_pid(node.data_dir) for node in nodes)
    running = all(pid is not None for pid in pids) and all(_answers(cfg, n) for n in nodes)
    return BrokerStatus(
        running=running,
        pid=pids[0],
        bootstrap=_bootstrap(cfg),
        data_dir=_data_dir(cfg),
        node_pids=pids,
    )


def node_pid(cfg: Config, node_id: int) -> int | None:
    """The JVM pid of node ``node_id`` (1-based) while it is alive (fault tests kill it)."""
    node = broker_nodes(cfg, _data_dir(cfg))[node_id - 1]
    return _live_broker_pid(node.data_dir)


def _data_dir(cfg: Config) -> Path:
    return cfg.broker.data_dir.expanduser().resolve()


def _as_on_disk(cfg: Config) -> Config:
    """``cfg`` with broker.nodes as its data dir holds them, so that ``stop`` and ``status``
    find a cluster started with ``--nodes 3`` without being told again."""
    data_dir = _data_dir(cfg)
    formatted = sorted(data_dir.glob("node*/kraft-logs/meta.properties"))
    if cfg.broker.nodes != 1 or not formatted or (data_dir / "kraft-logs").exists():
        return cfg
    broker = cfg.broker.model_copy(update={"nodes": len(formatted)})
    return cfg.model_copy(update={"broker": broker})


def _check_layout(cfg: Config) -> None:
    """One data dir holds one node or one cluster, never both: each has its own cluster id
    and ports, and starting the other kind over it would strand the first."""
    data_dir = _data_dir(cfg)
    single = (data_dir / "kraft-logs" / "meta.properties").exists()
    cluster = len(list(data_dir.glob("node*/kraft-logs/meta.properties")))
    if (cfg.broker.nodes == 1 and cluster) or (cfg.broker.nodes > 1 and single):
        holds = f"a {cluster}-node cluster" if cluster else "a single node"
        raise BrokerError(
            f"{data_dir} holds {holds}, but broker.nodes is {cfg.broker.nodes}: start it with "
            "the node count it was made with (--nodes), or use another broker.data_dir"
        )


def _node_address(cfg: Config, node: BrokerNode) -> str:
    return f"{cfg.broker.host}:{node.port}"


def _bootstrap(cfg: Config) -> str:
    """host:port of every node, comma-separated: bootstrap.servers for clients."""
    return ",".join(_node_address(cfg, n) for n in broker_nodes(cfg, _data_dir(cfg)))


def admin_kafka_config(cfg: Config, bootstrap: str | None = None) -> KafkaConfig:
    """How the broker's own tooling (readiness probe, topics and ACLs at start) connects:
    as the first SASL user when there are users (the super user with ``broker.acls``), else
    in plaintext; ``cfg.kafka``'s topic and sizing settings, never its credentials, which
    may be a client's with fewer rights."""
    base = cfg.kafka.model_copy(
        update={
            "bootstrap_servers": bootstrap or _bootstrap(cfg),
            "security_protocol": None,
            "sasl_mechanism": None,
            "sasl_username": None,
            "sasl_password": None,
            "ssl_ca_location": None,
        }
    )
    if not cfg.broker.sasl_users:
        return base
    name, password = next(iter(cfg.broker.sasl_users.items()))
    return base.model_copy(
        update={
            "security_protocol": SASL_LISTENER,
            "sasl_mechanism": cfg.broker.sasl_mechanism,
            "sasl_username": name,
            "sasl_password": password,
        }
    )


def _pid_file(data_dir: Path) -> Path:
    return data_dir / "broker.pid"


def _live_broker_pid(data_dir: Path) -> int | None:
    """The pid in the pid file if that process is alive and is a Kafka JVM, else None."""
    try:
        pid = int(_pid_file(data_dir).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not _pid_alive(pid) or not _is_kafka_process(pid):
        return None
    return pid


def _pid_alive(pid: int) -> bool:
    proc = _launched.get(pid)
    if proc is not None and proc.poll() is not None:  # our child, now exited and reaped
        _launched.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (not Linux) or already gone: trust os.kill
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def _is_kafka_process(pid: int) -> bool:
    """Guards against a recycled pid; without /proc (not Linux) the pid file is trusted."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return True
    return KAFKA_MAIN_CLASS.encode() in cmdline.split(b"\0")


def _answers(cfg: Config, node: BrokerNode, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``node`` itself answers a metadata request (not merely another node)."""
    probe = admin_kafka_config(cfg, _node_address(cfg, node))
    return _cluster_size(probe, timeout_s) is not None


def _cluster_size(probe: KafkaConfig, timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The brokers in the metadata of the node(s) ``probe`` names; None if none answers."""
    if not _port_accepts(probe.bootstrap_servers.split(",")[0]):
        return None  # cheap check first: librdkafka logs refused connects
    # log_level 0 keeps the refused connects of a broker still starting out of the log
    admin = admin_client(probe, {"log_level": 0})
    try:
        return len(admin.list_topics(timeout=timeout_s).brokers)
    except KafkaException:
        return None  # not answering yet: a readiness probe, not an error


def _port_accepts(bootstrap: str) -> bool:
    host, port = bootstrap.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


# --- start ------------------------------------------------------------------------------


def start_broker(cfg: Config) -> BrokerStatus:
    """Start the embedded broker (or find it running) and wait until it answers.

    1. Nodes already running from their data dirs are left as they are; only the others
       start (a cluster with one node killed gets that node back).
    2. Their ports must be free, else BrokerError naming the port.
    3. Jars are fetched once; server.properties is written; storage is formatted once,
       with one cluster id for every node.
    4. The JVMs start detached (their own session), logging into their data dirs' logs.
    5. Wait until every node answers and, for a cluster, sees every other node, up to
       ``broker.start_timeout_s``.
    """
    _check_layout(cfg)
    data_dir = _data_dir(cfg)
    nodes = broker_nodes(cfg, data_dir)
    pids = {node.node_id: _live_broker_pid(node.data_dir) for node in nodes}
    todo = [node for node in nodes if pids[node.node_id] is None]  # 1.
    launched: list[int] = []
    if todo:
        check_listen_address(cfg)
        check_ports_free(cfg, todo, broker_nodes(cfg, _data_dir(cfg)))  # 2.
        java_major_version()
        libs = fetch_kafka_jars()  # 3.
        cluster_id = _cluster_id(nodes)
        for node in todo:
            properties = _write_server_properties(cfg, node, nodes)
            _format_storage_once(libs, properties, node.data_dir, cluster_id, len(nodes) == 1)
        for node in todo:  # 4.
            pid = _launch_jvm(cfg, libs, node.data_dir / "server.properties", node.data_dir)
            pids[node.node_id] = pid
            launched.append(pid)
    return _wait_until_ready(cfg, nodes, pids, launched)  # 5.


def _write_server_properties(cfg: Config, node: BrokerNode, nodes: list[BrokerNode]) -> Path:
    (node.data_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = node.data_dir / "server.properties"
    # created 0600 before any secret is written into it (SASL passwords)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file keeps its mode through O_TRUNC
    with os.fdopen(fd, "w") as handle:
        handle.write(server_properties(cfg, node.data_dir, node, nodes))
    return path


def _java_command(libs: Path, data_dir: Path, heap: str | None = None) -> list[str]:
    heap_flags = [f"-Xms{heap}", f"-Xmx{heap}"] if heap else ["-Xmx256m"]  # tools: 256m
    return [
        "java",
        *heap_flags,
        *JVM_FLAGS,
        f"-Dkafka.logs.dir={data_dir / 'logs'}",
        f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
        "-cp",
        f"{libs}/*",
    ]


def _cluster_id(nodes: list[BrokerNode]) -> str:
    """The id every node is formatted with: an already formatted node's, else a new one."""
    for node in nodes:
        meta = node.data_dir / "kraft-logs" / "meta.properties"
        if meta.exists():
            for line in meta.read_text().splitlines():
                if line.startswith("cluster.id="):
                    return line.split("=", 1)[1].strip()
    return _random_cluster_id()


def _format_storage_once(
    libs: Path, properties: Path, data_dir: Path, cluster_id: str, standalone: bool = True
) -> None:
    if (data_dir / "kraft-logs" / "meta.properties").exists():
        return
    cmd = [
        *_java_command(libs, data_dir),
        STORAGE_TOOL_CLASS,
        "format",
        # one node: a dynamic quorum of itself; a cluster: the static controller.quorum.voters
        *(["--standalone"] if standalone else []),
        "-t",
        cluster_id,
        "-c",
        str(properties),
        "--ignore-formatted",
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=FORMAT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(
            f"formatting KRaft storage in {data_dir} took over {FORMAT_TIMEOUT_S:.0f} s"
        ) from exc
    if result.returncode != 0:
        output = _tail_text(result.stdout + result.stderr, LOG_TAIL_LINES)
        raise BrokerError(
            f"formatting KRaft storage in {data_dir} failed (exit {result.returncode}):\n{output}"
        )


def _random_cluster_id() -> str:
    """16 random bytes, base64url without padding (Kafka's Uuid format), made here to spare a
    JVM start for `StorageTool random-uuid`. Like Kafka's Uuid.randomUuid, never one that
    starts with "-": the storage tool's argument parser would take it for an option
    ("argument --cluster-id/-t: expected one argument"), one start in 64."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _launch_jvm(cfg: Config, libs: Path, properties: Path, data_dir: Path) -> int:
    heap = cfg.broker.heap
    if not _HEAP_RE.match(heap):
        raise BrokerError(f"broker.heap {heap!r} is not a JVM size such as 512m or 1g")
    cmd = [*_java_command(libs, data_dir, heap), KAFKA_MAIN_CLASS, str(properties)]
    with open(data_dir / "logs" / "stdout.log", "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            start_new_session=True,  # Ctrl-C in our terminal does not reach it
        )
    _launched[proc.pid] = proc
    _pid_file(data_dir).write_text(f"{proc.pid}\n")
    return proc.pid


def _wait_until_ready(
    cfg: Config, nodes: list[BrokerNode], pids: dict[int, int | None], launched: list[int]
) -> BrokerStatus:
    bootstrap = _bootstrap(cfg)
    deadline = time.monotonic() + cfg.broker.start_timeout_s
    while time.monotonic() < deadline:
        for node in nodes:
            pid = pids[node.node_id]
            if pid is None or not _pid_alive(pid):
                _pid_file(node.data_dir).unlink(missing_ok=True)
                _stop_launched(nodes, pids, launched)
                raise BrokerError(
                    f"the Kafka broker (pid {pid}, node {node.node_id}) exited during "
                    "start-up; last lines of its log:\n" + _broker_log_tail(node.data_dir)
                )
        if _cluster_ready(cfg, nodes):
            return BrokerStatus(
                running=True,
                pid=pids[nodes[0].node_id],
                bootstrap=bootstrap,
                data_dir=_data_dir(cfg),
                node_pids=tuple(pids[n.node_id] for n in nodes),
            )
        time.sleep(0.2)
    _stop_launched(nodes, pids, launched)  # half-started JVMs would hold ports and data dirs
    raise BrokerError(
        f"the Kafka broker did not answer on {bootstrap} within "
        f"{cfg.broker.start_timeout_s:.0f} s (broker.start_timeout_s); the nodes started by "
        "this call were stopped. Last lines of the first node's log:\n"
        + _broker_log_tail(nodes[0].data_dir)
    )


def _cluster_ready(cfg: Config, nodes: list[BrokerNode]) -> bool:
    """Every node answers, each sees all of them registered (a topic with three replicas
    can be created only then)."""
    for node in nodes:
        size = _cluster_size(admin_kafka_config(cfg, _node_address(cfg, node)))
        if size is None or size < len(nodes):
            return False
    return True


def _stop_launched(
    nodes: list[BrokerNode], pids: dict[int, int | None], launched: list[int]
) -> None:
    for node in nodes:
        pid = pids[node.node_id]
        if pid is not None and pid in launched and _pid_alive(pid):
            _terminate(pid, node.data_dir)


def _broker_log_tail(data_dir: Path) -> str:
    # stdout.log holds the JVM's own errors and the broker's WARN/ERROR lines (the
    # console appender's threshold); server.log adds INFO, mostly a config dump.
    logs = data_dir / "logs"
    stdout_log = logs / "stdout.log"
    tail = (
        _tail_text(stdout_log.read_text(errors="replace"), LOG_TAIL_LINES)
        if stdout_log.exists()
        else ""
    )
    return f"--- {stdout_log} ---\n{tail or '(empty)'}\n--- full log: {logs / 'server.log'}"


def _tail_text(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# --- stop -------------------------------------------------------------------------------


def stop_broker(cfg: Config) -> bool:
    """Stop every node of the broker of ``cfg.broker.data_dir``: SIGTERM to all at once
    (a cluster shuts down together, no node waits on a quorum already gone), then SIGKILL
    to any still alive after 30 s.

    Returns True if a node was running and every node is now stopped, False if none was.
    """
    cfg = _as_on_disk(cfg)
    nodes = broker_nodes(cfg, _data_dir(cfg))
    running = [(node, _live_broker_pid(node.data_dir)) for node in nodes]
    for node, pid in running:
        if pid is None:
            _pid_file(node.data_dir).unlink(missing_ok=True)  # stale: the JVM died on its own
    alive = [(node, pid) for node, pid in running if pid is not None]
    for _, pid in alive:
        _signal(pid, signal.SIGTERM)  # Kafka's shutdown hook: controlled shutdown, clean logs
    for node, pid in alive:
        _terminate(pid, node.data_dir)
    return bool(alive)


def kill_node(cfg: Config, node_id: int) -> int:
    """SIGKILL node ``node_id`` (1-based) of a running broker, as a crash would; returns
    its pid. For fault tests; ``start_broker`` brings it back."""
    node = broker_nodes(cfg, _data_dir(cfg))[node_id - 1]
    pid = _live_broker_pid(node.data_dir)
    if pid is None:
        raise BrokerError(f"node {node_id} of the broker in {_data_dir(cfg)} is not running")
    _signal(pid, signal.SIGKILL)
    if not _wait_for_exit(pid, 10.0):  # seconds; SIGKILL cannot be ignored
        raise BrokerError(f"the Kafka broker (pid {pid}) did not exit after SIGKILL")
    _pid_file(node.data_dir).unlink(missing_ok=True)
    return pid


def _terminate(pid: int, data_dir: Path) -> None:
    _signal(pid, signal.SIGTERM)  # Kafka's shutdown hook: controlled shutdown, clean logs
    if not _wait_for_exit(pid, STOP_TIMEOUT_S):
        _signal(pid, signal.SIGKILL)
        if not _wait_for_exit(pid, 10.0):  # seconds; SIGKILL cannot be ignored
            raise BrokerError(f"the Kafka broker (pid {pid}) did not exit after SIGKILL")
    _pid_file(data_dir).unlink(missing_ok=True)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_for_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.1)
    return not _pid_alive(pid)
