//! Errors of the data-directory layer (layout, membership, repair); queue
//! errors pass through as [`FsError::Queue`].
//!
//! Every message names the path or value involved; never a bare I/O error.

use std::path::PathBuf;

use shardq_core::QueueError;
use thiserror::Error;

/// Errors of the data-directory layer.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FsError {
    /// The data directory does not exist.
    #[error(
        "data dir {dir} does not exist (create it with `shardq init --data {dir} --shards N`)"
    )]
    Missing {
        /// The path.
        dir: PathBuf,
    },
    /// The directory exists but is not a shardq data directory.
    #[error("{dir} is not a shardq data dir: {reason}")]
    Foreign {
        /// The path.
        dir: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },
    /// `init` on a directory that is not empty.
    #[error("cannot init {dir}: {reason}")]
    InitRefused {
        /// The path.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// membership.json does not parse; it is left untouched.
    #[error("membership file {path} is corrupt ({reason}); it was not changed: fix or restore it by hand")]
    MembershipCorrupt {
        /// The path.
        path: PathBuf,
        /// Parse error.
        reason: String,
    },
    /// The shard map does not parse or validate.
    #[error("shard map {path} is invalid: {reason}")]
    MapInvalid {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// An option value out of range.
    #[error("invalid {name} {value}: {reason}")]
    InvalidOption {
        /// Option name.
        name: &'static str,
        /// Value given.
        value: String,
        /// Allowed range.
        reason: String,
    },
    /// Repair cannot proceed.
    #[error("cannot repair shard {shard:?}: {reason}")]
    RepairRefused {
        /// The shard.
        shard: String,
        /// Why.
        reason: String,
    },
    /// A queue operation failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl FsError {
    /// The kind of this error.
    pub fn kind(&self) -> shardq_core::ErrorKind {
        use shardq_core::ErrorKind;
        match self {
            FsError::Missing { .. }
            | FsError::Foreign { .. }
            | FsError::InitRefused { .. }
            | FsError::InvalidOption { .. }
            | FsError::RepairRefused { .. } => ErrorKind::BadInput,
            FsError::MembershipCorrupt { .. } | FsError::MapInvalid { .. } => ErrorKind::Corrupt,
            FsError::Queue(q) => q.kind(),
            _ => ErrorKind::Internal,
        }
    }
}

impl FsError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> FsError {
        FsError::Io {
            context: context.into(),
            source,
        }
    }
}
