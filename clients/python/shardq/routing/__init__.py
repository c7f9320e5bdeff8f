"""shardq.routing: a pure-Python reference of shardq's routing.

It routes every key to the same shard as the Rust crate ``shardq-route``,
which the shared vectors in ``testdata/routing-vectors.json`` check. Meant as
the specification in executable form and as a client for Python producers;
it does no I/O.
"""

from .hashes import HASHES, blake2b64, crc16, fnv1a64, murmur3, xxh3, xxh64
from .router import (
    SLOT_COUNT,
    MapError,
    Rendezvous,
    Ring,
    Router,
    Shard,
    ShardMap,
    hashtag,
    jump,
    parse_map,
    slot,
    weighted_score,
)

__all__ = [
    "HASHES",
    "SLOT_COUNT",
    "MapError",
    "Rendezvous",
    "Ring",
    "Router",
    "Shard",
    "ShardMap",
    "blake2b64",
    "crc16",
    "fnv1a64",
    "hashtag",
    "jump",
    "murmur3",
    "parse_map",
    "slot",
    "weighted_score",
    "xxh3",
    "xxh64",
]
