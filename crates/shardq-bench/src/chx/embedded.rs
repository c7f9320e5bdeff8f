//! The embedded on-disk queue (`shardq-fs`) as a harness system.
//!
//! The engine does not yet expose a way to initialise a data directory,
//! enqueue jobs and read per-shard depth, so this system reports itself as
//! skipped rather than substituting the bare router (which is already
//! measured under its algorithm's name).

use super::{Observer, Params, SystemReport};

/// Name of the system in every result file.
pub const SYSTEM: &str = "shardq-embedded";

/// Runs the experiments on the embedded engine, or says why it cannot.
pub fn run(_params: &Params, _obs: &mut dyn Observer) -> SystemReport {
    SystemReport::skipped(
        SYSTEM,
        "embedded engine not available (shardq-fs has no API yet to init a data dir, enqueue and read shard depth)",
    )
}
