//! The front door's one error type: what opening, initialising or reading a
//! deployment can fail with. Messages name the data dir, file, shard or
//! value; this module must never hide a lower layer's cause.

use thiserror::Error;

/// Errors of [`crate::Deployment`] and its helpers.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DeployError {
    /// Bad input (a flag, a spec, a map) or a data dir in a shape we refuse.
    #[error("{0}")]
    Invalid(String),
    /// The queue layer failed.
    #[error(transparent)]
    Queue(#[from] shardq_core::QueueError),
    /// The embedded engine failed.
    #[error(transparent)]
    Fs(#[from] shardq_fs::FsError),
    /// The Redis backend failed.
    #[error(transparent)]
    Redis(#[from] shardq_redis::RedisError),
    /// Resharding or the map store failed.
    #[error(transparent)]
    Reshard(#[from] shardq_core::reshard::ReshardError),
    /// A shard map is invalid.
    #[error(transparent)]
    Map(#[from] shardq_route::MapError),
    /// The producer could not start (its map did not load).
    #[error(transparent)]
    Produce(Box<shardq_core::producer::ProduceError>),
    /// The Redis map store named by a data dir's remote file failed.
    #[error("opening the shard map in Redis at {url} (named by {named_by}): {source}")]
    RemoteMap {
        /// The map store's URL.
        url: String,
        /// The file that names it.
        named_by: String,
        /// The cause, with its kind.
        #[source]
        source: Box<shardq_redis::RedisError>,
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
}

impl DeployError {
    /// The kind of this error, from which the CLI's exit code and the
    /// server's status follow.
    pub fn kind(&self) -> shardq_core::ErrorKind {
        use shardq_core::ErrorKind;
        match self {
            DeployError::Invalid(_) | DeployError::Map(_) => ErrorKind::BadInput,
            DeployError::Queue(q) => q.kind(),
            DeployError::Fs(e) => e.kind(),
            DeployError::Redis(e) => e.kind(),
            DeployError::Reshard(e) => e.kind(),
            DeployError::Produce(e) => e.kind(),
            DeployError::RemoteMap { source, .. } => source.kind(),
            DeployError::Io { .. } => ErrorKind::Internal,
        }
    }
}

impl From<shardq_core::producer::ProduceError> for DeployError {
    fn from(e: shardq_core::producer::ProduceError) -> DeployError {
        DeployError::Produce(Box::new(e))
    }
}

impl DeployError {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> DeployError {
        DeployError::Io {
            context: context.into(),
            source,
        }
    }
}

/// `Err(DeployError::Invalid(format!(...)))`.
macro_rules! invalid {
    ($($arg:tt)*) => {
        return Err($crate::error::DeployError::Invalid(format!($($arg)*)))
    };
}
pub(crate) use invalid;
