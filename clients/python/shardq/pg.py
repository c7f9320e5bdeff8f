"""Enqueue inside your own Postgres transaction (``shardq pg install``
wrote the outbox and its function; ``shardq pg relay`` moves committed
rows into the deployment). Works with any DB-API cursor whose
placeholders are ``%s``: psycopg 3 and psycopg2::

    import shardq.pg
    shardq.pg.enqueue(cur, "tenant-42", b"resize photo 7", max_attempts=3)

The job exists if and only if the cursor's transaction commits. Bad input
(an empty key, an oversized payload, a reserved dedup id) is refused by the
function, in that transaction, as the driver's error (SQLSTATE 22023)."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

__all__ = ["enqueue"]

_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,47}\Z")


def enqueue(cursor: Any, key: str, payload: Any, *, dedup_id: Optional[str] = None,
            delay_ms: Optional[int] = None, max_attempts: Optional[int] = None,
            schema: str = "shardq") -> int:
    """Writes a job for ``key`` into the outbox in the cursor's transaction
    and returns its row id. ``payload``: ``bytes`` as given, ``str`` as
    UTF-8, anything else as JSON (``jsonb``)."""
    if not _SCHEMA.match(schema):
        raise ValueError(f"schema {schema!r}: a lower-case SQL identifier, at most 48 bytes")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        value: Any = bytes(payload)
        cast = "bytea"
    elif isinstance(payload, str):
        value, cast = payload, "text"
    else:
        value, cast = json.dumps(payload), "jsonb"
    cursor.execute(f"SELECT {schema}.enqueue(%s::text, %s::{cast}, %s::text, %s::bigint, %s::integer)",
                   (key, value, dedup_id, delay_ms, max_attempts))
    row = cursor.fetchone()
    return int(row[0])
