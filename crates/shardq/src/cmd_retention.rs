//! `shardq retention show|set|clear`: how many finished jobs each shard
//! keeps and for how long (what `jobs --key` lists as finished), a setting
//! kept beside the map like the retry policies. Glue: parse, check, call
//! `shardq-deploy`, print.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::cmd_retry::open;
use clap::Subcommand;
use shardq_core::Retention;

#[derive(Debug, Subcommand)]
pub enum RetentionAction {
    /// Show how many finished jobs each shard keeps, and how long.
    Show {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Change the retention: the options given replace those fields.
    /// Workers and servers started afterwards use it (restart running ones).
    Set {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Newest finished jobs kept per shard (0 keeps none; at most 100000).
        #[arg(long, value_name = "N")]
        finished_jobs: Option<usize>,
        /// Oldest a kept finished job may be, in ms (default a day).
        #[arg(long, value_name = "MS")]
        finished_age_ms: Option<u64>,
    },
    /// Go back to the default (1000 finished jobs per shard, for a day).
    Clear {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
    },
}

fn line(r: &Retention) -> String {
    format!(
        "the newest {} finished jobs per shard, none older than {} ms",
        r.finished_jobs, r.finished_age_ms
    )
}

pub fn run(action: RetentionAction) -> anyhow::Result<ExitCode> {
    match action {
        RetentionAction::Show { data, json } => {
            let r = open(&data)?.retention()?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("finished jobs kept: {}", line(&r));
            }
        }
        RetentionAction::Set {
            data,
            finished_jobs,
            finished_age_ms,
        } => {
            let d = open(&data)?;
            let mut r = d.retention()?;
            if let Some(n) = finished_jobs {
                r.finished_jobs = n;
            }
            if let Some(ms) = finished_age_ms {
                r.finished_age_ms = ms;
            }
            d.set_retention(&r)?;
            println!(
                "finished jobs kept: {}; workers and servers started from now use it",
                line(&r)
            );
        }
        RetentionAction::Clear { data } => {
            let d = open(&data)?;
            d.set_retention(&Retention::default())?;
            println!(
                "finished jobs kept: back to the default, {}",
                line(&Retention::default())
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
