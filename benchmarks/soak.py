"""Soak: steady load on the whole pipeline for a while, watching memory and open groups.

A dispatcher thread publishes prompt groups of the seeded paced loop
(``tests/plugins/seeded_paced_loop.py``) at a fixed rate while real processes run them:
one embedded replica (tiny-qwen3), ``--session-workers`` session workers and
``--replay-buffers`` replay buffers, each started through the ``rolloutbus`` command
line and supervised by the fault harness (``tests/faults/``). Every
``--interval`` seconds it samples the resident memory of each process (VmRSS from
/proc/PID/status) and, from each replay buffer's /metrics, the open groups
(``rolloutbus_replay_buffer_open_groups``) and the groups released.

At the end it compares the first and the last quarter of the run: median RSS per process
and median open groups, with their ratio (last / first). A ratio well above 1 under
steady load is a leak (memory) or a backlog (open groups); a backlog also shows when the
rate is above what the replica can serve, so pick a rate the machine keeps up with.

    python benchmarks/soak.py [--minutes 30] [--rate 0.5] [--bootstrap HOST:PORT] [--quick]

Without --bootstrap it starts the embedded broker on free ports in a temporary folder.
Progress goes to stderr; the samples and the summary go to stdout. Exit code 0 when the
run completed with no process exiting, 1 when a process exited (restarted by the
supervisor: its RSS series restarts too) or the pipeline failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: ``tests``
from rolloutbus.errors import RolloutBusError  # noqa: E402
from rolloutbus.producers.publish import PromptPublisher, build_group  # noqa: E402
from tests.faults import Pipeline, Service, Workload, dedicated_broker  # noqa: E402

OPEN_GROUPS = "rolloutbus_replay_buffer_open_groups"
GROUPS_RELEASED = "rolloutbus_replay_buffer_groups_released_total"
METRICS_TIMEOUT_S = 5.0  # seconds; a /metrics page is a few kB served from memory
FLUSH_EVERY = 10  # groups published between producer flushes
QUICK_MINUTES, QUICK_INTERVAL_S = 20 / 60, 5.0  # --quick: 20 s, a sample every 5 s


@dataclass
class Sample:
    t_s: float
    published: int
    released: int
    open_groups: int
    rss_mb: dict[str, float] = field(default_factory=dict)


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (VmRSS), or NaN once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    except (FileNotFoundError, ProcessLookupError):
        pass
    return float("nan")


def buffer_metrics(buffer: Service) -> tuple[int, int] | None:
    """(open groups, groups released) from one replay buffer's /metrics; None if unreachable
    (a buffer restarting)."""
    try:
        text = httpx.get(
            f"http://127.0.0.1:{buffer.metrics_port}/metrics", timeout=METRICS_TIMEOUT_S
        ).text
    except httpx.HTTPError:
        return None
    values = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    return int(values.get(OPEN_GROUPS, 0)), int(values.get(GROUPS_RELEASED, 0))


class Dispatcher(threading.Thread):
    """Publishes one group every 1/rate seconds until stopped."""

    def __init__(self, pipeline: Pipeline, workload: Workload, rate: float):
        super().__init__(name="dispatcher", daemon=True)
        self.pipeline, self.workload, self.period_s = pipeline, workload, 1.0 / rate
        self.published = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        publisher = PromptPublisher(self.pipeline.cfg)
        template = self.workload.rows()[0]
        started = time.monotonic()
        try:
            while not self._halt.wait(
                max(0.0, started + self.published * self.period_s - time.monotonic())
            ):
                row = {
                    **template,
                    "uid": f"soak{self.published:08d}",
                    "prompt": [{"role": "user", "content": f"count to {self.published}"}],
                }
                publisher.publish_group(build_group(self.pipeline.cfg, row))
                self.published += 1
                if self.published % FLUSH_EVERY == 0:
                    publisher.flush()
            publisher.flush()
        except (RolloutBusError, ValueError) as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(30)


def sample(pipeline: Pipeline, dispatcher: Dispatcher, t0: float) -> Sample:
    open_groups = released = 0
    for buffer in pipeline.buffers:
        metrics = buffer_metrics(buffer)
        if metrics is None:
            print(f"[soak] {buffer.name}: /metrics unreachable", file=sys.stderr)
            continue
        open_groups, released = open_groups + metrics[0], released + metrics[1]
    rss = {s.name: rss_mb(s.popen.pid) for s in pipeline.services() if s.popen is not None}
    return Sample(time.monotonic() - t0, dispatcher.published, released, open_groups, rss)


def progress_line(s: Sample) -> str:
    rss = "  ".join(f"{name} {mb:.0f}" for name, mb in s.rss_mb.items())
    return (
        f"[soak] {s.t_s:6.0f} s  published {s.published}  released {s.released}  "
        f"open {s.open_groups}  RSS MiB: {rss}"
    )


def quarter_medians(samples: list[Sample], value) -> tuple[float, float]:
    """Medians of ``value(sample)`` over the first and the last quarter of the run."""
    end = samples[-1].t_s
    first = [value(s) for s in samples if s.t_s <= end / 4] or [value(samples[0])]
    last = [value(s) for s in samples if s.t_s >= 3 * end / 4] or [value(samples[-1])]
    return statistics.median(first), statistics.median(last)


def report(samples: list[Sample], restarts: int, out=sys.stdout) -> None:
    names = list(samples[0].rss_mb)
    print(
        "t_s  published  released  open_groups  " + "  ".join(f"rss_mb_{n}" for n in names),
        file=out,
    )
    for s in samples:
        print(
            f"{s.t_s:.0f}  {s.published}  {s.released}  {s.open_groups}  "
            + "  ".join(f"{s.rss_mb.get(n, float('nan')):.1f}" for n in names),
            file=out,
        )
    print(file=out)
    print(f"{'series':28s} {'first quarter':>14s} {'last quarter':>13s} {'ratio':>7s}", file=out)
    series = [(f"rss_mb {n}", lambda s, n=n: s.rss_mb.get(n, float("nan"))) for n in names]
    series.append(("open groups", lambda s: s.open_groups))
    for label, value in series:
        first, last = quarter_medians(samples, value)
        ratio = f"{last / first:.2f}" if first else "-"
        print(f"{label:28s} {first:14.1f} {last:13.1f} {ratio:>7s}", file=out)
    span = samples[-1].t_s - samples[0].t_s
    rate = (samples[-1].released - samples[0].released) / span if span else 0.0
    print(
        f"\ngroups published {samples[-1].published}, released {samples[-1].released} "
        f"({rate:.2f}/s over the run), process restarts {restarts}",
        file=out,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30.0, help="how long to load (default 30)")
    p.add_argument("--rate", type=float, default=0.5, help="groups published per second (0.5)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples (30)")
    p.add_argument("--n", type=int, default=4, help="sessions per group (4)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (3)")
    p.add_argument("--tokens-per-turn", type=int, default=4, help="tokens sampled per turn (4)")
    p.add_argument("--tool-delay", type=float, default=0.5, help="seconds between turns (0.5)")
    p.add_argument("--session-workers", type=int, default=1)
    p.add_argument("--replay-buffers", type=int, default=1)
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--replica-batch", type=int, default=8, help="replica max_batch_size (8)")
    p.add_argument("--bootstrap", help="an existing broker (default: start one on free ports)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smallest size (20 s at 0.5 groups/s, a sample every 5 s): checks it runs",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="keep configs and process logs here (default: a temporary folder)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.interval = QUICK_MINUTES, QUICK_INTERVAL_S
    if min(args.minutes, args.rate, args.interval) <= 0 or min(args.n, args.turns) < 1:
        p.error("--minutes, --rate and --interval must be positive; --n and --turns at least 1")
    return args


def soak(args: argparse.Namespace, bootstrap: str, workdir: Path) -> int:
    workload = Workload(
        groups=1,
        n=args.n,
        turns=args.turns,
        tokens_per_turn=args.tokens_per_turn,
        tool_delay_s=args.tool_delay,
    )
    pipeline = Pipeline(
        bootstrap,
        workdir,
        partitions=args.partitions,
        concurrency=16,
        replica_batch=args.replica_batch,
        metrics=True,
    )
    dispatcher = Dispatcher(pipeline, workload, args.rate)
    try:
        pipeline.start(args.session_workers, args.replay_buffers)
        samples = load(pipeline, dispatcher, args)
    finally:
        dispatcher.stop()
        pipeline.close()
        pipeline.delete_topics()
    if dispatcher.error is not None:
        print(f"soak: publishing failed: {dispatcher.error}", file=sys.stderr)
        return 1
    restarts = sum(s.restarts for s in pipeline.services())
    report(samples, restarts)
    if restarts:
        print(f"soak: {restarts} process restarts (logs in {workdir})", file=sys.stderr)
        return 1
    return 0


def load(pipeline: Pipeline, dispatcher: Dispatcher, args: argparse.Namespace) -> list[Sample]:
    """Publish at the rate for ``--minutes``, sampling every ``--interval`` seconds."""
    samples: list[Sample] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    dispatcher.start()
    while time.monotonic() < end and dispatcher.error is None:
        time.sleep(min(args.interval, max(0.0, end - time.monotonic())))
        samples.append(sample(pipeline, dispatcher, t0))
        print(progress_line(samples[-1]), file=sys.stderr, flush=True)
    return samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = stack.enter_context(dedicated_broker(workdir / "broker"))
            bootstrap = broker.kafka.bootstrap_servers
        try:
            return soak(args, bootstrap, workdir)
        except (RolloutBusError, RuntimeError) as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
