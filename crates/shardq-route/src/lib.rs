//! shardq-route: pure, stable routing of keys to shards.
//!
//! This crate decides where a key lives and nothing else: it does no I/O, no
//! async and keeps no global state, so the same inputs give the same outputs in
//! every process, release and (through the shared vectors in
//! `testdata/routing-vectors.json`) every language.
//!
//! ```
//! use shardq_route::Router;
//!
//! let router = Router::from_yaml(
//!     "version: 1\nalgorithm: rendezvous\nshards: [{name: redis-0}, {name: redis-1}]\n",
//! ).unwrap();
//! let shard = router.route("t-42");
//! assert!(shard == "redis-0" || shard == "redis-1");
//! ```

mod blake2b_short;
pub mod error;
pub mod hash;
pub mod jump;
mod keybuf;
pub mod map;
pub mod plan;
pub mod rendezvous;
pub mod ring;
pub mod router;
pub mod slots;

pub use error::MapError;
pub use hash::HashFn;
pub use map::{validate_shard_name, Algorithm, Shard, ShardMap, ShardState, SlotRange};
pub use plan::Plan;
pub use router::Router;
pub use slots::{hashtag, slot, SLOT_COUNT};
