"""What a released group says about the RL run, for Prometheus (``RolloutMetrics``).

The replay buffer sees every trajectory exactly when it is released, so the run's RL
figures are computed here, from the records as released: reward per data source (mean,
std, min, max, the share of 0 and 1 scores), response length and the clip ratio, turns per
trajectory, verl's per-trajectory agent-loop timings, failures by class, staleness at
release and the group's latency from its first turn event.

Reward and length figures describe a window of the last ``RELEASE_WINDOW_TRAJECTORIES``
trajectories of each data source (about a verl train batch), so they read as verl's
per-step figures do; distributions are histograms. A batch whose transaction is aborted is
folded and observed again: the figures are monitoring, not accounting.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from rolloutbus.config import RolloutConfig
from rolloutbus.metrics import failure_class_of
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus
from rolloutbus.streams.assembly.metrics import (
    RELEASE_WINDOW_TRAJECTORIES,
    ReplayBufferMetrics,
    RolloutMetrics,
)
from rolloutbus.streams.assembly.partition_fold import PartitionFold, ReleasedGroup

__all__ = [
    "ReleaseObserver",
    "last_turn_timestamp_ms",
    "observe_open_groups",
    "observe_release",
]

KNOWN_AGENT_LOOP_TIMINGS = ("generate_sequences", "tool_calls", "compute_score")


@dataclass(frozen=True)
class _Sample:
    """What the window keeps of one released trajectory."""

    reward: float | None
    response_len: int
    clipped: bool


class _SourceWindow:
    """The last trajectories of one data source, and its window gauges, computed when they
    are scraped (``set_function``): a release only appends a sample, where computing eight
    figures over the window cost ~70 µs per released group (2 µs per turn event).

    A scrape copies the deque first (one C call under the GIL), so the fold thread may go
    on appending meanwhile. The reward gauges exist from the source's first reward on and
    keep the figures of the last rewards seen while the window holds none (as a gauge set
    on release did).
    """

    def __init__(self, metrics: RolloutMetrics, source: str, window: int):
        self.samples: deque[_Sample] = deque(maxlen=window)
        self._metrics, self._label = metrics, {"data_source": source}
        self._rewards: list[float] = []  # the last rewards seen, for the reward gauges
        self._reward_gauges = False
        m, label = metrics, self._label
        m.length_mean.labels(**label).set_function(lambda: fmean(self._lengths() or [0]))
        m.length_max.labels(**label).set_function(lambda: max(self._lengths() or [0]))
        m.clip_ratio.labels(**label).set_function(self._clip_ratio)

    def append(self, sample: _Sample) -> None:
        self.samples.append(sample)
        if sample.reward is not None and not self._reward_gauges:
            self._export_rewards()

    def _lengths(self) -> list[int]:
        return [s.response_len for s in list(self.samples)]

    def _clip_ratio(self) -> float:
        samples = list(self.samples)
        return sum(s.clipped for s in samples) / len(samples) if samples else 0.0

    def _current_rewards(self) -> list[float]:
        rewards = [s.reward for s in list(self.samples) if s.reward is not None]
        if rewards:
            self._rewards = rewards
        return self._rewards

    def _export_rewards(self) -> None:
        self._reward_gauges = True
        m, label, rewards = self._metrics, self._label, self._current_rewards
        m.reward_mean.labels(**label).set_function(lambda: fmean(rewards()))
        m.reward_std.labels(**label).set_function(lambda: _pstdev(rewards()))
        m.reward_min.labels(**label).set_function(lambda: min(rewards()))
        m.reward_max.labels(**label).set_function(lambda: max(rewards()))
        m.reward_zero_ratio.labels(**label).set_function(lambda: _share(rewards(), 0))
        m.reward_one_ratio.labels(**label).set_function(lambda: _share(rewards(), 1))


def _share(values: list[float], of: float) -> float:
    return sum(v == of for v in values) / len(values)


class ReleaseObserver:
    """The window state and the series of one registry; see the module docstring."""

    def __init__(
        self,
        metrics: RolloutMetrics,
        response_length: int | None,
        window: int = RELEASE_WINDOW_TRAJECTORIES,
    ):
        self.metrics = metrics
        self.response_length = response_length
        self.window = window
        self.windows: dict[str, _SourceWindow] = {}
        self.newest_version: int | None = None  # the newest policy version released so far
        # labelled series looked up once: labels() costs microseconds per call, and the
        # replay buffer makes several per released trajectory
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _labelled(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*values)
        return series

    def observe(
        self,
        released: ReleasedGroup,
        trajectories: list[Trajectory],
        now: float | None = None,
        response_lens: Sequence[int] | None = None,
    ) -> None:
        """``response_lens``: each trajectory's response length where its token lists were
        left out (``finalize_group(token_lists=False)``); by default their lists' lengths."""
        now = time.time() if now is None else now
        self._observe_group_latency(released, now)
        self._note_versions(trajectories)
        lengths = response_lens
        if lengths is None:
            lengths = [t.response_len for t in trajectories]
        for t, response_len in zip(trajectories, lengths, strict=True):
            source = t.data_source or "unknown"
            self._labelled(self.metrics.trajectories, source, t.status.value).inc()
            if t.status == TrajectoryStatus.FAILED:
                self.metrics.failed.labels(failure_class=failure_class_of(t)).inc()
                continue
            self._observe_trajectory(t, source, response_len)

    def _observe_group_latency(self, released: ReleasedGroup, now: float) -> None:
        first = released.group.ts
        if math.isfinite(first) and now >= first:
            self.metrics.group_latency.observe(now - first)

    def _note_versions(self, trajectories: list[Trajectory]) -> None:
        versions = [t.max_global_steps for t in trajectories if t.max_global_steps is not None]
        if versions:
            newest = max(versions)
            self.newest_version = max(newest, self.newest_version or newest)

    def _observe_trajectory(self, t: Trajectory, source: str, response_len: int) -> None:
        m = self.metrics
        self._labelled(m.response_length, source).observe(response_len)
        self._labelled(m.num_turns, t.agent_name or "unknown").observe(t.num_turns)
        if t.min_global_steps is not None and self.newest_version is not None:
            m.staleness.observe(max(0, self.newest_version - t.min_global_steps))
        self._observe_agent_loop(t)
        clipped = t.status == TrajectoryStatus.TRUNCATED or (
            self.response_length is not None and response_len >= self.response_length
        )
        window = self.windows.get(source)
        if window is None:
            window = self.windows[source] = _SourceWindow(self.metrics, source, self.window)
        window.append(_Sample(t.reward_score, response_len, clipped))

    def _observe_agent_loop(self, t: Trajectory) -> None:
        """verl's per-trajectory agent-loop metrics, and any other numeric one a loop
        reports (exported under its own name: what arrives is exported)."""
        for name, value in t.metrics.model_dump().items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if name in KNOWN_AGENT_LOOP_TIMINGS:
                self.metrics.agent_loop[name].observe(value)
            elif name == "num_preempted":
                if value >= 0:  # -1: the engine did not report it
                    self.metrics.num_preempted.observe(value)
            elif name.isidentifier() and name.isascii():
                self.metrics.agent_loop_extra(name).observe(value)


