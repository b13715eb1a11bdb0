"""Compression of the trajectory records: what each codec costs in CPU and saves on disk.

For each codec in ``--codecs``: a turn log of ``--groups`` synthetic groups
(``tests/synthetic.py``: what the session runner logs, made with an instant scripted replica,
a test double) with ``--gen-tokens`` sampled tokens per turn, on topics of its own; one
``rolloutbus replay-buffer run`` process with ``replay_buffer.compression=CODEC`` folds it
until its committed offsets reach the end of the log; then a trainer client (this process)
receives every group. The same turn log for every codec.
The broker's CPU includes writing the turn log, the same for every codec.

Printed per codec, for the three processes that touch the records: the replay buffer's CPU
µs per turn event (it compresses), the broker's CPU µs per event over the same span (it
stores the batches as the producer compressed them), the trainer client's CPU µs per
trajectory (it decompresses); and the trajectory topic's bytes on disk (the broker's log
segments; only when this run started the broker), per trajectory and as a ratio to
``none``.

The synthetic log's sampled tokens are real text's: windows at seeded offsets of this
repository's docs and code run through the Qwen3 tokenizer (``tests/synthetic.py``'s
``VariedTokens``), with seeded logprobs (float32, mostly near 0 with a tail, like a model's).
The bytes saved are a property of the data (a run's own text may compress more or less);
the CPU costs are the codec's.

    python benchmarks/compression.py [--codecs none lz4 zstd] [--groups 500] [--gen-tokens 512]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench_harness import (
    ROOT,
    CpuMeter,
    add_common_args,
    broker,
    drop_topics,
    machine_line,
    produce_all,
    wait_assigned,
)
from capacity import _receive_all, _wait_folded

from rolloutbus.config import Config, KafkaConfig, ModelConfig, ReplayBufferConfig
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.topics import Topics
from tests.pipeline import spawn, stop, write_config
from tests.synthetic import N, VariedTokens, make_events

PARTITIONS = 2
SEED = 7  # of the varied tokens: every codec and every run folds the same log


@dataclass
class CodecRun:
    codec: str
    events: int
    trajectories: int
    buffer_cpu_s: float
    broker_cpu_s: float
    trainer_cpu_s: float
    disk_bytes: int | None

    def row(self, baseline: CodecRun) -> str:
        disk = (
            f"{self.disk_bytes / 1e6:>9.1f} {self.disk_bytes / self.trajectories:>10.0f} "
            f"{self.disk_bytes / baseline.disk_bytes:>6.2f}"
            if self.disk_bytes and baseline.disk_bytes
            else f"{'n/a':>9} {'n/a':>10} {'n/a':>6}"
        )
        return (
            f"{self.codec:<7} {self.buffer_cpu_s * 1e6 / self.events:>11.1f} "
            f"{self.broker_cpu_s * 1e6 / self.events:>11.1f} "
            f"{self.trainer_cpu_s * 1e6 / self.trajectories:>13.1f} {disk}"
        )


def run_codec(bus, codec: str, events, groups: int, work: Path) -> CodecRun:
    kafka = KafkaConfig(
        bootstrap_servers=bus.bootstrap,
        topic_prefix=f"cmp{codec}{uuid.uuid4().hex[:6]}",
        partitions=PARTITIONS,
    )
    group_id = f"{kafka.topic_prefix}-rb"
    cfg = Config(
        kafka=kafka, replay_buffer=ReplayBufferConfig(group_id=group_id, compression=codec)
    )
    topics = Topics.from_config(kafka)
    ensure_topics(kafka)
    proc = spawn(
        ["replay-buffer", "run"],
        write_config(cfg, work / f"{kafka.topic_prefix}.yaml"),
        work / f"{kafka.topic_prefix}.log",
    )
    try:
        wait_assigned(kafka, group_id, 1)  # its start-up is not the codec's cost
        meter = CpuMeter({"rb": proc.pid, "broker": bus.pid}).start()
        produce_all(kafka, topics.turns, events)
        _wait_folded(kafka, group_id)
        meter.stop()
        stop(proc)
        trainer = CpuMeter().start()
        trajectories = _receive_all(kafka, groups)
        trainer.stop()
        disk = topic_bytes_on_disk(bus.data, topics.trajectories)
    finally:
        stop(proc)
        drop_topics(kafka, topics.all())
    return CodecRun(
        codec,
        len(events),
        trajectories,
        meter.others_s["rb"],
        meter.others_s["broker"],
        trainer.own_s,
        disk,
    )


def topic_bytes_on_disk(data: Path | None, topic: str) -> int | None:
    """The bytes of ``topic``'s log segments under the broker's data folder."""
    if data is None:
        return None
    return sum(f.stat().st_size for f in data.glob(f"**/{topic}-*/*.log"))


def text_token_pool() -> list[int]:
    """Token ids of real text: the repository's docs and Python sources, Qwen3-tokenized."""
    tokenizer = load_tokenizer(ModelConfig(name="tiny-qwen3"))  # the real Qwen3 tokenizer
    files = sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("streams/**/*.py"))
    text = "\n".join(f.read_text() for f in files)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--codecs", nargs="+", default=["none", "lz4", "zstd"])
    ap.add_argument("--groups", type=int, default=500)
    ap.add_argument("--gen-tokens", type=int, default=512, help="sampled tokens per turn")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.groups, args.gen_tokens, args.codecs = 20, 64, ["none", "lz4"]
    if "none" not in args.codecs:
        args.codecs.insert(0, "none")  # the baseline of the ratios
    varied = VariedTokens(text_token_pool(), random.Random(SEED))
    events = make_events(args.groups, gen_tokens=args.gen_tokens, varied=varied)
    runs: dict[str, CodecRun] = {}
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        for codec in args.codecs:
            runs[codec] = run_codec(bus, codec, events, args.groups, Path(tmp))
            print(f"[compression] {codec} done", file=sys.stderr)
    print(
        f"{len(events)} turn events ({args.groups} groups x {N} sessions, {args.gen_tokens} "
        f"sampled tokens per turn); {machine_line()}"
    )
    print(
        f"{'codec':<7} {'rb us/event':>11} {'broker us/ev':>11} {'trainer us/traj':>13} "
        f"{'disk MB':>9} {'B/traj':>10} {'ratio':>6}"
    )
    for run in runs.values():
        print(run.row(runs["none"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
