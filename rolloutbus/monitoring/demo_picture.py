"""The demo with metrics on, and its picture: ``out/demo.png`` beside the Arrow file.

:func:`demo_monitoring` wraps ``rolloutbus demo``: it turns metrics on for the demo's
session worker and replay buffer (the ports of ``ops/metrics-on.yaml`` when free, so
``ops/prometheus/prometheus.yml`` scrapes the demo as it runs), samples their /metrics
every second while the demo runs, and afterwards draws three panels with matplotlib:
throughput over time (trajectories and sampled tokens per second), the mean reward by data
source, and a histogram of response lengths (the last two from the trajectories the demo
wrote).
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

from rolloutbus.config import Config, with_overrides
from rolloutbus.monitoring.scrape import Scrape, metrics_targets, scrape_all

__all__ = ["METRICS_ON_PORTS", "demo_monitoring", "draw_demo_picture"]

# ops/metrics-on.yaml's ports for the two workers the demo starts
# (tests/monitoring/test_monitoring.py keeps them equal)
METRICS_ON_PORTS = {"sessions.metrics_port": 9101, "replay_buffer.metrics_port": 9102}
SAMPLE_EVERY_S = 1.0  # seconds between two scrapes of the demo's /metrics


def with_metrics_on(cfg: Config) -> Config:
    """The config with the workers' metrics ports set: kept when the config sets them, the
    metrics-on port when it is free, else a free port of the OS's choosing."""
    configured = {
        "sessions.metrics_port": cfg.sessions.metrics_port,
        "replay_buffer.metrics_port": cfg.replay_buffer.metrics_port,
    }
    overrides: dict[str, int] = {}
    for key, wanted in METRICS_ON_PORTS.items():
        if configured[key] is None:
            overrides[key] = wanted if _free(wanted) else _any_free_port()
    return with_overrides(cfg, overrides) if overrides else cfg


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Sampler(threading.Thread):
    def __init__(self, targets: dict[str, str]):
        super().__init__(name="demo-metrics", daemon=True)
        self.targets = targets
        self.scrapes: list[Scrape] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_S):
            self.scrapes.append(scrape_all(self.targets))


@contextmanager
def demo_monitoring(cfg: Config, out: Path) -> Iterator[Config]:
    """Yield the demo's config with metrics on; draw ``demo.png`` beside ``out`` after."""
    cfg = with_metrics_on(cfg)
    targets = {
        job: url
        for job, url in metrics_targets(cfg).items()
        if job in ("sessions", "replay-buffer")
    }
    sampler = _Sampler(targets)
    sampler.start()
    try:
        yield cfg
    finally:
        sampler.done.set()
        sampler.join()
        if out.exists():
            picture = draw_demo_picture(sampler.scrapes, out, out.with_name("demo.png"))
            print(f"[demo] wrote {picture}", file=sys.stderr, flush=True)


def throughput(scrapes: list[Scrape]) -> tuple[list[float], list[float], list[float]]:
    """Seconds since the first scrape, trajectories/s and sampled tokens/s between scrapes."""
    times, trajectories, tokens = [], [], []
    for before, after in zip(scrapes, scrapes[1:], strict=False):
        dt = after.at - before.at
        if dt <= 0:
            continue
        times.append(after.at - scrapes[0].at)
        trajectories.append(
            _delta(before, after, "rolloutbus_replay_buffer_trajectories_total") / dt
        )
        tokens.append(
            _delta(before, after, "rolloutbus_sessions_tokens_total", kind="sampled") / dt
        )
    return times, trajectories, tokens


def _delta(before: Scrape, after: Scrape, name: str, **match: str) -> float:
    return max(0.0, (after.total(name, **match) or 0.0) - (before.total(name, **match) or 0.0))


def draw_demo_picture(scrapes: list[Scrape], arrow: Path, picture: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = pa.ipc.open_file(arrow).read_all().to_pylist()  # consumers.report.write_arrow's file
    fig, (flow, reward, lengths) = plt.subplots(1, 3, figsize=(15, 4.2))
    times, trajectories, tokens = throughput(scrapes)
    flow.plot(times, trajectories, label="trajectories/s")
    flow.set_xlabel("seconds")
    flow.set_title("throughput")
    twin = flow.twinx()
    twin.plot(times, tokens, color="tab:orange", label="sampled tokens/s")
    flow.legend(loc="upper left")
    twin.legend(loc="upper right")
    by_source: dict[str, list[float]] = {}
    for row in rows:
        if row.get("reward_score") is not None:
            by_source.setdefault(row.get("data_source") or "unknown", []).append(
                row["reward_score"]
            )
    sources = sorted(by_source)
    reward.bar(sources, [sum(v) / len(v) for v in (by_source[s] for s in sources)])
    reward.set_title("mean reward by data source")
    reward.set_ylabel("reward")
    lengths.hist([row["response_len"] for row in rows], bins=20)
    lengths.set_title("response length")
    lengths.set_xlabel("tokens")
    fig.tight_layout()
    picture.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(picture, dpi=100)
    plt.close(fig)
    return picture
