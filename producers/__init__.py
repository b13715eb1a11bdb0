"""What enters: dataset rows published as prompt groups; bad input to the dead-letter topic."""

from rolloutbus.producers.datasets import make_arithmetic_rows, read_rows, write_jsonl
from rolloutbus.producers.dlq import DeadLetterWriter
from rolloutbus.producers.publish import PromptPublisher, PublishReport, build_group, new_uid

__all__ = ["DeadLetterWriter", "PromptPublisher", "PublishReport", "build_group",
           "make_arithmetic_rows", "new_uid", "read_rows", "write_jsonl"]
