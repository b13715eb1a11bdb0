"""What the benchmarks share: the broker they run on, CPU accounting, the machine line and
quantiles.

Every benchmark takes ``--bootstrap HOST:PORT`` (a running broker) or starts the embedded
broker on free ports in a temporary folder, and stops it only after every client it made
was closed: a librdkafka client that outlives its broker fills stderr with connection
errors. ``--quick`` is each benchmark's smallest size (``tests/cli/test_benchmarks.py`` runs
every benchmark at it, so none rots).

CPU is counted as user + system seconds: of this process (``resource``: every thread,
librdkafka's included), of the child processes a benchmark starts (``psutil``), and of
the broker's JVM when the benchmark started it. On a shared machine wall-clock figures
swing by 2x from run to run; CPU per unit of work and ratios measured in one run do not.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the repository: synthetic events, free ports, the harness

from rolloutbus.config import BrokerConfig, Config, KafkaConfig  # noqa: E402
from rolloutbus.errors import BrokerError  # noqa: E402
from rolloutbus.kafka.clients import admin_client, idempotent_producer  # noqa: E402
from rolloutbus.topics import partition_for  # noqa: E402
from tests.helpers import free_port  # noqa: E402

PORT_RETRIES = 3  # a free port can be taken by another process before the JVM binds it
ADMIN_DRAIN_S = 0.5  # seconds an admin client serves its queue after deleting topics
READY_TIMEOUT_S = 300.0  # seconds for k replay buffers to start and share the partitions


@dataclass(frozen=True)
class Broker:
    bootstrap: str
    pid: int | None  # the JVM's pid when this run started it (its CPU is then reported)
    data: Path | None = None  # its data folder when this run started it (bytes on disk)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap", default=None, help="a running broker (default: start one on free ports)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="the smallest size: checks the benchmark runs"
    )


@contextmanager
def broker(bootstrap: str | None) -> Iterator[Broker]:
    """``bootstrap``'s broker, or the embedded one started on free ports for the run."""
    if bootstrap is not None:
        yield Broker(bootstrap, None)
        return
    from rolloutbus.broker.embedded import start_broker, stop_broker

    data = Path(tempfile.mkdtemp(prefix="rolloutbus-bench-"))
    cfg, pid = _start_on_free_ports(data, start_broker)
    print(f"started a broker on {cfg.kafka.bootstrap_servers}", file=sys.stderr)
    try:
        yield Broker(cfg.kafka.bootstrap_servers, pid, data)
    finally:
        gc.collect()  # clients the benchmark dropped are destroyed while their broker runs
        stop_broker(cfg)
        shutil.rmtree(data, ignore_errors=True)


def _start_on_free_ports(data: Path, start_broker) -> tuple[Config, int | None]:
    for attempt in range(PORT_RETRIES):
        port = controller = free_port()
        while controller == port:
            controller = free_port()
        cfg = Config(
            broker=BrokerConfig(
                data_dir=data / f"kafka{attempt}", port=port, controller_port=controller
            ),
            kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"),
        )
        try:
            return cfg, start_broker(cfg).pid
        except BrokerError as exc:
            if "already in use" not in str(exc) or attempt == PORT_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def drop_topics(kafka: KafkaConfig, names: Sequence[str]) -> None:
    """Delete topics (a missing one is no error), then serve the admin client's last events
    before it goes: dropped at once, librdkafka logs that it purged them."""
    from confluent_kafka import KafkaError, KafkaException

    admin = admin_client(kafka)
    for future in admin.delete_topics(list(names), operation_timeout=30).values():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
    admin.poll(ADMIN_DRAIN_S)


# -- writing and reading ------------------------------------------------------------------


def produce_all(kafka: KafkaConfig, topic: str, events: list[tuple[str, str, bytes]]) -> None:
    """Write ``(uid, key, value)`` events to their uid's partitions, as fast as a producer can."""
    p = idempotent_producer(kafka, {"linger.ms": 5})  # ms of batching, as the replay buffer does
    for uid, key, value in events:
        while True:
            try:
                p.produce(
                    topic, key=key, value=value, partition=partition_for(uid, kafka.partitions)
                )
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    p.flush(60)


def wait_assigned(kafka: KafkaConfig, group_id: str, members: int) -> None:
    """Until the group has ``members`` members and every partition is assigned."""
    admin = admin_client(kafka)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        [future] = admin.describe_consumer_groups([group_id]).values()
        try:
            group = future.result()
        except Exception:  # noqa: BLE001 - not known yet: keep waiting
            time.sleep(1.0)
            continue
        assigned = sum(len(m.assignment.topic_partitions) for m in group.members)
        if len(group.members) == members and assigned == kafka.partitions:
            admin.poll(0.5)
            return
        time.sleep(1.0)
    raise SystemExit(f"{members} replay buffers did not share the partitions")


# -- CPU -------------------------------------------------------------------------------


def own_cpu_s() -> float:
    """User + system seconds of this process so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pid_cpu_s(pid: int | None) -> float:
    """User + system seconds of process ``pid`` so far (0 when it is gone or None)."""
    if pid is None:
        return 0.0
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


@dataclass
class CpuMeter:
    """CPU seconds spent between ``start()`` and ``stop()``: this process, and each of
    ``pids`` (child processes, the broker) by name."""

    pids: dict[str, int | None] = field(default_factory=dict)
    own_s: float = 0.0
    others_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    _t0: tuple[float, float, dict[str, float]] | None = None

    def start(self) -> CpuMeter:
        self._t0 = (
            time.perf_counter(),
            own_cpu_s(),
            {name: pid_cpu_s(pid) for name, pid in self.pids.items()},
        )
        return self

    def stop(self) -> CpuMeter:
        assert self._t0 is not None, "CpuMeter.stop() before start()"
        wall0, own0, others0 = self._t0
        self.wall_s = time.perf_counter() - wall0
        self.own_s = own_cpu_s() - own0
        self.others_s = {name: pid_cpu_s(pid) - others0[name] for name, pid in self.pids.items()}
        return self


# -- reporting ---------------------------------------------------------------------------


def machine_line() -> str:
    """The machine and how loaded it was (1-minute load average against its cores)."""
    load1, load5, _ = os.getloadavg()
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load1:.1f} (1 min) / {load5:.1f} (5 min)"
    )


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, by linear interpolation between ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
