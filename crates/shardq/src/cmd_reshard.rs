//! Live resharding commands: add-shard, remove-shard, set-weight, pin, unpin,
//! rebalance, hot.
//!
//! Glue over `shardq_core::reshard`: the operations record a target map, and
//! `rebalance` (run by remove-shard, set-weight, pin and unpin too) moves the
//! keys with their backlogs. Nothing here changes routing by itself.
//! Works on embedded and Redis data dirs alike (`shardq_deploy` opens either).

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Subcommand;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use shardq_core::reshard::{
    self, RebalanceEvent, RebalanceOptions, RebalanceReport, BATCH_DEFAULT,
    DRAIN_TIMEOUT_MS_DEFAULT,
};
use shardq_core::reshard::{MapStore, ReshardBackend};
use shardq_deploy::Deployment;
use std::sync::Arc;

/// Most keys `hot` lists per shard.
const HOT_TOP_MAX: usize = 10_000;

#[derive(Debug, Clone, clap::Args)]
pub struct MoveOpts {
    /// Keys moved per batch.
    #[arg(long, default_value_t = BATCH_DEFAULT)]
    batch: usize,
    /// Longest wait for one batch: for the runs in flight of its keys (or, on a backend that cannot move backlogs, for its keys to drain), in ms.
    #[arg(long, default_value_t = DRAIN_TIMEOUT_MS_DEFAULT)]
    drain_timeout_ms: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// CPU niceness of the move (0 to 19): the copy yields the CPU to the
    /// processes serving producers and workers, so a move costs their calls
    /// less; it takes longer on a busy machine. 0 keeps this process's own.
    #[arg(long, default_value_t = NICE_DEFAULT, value_parser = clap::value_parser!(u8).range(0..=19))]
    nice: u8,
}

/// Default niceness of a move run from the command line.
const NICE_DEFAULT: u8 = 10;

/// Lowers this thread's CPU priority by `nice` (Linux: per thread), so a
/// long copy runs in the background of the processes serving producers. A
/// refusal costs nothing but the effect.
fn lower_priority(nice: u8) {
    if nice == 0 {
        return;
    }
    // SAFETY: plain system calls on this thread's own id; no memory is
    // shared with them.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        let _ = libc::setpriority(
            libc::PRIO_PROCESS,
            tid,
            now.max(0).saturating_add(i32::from(nice)).min(19),
        );
    }
}

