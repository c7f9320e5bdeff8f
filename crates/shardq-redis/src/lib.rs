//! shardq-redis: the Redis backend of shardq.
//!
//! Shards live on standalone Redis instances (`redis://host:port/db`, one
//! instance per shard or several shards per instance) or in one Redis
//! Cluster (`redis+cluster://host:port,host:port`), where each shard's keys
//! share one hashtag and so one slot ([`keys`] documents the key grammar).
//! Every transition of a job (enqueue, claim, ack, fail, reclaim,
//! dead-letter) is one Lua script, so it is atomic on the server; claims,
//! leases, fencing tokens and the fence itself live in Redis, so worker
//! processes on several hosts share the shards safely.
//!
//! * [`RedisBackend`] implements [`shardq_core::QueueBackend`].
//! * [`RedisCoordinator`] implements [`shardq_core::Coordinator`] with a
//!   lease per shard (owner `host@pid`, a token unique across store
//!   restarts, expiry, takeover).
//! * [`init_deployment`] writes a deployment's records (a random id, a
//!   namespace, the layout version); every later open and script checks
//!   them, so a store that lost its state stops workers with
//!   `QueueError::StoreLost`.
//! * [`RedisMapStore`] keeps the shard map YAML and its version in Redis,
//!   published by compare-and-set.
//! * [`local`] starts `redis-server` processes on this host's loopback
//!   ports (what `shardq demo --backend redis` runs on).
//!
//! This crate must never decide routing (that is `shardq-route`) and never
//! talk to any server but those the shard map or the caller names.

pub mod backend;
mod conn;
pub mod coord;
pub mod deploy;
pub mod error;
pub mod keys;
pub mod local;
pub mod mapstore;
mod scripts;

pub use backend::{
    is_redis_url, RedisBackend, RedisOptions, ACK_BATCH_MAX, CLAIM_BATCH_MAX, ENQUEUE_BATCH_MAX,
    EXTEND_BATCH_MAX, WAIT_REPLICAS_TIMEOUT_MS_DEFAULT,
};
pub use conn::{
    CONNECT_TIMEOUT_MS, REQUIRED_MAXMEMORY_POLICY, RESPONSE_TIMEOUT_MS, RETRY_ATTEMPTS_DEFAULT,
    RETRY_BUDGET_MS_DEFAULT, RETRY_BUDGET_MS_MAX, RETRY_WAIT_MS_MAX, SCHEME_CLUSTER,
    SCHEME_INSTANCE, TIMEOUT_MS_MAX, TIMEOUT_MS_MIN,
};
pub use coord::{default_owner, CoordinatorOptions, RedisCoordinator, LEASE_MS_DEFAULT};
pub use deploy::{init_deployment, init_shards, Deployment};
pub use error::RedisError;
pub use mapstore::RedisMapStore;
/// The default job lease of a claim, from the core contract.
pub use shardq_core::JOB_LEASE_MS_DEFAULT;
