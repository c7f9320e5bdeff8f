//! `shardq schedule set|apply|list|show|pause|resume|trigger|backfill|delete`:
//! recurring schedules (`shardq_core::schedule`). Glue: parse, call the
//! core's `ScheduleStore`, `trigger` and `backfill` on the data dir's
//! deployment, print. Workers (`shardq work`) and servers fire them.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use shardq_core::producer::ProducerOptions;
use shardq_core::schedule::{
    self, parse_time_ms, show_time, Schedule, ScheduleFile, ScheduleSpec, ScheduleStore,
    ScheduleView, TimeArg, When,
};

use crate::cmd_retry::open;

#[derive(Debug, Args)]
pub struct DataArg {
    /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
    #[arg(long, value_name = "DIR")]
    data: PathBuf,
    /// One JSON document instead of lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct SetArgs {
    #[command(flatten)]
    common: DataArg,
    /// The schedule's id (ASCII letters, digits and - _ . :).
    id: String,
    /// The key its jobs are enqueued for (the schedule runs on that key's
    /// shard, and moves with it).
    #[arg(long)]
    key: String,
    /// A cron expression: 5 fields (minute hour day month weekday) or 6
    /// with seconds first; names (MON, JAN) and ranges allowed.
    #[arg(long, value_name = "EXPR", conflicts_with = "every")]
    cron: Option<String>,
    /// The IANA time zone of the cron expression (default UTC).
    #[arg(long, value_name = "ZONE", requires = "cron")]
    tz: Option<String>,
    /// A fixed interval (at least 1s), anchored at --start (else the Unix
    /// epoch): 30s, 5m, 1h.
    #[arg(long, value_name = "DURATION")]
    every: Option<String>,
    /// The payload of every job (default empty).
    #[arg(long, value_name = "P", conflicts_with = "payload_file")]
    payload: Option<String>,
    /// Read the payload from a file (UTF-8 text).
    #[arg(long, value_name = "F")]
    payload_file: Option<PathBuf>,
    /// While the previous job is live: skip (no tick while it is queued or
    /// running; the default), one (keep at most one waiting), all.
    #[arg(long, value_name = "POLICY", default_value = "skip")]
    overlap: String,
    /// How late a tick may still fire after every worker was down; later
    /// ticks are counted missed (default 5m, at most 1d).
    #[arg(long, value_name = "DURATION")]
    catch_up: Option<String>,
    /// Spread each fire by up to this after its tick (the same delay in
    /// every process; at most 1h and at most the catch-up).
    #[arg(long, value_name = "DURATION")]
    jitter: Option<String>,
    /// No tick before this (RFC 3339, or ms since the epoch).
    #[arg(long, value_name = "TIME")]
    start: Option<String>,
    /// No tick after this (RFC 3339, or ms since the epoch).
    #[arg(long, value_name = "TIME")]
    end: Option<String>,
    /// Attempts of each job (1 to 1000; default 5).
    #[arg(long, value_name = "N")]
    max_attempts: Option<u32>,
}

