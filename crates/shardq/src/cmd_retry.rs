//! `shardq retry show|set|clear`: the deployment's retry backoff, kept
//! beside its map (embedded: `settings.retry.json`; Redis: the deployment's
//! settings hash), read by every worker and server when it starts. Glue:
//! parse, check, call `shardq-deploy`, print.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use shardq_core::{Backoff, BackoffKind};
use shardq_deploy::Deployment;

#[derive(Debug, Subcommand)]
pub enum RetryAction {
    /// Show the retry backoff (and what each attempt waits).
    Show {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Change the retry backoff: the options given replace those fields and
    /// the others keep their values. Workers and servers started afterwards
    /// use it (restart running ones).
    Set {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// `exponential` (base, doubling per attempt, up to max) or `fixed`
        /// (base after every attempt).
        #[arg(long, value_name = "KIND")]
        backoff: Option<String>,
        /// Delay after the first failed attempt, in ms (1 ms to 1 year).
        #[arg(long, value_name = "MS")]
        base_ms: Option<u64>,
        /// Longest delay, in ms (at least the base).
        #[arg(long, value_name = "MS")]
        max_ms: Option<u64>,
        /// Up to this percentage taken off each delay, so jobs that failed
        /// together come back spread out (0 to 100).
        #[arg(long, value_name = "PCT")]
        jitter_pct: Option<u8>,
    },
    /// Go back to the default backoff (100 ms doubling to 60 s, no jitter).
    Clear {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
    },
}

fn open(data: &std::path::Path) -> anyhow::Result<Deployment> {
    Ok(Deployment::open(
        data,
        &shardq_deploy::OpenOptions::default(),
    )?)
}

/// The waits before attempts 2..=6 and their sum, for `show`.
fn schedule(b: &Backoff) -> (Vec<u64>, u64) {
    let waits: Vec<u64> = (1..=5).map(|a| b.delay_ms(a)).collect();
    let sum = waits[..shardq_core::MAX_ATTEMPTS_DEFAULT as usize - 1]
        .iter()
        .sum();
    (waits, sum)
}

fn kind_word(k: BackoffKind) -> &'static str {
    match k {
        BackoffKind::Exponential => "exponential",
        BackoffKind::Fixed => "fixed",
    }
}

pub fn run(action: RetryAction) -> anyhow::Result<ExitCode> {
    match action {
        RetryAction::Show { data, json } => {
            let d = open(&data)?;
            let b = d.retry_policy()?;
            let (waits, sum) = schedule(&b);
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "backoff": kind_word(b.kind),
                        "base_ms": b.base_ms,
                        "max_ms": b.max_ms,
                        "jitter_pct": b.jitter_pct,
                        "waits_ms": waits,
                    })
                );
            } else {
                println!("backoff\t{}", kind_word(b.kind));
                println!("base\t{} ms", b.base_ms);
                println!("max\t{} ms", b.max_ms);
                println!("jitter\tup to {}% off each wait", b.jitter_pct);
                let shown: Vec<String> = waits.iter().map(|w| format!("{w} ms")).collect();
                println!(
                    "waits\t{} (before attempts 2 to 6; a job of the default {} attempts waits {} ms in all before it is dead, less the jitter)",
                    shown.join(", "),
                    shardq_core::MAX_ATTEMPTS_DEFAULT,
                    sum
                );
            }
        }
        RetryAction::Set {
            data,
            backoff,
            base_ms,
            max_ms,
            jitter_pct,
        } => {
            let d = open(&data)?;
            let mut b = d.retry_policy()?;
            if let Some(k) = backoff {
                b.kind = match k.as_str() {
                    "exponential" => BackoffKind::Exponential,
                    "fixed" => BackoffKind::Fixed,
                    other => {
                        anyhow::bail!("--backoff {other:?}: expected `exponential` or `fixed`")
                    }
                };
            }
            if let Some(v) = base_ms {
                b.base_ms = v;
                // A cap below a new base follows it up.
                if max_ms.is_none() && b.max_ms < v {
                    b.max_ms = v;
                }
            }
            if let Some(v) = max_ms {
                b.max_ms = v;
            }
            if let Some(v) = jitter_pct {
                b.jitter_pct = v;
            }
            d.set_retry_policy(Some(&b))?;
            println!(
                "retry backoff: {} from {} ms up to {} ms, up to {}% jitter; workers and servers started from now use it",
                kind_word(b.kind),
                b.base_ms,
                b.max_ms,
                b.jitter_pct
            );
        }
        RetryAction::Clear { data } => {
            open(&data)?.set_retry_policy(None)?;
            println!("retry backoff: back to the default (100 ms doubling to 60 s, no jitter)");
        }
    }
    Ok(ExitCode::SUCCESS)
}
