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
import fcntl
import hashlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaException

from rolloutbus.config import LOOPBACK, Config, KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import admin_client

__all__ = [
    "BrokerStatus",
    "broker_status",
    "fetch_kafka_jars",
    "java_major_version",
    "kafka_libs_dir",
    "parse_java_major",
    "server_properties",
    "start_broker",
    "stop_broker",
]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
POM_PATH = REPO_ROOT / "ops" / "kafka" / "pom.xml"
LOG4J_CONFIG = REPO_ROOT / "ops" / "kafka" / "log4j2.yaml"
MIN_JAVA = 17  # Kafka 4.x brokers need Java 17+ (Java 11 is for clients only)
KAFKA_MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL_CLASS = "kafka.tools.StorageTool"

STOP_TIMEOUT_S = 30.0  # seconds; a clean single-node shutdown takes ~1-5 s, then SIGKILL
FORMAT_TIMEOUT_S = 120.0  # seconds; one short JVM run, slow only on a starved machine
FETCH_TIMEOUT_S = 900.0  # seconds; ~25 MB of jars from Maven Central on a slow link
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
# Listener names: the client listener is named after its security protocol (Kafka's own
# convention), so the default map entry and the listener-scoped SASL keys line up.
PLAIN_LISTENER = "PLAINTEXT"
SASL_LISTENER = "SASL_PLAINTEXT"
CONTROLLER_LISTENER = "CONTROLLER"

# Brokers this process launched: kept so that they can be reaped (no zombies) and so that
# Popen never warns "subprocess still running" about a broker meant to outlive a call.
_launched: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class BrokerStatus:
    running: bool  # the JVM is alive and answers Kafka metadata requests
    pid: int | None  # the JVM's pid while it is alive (also when not yet answering)
    bootstrap: str  # host:port for bootstrap.servers
    data_dir: Path


# --- jars -------------------------------------------------------------------------------


def kafka_libs_dir() -> Path:
    """Where the broker's jars live: ``<repo root>/.cache/kafka/libs`` (git-ignored)."""
    return REPO_ROOT / ".cache" / "kafka" / "libs"


def fetch_kafka_jars(quiet: bool = True) -> Path:
    """Copy Kafka's runtime jars from Maven into :func:`kafka_libs_dir`, once per pom.

    A marker file keyed on the pom's hash records a finished fetch; a changed pom fetches
    into a fresh folder and replaces the old one, so two Kafka versions never share a
    classpath. A file lock makes concurrent callers (parallel test sessions) wait.
    """
    libs = kafka_libs_dir()
    marker = libs / f".fetched-{_pom_hash()}"
    if marker.exists():
        return libs
    java_major_version()  # Maven needs Java too; say so before Maven fails obscurely
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "`mvn` not found on PATH: the embedded broker's jars are fetched with Maven "
            "(install Maven 3.8+, e.g. `apt-get install maven`), or point "
            "kafka.bootstrap_servers at an existing Kafka cluster"
        )
    libs.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(libs.parent / "fetch.lock"):
        if marker.exists():  # another process fetched while we waited for the lock
            return libs
        _run_maven_copy(mvn, libs, quiet)
        marker.touch()
    return libs


def _pom_hash() -> str:
    if not POM_PATH.exists():
        raise BrokerError(
            f"{POM_PATH} is missing: the embedded broker needs the repository's ops/ folder"
        )
    return hashlib.sha256(POM_PATH.read_bytes()).hexdigest()[:16]


