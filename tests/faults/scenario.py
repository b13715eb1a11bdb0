"""What a scenario gets (the running pipeline, progress, a timeline), and the common faults."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutbus.config import Config
from tests.faults.processes import POLL_S, Pipeline
from tests.faults.services import Service
from tests.faults.workload import Workload


class ScenarioTimeout(AssertionError):
    """The run did not get where a scenario waits for it."""


@dataclass
class FaultContext:
    """What a scenario gets: the pipeline, a seeded RNG, progress, and a timeline."""

    pipeline: Pipeline
    workload: Workload
    rng: random.Random
    deadline: float
    broker: Config | None = None  # a dedicated broker the scenario may stop and start
    timeline: list[str] = field(default_factory=list)
    kills: int = 0
    # (service name, wall-clock time) of every SIGKILL, for the release stall after it
    killed_at: list[tuple[str, float]] = field(default_factory=list)
    _t0: float = field(default_factory=time.monotonic)

    def released(self) -> int:
        """Expected trajectory keys on rollout.trajectories so far."""
        return len(self.workload.expected_keys() & set(self.pipeline.watcher.keys))

    def wait_for_released(self, count: int) -> None:
        count = min(count, self.workload.sessions)
        while self.released() < count:
            if time.monotonic() > self.deadline:
                raise ScenarioTimeout(f"only {self.released()} of {count} trajectories arrived")
            time.sleep(POLL_S)

    def wait_for_fraction(self, fraction: float) -> None:
        self.wait_for_released(int(fraction * self.workload.sessions))

    def kill(self, service: Service) -> None:
        """SIGKILL; the supervisor starts it again. A kill waits for the supervisor's restart
        of the last one first: a kill that lands while the process is down kills nothing,
        and the row would prove one kill fewer than it says."""
        while not service.running():
            if time.monotonic() > self.deadline:
                raise ScenarioTimeout(f"{service.name} was not restarted")
            time.sleep(POLL_S)
        self.note(f"SIGKILL {service.name} (pid {service.popen.pid if service.popen else '-'})")
        self.killed_at.append((service.name, time.time()))
        service.kill()
        self.kills += 1

    def retire(self, service: Service) -> None:
        self.note(f"SIGKILL {service.name} for good")
        self.killed_at.append((service.name, time.time()))
        service.retire()
        self.kills += 1

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self._t0:7.1f} s  {self.released():4d} released  {what}"
        self.timeline.append(line)
        with (self.pipeline.workdir / "timeline.txt").open("a") as out:  # to follow a run live
            out.write(line + "\n")


Scenario = Callable[[FaultContext], None]


def at_spread_moments(kills: int, fault: Callable[[FaultContext, int], None]) -> Scenario:
    """Run ``fault(ctx, i)`` ``kills`` times at random moments spread over the run: kill i
    lands in the i-th of ``kills`` slices of 5-85 % of the trajectories released, each after
    at least one more group was released since the previous one."""

    def scenario(ctx: FaultContext) -> None:
        slot = 0.8 / kills  # fractions of the run: kill i lands somewhere in slot i
        last = 0
        for i in range(kills):
            fraction = 0.05 + i * slot + ctx.rng.uniform(0, 0.8 * slot)
            ctx.wait_for_released(max(int(fraction * ctx.workload.sessions), last + ctx.workload.n))
            time.sleep(ctx.rng.uniform(0.0, 2.0))  # seconds: a random moment
            last = ctx.released()
            fault(ctx, i)

    return scenario


def sigkill_spread(pick: Callable[[Pipeline], Service], kills: int) -> Scenario:
    """SIGKILL ``pick(pipeline)`` ``kills`` times spread over the run, restarted each time."""
    return at_spread_moments(kills, lambda ctx, _: ctx.kill(pick(ctx.pipeline)))


__all__ = [
    "FaultContext",
    "Scenario",
    "ScenarioTimeout",
    "at_spread_moments",
    "sigkill_spread",
]
