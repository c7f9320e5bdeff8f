"""A producer that writes straight into a Redis deployment, no server between.

It follows ``docs/redis-protocol.md``: reads the published map from
``sq:{=map:<ns>}:current``, routes each key with :class:`shardq.routing.Router`,
and appends the jobs of each shard with the backend's own enqueue script
(:mod:`shardq._lua`), stamped with the map version it routed with. A shard
that no longer trusts that version answers ``FENCED``: the producer reloads
the map, routes again and retries, waiting (bounded by ``fence_wait_ms``)
for a newer map. A key whose backlog a rebalance has moved answers
``MOVED`` with the shard that holds it now: its jobs go there at once,
with the same map version, until the map changes. A key paused for a
move answers ``PAUSED``: its jobs are held back and retried (bounded by
``pause_wait_ms``) while the other keys' go ahead. Jobs of one key keep
their order.

A rebalance fences every shard at the next map version before it publishes
that version; one killed between the two would leave every producer refused
until it is run again. Like the Rust producer, this one lifts such an
orphaned fence: fenced for :data:`ORPHAN_FENCE_AFTER_MS` with no newer map
(and again at most once per that interval), it takes the rebalance lock
(doing nothing while a rebalance holds it), and when a shard's fence asks
for a version above the published map's, publishes the same map (the same
routing, only the version changed) at the highest such version, with the
backend's compare-and-set publish script. The producers then go in.

Delivery is at least once: an enqueue whose reply was lost (a dropped
connection, a timeout) is retried and may store the batch twice, in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import socket
import threading
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, TypeVar, Union
from urllib.parse import urlparse

import redis

from .routing import MapError, Router, Shard, parse_map

from . import _lua
from .errors import (
    ConfigError,
    FencedTooLong,
    InvalidJob,
    PartialEnqueue,
    PausedTooLong,
    ShardqError,
    StoreFull,
    StoreLost,
    Unavailable,
)

_T = TypeVar("_T")

#: The key layout version this client reads and writes (``keys::LAYOUT_VERSION``).
LAYOUT_VERSION = 7
#: The ``remote.json`` format version this client reads (``remote::REMOTE_VERSION``).
REMOTE_VERSION = 1
#: Default queue (``keys::QUEUE_DEFAULT``).
QUEUE_DEFAULT = "default"
#: The parts of a shard, in the order the scripts take them as KEYS.
SHARD_PARTS = (
    "meta", "jobs", "keys", "next", "ready", "later", "inflight", "dead", "deadn", "delayed",
    "paused", "lease", "reason", "dedup", "dedupm", "sealed", "imported", "moved", "finished",
    "limits", "deadk", "keyed", "movedin",
)
#: Most jobs per enqueue script call (``ENQUEUE_BATCH_MAX``).
ENQUEUE_BATCH_MAX = 1024
#: Longest routing key, in bytes.
KEY_BYTES_MAX = 1024
#: Default largest payload (1 MiB).
PAYLOAD_BYTES_MAX_DEFAULT = 1 << 20
#: Default and largest ``max_attempts``.
MAX_ATTEMPTS_DEFAULT = 5
MAX_ATTEMPTS_LIMIT = 1000
#: Longest delay (one year), in ms.
DELAY_MS_MAX = 365 * 24 * 3600 * 1000
#: Default waits (the Rust producer's defaults).
PAUSE_WAIT_MS_DEFAULT = 30_000
FENCE_WAIT_MS_DEFAULT = 30_000
REFRESH_MS_DEFAULT = 100
#: Bounds of one Redis call: connect and reply timeouts, then retries of
#: transient errors within a time budget, waits growing 5 -> 200 ms.
CONNECT_TIMEOUT_S = 2.0
RESPONSE_TIMEOUT_S = 2.0
RETRY_BUDGET_MS_DEFAULT = 5_000
#: Sleep between retries of a refused (fenced or paused) enqueue, in ms.
REFUSED_RETRY_SLEEP_MS = 2
#: Most ``MOVED`` answers followed for one key in one call (a key moved
#: twice while this producer held one map); past it, it waits as if paused.
MOVED_HOPS_MAX = 4
#: How long a call waits for a newer map after its first fence before it
#: checks for an orphaned fence (a rebalance that died between fencing and
#: publishing), and then between checks, in ms (the Rust producer's
#: ``ORPHAN_FENCE_AFTER_MS``).
ORPHAN_FENCE_AFTER_MS = 2_000
#: Lifetime of the rebalance lock without renewal, in ms, and renewals per
#: lifetime (``REBALANCE_LOCK_MS`` and ``REBALANCE_LOCK_RENEWALS`` of the
#: Rust map store).
REBALANCE_LOCK_MS = 10_000
REBALANCE_LOCK_RENEWALS = 3

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _check_name(what: str, name: str) -> None:
    if not name or len(name.encode()) > 64 or not set(name) <= _NAME_CHARS:
        raise ConfigError(
            f"invalid {what} {name!r}: 1 to 64 ASCII letters, digits, '-', '_' or '.'"
        )


def deployment_key(ns: str) -> str:
    """``sq:{=dep:<ns>}:info``: the deployment record (hash ``id``, ``layout``, ``created_ms``)."""
    return f"sq:{{=dep:{ns}}}:info"


def map_key(ns: str) -> str:
    """``sq:{=map:<ns>}:current``: the published map (hash ``version``, ``yaml``)."""
    return f"sq:{{=map:{ns}}}:current"


def rebalance_lock_key(ns: str) -> str:
    """``sq:{=map:<ns>}:rebalance``: the rebalance lock (string: the holder's token, with a TTL)."""
    return f"sq:{{=map:{ns}}}:rebalance"


def shard_keys(ns: str, queue: str, shard: str) -> List[str]:
    """Every key of one shard, in :data:`SHARD_PARTS` order."""
    return [f"sq:{{{ns}:{queue}:{shard}}}:{part}" for part in SHARD_PARTS]


def shard_key(ns: str, queue: str, shard: str, part: str) -> str:
    """The key of one part of a shard, named (``"meta"``, ``"sealed"``...),
    never numbered; a part :data:`SHARD_PARTS` does not list raises
    ``ValueError``."""
    if part not in SHARD_PARTS:
        raise ValueError(f"no shard part {part!r}; the parts are {', '.join(SHARD_PARTS)}")
    return f"sq:{{{ns}:{queue}:{shard}}}:{part}"


@dataclass(frozen=True)
class Job:
    """A job to enqueue. ``payload`` is bytes (``str`` is sent as UTF-8)."""

    key: str
    payload: Union[bytes, str] = b""
    delay_ms: int = 0
    max_attempts: int = MAX_ATTEMPTS_DEFAULT


@dataclass(frozen=True)
class Placed:
    """Where a job landed: its index in the call, key, shard, the shard's job
    id and the map version it was routed with."""

    index: int
    key: str
    shard: str
    id: int
    map_version: int


JobLike = Union[Job, Tuple[str, Union[bytes, str]]]


# Characters no key holds (as ``shardq_core::job::is_unshowable``): control
# characters (Cc), line and paragraph separators (Zl, Zp), format
# characters (Cf), and the characters that show as nothing (``BLANKS``).
_UNSHOWABLE_CATEGORIES = frozenset(["Cc", "Cf", "Zl", "Zp"])
_BLANKS = frozenset([0x115F, 0x1160, 0x180E, 0x2800, 0x3164, 0xFFA0])


def _unshowable(key: str) -> Optional[Tuple[int, str]]:
    """The byte offset and character of the first character no key may
    hold, if any; a key may not start with a combining mark either."""
    if key.isascii():
        for i, c in enumerate(key):
            if ord(c) < 0x20 or ord(c) == 0x7F:
                return i, c
        return None
    if unicodedata.category(key[0]).startswith("M"):
        return 0, key[0]
    for i, c in enumerate(key):
        if unicodedata.category(c) in _UNSHOWABLE_CATEGORIES or ord(c) in _BLANKS:
            return len(key[:i].encode("utf-8")), c
    return None


def _as_job(j: JobLike, payload_bytes_max: int) -> Tuple[str, bytes, int, int]:
    if isinstance(j, Job):
        key, payload, delay, attempts = j.key, j.payload, j.delay_ms, j.max_attempts
    else:
        key, payload = j
        delay, attempts = 0, MAX_ATTEMPTS_DEFAULT
    if not isinstance(key, str):
        raise InvalidJob(f"a key must be a str, got {type(key).__name__}")
    if isinstance(payload, str):
        payload = payload.encode("utf-8")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidJob(f"payload of key {key!r} must be bytes or str, got {type(payload).__name__}")
    payload = bytes(payload)
    kb = len(key.encode("utf-8"))
    if kb == 0:
        raise InvalidJob("a key must not be empty")
    if kb > KEY_BYTES_MAX:
        raise InvalidJob(f"key {key[:32]!r}... has {kb} bytes; a key is at most {KEY_BYTES_MAX}")
    bad = _unshowable(key)
    if bad is not None:
        at, c = bad
        raise InvalidJob(
            f"key {key[:64]!r}: a key holds no control character, line separator, invisible "
            f"formatting or blank character, nor starts with a combining mark; this one has "
            f"{c!r} (U+{ord(c):04X}) at byte {at}"
        )
    if len(payload) > payload_bytes_max:
        raise InvalidJob(
            f"payload of key {key!r} has {len(payload)} bytes; the limit is {payload_bytes_max}"
        )
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= MAX_ATTEMPTS_LIMIT:
        raise InvalidJob(f"max_attempts {attempts!r} of key {key!r} must be 1..={MAX_ATTEMPTS_LIMIT}")
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= DELAY_MS_MAX:
        raise InvalidJob(f"delay_ms {delay!r} of key {key!r} must be 0..={DELAY_MS_MAX}")
    return key, payload, delay, attempts


def read_remote(data_dir: str) -> Dict[str, str]:
    """Reads ``<data_dir>/remote.json`` (format ``shardq-remote``, version
    ``REMOTE_VERSION``, as ``shardq_deploy::remote::REMOTE_VERSION``)."""
    path = os.path.join(data_dir, "remote.json")
    try:
        with open(path, "r", encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: {data_dir} is not a Redis data dir") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "shardq-remote":
        raise ConfigError(f"{path}: not a 'shardq-remote' file")
    if doc.get("version") != REMOTE_VERSION:
        raise ConfigError(
            f"{path}: version {doc.get('version')!r} is not supported (this client reads {REMOTE_VERSION})"
        )
    for field in ("map_url", "namespace", "deployment", "queue"):
        if not isinstance(doc.get(field), str):
            raise ConfigError(f"{path}: field {field!r} is missing or not a string")
    return doc


class _Transient(Exception):
    pass


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)):
        return True
    if isinstance(e, redis.ResponseError):
        msg = str(e)
        return msg.startswith(("TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN"))
    return False


