"""librdkafka's repeated lines are shown once per window per client, with a count
(rolloutbus/kafka/repeated_lines.py): unit tests on a clock of our own, and a real client
that cannot reach its broker."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from rolloutbus.config import KafkaConfig
from rolloutbus.kafka.clients import LIBRDKAFKA_LOGGER, read_committed_consumer
from rolloutbus.kafka.repeated_lines import RepeatedLines


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _refused(client: str, after_ms: int, level: int = logging.ERROR) -> logging.LogRecord:
    text = f"[thrd:127.0.0.1:9/bootstrap]: Connect to ipv4#127.0.0.1:9 failed: Connection refused (after {after_ms}ms in state CONNECT)"  # noqa: E501
    return logging.LogRecord(
        "librdkafka", level, __file__, 1, "%s [%s] %s", ("FAIL", client, text), None
    )


def _shown(lines: RepeatedLines, records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if lines.filter(r)]


def test_a_repeated_line_is_shown_once_per_window_then_with_the_count_held_back():
    clock = _Clock()
    lines = RepeatedLines(window_s=30.0, clock=clock)
    first = _shown(lines, [_refused("rdkafka#consumer-1", ms) for ms in (0, 1, 0)])
    assert len(first) == 1 and "after 0ms" in first[0]
    clock.now += 29.0
    assert _shown(lines, [_refused("rdkafka#consumer-1", 3)]) == []
    clock.now += 1.0
    [again] = _shown(lines, [_refused("rdkafka#consumer-1", 4)])
    assert again.endswith("(after 4ms in state CONNECT) (3 more like it in the last 30 s)")
    assert _shown(lines, [_refused("rdkafka#consumer-1", 5)]) == []  # a new window
    clock.now += 45.0
    [later] = _shown(lines, [_refused("rdkafka#consumer-1", 6)])
    assert later.endswith("(1 more like it in the last 45 s)")  # the count starts again


def test_each_client_and_each_kind_of_line_has_its_own_window():
    lines = RepeatedLines(window_s=30.0, clock=_Clock())
    other_kind = logging.LogRecord(
        "librdkafka", logging.WARNING, __file__, 1, "%s [%s] %s",
        ("GETPID", "rdkafka#producer-3", "Coordinator load in progress: retrying"), None,
    )  # fmt: skip
    shown = _shown(
        lines,
        [_refused("rdkafka#consumer-1", 0), _refused("rdkafka#consumer-2", 0), other_kind] * 5,
    )
    assert len(shown) == 3


def test_on_a_handler_only_the_named_libraries_are_held_back():
    lines = RepeatedLines(window_s=30.0, clock=_Clock(), loggers=("aiokafka",))

    def line(name: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, "Unable to update", (), None)

    records = [line("aiokafka"), line("aiokafka.consumer.fetcher"), line("aiokafkax")] * 4
    shown = [r.name for r in records if lines.filter(r)]
    assert shown == ["aiokafka", "aiokafka.consumer.fetcher"] + ["aiokafkax"] * 4


def test_lines_below_warning_all_pass():
    """-v asks for librdkafka's debug lines: nothing of theirs is held back."""
    lines = RepeatedLines(window_s=30.0, clock=_Clock())
    records = [_refused("rdkafka#consumer-1", 0, level=logging.DEBUG) for _ in range(5)]
    assert len(_shown(lines, records)) == 5


def test_a_client_without_a_broker_logs_one_refused_line_not_one_per_reconnect(
    caplog: pytest.LogCaptureFixture,
):
    """A real consumer pointed at a port nothing listens on reconnects every 50-80 ms, each
    time logging "Connection refused" (about 25 lines in 2 s without the filter)."""
    caplog.set_level(logging.WARNING, logger=LIBRDKAFKA_LOGGER.name)
    # a port bound and held but never listened on refuses every connect, and no other test
    # can start a server on it meanwhile
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        kafka = KafkaConfig(bootstrap_servers=f"127.0.0.1:{held.getsockname()[1]}")
        consumer = read_committed_consumer(kafka, "repeated-lines")
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                consumer.poll(0.1)  # confluent-kafka hands log lines over inside poll()
        finally:
            consumer.close()
    refused = [r for r in caplog.records if "Connection refused" in r.getMessage()]
    assert len(refused) == 1, caplog.text
