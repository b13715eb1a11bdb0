"""Routing decisions of the load balancer: pure logic, no I/O."""

from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest

from rolloutbus.errors import NoReplicaAvailableError
from rolloutbus.streams.inference.routing import LoadBalancer, stable_hash

A, B, C, D = "http://a:8000", "http://b:8000", "http://c:8000", "http://d:8000"


def balancer(*replicas: str, seed: int = 0, **kwargs) -> LoadBalancer:
    return LoadBalancer(replicas or (A, B, C), rng=random.Random(seed), **kwargs)


def test_later_turns_stick_to_the_first_replica():
    lb = balancer()
    first = lb.acquire("traj-1")
    lb.release(first)
    # Load the other replicas less: stickiness beats least in-flight.
    for _ in range(5):
        lb.acquire("other")  # sticks too, so all 5 land on one replica
    assert [lb.acquire("traj-1") for _ in range(3)] == [first] * 3


def test_first_requests_go_to_the_least_loaded_replica():
    lb = balancer()
    picks = [lb.acquire(f"t{i}") for i in range(6)]  # nothing released: load builds up
    assert Counter(picks) == {A: 2, B: 2, C: 2}
    lb.release(B)
    assert lb.acquire("t-new") == B


def test_random_tie_break_spreads_evenly_instead_of_piling_onto_the_first():
    """verl #7613: ties went to candidates[0], so a burst of released-at-once trajectories
    all landed on the first replica. Acquire+release keeps every replica at 0 in flight,
    so every pick is a four-way tie."""
    lb = balancer(A, B, C, D, seed=7)
    picks = Counter()
    for i in range(4000):
        replica = lb.acquire(f"t{i}")
        picks[replica] += 1
        lb.release(replica)
    assert set(picks) == {A, B, C, D}
    assert all(800 <= n <= 1200 for n in picks.values()), picks


def test_tie_break_is_reproducible_with_an_injected_rng():
    def run():
        lb = balancer(seed=42)
        out = []
        for i in range(20):
            out.append(lb.acquire(f"t{i}"))
            lb.release(out[-1])
        return out

    assert run() == run()


def test_removed_replica_drops_its_sticky_entries_and_the_next_turn_re_picks():
    lb = balancer()
    first = lb.acquire("traj")
    lb.remove_replicas([first])
    assert lb.sticky_replica_of("traj") is None
    assert first not in lb.in_flight
    again = lb.acquire("traj")
    assert again != first and again in lb.replicas
    lb.release(first)  # a late release for a removed replica is ignored
    assert first not in lb.in_flight


def test_unhealthy_sticky_replica_is_left_and_healthy_again_is_routable():
    lb = balancer()
    first = lb.acquire("traj")
    lb.release(first)
    lb.mark_unhealthy(first)
    moved = lb.acquire("traj")
    assert moved != first
    assert lb.acquire("traj") == moved  # the new replica is now sticky
    lb.mark_healthy(first)
    assert lb.is_healthy(first)
    assert lb.acquire("traj") == moved  # recovery does not move live trajectories back


def test_no_healthy_replica_raises():
    lb = balancer(A, B)
    lb.mark_unhealthy(A)
    lb.mark_unhealthy(B)
    with pytest.raises(NoReplicaAvailableError, match="no healthy replica"):
        lb.acquire("traj")
    with pytest.raises(NoReplicaAvailableError):
        LoadBalancer().acquire("traj")


def test_release_never_goes_below_zero():
    lb = balancer(A)
    lb.release(A)
    lb.release(A)
    assert lb.in_flight[A] == 0
    lb.acquire("t")
    lb.release(A)
    lb.release(A)
    assert lb.in_flight[A] == 0


def test_sticky_cache_is_lru_with_the_configured_size():
    lb = balancer(sticky_cache_size=2)
    for rid in ("t1", "t2"):
        lb.release(lb.acquire(rid))
    lb.release(lb.acquire("t1"))  # t1 is now most recently used
    lb.release(lb.acquire("t3"))  # evicts t2, the least recently used
    assert lb.sticky_replica_of("t1") is not None
    assert lb.sticky_replica_of("t2") is None
    assert lb.sticky_replica_of("t3") is not None


def test_default_sticky_cache_size_is_verls():
    lb = balancer(A)
    for i in range(10_001):
        lb.release(lb.acquire(f"t{i}"))
    assert lb.sticky_replica_of("t0") is None
    assert lb.sticky_replica_of("t1") == A


def test_clear_sticky_cache():
    lb = balancer()
    lb.acquire("t")
    lb.clear_sticky_cache()
    assert lb.sticky_replica_of("t") is None


def test_add_replicas_joins_routing_with_nothing_in_flight():
    lb = balancer(A)
    lb.acquire("t1")
    lb.add_replicas([B, A])  # A is known: its count is kept
    assert lb.in_flight == {A: 1, B: 0}
    assert lb.acquire("t2") == B


def test_full_determinism_routes_by_a_stable_hash():
    ids = [f"traj-{i}" for i in range(50)]
    lb1 = balancer(seed=1, full_determinism=True)
    lb2 = balancer(seed=2, full_determinism=True)
    picks1 = [lb1.acquire(r) for r in ids]  # load differs along the way: hash ignores it
    picks2 = [lb2.acquire(r) for r in ids]
    assert picks1 == picks2 == [(A, B, C)[stable_hash(r) % 3] for r in ids]
    assert len(set(picks1)) == 3


def test_stable_hash_is_not_pythons_salted_hash():
    # crc32 of the UTF-8 bytes: the same in every process and on every machine.
    assert stable_hash("traj-0") == zlib.crc32(b"traj-0")


def test_in_flight_view_is_read_only():
    lb = balancer()
    with pytest.raises(TypeError):
        lb.in_flight[A] = 5  # type: ignore[index]
