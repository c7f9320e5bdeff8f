"""The shard map and every routing algorithm, as a readable reference for the
Rust crate ``shardq-route`` (``src/map.rs``, ``ring.rs``, ``rendezvous.rs``,
``jump.rs``, ``slots.rs``, ``router.rs``).

Written for clarity over speed: it must give the same shard as the Rust
router for every key, which ``tests/test_vectors.py`` checks against
``testdata/routing-vectors.json``. It does no I/O: callers hand it YAML text.

Routing rule: an override wins whatever the shard's state; otherwise the
map's algorithm picks among the ``active`` shards only, in map order.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from .hashes import HASHES, U64_MASK, HashFn, crc16

SLOT_COUNT = 16384
VNODES_DEFAULT = 256
VNODES_MAX = 4096
WEIGHT_MAX = 1000
ALGORITHMS = ("modulo", "ring", "rendezvous", "jump", "slots")
STATES = ("active", "warming", "draining")
_SHARD_FIELDS = {"name", "url", "weight", "state", "slots"}
_MAP_FIELDS = {"version", "algorithm", "hash", "vnodes", "shards", "overrides"}


class MapError(ValueError):
    """A shard map that cannot be used; the message names the field and value."""


@dataclass
class Shard:
    name: str
    url: Optional[str] = None
    weight: int = 1
    state: str = "active"
    #: Inclusive ``(start, end)`` slot ranges (the ``slots`` algorithm only).
    slots: List[Tuple[int, int]] = field(default_factory=list)


@dataclass
class ShardMap:
    version: int
    algorithm: str
    hash: str
    vnodes: int
    shards: List[Shard]
    overrides: Dict[str, str]


def _int_field(value: object, name: str, lo: int, hi: Optional[int]) -> int:
    # bool is an int subclass in Python; YAML `true` is not a number.
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise MapError(f"field `{name}` has invalid value {value!r}: expected an integer {bound}")
    return value


def _slot_range(value: object, name: str) -> Tuple[int, int]:
    bad = MapError(f"field `{name}` has invalid value {value!r}: expected a slot or a range such as \"0-5460\"")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        start = end = value
    elif isinstance(value, str):
        parts = value.split("-", 1)
        try:
            start, end = int(parts[0].strip()), int(parts[-1].strip())
        except ValueError:
            raise bad from None
    else:
        raise bad
    if start < 0 or start > end or end >= SLOT_COUNT:
        raise bad
    return start, end


def parse_map(text: str) -> ShardMap:
    """Parses and validates a YAML shard map."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise MapError(f"shard map is not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise MapError("the shard map must be a YAML mapping")
    unknown = set(map(str, doc)) - _MAP_FIELDS
    if unknown:
        raise MapError(f"unknown field(s) {sorted(unknown)}; expected one of {sorted(_MAP_FIELDS)}")
    if doc.get("version") is None:
        raise MapError("missing field `version`")
    version = _int_field(doc["version"], "version", 0, None)
    algorithm = doc.get("algorithm") or "rendezvous"
    if algorithm not in ALGORITHMS:
        raise MapError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    hash_name = doc.get("hash") or "blake2b64"
    if hash_name not in HASHES:
        raise MapError(f"unknown hash {hash_name!r}; expected one of {', '.join(HASHES)}")
    vnodes = VNODES_DEFAULT if doc.get("vnodes") is None else _int_field(doc["vnodes"], "vnodes", 1, VNODES_MAX)
    raw_shards = doc.get("shards")
    if not isinstance(raw_shards, list) or not raw_shards:
        raise MapError("field `shards` must be a non-empty list")
    shards = []
    for i, s in enumerate(raw_shards):
        if not isinstance(s, dict) or not isinstance(s.get("name"), str):
            raise MapError(f"`shards[{i}]` must be a mapping with a string name")
        if set(s) - _SHARD_FIELDS:
            raise MapError(f"`shards[{i}]` has unknown field(s) {sorted(set(s) - _SHARD_FIELDS)}")
        weight = 1 if s.get("weight") is None else _int_field(s["weight"], f"shards[{i}].weight", 1, WEIGHT_MAX)
        state = s.get("state") or "active"
        if state not in STATES:
            raise MapError(f"unknown state {state!r} in shards[{i}]; expected active, warming or draining")
        raw_slots = s.get("slots")
        if raw_slots is None:
            slots = []
        elif isinstance(raw_slots, list):
            slots = [_slot_range(v, f"shards[{i}].slots[{j}]") for j, v in enumerate(raw_slots)]
        else:
            slots = [_slot_range(raw_slots, f"shards[{i}].slots")]
        shards.append(Shard(s["name"], s.get("url"), weight, state, slots))
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise MapError("duplicate shard name")
    if not any(s.state == "active" for s in shards):
        raise MapError("no shard is active; at least one must be active")
    owner_of_slot: Dict[int, str] = {}
    for s in shards:
        for start, end in s.slots:
            for slot_no in range(start, end + 1):
                prev = owner_of_slot.setdefault(slot_no, s.name)
                if prev != s.name:
                    raise MapError(f"slot {slot_no} is assigned to both {prev!r} and {s.name!r}")
    overrides = {}
    for key, shard in (doc.get("overrides") or {}).items():
        if shard not in names:
            raise MapError(f"override for key {key!r} names unknown shard {shard!r}")
        # YAML reads `123: shard-0` as a number; keys are strings.
        overrides[str(key)] = shard
    return ShardMap(version, algorithm, hash_name, vnodes, shards, overrides)


