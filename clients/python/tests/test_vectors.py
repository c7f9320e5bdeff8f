"""The Python reference against the shared routing vectors
(``testdata/routing-vectors.json``, written by the Rust generator): every
hash, hashtag, slot, jump bucket, weighted score and routed key must match.
"""

import json
import os
import struct

import pytest

from shardq.routing import HASHES, Ring, Router, hashtag, jump, slot, weighted_score

VECTORS_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "testdata", "routing-vectors.json")

with open(VECTORS_PATH, encoding="utf-8") as f:
    VECTORS = json.load(f)


def check(failures, what, got, want):
    """The one comparison helper: records a mismatch instead of stopping, so a
    run reports every difference at once."""
    if got != want:
        failures.append(f"{what}: got {got!r}, want {want!r}")


def assert_no_failures(failures, checked):
    assert not failures, f"{len(failures)} of {checked} checks failed:\n" + "\n".join(failures[:20])


def test_file_says_how_it_was_made():
    assert VECTORS["generated_by"].startswith("cargo run -p shardq-route --example gen_vectors")
    assert VECTORS["format_version"] == 1


@pytest.mark.parametrize("hash_name", sorted(HASHES))
def test_hashes(hash_name):
    failures, rows = [], VECTORS["hashes"]
    assert len(rows) >= 40
    for row in rows:
        check(failures, f"{hash_name}({row['key']!r})", HASHES[hash_name](row["key"].encode()), int(row[hash_name]))
    assert_no_failures(failures, len(rows))


def test_slots_and_hashtags():
    failures, rows = [], VECTORS["slots"]
    assert len(rows) >= 200
    for row in rows:
        key = row["key"].encode()
        check(failures, f"hashtag({row['key']!r})", hashtag(key), row["hashtag"].encode())
        check(failures, f"slot({row['key']!r})", slot(key), row["slot"])
    assert_no_failures(failures, 2 * len(rows))


def test_jump():
    failures, rows = [], VECTORS["jump"]
    for row in rows:
        key, buckets = int(row["key"]), row["buckets"]
        check(failures, f"jump({key}, {buckets})", jump(key, buckets), row["bucket"])
    assert_no_failures(failures, len(rows))


def test_weighted_scores_bit_for_bit():
    failures, rows = [], VECTORS["weighted_scores"]
    for row in rows:
        x, weight = int(row["x"]), row["weight"]
        bits = struct.pack(">d", weighted_score(weight, x)).hex()
        check(failures, f"weighted_score({weight}, {x})", bits, row["score_bits"])
    assert_no_failures(failures, len(rows))


@pytest.mark.parametrize("case", VECTORS["maps"], ids=[m["name"] for m in VECTORS["maps"]])
def test_map_routes_every_key(case):
    failures = []
    router = Router.from_yaml(case["yaml"])
    check(failures, "algorithm", router.map.algorithm, case["algorithm"])
    check(failures, "hash", router.map.hash, case["hash"])
    if "ring_distinct_points" in case:
        check(failures, "ring points", len(router.ring.points), case["ring_distinct_points"])
    assert len(case["owners"]) >= 200
    for key, want in case["owners"]:
        check(failures, f"route({key!r})", router.route(key), want)
    assert_no_failures(failures, len(case["owners"]) + 3)


def test_every_algorithm_and_hash_is_covered():
    maps = VECTORS["maps"]
    assert {m["algorithm"] for m in maps} == {"modulo", "ring", "rendezvous", "jump", "slots"}
    assert {m["hash"] for m in maps} == set(HASHES)
    # The crc16 ring exists to pin the tie rule: it must really have ties.
    tie_ring = next(m for m in maps if m["name"] == "ring-crc16-v2048-ties")
    assert tie_ring["ring_distinct_points"] < 4 * 2048


def test_ring_tie_goes_to_the_later_shard():
    # A constant hash puts every point on one value: the last shard owns it.
    ring = Ring(lambda b: 7, 4, [("a", 1), ("b", 1), ("c", 1)])
    assert ring.points == [7]
    assert ring.lookup(0) == ring.lookup(7) == ring.lookup(2**64 - 1) == 2
