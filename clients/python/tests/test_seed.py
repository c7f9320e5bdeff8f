"""The specification's own Python (seed 000: ``h``, ``HashRing``,
``rendezvous``) against ``shardq.routing``, and the specification's numbers for
100,000 tenants going from 4 to 5 shards.

The seed code is restated here with its semantics unchanged (blake2b64,
``bisect`` on sorted points with a dict of owners, ``max`` over shards), so
that ``shardq.routing`` -- and through the shared vectors the Rust crate -- is
tied to the text users read.
"""

import bisect
import hashlib

import pytest

from shardq.routing import Router

SHARDS4 = ["redis-0", "redis-1", "redis-2", "redis-3"]
SHARDS5 = SHARDS4 + ["redis-4"]
TENANTS = [f"t-{i}" for i in range(100_000)]


def h(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class SeedHashRing:
    def __init__(self, shards, vnodes=256):
        self.points = []
        self.owner = {}
        for name, weight in shards.items():
            for i in range(vnodes * weight):
                p = h(f"{name}#{i}")
                self.points.append(p)
                self.owner[p] = name
        self.points.sort()

    def shard_for(self, key):
        i = bisect.bisect(self.points, h(key)) % len(self.points)
        return self.owner[self.points[i]]


def seed_rendezvous(key, shards):
    return max(shards, key=lambda s: h(f"{s}:{key}"))


def router(algorithm, shards, vnodes=256):
    listed = ", ".join(f"{{name: {s}}}" for s in shards)
    return Router.from_yaml(
        f"version: 1\nalgorithm: {algorithm}\nhash: blake2b64\nvnodes: {vnodes}\nshards: [{listed}]\n"
    )


def check(failures, what, got, want):
    if got != want:
        failures.append(f"{what}: got {got!r}, want {want!r}")


@pytest.mark.parametrize("shards", [SHARDS4, SHARDS5], ids=["4-shards", "5-shards"])
def test_ring_matches_seed_hash_ring(shards):
    seed = SeedHashRing({s: 1 for s in shards})
    ours = router("ring", shards)
    failures = []
    for key in TENANTS[:10_000]:
        check(failures, key, ours.route(key), seed.shard_for(key))
    assert not failures, failures[:10]


@pytest.mark.parametrize("shards", [SHARDS4, SHARDS5], ids=["4-shards", "5-shards"])
def test_rendezvous_matches_seed_rendezvous(shards):
    ours = router("rendezvous", shards)
    failures = []
    for key in TENANTS[:10_000]:
        check(failures, key, ours.route(key), seed_rendezvous(key, shards))
    assert not failures, failures[:10]


def moves(algorithm):
    """(fraction of tenants moved 4 -> 5, whether all went to redis-4, max/min load at 5)."""
    before, after = router(algorithm, SHARDS4), router(algorithm, SHARDS5)
    moved, all_to_new = 0, True
    counts = dict.fromkeys(SHARDS5, 0)
    for t in TENANTS:
        b, a = before.route(t), after.route(t)
        counts[a] += 1
        if a != b:
            moved += 1
            all_to_new = all_to_new and a == "redis-4"
    return moved / len(TENANTS), all_to_new, max(counts.values()) / min(counts.values())


def test_seed_modulo_moves_about_80_percent():
    moved, _, _ = moves("modulo")
    assert abs(moved - 0.8) < 0.01, moved


def test_seed_ring_moves_about_20_percent_all_to_the_new_shard():
    moved, all_to_new, _ = moves("ring")
    # The seed's ring code, run as written, moves exactly 21,811 of these
    # tenants (21.8%; its comment says 20.1%): 256 vnodes leave a few percent
    # of arc noise around the ideal 1/5. Pinned, as the ring must equal it.
    assert round(moved * len(TENANTS)) == 21_811, moved
    assert abs(moved - 0.2) < 0.025, moved
    assert all_to_new


def test_seed_rendezvous_moves_about_20_percent_evenly():
    moved, all_to_new, max_min = moves("rendezvous")
    assert abs(moved - 0.2) < 0.01, moved
    assert all_to_new
    assert max_min < 1.05, max_min
