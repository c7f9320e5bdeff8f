//! `shardq batch open|close|show`: jobs grouped under one id, with
//! callbacks that run once when the batch is complete, succeeded, or at its
//! first dead job. Jobs join with `shardq enqueue --batch @N`. Glue: parse,
//! call `shardq-deploy`, print; the semantics are the core's
//! (`shardq_core::workflow`, `batch.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Subcommand;
use shardq_core::workflow::{parse_batch_id, CallbackKind, NewBatch};
use shardq_server::api::batch_value;

use crate::cmd_retry::open;

#[derive(Debug, Subcommand)]
pub enum BatchAction {
    /// Open a batch and print its id, @N. Add jobs with `shardq enqueue
    /// --batch @N` (a job of the batch may add more: its handler gets
    /// SHARDQ_BATCH), then `batch close`. Each callback is a job on --key,
    /// enqueued once: --on-complete when every job of the closed batch has
    /// ended, --on-success when every one was acked, --on-death at the
    /// first dead job. Its handler gets SHARDQ_BATCH and
    /// SHARDQ_BATCH_CALLBACK; `batch show @N --json` has the counts and
    /// the jobs' results. A worker or an owning server must run.
    Open {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The key the callbacks are enqueued on.
        #[arg(long)]
        key: String,
        /// Payload of the callback run when every job has ended, however.
        #[arg(long, value_name = "PAYLOAD")]
        on_complete: Option<String>,
        /// Payload of the callback run when every job was acked.
        #[arg(long, value_name = "PAYLOAD")]
        on_success: Option<String>,
        /// Payload of the callback run at the batch's first dead job.
        #[arg(long, value_name = "PAYLOAD")]
        on_death: Option<String>,
        /// Attempts of each callback (default: the key's retry policy).
        #[arg(long, value_name = "N")]
        max_attempts: Option<u32>,
        /// One JSON object instead of the id.
        #[arg(long)]
        json: bool,
    },
    /// Close a batch: from now on only its own jobs add to it, and its
    /// complete and success callbacks run once every job has ended.
    Close {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The batch, @N.
        id: String,
        /// One JSON object instead of a line.
        #[arg(long)]
        json: bool,
    },
    /// Show a batch: open or closed, its counts, its callbacks (and the
    /// jobs they ran as), and each job's outcome (`--json`: and result).
    Show {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The batch, @N.
        id: String,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(action: BatchAction) -> anyhow::Result<ExitCode> {
    match action {
        BatchAction::Open {
            data,
            key,
            on_complete,
            on_success,
            on_death,
            max_attempts,
            json,
        } => {
            let d = open(&data)?;
            let callbacks: BTreeMap<CallbackKind, Vec<u8>> = [
                (CallbackKind::Complete, on_complete),
                (CallbackKind::Success, on_success),
                (CallbackKind::Death, on_death),
            ]
            .into_iter()
            .filter_map(|(k, p)| p.map(|p| (k, p.into_bytes())))
            .collect();
            let max_attempts = max_attempts.unwrap_or_else(|| match d.retry_settings() {
                Ok(r) => r.for_key(&key).max_attempts,
                Err(_) => shardq_core::retry::RetryPolicy::default().max_attempts,
            });
            let (n, _) = d
                .open_batch(&NewBatch {
                    key,
                    max_attempts,
                    callbacks,
                    dedup_id: None,
                })
                .context("the batch was NOT opened")?;
            if json {
                println!("{}", serde_json::json!({ "id": format!("@{n}") }));
            } else {
                println!("@{n}");
            }
        }
        BatchAction::Close { data, id, json } => {
            let n = parse_batch_id(&id)?;
            let before = open(&data)?
                .close_batch(n)
                .with_context(|| format!("closing batch @{n}"))?;
            let was_open = before.batch.as_ref().is_some_and(|b| b.open);
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "id": format!("@{n}"), "closed": was_open })
                );
            } else if was_open {
                println!("closed @{n}");
            } else {
                println!("@{n} was closed already");
            }
        }
        BatchAction::Show { data, id, json } => {
            let n = parse_batch_id(&id)?;
            let Some(w) = open(&data)?
                .batch(n)
                .with_context(|| format!("reading batch @{n}"))?
            else {
                eprintln!("shardq: no batch @{n} here: it completed longer ago than batches are kept (a day), or never existed");
                return Ok(ExitCode::from(1));
            };
            print_batch(n, &w, json);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints batch `n` (`--json`: as `GET /v1/batches/@N` answers), for
/// `batch show` and `job show @N`.
pub(crate) fn print_batch(n: u64, w: &shardq_core::workflow::Waiting, json: bool) {
    let v = batch_value(n, w);
    if json {
        println!("{v}");
        return;
    }
    println!("id\t@{n}");
    println!("state\t{}", v["state"].as_str().unwrap_or(""));
    println!("callback key\t{}", shardq_core::job::shown_key(&w.key));
    let c = &v["counts"];
    println!(
        "jobs\t{} ({} pending, {} completed, {} dead, {} other)",
        c["jobs"], c["pending"], c["completed"], c["dead"], c["other"]
    );
    let complete = v["state"] == "complete";
    for (kind, cb) in v["callbacks"].as_object().into_iter().flatten() {
        let fired = match (cb["fired"].as_str(), cb["refused"].as_str()) {
            (Some(at), _) => at.to_string(),
            (None, Some(why)) => format!("refused for good: {why}"),
            (None, None) if complete => "did not fire".to_string(),
            (None, None) => "not yet".to_string(),
        };
        println!("on {kind}\t{fired}");
    }
    println!("JOB\tOUTCOME\tAT");
    for d in v["jobs"].as_array().into_iter().flatten() {
        println!(
            "{}\t{}\t{}",
            d["id"].as_str().unwrap_or(""),
            d["outcome"].as_str().unwrap_or("-"),
            d.get("at").and_then(|a| a.as_str()).unwrap_or("")
        );
    }
}
