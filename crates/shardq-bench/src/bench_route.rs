//! `shardq-bench route`: nanoseconds per lookup for every algorithm and hash
//! at several shard counts, against a bare-hash baseline measured in the same
//! process run, so the ratio survives a noisy or slower machine.
//!
//! Method: keys `tenant-<13 digits>` (20 bytes) are generated up front; each
//! cell times `Router::route_index` (overrides checked, none present) over
//! the keys in a loop, inputs and results passed through
//! `std::hint::black_box` so the optimiser can neither hoist nor drop the
//! work. A cell is calibrated to about `--ms-per-cell` and measured as the
//! best of [`SAMPLES`] runs: on a shared machine interference only ever adds
//! time, so the minimum is the least noisy estimate.
//!
//! This command only measures; it changes nothing on disk.

use std::hint::black_box;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shardq_route::map::VNODES_DEFAULT;
use shardq_route::{Algorithm, HashFn, Router, Shard, ShardMap};

/// Timed runs per cell; the fastest is reported.
const SAMPLES: u32 = 5;
/// Keys cycled through; a power of two so the index is a mask. 4096 keys of
/// 20 bytes stay cache-resident, as a producer's hot tenants would.
const KEYS: usize = 4096;
/// Bound on the per-cell budget so a typo cannot run for hours.
const MS_PER_CELL_MAX: u64 = 10_000;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print a JSON array of rows instead of a table.
    #[arg(long)]
    json: bool,
    /// Shard counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "4,16,64,256")]
    shards: Vec<u32>,
    /// Algorithms to measure (modulo, ring, rendezvous, jump, slots).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "modulo,ring,rendezvous,jump,slots"
    )]
    algorithms: Vec<Algorithm>,
    /// Hashes to measure (blake2b64, xxh64, xxh3, murmur3, fnv1a64, crc16).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "blake2b64,xxh64,xxh3,murmur3,fnv1a64,crc16"
    )]
    hashes: Vec<HashFn>,
    /// Approximate measuring time per cell, in milliseconds.
    #[arg(long, default_value_t = 80)]
    ms_per_cell: u64,
}

/// One line of the result.
#[derive(Debug, Serialize)]
struct Row {
    /// A routing algorithm, or `bare-hash` for the baseline.
    algorithm: String,
    hash: &'static str,
    /// Shard count; `null` for the bare-hash baseline.
    shards: Option<u32>,
    ns_per_lookup: f64,
    ratio_to_bare_hash: f64,
}

/// `tenant-` and 13 digits; the numbers are spread so neighbouring keys
/// differ in many digits, as real tenant ids would.
fn make_keys() -> Vec<String> {
    (0..KEYS as u64)
        .map(|i| {
            format!(
                "tenant-{:013}",
                i.wrapping_mul(2_654_435_761) % 10_000_000_000_000
            )
        })
        .collect()
}

/// Times `f` over `iters` keys; returns ns per call.
fn time_once(keys: &[String], iters: u64, f: &mut impl FnMut(&[u8]) -> usize) -> f64 {
    let mask = keys.len() - 1;
    let start = Instant::now();
    for i in 0..iters {
        let key = black_box(keys[i as usize & mask].as_bytes());
        black_box(f(key));
    }
    start.elapsed().as_nanos() as f64 / iters as f64
}

/// Calibrates an iteration count for `budget`, then returns the best of
/// [`SAMPLES`] runs in ns per call.
fn measure(keys: &[String], budget: Duration, mut f: impl FnMut(&[u8]) -> usize) -> f64 {
    let mut iters: u64 = 16;
    // Double until one run takes at least a tenth of a sample's share.
    let probe = budget / (SAMPLES * 10);
    loop {
        let start = Instant::now();
        time_once(keys, iters, &mut f);
        let took = start.elapsed();
        if took >= probe || iters >= 1 << 40 {
            let per_sample = budget.as_nanos() as f64 / f64::from(SAMPLES);
            let scale = per_sample / took.as_nanos().max(1) as f64;
            iters = ((iters as f64 * scale) as u64).max(1);
            break;
        }
        iters *= 2;
    }
    (0..SAMPLES)
        .map(|_| time_once(keys, iters, &mut f))
        .fold(f64::INFINITY, f64::min)
}

fn router_for(algorithm: Algorithm, hash: HashFn, shards: u32) -> anyhow::Result<Router> {
    let map = ShardMap {
        version: 1,
        algorithm,
        hash,
        vnodes: VNODES_DEFAULT,
        shards: (0..shards)
            .map(|i| Shard::new(format!("redis-{i}")))
            .collect(),
        overrides: Default::default(),
    };
    Router::new(map).with_context(|| format!("building a {algorithm} map of {shards} shards"))
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        (1..=MS_PER_CELL_MAX).contains(&args.ms_per_cell),
        "--ms-per-cell is {}; expected 1 to {MS_PER_CELL_MAX}",
        args.ms_per_cell
    );
    anyhow::ensure!(!args.shards.contains(&0), "--shards must be at least 1");
    let budget = Duration::from_millis(args.ms_per_cell);
    let keys = make_keys();

    let cells = args.hashes.len() * (1 + args.algorithms.len() * args.shards.len());
    let bar = ProgressBar::new(cells as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut rows = Vec::with_capacity(cells);
    for &hash in &args.hashes {
        bar.set_message(format!("bare {hash}"));
        let bare = measure(&keys, budget, |k| hash.hash(k) as usize);
        bar.inc(1);
        rows.push(Row {
            algorithm: "bare-hash".into(),
            hash: hash.name(),
            shards: None,
            ns_per_lookup: bare,
            ratio_to_bare_hash: 1.0,
        });
        for &algorithm in &args.algorithms {
            for &n in &args.shards {
                bar.set_message(format!("{algorithm} {hash} {n}"));
                let router = router_for(algorithm, hash, n)?;
                let ns = measure(&keys, budget, |k| router.route_index(k));
                bar.inc(1);
                rows.push(Row {
                    algorithm: algorithm.name().into(),
                    hash: hash.name(),
                    shards: Some(n),
                    ns_per_lookup: ns,
                    ratio_to_bare_hash: ns / bare,
                });
            }
        }
    }
    bar.finish_and_clear();

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
    } else {
        writeln!(
            out,
            "{:<11} {:<10} {:>6} {:>12} {:>9}",
            "algorithm", "hash", "shards", "ns/lookup", "x bare"
        )?;
        for r in &rows {
            let shards = r.shards.map_or_else(|| "-".to_string(), |n| n.to_string());
            writeln!(
                out,
                "{:<11} {:<10} {:>6} {:>12.1} {:>9.2}",
                r.algorithm, r.hash, shards, r.ns_per_lookup, r.ratio_to_bare_hash
            )?;
        }
        writeln!(
            out,
            "# {KEYS} keys of 20 bytes; best of {SAMPLES} runs of ~{} ms per cell; ring vnodes {VNODES_DEFAULT}",
            args.ms_per_cell / u64::from(SAMPLES)
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
