//! `shardq pg install|relay|status`: the Postgres outbox. Glue: parse,
//! call `shardq-pg`, print.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use clap::Subcommand;
use shardq_deploy::{Deployment, OpenOptions};
use shardq_pg::relay::{RelayEvent, RelayOptions, RELAY_BATCH_DEFAULT, RELAY_POLL_MS_DEFAULT};
use shardq_pg::schema::Bounds;

#[derive(Debug, Subcommand)]
pub enum PgAction {
    /// Create or bring up to date the outbox in a database: the schema's
    /// table (numbered migrations, recorded in SCHEMA.migrations) and the
    /// function SCHEMA.enqueue(key, payload, dedup_id, delay_ms,
    /// max_attempts), whose checks follow this deployment. Safe to run
    /// again.
    Install {
        /// Data dir of the deployment (embedded or Redis).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The database: a postgres:// URL or a key=value string.
        #[arg(long, value_name = "URL")]
        postgres: String,
        /// Schema of the outbox.
        #[arg(long, default_value = "shardq")]
        schema: String,
        /// How the relay hears of commits: `notify` (enqueue calls
        /// pg_notify: lowest latency, but PostgreSQL commits notifying
        /// transactions one at a time) or `poll` (no notification: the
        /// relay reads every --poll-ms; cheaper for the application's
        /// transactions; run the relay with a short --poll-ms). Default:
        /// what the schema has now, `notify` for a new one.
        #[arg(long, value_enum)]
        wake: Option<WakeArg>,
    },
    /// Move committed outbox rows into the deployment, each key's in
    /// commit order, and delete them; runs until SIGINT/SIGTERM. Several
    /// relays may run: one is active, the others wait to take over.
    Relay {
        /// Data dir of the deployment (embedded or Redis).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The database: a postgres:// URL or a key=value string.
        #[arg(long, value_name = "URL")]
        postgres: String,
        /// Schema of the outbox.
        #[arg(long, default_value = "shardq")]
        schema: String,
        /// Rows per round (1 to 10000).
        #[arg(long, default_value_t = RELAY_BATCH_DEFAULT)]
        batch: usize,
        /// Longest wait between two reads of the outbox when no commit is
        /// heard of, in ms (10 to 60000).
        #[arg(long, value_name = "MS", default_value_t = RELAY_POLL_MS_DEFAULT)]
        poll_ms: u64,
        /// Exit once the outbox is empty.
        #[arg(long)]
        exit_when_empty: bool,
        /// One JSON line per event and a JSON report at the end.
        #[arg(long)]
        json: bool,
    },
    /// The outbox's depth, its oldest row's age (the relay's lag), whether
    /// a relay is active, and the transactions holding keys back.
    Status {
        /// The database: a postgres:// URL or a key=value string.
        #[arg(long, value_name = "URL")]
        postgres: String,
        /// Schema of the outbox.
        #[arg(long, default_value = "shardq")]
        schema: String,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
}

fn open(data: &Path) -> anyhow::Result<(Deployment, OpenOptions)> {
    let opts = crate::open_options();
    let d = Deployment::open(data, &opts)
        .with_context(|| format!("opening the deployment in {}", data.display()))?;
    Ok((d, opts))
}

/// `--wake` of `pg install`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum WakeArg {
    /// enqueue notifies the relay at commit.
    Notify,
    /// The relay polls; enqueue does not notify.
    Poll,
}

/// `shardq pg`: dispatches to one function per action.
pub fn run(action: PgAction) -> anyhow::Result<ExitCode> {
    match action {
        PgAction::Install {
            data,
            postgres,
            schema,
            wake,
        } => install(&data, &postgres, &schema, wake),
        PgAction::Relay {
            data,
            postgres,
            schema,
            batch,
            poll_ms,
            exit_when_empty,
            json,
        } => relay(
            &data,
            &postgres,
            RelayOptions {
                schema,
                batch,
                poll_ms,
                exit_when_empty,
            },
            json,
        ),
        PgAction::Status {
            postgres,
            schema,
            json,
        } => status(&postgres, &schema, json),
    }
}

