"""The demo with metrics on, and its picture: ``out/demo.png`` beside the Arrow file.

:func:`demo_monitoring` wraps ``rolloutbus demo``: it turns metrics on for the demo's
session worker and replay buffer (the ports of ``ops/metrics-on.yaml`` when free, so
``ops/prometheus/prometheus.yml`` scrapes the demo as it runs), samples their /metrics
every second while the demo runs, and afterwards draws three panels with matplotlib:
progress over time (sampled tokens as the sessions log them, trajectories as they are
released; cumulative, so a release does not read as a spike), the rewards by data source
(how many scored above 0, 0 or not at all: an all-zero demo shows its zeros), and the
response lengths with ``rollout.response_length`` marked (the last two from the
trajectories the demo wrote).
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
            picture = draw_demo_picture(
                sampler.scrapes, out, out.with_name("demo.png"), cfg.rollout.response_length
            )
            print(f"[demo] wrote {picture}", file=sys.stderr, flush=True)


def cumulative(
    scrapes: list[Scrape], released_in_the_end: int | None = None
) -> tuple[list[float], list[float], list[float]]:
    """Seconds since the first scrape, and at each scrape the sampled tokens logged so far
    (the session worker counts them as each turn is logged: sampling time) and the
    trajectories released so far (the replay buffer, a group at a time).

    ``released_in_the_end``: the trajectories the demo wrote. The last groups are released
    after the last scrape (the demo ends once it has them all), so the curve would stop
    short of the total: a last point, one scrape interval on, says where it ended."""
    if not scrapes:
        return [], [], []
    first = scrapes[0]
    times = [s.at - first.at for s in scrapes]
    tokens = _so_far(
        [_delta(first, s, "rolloutbus_sessions_tokens_total", kind="sampled") for s in scrapes]
    )
    released = _so_far(
        [_delta(first, s, "rolloutbus_replay_buffer_trajectories_total") for s in scrapes]
    )
    if released_in_the_end is not None and released_in_the_end > released[-1]:
        times.append(times[-1] + SAMPLE_EVERY_S)
        tokens.append(tokens[-1])
        released.append(float(released_in_the_end))
    return times, tokens, released


def _so_far(values: list[float]) -> list[float]:
    """Running maximum: a scrape after a process stopped reads nothing, not a drop to 0."""
    out: list[float] = []
    for value in values:
        out.append(max(value, out[-1]) if out else value)
    return out


def _delta(before: Scrape, after: Scrape, name: str, **match: str) -> float:
    return max(0.0, (after.total(name, **match) or 0.0) - (before.total(name, **match) or 0.0))


def reward_outcomes(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per data source, how many trajectories scored above 0, exactly 0 (or below), or not
    at all: a demo whose every reward is 0 shows a bar of zeros, not an empty panel."""
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        score = row.get("reward_score")
        outcome = "unscored" if score is None else "reward > 0" if score > 0 else "reward <= 0"
        source = counts.setdefault(row.get("data_source") or "unknown", dict.fromkeys(OUTCOMES, 0))
        source[outcome] += 1
    return counts


OUTCOMES = ("reward > 0", "reward <= 0", "unscored")
OUTCOME_COLOURS = ("tab:green", "tab:red", "tab:gray")


def draw_demo_picture(
    scrapes: list[Scrape], arrow: Path, picture: Path, response_length: int | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = pa.ipc.open_file(arrow).read_all().to_pylist()  # consumers.report.write_arrow's file
    fig, (flow, reward, lengths) = plt.subplots(1, 3, figsize=(15, 4.2))
    _draw_progress(flow, scrapes, len(rows))
    _draw_rewards(reward, reward_outcomes(rows))
    _draw_lengths(lengths, [row["response_len"] for row in rows], response_length)
    fig.tight_layout()
    picture.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(picture, dpi=100)
    plt.close(fig)
    return picture


def _draw_progress(axes, scrapes: list[Scrape], released_in_the_end: int) -> None:
    times, tokens, released = cumulative(scrapes, released_in_the_end)
    axes.plot(times, tokens, color="tab:orange", label="sampled tokens (as logged)")
    axes.set_xlabel("seconds")
    axes.set_ylabel("tokens")
    axes.set_title("progress")
    twin = axes.twinx()
    twin.step(times, released, where="post", label="trajectories released")
    twin.set_ylabel("trajectories")
    axes.legend(loc="upper left")
    twin.legend(loc="lower right")


def _draw_rewards(axes, counts: dict[str, dict[str, int]]) -> None:
    sources = sorted(counts)
    bottom = [0] * len(sources)
    for outcome, colour in zip(OUTCOMES, OUTCOME_COLOURS, strict=True):
        heights = [counts[s][outcome] for s in sources]
        if any(heights):
            axes.bar(sources, heights, bottom=bottom, color=colour, label=outcome)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axes.set_title("rewards by data source")
    axes.set_ylabel("trajectories")
    axes.legend()


def _draw_lengths(axes, lengths: list[int], limit: int | None) -> None:
    axes.hist(lengths, bins=20)
    if limit is not None:
        at_limit = sum(n >= limit for n in lengths)
        axes.axvline(limit, color="tab:red", linestyle="--", label=f"response_length {limit}")
        axes.legend(title=f"{at_limit} of {len(lengths)} at the limit")
    axes.set_title("response length")
    axes.set_xlabel("tokens")
