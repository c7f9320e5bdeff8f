"""Errors of the ``shardq`` client. Every message names the thing and the
value that caused it."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence


class ShardqError(Exception):
    """Base class of every error this package raises."""


class InvalidJob(ShardqError, ValueError):
    """A job outside the queue's limits (empty or long key, large payload,
    ``max_attempts`` or ``delay_ms`` out of range)."""


class ConfigError(ShardqError, ValueError):
    """A data dir, URL, namespace or map that cannot be used."""


# --- Redis producer -------------------------------------------------------


class StoreLost(ShardqError):
    """A shard's deployment record is missing or names another deployment:
    the server lost its state (flushed, restarted without its data) or was
    re-initialised. Never retried: nothing is written to such a store."""


class StoreFull(ShardqError):
    """A shard's server is at ``maxmemory`` and refused the enqueue (``OOM``)."""


class Unavailable(ShardqError):
    """A shard's server could not be reached within the retry budget."""


class FencedTooLong(ShardqError):
    """A shard kept refusing the producer's map version and no newer map was
    published within ``fence_wait_ms``."""

    def __init__(self, shard: str, map_version: int, waited_ms: int):
        super().__init__(
            f"shard {shard!r} refuses map version {map_version} and no newer map was "
            f"published within {waited_ms} ms"
        )
        self.shard = shard
        self.map_version = map_version
        self.waited_ms = waited_ms


class PausedTooLong(ShardqError):
    """Keys stayed paused (mid-migration) past ``pause_wait_ms``. Every job of
    the other keys was enqueued (``placed``); none of ``keys``'s."""

    def __init__(self, keys: Sequence[str], shard: str, limit_ms: int, placed: List[Any]):
        super().__init__(
            f"key(s) {list(keys)!r} stayed paused on shard {shard!r} for more than {limit_ms} ms; "
            f"{len(placed)} job(s) of other keys were enqueued, none of these keys'"
        )
        self.keys = list(keys)
        self.shard = shard
        self.limit_ms = limit_ms
        self.placed = placed


class PartialEnqueue(ShardqError):
    """An error after some jobs of a batch were stored: ``placed`` lists
    those (resend only the others), ``cause`` is the error."""

    def __init__(self, placed: List[Any], cause: BaseException):
        super().__init__(f"{len(placed)} job(s) were enqueued before this error: {cause}")
        self.placed = placed
        self.cause = cause


# --- HTTP client ----------------------------------------------------------


class HttpError(ShardqError):
    """The server answered with an error status; ``status`` and ``error``
    (the body's ``error`` field, or the body) say which."""

    def __init__(self, url: str, status: int, error: str):
        super().__init__(f"{url} answered {status}: {error}")
        self.url = url
        self.status = status
        self.error = error


class BadRequest(HttpError):
    """400: the server refused the request's content (not retried)."""


class Unauthorized(HttpError):
    """401 or 403: a missing or wrong token (not retried)."""


class TooLarge(HttpError):
    """413: the request's body is over the server's ``--body-bytes-max``
    (an enqueue splits its batch and retries; one job too large for it
    raises :class:`InvalidJob`)."""


class StaleReceipt(HttpError):
    """409: the run a receipt names is no longer current (its lease lapsed,
    the job ran again elsewhere)."""


class ResultTimeout(ShardqError, TimeoutError):
    """:meth:`shardq.Client.result` waited its ``timeout`` and the job had
    not finished; ``state`` is the job's then (``queued``, ``delayed`` or
    ``running``)."""

    def __init__(self, id: str, timeout: float, state: str):
        super().__init__(f"job {id} did not finish within {timeout} s (it is {state})")
        self.id = id
        self.state = state


class JobDied(ShardqError):
    """:meth:`shardq.Client.result`: the job ran out of attempts and is a
    dead letter (``reason`` its last failure's); it has no result. For a
    dependent (``@N``) that will never run, ``dependent_state`` says why:
    ``"failed"`` (a dependency did not complete, under the policy
    ``"fail"``: ``reason`` names it) or ``"cancelled"``."""

    def __init__(self, id: str, reason: Optional[str], dependent_state: Optional[str] = None):
        super().__init__(f"job {id} is dead: {reason or 'its attempts failed'}")
        self.id = id
        self.reason = reason
        self.dependent_state = dependent_state


class JobNotCancelled(HttpError):
    """409 on a cancel: the job's key is moving to another shard (``state``
    ``"moving"``: cancel it there once the move is done), or a server that
    cannot stop runs found it running (``"running"``). Nothing changed."""

    def __init__(self, url: str, status: int, error: str, state: str):
        super().__init__(url, status, error)
        self.state = state


class KeyNotResumed(HttpError):
    """409 on a key resume (:meth:`shardq.Client.resume_key`): the key is
    moving to another shard now (``state`` ``"moving"``; ``shard`` is the
    shard it is leaving, when the server said). Nothing changed. The move
    carries the key's jobs with their waits, and the new shard keeps a
    back-off's wait as a plain delay, which a resume does not lift there."""

    def __init__(self, url: str, status: int, error: str, state: str, shard: Optional[str] = None):
        super().__init__(url, status, error)
        self.state = state
        self.shard = shard


class ServerUnavailable(ShardqError):
    """No URL answered within the retry budget; ``causes`` holds the last
    error of each URL. For an enqueue, the jobs may or may not have been
    stored: send the same jobs again (a :class:`shardq.NewJob` keeps the
    dedup id it was given or that was generated for it, so nothing is
    stored twice); ``dedup_ids`` lists the ids sent."""

    def __init__(self, what: str, causes: List[str], last: Optional[BaseException] = None,
                 dedup_ids: Sequence[str] = ()):
        super().__init__(f"{what} failed on every server: {'; '.join(causes)}")
        self.causes = causes
        self.last = last
        self.dedup_ids = list(dedup_ids)