class _Node:
    """One Redis server: a connection pool, bounded retries, the eviction check."""

    def __init__(self, what: str, url: str, retry_budget_ms: int):
        if url.startswith("redis+cluster://"):
            raise ConfigError(
                f"{what}: {url} is a redis+cluster:// URL; this producer supports standalone "
                f"redis:// servers only"
            )
        if urlparse(url).scheme != "redis":
            raise ConfigError(f"{what}: {url!r} is not a redis:// URL")
        self.what = what
        self.url = url
        self.retry_budget_ms = retry_budget_ms
        self.client = redis.Redis.from_url(
            url,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=RESPONSE_TIMEOUT_S,
            decode_responses=False,
        )
        self.checked = False

    def run(self, fn: "Callable[[redis.Redis], _T]") -> _T:
        """Runs ``fn(client)``, retrying transient errors within the budget."""
        start = time.monotonic()
        wait_ms = 5
        while True:
            try:
                if not self.checked:
                    self._check_policy()
                return fn(self.client)
            except redis.RedisError as e:
                if not _is_transient(e):
                    raise
                elapsed = (time.monotonic() - start) * 1000
                if elapsed + wait_ms > self.retry_budget_ms:
                    raise Unavailable(
                        f"{self.what} at {self.url}: unreachable for {int(elapsed)} ms: {e}"
                    ) from e
                time.sleep(wait_ms / 1000)
                wait_ms = min(wait_ms * 2, 200)

    def _check_policy(self) -> None:
        # A server that may evict keys could drop a job or a fence silently.
        try:
            got = self.client.config_get("maxmemory-policy")
        except redis.ResponseError as e:
            raise ConfigError(
                f"{self.what} at {self.url}: CONFIG GET maxmemory-policy failed ({e}); shardq "
                f"needs to check that the server never evicts keys"
            ) from None
        reply: Dict[Any, Any] = dict(got)
        policy = reply.get(b"maxmemory-policy", reply.get("maxmemory-policy", b""))
        if isinstance(policy, bytes):
            policy = policy.decode()
        if policy != "noeviction":
            raise ConfigError(
                f"{self.what} at {self.url}: maxmemory-policy is {policy!r}; shardq needs "
                f"'noeviction' (CONFIG SET maxmemory-policy noeviction)"
            )
        self.checked = True

    def close(self) -> None:
        self.client.close()


