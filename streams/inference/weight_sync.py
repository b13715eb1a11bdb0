"""Weight sync: apply each policy version published on ``rollout.control`` to every replica.

The trainer never talks to a replica. It writes a checkpoint folder and publishes
``PolicyVersionPublished``; this loop follows the control topic and, for each new version,
runs on every replica in ``replicas.urls`` (all replicas at once, so the fleet changes
version together):

    vLLM (dev mode, 0.32/0.33)                    SGLang
    1. POST /pause?mode=keep|abort                POST /pause_generation {"mode": retract|abort}
    2. POST /collective_rpc reload_weights DIR    POST /update_weights_from_disk {"model_path": DIR}
    3. POST /update_weight_version {new_version}  POST /update_weight_version {new_version}
    4. POST /resume                               POST /continue_generation

``async_training.partial_rollout`` picks the pause mode, as in verl: true keeps in-flight
turns (vLLM ``keep``; SGLang ``retract``, which re-queues them and recomputes their cache on
the new weights); they finish on the new weights and their ``weight_versions`` spans record
where the version changed. False aborts them; the LLM client resumes each aborted turn with
its tokens so far (``replicas.resume_aborted``). Either way each token's version is logged.

Which versions it applies: the newest run's, in order (``rolloutbus.kafka.version_ledger``).
A new run is applied even when its version number is lower (a new run starts at 0, with
the folder of its initial weights), and every replica reloads then, whatever it reports:
a version label cannot tell two runs' weights apart. A record of an older run, a version
that goes backwards, and a version above 0 without weights are never applied; this
process writes them to the dead-letter topic. Version 0 with no ``weights_path`` (a
publisher other than ``rolloutbus train``) is the replicas' initial weights: only the label
is set.

**Pauses have an owner.** On the embedded replica the pause takes a lease
(``/pause?lease_s=replicas.pause_lease_s``), renewed every third of it while the steps run;
a weight sync killed mid-reload leaves the replica paused for at most the lease, and the
replica then resumes on its weights under a truthful label (``replica/pause_gate.py``).
vLLM's pause has no lease, so at start this loop probes every replica, names those it
cannot reach, and resumes any it finds still paused once it has applied the current version.

When every replica serves the current version, this loop says so on ``rollout.control``:
``PolicyVersionApplied`` (``weight_sync_applied``), once per version, for on-policy trainers
that wait for it (``rolloutbus.verl.applied``).

A replica that goes down is re-synced when it is healthy again (a restarted replica serves
its initial weights): the loop probes ``GET /health`` (and ``GET /weight_info`` on vLLM and
the embedded replica, which names the version served: a replica restarted between two
probes says "default", or "0")
every ``replicas.health_interval_s`` and applies the current version to any replica that
has not got it. A step that fails
leaves the replica resumed on its old weights (never paused forever) and is retried on the
next probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError, SchemaError
from rolloutbus.kafka.control import PolicyVersionFollower, latest_policy_version
from rolloutbus.kafka.version_ledger import supersedes
from rolloutbus.schemas.control import (
    PolicyVersionApplied,
    PolicyVersionPublished,
    as_policy_version,
)
from rolloutbus.streams.inference.replica_health import get_health
from rolloutbus.streams.inference.weight_sync_applied import AppliedAnnouncer
from rolloutbus.streams.inference.weight_sync_metrics import WeightSyncMetrics

__all__ = [
    "ReplicaSyncState",
    "SyncOutcome",
    "WeightSync",
    "check_weights_folder",
    "sync_steps",
]

log = logging.getLogger(__name__)
# seconds per control call; a reload of a large checkpoint from local disk takes minutes
CONTROL_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 5.0  # seconds; a live replica answers /health at once
FOLLOW_POLL_S = 0.5  # seconds one control-topic poll waits: the stop latency of run()

Outcome = Literal["applied", "labelled", "failed"]  # labelled: version 0, no weights to load
HISTORY = 1000  # sync outcomes kept in SyncReport.history (a forever process)
_UNREACHABLE = "replica %s is unreachable: %s (it gets the current version once it answers /health)"
_LEFT_PAUSED = (
    "replica %s was paused when the weight sync started (a weight sync stopped between its "
    "pause and its resume?) and is still paused: resuming it"
)


@dataclass(frozen=True)
class SyncStep:
    """One HTTP call of the sync protocol."""

    name: str  # pause, reload, version, resume
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, str] | None = None


def sync_steps(
    backend: str,
    event: PolicyVersionPublished,
    *,
    partial_rollout: bool,
    lease_s: float | None = None,
) -> list[SyncStep]:
    """The calls that move one replica to ``event``'s version, in order; ``lease_s``: the
    lease asked on a vLLM-API pause (the embedded replica grants it, vLLM ignores it)."""
    # a JSON string: vLLM 0.32 answers 400 to an integer new_version; SGLang takes a string
    label = SyncStep(
        "version", "/update_weight_version", {"new_version": str(event.policy_version)}
    )
    if event.weights_path is None:
        return [label]
    if backend == "sglang":
        return [
            SyncStep(
                "pause", "/pause_generation", {"mode": "retract" if partial_rollout else "abort"}
            ),
            SyncStep("reload", "/update_weights_from_disk", {"model_path": event.weights_path}),
            label,
            SyncStep("resume", "/continue_generation", {}),
        ]
    pause = {"mode": "keep" if partial_rollout else "abort"}
    if lease_s is not None:
        pause["lease_s"] = f"{lease_s:g}"
    return [
        SyncStep("pause", "/pause", params=pause),
        SyncStep(
            "reload",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": event.weights_path}},
        ),
        label,
        SyncStep("resume", "/resume"),
    ]


@dataclass
class ReplicaSyncState:
    url: str
    applied: int | None = None  # the version this replica is known to serve; None: unknown
    healthy: bool = True
    failures: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class SyncOutcome:
    url: str
    policy_version: int
    outcome: Outcome
    seconds: float = 0.0
    error: str = ""


@dataclass
class SyncReport:
    """What the loop did: counts by outcome, and the last ``HISTORY`` outcomes."""

    outcomes: dict[str, int] = field(default_factory=dict)
    history: list[SyncOutcome] = field(default_factory=list)

    def add(self, outcome: SyncOutcome) -> None:
        self.outcomes[outcome.outcome] = self.outcomes.get(outcome.outcome, 0) + 1
        self.history = [*self.history[-(HISTORY - 1) :], outcome]


class WeightSync:
    """Applies policy versions to the replicas; use :meth:`run` as a process, or
    :meth:`apply` / :meth:`sync_once` in-process (tests, the trainer, the demo)."""

    def __init__(
        self,
        cfg: Config,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        on_outcome: Callable[[SyncOutcome], None] | None = None,
        registry: CollectorRegistry | None = None,
    ):
        self.cfg = cfg
        self.backend = cfg.replicas.backend
        self.partial_rollout = cfg.async_training.partial_rollout
        self.replicas = {
            url.rstrip("/"): ReplicaSyncState(url.rstrip("/")) for url in cfg.replicas.urls
        }
        self.current: PolicyVersionPublished | None = None
        self.report = SyncReport()
        self._on_outcome = on_outcome
        self._metrics = WeightSyncMetrics(registry)
        self._http = httpx.AsyncClient(timeout=CONTROL_TIMEOUT_S, transport=transport)
        self._lock = asyncio.Lock()  # one sync at a time: a probe never interleaves an apply
        self.lease_s = cfg.replicas.pause_lease_s
        self._found_paused: set[str] = set()  # replicas paused when this process started
        self.announcer = AppliedAnnouncer(cfg)  # PolicyVersionApplied, from run()

    async def aclose(self) -> None:
        await self._http.aclose()
        await asyncio.to_thread(self.announcer.close)

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- applying a version ------------------------------------------------------------

    async def apply(self, event: PolicyVersionPublished) -> list[SyncOutcome]:
        """Make ``event`` the current version and move every healthy replica to it."""
        _refuse_unweighted(event)
        async with self._lock:
            if self._reloads_every_replica(event):
                for replica in self.replicas.values():
                    replica.applied = None
            self.current = event
            # a replica known to be down gets it from sync_once when it is back
            targets = [
                r for r in self.replicas.values() if r.healthy and r.applied != event.policy_version
            ]
            return list(await asyncio.gather(*(self._apply_to(r, event) for r in targets)))

    def _reloads_every_replica(self, event: PolicyVersionPublished) -> bool:
        """A new run, or the same version republished from another folder: what a replica
        reports (its version label) cannot tell those weights from the ones it serves."""
        current = self.current
        if current is None:
            return False
        if event.run_epoch != current.run_epoch:
            return True
        return (
            event.policy_version == current.policy_version
            and event.weights_path != current.weights_path
        )

    async def sync_once(self) -> list[SyncOutcome]:
        """Probe every replica; give the current version to those that lack it (a replica
        that was down, maybe restarted on its initial weights, or one whose sync failed)."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas.values()))
        if self.current is None:
            return []
        async with self._lock:
            event = self.current
            behind = [
                r for r in self.replicas.values() if r.healthy and r.applied != event.policy_version
            ]
            return list(await asyncio.gather(*(self._apply_to(r, event) for r in behind)))

    async def _apply_to(
        self, replica: ReplicaSyncState, event: PolicyVersionPublished
    ) -> SyncOutcome:
        started = time.monotonic()
        steps = sync_steps(
            self.backend, event, partial_rollout=self.partial_rollout, lease_s=self.lease_s
        )
        try:
            check_weights_folder(event.weights_path)
            await self._run_steps(replica.url, steps)
        except ReplicaError as exc:
            replica.applied = None  # unknown: a half-done sync may have loaded the weights
            replica.failures += 1
            replica.last_error = str(exc)
            log.error("weight sync of version %d failed: %s", event.policy_version, exc)
            return self._record(replica, event, "failed", started, str(exc))
        replica.applied, replica.healthy, replica.last_error = event.policy_version, True, ""
        outcome: Outcome = "applied" if event.weights_path is not None else "labelled"
        log.info(
            "replica %s serves policy version %d (%s) after %.2f s",
            replica.url,
            event.policy_version,
            event.weights_path or "initial weights",
            time.monotonic() - started,
        )
        return self._record(replica, event, outcome, started)

    async def _run_steps(self, url: str, steps: list[SyncStep]) -> None:
        """Each step in order; if one after the pause fails, resume the replica (on its
        old weights) before raising, so a failed sync never leaves it paused. While the
        replica is paused under a lease, the lease is renewed until just before the resume."""
        paused = False
        lease = _LeaseRenewal(self, url)
        try:
            for step in steps:
                if step.name == "resume":
                    await lease.stop()  # no renewal may reach the replica after its resume
                response = await self._call(url, step)
                if step.name == "pause":
                    paused = True
                    lease.start_if_granted(step, response, self.lease_s)
                if step.name == "resume":
                    paused = False
        finally:
            await lease.stop()
            if paused:
                await self._resume_after_failure(url, steps)

    async def _resume_after_failure(self, url: str, steps: list[SyncStep]) -> None:
        resume = next(s for s in steps if s.name == "resume")
        try:
            await self._call(url, resume)
        except ReplicaError as exc:  # the original error is what the caller must see
            log.error("could not resume %s after a failed weight sync: %s", url, exc)

    async def _call(
        self, url: str, step: SyncStep, timeout_s: float | None = None
    ) -> httpx.Response:
        where = f"{step.name}: POST {url}{step.path}"
        timeout = timeout_s if timeout_s is not None else CONTROL_TIMEOUT_S
        try:
            response = await self._http.post(
                url + step.path, json=step.json, params=step.params, timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise ReplicaError(f"{where} answered {response.status_code}: {response.text[:500]}")
        if step.path == "/update_weights_from_disk":
            # SGLang answers 200 with success false when the load failed
            try:
                body = response.json()
            except ValueError:
                body = {}
            if isinstance(body, dict) and body.get("success") is False:
                raise ReplicaError(f"{where} did not load: {body.get('message', '')}")
        return response

    # -- health ------------------------------------------------------------------------

    async def _probe(self, replica: ReplicaSyncState) -> None:
        try:
            response = await self._http.get(replica.url + "/health", timeout=HEALTH_TIMEOUT_S)
            up = response.status_code == 200
        except httpx.HTTPError:
            up = False
        if not up and replica.healthy:
            log.warning("replica %s is down; it gets the current version when back", replica.url)
        if not up:
            # it may come back restarted, serving its initial weights: re-apply when it does
            replica.applied = None
        elif replica.applied is not None and self.backend != "sglang":
            await self._check_label(replica)
        replica.healthy = up

    async def _check_label(self, replica: ReplicaSyncState) -> None:
        """vLLM's ``GET /weight_info`` names the version the replica serves: a replica that
        restarted between two probes answers ``"default"`` and is synced again. A replica
        without the route (404) is judged by its health alone."""
        try:
            response = await self._http.get(replica.url + "/weight_info", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return
        if response.status_code != 200:
            return
        served = as_policy_version(response.json().get("weight_version"))
        if served != replica.applied:
            log.warning(
                "replica %s serves version %s, not %s (restarted?): syncing it again",
                replica.url,
                served,
                replica.applied,
            )
            replica.applied = None

    def _record(
        self,
        replica: ReplicaSyncState,
        event: PolicyVersionPublished,
        outcome: Outcome,
        started: float,
        error: str = "",
    ) -> SyncOutcome:
        result = SyncOutcome(
            replica.url, event.policy_version, outcome, time.monotonic() - started, error
        )
        self.report.add(result)
        self._metrics.syncs.labels(outcome).inc()
        if outcome != "failed":
            self._metrics.replica_version.labels(replica.url).set(event.policy_version)
            self._metrics.sync_seconds.observe(result.seconds)
        if self._on_outcome is not None:
            self._on_outcome(result)
        return result

    # -- the process -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> SyncReport:
        """Follow the control topic until ``stop`` is set: apply each new version, and
        re-sync replicas that come back, every ``replicas.health_interval_s``."""
        await self.check_replicas_at_start()
        latest = await asyncio.to_thread(latest_policy_version, self.cfg)
        if latest is not None and _is_new(self.current, latest):
            await self.apply(latest)  # the current version first, not the log's history
        await self.resume_left_paused()
        # this process writes the control topic's dead letters (kafka/control_reader.py)
        follower = PolicyVersionFollower(self.cfg, dead_letters=True)
        next_probe = 0.0
        try:
            while not stop.is_set():
                event = await asyncio.to_thread(follower.poll, FOLLOW_POLL_S)
                if event is not None and _is_new(self.current, event):
                    await self.apply(event)
                if time.monotonic() >= next_probe:
                    await self.sync_once()
                    next_probe = time.monotonic() + self.cfg.replicas.health_interval_s
                await self.announce_if_served()
        finally:
            await asyncio.to_thread(follower.close)
        return self.report

    async def announce_if_served(self) -> PolicyVersionApplied | None:
        """``PolicyVersionApplied`` for the current version once every replica serves it
        (``weight_sync_applied``); what was written, or None."""
        applied = {url: r.applied for url, r in self.replicas.items()}
        return await asyncio.to_thread(self.announcer.announce_if_served, self.current, applied)

    # -- start-up: who answers, who was left paused -------------------------------------

    async def check_replicas_at_start(self) -> dict[str, str | None]:
        """Probe every replica once; log by name each one that cannot be reached and why.
        Returns url -> the problem (None: it answers). Remembers those found paused."""
        looks = await asyncio.gather(*(self._first_look(r) for r in self.replicas.values()))
        problems = dict(zip(self.replicas, looks, strict=True))
        for url, problem in problems.items():
            if problem is not None:
                log.error(_UNREACHABLE, url, problem)
        reachable = sum(1 for problem in looks if problem is None)
        log.info("weight sync: %d of %d replicas reachable", reachable, len(looks))
        return problems

    async def _first_look(self, replica: ReplicaSyncState) -> str | None:
        _, problem = await get_health(self._http, replica.url, HEALTH_TIMEOUT_S)
        replica.healthy = problem is None
        if (
            problem is None
            and self.backend != "sglang"
            and await is_paused(self._http, replica.url)
        ):
            self._found_paused.add(replica.url)
        return problem

    async def resume_left_paused(self) -> list[str]:
        """vLLM's pause has no lease: a replica a killed weight sync left paused stays so.
        Each replica found paused at start and still paused now is resumed (after the
        current version was applied, so it resumes on the right weights when it can)."""
        resumed = []
        for url in sorted(self._found_paused):
            if not await is_paused(self._http, url):
                continue
            log.warning(_LEFT_PAUSED, url)
            try:
                await self._call(url, SyncStep("resume", "/resume"), HEALTH_TIMEOUT_S)
            except ReplicaError as exc:
                log.error("could not resume %s: %s", url, exc)
                continue
            resumed.append(url)
        self._found_paused.clear()
        return resumed


async def is_paused(http: httpx.AsyncClient, url: str) -> bool:
    """vLLM's (and the embedded replica's) ``GET /is_paused``; False when it cannot say."""
    try:
        response = await http.get(url + "/is_paused", timeout=HEALTH_TIMEOUT_S)
        return response.status_code == 200 and response.json().get("is_paused") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False  # no dev-mode control surface, or not JSON: nothing to resume


class _LeaseRenewal:
    """Renews one replica's pause lease, every third of it, while a sync works on it."""

    def __init__(self, sync: WeightSync, url: str):
        self._sync, self._url = sync, url
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start_if_granted(self, pause: SyncStep, response: httpx.Response, lease_s: float) -> None:
        """Renew only a lease the replica said it holds (vLLM answers without one)."""
        try:
            granted = response.json().get("pause_lease_s") is not None
        except (ValueError, AttributeError):
            granted = False
        if granted:
            self._task = asyncio.ensure_future(self._renew(pause, lease_s / 3))

    async def _renew(self, pause: SyncStep, every_s: float) -> None:
        while True:
            try:
                async with asyncio.timeout(every_s):  # not wait_for: see sessions/runner.py
                    await self._stopping.wait()
                return
            except TimeoutError:
                pass
            try:  # a pause in the same mode renews the lease (and pauses again if it ran out)
                await self._sync._call(self._url, pause, HEALTH_TIMEOUT_S)
            except ReplicaError as exc:
                log.warning("could not renew the pause lease of %s: %s", self._url, exc)

    async def stop(self) -> None:
        """Stop renewing; returns once no renewal is in flight."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None


def check_weights_folder(weights_path: str | None) -> None:
    """Refuse a folder that cannot be a checkpoint before any replica is touched: vLLM 0.32's
    engine dies on a failed reload_weights (the next request gets EngineDeadError) instead
    of answering an error. The folder must be at the same path for this process and the
    replicas (one machine, or a shared filesystem)."""
    if weights_path is None:
        return
    folder = Path(weights_path)
    if not folder.is_dir():
        raise ReplicaError(f"weights_path {weights_path}: no such folder here")
    if not any(folder.glob("*.safetensors")):
        raise ReplicaError(f"weights_path {weights_path}: no *.safetensors file in it")


def _is_new(current: PolicyVersionPublished | None, event: PolicyVersionPublished) -> bool:
    """The follower reads the topic from its start, and ``run`` also applied the latest
    version before following: only a version that supersedes the applied one is new (a
    newer run, or a later version of the same run, or the same one from another folder)."""
    return supersedes(event, current)


def _refuse_unweighted(event: PolicyVersionPublished) -> None:
    """A version above 0 without weights would relabel a replica's weights unchanged."""
    if event.policy_version > 0 and event.weights_path is None:
        raise SchemaError(
            f"policy version {event.policy_version} names no weights_path: refusing to "
            "relabel the replicas' weights as it"
        )
