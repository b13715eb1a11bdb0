"""The baseline of ``replay_speed.py``: a plain confluent-kafka consume of every partition of
a topic, from its start to its end; prints the records read. A script of its own, so that
its process imports nothing but confluent-kafka (not a benchmark: it has no --quick).

    python benchmarks/plain_consume.py BOOTSTRAP TOPIC PARTITIONS
"""

from __future__ import annotations

import sys
import uuid

from confluent_kafka import Consumer, TopicPartition

CONSUME_BATCH = 1000  # records per consume() call
# seconds one consume() call may wait for its batch to fill: short, since consume() waits for
# a whole batch or the timeout, and the last batch is short
CONSUME_WAIT_S = 0.1


def plain_consume(bootstrap: str, topic: str, partitions: int) -> int:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"plain-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    ends = {
        p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
        for p in range(partitions)
    }
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions) if ends[p] > 0])
    done = {p for p, end in ends.items() if end == 0}
    count = 0
    while len(done) < partitions:
        for msg in consumer.consume(CONSUME_BATCH, CONSUME_WAIT_S):
            if msg.error() is None:
                count += 1
                if msg.offset() + 1 >= ends[msg.partition()]:
                    done.add(msg.partition())
            else:
                done.add(msg.partition())  # the end of the partition
    consumer.close()
    return count


if __name__ == "__main__":
    print(plain_consume(sys.argv[1], sys.argv[2], int(sys.argv[3])))
