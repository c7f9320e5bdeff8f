"""Stable 64-bit hashes of a key's UTF-8 bytes, bit-for-bit equal to the Rust
crate ``shardq-route`` (``src/hash.rs``).

BLAKE2b-64, FNV-1a 64 and CRC16-XMODEM use the standard library only; xxh64
and xxh3 come from the ``xxhash`` package and murmur3 from ``mmh3``, both
thin bindings of the reference C code. Python's built-in ``hash()`` is never
used: it is randomised per process.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, List

import mmh3
import xxhash

U64_MASK = (1 << 64) - 1

_FNV_OFFSET_BASIS = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def blake2b64(data: bytes) -> int:
    """BLAKE2b with an 8-byte digest *parameter* (not a truncated digest), big-endian."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def xxh64(data: bytes) -> int:
    """XXH64, seed 0."""
    return xxhash.xxh64_intdigest(data, 0)


def xxh3(data: bytes) -> int:
    """XXH3 64-bit, seed 0, default secret."""
    return xxhash.xxh3_64_intdigest(data, 0)


def murmur3(data: bytes) -> int:
    """MurmurHash3 x64_128, seed 0, first 64-bit half (h1)."""
    return mmh3.hash64(data, 0, signed=False)[0]


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64-bit."""
    h = _FNV_OFFSET_BASIS
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & U64_MASK
    return h


def _crc16_table() -> List[int]:
    table = []
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
        table.append(crc)
    return table


_CRC16_TABLE = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC16-XMODEM (poly 0x1021, init 0, no reflection): the Redis Cluster CRC."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16_TABLE[(crc >> 8) ^ byte]
    return crc


HashFn = Callable[[bytes], int]

#: Hash functions by the name a shard map uses in its ``hash`` field.
HASHES: Dict[str, HashFn] = {
    "blake2b64": blake2b64,
    "xxh64": xxh64,
    "xxh3": xxh3,
    "murmur3": murmur3,
    "fnv1a64": fnv1a64,
    "crc16": crc16,
}
