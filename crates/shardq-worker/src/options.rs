//! The options of `shardq work` that shape its handlers, with their bounds
//! and their one check.
//!
//! [`WorkOptions::validate`] is where each of them is judged; the command
//! line only reads the flags into a [`WorkOptions`] and reports the
//! [`OptionError`], which names the flag and the value refused. Options of
//! the pool itself are checked where the pool lives (`shardq_core`): the
//! job lease by `shardq_core::validate_job_lease_ms`, whose error is
//! passed on under the flag's name.

use std::time::Duration;

use shardq_core::{ErrorKind, QueueError};

/// Fewest handler slots (`--concurrency`).
pub const CONCURRENCY_MIN: usize = 1;
/// Most handler slots (`--concurrency`): the pool's bound on runs at once.
pub const CONCURRENCY_MAX: usize = shardq_core::pool::CONCURRENCY_MAX;
/// Fewest jobs written ahead to one stdio handler (`--stdio-pipeline`).
pub const STDIO_PIPELINE_MIN: usize = 1;
/// Most jobs written ahead to one stdio handler (`--stdio-pipeline`).
pub const STDIO_PIPELINE_MAX: usize = 64;
/// Jobs written ahead to one stdio handler unless told otherwise.
pub const STDIO_PIPELINE_DEFAULT: usize = 4;
/// Shortest `--job-timeout-ms` accepted (core's, shared with the server).
pub const JOB_TIMEOUT_MS_MIN: u64 = shardq_core::job::JOB_TIMEOUT_MS_MIN;
/// Longest `--job-timeout-ms` accepted (7 days).
pub const JOB_TIMEOUT_MS_MAX: u64 = shardq_core::job::JOB_TIMEOUT_MS_MAX;

/// Why an option was refused. Its text names the flag and the value.
#[derive(Debug, thiserror::Error)]
pub enum OptionError {
    /// A value outside its bounds.
    #[error("invalid {option} {value}: must be {allowed}")]
    OutOfRange {
        /// The flag, as written on the command line (`--concurrency`).
        option: &'static str,
        /// The value given.
        value: String,
        /// What is allowed (`1..=64`).
        allowed: String,
    },
    /// A value refused by the library that owns the option.
    #[error("{option}: {source}")]
    Refused {
        /// The flag, as written on the command line (`--job-lease-ms`).
        option: &'static str,
        /// The owner's refusal, which names the value.
        source: QueueError,
    },
}

impl OptionError {
    /// Always bad input: the caller gave a value out of bounds.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::BadInput
    }
}

/// What `shardq work` runs its handlers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkOptions {
    /// Handler slots: handlers running at once, or with stdio, long-lived
    /// handler processes ([`CONCURRENCY_MIN`]..=[`CONCURRENCY_MAX`]).
    pub concurrency: usize,
    /// With the stdio protocol: jobs written ahead to each handler process
    /// ([`STDIO_PIPELINE_MIN`]..=[`STDIO_PIPELINE_MAX`]); `None`: one
    /// process per job.
    pub stdio_pipeline: Option<usize>,
    /// Longest run of one handler, in ms
    /// ([`JOB_TIMEOUT_MS_MIN`]..=[`JOB_TIMEOUT_MS_MAX`]); `None`: no limit.
    pub job_timeout_ms: Option<u64>,
    /// Job lease of each run, in ms (bounded by `shardq_core`).
    pub job_lease_ms: u64,
    /// Most bytes of a handler's result (1..=[`RESULT_BYTES_MAX`]): a
    /// larger one fails its attempt.
    pub result_bytes_max: usize,
}

/// The largest result a handler may give: core's bound.
pub use shardq_core::job::RESULT_BYTES_MAX;

impl Default for WorkOptions {
    fn default() -> Self {
        WorkOptions {
            concurrency: CONCURRENCY_MIN,
            stdio_pipeline: None,
            job_timeout_ms: None,
            job_lease_ms: shardq_core::JOB_LEASE_MS_DEFAULT,
            result_bytes_max: RESULT_BYTES_MAX,
        }
    }
}

