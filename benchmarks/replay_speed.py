"""P5: ``rolloutbus replay`` of a large turn log against a plain consume of the same topic.

Writes ``--groups`` synthetic groups (``tests/synthetic.py``: what the session runner logs,
made with an instant scripted replica, a test double) to rollout.turns, then, in each
round, runs as child processes, one after the other:

* baseline: a plain confluent-kafka consumer reading every partition of the topic from its
  start to its end (``benchmarks/plain_consume.py``);
* replay: ``rolloutbus replay --out FILE``, which folds every partition into trajectories
  (the replay buffer's fold, checks and Arrow encoding) and writes them to an Arrow file.

Both pay a Python start; the replay also its imports. Printed: events/s (medians over
rounds), the ratio replay/baseline, and CPU µs per event of each child process. Then the
replay's peak RSS over the first quarter of each partition and over the whole log: a file
written as groups are released keeps it flat.

    python benchmarks/replay_speed.py [--groups 5000] [--rounds 3] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench_harness import add_common_args, broker, drop_topics, machine_line, median, produce_all

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.topics import Topics
from tests.pipeline import write_config
from tests.synthetic import N, make_events

CHUNK_GROUPS = 500  # groups generated and written at a time (bounded memory)
PARTITIONS = 2
PLAIN = Path(__file__).with_name("plain_consume.py")
# the command line in a child that prints its own peak RSS last on stderr (ru_maxrss, KiB)
RSS_CHILD = """import resource, sys
from rolloutbus.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


@dataclass
class Run:
    wall_s: float
    cpu_s: float


def timed_child(argv: list[str]) -> Run:
    """Run a child process to its end: its wall time and its CPU (user + system, from the
    rusage of waited-for children)."""
    before = os.times()
    started = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    after = os.times()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return Run(wall, cpu)


def replay_peak_rss_mb(config: Path, out: Path, *extra: str) -> float:
    argv = [sys.executable, "-c", RSS_CHILD, "replay", "--config", str(config), "--out", str(out)]
    done = subprocess.run([*argv, *extra], capture_output=True, text=True, check=True)
    return int(done.stderr.split()[-1]) / 1024


def write_log(kafka: KafkaConfig, groups: int) -> int:
    topic = Topics.from_config(kafka).turns
    events = 0
    for start in range(0, groups, CHUNK_GROUPS):
        chunk = make_events(min(CHUNK_GROUPS, groups - start))
        produce_all(kafka, topic, chunk)
        events += len(chunk)
    return events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.groups, args.rounds = 40, 1
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        kafka = KafkaConfig(
            bootstrap_servers=bus.bootstrap,
            topic_prefix=f"replay{uuid.uuid4().hex[:6]}",
            partitions=PARTITIONS,
        )
        ensure_topics(kafka)
        try:
            print(f"writing {args.groups} groups to the turn log", file=sys.stderr)
            events = write_log(kafka, args.groups)
            config = write_config(Config(kafka=kafka), Path(tmp) / "config.yaml")
            base, replay = [], []
            for r in range(args.rounds):
                turns = Topics.from_config(kafka).turns
                base.append(
                    timed_child([sys.executable, str(PLAIN), bus.bootstrap, turns, str(PARTITIONS)])
                )
                out = Path(tmp) / f"replay{r}.arrow"
                replay.append(
                    timed_child(
                        [
                            sys.executable,
                            "-m",
                            "rolloutbus.cli",
                            "replay",
                            "--config",
                            str(config),
                            "--out",
                            str(out),
                        ]
                    )
                )
                print(
                    f"round {r + 1}: replay {replay[-1].wall_s:.2f} s, "
                    f"plain consume {base[-1].wall_s:.2f} s",
                    file=sys.stderr,
                )
            quarter = str(events // PARTITIONS // 4)
            rss = [
                replay_peak_rss_mb(config, Path(tmp) / "rss.arrow", *extra)
                for extra in (("--end-offset", quarter), ())
            ]
        finally:
            drop_topics(kafka, Topics.from_config(kafka).all())
    print(
        f"turn log: {events} events, {args.groups} groups ({args.groups * N} trajectories), "
        f"rounds: {args.rounds}; {machine_line()}"
    )
    print(f"{'path':<44} {'events/s':>9} {'CPU us/event':>13}")
    for label, runs in (
        ("plain confluent-kafka consume (baseline)", base),
        ("rolloutbus replay --out FILE", replay),
    ):
        wall, cpu = median([r.wall_s for r in runs]), median([r.cpu_s for r in runs])
        print(f"{label:<44} {events / wall:>9.0f} {cpu * 1e6 / events:>13.1f}")
    ratio = median([r.wall_s for r in base]) / median([r.wall_s for r in replay])
    print(f"ratio replay/baseline throughput: {ratio:.2f} (goal >= 0.4)")
    print(
        f"replay peak RSS: {rss[0]:.0f} MB over a quarter of the log, {rss[1]:.0f} MB over "
        f"all of it ({rss[1] / rss[0]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
