//! The queue layer's one error type, returned by every [`crate::QueueBackend`].
//!
//! Messages name the shard, key, segment or value involved and say what to do;
//! this module must never hide an I/O error's cause.

use thiserror::Error;

/// Errors of the queue layer (any backend).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum QueueError {
    /// The key is empty or too long.
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The key (cut if long).
        key: String,
        /// Why it was refused.
        reason: String,
    },
    /// A dedup id breaks the grammar.
    #[error("key {key:?}: invalid dedup id {id:?}: {reason}")]
    InvalidDedupId {
        /// The job's key (cut if long).
        key: String,
        /// The id (cut if long, escaped).
        id: String,
        /// Why it was refused.
        reason: String,
    },
    /// The payload is larger than the configured limit.
    #[error("payload of key {key:?} is {bytes} bytes, over the limit of {max} bytes (raise payload_bytes_max or send a reference to the data)")]
    PayloadTooLarge {
        /// The job's key.
        key: String,
        /// Payload size.
        bytes: usize,
        /// Configured limit.
        max: usize,
    },
    /// `max_attempts` is zero or over the limit.
    #[error("invalid max attempts {value}: must be 1..={max}")]
    InvalidMaxAttempts {
        /// Requested value.
        value: u32,
        /// Upper bound.
        max: u32,
    },
    /// The delay is over the limit.
    #[error("invalid delay {delay_ms} ms: at most {max} ms")]
    InvalidDelay {
        /// Requested delay.
        delay_ms: u64,
        /// Upper bound.
        max: u64,
    },
    /// A batch has more jobs than the backend accepts in one call.
    #[error("batch of {jobs} jobs is over the limit of {max} per call")]
    BatchTooLarge {
        /// Jobs in the batch.
        jobs: usize,
        /// Upper bound.
        max: usize,
    },
    /// The producer routed with a map older than the shard accepts: reload the
    /// shard map, route again and retry.
    #[error("shard {shard:?} refused key {key:?}: routed with map version {map_version}, shard requires version {map_version_min} or newer (reload the shard map and retry)")]
    Fenced {
        /// Refusing shard.
        shard: String,
        /// Key of the refused job.
        key: String,
        /// Version the producer routed with.
        map_version: u64,
        /// Oldest version the shard accepts.
        map_version_min: u64,
    },
    /// A rebalance's write refused because a newer rebalance has written to
    /// the shard since: this one lost its lock (it stalled past the lock's
    /// lease) and must stop, leaving the work to the newer one.
    #[error("shard {shard:?} refused a write of rebalance epoch {epoch}: a newer rebalance (epoch {newer}) has taken over since; this one lost its lock and stops (rerun `rebalance` if none is running)")]
    Superseded {
        /// Refusing shard.
        shard: String,
        /// The writer's epoch.
        epoch: u64,
        /// The newest epoch the shard has seen.
        newer: u64,
    },
    /// The key's enqueues are paused (it is being moved): retry later.
    #[error("shard {shard:?} has paused enqueues for key {key:?} (the key is being moved; retry shortly)")]
    Paused {
        /// Refusing shard.
        shard: String,
        /// Paused key.
        key: String,
    },
    /// The key's backlog has moved to shard `to` (a rebalance is switching
    /// it there): send the job there, routed with the same map.
    #[error(
        "shard {shard:?} refused key {key:?}: its jobs have moved to shard {to:?} (send it there)"
    )]
    Moved {
        /// Refusing shard.
        shard: String,
        /// The key.
        key: String,
        /// The shard that holds the key's jobs now.
        to: String,
    },
    /// No shard of that name.
    #[error("unknown shard {shard:?}")]
    UnknownShard {
        /// The name asked for.
        shard: String,
    },
    /// Running jobs of a shard needs ownership of it.
    #[error(
        "this process does not own shard {shard:?}: only the owner claims, acks and fails its jobs"
    )]
    NotOwner {
        /// The shard.
        shard: String,
    },
    /// Ack or fail for a job that is not in flight.
    #[error("job {id} of shard {shard:?} is not in flight (already finished, or claimed by another owner)")]
    NotInFlight {
        /// The shard.
        shard: String,
        /// The job.
        id: u64,
    },
    /// A checksum or framing failure that is not a torn tail. The shard does
    /// not serve until repaired.
    #[error("shard {shard:?} is corrupt: segment {segment} offset {offset}: {reason}; it refuses to serve until `shardq repair --data DIR {shard}` is run")]
    Corrupt {
        /// The shard.
        shard: String,
        /// Segment file name.
        segment: String,
        /// Byte offset of the bad record in the segment.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A write or fsync failed earlier; the shard refuses work until reopened.
    #[error("shard {shard:?} refuses work after a failed write or fsync ({cause}); reopen it")]
    Poisoned {
        /// The shard.
        shard: String,
        /// The first failure.
        cause: String,
    },
    /// The shard's state contradicts itself (a bug, or an edited log).
    #[error("shard {shard:?} log is inconsistent at {segment} offset {offset}: {reason}")]
    Inconsistent {
        /// The shard.
        shard: String,
        /// Segment file name.
        segment: String,
        /// Byte offset of the record.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// An ack, fail or extend named a run that is not the current run of the
    /// job: it finished already, its job lease lapsed and the job was handed
    /// out again, or it came from an earlier owner. Nothing was changed.
    #[error("stale receipt for job {id} of shard {shard:?} (fence {fence}): {reason}; nothing was changed")]
    StaleReceipt {
        /// The shard.
        shard: String,
        /// The job.
        id: u64,
        /// The fence the receipt carried.
        fence: u64,
        /// Why it is not the current run.
        reason: String,
    },
    /// The shard could not be reached within its bound (a lock held by a
    /// stalled process, a store that does not answer). Transient: the caller
    /// may retry later; other shards are unaffected.
    #[error("shard {shard:?} is unavailable: {reason}")]
    Unavailable {
        /// The shard.
        shard: String,
        /// What did not answer, and for how long.
        reason: String,
    },
    /// The store refuses writes because it is full; claims and acks still
    /// run so that workers can drain it.
    #[error("shard {shard:?} is full: {reason}; nothing was enqueued (drain it, or give the store more room)")]
    StoreFull {
        /// The shard.
        shard: String,
        /// The store's own words.
        reason: String,
    },
    /// The store lost its state, or belongs to another deployment: workers
    /// stop rather than run on it.
    #[error("{0}")]
    StoreLost(String),
    /// Data written in a format this build does not know.
    #[error("{what} has format version {found}, this build reads version {supported} (upgrade shardq, or restore data written by this version)")]
    UnknownFormat {
        /// The file, segment or store, by name.
        what: String,
        /// The version found.
        found: String,
        /// The version this build reads and writes.
        supported: String,
    },
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the file.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An option or setting outside its range: names it, the value and
    /// what is allowed.
    #[error("invalid {name} {value}: must be {allowed}")]
    InvalidOption {
        /// The option, as a user writes it (`job lease`, `concurrency`).
        name: &'static str,
        /// The value given, with its unit.
        value: String,
        /// The allowed range.
        allowed: String,
    },
    /// Something already exists where it was to be created (a deployment
    /// in a Redis namespace): nothing was written.
    #[error("{what}")]
    AlreadyExists {
        /// What exists, where, and what to do instead.
        what: String,
    },
    /// The backend does not have this capability.
    #[error("this backend does not support {what}")]
    Unsupported {
        /// The capability.
        what: &'static str,
    },
    /// A shard holds more keys with work than an inventory walks.
    #[error("shard {shard:?}: more than {max} keys with work; the inventory stops there")]
    InventoryTooLarge {
        /// The shard.
        shard: String,
        /// The bound.
        max: usize,
    },
    /// A file of the store (a fence file) does not hold what it must.
    #[error("{path} is not a valid {what}: {reason}")]
    BadFile {
        /// The file.
        path: String,
        /// What it should be (`fence file`).
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The worker pool's threads are gone (each logged why).
    #[error("all worker threads exited")]
    WorkersExited,
    /// A shard failed while the pool ran and was not run again (the error
    /// was logged when it happened).
    #[error("shard {shard:?} failed and was not run (see the errors above)")]
    ShardFailed {
        /// The shard.
        shard: String,
    },
    /// A store's own error (a Redis reply, a map file), kept whole: its
    /// kind and its source survive the trip through this layer.
    #[error("{source}")]
    Store {
        /// What kind of failure it is, as the store judged it.
        kind: ErrorKind,
        /// The store's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An invariant of shardq broke (a bug): what was expected.
    #[error("internal error: {what} (a bug in shardq; please report it)")]
    Internal {
        /// What did not hold.
        what: String,
    },
}

/// What kind of failure an error is, whatever layer it comes from: the one
/// thing a caller decides on. The CLI's exit code and the server's HTTP
/// status follow from it ([`ErrorKind::exit_code`], [`ErrorKind::http_status`]),
/// in one place, so no layer reads another's message to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request itself is wrong (a field, a value, a name): sending it
    /// again changes nothing; nothing was stored.
    BadInput,
    /// The request meets the state of the store (a stale receipt, a shard
    /// owned elsewhere, a busy rebalance): it can be right later, or never.
    Conflict,
    /// The store did not answer in time or is full for now: the same
    /// request may work later.
    Retryable,
    /// Stored data is damaged: nothing runs on it until it is repaired.
    Corrupt,
    /// The store lost its state or is another deployment's: stop.
    Lost,
    /// Anything else (a bug, an unexpected I/O error).
    Internal,
}

impl ErrorKind {
    /// The HTTP status of an error of this kind.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::BadInput => 400,
            ErrorKind::Conflict => 409,
            ErrorKind::Retryable => 503,
            ErrorKind::Corrupt | ErrorKind::Lost | ErrorKind::Internal => 500,
        }
    }

    /// The CLI's exit code for an error of this kind: 2 bad input, 3
    /// conflict, 75 retry later (`EX_TEMPFAIL`), 65 damaged data
    /// (`EX_DATAERR`), 76 a lost store (`EX_PROTOCOL`), 1 anything else.
    pub fn exit_code(self) -> u8 {
        match self {
            ErrorKind::BadInput => 2,
            ErrorKind::Conflict => 3,
            ErrorKind::Retryable => 75,
            ErrorKind::Corrupt => 65,
            ErrorKind::Lost => 76,
            ErrorKind::Internal => 1,
        }
    }

    /// Its name, for logs and JSON (`"bad_input"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::BadInput => "bad_input",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Retryable => "retryable",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Lost => "lost",
            ErrorKind::Internal => "internal",
        }
    }
}

