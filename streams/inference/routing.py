"""Which replica serves a generate() call: sticky sessions plus least in-flight.

A trajectory's turns share a growing prefix, so every turn after the first goes back to
the replica that served the first one, where that prefix already sits in the KV cache
(verl's ``GlobalRequestLoadBalancer``: an LRU from the trajectory's request id to a
replica). A trajectory's first request goes to the healthy replica with the fewest
requests in flight; ties are broken at random, not by list order, so that a burst of new
trajectories spreads over equally idle replicas instead of avalanching onto the first
one (verl PR #7613). Under ``full_determinism`` the first choice is a stable hash of the
request id instead, so a rerun routes every trajectory to the same replica.

verl's plug-in router: ``rollout.router_config_path`` names a YAML file whose
``router_class`` is a dotted path to a ``LoadBalancer`` subclass; ``load_balancer`` builds it
as verl builds its plug-in, ``cls(replica_ids, the_whole_yaml_as_a_dict)`` (verl passes its
servers and the dict). The subclass overrides ``acquire`` (and whatever else it needs);
membership, health and in-flight bookkeeping are the base class's.

In-flight counts are per worker process, on purpose. Kafka partitions already spread
prompt groups evenly over the session workers, so each worker balancing its own share
over all replicas keeps the replicas balanced in aggregate; a shared counter (in Kafka
or anywhere else) would add a network hop to every turn in exchange for a slightly
tighter balance. The balancer is pure bookkeeping with no I/O; the LLM client owns it.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from rolloutbus.errors import ConfigError, NoReplicaAvailableError
from rolloutbus.streams.plugins import import_object

__all__ = ["DEFAULT_STICKY_CACHE_SIZE", "LoadBalancer", "load_balancer", "stable_hash"]

# entries; verl's LRUCache(maxsize=10000): enough for every trajectory in flight on
# one worker, small enough (about a megabyte) to never matter.
DEFAULT_STICKY_CACHE_SIZE = 10_000


def stable_hash(key: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` of str is salted)."""
    return zlib.crc32(key.encode("utf-8"))


