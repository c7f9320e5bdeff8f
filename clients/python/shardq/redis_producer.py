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

Delivery is at least once: an enqueue whose reply was lost (a dropped
connection, a timeout) is retried and may store the batch twice, in order.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, TypeVar, Union
from urllib.parse import urlparse

import redis

from .routing import Router

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

#: Key layout version this client writes (``keys::LAYOUT_VERSION``).
LAYOUT_VERSION = 2
#: Default queue (``keys::QUEUE_DEFAULT``).
QUEUE_DEFAULT = "default"
#: The parts of a shard, in the order the scripts take them as KEYS.
SHARD_PARTS = (
    "meta", "jobs", "keys", "next", "ready", "later", "inflight", "dead", "deadn", "delayed",
    "paused", "lease", "reason", "dedup", "dedupx", "sealed", "imported", "moved", "done",
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


def shard_keys(ns: str, queue: str, shard: str) -> List[str]:
    """Every key of one shard, in :data:`SHARD_PARTS` order."""
    return [f"sq:{{{ns}:{queue}:{shard}}}:{part}" for part in SHARD_PARTS]


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
    """Reads ``<data_dir>/remote.json`` (format ``shardq-remote``, version 2)."""
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
    if doc.get("version") != 2:
        raise ConfigError(f"{path}: version {doc.get('version')!r} is not supported (this client reads 2)")
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


class RedisProducer:
    """Routes and enqueues jobs straight into a Redis deployment.

    Give ``map_url`` and ``namespace`` (the deployment id is then read from
    the deployment record), or use :meth:`from_data_dir` to read all of it
    from a data dir's ``remote.json``. Safe to share between threads (calls
    run one at a time); one producer per thread scales better.
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
        if layout is None or int(layout) != LAYOUT_VERSION:
            raise ConfigError(
                f"{key} at {self._store.url}: layout {layout!r} is not supported (this client writes {LAYOUT_VERSION})"
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
        for shard in router.map.shards:
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
        self._router = router
        return True

    def _reload_if_stale(self) -> None:
        if (time.monotonic() - self._loaded_at) * 1000 >= self.refresh_ms:
            self.reload()

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
                    waited = int((time.monotonic() - started) * 1000)
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
        # max_attempts and dedup id ('' = none) per job.
        args: List[Union[str, bytes, int]] = ["", "", self.halt_arg, self.deployment, version, len(jobs), 0]
        for key, payload, delay, attempts in jobs:
            args.extend((key, payload, delay, attempts, ""))

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