def _run_maven_copy(mvn: str, libs: Path, quiet: bool) -> None:
    staging = libs.with_name(libs.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [
        mvn,
        *(["-q"] if quiet else []),
        "-B",
        "-f",
        str(POM_PATH),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]
    try:
        result = subprocess.run(cmd, capture_output=quiet, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(
            f"fetching Kafka jars with Maven took over {FETCH_TIMEOUT_S:.0f} s"
        ) from exc
    if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        output = _tail_text((result.stdout or "") + (result.stderr or ""), LOG_TAIL_LINES)
        raise BrokerError(
            f"fetching Kafka jars failed (exit {result.returncode}): {' '.join(cmd)}\n{output}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def java_major_version() -> int:
    """The major version of ``java`` on PATH; BrokerError if missing or older than 17."""
    java = shutil.which("java")
    if java is None:
        raise BrokerError(
            f"`java` not found on PATH: the embedded Kafka broker needs Java {MIN_JAVA}+ "
            "(e.g. `apt-get install openjdk-17-jre-headless`), or point "
            "kafka.bootstrap_servers at an existing Kafka cluster"
        )
    result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    major = parse_java_major(result.stderr + result.stdout)
    if major is None:
        raise BrokerError(
            f"cannot read the Java version from `java -version`: {result.stderr.strip()!r}"
        )
    if major < MIN_JAVA:
        raise BrokerError(
            f"Java {major} found at {java}, but Kafka 4.x brokers need Java {MIN_JAVA}+ "
            "(e.g. `apt-get install openjdk-17-jre-headless`)"
        )
    return major


def parse_java_major(version_output: str) -> int | None:
    """17 from 'openjdk version "17.0.15"', 8 from 'java version "1.8.0_392"'."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2):  # the pre-9 "1.x" scheme
        major = int(match.group(2))
    return major


# --- status -----------------------------------------------------------------------------


def broker_status(cfg: Config) -> BrokerStatus:
    """Whether the broker of ``cfg.broker.data_dir`` is alive and answering."""
    data_dir = _data_dir(cfg)
    pid = _live_broker_pid(data_dir)
    bootstrap = _bootstrap(cfg)
    running = pid is not None and _answers(cfg)
    return BrokerStatus(running=running, pid=pid, bootstrap=bootstrap, data_dir=data_dir)


def _data_dir(cfg: Config) -> Path:
    return cfg.broker.data_dir.expanduser().resolve()


def _bootstrap(cfg: Config) -> str:
    return f"{cfg.broker.host}:{cfg.broker.port}"


def _client_listener(cfg: Config) -> str:
    return SASL_LISTENER if cfg.broker.sasl_users else PLAIN_LISTENER


def _probe_config(cfg: Config) -> KafkaConfig:
    """How the broker's own tooling (the readiness probe) connects: as the first SASL user
    when there are users, else in plaintext; never from ``cfg.kafka``, which may name
    another cluster or a client with fewer rights."""
    bootstrap = _bootstrap(cfg)
    if not cfg.broker.sasl_users:
        return KafkaConfig(bootstrap_servers=bootstrap)
    name, password = next(iter(cfg.broker.sasl_users.items()))
    return KafkaConfig(
        bootstrap_servers=bootstrap,
        security_protocol=SASL_LISTENER,
        sasl_mechanism=cfg.broker.sasl_mechanism,
        sasl_username=name,
        sasl_password=password,
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


def _answers(cfg: Config, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    probe = _probe_config(cfg)
    if not _port_accepts(
        probe.bootstrap_servers
    ):  # cheap check first: librdkafka logs refused connects
        return False
    # log_level 0 keeps the refused connects of a broker still starting out of the log
    admin = admin_client(probe, {"log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException:
        return False  # not answering yet: a readiness probe, not an error
    return True


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

    1. A broker already running from this data dir is returned as is.
    2. Both ports must be free, else BrokerError naming the port.
    3. Jars are fetched once; server.properties is written; storage is formatted once.
    4. The JVM starts detached (its own session), logging into data_dir/logs.
    5. Wait until ``AdminClient.list_topics`` answers, up to ``broker.start_timeout_s``.
    """
    data_dir = _data_dir(cfg)
    pid = _live_broker_pid(data_dir)
    if pid is not None:  # 1. alive: it is running or still starting; never start twice
        return _wait_until_ready(cfg, pid)
    _check_listen_address(cfg)
    _check_ports_free(cfg)  # 2.
    java_major_version()
    libs = fetch_kafka_jars()  # 3.
    properties = _write_server_properties(cfg, data_dir)
    _format_storage_once(libs, properties, data_dir)
    pid = _launch_jvm(cfg, libs, properties, data_dir)  # 4.
    return _wait_until_ready(cfg, pid)  # 5.


def _check_listen_address(cfg: Config) -> None:
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


def _check_ports_free(cfg: Config) -> None:
    for name, host, port in (
        ("broker.port", cfg.broker.host, cfg.broker.port),
        ("broker.controller_port", LOOPBACK, cfg.broker.controller_port),
    ):
        if not _port_free(host, port):
            raise BrokerError(
                f"port {port} on {host} ({name}) is already in use: stop what listens "
                f"there (an earlier broker: `rolloutbus broker stop`) or set {name} to "
                "another port"
            )
    if cfg.broker.port == cfg.broker.controller_port:
        raise BrokerError(f"broker.port and broker.controller_port are both {cfg.broker.port}")


def _port_free(host: str, port: int) -> bool:
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


def server_properties(cfg: Config, data_dir: Path) -> str:
    """The single-node broker+controller config (KRaft) for ``cfg``.

    With ``broker.sasl_users`` the text holds their passwords: write it where only the
    owner can read it (``_write_server_properties`` does).
    """
    port, cport = cfg.broker.port, cfg.broker.controller_port
    client = _client_listener(cfg)
    client_url = f"{client}://{cfg.broker.host}:{port}"
    controller_url = f"{CONTROLLER_LISTENER}://{LOOPBACK}:{cport}"
    # bytes; topic max.message.bytes is set per topic (rolloutbus.kafka.admin), this is the
    # broker default and the cap that replica fetches and socket requests must exceed.
    max_bytes = max(cfg.kafka.max_message_bytes, 1048588)
    request_max = max(104857600, max_bytes + 1048576)  # bytes; Kafka's default 100 MiB
    lines = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"{LOOPBACK}:{cport}",  # dynamic quorum (KIP-853)
        "listeners": f"{client_url},{controller_url}",
        "advertised.listeners": f"{client_url},{controller_url}",
        "controller.listener.names": CONTROLLER_LISTENER,
        # the broker reaches itself on the client listener (transaction markers to the
        # partition leaders): with SASL, as the first user (_sasl_properties)
        "inter.broker.listener.name": client,
        "listener.security.protocol.map": f"{CONTROLLER_LISTENER}:PLAINTEXT,{client}:{client}",
        **_sasl_properties(cfg),
        "log.dirs": str(data_dir / "kraft-logs"),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",  # topics come from rolloutbus.kafka.admin only
        "message.max.bytes": str(max_bytes),
        "replica.fetch.max.bytes": str(max_bytes),
        "socket.request.max.bytes": str(request_max),
        # One node: every internal topic has one replica.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # Dev speed: no 3 s wait before the first rebalance, and one partition per internal
        # topic instead of 50 (each partition is files and a coordinator load on start).
        "group.initial.rebalance.delay.ms": "0",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.num.partitions": "1",
    }
    header = (
        "# Written by rolloutbus.kafka.broker on every start; edit the config, not this file.\n"
    )
    return header + "".join(f"{key}={value}\n" for key, value in lines.items())


def _sasl_properties(cfg: Config) -> dict[str, str]:
    """SASL/PLAIN on the client listener: one ``user_NAME="PASSWORD"`` per user, and the
    first user's ``username``/``password`` for the broker's connections to itself.
    Names and passwords are checked JAAS-safe by BrokerConfig."""
    users = cfg.broker.sasl_users
    if not users:
        return {}
    mechanism = cfg.broker.sasl_mechanism
    own_name, own_password = next(iter(users.items()))
    entries = [
        f'username="{own_name}"',
        f'password="{own_password.get_secret_value()}"',
        *(f'user_{name}="{password.get_secret_value()}"' for name, password in users.items()),
    ]
    jaas = f"org.apache.kafka.common.security.plain.PlainLoginModule required {' '.join(entries)};"
    prefix = f"listener.name.{SASL_LISTENER.lower()}.{mechanism.lower()}"
    return {
        "sasl.enabled.mechanisms": mechanism,
        "sasl.mechanism.inter.broker.protocol": mechanism,
        f"{prefix}.sasl.jaas.config": jaas,
    }


def _write_server_properties(cfg: Config, data_dir: Path) -> Path:
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = data_dir / "server.properties"
    # created 0600 before any secret is written into it (SASL passwords)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file keeps its mode through O_TRUNC
    with os.fdopen(fd, "w") as handle:
        handle.write(server_properties(cfg, data_dir))
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


def _format_storage_once(libs: Path, properties: Path, data_dir: Path) -> None:
    if (data_dir / "kraft-logs" / "meta.properties").exists():
        return
    cluster_id = _random_cluster_id()
    cmd = [
        *_java_command(libs, data_dir),
        STORAGE_TOOL_CLASS,
        "format",
        "--standalone",
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


def _wait_until_ready(cfg: Config, pid: int) -> BrokerStatus:
    data_dir, bootstrap = _data_dir(cfg), _bootstrap(cfg)
    deadline = time.monotonic() + cfg.broker.start_timeout_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            _pid_file(data_dir).unlink(missing_ok=True)
            raise BrokerError(
                f"the Kafka broker (pid {pid}) exited during start-up; last lines of its log:\n"
                + _broker_log_tail(data_dir)
            )
        if _answers(cfg):
            return BrokerStatus(running=True, pid=pid, bootstrap=bootstrap, data_dir=data_dir)
        time.sleep(0.2)
    _terminate(pid, data_dir)  # a half-started JVM would hold the ports and the data dir
    raise BrokerError(
        f"the Kafka broker (pid {pid}) did not answer on {bootstrap} within "
        f"{cfg.broker.start_timeout_s:.0f} s (broker.start_timeout_s); it was stopped. "
        "Last lines of its log:\n" + _broker_log_tail(data_dir)
    )


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
    """Stop the broker of ``cfg.broker.data_dir``: SIGTERM, then SIGKILL after 30 s.

    Returns True if a broker was running and is now stopped, False if none was running.
    """
    data_dir = _data_dir(cfg)
    pid = _live_broker_pid(data_dir)
    if pid is None:
        _pid_file(data_dir).unlink(missing_ok=True)  # stale: the JVM died on its own
        return False
    _terminate(pid, data_dir)
    return True


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