impl WorkOptions {
    /// Checks every option against its bounds, in the order `concurrency`,
    /// `job_timeout_ms`, `job_lease_ms`, `stdio_pipeline`,
    /// `result_bytes_max`; the first one refused is named with its value.
    pub fn validate(&self) -> Result<(), OptionError> {
        if !(CONCURRENCY_MIN..=CONCURRENCY_MAX).contains(&self.concurrency) {
            return Err(OptionError::OutOfRange {
                option: "--concurrency",
                value: self.concurrency.to_string(),
                allowed: format!("{CONCURRENCY_MIN}..={CONCURRENCY_MAX}"),
            });
        }
        if let Some(ms) = self.job_timeout_ms {
            if !(JOB_TIMEOUT_MS_MIN..=JOB_TIMEOUT_MS_MAX).contains(&ms) {
                return Err(OptionError::OutOfRange {
                    option: "--job-timeout-ms",
                    value: ms.to_string(),
                    allowed: format!("{JOB_TIMEOUT_MS_MIN}..={JOB_TIMEOUT_MS_MAX}"),
                });
            }
        }
        shardq_core::validate_job_lease_ms(self.job_lease_ms).map_err(|source| {
            OptionError::Refused {
                option: "--job-lease-ms",
                source,
            }
        })?;
        if let Some(n) = self.stdio_pipeline {
            if !(STDIO_PIPELINE_MIN..=STDIO_PIPELINE_MAX).contains(&n) {
                return Err(OptionError::OutOfRange {
                    option: "--stdio-pipeline",
                    value: n.to_string(),
                    allowed: format!("{STDIO_PIPELINE_MIN}..={STDIO_PIPELINE_MAX}"),
                });
            }
        }
        if !(1..=RESULT_BYTES_MAX).contains(&self.result_bytes_max) {
            return Err(OptionError::OutOfRange {
                option: "--result-bytes-max",
                value: self.result_bytes_max.to_string(),
                allowed: format!("1..={RESULT_BYTES_MAX}"),
            });
        }
        Ok(())
    }

    /// The job timeout as a duration.
    pub fn job_timeout(&self) -> Option<Duration> {
        self.job_timeout_ms.map(Duration::from_millis)
    }

    /// Runs the pool keeps going at once: one per slot, or with stdio one
    /// per job written ahead to each slot's process (at most
    /// [`CONCURRENCY_MAX`]).
    pub fn pool_concurrency(&self) -> usize {
        match self.stdio_pipeline {
            None => self.concurrency,
            Some(n) => self.concurrency.saturating_mul(n).min(CONCURRENCY_MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(change: impl FnOnce(&mut WorkOptions)) -> WorkOptions {
        let mut o = WorkOptions::default();
        change(&mut o);
        o
    }

    #[test]
    fn the_defaults_pass() {
        WorkOptions::default().validate().expect("defaults");
        with(|o| o.stdio_pipeline = Some(STDIO_PIPELINE_DEFAULT))
            .validate()
            .expect("stdio defaults");
    }

    #[test]
    fn concurrency_is_bounded_on_both_sides() {
        let e = with(|o| o.concurrency = 0).validate().unwrap_err();
        assert_eq!(e.to_string(), "invalid --concurrency 0: must be 1..=4096");
        assert_eq!(e.kind(), ErrorKind::BadInput);
        let over = CONCURRENCY_MAX + 1;
        let e = with(|o| o.concurrency = over).validate().unwrap_err();
        assert!(
            e.to_string().contains(&format!("--concurrency {over}")),
            "{e}"
        );
        with(|o| o.concurrency = CONCURRENCY_MAX)
            .validate()
            .expect("the bound itself");
    }

    #[test]
    fn the_pipeline_is_checked_only_with_stdio() {
        let e = with(|o| o.stdio_pipeline = Some(0)).validate().unwrap_err();
        assert_eq!(e.to_string(), "invalid --stdio-pipeline 0: must be 1..=64");
        let e = with(|o| o.stdio_pipeline = Some(STDIO_PIPELINE_MAX + 1))
            .validate()
            .unwrap_err();
        assert_eq!(e.to_string(), "invalid --stdio-pipeline 65: must be 1..=64");
        with(|o| o.stdio_pipeline = Some(STDIO_PIPELINE_MAX))
            .validate()
            .expect("the bound itself");
    }

    #[test]
    fn timeouts_and_leases_name_their_flag_and_value() {
        let e = with(|o| o.job_timeout_ms = Some(0)).validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("invalid --job-timeout-ms 0: must be 1..={JOB_TIMEOUT_MS_MAX}")
        );
        let e = with(|o| o.job_timeout_ms = Some(JOB_TIMEOUT_MS_MAX + 1))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("--job-timeout-ms 604800001"), "{e}");
        let e = with(|o| o.job_lease_ms = 5).validate().unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with("--job-lease-ms: ") && text.contains("5 ms"),
            "{text}"
        );
        assert!(matches!(e, OptionError::Refused { .. }));
    }

    #[test]
    fn the_first_option_refused_is_the_one_named() {
        let e = with(|o| {
            o.concurrency = 0;
            o.stdio_pipeline = Some(0);
        })
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("--concurrency"), "{e}");
    }

    #[test]
    fn stdio_multiplies_the_pool_up_to_its_bound() {
        assert_eq!(with(|o| o.concurrency = 3).pool_concurrency(), 3);
        let stdio = with(|o| {
            o.concurrency = 3;
            o.stdio_pipeline = Some(4);
        });
        assert_eq!(stdio.pool_concurrency(), 12);
        let big = with(|o| {
            o.concurrency = CONCURRENCY_MAX;
            o.stdio_pipeline = Some(STDIO_PIPELINE_MAX);
        });
        assert_eq!(big.pool_concurrency(), CONCURRENCY_MAX);
        assert_eq!(
            with(|o| o.job_timeout_ms = Some(250)).job_timeout(),
            Some(Duration::from_millis(250))
        );
    }
}
