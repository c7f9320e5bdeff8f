//! The Redis backend's one error type.
//!
//! Every message names the shard (or map store) and the URL involved and
//! says what to do. This module must never hide the Redis client's cause.

use shardq_core::QueueError;
use thiserror::Error;

/// Errors of the Redis backend, the coordinator and the map store.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The server did not answer within the bounded retries (refused
    /// connections, timeouts: a stopped or overloaded server). Transient:
    /// becomes [`QueueError::Unavailable`].
    #[error("shard {shard:?} at {url}: Redis unreachable after {attempts} attempts in {elapsed_ms} ms ({cause}); check that the server runs and the URL is right")]
    Unreachable {
        /// Shard (or `map store`).
        shard: String,
        /// URL of the instance or cluster.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent, in ms.
        elapsed_ms: u64,
        /// Last error from the client.
        cause: String,
    },
    /// A write was applied on the primary but fewer replicas than
    /// `--redis-wait-replicas` confirmed it in time: it may not survive a
    /// failover. Transient: becomes [`QueueError::Unavailable`].
    #[error("shard {shard:?} at {}", replicas_behind(url, *wanted, *acked, *timeout_ms))]
    ReplicasBehind {
        /// Shard.
        shard: String,
        /// URL of the primary.
        url: String,
        /// Replicas asked for.
        wanted: u32,
        /// Replicas that confirmed.
        acked: u64,
        /// The wait, in ms.
        timeout_ms: u64,
    },
    /// The server may not be used: it may evict keys, its CONFIG command is
    /// hidden so that cannot be checked, or it refused the handshake.
    #[error("shard {shard:?}: {reason}")]
    Refused {
        /// Shard (or `map store`).
        shard: String,
        /// URL of the instance or cluster.
        url: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The server is at `maxmemory` (policy `noeviction`) and refused a
    /// write: becomes [`QueueError::StoreFull`].
    #[error("shard {shard:?} at {url}: Redis is full: {cause}")]
    Full {
        /// Shard (or `map store`).
        shard: String,
        /// URL of the instance or cluster.
        url: String,
        /// The server's error.
        cause: String,
    },
    /// A script found a record of the shard that is not its grammar (a
    /// flipped byte, a write by something else): the shard's data needs a
    /// look. Becomes a store error of kind corrupt.
    #[error("shard {shard:?} at {url}: {cause}; the shard's data is damaged: inspect the record named (redis-cli), fix or delete it")]
    CorruptRecord {
        /// Shard.
        shard: String,
        /// URL of the instance or cluster.
        url: String,
        /// The script's error, naming the record.
        cause: String,
    },
    /// The server refused a command for a reason retrying does not cure.
    #[error("shard {shard:?} at {url}: Redis refused the command: {cause}")]
    Command {
        /// Shard (or `map store`).
        shard: String,
        /// URL of the instance or cluster.
        url: String,
        /// The server's error.
        cause: String,
    },
    /// A script answered something this client does not understand (a
    /// different shardq version wrote the keys, or the keys were edited).
    #[error("shard {shard:?} at {url}: unexpected reply: {reason}")]
    Protocol {
        /// Shard (or `map store`).
        shard: String,
        /// URL of the instance or cluster.
        url: String,
        /// What was wrong.
        reason: String,
    },
    /// A shard URL that is not `redis://host:port/db` or
    /// `redis+cluster://host:port,host:port`.
    #[error("shard {shard:?}: invalid Redis URL {url:?}: {reason}")]
    InvalidUrl {
        /// Shard.
        shard: String,
        /// The URL as given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// A queue or shard name that cannot be part of a key.
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName {
        /// `queue` or `shard`.
        what: &'static str,
        /// The name as given.
        name: String,
        /// Why it was refused.
        reason: String,
    },
    /// The shard map names no shard with a Redis URL.
    #[error("the shard map (version {version}) has no shard with a redis:// or redis+cluster:// url; give shards a url such as redis://127.0.0.1:6379/0")]
    NoRedisShards {
        /// Map version.
        version: u64,
    },
    /// The stored shard map could not be used.
    #[error("shard map in Redis at {url}: {reason}")]
    Map {
        /// URL of the map store.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// Compare-and-set publish lost: someone published another version first.
    /// A map write under the rebalance lock found the lock lapsed: no
    /// longer this process's.
    #[error("shard map in Redis at {url}: {what} refused: this process's rebalance lock lapsed (its holder stalled past the lease) and is no longer its own")]
    LockLost {
        /// The store's URL.
        url: String,
        /// What was refused.
        what: String,
    },
    #[error("shard map in Redis at {url} is at version {found}, not the expected {expected}: reload the map, reapply the change and publish again")]
    VersionConflict {
        /// URL of the map store.
        url: String,
        /// Version the caller expected.
        expected: u64,
        /// Version stored.
        found: u64,
    },
    /// A queue-level refusal (fencing, ownership, limits).
    #[error(transparent)]
    Queue(#[from] QueueError),
}

fn replicas_behind(url: &str, wanted: u32, acked: u64, timeout_ms: u64) -> String {
    format!(
        "Redis at {url}: {acked} of {wanted} replicas confirmed the write within {timeout_ms} ms \
         (--redis-wait-replicas {wanted}); it may not survive a failover, so it is not reported \
         done: retry once the replicas catch up"
    )
}

impl RedisError {
    /// The kind of this error.
    pub fn kind(&self) -> shardq_core::ErrorKind {
        use shardq_core::ErrorKind;
        match self {
            RedisError::Unreachable { .. }
            | RedisError::Full { .. }
            | RedisError::ReplicasBehind { .. } => ErrorKind::Retryable,
            RedisError::InvalidUrl { .. }
            | RedisError::InvalidName { .. }
            | RedisError::NoRedisShards { .. }
            | RedisError::Map { .. } => ErrorKind::BadInput,
            RedisError::VersionConflict { .. } | RedisError::LockLost { .. } => ErrorKind::Conflict,
            RedisError::CorruptRecord { .. } => ErrorKind::Corrupt,
            RedisError::Queue(q) => q.kind(),
            _ => ErrorKind::Internal,
        }
    }
}

impl From<RedisError> for QueueError {
    fn from(e: RedisError) -> QueueError {
        match e {
            RedisError::Queue(q) => q,
            RedisError::Unreachable {
                shard,
                url,
                attempts,
                elapsed_ms,
                cause,
            } => QueueError::Unavailable {
                shard,
                reason: format!(
                    "Redis at {url} did not answer: {attempts} attempts in {elapsed_ms} ms ({cause})"
                ),
            },
            RedisError::ReplicasBehind {
                shard,
                url,
                wanted,
                acked,
                timeout_ms,
            } => QueueError::Unavailable {
                shard,
                reason: replicas_behind(&url, wanted, acked, timeout_ms),
            },
            RedisError::Full { shard, url, cause } => QueueError::StoreFull {
                shard,
                reason: format!("Redis at {url}: {cause}"),
            },
            other => QueueError::store(other.kind(), other),
        }
    }
}
