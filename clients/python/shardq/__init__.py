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
from .http import ClaimedJob, Client, Enqueued, NewJob, Retry, Worker, WorkerStats
from .redis_producer import Job, Placed, RedisProducer

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