#[derive(Debug, Subcommand)]
pub enum ScheduleAction {
    /// Create a schedule, or replace one (it keeps its state and whether
    /// it is paused). Every worker uses it within a second.
    Set(Box<SetArgs>),
    /// Set every schedule of a file in one change (YAML, or JSON when the
    /// name ends in .json): `schedules:` then, per id, the fields of
    /// `schedule set` (key, cron, tz, every, payload, overlap, catch_up,
    /// jitter, start, end, max_attempts). All of it is stored or nothing.
    Apply {
        #[command(flatten)]
        common: DataArg,
        /// The file of schedules.
        #[arg(long, value_name = "F")]
        file: PathBuf,
        /// Also delete every schedule the file does not name.
        #[arg(long)]
        prune: bool,
        /// Say what would change; store nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Every schedule: its key, when it ticks, its next and last fires,
    /// and its fired, skipped and missed counts.
    List {
        #[command(flatten)]
        common: DataArg,
    },
    /// One schedule in full.
    Show {
        #[command(flatten)]
        common: DataArg,
        /// The schedule's id.
        id: String,
    },
    /// Stop a schedule's ticks until it is resumed.
    Pause {
        #[command(flatten)]
        common: DataArg,
        /// The schedule's id.
        id: String,
    },
    /// Start a paused schedule again; the ticks of its pause never fire.
    Resume {
        #[command(flatten)]
        common: DataArg,
        /// The schedule's id.
        id: String,
    },
    /// Enqueue one job of the schedule now (outside its ticks; the
    /// overlap policy does not apply).
    Trigger {
        #[command(flatten)]
        common: DataArg,
        /// The schedule's id.
        id: String,
    },
    /// Enqueue the job of every tick in a past range, in order; a tick
    /// whose job was already stored (fired or backfilled within the
    /// schedule's dedup window: its catch-up, its jitter and 10 minutes) is
    /// not stored again.
    Backfill {
        #[command(flatten)]
        common: DataArg,
        /// The schedule's id.
        id: String,
        /// First time of the range (RFC 3339, or ms since the epoch).
        #[arg(long, value_name = "TIME")]
        from: String,
        /// Last time of the range (inclusive).
        #[arg(long, value_name = "TIME")]
        to: String,
    },
    /// Delete a schedule (jobs it enqueued stay).
    Delete {
        #[command(flatten)]
        common: DataArg,
        /// The schedule's id.
        id: String,
    },
}

fn schedule_of(a: &SetArgs) -> anyhow::Result<Schedule> {
    let payload = match (&a.payload, &a.payload_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
            String::from_utf8(bytes).map_err(|_| {
                anyhow::anyhow!(
                    "--payload-file {}: a schedule's payload is UTF-8 text, and this file is not",
                    f.display()
                )
            })?
        }
        (None, None) => String::new(),
    };
    if a.cron.is_none() && a.every.is_none() {
        bail!("give when the schedule ticks: --cron EXPR [--tz ZONE] or --every DURATION");
    }
    let spec = ScheduleSpec {
        key: a.key.clone(),
        cron: a.cron.clone(),
        tz: a.tz.clone(),
        every: a.every.clone(),
        payload,
        overlap: Some(a.overlap.clone()),
        catch_up: a.catch_up.clone(),
        jitter: a.jitter.clone(),
        start: a.start.clone().map(TimeArg::Text),
        end: a.end.clone().map(TimeArg::Text),
        max_attempts: a.max_attempts,
    };
    Ok(spec.build(&a.id)?)
}

fn when_text(w: &When) -> String {
    match w {
        When::Cron { expr, tz } => format!("cron {expr:?} in {tz}"),
        When::Every { every_ms } => format!("every {every_ms} ms"),
    }
}

fn view_line(v: &ScheduleView) -> String {
    let next = match (v.schedule.paused, v.next_fire_ms) {
        (true, _) => "paused".to_string(),
        (false, Some(t)) => format!("next {}", show_time(t)),
        (false, None) => "ended".to_string(),
    };
    let last = v
        .state
        .last
        .as_ref()
        .map_or("never fired".to_string(), |l| {
            format!(
                "last {} (job {} on {})",
                show_time(l.tick_ms),
                l.job,
                l.shard
            )
        });
    format!(
        "{}\tkey {}\t{}\toverlap {}\t{next}\t{last}\tfired {} skipped {} missed {}",
        v.id,
        v.schedule.key,
        when_text(&v.schedule.when),
        v.schedule.overlap.name(),
        v.state.fired,
        v.state.skipped,
        v.state.missed
    )
}