def _pstdev(values: list[float]) -> float:
    """The population standard deviation, in floats (``statistics.pstdev`` computes it in
    exact fractions: ~60 µs for a window of 256, per released group)."""
    mean = fmean(values)
    return math.sqrt(fmean([(v - mean) ** 2 for v in values]))


_observers: weakref.WeakKeyDictionary[CollectorRegistry, ReleaseObserver] = (
    weakref.WeakKeyDictionary()
)


def observe_release(
    released: ReleasedGroup,
    trajectories: list[Trajectory],
    rollout: RolloutConfig,
    registry: CollectorRegistry | None = None,
    response_lens: Sequence[int] | None = None,
) -> None:
    """The replay buffer's one call per released group (the process keeps one observer per
    registry, so the windows live as long as the process); ``response_lens`` as in
    :meth:`ReleaseObserver.observe`."""
    registry = REGISTRY if registry is None else registry
    observer = _observers.get(registry)
    if observer is None:
        observer = ReleaseObserver(RolloutMetrics(registry), rollout.response_length)
        _observers[registry] = observer
    observer.observe(released, trajectories, response_lens=response_lens)


def last_turn_timestamp_ms(released: ReleasedGroup) -> int | None:
    """When the group's last session ended, in ms since the epoch (the log timestamp of its
    latest terminal event): the replay buffer stamps the group's trajectory records with it,
    so a trainer client measures last turn → trainer from the record alone. None when no
    session reached a terminal event (a group released early)."""
    stamps = [
        fold.terminal.ts
        for fold in released.sessions
        if fold.terminal is not None and math.isfinite(fold.terminal.ts) and fold.terminal.ts > 0
    ]
    return int(max(stamps) * 1000) if stamps else None


def observe_open_groups(
    metrics: ReplayBufferMetrics, folds: Iterable[PartitionFold], group_deadline_s: float
) -> None:
    """The age of the oldest open group against its deadline (alert: open groups past
    their deadline, which log-time deadlines release only when a later event arrives)."""
    # a fold keeps its open groups oldest first: the first dated one per partition suffices
    oldest = (
        next((g.first_ts for g in fold.open.values() if g.first_ts is not None), None)
        for fold in folds
    )
    firsts = [ts for ts in oldest if ts is not None and math.isfinite(ts)]
    metrics.oldest_open_group.set(min(firsts) if firsts else 0)
    metrics.group_deadline.set(group_deadline_s)
