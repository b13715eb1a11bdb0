"""``rolloutbus top``: the run at a glance, from the processes' own /metrics.

Two scrapes ``interval`` seconds apart give the rates; :func:`summarize` turns them into
sections of (label, value) rows (pure, tested), :func:`render` lays those out with rich.
``--once`` prints one snapshot and exits (for scripts: plain text when stdout is not a
terminal); without it the view refreshes in place on a terminal, and is printed again
every interval, one snapshot after another, when stdout is a file or a pipe (as
``top -b``), until Ctrl-C or SIGTERM (``stop``). Works on a plain terminal: no colours are
needed to read it. Counters show their rate and their total since the process started.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rolloutbus.monitoring.scrape import Scrape, scrape_all

__all__ = ["Section", "render", "run_top", "summarize"]

STAGES = ("sessions", "replay_buffer", "trainer")


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, label: str, value: str) -> None:
        self.rows.append((label, value))


def summarize(before: Scrape, after: Scrape) -> list[Section]:
    """The view's sections from two scrapes (rates over the time between them)."""
    dt = max(after.at - before.at, 1e-9)
    return [
        _flow(before, after, dt),
        _lag(after),
        _staleness(after),
        _replicas(after),
        _failures(after),
        _trainer(after),
        _processes(after),
    ]


def _rate(before: Scrape, after: Scrape, dt: float, name: str, **match: str) -> str:
    """The rate over the interval, and the total the processes report."""
    a, b = before.total(name, **match), after.total(name, **match)
    if b is None:
        return "-"
    return f"{max(0.0, b - (a or 0.0)) / dt:.2f}/s, {b:.0f} in all"


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _flow(before: Scrape, after: Scrape, dt: float) -> Section:
    s = Section("flow")
    s.add("trajectories", _rate(before, after, dt, "rolloutbus_replay_buffer_trajectories_total"))
    s.add(
        "groups released",
        _rate(before, after, dt, "rolloutbus_replay_buffer_groups_released_total"),
    )
    s.add(
        "tokens sampled",
        _rate(before, after, dt, "rolloutbus_sessions_tokens_total", kind="sampled"),
    )
    s.add("groups in flight (workers)", _num(after.total("rolloutbus_sessions_groups_in_flight")))
    s.add("open groups (replay buffer)", _num(after.total("rolloutbus_replay_buffer_open_groups")))
    return s


def _lag(after: Scrape) -> Section:
    s = Section("consumer lag")
    records = after.by("rolloutbus_consumer_lag_records", "stage")
    members = after.by("rolloutbus_consumer_group_members", "stage")
    oldest: dict[str, float] = {}
    for sample in after.values("rolloutbus_consumer_lag_seconds"):
        stage = sample.labels.get("stage", "")
        oldest[stage] = max(oldest.get(stage, 0.0), sample.value)
    for stage in STAGES:
        if stage not in records:
            s.add(stage, "- (no lag exporter)")
            continue
        s.add(
            stage,
            f"{records[stage]:.0f} records, oldest {oldest.get(stage, 0.0):.1f} s, "
            f"{members.get(stage, 0):.0f} consumers",
        )
    return s


def _mean(after: Scrape, histogram: str) -> float | None:
    total, count = after.total(f"{histogram}_sum"), after.total(f"{histogram}_count")
    return None if not count or total is None else total / count


def _staleness(after: Scrape) -> Section:
    s = Section("staleness (versions)")
    s.add(
        "at release, mean",
        _num(_mean(after, "rolloutbus_rollout_staleness_at_release_versions"), "{:.2f}"),
    )
    s.add(
        "at training, mean",
        _num(_mean(after, "rolloutbus_trainer_client_group_staleness_versions"), "{:.2f}"),
    )
    s.add("last step, max", _num(after.total("rolloutbus_trainer_staleness_max_versions")))
    return s


def _replicas(after: Scrape) -> Section:
    s = Section("replicas")
    healthy = after.by("rolloutbus_client_replica_healthy", "replica")
    in_flight = after.by("rolloutbus_client_in_flight", "replica")
    versions = after.by("rolloutbus_weight_sync_replica_policy_version", "replica")
    for replica in sorted(set(healthy) | set(versions)):
        state = {1.0: "healthy", 0.0: "UNHEALTHY"}.get(healthy.get(replica, -1.0), "?")
        version = versions.get(replica)
        s.add(
            replica,
            f"{state}, {in_flight.get(replica, 0):.0f} in flight"
            + ("" if version is None else f", v{version:.0f}"),
        )
    running = after.total("rolloutbus_replica_requests_running")
    waiting = after.total("rolloutbus_replica_requests_waiting")
    if running is not None:
        s.add("embedded replicas", f"{running:.0f} running, {_num(waiting)} waiting")
    if not s.rows:
        s.add("(none seen)", "-")
    return s


def _failures(after: Scrape) -> Section:
    s = Section("failures")
    by_class = after.by("rolloutbus_rollout_failed_trajectories_total", "failure_class")
    for cls, count in sorted(by_class.items()):
        s.add(f"failed trajectories: {cls}", f"{count:.0f}")
    s.add(
        "dead letters (replay buffer)",
        _num(after.total("rolloutbus_replay_buffer_dead_letters_total")),
    )
    early = after.by("rolloutbus_replay_buffer_groups_released_early_total", "kind")
    for kind, count in sorted(early.items()):
        s.add(f"groups released early: {kind}", f"{count:.0f}")
    return s


def _trainer(after: Scrape) -> Section:
    s = Section("trainer")
    s.add("step", _num(after.total("rolloutbus_trainer_global_step")))
    s.add("policy version", _num(after.total("rolloutbus_trainer_policy_version")))
    s.add("reward (last step)", _num(after.total("rolloutbus_trainer_batch_reward_mean"), "{:.3f}"))
    s.add("pg loss", _num(after.total("rolloutbus_trainer_pg_loss"), "{:.4f}"))
    s.add("waited for data", _num(after.total("rolloutbus_trainer_wait_seconds"), "{:.1f} s"))
    return s


def _processes(after: Scrape) -> Section:
    s = Section("processes")
    for job, up in sorted(after.up.items()):
        s.add(job, "up" if up else "DOWN")
    return s


def render(sections: list[Section], at: float) -> Group:
    """The sections as rich tables, two columns each."""
    title = time.strftime("rolloutbus top  %Y-%m-%d %H:%M:%S", time.localtime(at))
    tables = []
    for section in sections:
        table = Table(title=section.title, title_justify="left", show_header=False, box=None)
        table.add_column(min_width=30)
        table.add_column()
        for label, value in section.rows:
            table.add_row(label, value)
        tables.append(table)
    return Group(title, *tables)


def run_top(
    targets: dict[str, str],
    *,
    once: bool,
    interval_s: float,
    console: Console | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Scrape every ``interval_s`` and show the view until ``stop`` is set (or once)."""
    console = console or Console()
    stop = stop or threading.Event()
    before = scrape_all(targets)
    if once:
        stop.wait(interval_s)
        after = scrape_all(targets)
        console.print(render(summarize(before, after), after.at))
        return
    if not console.is_terminal:  # a file or a pipe: one snapshot after another
        while not stop.wait(interval_s):
            after = scrape_all(targets)
            console.print(render(summarize(before, after), after.at))
            console.print()
            console.file.flush()
            before = after
        return
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while not stop.wait(interval_s):
            after = scrape_all(targets)
            live.update(render(summarize(before, after), after.at), refresh=True)
            before = after
