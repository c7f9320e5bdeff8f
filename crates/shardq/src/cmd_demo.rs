//! `shardq demo`: argument parsing, the progress line and the report. The
//! demo itself (load, order and loss checks, the live rebalance, and the
//! backends it runs on) is [`crate::demo`]. With `--serve`, the
//! dashboard (`shardq_server::dashboard`) watches the demo's deployment
//! while it runs and for `--serve-after-s` seconds after the report.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::demo::envs::{shard_names, DeploymentEnv, MemoryEnv};
use crate::demo::{self, DemoEnv, DemoParams};

/// Where the demo's shards live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoBackend {
    /// The embedded on-disk engine (the default).
    Fs,
    /// Local redis-server instances the demo starts itself.
    Redis,
    /// In memory, no durability: shows the resharding logic alone.
    Memory,
}

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Tenants (keys) the producers enqueue for.
    #[arg(long, default_value_t = 10_000)]
    tenants: usize,
    /// Shards before the new one is added.
    #[arg(long, default_value_t = 4)]
    shards: usize,
    /// Seconds of load before the rebalance, and again after it.
    #[arg(long, default_value_t = 3.0)]
    phase_s: f64,
    /// Jobs per second enqueued over all producers.
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// Jobs enqueued back to back per tenant visit (gives tenants a backlog to drain).
    #[arg(long, default_value_t = 5)]
    burst: u64,
    /// Simulated work per job, in microseconds.
    #[arg(long, default_value_t = 1000)]
    work_us: u64,
    /// Producer threads.
    #[arg(long, default_value_t = 2)]
    producers: usize,
    /// Worker pool concurrency.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Keys per move batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = DemoBackend::Fs)]
    backend: DemoBackend,
    /// With --backend redis: start the redis-server instances on the first
    /// free loopback ports of this inclusive range (one per shard and one
    /// for the added shard), e.g. 30000-30010; by default, any free ports.
    #[arg(long, value_name = "LOW-HIGH", value_parser = parse_port_range)]
    redis_ports: Option<(u16, u16)>,
    /// Keep the data directory here instead of a temporary one.
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
    /// Print the final report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Serve the dashboard on the demo's deployment (fs or redis) while it
    /// runs, and for --serve-after-s seconds after the report.
    #[arg(long)]
    serve: bool,
    /// Where the dashboard listens (loopback only: it has no tokens).
    #[arg(long, default_value = "127.0.0.1:7070", requires = "serve")]
    listen: std::net::SocketAddr,
    /// Seconds the dashboard stays up after the report.
    #[arg(long, default_value_t = 60, requires = "serve")]
    serve_after_s: u64,
}

/// `LOW-HIGH`, an inclusive range of ports, LOW <= HIGH, both 1..=65535.
fn parse_port_range(text: &str) -> Result<(u16, u16), String> {
    let bad = |why: &str| {
        format!("invalid port range {text:?}: {why} (expected LOW-HIGH, e.g. 30000-30010)")
    };
    let (lo, hi) = text.split_once('-').ok_or_else(|| bad("no `-`"))?;
    let port = |p: &str| -> Result<u16, String> {
        match p.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(bad(&format!("{p:?} is not a port 1..=65535"))),
            Ok(n) => Ok(n),
        }
    };
    let (lo, hi) = (port(lo)?, port(hi)?);
    if lo > hi {
        return Err(bad("LOW is above HIGH"));
    }
    Ok((lo, hi))
}

pub fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    if args.shards == 0 || args.shards > 256 {
        bail!("--shards {}: must be 1..=256", args.shards);
    }
    if args.concurrency == 0 {
        bail!("--concurrency 0: must be at least 1");
    }
    let params = DemoParams {
        tenants: args.tenants,
        burst: args.burst,
        work_us: args.work_us,
        phase_s: args.phase_s,
        rate: args.rate,
        producers: args.producers,
        concurrency: args.concurrency,
        batch: args.batch,
    };
    if args.serve && args.backend == DemoBackend::Memory {
        bail!("--serve needs --backend fs or redis: the dashboard reads a data dir, and the memory backend has none");
    }
    if args.serve && !args.listen.ip().is_loopback() {
        bail!(
            "--listen {}: the demo's dashboard runs without tokens, so it listens on a loopback address only",
            args.listen
        );
    }
    if args.redis_ports.is_some() && args.backend != DemoBackend::Redis {
        bail!("--redis-ports is for --backend redis: the other backends start no servers");
    }
    let names = shard_names(args.shards);
    let deployed = match args.backend {
        DemoBackend::Memory => None,
        DemoBackend::Fs => Some(Arc::new(DeploymentEnv::embedded(
            args.keep.clone(),
            &names,
        )?)),
        DemoBackend::Redis => Some(Arc::new(DeploymentEnv::redis(
            args.keep.clone(),
            &names,
            args.redis_ports,
        )?)),
    };
    let env: Arc<dyn DemoEnv> = match &deployed {
        Some(d) => d.clone(),
        None => Arc::new(MemoryEnv::new(&names)?),
    };
    // The dashboard takes no shard lease: the demo's pool runs every shard.
    let viewer = match (&deployed, args.serve) {
        (Some(d), true) => {
            let opts = shardq_server::ServerOptions {
                listen: args.listen,
                ..shardq_server::ServerOptions::default()
            };
            let v = shardq_server::dashboard::spawn_viewer(d.dir(), opts)
                .with_context(|| format!("starting the dashboard on {}", args.listen))?;
            eprintln!(
                "shardq demo: dashboard at {}/ (no tokens, loopback only)",
                v.url()
            );
            Some(v)
        }
        _ => None,
    };
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    let report = demo::run(env, &params, &|msg: &str| bar.set_message(msg.to_string()));
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", demo::render(&report));
    }
    if let Some(v) = viewer {
        eprintln!(
            "shardq demo: the dashboard stays up at {}/ for {} s (Ctrl-C to stop sooner)",
            v.url(),
            args.serve_after_s
        );
        std::thread::sleep(Duration::from_secs(args.serve_after_s));
        v.stop().context("stopping the dashboard")?;
    }
    let healthy = report.order_violations == 0 && report.lost_jobs == 0;
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(test)]
mod tests {
    use super::parse_port_range;

    #[test]
    fn port_ranges_parse_or_say_what_is_wrong() {
        assert_eq!(parse_port_range("30000-30010"), Ok((30000, 30010)));
        assert_eq!(parse_port_range("7000-7000"), Ok((7000, 7000)));
        for (bad, why) in [
            ("30000", "no `-`"),
            ("0-10", "\"0\" is not a port"),
            ("10-70000", "\"70000\" is not a port"),
            ("x-10", "\"x\" is not a port"),
            ("20-10", "LOW is above HIGH"),
        ] {
            let err = parse_port_range(bad).unwrap_err();
            assert!(err.contains(why) && err.contains(bad), "{bad}: {err}");
        }
    }
}
