"""Which replicas can take a turn: health probes, the gate for (re)started replicas, pauses
watched, and the turns that wait while no replica can.

The LLM client's request path asks :class:`ReplicaFleet` for a replica and tells it when a
call failed; everything about the replicas' state lives here:

- **Health.** ``GET /health`` every ``replicas.health_interval_s`` (and at most every second
  while turns wait). A replica that does not answer 200 is not routed to; at start-up every
  replica is probed once and each one that cannot be reached is named in the log, with why.
- **Admission** (``admission.py``). With a version source (the session worker follows
  ``rollout.control``), a replica that (re)starts, or whose weight label goes backwards
  (restarted between two probes), is held back until it serves the current policy version
  or ``replicas.admit_stale_s`` has passed.
- **Pauses.** The embedded replica's ``/health`` says since when it is paused; vLLM's
  ``GET /is_paused`` says whether (since when: from the first probe that saw it). A replica
  paused longer than ``replicas.paused_warn_s`` is warned about and counted.
- **Waiting turns.** A turn that finds no routable replica waits, probing, at most
  ``replicas.unavailable_wait_s`` in all (over its retries), then fails with
  ``NoReplicaAvailableError`` naming why each replica is out. While none is routable, a
  warning every ``health_interval_s`` gives how many turns wait and the longest wait.

Routing itself (sticky, least in flight) is ``routing.LoadBalancer``'s; the fleet marks a
replica routable there only while it is up and admitted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from rolloutbus.config import ReplicasConfig
from rolloutbus.errors import NoReplicaAvailableError
from rolloutbus.schemas.control import as_policy_version
from rolloutbus.streams.inference.admission import VersionSource, admission_reason
from rolloutbus.streams.inference.client_metrics import ClientMetrics
from rolloutbus.streams.inference.routing import LoadBalancer

__all__ = ["Probe", "ReplicaFleet", "ReplicaState", "TurnWait", "get_health"]

log = logging.getLogger(__name__)

UNAVAILABLE_PROBE_S = 1.0  # seconds between probes while turns wait for a routable replica
UNAVAILABLE_WARN_EVERY_S = 30.0  # seconds between two "no replica" lines while turns wait
WEIGHT_SYNC_HINT = (
    "`rolloutbus weight-sync` loads the current weights into a replica that comes up: is it "
    "running?"
)


@dataclass
class Probe:
    """What one look at a replica saw."""

    up: bool
    problem: str | None = None  # why it is not up, in words
    label: Any = None  # the label of the weights it serves
    reports_version: bool = False
    paused: bool | None = None  # None: the replica does not say
    paused_since: float | None = None  # seconds since the epoch, when the replica says


@dataclass
class ReplicaState:
    url: str
    up: bool = True  # until a probe says otherwise
    admitted: bool = True
    held_since: float | None = None  # time.monotonic(): held back until admitted
    problem: str | None = None
    label: Any = None
    paused_since: float | None = None  # seconds since the epoch
    paused_warned_at: float | None = None  # time.monotonic()
    has_weight_info: bool = True  # GET /weight_info answered (no 404) so far
    has_is_paused: bool = True
    routed_once: bool = False  # routed to since the client started: "back", not "up"


class TurnWait:
    """One turn's wait for a routable replica: ``limit_s`` in all, over its retries."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.since: float | None = None  # time.monotonic() when it first found none

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    @property
    def waited_s(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    @property
    def expired(self) -> bool:
        return self.since is not None and self.waited_s >= self.limit_s


async def get_health(
    http: httpx.AsyncClient, url: str, timeout_s: float
) -> tuple[httpx.Response | None, str | None]:
    """``GET url/health``: the 200 answer, or why there is none, in words."""
    try:
        async with asyncio.timeout(timeout_s):
            response = await http.get(url + "/health")
    except TimeoutError:
        return None, f"no answer to GET /health within {timeout_s:g} s"
    except httpx.ConnectError as exc:
        return None, f"cannot connect ({exc or type(exc).__name__})"
    except httpx.HTTPError as exc:
        return None, f"GET /health failed: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return None, f"GET /health answered {response.status_code}"
    return response, None


class ReplicaProber:
    """One look at a replica: ``/health``, and on vLLM ``/is_paused`` and ``/weight_info``
    where its ``/health`` (an empty 200) does not say; a route that answers 404 is not asked
    again."""

    def __init__(self, http: httpx.AsyncClient, timeout_s: float, backend: str, versions: bool):
        self._http, self._timeout_s = http, timeout_s
        self._vllm = backend.startswith("vllm")
        self._versions = versions  # ask for the weight label (only the gate needs it)

    async def probe(self, state: ReplicaState) -> Probe:
        response, problem = await get_health(self._http, state.url, self._timeout_s)
        if response is None:
            return Probe(up=False, problem=problem)
        body = _json_object(response)
        probe = Probe(up=True)
        if "is_paused" in body:  # the embedded replica
            probe.paused, probe.paused_since = bool(body["is_paused"]), body.get("paused_since")
        elif self._vllm and state.has_is_paused:
            answer = await self._ask(state, "/is_paused")
            state.has_is_paused = answer is not None
            probe.paused = None if answer is None else answer.get("is_paused") is True
        if "weight_version" in body:
            probe.label, probe.reports_version = body["weight_version"], True
        elif self._versions and self._vllm and state.has_weight_info:
            answer = await self._ask(state, "/weight_info")
            state.has_weight_info = answer is not None
            if answer is not None:
                probe.label, probe.reports_version = answer.get("weight_version"), True
        return probe

    async def _ask(self, state: ReplicaState, path: str) -> dict[str, Any] | None:
        """The JSON object a GET answers; None when the route does not exist or fails."""
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._http.get(state.url + path)
        except (TimeoutError, httpx.HTTPError):
            return None
        return _json_object(response) if response.status_code == 200 else None


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except (ValueError, json.JSONDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


class ReplicaFleet:
    """The replicas an LLM client routes over, and what it knows about each (module doc)."""

    def __init__(
        self,
        config: ReplicasConfig,
        balancer: LoadBalancer,
        prober: ReplicaProber,
        metrics: ClientMetrics,
        versions: VersionSource | None = None,
    ) -> None:
        self._config, self._balancer, self._prober = config, balancer, prober
        self._metrics, self._versions = metrics, versions
        self._states: dict[str, ReplicaState] = {}
        self._waiting: set[TurnWait] = set()
        self._probing: asyncio.Future[dict[str, bool]] | None = None
        self._probed_at = float("-inf")  # time.monotonic() of the last probe round's end
        # the last "no replica can take a turn" line: (when, whether turns were waiting)
        self._unavailable_said: tuple[float, bool] | None = None
        for replica in balancer.replicas:
            self._track(replica)

    # -- membership ----------------------------------------------------------------

    @property
    def balancer(self) -> LoadBalancer:
        return self._balancer

    def add(self, replica: str) -> None:
        self._balancer.add_replicas([replica])
        self._track(replica)

    def remove(self, replica: str) -> None:
        self._balancer.remove_replicas([replica])
        self._states.pop(replica, None)
        self._metrics.forget(replica)

    def _track(self, replica: str) -> None:
        state = self._states.setdefault(replica, ReplicaState(replica))
        if self._versions is not None:  # new to us: it may serve anything until it says
            self._hold_back(state, "is new to this client")
        self._publish(replica)

    # -- routing -------------------------------------------------------------------

    async def acquire(self, request_id: str, wait: TurnWait, last_error: Exception | None) -> str:
        """A replica for one call; while none is routable, probe until one is or ``wait``
        runs out (a replica restart is not a failed turn)."""
        try:
            while True:
                try:
                    return self._acquire_now(request_id)
                except NoReplicaAvailableError as exc:
                    wait.start()
                    self._note_waiting(wait)
                    if wait.expired:
                        raise self._gave_up(request_id, wait, last_error) from (last_error or exc)
                pause_s = min(self._config.health_interval_s, UNAVAILABLE_PROBE_S)
                await asyncio.sleep(max(0.0, min(pause_s, wait.limit_s - wait.waited_s)))
                await self.refresh(UNAVAILABLE_PROBE_S)
        finally:
            self._waiting.discard(wait)
            self._metrics.waiting.set(len(self._waiting))

    def _acquire_now(self, request_id: str) -> str:
        replica = self._balancer.acquire(request_id)
        self._metrics.in_flight.labels(replica).set(self._balancer.in_flight[replica])
        return replica

    def release(self, replica: str) -> None:
        self._balancer.release(replica)
        if replica in self._balancer.in_flight:
            self._metrics.in_flight.labels(replica).set(self._balancer.in_flight[replica])

    def take_out(self, replica: str, why: Exception) -> None:
        """A call to ``replica`` failed on the replica's side: route elsewhere until a probe
        finds it healthy."""
        log.warning("taking replica %s out of routing: %s", replica, why)
        self._balancer.mark_unhealthy(replica)
        self._publish(replica)

    def _note_waiting(self, wait: TurnWait) -> None:
        self._waiting.add(wait)
        self._metrics.waiting.set(len(self._waiting))

    def _gave_up(
        self, request_id: str, wait: TurnWait, last_error: Exception | None
    ) -> NoReplicaAvailableError:
        self._metrics.unavailable.inc()
        message = (
            f"no replica could take the turn of {request_id!r} for {wait.waited_s:.1f} s "
            f"(replicas.unavailable_wait_s = {wait.limit_s:g}): {self.describe_unroutable()}"
        )
        if last_error is not None:
            message += f"; last failure: {last_error}"
        return NoReplicaAvailableError(message)

    def describe_unroutable(self) -> str:
        """Why each replica is out of routing now, in one line."""
        out = []
        for replica, state in self._states.items():
            if self._balancer.is_healthy(replica):
                continue
            if not state.up:
                why = state.problem or "down"
            elif not state.admitted:
                current = self._versions.current_version() if self._versions else None
                why = f"held back until it serves policy version {current} (serves {state.label})"
            else:
                why = "taken out after a failed call, waiting for a health probe"
            out.append(f"{replica}: {why}")
        return "; ".join(out) or f"{len(self._states)} replicas known"

    # -- probes --------------------------------------------------------------------

    async def check_health(self) -> dict[str, bool]:
        """Probe every replica once; returns which answered ``/health`` with 200."""
        replicas = list(self._states)
        probes = await asyncio.gather(*(self._prober.probe(self._states[r]) for r in replicas))
        for replica, probe in zip(replicas, probes, strict=True):
            state = self._states.get(replica)
            if state is not None:  # else removed while the probe ran
                self._apply(state, probe)
        self._probed_at = time.monotonic()
        return {replica: probe.up for replica, probe in zip(replicas, probes, strict=True)}

    async def refresh(self, max_age_s: float) -> None:
        """Probe unless a round ended less than ``max_age_s`` ago; waiters share one round."""
        if self._probing is None:
            if time.monotonic() - self._probed_at < max_age_s:
                return
            self._probing = asyncio.ensure_future(self.check_health())
            self._probing.add_done_callback(self._probe_done)
        await asyncio.shield(self._probing)

    def _probe_done(self, _: asyncio.Future[dict[str, bool]]) -> None:
        self._probing = None

    async def probe_at_start(self) -> dict[str, str | None]:
        """Probe every replica; log each that cannot be reached, by name and why."""
        await self.check_health()
        problems = {r: s.problem if not s.up else None for r, s in self._states.items()}
        if _report_start(problems, self._config.unavailable_wait_s):
            self._unavailable_said = (time.monotonic(), False)  # said once is enough
        return problems

    def _apply(self, state: ReplicaState, probe: Probe) -> None:
        was_routable, was_up = self._balancer.is_healthy(state.url), state.up
        state.up, state.problem = probe.up, probe.problem
        if not probe.up:
            if was_up and state.routed_once:  # one never routed to is named by the start probe
                log.warning("replica %s is unhealthy: %s", state.url, probe.problem)
            if self._versions is not None:  # admit_stale_s counts from when it is back
                state.admitted, state.held_since = False, None
            self._balancer.mark_unhealthy(state.url)
            self._publish(state.url)
            return
        if self._versions is not None and not was_up:
            back = "is back (maybe restarted on other weights)" if state.routed_once else "is up"
            self._hold_back(state, back)
        elif self._versions is not None and _went_back(state.label, probe):
            self._hold_back(state, f"now serves {probe.label!r} after {state.label!r}")
        if probe.reports_version:
            state.label = probe.label
        self._watch_pause(state, probe)
        if not state.admitted:
            self._admit_if_ready(state, probe)
        if state.admitted:
            self._balancer.mark_healthy(state.url)
            if not was_routable and state.routed_once:
                log.warning("replica %s is back", state.url)
            elif not was_routable:
                log.info("replica %s is routable", state.url)
            state.routed_once = True
        self._publish(state.url)

    # -- admission and pauses --------------------------------------------------------

    def _hold_back(self, state: ReplicaState, why: str) -> None:
        if not state.admitted and state.held_since is not None:
            return  # held back already: admit_stale_s counts from the first time
        state.admitted, state.held_since = False, time.monotonic()
        self._balancer.mark_unhealthy(state.url)
        log.info(
            "replica %s %s: not routed to until it serves the current policy version "
            "(at most replicas.admit_stale_s = %g s); %s",
            state.url,
            why,
            self._config.admit_stale_s,
            WEIGHT_SYNC_HINT,
        )

    def _admit_if_ready(self, state: ReplicaState, probe: Probe) -> None:
        assert self._versions is not None and state.held_since is not None
        waited_s = time.monotonic() - state.held_since
        reason = admission_reason(
            self._versions,
            probe.label,
            reports_version=probe.reports_version,
            waited_s=waited_s,
            admit_stale_s=self._config.admit_stale_s,
        )
        if reason is None:
            return
        state.admitted, state.held_since = True, None
        self._metrics.admissions.labels(state.url, reason).inc()
        current = self._versions.current_version()
        stale = reason == "stale_timeout"
        log.log(
            logging.WARNING if stale else logging.INFO,
            "replica %s admitted after %.1f s (%s): serves %r, current policy version %s%s",
            state.url,
            waited_s,
            reason,
            probe.label,
            current,
            f"; the trainer's staleness bound may drop its groups. {WEIGHT_SYNC_HINT}"
            if stale
            else "",
        )

    def _watch_pause(self, state: ReplicaState, probe: Probe) -> None:
        if probe.paused is None:
            return
        if not probe.paused:
            state.paused_since = state.paused_warned_at = None
            self._metrics.paused_seconds.labels(state.url).set(0)
            return
        state.paused_since = probe.paused_since or state.paused_since or time.time()
        paused_s = time.time() - state.paused_since
        self._metrics.paused_seconds.labels(state.url).set(paused_s)
        limit_s, now = self._config.paused_warn_s, time.monotonic()
        if paused_s < limit_s:
            return
        if state.paused_warned_at is not None and now - state.paused_warned_at < limit_s:
            return
        state.paused_warned_at = now
        self._metrics.paused_too_long.labels(state.url).inc()
        log.warning(
            "replica %s has been paused for %.0f s (over replicas.paused_warn_s = %g s): the "
            "turns sent to it wait; a weight sync stopped between its pause and its resume? "
            "(a restarted weight sync resumes it)",
            state.url,
            paused_s,
            limit_s,
        )

    # -- the background loop -----------------------------------------------------------

    async def run_forever(self) -> None:
        """Probe every ``health_interval_s``; while no replica is routable, say so."""
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            await self.refresh(0.0)
            self.warn_if_unavailable()

    def warn_if_unavailable(self) -> None:
        """While no replica is routable: one line when it starts, one when turns start
        waiting, then one every UNAVAILABLE_WARN_EVERY_S while they wait (none while
        nothing waits)."""
        if self._balancer.healthy_replicas or not self._states:
            self._unavailable_said = None
            return
        now, waiting = time.monotonic(), bool(self._waiting)
        said = self._unavailable_said
        if said is not None and said[1] == waiting:
            if not waiting or now - said[0] < UNAVAILABLE_WARN_EVERY_S:
                return
        self._unavailable_said = (now, waiting)
        held = any(s.up and not s.admitted for s in self._states.values())
        oldest = max((w.waited_s for w in self._waiting), default=0.0)
        log.warning(
            "no replica can take a turn (%s); %d sessions waiting for one, the longest for "
            "%.0f s; a session fails after replicas.unavailable_wait_s = %g s of waiting%s",
            self.describe_unroutable(),
            len(self._waiting),
            oldest,
            self._config.unavailable_wait_s,
            f". {WEIGHT_SYNC_HINT}" if held else "",
        )

    def _publish(self, replica: str) -> None:
        state = self._states.get(replica)
        if state is None:
            return
        self._metrics.healthy.labels(replica).set(int(self._balancer.is_healthy(replica)))
        self._metrics.admitted.labels(replica).set(int(state.admitted))
        self._metrics.in_flight.labels(replica).set(self._balancer.in_flight.get(replica, 0))


def _went_back(before: Any, probe: Probe) -> bool:
    """The weight label moved to a lower version: the replica restarted on its initial
    weights between two probes. (A label that names no version, as after a pause lease ran
    out over an unlabelled reload, is no restart: its tokens carry no version, and it keeps
    serving.)"""
    if not probe.reports_version or before is None:
        return False
    old, new = as_policy_version(before), as_policy_version(probe.label)
    return old is not None and new is not None and new < old


def _report_start(problems: dict[str, str | None], unavailable_wait_s: float) -> bool:
    """The start probe in one line: each unreachable replica by name and why, and what
    happens to turns when none is reachable (then True)."""
    reachable = sum(1 for p in problems.values() if p is None)
    unreachable = "; ".join(
        f"replica {r} is unreachable: {p}" for r, p in problems.items() if p is not None
    )
    if problems and not reachable:
        log.error(
            "%s; no replica is reachable (%d configured in replicas.urls): every turn "
            "waits up to replicas.unavailable_wait_s = %g s for one, then its session fails",
            unreachable,
            len(problems),
            unavailable_wait_s,
        )
        return True
    if unreachable:
        log.error("%s; %d of %d replicas reachable", unreachable, reachable, len(problems))
    else:
        log.info("%d of %d replicas reachable", reachable, len(problems))
    return False