impl QueueError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            QueueError::InvalidKey { .. }
            | QueueError::InvalidDedupId { .. }
            | QueueError::PayloadTooLarge { .. }
            | QueueError::InvalidMaxAttempts { .. }
            | QueueError::InvalidDelay { .. }
            | QueueError::BatchTooLarge { .. }
            | QueueError::InvalidOption { .. }
            | QueueError::Unsupported { .. }
            | QueueError::UnknownShard { .. } => ErrorKind::BadInput,
            QueueError::AlreadyExists { .. } => ErrorKind::Conflict,
            QueueError::BadFile { .. } => ErrorKind::Corrupt,
            QueueError::Store { kind, .. } => *kind,
            QueueError::NotOwner { .. }
            | QueueError::NotInFlight { .. }
            | QueueError::StaleReceipt { .. }
            | QueueError::Superseded { .. } => ErrorKind::Conflict,
            QueueError::Fenced { .. }
            | QueueError::Paused { .. }
            | QueueError::Moved { .. }
            | QueueError::Unavailable { .. }
            | QueueError::StoreFull { .. } => ErrorKind::Retryable,
            QueueError::Corrupt { .. }
            | QueueError::Inconsistent { .. }
            | QueueError::UnknownFormat { .. } => ErrorKind::Corrupt,
            QueueError::StoreLost(_) => ErrorKind::Lost,
            QueueError::Poisoned { .. }
            | QueueError::Io { .. }
            | QueueError::InventoryTooLarge { .. }
            | QueueError::WorkersExited
            | QueueError::ShardFailed { .. }
            | QueueError::Internal { .. } => ErrorKind::Internal,
        }
    }

    /// Errors that concern one shard only and may pass: the pool keeps
    /// running its other shards and tries this one again later.
    pub fn is_transient(&self) -> bool {
        matches!(self, QueueError::Unavailable { .. })
    }

    /// Wraps a store's own error, keeping its kind and source.
    pub fn store<E: std::error::Error + Send + Sync + 'static>(
        kind: ErrorKind,
        source: E,
    ) -> QueueError {
        QueueError::Store {
            kind,
            source: Box::new(source),
        }
    }

    /// Wraps an I/O error with a description of what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> QueueError {
        QueueError::Io {
            context: context.into(),
            source,
        }
    }
}
