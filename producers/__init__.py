"""What enters: dataset rows published as prompt groups (bad rows go to the dead-letter
topic through ``rolloutbus.kafka.dead_letters``)."""

from rolloutbus.producers.datasets import make_arithmetic_rows, read_rows, write_jsonl
from rolloutbus.producers.publish import PromptPublisher, PublishReport, build_group, new_uid

__all__ = [
    "PromptPublisher",
    "PublishReport",
    "build_group",
    "make_arithmetic_rows",
    "new_uid",
    "read_rows",
    "write_jsonl",
]