class Ring:
    """Hash ring: shard ``name`` of weight ``w`` owns points ``h(f"{name}#{i}")``
    for ``i < vnodes * w``; a key goes to the first point strictly above its
    hash, wrapping. Equal points go to the shard *last* in map order, since a
    later write to ``owner`` wins."""

    def __init__(self, hash_fn: HashFn, vnodes: int, shards: Sequence[Tuple[str, int]]):
        owner: Dict[int, int] = {}
        for pos, (name, weight) in enumerate(shards):
            for i in range(vnodes * weight):
                owner[hash_fn(f"{name}#{i}".encode())] = pos
        self.points = sorted(owner)
        self.owners = [owner[p] for p in self.points]

    def lookup(self, h: int) -> int:
        """Position (in the active list) of the owner of hash ``h``."""
        return self.owners[bisect.bisect(self.points, h) % len(self.points)]


def weighted_score(weight: int, x: int) -> float:
    """Logarithmic-method score. ``x >> 12`` keeps 52 bits so ``(x >> 12) + 0.5``
    is exact in a double and ``u`` stays below 1 (``log`` never returns 0).
    Every step is exact or correctly rounded IEEE arithmetic except ``log``,
    which Python and Rust both take from the platform's libm."""
    u = ((x >> 12) + 0.5) / 2.0**52
    return weight / -math.log(u)


class Rendezvous:
    """Highest random weight over ``h(f"{name}:{key}")``; ties go to the
    earliest shard (``max`` keeps the first maximum). Weighted only when the
    active weights differ, so equal weights give exactly the unweighted answer."""

    def __init__(self, hash_fn: HashFn, shards: Sequence[Tuple[str, int]]):
        self.hash_fn = hash_fn
        self.prefixes = [f"{name}:".encode() for name, _ in shards]
        self.weights = [w for _, w in shards]
        self.weighted = len(set(self.weights)) > 1

    def lookup(self, key: bytes) -> int:
        h = self.hash_fn
        positions = range(len(self.prefixes))
        if self.weighted:
            return max(positions, key=lambda i: weighted_score(self.weights[i], h(self.prefixes[i] + key)))
        return max(positions, key=lambda i: h(self.prefixes[i] + key))


def jump(key: int, buckets: int) -> int:
    """Lamping-Veach jump consistent hash, with the paper's 64-bit LCG."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & U64_MASK
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def hashtag(key: bytes) -> bytes:
    """Bytes between the first ``{`` and the next ``}`` when non-empty, else the key."""
    open_at = key.find(b"{")
    if open_at >= 0:
        close_at = key.find(b"}", open_at + 1)
        if close_at > open_at + 1:
            return key[open_at + 1 : close_at]
    return key


def slot(key: bytes) -> int:
    """Redis Cluster slot: CRC16-XMODEM of the hashtag mod 16384."""
    return crc16(hashtag(key)) % SLOT_COUNT


class Router:
    """A shard map compiled for lookups; immutable, one per map version."""

    def __init__(self, shard_map: ShardMap):
        self.map = shard_map
        self.hash_fn = HASHES[shard_map.hash]
        self.active = [i for i, s in enumerate(shard_map.shards) if s.state == "active"]
        pairs = [(shard_map.shards[i].name, shard_map.shards[i].weight) for i in self.active]
        algorithm = shard_map.algorithm
        self.ring = Ring(self.hash_fn, shard_map.vnodes, pairs) if algorithm == "ring" else None
        self.hrw = Rendezvous(self.hash_fn, pairs) if algorithm in ("rendezvous", "slots") else None
        self.slot_owners: List[int] = []
        if algorithm == "slots":
            explicit: Dict[int, int] = {}
            # Only active shards' ranges count; a warming shard's wait for it to go active.
            for pos, i in enumerate(self.active):
                for start, end in shard_map.shards[i].slots:
                    for s in range(start, end + 1):
                        explicit[s] = pos
            self.slot_owners = [
                explicit[s] if s in explicit else self._hrw().lookup(str(s).encode()) for s in range(SLOT_COUNT)
            ]

    def _hrw(self) -> "Rendezvous":
        assert self.hrw is not None, "rendezvous state of a map that does not use it"
        return self.hrw

    @classmethod
    def from_yaml(cls, text: str) -> "Router":
        return cls(parse_map(text))

    def computed(self, key: str) -> str:
        """Shard the algorithm picks for ``key``, ignoring overrides."""
        data = key.encode("utf-8")
        algorithm = self.map.algorithm
        if algorithm == "modulo":
            pos = self.hash_fn(data) % len(self.active)
        elif algorithm == "ring":
            assert self.ring is not None
            pos = self.ring.lookup(self.hash_fn(data))
        elif algorithm == "rendezvous":
            pos = self._hrw().lookup(data)
        elif algorithm == "jump":
            pos = jump(self.hash_fn(data), len(self.active))
        else:
            pos = self.slot_owners[slot(data)]
        return self.map.shards[self.active[pos]].name

    def route(self, key: str) -> str:
        """Shard owning ``key``: its override if any, else the computed shard."""
        override = self.map.overrides.get(key)
        return override if override is not None else self.computed(key)
