//! `shardq-bench chx`: the consistent-hash harness (seed 001's experiments A,
//! B and C) over shardq's routers, the embedded queue and, when a broker URL
//! is given, RabbitMQ's `x-consistent-hash` exchange.
//!
//! Glue only: the experiments and the result files live in
//! `shardq_bench::chx`. This module parses flags, draws the progress bar,
//! prints the summary (or `--json`) and picks the exit code.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use shardq_bench::chx::{
    self, report, EmbeddedTarget, Observer, Params, RabbitTarget, RouterTarget, SystemReport,
};
use shardq_route::Algorithm;

/// How often the bar redraws on its own while a step waits on the broker.
const TICK: Duration = Duration::from_millis(200);

/// Seed 001's experiments: A evenness, B rebalance cost (add and remove), C affinity.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for the CSVs, summary.txt and SVG charts.
    #[arg(long, default_value = "results")]
    pub out: PathBuf,
    /// RabbitMQ to measure, e.g. amqp://127.0.0.1:5672 (see scripts/rabbitmq.sh).
    #[arg(long, value_name = "URL")]
    pub rabbitmq: Option<String>,
    /// Queues (shards) in A and C; B adds one and removes the middle one of N+1.
    #[arg(long, default_value_t = Params::default().queues)]
    pub queues: usize,
    /// Messages sent in A.
    #[arg(long, default_value_t = Params::default().messages)]
    pub messages: u64,
    /// Distinct keys (user-<n>) the A messages cycle through.
    #[arg(long, default_value_t = Params::default().keys)]
    pub keys: u64,
    /// Distinct keys placed in B.
    #[arg(long, default_value_t = Params::default().rebalance_keys)]
    pub rebalance_keys: u64,
    /// Distinct keys in C.
    #[arg(long, default_value_t = Params::default().affinity_keys)]
    pub affinity_keys: u64,
    /// Copies of each key in C.
    #[arg(long, default_value_t = Params::default().copies)]
    pub copies: u32,
    /// Print the headline numbers as one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Draws one indicatif bar that each step resets.
struct Bar(ProgressBar);

impl Observer for Bar {
    fn step(&mut self, system: &str, step: &str, total: u64) {
        self.0.set_length(total);
        self.0.set_position(0);
        self.0.set_message(format!("{system}: {step}"));
    }

    fn advance(&mut self, n: u64) {
        self.0.inc(n);
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let params = Params {
        queues: args.queues,
        messages: args.messages,
        keys: args.keys,
        rebalance_keys: args.rebalance_keys,
        affinity_keys: args.affinity_keys,
        copies: args.copies,
    };
    params.validate()?;
    let started = Instant::now();
    let mut info = report::RunInfo::detect(env!("CARGO_PKG_VERSION"), args.rabbitmq.as_deref());

    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg:32} [{bar:40}] {pos}/{len} ({eta})")
            .context("progress bar template")?
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(TICK);
    let mut obs = Bar(bar.clone());

    let mut reports: Vec<SystemReport> = Vec::new();
    for algorithm in [
        Algorithm::Ring,
        Algorithm::Rendezvous,
        Algorithm::Jump,
        Algorithm::Slots,
        Algorithm::Modulo,
    ] {
        reports.push(chx::run_system(
            &mut RouterTarget::new(algorithm),
            &params,
            &mut obs,
        ));
    }
    reports.push(chx::run_system(
        &mut EmbeddedTarget::new(),
        &params,
        &mut obs,
    ));
    let rabbit = match &args.rabbitmq {
        None => SystemReport::skipped("rabbitmq", "no --rabbitmq URL given"),
        Some(url) => match RabbitTarget::connect(url) {
            Ok(mut target) => {
                let r = chx::run_system(&mut target, &params, &mut obs);
                target.close();
                r
            }
            Err(shardq_bench::ChxError::NoBroker { url, reason }) => {
                SystemReport::skipped("rabbitmq", format!("no broker at {url} ({reason})"))
            }
            Err(err) => SystemReport {
                note: Some(format!("failed: {err}")),
                ..SystemReport::skipped("rabbitmq", "")
            },
        },
    };
    reports.push(rabbit);
    bar.finish_and_clear();

    info.elapsed_s = started.elapsed().as_secs_f64();
    let written = report::write_all(&args.out, &params, &info, &reports)?;
    if args.json {
        println!("{}", report::headline_json(&params, &info, &reports));
    } else {
        print!("{}", report::summary(&params, &info, &reports));
        eprintln!("wrote {} files to {}", written.len(), args.out.display());
    }

    // A system that was asked for but did not finish fails the run: a missing
    // broker must never read as a pass. RabbitMQ without --rabbitmq was not
    // asked for: its row says so and the run still succeeds.
    let mut failed = false;
    for r in &reports {
        let asked = r.system != "rabbitmq" || args.rabbitmq.is_some();
        if !r.complete() && asked {
            eprintln!(
                "shardq-bench: {}: {}",
                r.system,
                r.note.as_deref().unwrap_or("incomplete")
            );
            failed = true;
        } else if let Some(n) = &r.note {
            eprintln!("shardq-bench: note: {}: {n}", r.system);
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
