//! shardq-testkit: what the workspace's tests share, kept out of the
//! product libraries.
//!
//! * [`contract`] is the backend contract as executable checks, and
//!   [`contract_tests!`] turns them into one named test per check on a
//!   backend's harness (`cargo test -p shardq-fs --test contract
//!   one_run_per_key` runs one).
//! * [`maps::HookedMaps`] is a map store that passes every call on but
//!   the ones a test hooks (a publish that fails, read-only settings).
//! * `redis` (feature `redis`) starts real `redis-server` processes
//!   (standalone, replicas, clusters) and a switchable TCP proxy for the
//!   Redis tests.
//! * [`pg::PgServer`] starts a real PostgreSQL server for the outbox's
//!   tests.
//! * [`wait::wait_until`] waits on a condition up to a bound, failing
//!   with what it waited for.
//!
//! Product crates name this crate only under `[dev-dependencies]`; the
//! `shardq` binary never links it.

pub mod contract;
mod macros;
pub mod maps;
pub mod pg;
#[cfg(feature = "redis")]
pub mod redis;
pub mod wait;

pub use contract::{ContractHarness, RewindHarness, CHECKS, REWIND_CHECKS};
pub use wait::{wait_until, WAIT_MAX};
