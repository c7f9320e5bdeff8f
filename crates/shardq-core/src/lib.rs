//! shardq-core: what a job queue backend must do, independent of where jobs live.
//!
//! This crate holds the [`QueueBackend`] trait (enqueue, claim, ack, fail,
//! per-key counts, fencing by map version), the job types, the [`Clock`]
//! trait and the worker pool that runs jobs from any backend. It must never do
//! I/O of its own: the file engine (`shardq-fs`) and the Redis backend
//! implement the trait, and the pool, the CLI and resharding only see the trait.

pub mod backend;
pub mod backoff;
pub mod clock;
pub mod error;
pub mod flow;
pub mod job;
pub mod memory;
pub mod pool;
pub mod producer;
pub mod reshard;
pub mod retry;
pub mod schedule;
pub mod secret;
pub mod workflow;

pub use backend::{
    claim_order, BackedOff, BackendLimits, Coordinator, InspectJobs, KeyHold, KeyResume, MoveKeys,
    Ownership, QueueBackend, RunJobs, KEY_HOLD_SCAN_JOBS,
};
pub use clock::{Clock, ManualClock, SystemClock, MANUAL_WAIT_SLICE_MS};
pub use error::{ErrorKind, QueueError};
pub use flow::{
    Admit, FlowControl, FlowPolicy, FlowSettings, FlowStats, GroupBuckets, GroupLevel, GroupLimit,
    GroupState, LocalGroupBuckets, PolicySource, PolicyTarget, Rate, RunStart, SlotAsk,
};
pub use job::{
    next_fence, validate_job_lease_ms, validate_job_timeout_ms, validate_key, AckOutcome, Backoff,
    BackoffKind, CancelOutcome, ClaimedJob, DeadJob, DeadPolicy, DedupRecord, FailOutcome, Fence,
    Finish, FinishedJob, JobId, JobInfo, JobState, KeyCounts, Keyed, KeyedLive, KeyedMeets,
    KeyedSpec, MovedAway, MovedIn, MovedJob, NewJob, Receipt, Retention, ShardStats, Stored,
    DEDUP_ID_BYTES_MAX, DEDUP_WINDOW_MS_DEFAULT, DEDUP_WINDOW_MS_MAX, FINISHED_AGE_MS_DEFAULT,
    FINISHED_JOBS_KEPT_DEFAULT, FINISHED_JOBS_KEPT_MAX, FINISHED_STARTS_KEPT, JOB_LEASE_MS_DEFAULT,
    JOB_LEASE_MS_MAX, JOB_LEASE_MS_MIN, KEY_BYTES_MAX, KEY_JOBS_MAX, MAX_ATTEMPTS_DEFAULT,
    MAX_ATTEMPTS_LIMIT, MOVED_IDS_KEPT, MOVED_KEYS_KEPT, PAYLOAD_BYTES_LIMIT,
    PAYLOAD_BYTES_MAX_DEFAULT,
};
pub use pool::{
    current_run, BackOff, Handler, HandlerError, PoolEvent, PoolOptions, PoolReport, RunContext,
    RunOutcome, WorkerPool,
};
pub use retry::{RetryChange, RetryPolicy, RetryRules, RetrySettings, RETRY_RULES_MAX};
