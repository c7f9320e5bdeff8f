//! Jobs one at a time, for operators: `job show ID`, `job cancel ID`,
//! `jobs --key KEY` and `key resume KEY`, over any deployment (embedded or
//! Redis), in the same words and `--json` forms as `GET /v1/jobs/{id}`,
//! `DELETE /v1/jobs/{id}`, `GET /v1/keys/{key}/jobs` and
//! `POST /v1/keys/{key}/resume`. Glue: parse, call the backend, print.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Subcommand;
use serde_json::json;
use shardq_core::{CancelOutcome, JobId, JobInfo, JobState, KEY_JOBS_MAX};
use shardq_deploy::{Deployment, JobLookup};
use shardq_server::api::{back_off_value, dependent_value, finished_value, job_value};

/// Jobs `jobs` lists when `--limit` is not given.
const JOBS_LIMIT_DEFAULT: usize = 100;
/// Finished jobs `jobs` lists when `--finished` is not given.
const FINISHED_DEFAULT: usize = 20;
/// Payload bytes `job show` prints as text before cutting (all of it with
/// `--json`).
const SHOWN_PAYLOAD_BYTES: usize = 4096;

#[derive(Debug, Subcommand)]
pub enum JobAction {
    /// Show a live job (queued, delayed, running or dead): its key, state,
    /// attempts, times, last failure reason and payload. A job that
    /// finished, was cancelled or moved away with its key is not live:
    /// exit 1.
    Show {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The job's id, SHARD:ID, as `enqueue`, `dead list` and the API
        /// give it, or a dependent's @N (`enqueue --after`): its state and
        /// each dependency's outcome and result.
        id: String,
        /// One JSON object (the API's `Job`) instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job: a queued, delayed or dead one is deleted and never
    /// runs; a running one's run is asked to stop (its ack, fail and extend
    /// are refused from now, so its worker stops the handler) and the job is
    /// deleted when the run ends, at the latest when its job lease lapses;
    /// the key's next job waits for that, so no two runs overlap. A job
    /// whose key is moving is refused until the move is done (exit 75); no
    /// live job with the id: exit 1.
    Cancel {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The job's id, SHARD:ID, or a dependent's @N (cancelled while it
        /// waits; once released, its job).
        id: String,
        /// One JSON object instead of a line.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeyAction {
    /// Lift a handler's back-off of a key: the key's jobs its handler put
    /// back with a back-off (a command handler's exit 75 with
    /// `shardq-backoff: MS`, a stdio or HTTP worker's `backoff_ms`) are due
    /// now, and the key starts again at its shard owner's next claim,
    /// whichever process runs it. Only a back-off is lifted: a delay its
    /// producer gave (`enqueue --delay-ms`), a retry's wait after a failed
    /// attempt and a group's hold (`shardq group resume`) stay. A key that
    /// no back-off holds: nothing changes, exit 0 ("resumed": false with
    /// --json). A key moving to another shard now: nothing changes, exit 3
    /// (the move carries its jobs with their waits; its new shard keeps a
    /// back-off's as a plain delay).
    Resume {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The routing key (on the shard the published map routes it to).
        key: String,
        /// One JSON object (as `POST /v1/keys/{key}/resume`) instead of a line.
        #[arg(long)]
        json: bool,
    },
}

/// `shardq key resume`.
pub fn key(action: KeyAction) -> anyhow::Result<ExitCode> {
    let KeyAction::Resume { data, key, json } = action;
    shardq_core::validate_key(&key).with_context(|| format!("key {key:?}"))?;
    let deployment = Deployment::open(&data, &crate::open_options())?;
    let (shard, done) = deployment
        .resume_key(&key)
        .with_context(|| format!("resuming key {key:?}"))?;
    let shown = shardq_core::job::shown_key(&key);
    let lifted = match done {
        shardq_core::KeyResume::Resumed(hold) => Some(hold),
        shardq_core::KeyResume::NotHeld => None,
        shardq_core::KeyResume::Moving => {
            if json {
                println!(
                    "{}",
                    json!({ "key": key, "shard": shard, "resumed": false, "state": "moving" })
                );
            } else {
                eprintln!(
                    "shardq: key {shown} is moving from shard {shard} to another shard now; nothing changed (the move carries its jobs with their waits, which its new shard keeps as plain delays)"
                );
            }
            return Ok(ExitCode::from(3));
        }
    };
    if json {
        println!(
            "{}",
            json!({
                "key": key,
                "shard": shard,
                "resumed": lifted.is_some(),
                "back_off": back_off_value(&shard, lifted.as_ref()),
            })
        );
        return Ok(ExitCode::SUCCESS);
    }
    match lifted {
        Some(hold) => {
            let ids: Vec<String> = (hold.jobs.iter())
                .map(|id| format!("{shard}:{}", id.0))
                .collect();
            println!(
                "resumed key {shown} on {shard}: {} held by a back-off until {} ({}) due now",
                ids.join(", "),
                hold.until_ms,
                relative(hold.until_ms, now_ms())
            );
        }
        None => println!(
            "key {shown} on {shard}: no back-off holds it; nothing changed (a delay or a retry's wait is not lifted: `shardq jobs --key` shows what its jobs wait for)"
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// `shardq jobs`: a key's live jobs.
#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
    #[arg(long, value_name = "DIR")]
    data: PathBuf,
    /// The routing key whose jobs to list (on the shard it routes to).
    #[arg(long)]
    key: String,
    /// At most this many jobs (1 to 1000).
    #[arg(long, default_value_t = JOBS_LIMIT_DEFAULT)]
    limit: usize,
    /// Also the key's newest finished jobs (acked or cancelled, kept for
    /// `shardq retention`), at most this many (0 to 1000).
    #[arg(long, value_name = "N", default_value_t = FINISHED_DEFAULT)]
    finished: usize,
    /// One JSON object (as `GET /v1/keys/{key}/jobs`) instead of a table.
    #[arg(long)]
    json: bool,
}

/// `SHARD:ID`, the shard checked against the map.
fn parse_id(deployment: &Deployment, s: &str) -> anyhow::Result<(String, JobId)> {
    let bad = || anyhow::anyhow!("job id {s:?}: expected SHARD:ID, e.g. shard-2:17");
    let (shard, id) = s.rsplit_once(':').ok_or_else(bad)?;
    let id: u64 = id.parse().map_err(|_| bad())?;
    let all = deployment.shard_names()?;
    if !all.iter().any(|n| n == shard) {
        bail!(
            "job id {s:?}: unknown shard {shard:?}: the map has {}",
            all.join(", ")
        );
    }
    Ok((shard.to_string(), JobId(id)))
}

/// A dependent's id, `@N`, if `s` is one.
fn dependent_id(s: &str) -> anyhow::Result<Option<u64>> {
    match s.strip_prefix('@') {
        None => Ok(None),
        Some(n) => Ok(Some(n.parse().map_err(|_| {
            anyhow::anyhow!("job id {s:?}: a dependent's id is @N, e.g. @17")
        })?)),
    }
}

/// `job show @N`: the dependent, each dependency's outcome and result,
/// and the job it was released as.
fn show_dependent(deployment: &Deployment, n: u64, json: bool) -> anyhow::Result<ExitCode> {
    let Some(w) = deployment
        .dependent(n)
        .with_context(|| format!("reading dependent @{n}"))?
    else {
        eprintln!("shardq: no dependent @{n} here: it ended longer ago than dependents are kept (a day), or never existed");
        return Ok(ExitCode::from(1));
    };
    if w.batch.is_some() {
        crate::cmd_batch::print_batch(n, &w, json);
        return Ok(ExitCode::SUCCESS);
    }
    let v = dependent_value(n, &w);
    if json {
        println!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("id\t@{n}");
    println!("key\t{}", shardq_core::job::shown_key(&w.key));
    println!("state\t{}", v["state"].as_str().unwrap_or(""));
    println!(
        "on dependency failure\t{}",
        v["on_dependency_failure"].as_str().unwrap_or("")
    );
    if let Some(r) = &w.released {
        println!("released as\t{r}");
    }
    if let Some(r) = &w.reason {
        println!("reason\t{r}");
    }
    println!("DEPENDENCY\tOUTCOME\tAT\tRESULT");
    for d in v["after"].as_array().into_iter().flatten() {
        let result = match (d.get("result"), d.get("result_b64")) {
            (Some(t), _) => format!("{t}"),
            (None, Some(_)) => "(bytes; --json gives them in base64)".into(),
            _ if d.get("result_dropped").is_some() => {
                "(dropped: over the 1 MiB a dependent collects)".into()
            }
            _ => String::new(),
        };
        println!(
            "{}\t{}\t{}\t{result}",
            d["id"].as_str().unwrap_or(""),
            d["outcome"].as_str().unwrap_or("-"),
            d.get("at").and_then(|a| a.as_str()).unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `job cancel @N`: a waiting dependent ends as cancelled; a released one's
/// job is cancelled.
fn cancel_dependent(deployment: &Deployment, n: u64, json: bool) -> anyhow::Result<ExitCode> {
    let (before, job) = deployment
        .cancel_dependent(n)
        .with_context(|| format!("cancelling dependent @{n}"))?;
    let Some(w) = before else {
        bail!("no dependent @{n} here: it ended longer ago than dependents are kept (a day), or never existed");
    };
    let (word, code, text) = match (w.state, &job) {
        (shardq_core::workflow::WaitState::Waiting, _) => {
            ("cancelled", 0, format!("cancelled @{n} while it waited"))
        }
        (shardq_core::workflow::WaitState::Released, Some((at, acted, outcome))) => match outcome {
            CancelOutcome::Cancelled | CancelOutcome::Stopping => (
                "cancelled",
                0,
                format!("cancelled @{n}'s job {at}:{}", acted.0),
            ),
            _ => (
                "not_cancelled",
                3,
                format!("@{n} was released as {at}:{}, which is running, moving or finished: not cancelled", acted.0),
            ),
        },
        _ => ("ended", 3, format!("@{n} has ended and is not cancelled again")),
    };
    if json {
        println!("{}", json!({ "id": format!("@{n}"), "outcome": word }));
    } else if code == 0 {
        println!("{text}");
    } else {
        eprintln!("shardq: {text}");
    }
    Ok(ExitCode::from(code))
}

fn state_word(s: JobState) -> &'static str {
    match s {
        JobState::Queued => "queued",
        JobState::Delayed => "delayed",
        JobState::Running => "running",
        JobState::Dead => "dead",
    }
}

/// `ms` as a time relative to `now`: "12.3 s ago", "in 4.0 s".
fn relative(ms: u64, now: u64) -> String {
    let secs = |d: u64| format!("{:.1} s", d as f64 / 1000.0);
    if ms > now {
        format!("in {}", secs(ms - now))
    } else {
        format!("{} ago", secs(now - ms))
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn print_finished(shard: &str, f: &shardq_core::FinishedJob) {
    let now = now_ms();
    println!("id\t{shard}:{}", f.id.0);
    println!("key\t{}", shardq_core::job::shown_key(&f.key));
    println!(
        "state\t{}",
        match f.outcome {
            shardq_core::Finish::Completed => "completed",
            shardq_core::Finish::Cancelled => "cancelled",
        }
    );
    println!("attempts\t{}", f.attempts);
    println!(
        "finished\t{} ({})",
        f.finished_ms,
        relative(f.finished_ms, now)
    );
    let first = (f.attempts as usize).saturating_sub(f.attempt_starts_ms.len()) + 1;
    for (n, at) in f.attempt_starts_ms.iter().enumerate() {
        println!(
            "attempt {}\tstarted {at} ({})",
            first + n,
            relative(*at, now)
        );
    }
    if let Some(r) = &f.reason {
        println!("reason\t{}", shardq_core::job::shown_key(r));
    }
    if let Some(b) = &f.result {
        match std::str::from_utf8(b) {
            Ok(text) if text.len() <= SHOWN_PAYLOAD_BYTES => println!("result\t{text:?}"),
            Ok(text) => println!(
                "result\t{:?}... ({} bytes; --json shows all)",
                shardq_core::job::cut_at_char(text, SHOWN_PAYLOAD_BYTES),
                b.len()
            ),
            Err(_) => println!(
                "result\t{} bytes, not UTF-8 (--json gives them in base64)",
                b.len()
            ),
        }
    }
}

fn print_job(shard: &str, j: &JobInfo) {
    let now = now_ms();
    println!("id\t{shard}:{}", j.id.0);
    println!("key\t{}", shardq_core::job::shown_key(&j.key));
    println!("state\t{}", state_word(j.state));
    println!("attempts\t{} of {}", j.attempts, j.max_attempts);
    println!(
        "created\t{} ({})",
        j.created_ms,
        relative(j.created_ms, now)
    );
    if j.state != JobState::Running && j.state != JobState::Dead {
        println!(
            "not before\t{} ({})",
            j.not_before_ms,
            relative(j.not_before_ms, now)
        );
    }
    if let Some((fence, until)) = j.run {
        if until == u64::MAX {
            println!("run\tfence {fence}");
        } else {
            println!(
                "run\tfence {fence}, job lease ends {}",
                relative(until, now)
            );
        }
    }
    // The times kept are those of the last attempts (a job moved with its
    // key keeps its count, not its times): numbered from the end.
    let made = j.attempts as usize + usize::from(j.state == JobState::Running);
    let first = made.saturating_sub(j.attempt_starts_ms.len()) + 1;
    for (n, at) in j.attempt_starts_ms.iter().enumerate() {
        println!(
            "attempt {}\tstarted {at} ({})",
            first + n,
            relative(*at, now)
        );
    }
    if let Some(r) = &j.reason {
        println!("reason\t{}", shardq_core::job::shown_key(r));
    }
    if let Some(d) = &j.dedup_id {
        println!("dedup id\t{}", shardq_core::job::shown_key(d));
        if let Some(t) = shardq_core::schedule::ScheduleTick::of_dedup_id(d) {
            let how = if t.triggered { "triggered at" } else { "tick" };
            println!(
                "schedule\t{} {how} {}",
                t.id,
                shardq_core::schedule::show_time(t.tick_ms)
            );
        }
    }
    match std::str::from_utf8(&j.payload) {
        Ok(text) if text.len() <= SHOWN_PAYLOAD_BYTES => println!("payload\t{text:?}"),
        Ok(text) => println!(
            "payload\t{:?}... ({} bytes; --json shows all)",
            shardq_core::job::cut_at_char(text, SHOWN_PAYLOAD_BYTES),
            text.len()
        ),
        Err(_) => println!(
            "payload\t{} bytes, not UTF-8 (--json gives them in base64)",
            j.payload.len()
        ),
    }
}

/// Why an id that no shard remembers as moved is not live.
const NOT_LIVE_WHY: &str = "it finished or was cancelled longer ago than the retention keeps (`shardq retention show`), moved away with its key longer ago than its shard remembers, or never existed";

/// What `job show` and `job cancel` say of a job that left its shard with
/// its key.
fn moved_text(id: &str, key: &str, now: &str) -> String {
    format!(
        "job {id} is no longer on its shard: it moved with its key {} to shard {now}, where it runs or ran under a new id (`shardq jobs --key {}` lists the key's jobs there)",
        shardq_core::job::shown_key(key),
        shardq_core::job::shown_key(key)
    )
}

pub fn job(action: JobAction) -> anyhow::Result<ExitCode> {
    match action {
        JobAction::Show { data, id, json } => {
            let deployment = Deployment::open(&data, &crate::open_options())?;
            if let Some(n) = dependent_id(&id)? {
                return show_dependent(&deployment, n, json);
            }
            let (shard, job) = parse_id(&deployment, &id)?;
            // Live or finished here, or its copy after a move.
            let found = deployment
                .find_job(&shard, job)
                .with_context(|| format!("reading job {id}"))?;
            let shown = matches!(found, JobLookup::Live(..) | JobLookup::Finished(..));
            // A copy found after a move says so (as GET /v1/jobs/{id} does).
            let moved = |at: &str, found: JobId, key: &str, mut v: serde_json::Value| {
                if (at, found) != (shard.as_str(), job) {
                    v["moved"] = json!({ "key": key, "shard": at, "from": id });
                }
                v
            };
            match found {
                JobLookup::Live(at, j) if json => {
                    let (found, key) = (j.id, j.key.clone());
                    println!("{}", moved(&at, found, &key, job_value(&at, j)))
                }
                JobLookup::Live(at, j) => {
                    if (at.as_str(), j.id) != (shard.as_str(), job) {
                        println!("{id} moved with its key: its copy is {at}:{}", j.id.0);
                    }
                    print_job(&at, &j)
                }
                JobLookup::Finished(at, f) if json => {
                    let (found, key) = (f.id, f.key.clone());
                    println!("{}", moved(&at, found, &key, finished_value(&at, f)))
                }
                JobLookup::Finished(at, f) => {
                    if (at.as_str(), f.id) != (shard.as_str(), job) {
                        println!("{id} moved with its key: its copy is {at}:{}", f.id.0);
                    }
                    print_finished(&at, &f)
                }
                JobLookup::Moved { key, shard: now } if json => println!(
                    "{}",
                    json!({ "id": id, "live": false, "moved": { "key": key, "shard": now } })
                ),
                JobLookup::Moved { key, shard: now } => {
                    eprintln!("shardq: {}", moved_text(&id, &key, &now))
                }
                JobLookup::Unknown => eprintln!("shardq: no job {id} here: {NOT_LIVE_WHY}"),
            }
            Ok(if shown {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        JobAction::Cancel { data, id, json } => {
            let deployment = Deployment::open(&data, &crate::open_options())?;
            if let Some(n) = dependent_id(&id)? {
                return cancel_dependent(&deployment, n, json);
            }
            let (shard, job) = parse_id(&deployment, &id)?;
            // The job, or its copy when it moved with its key.
            let (at, acted, outcome) = deployment
                .cancel_job(&shard, job)
                .with_context(|| format!("cancelling job {id}"))?;
            let copy = ((at.as_str(), acted) != (shard.as_str(), job))
                .then(|| format!("{at}:{}", acted.0));
            let named = match &copy {
                Some(c) => format!("{c} (the copy of {id}, which moved with its key)"),
                None => id.clone(),
            };
            let (word, code, text) = match outcome {
                CancelOutcome::Cancelled => ("cancelled", 0, format!("cancelled {named}")),
                CancelOutcome::Stopping => (
                    "stopping",
                    0,
                    format!("cancelled {named}: its run is asked to stop (its results are refused from now), and the job is deleted when the run ends, at the latest when its job lease lapses"),
                ),
                CancelOutcome::Running => (
                    "running",
                    3,
                    format!("job {named} is running and was not cancelled: cancel it after its run ends"),
                ),
                CancelOutcome::Moving => (
                    "moving",
                    75,
                    format!("the key of job {id} is moving to another shard; nothing changed: cancel it by its id there once the move is done"),
                ),
                CancelOutcome::NotFound => match deployment.moved_job(&shard, job).unwrap_or(None) {
                    Some((key, now)) => ("moved", 1, moved_text(&id, &key, &now)),
                    None => (
                        "not_found",
                        1,
                        format!("no live job {id}: {NOT_LIVE_WHY}"),
                    ),
                },
            };
            if json {
                let mut v = json!({ "id": id, "cancelled": code == 0, "outcome": word });
                if let Some(c) = copy {
                    v["copy"] = json!(c);
                }
                println!("{v}");
            } else if code == 0 {
                println!("{text}");
            }
            if code != 0 && !json {
                eprintln!("shardq: {text}");
            }
            Ok(ExitCode::from(code))
        }
    }
}

/// `shardq jobs`: lists one key's jobs, back-off, finished jobs and waiting dependents.
pub fn jobs(args: JobsArgs) -> anyhow::Result<ExitCode> {
    if args.limit == 0 || args.limit > KEY_JOBS_MAX {
        bail!("--limit {}: out of range 1..={KEY_JOBS_MAX}", args.limit);
    }
    if args.finished > KEY_JOBS_MAX {
        bail!(
            "--finished {}: out of range 0..={KEY_JOBS_MAX}",
            args.finished
        );
    }
    shardq_core::validate_key(&args.key).with_context(|| format!("--key {:?}", args.key))?;
    let listing = read_key_listing(&args)?;
    if args.json {
        print_key_listing_json(&args.key, listing);
    } else {
        print_key_listing(&listing, args.finished);
    }
    Ok(ExitCode::SUCCESS)
}

/// What `shardq jobs` shows of one key.
struct KeyListing {
    /// The shard the key routes to now.
    shard: String,
    jobs: Vec<JobInfo>,
    hold: Option<shardq_core::KeyHold>,
    /// `(shard, job)`, from every shard.
    finished: Vec<(String, shardq_core::FinishedJob)>,
    /// `(number, dependent)`: the key's dependents still waiting.
    waiting: Vec<(u64, shardq_core::workflow::Waiting)>,
}

/// Reads the key's live jobs and back-off on its shard, its finished jobs and its waiting dependents.
fn read_key_listing(args: &JobsArgs) -> anyhow::Result<KeyListing> {
    let deployment = Deployment::open(&args.data, &crate::open_options())?;
    let router = shardq_route::Router::new(deployment.map()?)?;
    let shard = router.route(&args.key).to_string();
    let jobs = deployment
        .queue()
        .key_jobs(&shard, &args.key, args.limit)
        .with_context(|| format!("listing the jobs of key {:?} on {shard}", args.key))?;
    let hold = deployment
        .queue()
        .key_hold(&shard, &args.key)
        .with_context(|| format!("reading the back-off of key {:?} on {shard}", args.key))?;
    // The key's finished jobs from every shard (they stay where they
    // finished, before a move too); a shard that cannot be read leaves
    // the live jobs listed.
    let shards: Vec<String> = router.map().shards.iter().map(|s| s.name.clone()).collect();
    let finished = match args.finished {
        0 => Vec::new(),
        n => {
            let (list, failed) =
                shardq_core::backend::key_finished(&*deployment.queue(), &shards, &args.key, n);
            for (s, e) in failed {
                eprintln!(
                    "shardq: the finished jobs of key {:?} on {s} could not be read: {e}",
                    args.key
                );
            }
            list
        }
    };
    // Its dependents still waiting (on no shard yet).
    let waiting = deployment
        .waiting_of_key(&args.key)
        .with_context(|| format!("listing the waiting dependents of key {:?}", args.key))?;
    Ok(KeyListing {
        shard,
        jobs,
        hold,
        finished,
        waiting,
    })
}

/// `shardq jobs --json`: the listing as one JSON object.
fn print_key_listing_json(key: &str, listing: KeyListing) {
    let KeyListing {
        shard,
        jobs,
        hold,
        finished,
        waiting,
    } = listing;
    let list: Vec<serde_json::Value> = jobs.into_iter().map(|j| job_value(&shard, j)).collect();
    let finished: Vec<serde_json::Value> = finished
        .into_iter()
        .map(|(s, f)| finished_value(&s, f))
        .collect();
    let back_off = back_off_value(&shard, hold.as_ref());
    let waiting: Vec<serde_json::Value> = waiting
        .iter()
        .map(|(n, w)| dependent_value(*n, w))
        .collect();
    println!(
        "{}",
        json!({ "key": key, "shard": shard, "jobs": list, "back_off": back_off, "finished": finished, "waiting": waiting })
    );
}

/// `shardq jobs`: the listing as a table, then the back-off and the finished jobs.
fn print_key_listing(listing: &KeyListing, finished_max: usize) {
    let KeyListing {
        shard,
        jobs,
        hold,
        finished,
        waiting,
    } = listing;
    let now = now_ms();
    println!("ID\tSTATE\tATTEMPTS\tCREATED\tNOT_BEFORE\tREASON");
    for (n, w) in waiting {
        let left = w.after.iter().filter(|d| d.outcome.is_none()).count();
        println!(
            "@{n}\twaiting\t0/{}\t{}\t-\tafter {left} of {} dependencies",
            w.max_attempts,
            relative(w.created_ms, now),
            w.after.len()
        );
    }
    for j in jobs {
        println!(
            "{shard}:{}\t{}\t{}/{}\t{}\t{}\t{}",
            j.id.0,
            state_word(j.state),
            j.attempts,
            j.max_attempts,
            relative(j.created_ms, now),
            relative(j.not_before_ms, now),
            j.reason
                .as_deref()
                .map(shardq_core::job::shown_key)
                .unwrap_or_default()
        );
    }
    if let Some(h) = hold {
        println!();
        let ids: Vec<String> = h
            .jobs
            .iter()
            .map(|id| format!("{shard}:{}", id.0))
            .collect();
        println!(
            "BACK-OFF\t{} held by a handler's back-off until {} ({}): `shardq key resume` lifts it",
            ids.join(", "),
            h.until_ms,
            relative(h.until_ms, now)
        );
    }
    if finished_max > 0 {
        print_key_finished(finished, now);
    }
}

/// The `FINISHED` table of `shardq jobs --finished N`.
fn print_key_finished(finished: &[(String, shardq_core::FinishedJob)], now: u64) {
    println!();
    println!("FINISHED\tOUTCOME\tATTEMPTS\tAT\tLAST_FAILURE");
    if finished.is_empty() {
        println!("(no shard keeps a finished job of this key: none finished within the retention, see `shardq retention show`)");
    }
    for (s, f) in finished {
        println!(
            "{s}:{}\t{}\t{}\t{}\t{}",
            f.id.0,
            match f.outcome {
                shardq_core::Finish::Completed => "completed",
                shardq_core::Finish::Cancelled => "cancelled",
            },
            f.attempts,
            relative(f.finished_ms, now),
            f.reason
                .as_deref()
                .map(shardq_core::job::shown_key)
                .unwrap_or_default()
        );
    }
}
