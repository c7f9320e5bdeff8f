"""shardq: Python clients of the shardq job queue.

* :class:`Client` and :class:`Worker` speak the HTTP API of ``shardq
  serve`` with the standard library only; :class:`AsyncClient` and
  :class:`AsyncWorker` do the same from asyncio code (the ``asyncio`` extra,
  aiohttp).
* :class:`RedisProducer` writes straight into a Redis deployment (no
  server in between), with the backend's own enqueue script (the ``redis``
  extra).
* :mod:`shardq.routing` is the pure-Python reference of the key-to-shard
  routing, which :class:`RedisProducer` routes with (the ``redis`` extra:
  PyYAML, xxhash, mmh3).
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    BadRequest,
    ConfigError,
    FencedTooLong,
    HttpError,
    InvalidJob,
    JobDied,
    JobNotCancelled,
    KeyNotResumed,
    PartialEnqueue,
    PausedTooLong,
    ResultTimeout,
    ServerUnavailable,
    ShardqError,
    StaleReceipt,
    StoreFull,
    StoreLost,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from .http import (
    BackOff,
    BatchCallback,
    BatchCounts,
    BatchInfo,
    ClaimedJob,
    Client,
    DependencyOutcome,
    DependentInfo,
    Enqueued,
    FinishedInfo,
    FlowPolicy,
    FlowSettings,
    GroupInfo,
    JobInfo,
    KeyHold,
    Moved,
    NewJob,
    PolicyInfo,
    Retry,
    Schedule,
    ScheduleBackfilled,
    ScheduleFire,
    ScheduleInfo,
    SchedulesApplied,
    ScheduleState,
    ScheduleTick,
    ScheduleTime,
    ScheduleTriggered,
    Worker,
    WorkerStats,
)

# The asyncio clients need aiohttp, the direct Redis producer redis-py and
# the reference router (two thirds of the import time of this package):
# they load on first use, so an HTTP client or worker does not pay for them
# at start, and they need not be installed.
_LAZY = {
    "AsyncClient": "aio",
    "AsyncWorker": "aio",
    "Job": "redis_producer",
    "Placed": "redis_producer",
    "RedisProducer": "redis_producer",
}

if TYPE_CHECKING:  # for type checkers, which do not run __getattr__
    from .aio import AsyncClient, AsyncWorker
    from .redis_producer import Job, Placed, RedisProducer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(f".{module}", __name__), name)
    raise AttributeError(f"module 'shardq' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AsyncWorker",
    "BackOff",
    "BadRequest",
    "BatchCallback",
    "BatchCounts",
    "BatchInfo",
    "ClaimedJob",
    "Client",
    "ConfigError",
    "DependencyOutcome",
    "DependentInfo",
    "Enqueued",
    "FencedTooLong",
    "HttpError",
    "InvalidJob",
    "Job",
    "FinishedInfo",
    "FlowPolicy",
    "FlowSettings",
    "GroupInfo",
    "JobDied",
    "JobInfo",
    "JobNotCancelled",
    "KeyHold",
    "KeyNotResumed",
    "Moved",
    "NewJob",
    "PartialEnqueue",
    "PausedTooLong",
    "Placed",
    "PolicyInfo",
    "RedisProducer",
    "ResultTimeout",
    "Retry",
    "Schedule",
    "ScheduleBackfilled",
    "SchedulesApplied",
    "ScheduleFire",
    "ScheduleInfo",
    "ScheduleState",
    "ScheduleTick",
    "ScheduleTime",
    "ScheduleTriggered",
    "ServerUnavailable",
    "ShardqError",
    "StaleReceipt",
    "StoreFull",
    "StoreLost",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "Worker",
    "WorkerStats",
]