class LoadBalancer:
    """Routes trajectories to replicas; replica ids are the replicas' base URLs."""

    def __init__(
        self,
        replica_ids: Iterable[str] = (),
        *,
        sticky_cache_size: int = DEFAULT_STICKY_CACHE_SIZE,
        full_determinism: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        if sticky_cache_size < 1:
            raise ValueError(f"sticky_cache_size must be >= 1, got {sticky_cache_size}")
        self._sticky_cache_size = sticky_cache_size
        self._full_determinism = full_determinism
        self._rng = rng or random.Random()
        # replica id -> requests in flight from this process; dict order = config order,
        # which the determinism hash indexes into.
        self._in_flight: dict[str, int] = {}
        self._unhealthy: set[str] = set()
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self.add_replicas(replica_ids)

    # -- routing -------------------------------------------------------------------

    def acquire(self, request_id: str) -> str:
        """Pick the replica for one call of trajectory ``request_id`` and count it in flight."""
        replica_id = self._sticky_replica(request_id)
        if replica_id is None:
            replica_id = self._pick_first(request_id)
        self._remember(request_id, replica_id)
        self._in_flight[replica_id] += 1
        return replica_id

    def release(self, replica_id: str) -> None:
        """The call finished (in any way). Never below zero; a removed replica is ignored."""
        count = self._in_flight.get(replica_id)
        if count is not None:
            self._in_flight[replica_id] = max(0, count - 1)

    def _sticky_replica(self, request_id: str) -> str | None:
        replica_id = self._sticky.get(request_id)
        if replica_id is None:
            return None
        if replica_id not in self._in_flight or replica_id in self._unhealthy:
            del self._sticky[request_id]  # its replica is gone or sick: route afresh
            return None
        self._sticky.move_to_end(request_id)
        return replica_id

    def _pick_first(self, request_id: str) -> str:
        healthy = self.healthy_replicas
        if not healthy:
            raise NoReplicaAvailableError(
                f"no healthy replica for request {request_id!r}: "
                f"{len(self._in_flight)} known, {len(self._unhealthy)} unhealthy"
            )
        if self._full_determinism:
            return healthy[stable_hash(request_id) % len(healthy)]
        fewest = min(self._in_flight[r] for r in healthy)
        return self._rng.choice([r for r in healthy if self._in_flight[r] == fewest])

    def _remember(self, request_id: str, replica_id: str) -> None:
        self._sticky[request_id] = replica_id
        self._sticky.move_to_end(request_id)
        while len(self._sticky) > self._sticky_cache_size:
            self._sticky.popitem(last=False)

    # -- membership and health -----------------------------------------------------

    def add_replicas(self, replica_ids: Iterable[str]) -> None:
        """Add replicas (healthy, nothing in flight); known ones are left as they are."""
        for replica_id in replica_ids:
            self._in_flight.setdefault(replica_id, 0)

    def remove_replicas(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas and every sticky entry that points at them."""
        removed = set(replica_ids)
        for replica_id in removed:
            self._in_flight.pop(replica_id, None)
            self._unhealthy.discard(replica_id)
        for request_id in [k for k, v in self._sticky.items() if v in removed]:
            del self._sticky[request_id]

    def mark_unhealthy(self, replica_id: str) -> None:
        """Take a replica out of routing; its sticky trajectories move on their next turn."""
        if replica_id in self._in_flight:
            self._unhealthy.add(replica_id)

    def mark_healthy(self, replica_id: str) -> None:
        self._unhealthy.discard(replica_id)

    def clear_sticky_cache(self) -> None:
        self._sticky.clear()

    # -- views ---------------------------------------------------------------------

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(self._in_flight)

    @property
    def healthy_replicas(self) -> tuple[str, ...]:
        return tuple(r for r in self._in_flight if r not in self._unhealthy)

    @property
    def in_flight(self) -> Mapping[str, int]:
        """Read-only live view: replica id -> calls in flight from this process."""
        return MappingProxyType(self._in_flight)

    def is_healthy(self, replica_id: str) -> bool:
        return replica_id in self._in_flight and replica_id not in self._unhealthy

    def sticky_replica_of(self, request_id: str) -> str | None:
        """Where the trajectory is pinned now, without touching the LRU order."""
        return self._sticky.get(request_id)

    def __len__(self) -> int:
        return len(self._in_flight)


def load_balancer(
    replica_ids: Iterable[str],
    *,
    router_config_path: str | None = None,
    sticky_cache_size: int = DEFAULT_STICKY_CACHE_SIZE,
    full_determinism: bool = False,
    rng: random.Random | None = None,
) -> LoadBalancer:
    """The built-in balancer, or the plug-in that ``router_config_path`` names (verl's
    ``rollout.router_config_path``: a YAML file with ``router_class``)."""
    if not router_config_path:
        return LoadBalancer(
            replica_ids,
            sticky_cache_size=sticky_cache_size,
            full_determinism=full_determinism,
            rng=rng,
        )
    settings = _router_yaml(router_config_path)
    path = settings.get("router_class")
    if not isinstance(path, str) or not path:
        raise ConfigError(  # verl's ValueError text, with the file named
            f"router config {router_config_path} must contain 'router_class' (a dotted path). "
            "Example: router_class: my_pkg.routing.KvCacheAwareRouter"
        )
    what = f"router (router_class of rollout.router_config_path {router_config_path})"
    cls = import_object(path, what=what, kind="class", error=ConfigError)
    if not issubclass(cls, LoadBalancer):
        raise ConfigError(
            f"cannot load {what} from {path!r}: {cls.__qualname__} is not a subclass of "
            "rolloutbus.streams.inference.routing.LoadBalancer"
        )
    return cls(replica_ids, settings)


def _router_yaml(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        loaded = yaml.safe_load(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"Router config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"router config {path} is not valid YAML: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"router config {path} must be a YAML mapping with 'router_class'")
    if "defaults" in loaded:  # verl refuses Hydra's defaults blocks too
        raise ConfigError(
            f"router config {path} uses a Hydra 'defaults' block, which is not supported: "
            "inline the referenced configs"
        )
    return loaded
