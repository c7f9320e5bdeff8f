"""shardq: Python clients of the shardq job queue.

* :class:`RedisProducer` writes straight into a Redis deployment (no
  server in between), with the backend's own enqueue script.
* :class:`Client` and :class:`Worker` speak the HTTP API of ``shardq serve``.

Routing comes from :mod:`shardq_ref`, the reference router.
"""

from .errors import (
    BadRequest,
    ConfigError,
    FencedTooLong,
    HttpError,
    InvalidJob,
    PartialEnqueue,
    PausedTooLong,
    ServerUnavailable,
    ShardqError,
    StaleReceipt,
    StoreFull,
    StoreLost,
    Unauthorized,
    Unavailable,
)
from typing import TYPE_CHECKING

from .http import ClaimedJob, Client, Enqueued, NewJob, Retry, Worker, WorkerStats

# The direct Redis producer needs the redis package and the reference router
# (two thirds of the import time of this package): they load on first use,
# so an HTTP client or worker does not pay for them at start.
_LAZY = {"Job", "Placed", "RedisProducer"}

if TYPE_CHECKING:  # for type checkers, which do not run __getattr__
    from .redis_producer import Job, Placed, RedisProducer


def __getattr__(name: str):
    if name in _LAZY:
        from . import redis_producer

        return getattr(redis_producer, name)
    raise AttributeError(f"module 'shardq' has no attribute {name!r}")

__all__ = [
    "BadRequest",
    "ClaimedJob",
    "Client",
    "Enqueued",
    "NewJob",
    "Retry",
    "Worker",
    "WorkerStats",
    "ConfigError",
    "FencedTooLong",
    "HttpError",
    "InvalidJob",
    "Job",
    "PartialEnqueue",
    "PausedTooLong",
    "Placed",
    "RedisProducer",
    "ServerUnavailable",
    "ShardqError",
    "StaleReceipt",
    "StoreFull",
    "StoreLost",
    "Unauthorized",
    "Unavailable",
]
