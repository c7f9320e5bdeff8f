//! shardq-worker: the handler processes of `shardq work`.
//!
//! A worker pool (`shardq_core::WorkerPool`) calls a [`Handler`] per run;
//! this crate builds the handlers that run a user's command:
//!
//! - [`command_handler`] starts the command once per job
//!   ([`handler_proc`]): payload on stdin, the job in `SHARDQ_*`
//!   environment variables, exit 0 acks, exit 75 with a `shardq-backoff:
//!   MS` line backs off, anything else fails the attempt with the end of
//!   the handler's stderr;
//! - [`stdio_handler`] keeps long-lived handler processes fed one JSON job
//!   per line ([`stdio_worker`], `docs/stdio-protocol.md`).
//!
//! Either way every handler runs in a process group of its own that is
//! killed, and its leader reaped, before the attempt's result is reported.
//! [`WorkOptions`] holds the options of these handlers and checks them.
//!
//! The crate knows nothing of shards, leases or retries beyond the claimed
//! job it is handed: what a failed attempt means is the pool's business.
//!
//! [`Handler`]: shardq_core::Handler

pub mod handler_proc;
pub mod options;
pub mod stdio_worker;

pub use handler_proc::{
    backoff_asked, check_command, command_handler, run_job_command, BACKOFF_EXIT_CODE,
    BACKOFF_LINE, STDERR_TAIL_BYTES,
};
pub use options::{
    OptionError, WorkOptions, CONCURRENCY_MAX, CONCURRENCY_MIN, JOB_TIMEOUT_MS_MAX,
    JOB_TIMEOUT_MS_MIN, STDIO_PIPELINE_DEFAULT, STDIO_PIPELINE_MAX, STDIO_PIPELINE_MIN,
};
pub use stdio_worker::{stdio_handler, StdioJob, RESULT_LINE_BYTES_MAX};

#[cfg(test)]
pub(crate) mod testing;