def _eval(c: "redis.Redis", script: str, sha1: str, keys: Sequence[str], args: Sequence[Union[str, bytes, int]]) -> Any:
    """Runs a script by its SHA1, sending its text once when the server does
    not have it cached (as ``Lua::call`` does)."""
    try:
        return c.evalsha(sha1, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return c.eval(script, len(keys), *keys, *args)


_LOCK_NONCE = itertools.count()


def _host_name() -> str:
    """This host's name as lock tokens carry it (the Rust side reads
    ``/proc/sys/kernel/hostname`` first)."""
    try:
        with open("/proc/sys/kernel/hostname", encoding="utf-8") as f:
            name = f.read().strip()
        if name:
            return name
    except OSError:
        pass
    return socket.gethostname() or "localhost"


def _lock_owner() -> str:
    """``host@pid``, the holder the Rust side names in its lock tokens."""
    return f"{_host_name()}@{os.getpid()}"


def _holder_dead_here(token: str) -> bool:
    """Whether lock token ``host@pid#nonce`` names a process of this host
    that is gone (no ``/proc/<pid>``, or a zombie): the Rust map store's
    ``holder_dead_here``. Another host's token, this process's, or one
    that does not parse is never dead: its lock lapses by its lease."""
    host, sep, rest = token.partition("@")
    pid_text = rest.split("#", 1)[0]
    if not sep or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if host != _host_name() or pid in (0, os.getpid()) or not os.path.exists("/proc/self/stat"):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    at = stat.rfind(")")
    return at >= 0 and stat[at + 1:].lstrip()[:1] in ("Z", "X")


class _RebalanceLock:
    """The rebalance lock, taken as the Rust map store takes it: a token
    ``host@pid#nonce`` set with ``SET NX PX`` (:data:`REBALANCE_LOCK_MS`),
    renewed by a thread while held, and released only while the token is
    still ours (a compare-and-delete script, never a successor's lock)."""

    def __init__(self, store: _Node, key: str, token: str) -> None:
        self._store = store
        self._key = key
        self._token = token
        #: Set when a renewal found another token: the lock lapsed and
        #: someone else may hold it.
        self.lost = False
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="shardq-rebalance-lock", daemon=True)
        self._renewer.start()

    @classmethod
    def try_take(cls, store: _Node, key: str) -> "Optional[_RebalanceLock]":
        """The lock, or None when another holder has it."""
        token = f"{_lock_owner()}#{next(_LOCK_NONCE)}"
        # A retried SET after a lost reply finds our own token: that is ours.
        got = store.run(lambda c: c.set(key, token, nx=True, px=REBALANCE_LOCK_MS, get=True))
        if got is not None and _s(got) != token and _holder_dead_here(_s(got)):
            # A holder of this host that is gone frees its lock now, not
            # when its lease lapses: released only while it still holds
            # that dead token, then taken once more.
            dead = _s(got)
            store.run(lambda c: _eval(c, _lua.LOCK_RELEASE_SCRIPT, _lua.LOCK_RELEASE_SHA1, [key], [dead]))
            got = store.run(lambda c: c.set(key, token, nx=True, px=REBALANCE_LOCK_MS, get=True))
        if got is not None and _s(got) != token:
            return None
        return cls(store, key, token)

    def _renew(self) -> None:
        every_s = REBALANCE_LOCK_MS / REBALANCE_LOCK_RENEWALS / 1000
        while not self._stop.wait(every_s):
            try:
                held = self._store.run(
                    lambda c: _eval(c, _lua.LOCK_RENEW_SCRIPT, _lua.LOCK_RENEW_SHA1, [self._key],
                                    [self._token, REBALANCE_LOCK_MS])
                )
            except (ShardqError, redis.RedisError):
                # Retried next period; the lock lapses only after two more misses.
                continue
            if not held:
                self.lost = True

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        try:
            self._store.run(
                lambda c: _eval(c, _lua.LOCK_RELEASE_SCRIPT, _lua.LOCK_RELEASE_SHA1, [self._key], [self._token])
            )
        except (ShardqError, redis.RedisError):
            # Best effort: a lock we fail to release lapses on its own.
            pass