#[derive(Debug, Subcommand)]
pub enum ReshardCommand {
    /// Deploy a new shard as `warming`: visible in status, receiving nothing
    /// until `rebalance` makes it active and moves its keys to it.
    AddShard {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Name of the new shard.
        name: String,
        /// Relative capacity.
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Where the shard lives: `file:` or none in an embedded data dir,
        /// `redis://host:port/db` or `redis+cluster://host:port,...` (required)
        /// in a Redis one.
        #[arg(long)]
        url: Option<String>,
    },
    /// Move every key whose owner changes to the pending target, with its
    /// backlog, without breaking any key's order (pin; per batch: seal, wait
    /// for the run in flight, copy, switch). `status` shows its progress.
    Rebalance {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Print the plan (keys with work that would move) and change nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        opts: MoveOpts,
    },
    /// Drain a shard's keys to their new owners, then drop it from the map.
    RemoveShard {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The shard to remove.
        name: String,
        #[command(flatten)]
        opts: MoveOpts,
    },
    /// Change a shard's weight and move the keys that change owner.
    SetWeight {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The shard.
        name: String,
        /// New weight.
        weight: u32,
        #[command(flatten)]
        opts: MoveOpts,
    },
    /// Pin a key (a hot tenant) to a shard, moving it after its backlog.
    Pin {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The key.
        key: String,
        /// The shard it should live on.
        shard: String,
        #[command(flatten)]
        opts: MoveOpts,
    },
    /// Remove a key's pin, moving it back to its computed owner.
    Unpin {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The key.
        key: String,
        #[command(flatten)]
        opts: MoveOpts,
    },
    /// The keys with the most queued and in-flight jobs, per shard.
    Hot {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Keys listed per shard.
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Everything a reshard command needs for one data dir, of either kind.
struct Env {
    deployment: Deployment,
    store: Arc<dyn MapStore>,
    backend: Arc<dyn ReshardBackend>,
}

fn open(dir: &Path) -> anyhow::Result<Env> {
    let deployment = Deployment::open(dir, &crate::open_options())?;
    Ok(Env {
        store: deployment.maps(),
        backend: deployment.backend(),
        deployment,
    })
}

pub fn run(cmd: ReshardCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ReshardCommand::AddShard {
            data,
            name,
            weight,
            url,
        } => {
            let env = open(&data)?;
            env.deployment
                .deploy_shard(&name, url.as_deref())
                .with_context(|| format!("deploying shard {name:?}"))?;
            let version = reshard::add_shard(&*env.store, &name, weight, url)?;
            println!(
                "shard {name} deployed as warming (map version {version}); run `shardq rebalance --data {}` to move its keys to it",
                data.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        ReshardCommand::Rebalance {
            data,
            dry_run,
            opts,
        } => {
            let env = open(&data)?;
            if dry_run {
                return dry_run_plan(&env, opts.json);
            }
            rebalance(&env, &opts)
        }
        ReshardCommand::RemoveShard { data, name, opts } => {
            let env = open(&data)?;
            reshard::remove_shard(&*env.store, &name)?;
            rebalance(&env, &opts)
        }
        ReshardCommand::SetWeight {
            data,
            name,
            weight,
            opts,
        } => {
            let env = open(&data)?;
            reshard::set_weight(&*env.store, &name, weight)?;
            rebalance(&env, &opts)
        }
        ReshardCommand::Pin {
            data,
            key,
            shard,
            opts,
        } => {
            let env = open(&data)?;
            shardq_core::validate_key(&key)?;
            reshard::pin(&*env.store, &key, &shard)?;
            rebalance(&env, &opts)
        }
        ReshardCommand::Unpin { data, key, opts } => {
            let env = open(&data)?;
            if !reshard::unpin(&*env.store, &key)? {
                println!("key {key:?} is not pinned; nothing to do");
                return Ok(ExitCode::SUCCESS);
            }
            rebalance(&env, &opts)
        }
        ReshardCommand::Hot { data, top, json } => {
            if top == 0 || top > HOT_TOP_MAX {
                bail!("--top {top}: must be 1..={HOT_TOP_MAX}");
            }
            let env = open(&data)?;
            hot(&env, top, json)
        }
    }
}

#[derive(Serialize)]
struct RebalanceJson<'a> {
    from_version: u64,
    to_version: u64,
    nothing_to_do: bool,
    keys_moved: usize,
    moves: BTreeMap<String, BTreeMap<String, u64>>,
    pause_ms_p50: f64,
    pause_ms_p99: f64,
    pause_ms_max: f64,
    /// Jobs (queued, delayed, dead) copied to new shards with their keys.
    jobs_moved: u64,
    /// Longest wait for a moving key's run in flight on its old shard.
    run_wait_ms_max: f64,
    elapsed_ms: f64,
    #[serde(skip)]
    _report: &'a RebalanceReport,
}

/// Shards whose lease nobody holds now (no owner, or a lapsed lease).
fn shards_without_owner(deployment: &Deployment) -> Vec<String> {
    let now = deployment.clock().now_ms();
    match deployment.status() {
        Ok(st) => st
            .shards
            .iter()
            .filter(|r| r.owner.is_none() || r.lease_expires_ms.is_some_and(|at| at < now))
            .map(|r| r.name.clone())
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn rebalance(env: &Env, opts: &MoveOpts) -> anyhow::Result<ExitCode> {
    lower_priority(opts.nice);
    let options = RebalanceOptions {
        batch: opts.batch,
        drain_timeout_ms: opts.drain_timeout_ms,
        runner: format!("shardq rebalance (pid {})", std::process::id()),
        ..RebalanceOptions::default()
    };
    let bar = if opts.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} keys ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("pinning keys with work");
    // Not on a terminal (a pipe, a log): progress as lines, JSON lines with
    // --json, on stderr; stdout keeps the final report alone.
    let lines = opts.json || !std::io::stderr().is_terminal();
    let say = |json: serde_json::Value, text: String| {
        if opts.json {
            eprintln!("{json}");
        } else if lines {
            eprintln!("rebalance: {text}");
        } else {
            bar.suspend(|| eprintln!("rebalance: {text}"));
        }
    };
    let report = reshard::rebalance(&*env.backend, &*env.store, &options, &mut |ev| match ev {
        RebalanceEvent::Pinned { pinned, version } => {
            bar.set_length(pinned as u64);
            bar.set_message("move with backlogs");
            if lines {
                let how = "move with their backlogs";
                say(
                    serde_json::json!({"event": "pinned", "keys": pinned, "map_version": version}),
                    format!("{pinned} keys with work to {how} (map version {version})"),
                );
            }
            let orphans = shards_without_owner(&env.deployment);
            if pinned > 0 && !orphans.is_empty() {
                let why = "a key with a run in flight there moves only once a worker (`shardq work`, `shardq serve`) ends that run";
                say(
                    serde_json::json!({"event": "no_owner", "shards": orphans}),
                    format!("shards {orphans:?} have no owner: {why}"),
                );
            }
        }
        RebalanceEvent::Moving { keys } if lines => say(
            serde_json::json!({"event": "moving", "keys": keys}),
            format!("moving a batch of {keys} keys"),
        ),
        RebalanceEvent::Waiting { keys, waited_ms } if lines => say(
            serde_json::json!({"event": "waiting", "keys": keys, "waited_ms": waited_ms}),
            format!(
                "{keys} keys still have a run in flight on their old shard ({:.0} s waited)",
                waited_ms as f64 / 1000.0
            ),
        ),
        RebalanceEvent::Switched {
            done, total, jobs, ..
        } => {
            bar.set_position(done as u64);
            if lines {
                say(
                    serde_json::json!({"event": "switched", "done": done, "total": total, "jobs_moved": jobs}),
                    format!("{done}/{total} keys switched ({jobs} jobs moved with this batch)"),
                );
            }
        }
        _ => {}
    })?;
    bar.finish_and_clear();
    print_rebalance(&report, opts.json)?;
    Ok(ExitCode::SUCCESS)
}

/// Prints what a rebalance did: one JSON document with `--json`, else a
/// summary line, the moves per pair of shards and the pauses.
fn print_rebalance(report: &RebalanceReport, json: bool) -> anyhow::Result<()> {
    let mut moves: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for m in &report.moved {
        *moves
            .entry(m.from.clone())
            .or_default()
            .entry(m.to.clone())
            .or_default() += 1;
    }
    let max = report.moved.iter().map(|m| m.pause_ms).fold(0.0, f64::max);
    let out = RebalanceJson {
        from_version: report.from_version,
        to_version: report.to_version,
        nothing_to_do: report.nothing_to_do,
        keys_moved: report.moved.len(),
        moves,
        pause_ms_p50: report.pause_percentile_ms(50.0),
        pause_ms_p99: report.pause_percentile_ms(99.0),
        pause_ms_max: max,
        jobs_moved: report.jobs_moved,
        run_wait_ms_max: report
            .moved
            .iter()
            .map(|m| m.run_wait_ms)
            .fold(0.0, f64::max),
        elapsed_ms: report.elapsed_ms,
        _report: report,
    };
    if json {
        println!("{}", serde_json::to_string(&out)?);
    } else if out.nothing_to_do {
        println!(
            "nothing to do: the published map (version {}) is the target",
            out.to_version
        );
    } else {
        println!(
            "map version {} -> {}: {} keys with work moved in {:.0} ms ({} jobs moved with them)",
            out.from_version, out.to_version, out.keys_moved, out.elapsed_ms, out.jobs_moved
        );
        for (from, tos) in &out.moves {
            for (to, n) in tos {
                println!("  {from} -> {to}: {n} keys");
            }
        }
        if out.keys_moved > 0 {
            println!(
                "  enqueue pause per key: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; longest wait for a run in flight {:.0} ms",
                out.pause_ms_p50, out.pause_ms_p99, out.pause_ms_max, out.run_wait_ms_max
            );
        }
    }
    Ok(())
}

#[derive(Serialize)]
struct DryRun {
    from_version: u64,
    keys_with_work: u64,
    moved: u64,
    moves: BTreeMap<String, BTreeMap<String, u64>>,
    jobs_to_drain: u64,
}

fn dry_run_plan(env: &Env, json: bool) -> anyhow::Result<ExitCode> {
    let cur = env.store.load()?;
    let target = reshard::current_target(&*env.store)?;
    let moves = reshard::plan_moves(&*env.backend, &cur, &target)?;
    let mut keys_with_work = 0u64;
    for s in &cur.shards {
        keys_with_work += env.backend.keys_with_work(&s.name)?.len() as u64;
    }
    let mut out = DryRun {
        from_version: cur.version,
        keys_with_work,
        moved: moves.len() as u64,
        moves: BTreeMap::new(),
        jobs_to_drain: moves.iter().map(|m| m.jobs).sum(),
    };
    for m in &moves {
        *out.moves
            .entry(m.from.clone())
            .or_default()
            .entry(m.to.clone())
            .or_default() += 1;
    }
    if json {
        println!("{}", serde_json::to_string(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "map version {}: {} of {} keys with work would move ({} jobs to drain first)",
        out.from_version, out.moved, out.keys_with_work, out.jobs_to_drain
    );
    for (from, tos) in &out.moves {
        for (to, n) in tos {
            println!("  {from} -> {to}: {n} keys");
        }
    }
    println!("keys without work follow the new map at once; nothing was changed (dry run)");
    Ok(ExitCode::SUCCESS)
}

#[derive(Serialize)]
struct HotKey {
    key: String,
    depth: u64,
    in_flight: u64,
    dead: u64,
}

/// One shard of `hot --json`, as `GET /v1/hot` answers it.
#[derive(Serialize)]
struct HotShard {
    shard: String,
    keys_with_work: Option<usize>,
    top: Vec<HotKey>,
    error: Option<String>,
}

fn hot(env: &Env, top: usize, json: bool) -> anyhow::Result<ExitCode> {
    let map = env.store.load()?;
    let mut out: Vec<HotShard> = Vec::new();
    for s in &map.shards {
        let mut keys = match env.backend.keys_with_work(&s.name) {
            Ok(k) => k,
            Err(e) if json => {
                out.push(HotShard {
                    shard: s.name.clone(),
                    keys_with_work: None,
                    top: Vec::new(),
                    error: Some(e.to_string()),
                });
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let n = keys.len();
        keys.sort_by(|a, b| {
            (b.1.depth + b.1.in_flight)
                .cmp(&(a.1.depth + a.1.in_flight))
                .then(a.0.cmp(&b.0))
        });
        keys.truncate(top);
        let list = keys
            .into_iter()
            .map(|(key, c)| HotKey {
                key,
                depth: c.depth,
                in_flight: c.in_flight,
                dead: c.dead,
            })
            .collect::<Vec<_>>();
        if !json {
            let total = env.backend.shard_stats(&s.name)?;
            println!(
                "{} ({} ready, {} delayed, {} in flight)",
                s.name, total.ready, total.delayed, total.in_flight
            );
            for k in &list {
                println!(
                    "  {:<32} {:>8} queued {:>3} in flight",
                    shardq_core::job::shown_key(&k.key),
                    k.depth,
                    k.in_flight
                );
            }
        }
        out.push(HotShard {
            shard: s.name.clone(),
            keys_with_work: Some(n),
            top: list,
            error: None,
        });
    }
    if json {
        println!("{}", serde_json::json!({ "top": top, "shards": out }));
    }
    Ok(ExitCode::SUCCESS)
}
