"""An idempotent confluent-kafka producer for asyncio code: ``await send(...)`` returns the
offset once the record is durably written (acks=all), or raises ``BrokerError``.

The session worker writes the turn log through this rather than through Faust's aiokafka
producer: Faust enables idempotence only in its own (experimental) transaction mode, and a
retried send without idempotence can put a turn event in the log twice. Delivery reports
come from librdkafka's thread; a small poll thread hands them to the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message

from rolloutbus.config import KafkaConfig
from rolloutbus.kafka.clients import broker_error, idempotent_producer

POLL_S = 0.05  # seconds; delivery-report latency added to every send
FLUSH_TIMEOUT_S = 30.0  # seconds to drain on close; a record not written by then is lost
# A record is retried by librdkafka until this many ms have passed, then reported failed:
# long enough to ride out a broker restart on a busy two-core machine.
DELIVERY_TIMEOUT_MS = 120_000


class AsyncProducer:
    def __init__(self, kafka: KafkaConfig, *, overrides: dict[str, Any] | None = None):
        self._producer = idempotent_producer(
            kafka, {"linger.ms": 2, "delivery.timeout.ms": DELIVERY_TIMEOUT_MS, **(overrides or {})}
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._poll_forever, name="turn-log-producer", daemon=True
        )
        self._thread.start()

    async def send(self, topic: str, *, key: bytes, value: bytes, partition: int) -> int:
        """Write one record; returns its offset once every in-sync replica has it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            loop.call_soon_threadsafe(_settle, done, err, msg, topic, partition)

        while True:
            try:
                self._producer.produce(
                    topic, key=key, value=value, partition=partition, on_delivery=on_delivery
                )
                break
            except BufferError:
                await asyncio.sleep(POLL_S)  # local queue full: wait for deliveries
            except KafkaException as exc:
                raise broker_error(exc, "producing", topic=topic, partition=partition) from exc
        return await done

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> int:
        """Wait until every queued record is delivered; returns how many are still queued."""
        return self._producer.flush(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._producer.flush(FLUSH_TIMEOUT_S)

    def _poll_forever(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(POLL_S)


def _settle(
    done: asyncio.Future[int], err: KafkaError | None, msg: Message, topic: str, partition: int
) -> None:
    if done.done():
        return
    if err is not None:
        done.set_exception(broker_error(err, "producing", topic=topic, partition=partition))
    else:
        offset = msg.offset()
        done.set_result(offset if offset is not None else -1)
