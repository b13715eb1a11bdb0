"""The replay buffer's fold alone, in one process: CPU per turn event of decoding, folding
and building the released groups' records, on the same events, rounds interleaved: the
pydantic decode and build (the baseline: ``wire=False``, ``columnar=False``); the columnar
build (``streams/assembly/columnar_fold.py``); the msgspec wire decode of token events
(``streams/assembly/fold_events.py``) with the pydantic build; both together, the offline
replay's default (the wire's numpy arrays kept through the fold into the Arrow columns);
that path returning its trajectories without token lists (``buffer``: the replay buffer's,
``finalize_group(token_lists=False)``); and that one without records (``replay-out``:
``replay --out``'s, ``records=False``: each row is encoded only where the group's bound
does not show that it fits the topic).

No broker: the events are ``tests/synthetic.py``'s (what the session runner logs with an
instant scripted replica, a test double), at two generation sizes, so the cost splits into
a part per event and a part per sampled token (the slope between the two sizes).

    python benchmarks/fold_cpu.py [--groups 300] [--rounds 5] [--tokens 128 1024] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_harness import machine_line

from rolloutbus.config import KafkaConfig, RolloutConfig
from rolloutbus.schemas.turns import Generation, decode_turn_event
from rolloutbus.streams.assembly.fold_events import decode_fold_event
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.trajectories import finalize_group, max_record_bytes
from tests.synthetic import make_events

LIMIT = max_record_bytes(KafkaConfig())  # records are checked against the topic's, as live

# path name -> (columnar build, wire decode, trajectories with token lists, records);
# "buffer" is the replay buffer's path, "wire+columnar" the offline replay's when it keeps
# trajectories, "replay-out" its path when it writes only the batches to a file
PATHS = {
    "pydantic": (False, False, True, True),
    "columnar": (True, False, True, True),
    "wire": (False, True, True, True),
    "wire+columnar": (True, True, True, True),
    "buffer": (True, True, False, True),
    "replay-out": (True, True, False, False),
}


def fold_cpu_s(values: list[bytes], path: tuple[bool, bool, bool, bool]) -> float:
    """CPU seconds to fold ``values`` and build every released group's records."""
    columnar, wire, token_lists, records = path
    rollout = RolloutConfig()
    fold = PartitionFold(0)
    started = time.process_time()
    for offset, value in enumerate(values):
        for group in fold.fold(offset, decode_fold_event(value, wire=wire)):
            finalize_group(
                group,
                rollout,
                max_record_bytes=LIMIT,
                columnar=columnar,
                token_lists=token_lists,
                records=records,
            )
    return time.process_time() - started


def sampled_tokens(values: list[bytes]) -> int:
    events = (decode_turn_event(v) for v in values)
    return sum(len(e.token_ids) for e in events if isinstance(e, Generation))


def measure(groups: int, tokens: int, rounds: int) -> dict[str, float]:
    values = [value for _, _, value in make_events(groups, tokens)]
    runs: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(rounds):
        for name, path in PATHS.items():
            runs[name].append(fold_cpu_s(values, path))
    per_event = {path: statistics.median(r) / len(values) * 1e6 for path, r in runs.items()}
    base = per_event["pydantic"]
    figures = ", ".join(
        f"{path} {us:.1f} µs/event ({us / base:.2f})" for path, us in per_event.items()
    )
    print(
        f"{tokens:>5} tokens/turn, {len(values)} events "
        f"({sampled_tokens(values) / len(values):.0f} sampled tokens/event): {figures}"
    )
    return {**per_event, "tokens": sampled_tokens(values) / len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs=2, default=[128, 1024])
    parser.add_argument("--quick", action="store_true", help="10 groups, 1 round (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.rounds = 10, 1
    print(machine_line())
    small, large = (measure(args.groups, t, args.rounds) for t in args.tokens)
    delta = large["tokens"] - small["tokens"]
    for path in PATHS:
        slope = (large[path] - small[path]) / delta * 1000
        print(f"{path}: {slope:.0f} ns per sampled token (slope between the two sizes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