# The top-level `version:` line of a map's YAML (as `ShardMap::to_yaml`
# writes it first).
_VERSION_LINE = re.compile(r"^version:[ \t]*([0-9]+)[ \t]*(?:#[^\n]*)?\r?$", re.M)


def _map_yaml_at_version(text: str, version: int) -> str:
    """``text``, a published map's YAML, with its ``version`` set to
    ``version`` and not a byte else changed: the map a lift republishes.
    Checked before it is used: it must parse, with the new version, to the
    very map ``text`` holds otherwise (so routing is unchanged). Raises
    :class:`ConfigError` when the version line cannot be found or the result
    does not check out."""
    found = list(_VERSION_LINE.finditer(text))
    if len(found) != 1:
        raise ConfigError(
            f"the map's YAML has {len(found)} top-level `version:` lines; expected exactly one"
        )
    at = found[0]
    out = text[: at.start(1)] + str(version) + text[at.end(1):]
    try:
        before, after = parse_map(text), parse_map(out)
    except MapError as e:
        raise ConfigError(f"the map at version {version} does not validate: {e}") from None
    if after.version != version or dataclasses.replace(before, version=version) != after:
        raise ConfigError(f"the map at version {version} is not the published map with a new version")
    return out


class RedisProducer:
    """Routes and enqueues jobs straight into a Redis deployment.

    Give ``map_url`` and ``namespace`` (the deployment id is then read from
    the deployment record), or use :meth:`from_data_dir` to read all of it
    from a data dir's ``remote.json``. Safe to share between threads (calls
    run one at a time); one producer per thread scales better.

    Fenced with no newer map published, it waits up to ``fence_wait_ms``
    and then raises :class:`FencedTooLong`. Within that wait it lifts an
    orphaned fence as the Rust producer does: after
    :data:`ORPHAN_FENCE_AFTER_MS` (and at most once per that interval), if
    no rebalance holds the rebalance lock and some shard's fence is ahead of
    the published map, it publishes the same map again at the highest fenced
    version (compare-and-set, routing unchanged), then reloads and goes in.
    While a rebalance holds the lock it publishes nothing and keeps waiting.
    """

    def __init__(
        self,
        map_url: str,
        namespace: str,
        *,
        deployment: Optional[str] = None,
        queue: str = QUEUE_DEFAULT,
        pause_wait_ms: int = PAUSE_WAIT_MS_DEFAULT,
        fence_wait_ms: int = FENCE_WAIT_MS_DEFAULT,
        refresh_ms: int = REFRESH_MS_DEFAULT,
        halt_on_dead: bool = False,
        payload_bytes_max: int = PAYLOAD_BYTES_MAX_DEFAULT,
        retry_budget_ms: int = RETRY_BUDGET_MS_DEFAULT,
    ) -> None:
        _check_name("namespace", namespace)
        _check_name("queue", queue)
        self.namespace = namespace
        self.queue = queue
        self.pause_wait_ms = pause_wait_ms
        self.fence_wait_ms = fence_wait_ms
        self.refresh_ms = refresh_ms
        self.halt_arg = "1" if halt_on_dead else "0"
        self.payload_bytes_max = payload_bytes_max
        self.retry_budget_ms = retry_budget_ms
        self._lock = threading.RLock()
        self._store = _Node("map store", map_url, retry_budget_ms)
        self._nodes: Dict[str, _Node] = {}
        self._keys: Dict[str, List[str]] = {}
        self.deployment = deployment if deployment is not None else self._read_deployment()
        self._router: Optional[Router] = None
        self._loaded_at = 0.0
        # Keys a shard answered MOVED for, with the shard that holds them
        # now: valid for the map version they were learnt with.
        self._moved: Dict[str, str] = {}
        self._moved_version = -1
        self.reload()

    @classmethod
    def from_data_dir(cls, data_dir: str, **options: Any) -> "RedisProducer":
        """A producer for the deployment a data dir's ``remote.json`` names."""
        r = read_remote(data_dir)
        return cls(r["map_url"], r["namespace"], deployment=r["deployment"], queue=r["queue"], **options)

    # --- map ---------------------------------------------------------------

    def _read_deployment(self) -> str:
        key = deployment_key(self.namespace)
        dep, layout = self._store.run(lambda c: c.hmget(key, "id", "layout"))
        if dep is None:
            raise StoreLost(
                f"map store at {self._store.url}: no deployment record {key}: namespace "
                f"{self.namespace!r} was never initialised there, or the server lost its state"
            )
        if layout is None or _s(layout) != str(LAYOUT_VERSION):
            raise ConfigError(
                f"{key} at {self._store.url}: key layout {layout!r} is not supported: this client "
                f"reads layout {LAYOUT_VERSION} only; use a client of the deployment's release"
            )
        return _s(dep)

    @property
    def map_version(self) -> int:
        """Version of the map the producer routes with."""
        assert self._router is not None
        return self._router.map.version

    @property
    def router(self) -> Router:
        assert self._router is not None
        return self._router

    def reload(self) -> bool:
        """Reads the published map; True when it is newer than the one held."""
        key = map_key(self.namespace)
        got_version, text = self._store.run(lambda c: c.hmget(key, "version", "yaml"))
        self._loaded_at = time.monotonic()
        if got_version is None or text is None:
            raise ConfigError(f"map store at {self._store.url}: no map published at {key}")
        version = int(got_version)
        if self._router is not None and version <= self._router.map.version:
            return False
        router = Router.from_yaml(_s(text))
        if router.map.version != version:
            raise ConfigError(
                f"{key} at {self._store.url}: field version {version} but the YAML says "
                f"{router.map.version}"
            )
        self._add_nodes(router.map.shards)
        self._router = router
        return True

    def _add_nodes(self, shards: Iterable[Shard]) -> None:
        for shard in shards:
            if shard.name in self._nodes:
                continue
            if shard.url is None:
                # Shards without a URL (or of another backend) are another
                # producer's business; routing to one is an error below.
                continue
            if not shard.url.startswith(("redis://", "redis+cluster://")):
                continue
            self._nodes[shard.name] = _Node(f"shard {shard.name!r}", shard.url, self.retry_budget_ms)
            self._keys[shard.name] = shard_keys(self.namespace, self.queue, shard.name)

    def _reload_if_stale(self) -> None:
        if (time.monotonic() - self._loaded_at) * 1000 >= self.refresh_ms:
            self.reload()

    # --- orphaned fences -------------------------------------------------------

    def _lift_orphaned_fence(self) -> bool:
        """Ends the fence of a rebalance that died between fencing every
        shard at the next map version and publishing that version, as
        ``reshard::lift_orphaned_fence`` does: under the rebalance lock, when
        a readable shard's fence (``map_version_min``) is above the published
        map's version, publishes the same map at the highest such version
        (compare-and-set on the version it loaded). A shard that cannot be
        read is passed by: the routing does not change, so the version the
        readable fences ask for is safe to publish. True when it published;
        False when a rebalance holds the lock (it will publish), no fence is
        ahead, or the publish lost a race. A rebalance that only stalled
        (its lock lapsed) then fails its own publish, since the version
        moved on."""
        lock = _RebalanceLock.try_take(self._store, rebalance_lock_key(self.namespace))
        if lock is None:
            return False
        try:
            key = map_key(self.namespace)
            got_version, text = self._store.run(lambda c: c.hmget(key, "version", "yaml"))
            if got_version is None or text is None:
                return False
            published = int(got_version)
            yaml_text = _s(text)
            try:
                current = parse_map(yaml_text)
            except MapError:
                return False
            if current.version != published:
                return False
            self._add_nodes(current.shards)
            ahead = published
            for shard in current.shards:
                fence = self._fence_of(shard.name)
                if fence is not None:
                    ahead = max(ahead, fence)
            if ahead <= published:
                return False
            # Never publish a map that does not validate: this raises
            # instead, and the wait goes on.
            republished = _map_yaml_at_version(yaml_text, ahead)
            if lock.lost:
                return False
            reply = self._store.run(
                lambda c: _eval(c, _lua.MAP_PUBLISH_SCRIPT, _lua.MAP_PUBLISH_SHA1, [key],
                                [published, ahead, republished])
            )
            return bool(reply) and _s(reply[0]) == "OK"
        finally:
            lock.release()

    def _fence_of(self, shard: str) -> Optional[int]:
        """The shard's fence, the oldest map version it accepts (the
        backend's ``FENCE_GET`` script); None when it cannot be read (no
        ``redis://`` server in the map, unreachable, or its deployment record
        lost)."""
        node = self._nodes.get(shard)
        if node is None:
            return None
        keys = self._keys[shard]
        # ARGV as every shard script takes them: time, lease token, halt
        # flag, deployment id.
        args: List[Union[str, bytes, int]] = ["", "", self.halt_arg, self.deployment]
        try:
            reply = node.run(lambda c: _eval(c, _lua.FENCE_GET_SCRIPT, _lua.FENCE_GET_SHA1, keys, args))
        except (ShardqError, redis.RedisError):
            return None
        if not reply or _s(reply[0]) == "LOST":
            return None
        try:
            return int(_s(reply[0]))
        except ValueError:
            return None

    # --- enqueue -------------------------------------------------------------

    def enqueue(
        self,
        key: str,
        payload: Union[bytes, str] = b"",
        delay_ms: int = 0,
        max_attempts: int = MAX_ATTEMPTS_DEFAULT,
    ) -> Placed:
        """Routes and enqueues one job."""
        return self.enqueue_many([Job(key, payload, delay_ms, max_attempts)])[0]

    def enqueue_many(self, jobs: Iterable[JobLike]) -> List[Placed]:
        """Routes and enqueues ``jobs`` (``Job`` values or ``(key, payload)``
        pairs): one script call per shard (per 1024 jobs). Jobs of one key
        keep their order. Returns placements in the jobs' order.

        Raises :class:`PausedTooLong` (with the placements of every other
        key), :class:`PartialEnqueue` after an error once some jobs were
        stored, or the error itself when none were."""
        checked = [_as_job(j, self.payload_bytes_max) for j in jobs]
        with self._lock:
            placed: List[Optional[Placed]] = [None] * len(checked)
            try:
                gave_up = self._place(checked, placed)
            except ShardqError as e:
                done = [p for p in placed if p is not None]
                if done:
                    raise PartialEnqueue(done, e) from e
                raise
            done = [p for p in placed if p is not None]
            if gave_up:
                raise PausedTooLong([k for k, _ in gave_up], gave_up[0][1], self.pause_wait_ms, done)
            return done

    def _place(
        self, jobs: Sequence[Tuple[str, bytes, int, int]], placed: List[Optional[Placed]]
    ) -> List[Tuple[str, str]]:
        self._reload_if_stale()
        started = time.monotonic()
        pending = list(range(len(jobs)))
        paused: Set[str] = set()
        paused_since: Dict[str, float] = {}
        hops: Dict[str, int] = {}
        gave_up: List[Tuple[str, str]] = []
        # When this call first met a fence no newer map followed, and the
        # time into that wait of the last lift attempt (ms).
        fenced_since: Optional[float] = None
        last_lift_ms = 0
        while pending:
            router = self.router
            version = router.map.version
            if self._moved_version != version:
                self._moved = {}
                self._moved_version = version
            # One group per shard; a paused key gets a group of its own so
            # that its refusal does not hold back the others.
            groups: Dict[Tuple[str, Optional[str]], List[int]] = {}
            for i in pending:
                key = jobs[i][0]
                shard = self._moved.get(key) or router.route(key)
                groups.setdefault((shard, key if key in paused else None), []).append(i)
            retry: List[int] = []
            fenced: Optional[str] = None
            for (shard, own), idxs in groups.items():
                # Chunks of one group go in order; after a refusal the rest
                # of the group waits too, so no later job of a key overtakes
                # a refused earlier one.
                for start in range(0, len(idxs), ENQUEUE_BATCH_MAX):
                    chunk = idxs[start:start + ENQUEUE_BATCH_MAX]
                    status, detail = self._enqueue_script(shard, version, [jobs[i] for i in chunk])
                    if status == "OK":
                        for n, i in enumerate(chunk):
                            placed[i] = Placed(i, jobs[i][0], shard, detail[n], version)
                            paused.discard(jobs[i][0])
                        continue
                    rest = idxs[start:]
                    if status == "FENCED":
                        fenced = shard
                        retry.extend(rest)
                    elif status == "MOVED":
                        # The key's backlog is on `to` now: send its jobs
                        # there at once (the others of the chunk go again
                        # to where they route).
                        key, to = detail
                        hops[key] = hops.get(key, 0) + 1
                        if to not in self._nodes:
                            self.reload()
                        if to in self._nodes and hops[key] <= MOVED_HOPS_MAX:
                            self._moved[key] = to
                            paused.discard(key)
                        else:
                            paused.add(key)
                        retry.extend(rest)
                    else:  # PAUSED
                        key = detail
                        since = paused_since.setdefault(key, time.monotonic())
                        if own == key and (time.monotonic() - since) * 1000 >= self.pause_wait_ms:
                            gave_up.append((key, shard))
                        else:
                            paused.add(key)
                            retry.extend(rest)
                    break
            pending = sorted(retry)
            if not pending:
                break
            if fenced is not None:
                if not self.reload():
                    now = time.monotonic()
                    waited = int((now - started) * 1000)
                    # A fence no map follows for a while: its rebalance may
                    # have died between the two; lifted when no rebalance
                    # runs (at most one try per interval, counted from the
                    # first fence this call met).
                    if fenced_since is None:
                        fenced_since = now
                    fenced_ms = int((now - fenced_since) * 1000)
                    if fenced_ms >= ORPHAN_FENCE_AFTER_MS and fenced_ms >= last_lift_ms + ORPHAN_FENCE_AFTER_MS:
                        last_lift_ms = fenced_ms
                        try:
                            lifted = self._lift_orphaned_fence()
                        except (ShardqError, redis.RedisError):
                            # A store not answering, a map that does not
                            # check out: nothing was published; the wait
                            # goes on.
                            lifted = False
                        if lifted:
                            self.reload()
                            continue
                    if waited >= self.fence_wait_ms:
                        raise FencedTooLong(fenced, version, waited)
                    time.sleep(REFUSED_RETRY_SLEEP_MS / 1000)
            elif all(jobs[i][0] in paused for i in pending):
                # A pause ends with the old shard's fence raised (the retry
                # is then FENCED and reloads) or with the key still pinned
                # there; a reload per retry is not needed.
                time.sleep(REFUSED_RETRY_SLEEP_MS / 1000)
                self._reload_if_stale()
        return gave_up

    def _enqueue_script(self, shard: str, version: int, jobs: Sequence[Tuple[str, bytes, int, int]]) -> Any:
        """Runs the enqueue script on ``shard``: ("OK", ids in job order),
        ("FENCED", key), ("MOVED", (key, shard)) or ("PAUSED", key)."""
        node = self._nodes.get(shard)
        if node is None:
            raise ConfigError(
                f"map version {version} routes to shard {shard!r}, which has no redis:// url in the map"
            )
        keys = self._keys[shard]
        # ARGV: time ('' = the server's TIME), lease token ('' = none: a
        # producer), halt flag, deployment id, map version, job count, then
        # the dedup window (0: no dedup ids), then key, payload, delay_ms,
        # max_attempts, dedup id ('' = none) and keyed mode ('' = none) per
        # job.
        args: List[Union[str, bytes, int]] = ["", "", self.halt_arg, self.deployment, version, len(jobs), 0]
        for key, payload, delay, attempts in jobs:
            args.extend((key, payload, delay, attempts, "", ""))

        def call(c: "redis.Redis") -> Any:
            try:
                return c.evalsha(_lua.ENQUEUE_SHA1, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return c.eval(_lua.ENQUEUE_SCRIPT, len(keys), *keys, *args)

        try:
            reply = node.run(call)
        except redis.ResponseError as e:
            if isinstance(e, redis.exceptions.OutOfMemoryError) or str(e).startswith("OOM"):
                raise StoreFull(
                    f"shard {shard!r} at {node.url}: the server is at maxmemory and refused the "
                    f"enqueue (OOM): {e}"
                ) from None
            raise ShardqError(f"shard {shard!r} at {node.url}: enqueue failed: {e}") from None
        status = _s(reply[0]) if reply else ""
        if status == "OK":
            # One id per job, in order (no dedup ids: none is a duplicate).
            return "OK", [int(_s(x)) for x in reply[1:]]
        if status == "FENCED":
            return "FENCED", _s(reply[1])
        if status == "PAUSED":
            return "PAUSED", _s(reply[1])
        if status == "MOVED":
            return "MOVED", (_s(reply[1]), _s(reply[2]))
        if status == "LOST":
            found = _s(reply[1]) if len(reply) > 1 else ""
            what = (
                f"its deployment record ({keys[0]} field dep) is missing: the server lost its state"
                if not found
                else f"it now belongs to deployment {found!r}"
            )
            raise StoreLost(
                f"shard {shard!r} at {node.url}: the store no longer holds deployment "
                f"{self.deployment!r}: {what}"
            )
        raise ShardqError(f"shard {shard!r} at {node.url}: enqueue answered {reply!r}")

    def close(self) -> None:
        """Closes every connection."""
        self._store.close()
        for n in self._nodes.values():
            n.close()

    def __enter__(self) -> "RedisProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _s(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