/// `shardq pg install`: creates or migrates the outbox schema and writes its functions.
fn install(
    data: &Path,
    postgres: &str,
    schema: &str,
    wake: Option<WakeArg>,
) -> anyhow::Result<ExitCode> {
    let (d, opts) = open(data)?;
    let mut client = shardq_pg::connect(postgres)?;
    let wake = match wake {
        Some(WakeArg::Notify) => shardq_pg::schema::Wake::Notify,
        Some(WakeArg::Poll) => shardq_pg::schema::Wake::Poll,
        // A new install notifies; an existing one keeps its mode.
        None => shardq_pg::schema::installed_wake(&mut client, schema)?
            .unwrap_or(shardq_pg::schema::Wake::Notify),
    };
    let bounds = Bounds {
        payload_bytes_max: d.payload_bytes_max(&opts),
        wake,
    };
    let applied = shardq_pg::schema::install(&mut client, schema, bounds)?;
    if applied.is_empty() {
        println!(
            "schema {schema}: up to date (migration {}); functions written",
            shardq_pg::schema::latest_version()
        );
    } else {
        let list: Vec<String> = applied.iter().map(i32::to_string).collect();
        println!(
            "schema {schema}: applied migration {}; functions written",
            list.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `shardq pg relay`: moves committed outbox rows into the deployment until stopped.
fn relay(data: &Path, postgres: &str, opts: RelayOptions, json: bool) -> anyhow::Result<ExitCode> {
    let (d, _) = open(data)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let mut on_event = |e: RelayEvent| match (json, e) {
        (true, RelayEvent::Relayed(_)) => {}
        (true, e) => println!("{}", event_json(&e)),
        (false, RelayEvent::Standby) => {
            eprintln!("shardq: standby: another relay of this outbox is active")
        }
        (false, RelayEvent::Active) => eprintln!("shardq: relaying"),
        (false, RelayEvent::Relayed(_)) => {}
        (false, RelayEvent::Failed { why, retry_ms }) => {
            eprintln!("shardq: relay: {why}; trying again in {retry_ms} ms")
        }
    };
    let report = shardq_pg::relay::run(&d, postgres, &opts, &stop, &mut on_event)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "relayed {} rows ({} already stored), {} retries",
            report.relayed, report.already_stored, report.retries
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `shardq pg status`: prints the outbox's depth, lag, relay and open transactions.
fn status(postgres: &str, schema: &str, json: bool) -> anyhow::Result<ExitCode> {
    let mut client = shardq_pg::connect(postgres)?;
    let s = shardq_pg::status(&mut client, schema)?;
    if json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "outbox {}: migration {} of {}",
        s.schema, s.installed_version, s.latest_version
    );
    println!("depth\t{} rows", s.depth);
    println!(
        "wake\t{}",
        if s.wake == "notify" {
            "enqueue notifies the relay at commit"
        } else {
            "the relay polls (enqueue does not notify): its --poll-ms bounds the lag"
        }
    );
    match s.oldest_age_ms {
        Some(ms) => println!("oldest row\t{ms} ms old (the relay's lag)"),
        None => println!("oldest row\tnone"),
    }
    println!(
        "relay\t{}",
        if s.relay_active {
            "active"
        } else {
            "none active: committed rows wait (run `shardq pg relay`)"
        }
    );
    match s.oldest_open_transaction_ms {
        Some(ms) if s.open_transactions > 0 => println!(
            "open transactions\t{} hold outbox keys, the oldest for {ms} ms: later rows of their keys wait for them",
            s.open_transactions
        ),
        _ => println!("open transactions\tnone hold outbox keys"),
    }
    println!("dead tuples\t{}", s.dead_tuples);
    Ok(ExitCode::SUCCESS)
}

fn event_json(e: &RelayEvent) -> serde_json::Value {
    match e {
        RelayEvent::Standby => serde_json::json!({"event": "standby"}),
        RelayEvent::Active => serde_json::json!({"event": "active"}),
        RelayEvent::Relayed(n) => serde_json::json!({"event": "relayed", "rows": n}),
        RelayEvent::Failed { why, retry_ms } => {
            serde_json::json!({"event": "failed", "why": why, "retry_ms": retry_ms})
        }
    }
}
