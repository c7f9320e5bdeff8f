//! The harness's one error type. Messages say what to do next, because the
//! usual failure (no broker) is fixed by the reader, not by the code.

use std::path::PathBuf;

/// Everything that can stop an experiment or the writing of its results.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChxError {
    /// A parameter is outside its documented bounds.
    #[error("parameter `{field}` has invalid value {value}: {reason}")]
    InvalidParam {
        /// The parameter's name, as on the command line.
        field: &'static str,
        /// The rejected value.
        value: String,
        /// The rule it breaks.
        reason: String,
    },
    /// Nothing answers AMQP at the URL.
    #[error("no broker at {url} ({reason}); start one with `scripts/rabbitmq.sh start`")]
    NoBroker {
        /// The URL that was tried.
        url: String,
        /// What went wrong (connection refused, timeout, not AMQP).
        reason: String,
    },
    /// The broker answered but an AMQP operation failed.
    #[error("AMQP error at {url} while {doing}: {source}")]
    Amqp {
        /// The broker URL.
        url: String,
        /// The operation, in words ("declaring exchange shardq-chx-...").
        doing: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// Messages the broker confirmed do not add up to what was sent.
    #[error("{system}: {detail}")]
    Lost {
        /// The system under test.
        system: String,
        /// Which messages are missing or duplicated.
        detail: String,
    },
    /// The embedded engine refused an operation or reported inconsistent depths.
    #[error("embedded engine, {doing}: {reason}")]
    Engine {
        /// The operation ("enqueueing", "reading status").
        doing: String,
        /// The engine's error or the inconsistency.
        reason: String,
    },
    /// A shard map the harness built was rejected.
    #[error("building a shard map: {0}")]
    Route(#[from] shardq_route::MapError),
    /// A result file could not be written.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A chart could not be drawn.
    #[error("drawing {path}: {reason}")]
    Chart {
        /// The SVG file.
        path: PathBuf,
        /// The drawing library's error.
        reason: String,
    },
}