pub fn run(action: ScheduleAction) -> anyhow::Result<ExitCode> {
    match action {
        ScheduleAction::Set(a) => {
            let s = schedule_of(&a)?;
            let d = open(&a.common.data)?;
            let now = d.clock().now_ms();
            let max = d.payload_bytes_max(&crate::open_options());
            let stored = ScheduleStore::put(&*d.maps(), &a.id, &s, now, max)?;
            if a.common.json {
                println!("{}", serde_json::json!({"id": a.id, "schedule": stored}));
            } else {
                println!(
                    "schedule {} set: key {}, {}, overlap {}, catch-up {} ms",
                    a.id,
                    stored.key,
                    when_text(&stored.when),
                    stored.overlap.name(),
                    stored.catch_up_ms
                );
            }
        }
        ScheduleAction::Apply {
            common,
            file,
            prune,
            dry_run,
        } => apply(&common, &file, prune, dry_run)?,
        ScheduleAction::List { common } => {
            let views = ScheduleStore::views(&*open(&common.data)?.maps())?;
            if common.json {
                println!("{}", serde_json::json!({ "schedules": views }));
            } else if views.is_empty() {
                println!("no schedules");
            } else {
                for v in &views {
                    println!("{}", view_line(v));
                }
            }
        }
        ScheduleAction::Show { common, id } => {
            let d = open(&common.data)?;
            ScheduleStore::get(&*d.maps(), &id)?;
            let views = ScheduleStore::views(&*d.maps())?;
            let Some(v) = views.into_iter().find(|v| v.id == id) else {
                bail!("schedule {id:?} was deleted meanwhile");
            };
            if common.json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                println!("{}", view_line(&v));
            }
        }
        ScheduleAction::Pause { common, id } => pause(&common, &id, true)?,
        ScheduleAction::Resume { common, id } => pause(&common, &id, false)?,
        ScheduleAction::Trigger { common, id } => {
            let d = open(&common.data)?;
            let s = ScheduleStore::get(&*d.maps(), &id)?;
            let mut producer = producer(&d)?;
            let p = schedule::trigger(&mut producer, &id, &s, d.clock().now_ms())?;
            d.flush()?;
            if common.json {
                println!(
                    "{}",
                    serde_json::json!({"id": id, "shard": p.shard, "job": p.id.0})
                );
            } else {
                println!("schedule {id} triggered: job {} on {}", p.id, p.shard);
            }
        }
        ScheduleAction::Backfill {
            common,
            id,
            from,
            to,
        } => {
            let (from, to) = (parse_time_ms("from", &from)?, parse_time_ms("to", &to)?);
            if from > to {
                bail!("invalid --from {from} ms: it is after --to ({to} ms)");
            }
            let d = open(&common.data)?;
            let s = ScheduleStore::get(&*d.maps(), &id)?;
            let mut producer = producer(&d)?;
            let now = d.clock().now_ms();
            let placed = schedule::backfill(&mut producer, &id, &s, from, to, now)?;
            d.flush()?;
            let stored = placed.iter().filter(|(_, p)| !p.duplicate).count();
            let already = placed.len() - stored;
            if common.json {
                println!(
                    "{}",
                    serde_json::json!({"id": id, "ticks": placed.len(), "stored": stored, "already_stored": already})
                );
            } else {
                println!(
                    "schedule {id}: {} ticks from {} to {}: {stored} jobs stored, {already} already stored",
                    placed.len(),
                    show_time(from),
                    show_time(to)
                );
            }
        }
        ScheduleAction::Delete { common, id } => {
            let existed = ScheduleStore::delete(&*open(&common.data)?.maps(), &id)?;
            if common.json {
                println!("{}", serde_json::json!({"id": id, "deleted": existed}));
            } else if existed {
                println!("schedule {id} deleted");
            } else {
                println!("no schedule {id}: nothing to delete");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A producer for a trigger or a backfill (each sets the dedup window to
/// its schedule's).
fn producer(
    d: &shardq_deploy::Deployment,
) -> anyhow::Result<shardq_core::producer::Producer<dyn shardq_core::reshard::ReshardBackend>> {
    Ok(d.producer(ProducerOptions::default())?)
}

fn pause(common: &DataArg, id: &str, paused: bool) -> anyhow::Result<()> {
    let d = open(&common.data)?;
    let s = ScheduleStore::set_paused(&*d.maps(), id, paused, d.clock().now_ms())?;
    let word = if paused { "paused" } else { "resumed" };
    if common.json {
        println!("{}", serde_json::json!({"id": id, "schedule": s}));
    } else {
        println!("schedule {id} {word}");
    }
    Ok(())
}

/// Reads a file of schedules: JSON when its name ends in `.json`, else
/// YAML; an unknown field or a missing key is refused naming the file.
fn read_schedule_file(file: &std::path::Path) -> anyhow::Result<ScheduleFile> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let parsed = if file.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{e}"))
    } else {
        serde_yaml_ng::from_str(&text).map_err(|e| anyhow::anyhow!("{e}"))
    };
    parsed.with_context(|| format!("{}: not a file of schedules", file.display()))
}

/// Ids listed per kind of change by `apply` without `--json`.
const LISTED_MAX: usize = 20;

fn apply(
    common: &DataArg,
    file: &std::path::Path,
    prune: bool,
    dry_run: bool,
) -> anyhow::Result<()> {
    let wanted = read_schedule_file(file)?
        .build()
        .with_context(|| format!("in {}", file.display()))?;
    let d = open(&common.data)?;
    let now = d.clock().now_ms();
    let max = d.payload_bytes_max(&crate::open_options());
    let applied = ScheduleStore::apply(&*d.maps(), &wanted, prune, dry_run, now, max)?;
    if common.json {
        println!(
            "{}",
            serde_json::json!({"dry_run": dry_run, "applied": applied})
        );
    } else {
        let verb = if dry_run {
            " (dry run: nothing stored)"
        } else {
            ""
        };
        println!(
            "{}: added {}, changed {}, unchanged {}, deleted {}{verb}",
            file.display(),
            applied.added.len(),
            applied.changed.len(),
            applied.unchanged.len(),
            applied.removed.len()
        );
        for (word, ids) in [
            ("added", &applied.added),
            ("changed", &applied.changed),
            ("deleted", &applied.removed),
        ] {
            for id in ids.iter().take(LISTED_MAX) {
                println!("  {word} {id}");
            }
            if ids.len() > LISTED_MAX {
                println!(
                    "  ... and {} more {word} (--json lists all)",
                    ids.len() - LISTED_MAX
                );
            }
        }
    }
    Ok(())
}
