//! `ReshardError`: what resharding can fail with, each with its kind.

use super::*;

/// Errors of resharding.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReshardError {
    /// The queue backend failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// A map is invalid.
    #[error(transparent)]
    Map(#[from] MapError),
    /// Another rebalance holds the lock.
    #[error(
        "another rebalance is running ({holder}); wait for it to finish, or rerun after it dies"
    )]
    Busy {
        /// Who holds the lock, as far as known.
        holder: String,
    },
    /// This rebalance's lock lapsed while it ran (its holder stalled past
    /// the lease, or a renewal failed): it writes nothing more.
    #[error("this rebalance lost its lock: {reason}; it stopped and wrote nothing more: run rebalance again")]
    LockLost {
        /// What showed the loss.
        reason: String,
    },
    /// The published map changed under us.
    #[error("the shard map changed while rebalancing (expected version {expected}, found {found}); rerun the rebalance")]
    Conflict {
        /// Version we built on.
        expected: u64,
        /// Version found.
        found: u64,
    },
    /// Keys did not drain in time; they were un-paused and stay pinned to their old shard.
    #[error("keys {keys:?} still have work on their old shards after {waited_ms} ms; they stay pinned there, rerun `rebalance` once they drain (a key halted by a dead letter never drains: retry or purge it)")]
    DrainTimeout {
        /// Keys still busy (first few).
        keys: Vec<String>,
        /// How long we waited.
        waited_ms: u64,
    },
    /// Shards failed during the moves (unreadable, unreachable): the keys
    /// that move from or to them stay where they are; every other key moved.
    #[error("{}", shards_failed_text(*.count, .shards, .keys))]
    ShardsFailed {
        /// The kind of the first shard's failure.
        kind: ErrorKind,
        /// Each failed shard and its error.
        shards: Vec<String>,
        /// How many keys stay.
        count: usize,
        /// The first few of them.
        keys: Vec<String>,
    },
    /// An operation that makes no sense for this map.
    #[error("{0}")]
    Invalid(String),
    /// I/O on the map store's files failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the file.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The map store's own error (a Redis reply, a map file that does not
    /// parse), kept whole with the kind the store gave it.
    #[error("{source}")]
    Store {
        /// What kind of failure it is.
        kind: ErrorKind,
        /// The store's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No shard map is published where the store looks.
    #[error("no shard map is published in {location}; create one with `shardq init`")]
    NoMap {
        /// Where it was looked for.
        location: String,
    },
    /// The stored target map does not parse.
    #[error("the target map in {location} does not parse: {reason}")]
    BadTarget {
        /// Where it is stored.
        location: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The map store did not answer within its bound (a lock held by a
    /// stalled process, an unreachable Redis): retry later.
    #[error("{0}")]
    Unavailable(String),
}

pub(super) fn shards_failed_text(count: usize, shards: &[String], keys: &[String]) -> String {
    if count == 0 {
        format!(
            "every key moved, but clearing the moved keys' copies or seals on their old shards failed ({shards:?}); once those shards answer, rerun `rebalance` to finish"
        )
    } else {
        format!(
            "{count} keys stay where they are because a shard they move from or to failed ({shards:?}; first keys: {keys:?}); repair or restart those shards and rerun `rebalance`; every other key has moved"
        )
    }
}

impl ReshardError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ReshardError::Queue(q) => q.kind(),
            ReshardError::Map(_) | ReshardError::Invalid(_) | ReshardError::NoMap { .. } => {
                ErrorKind::BadInput
            }
            ReshardError::BadTarget { .. } => ErrorKind::Corrupt,
            ReshardError::Store { kind, .. } | ReshardError::ShardsFailed { kind, .. } => *kind,
            ReshardError::Busy { .. }
            | ReshardError::LockLost { .. }
            | ReshardError::Conflict { .. }
            | ReshardError::DrainTimeout { .. } => ErrorKind::Conflict,
            ReshardError::Unavailable(_) => ErrorKind::Retryable,
            ReshardError::Io { .. } => ErrorKind::Internal,
        }
    }

    /// Wraps a map store's own error, keeping its kind and source.
    pub fn store<E: std::error::Error + Send + Sync + 'static>(
        kind: ErrorKind,
        source: E,
    ) -> ReshardError {
        ReshardError::Store {
            kind,
            source: Box::new(source),
        }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> ReshardError {
        ReshardError::Io {
            context: context.into(),
            source,
        }
    }
}
