//! The queue's commands: init, enqueue, work, status, dead, repair.
//!
//! Glue over `shardq-fs` or `shardq-redis`, whichever the data dir's shards
//! live on (`backends` decides): parse, check input, call the library,
//! print, with the same output either way. Bad input gets an error naming
//! the option and value; nothing here writes a log record or a Redis key
//! itself. `work` runs handler commands through `handler_proc`.

use std::fs::OpenOptions;
use std::io::{self, BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Subcommand;
use shardq_core::producer::{Placed, ProduceError, Producer, ProducerOptions};
use shardq_core::reshard::MapStore;
use shardq_core::{
    ClaimedJob, DeadPolicy, JobId, NewJob, PoolEvent, PoolOptions, QueueBackend, QueueError,
    ShardStats, SystemClock, WorkerPool,
};
use shardq_fs::map_store::FileMapStore;
use shardq_fs::{Durability, Engine, EngineOptions, MemberOptions, StatusTotals};
use shardq_redis::{RedisBackend, RedisMapStore, RedisOptions};
use shardq_route::{Algorithm, HashFn, ShardMap};

use crate::backends;
use crate::handler_proc;

/// Most shards `init` creates.
const INIT_SHARDS_MAX: usize = 4096;
/// Most jobs sent as one batch by `enqueue --stdin`.
const STDIN_BATCH_MAX: usize = 4096;
/// Longest `KEY<TAB>PAYLOAD` line, in bytes (payload limit plus key and tab).
const STDIN_LINE_BYTES_MAX: usize = shardq_core::PAYLOAD_BYTES_LIMIT + 2048;

#[derive(Debug, Subcommand)]
pub enum EngineCommand {
    /// Create a data dir with shards shard-0..shard-(N-1) and map version 1.
    Init {
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Number of shards.
        #[arg(long)]
        shards: usize,
        /// Routing algorithm (rendezvous, ring, jump, modulo, slots).
        #[arg(long, default_value = "rendezvous")]
        algorithm: String,
        /// Hash function (blake2b64, xxh64, xxh3, murmur3).
        #[arg(long)]
        hash: Option<String>,
        /// Put the shards on Redis instances: a comma-separated list of
        /// redis://host:port/db; shard i goes to the i-th (round-robin). The
        /// map is published on the first; the data dir keeps remote.json and
        /// a cached shardmap.yaml.
        #[arg(long, value_name = "URLS", conflicts_with = "redis_cluster")]
        redis: Option<String>,
        /// Put every shard on one Redis Cluster, named by seed nodes
        /// (redis://host:port,...).
        #[arg(long, value_name = "SEEDS")]
        redis_cluster: Option<String>,
        /// With --redis/--redis-cluster: use the map already published there
        /// (another data dir's) whatever its shards, instead of refusing one
        /// that differs from the one this init would create.
        #[arg(long)]
        join: bool,
    },
    /// Enqueue a job, or `KEY<TAB>PAYLOAD` lines from stdin with --stdin.
    Enqueue(EnqueueArgs),
    /// Run jobs of the shards this process can claim: CMD runs once per job.
    Work(WorkArgs),
    /// Per-shard ready, delayed, in-flight and dead counts, owners, leases.
    ///
    /// A shard that cannot be read (e.g. a corrupt log) is shown with its
    /// error (`"error"` in --json, counts null) and left out of the totals;
    /// the other shards are still shown, and each failed shard's error and
    /// a summary line go to stderr. Exit status 2 if any shard failed, as
    /// for any other error.
    Status {
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The dead-letter list.
    Dead {
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[command(subcommand)]
        action: DeadAction,
    },
    /// Cut corrupt records out of a shard's log (saving them to quarantine/),
    /// so it serves again. Reports every byte range it removed.
    Repair {
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Shard name, e.g. shard-0.
        shard: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeadAction {
    /// List dead jobs (SHARD<TAB>ID<TAB>KEY<TAB>ATTEMPTS<TAB>REASON).
    List {
        #[arg(long)]
        shard: Option<String>,
    },
    /// Put dead jobs back in their keys (all, or --shard/--id).
    Retry {
        #[arg(long)]
        shard: Option<String>,
        #[arg(long, requires = "shard")]
        id: Vec<u64>,
    },
    /// Delete dead jobs for good (all, or --shard/--id).
    Purge {
        #[arg(long)]
        shard: Option<String>,
        #[arg(long, requires = "shard")]
        id: Vec<u64>,
    },
}

#[derive(Debug, clap::Args)]
pub struct CommonOpts {
    /// fsync (per batch, group commit), interval, or none.
    #[arg(long, default_value = "fsync")]
    durability: String,
    /// Period of `--durability interval`, in ms.
    #[arg(long, default_value_t = shardq_fs::backend::SYNC_INTERVAL_MS_DEFAULT)]
    interval_ms: u64,
    /// Largest payload in bytes (default 1 MiB).
    #[arg(long, default_value_t = shardq_core::PAYLOAD_BYTES_MAX_DEFAULT)]
    payload_bytes_max: usize,
    /// Segment size before rolling, in bytes.
    #[arg(long, default_value_t = 64 << 20, hide = true)]
    segment_bytes: u64,
}

#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    #[arg(long, value_name = "DIR")]
    data: PathBuf,
    /// Routing key.
    #[arg(long, required_unless_present = "stdin", conflicts_with = "stdin")]
    key: Option<String>,
    /// Payload (UTF-8 text); empty if absent.
    #[arg(long)]
    payload: Option<String>,
    /// Read KEY<TAB>PAYLOAD lines from stdin; prints KEY<TAB>SHARD<TAB>ID for
    /// each job once it is stored. After an error every stored job has been
    /// printed and the error names the stdin lines NOT enqueued (exit 2), so
    /// exactly those can be sent again.
    #[arg(long)]
    stdin: bool,
    /// Earliest start, as a delay in ms.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Attempts before dead-lettering.
    #[arg(long, default_value_t = shardq_core::MAX_ATTEMPTS_DEFAULT)]
    max_attempts: u32,
    #[command(flatten)]
    common: CommonOpts,
}

#[derive(Debug, clap::Args)]
pub struct WorkArgs {
    #[arg(long, value_name = "DIR")]
    data: PathBuf,
    /// Handlers running at once, over all owned shards.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Most shards to own: a number or `all`.
    #[arg(long, default_value = "1")]
    max_local_shards: String,
    /// Lease length in ms (renewed every third).
    #[arg(long, default_value_t = shardq_fs::membership::LEASE_MS_DEFAULT)]
    lease_ms: u64,
    /// Margin past a lapsed lease before takeover, in ms.
    #[arg(long)]
    clock_skew_ms: Option<u64>,
    /// On SIGINT/SIGTERM, how long to wait for running jobs, in ms; handler
    /// commands still running then are killed (their attempt fails) and
    /// waited for before the worker exits.
    #[arg(long, default_value_t = shardq_core::pool::DRAIN_TIMEOUT_MS_DEFAULT)]
    drain_timeout_ms: u64,
    /// Kill a handler command (its whole process group) that runs longer
    /// than this, in ms; the attempt fails and is retried or dead-lettered.
    #[arg(long, value_name = "MS")]
    job_timeout_ms: Option<u64>,
    /// Job lease of each run, in ms: extended every third of it while the
    /// handler runs; if this worker stops renewing (stopped, partitioned)
    /// the job runs again elsewhere after it, with a larger SHARDQ_FENCE.
    #[arg(long, value_name = "MS", default_value_t = shardq_core::JOB_LEASE_MS_DEFAULT)]
    job_lease_ms: u64,
    /// Exit once the owned shards are idle.
    #[arg(long)]
    exit_when_idle: bool,
    /// After a job's last attempt fails: `continue` with the key's next jobs,
    /// or `halt` the key until its dead jobs are retried or purged.
    #[arg(long, default_value = "continue")]
    on_dead: String,
    /// Test and benchmark only: instead of CMD, append
    /// "KEY JOB_ID ATTEMPT SHARD" lines to FILE (`append:FILE`).
    #[arg(long, hide = true)]
    handler_builtin: Option<String>,
    #[command(flatten)]
    common: CommonOpts,
    /// Command run per job, in a process group of its own that is killed
    /// when the attempt ends (and, on Linux, when the worker dies): payload
    /// on stdin; SHARDQ_KEY, SHARDQ_JOB_ID, SHARDQ_ATTEMPT, SHARDQ_SHARD,
    /// SHARDQ_PAYLOAD_BYTES (the payload's length: compare it with what was
    /// read, a worker that dies mid-write leaves a short stdin) and, where
    /// the backend provides it, SHARDQ_FENCE in its environment. Exit 0 acks,
    /// unless writing the payload failed (other than the handler closing its
    /// stdin early).
    #[arg(last = true)]
    cmd: Vec<String>,
}

pub fn run(cmd: EngineCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        EngineCommand::Init {
            data,
            shards,
            algorithm,
            hash,
            redis,
            redis_cluster,
            join,
        } => {
            let urls = match (redis, redis_cluster) {
                (Some(r), _) => Some(backends::instance_urls(&r)?),
                (None, Some(c)) => Some(vec![backends::cluster_url(&c)?]),
                (None, None) => None,
            };
            match urls {
                None if join => bail!("--join needs --redis or --redis-cluster"),
                None => init(&data, shards, &algorithm, hash.as_deref()),
                Some(urls) => init_redis(&data, shards, &algorithm, hash.as_deref(), &urls, join),
            }
        }
        EngineCommand::Enqueue(args) => enqueue(args),
        EngineCommand::Work(args) => work(args),
        EngineCommand::Status { data, json } => status(&data, json),
        EngineCommand::Dead { data, action } => dead(&data, action),
        EngineCommand::Repair { data, shard } => repair(&data, &shard),
    }
}

fn engine_options(common: &CommonOpts) -> anyhow::Result<EngineOptions> {
    let durability = match common.durability.as_str() {
        "fsync" => Durability::Fsync,
        "interval" => Durability::Interval {
            ms: common.interval_ms,
        },
        "none" => Durability::None,
        other => bail!("invalid --durability {other:?}: expected fsync, interval or none"),
    };
    if common.payload_bytes_max > shardq_core::PAYLOAD_BYTES_LIMIT {
        bail!(
            "invalid --payload-bytes-max {}: at most {}",
            common.payload_bytes_max,
            shardq_core::PAYLOAD_BYTES_LIMIT
        );
    }
    if common.segment_bytes < 4096 {
        bail!(
            "invalid --segment-bytes {}: at least 4096",
            common.segment_bytes
        );
    }
    Ok(EngineOptions {
        durability,
        payload_bytes_max: common.payload_bytes_max,
        segment_bytes_max: common.segment_bytes,
        ..EngineOptions::default()
    })
}

fn init(
    dir: &Path,
    shards: usize,
    algorithm: &str,
    hash: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let map = init_map(shards, algorithm, hash)?;
    Engine::init(dir, &map)?;
    println!(
        "initialised {} with {shards} shards (map version {})",
        dir.display(),
        map.version
    );
    Ok(ExitCode::SUCCESS)
}

/// The version-1 map `init` creates: shard-0..shard-(N-1).
fn init_map(shards: usize, algorithm: &str, hash: Option<&str>) -> anyhow::Result<ShardMap> {
    if shards == 0 || shards > INIT_SHARDS_MAX {
        bail!("invalid --shards {shards}: must be 1..={INIT_SHARDS_MAX}");
    }
    let algorithm: Algorithm = algorithm
        .parse()
        .map_err(|e| anyhow::anyhow!("invalid --algorithm {algorithm:?}: {e}"))?;
    let names: Vec<String> = (0..shards).map(|i| format!("shard-{i}")).collect();
    let mut map = ShardMap::with_shards(algorithm, names).context("building the shard map")?;
    if let Some(h) = hash {
        map.hash = h
            .parse::<HashFn>()
            .map_err(|e| anyhow::anyhow!("invalid --hash {h:?}: {e}"))?;
        map.validate().context("checking the shard map")?;
    }
    Ok(map)
}

/// `init --redis`/`--redis-cluster`: publishes the map in Redis (or joins
/// the one there) and makes `dir` a Redis data dir (remote.json + cache).
fn init_redis(
    dir: &Path,
    shards: usize,
    algorithm: &str,
    hash: Option<&str>,
    urls: &[String],
    join: bool,
) -> anyhow::Result<ExitCode> {
    let mut map = init_map(shards, algorithm, hash)?;
    for (i, s) in map.shards.iter_mut().enumerate() {
        s.url = Some(urls[i % urls.len()].clone());
    }
    map.validate().context("checking the shard map")?;
    if dir.exists() {
        let mut entries =
            std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
        if entries.next().is_some() {
            bail!(
                "cannot initialise {}: the directory is not empty",
                dir.display()
            );
        }
    }
    // Every shard's server must answer before anything is written.
    RedisBackend::open(&map, RedisOptions::default())?;
    let remote = backends::Remote::new(&urls[0]);
    let store = RedisMapStore::open(&remote.map_url)?;
    let (map, joined) = match store.load_map()? {
        None => match store.publish_map(&map, 0) {
            Ok(()) => (map, false),
            // Another init won the race: join its map like any later one.
            Err(shardq_redis::RedisError::VersionConflict { .. }) => {
                (store.load_map()?.context("the shard map vanished")?, true)
            }
            Err(e) => return Err(e.into()),
        },
        Some(existing) => (existing, true),
    };
    if joined && !join {
        let same = |m: &ShardMap| -> Vec<(String, Option<String>)> {
            m.shards
                .iter()
                .map(|s| (s.name.clone(), s.url.clone()))
                .collect()
        };
        let mine = init_map(shards, algorithm, hash)?;
        let wanted: Vec<(String, Option<String>)> = mine
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), Some(urls[i % urls.len()].clone())))
            .collect();
        if same(&map) != wanted || map.algorithm != mine.algorithm || map.hash != mine.hash {
            bail!(
                "Redis at {} already holds a different shard map (version {}, {} shards); pass --join to use it from this data dir",
                remote.map_url,
                map.version,
                map.shards.len()
            );
        }
    }
    backends::check_all(&map, true)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    shardq_fs::layout::write_atomic(
        &dir.join(backends::MAP_CACHE_FILE),
        map.to_yaml().as_bytes(),
    )
    .with_context(|| format!("writing {}", dir.join(backends::MAP_CACHE_FILE).display()))?;
    remote.write(dir)?;
    let verb = if joined { "joined" } else { "initialised" };
    println!(
        "{verb} {} with {} shards on Redis (map version {}, published at {})",
        dir.display(),
        map.shards.len(),
        map.version,
        remote.map_url
    );
    Ok(ExitCode::SUCCESS)
}

/// What one placement call stored: `(index in the call, shard, id)` per
/// stored job, in input order, and the error that stopped the call, if any
/// (every job not listed was NOT stored).
struct Stored {
    placed: Vec<(usize, String, JobId)>,
    error: Option<anyhow::Error>,
}

impl Stored {
    /// Splits a producer's answer into what landed and what stopped it.
    fn from_produce(result: Result<Vec<Placed>, ProduceError>, offset: usize) -> Stored {
        let list = |p: Vec<Placed>| -> Vec<(usize, String, JobId)> {
            p.into_iter()
                .map(|p| (offset + p.index, p.shard, p.id))
                .collect()
        };
        match result {
            Ok(p) => Stored {
                placed: list(p),
                error: None,
            },
            Err(ProduceError::Partial { placed, cause }) => Stored {
                placed: list(placed),
                error: Some(anyhow::Error::new(*cause)),
            },
            Err(ProduceError::PausedTooLong {
                keys,
                shard,
                limit_ms,
                placed,
            }) => Stored {
                placed: list(placed),
                error: Some(anyhow::anyhow!(
                    "keys {keys:?} stayed paused for more than {limit_ms} ms (the first on shard {shard:?}): they are being moved and their old shard has not drained"
                )),
            },
            Err(e) => Stored {
                placed: Vec::new(),
                error: Some(e.into()),
            },
        }
    }
}

/// Places a batch of jobs (routing, fencing, retries); see [`Stored`].
type Place<'a> = dyn FnMut(&[NewJob]) -> Stored + 'a;

fn enqueue(args: EnqueueArgs) -> anyhow::Result<ExitCode> {
    match backends::kind(&args.data)? {
        backends::Kind::Embedded => {
            let engine = Engine::open(&args.data, engine_options(&args.common)?)?;
            let backend = engine.backend();
            // The engine's own enqueue_batch folds a partial result into one
            // error string; the producer reports which jobs landed.
            let store: Arc<dyn MapStore> = Arc::new(FileMapStore::open(&args.data)?);
            let mut producer =
                Producer::new(Arc::clone(&backend), store, ProducerOptions::default())?;
            enqueue_with(&args, &mut |jobs| {
                let mut stored = Stored::from_produce(producer.enqueue_batch(jobs), 0);
                if !stored.placed.is_empty() {
                    if let Err(e) = backend.flush() {
                        let e = anyhow::Error::new(e).context(
                            "syncing the jobs listed above to disk failed: they are written but may not survive a crash",
                        );
                        stored.error = Some(match stored.error.take() {
                            None => e,
                            Some(first) => first.context(format!("{e:#}")),
                        });
                    }
                }
                stored
            })
        }
        backends::Kind::Redis(remote) => {
            let env = backends::open_redis(&args.data, &remote, redis_options(&args.common)?)?;
            let mut producer = Producer::new(
                Arc::new(env.backend.clone()),
                env.maps.clone() as Arc<dyn MapStore>,
                ProducerOptions::default(),
            )?;
            enqueue_with(&args, &mut |jobs| {
                let mut all = Stored {
                    placed: Vec::with_capacity(jobs.len()),
                    error: None,
                };
                // One script per shard per call is bounded; chunks keep each
                // key's order since they go in one after another, and the
                // first error stops the rest.
                for (n, chunk) in jobs.chunks(shardq_redis::ENQUEUE_BATCH_MAX).enumerate() {
                    let offset = n * shardq_redis::ENQUEUE_BATCH_MAX;
                    let stored = Stored::from_produce(producer.enqueue_batch(chunk), offset);
                    all.placed.extend(stored.placed);
                    if stored.error.is_some() {
                        all.error = stored.error;
                        break;
                    }
                }
                all
            })
        }
    }
}

/// `1-3, 7, 9-12`: sorted line numbers as ranges.
fn line_ranges(lines: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let first = lines[i];
        let mut last = first;
        while i + 1 < lines.len() && lines[i + 1] == last + 1 {
            i += 1;
            last = lines[i];
        }
        out.push(if first == last {
            first.to_string()
        } else {
            format!("{first}-{last}")
        });
        i += 1;
    }
    out.join(", ")
}

/// Where the unsent rest of stdin starts, for an error message.
enum Rest {
    /// Input ended: nothing after the batch.
    None,
    /// This line (it exists) and every one after it.
    From(u64),
    /// Every line from this one on, if the input has any (not read yet).
    FromIfAny(u64),
}

/// Which stdin lines were not enqueued: `missed` (sorted) and the rest.
fn not_enqueued(missed: &[u64], rest: Rest) -> String {
    let rest = match rest {
        Rest::None => None,
        Rest::From(r) => Some(format!("{r} and every line after it")),
        Rest::FromIfAny(r) => Some(format!("every line from {r} on (if the input has more)")),
    };
    match (missed.is_empty(), rest) {
        (true, None) => "none".to_string(),
        (false, None) => line_ranges(missed),
        (true, Some(r)) => r,
        (false, Some(r)) => format!("{}, and {r}", line_ranges(missed)),
    }
}

fn enqueue_with(args: &EnqueueArgs, place: &mut Place<'_>) -> anyhow::Result<ExitCode> {
    if !args.stdin {
        let key = args.key.clone().unwrap_or_default();
        let job = NewJob {
            key,
            payload: args.payload.clone().unwrap_or_default().into_bytes(),
            delay_ms: args.delay_ms,
            max_attempts: args.max_attempts,
        };
        let stored = place(std::slice::from_ref(&job));
        if let Some((_, shard, id)) = stored.placed.first() {
            println!("{shard}\t{id}");
        }
        return match stored.error {
            Some(e) if stored.placed.is_empty() => Err(e.context("the job was NOT enqueued")),
            Some(e) => Err(e),
            None if stored.placed.is_empty() => bail!("an enqueue returned no id"),
            None => Ok(ExitCode::SUCCESS),
        };
    }
    let stdin = io::stdin();
    let mut reader = io::BufReader::with_capacity(1 << 16, stdin.lock());
    let mut out = io::BufWriter::new(io::stdout().lock());
    let mut line = Vec::new();
    let mut batch: Vec<NewJob> = Vec::new();
    // The stdin line number of each job of `batch`.
    let mut batch_lines: Vec<u64> = Vec::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        let n = (&mut reader)
            .take(STDIN_LINE_BYTES_MAX as u64 + 1)
            .read_until(b'\n', &mut line)
            .context("reading stdin")?;
        let eof = n == 0;
        // A bad line stops the input; the good lines before it still go in.
        let mut bad: Option<anyhow::Error> = None;
        if !eof {
            line_no += 1;
            match parse_stdin_line(args, &line, line_no) {
                Ok(job) => {
                    batch.push(job);
                    batch_lines.push(line_no);
                }
                Err(e) => bad = Some(e),
            }
        }
        // Send what has arrived once no more is waiting in the buffer, so
        // lines are stored as they arrive and a pipe is never stalled.
        let flush =
            eof || bad.is_some() || batch.len() >= STDIN_BATCH_MAX || reader.buffer().is_empty();
        if flush && !batch.is_empty() {
            let jobs = std::mem::take(&mut batch);
            let lines = std::mem::take(&mut batch_lines);
            let stored = place(&jobs);
            let mut done = vec![false; jobs.len()];
            for (i, shard, id) in &stored.placed {
                writeln!(out, "{}\t{shard}\t{id}", jobs[*i].key)?;
                done[*i] = true;
            }
            out.flush()?;
            if let Some(e) = stored.error {
                let missed: Vec<u64> = lines
                    .iter()
                    .zip(&done)
                    .filter(|(_, d)| !**d)
                    .map(|(l, _)| *l)
                    .collect();
                // A bad line ends the input at that line; otherwise the
                // input continues after the batch's last line unless it
                // ended.
                let rest = match (&bad, eof) {
                    (Some(_), _) => Rest::From(line_no),
                    (None, true) => Rest::None,
                    (None, false) => Rest::FromIfAny(line_no + 1),
                };
                let mut e = e.context(format!(
                    "stdin lines NOT enqueued: {}; every other line was stored and printed",
                    not_enqueued(&missed, rest)
                ));
                if let Some(b) = bad {
                    e = e.context(format!("also: {b:#}"));
                }
                return Err(e);
            }
        }
        if let Some(b) = bad {
            return Err(b.context(format!(
                "stdin lines NOT enqueued: {}; every line before it was stored and printed",
                not_enqueued(&[], Rest::From(line_no))
            )));
        }
        if eof {
            break;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One `KEY<TAB>PAYLOAD` stdin line (with its line ending) as a job.
fn parse_stdin_line(args: &EnqueueArgs, line: &[u8], line_no: u64) -> anyhow::Result<NewJob> {
    if line.len() > STDIN_LINE_BYTES_MAX {
        bail!("stdin line {line_no} is over {STDIN_LINE_BYTES_MAX} bytes");
    }
    let text =
        std::str::from_utf8(line).with_context(|| format!("stdin line {line_no} is not UTF-8"))?;
    let text = text.trim_end_matches(['\n', '\r']);
    let Some((key, payload)) = text.split_once('\t') else {
        bail!("stdin line {line_no} {text:?} has no TAB: expected KEY<TAB>PAYLOAD");
    };
    let job = NewJob {
        key: key.to_string(),
        payload: payload.as_bytes().to_vec(),
        delay_ms: args.delay_ms,
        max_attempts: args.max_attempts,
    };
    job.validate(args.common.payload_bytes_max)
        .with_context(|| format!("stdin line {line_no}"))?;
    Ok(job)
}

fn work(args: WorkArgs) -> anyhow::Result<ExitCode> {
    if args.concurrency == 0 || args.concurrency > shardq_core::pool::CONCURRENCY_MAX {
        bail!(
            "invalid --concurrency {}: must be 1..={}",
            args.concurrency,
            shardq_core::pool::CONCURRENCY_MAX
        );
    }
    let max_local_shards = match args.max_local_shards.as_str() {
        "all" => usize::MAX,
        n => match n.parse::<usize>() {
            Ok(v) if v > 0 => v,
            _ => bail!("invalid --max-local-shards {n:?}: a number from 1, or `all`"),
        },
    };
    let dead_policy = match args.on_dead.as_str() {
        "continue" => DeadPolicy::Continue,
        "halt" => DeadPolicy::Halt,
        other => bail!("invalid --on-dead {other:?}: expected continue or halt"),
    };
    let job_timeout = match args.job_timeout_ms {
        None => None,
        Some(ms) if (1..=handler_proc::JOB_TIMEOUT_MS_MAX).contains(&ms) => {
            Some(Duration::from_millis(ms))
        }
        Some(ms) => bail!(
            "invalid --job-timeout-ms {ms}: must be 1..={}",
            handler_proc::JOB_TIMEOUT_MS_MAX
        ),
    };
    shardq_core::validate_job_lease_ms(args.job_lease_ms)
        .map_err(|e| anyhow::anyhow!("--job-lease-ms: {e}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let handler: Arc<shardq_core::Handler> = match (&args.handler_builtin, args.cmd.is_empty()) {
        (Some(_), _) if job_timeout.is_some() => {
            bail!("--job-timeout-ms applies to a handler command, not --handler-builtin")
        }
        (Some(spec), true) => builtin_handler(spec)?,
        (Some(_), false) => bail!("give either --handler-builtin or a command after --, not both"),
        (None, true) => bail!(
            "no handler command: give it after --, e.g. `shardq work --data DIR -- ./handle.sh`"
        ),
        (None, false) => command_handler(args.cmd.clone()),
    };
    let redis = match backends::kind(&args.data)? {
        backends::Kind::Embedded => None,
        backends::Kind::Redis(remote) => Some(remote),
    };
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let mut pool = pool_options(&args);
    pool.job_timeout_ms = job_timeout.map(|d| d.as_millis() as u64);
    pool.job_lease_ms = args.job_lease_ms;
    // The pool cancels runs past the job timeout, on a lost shard and past
    // the drain timeout; a cancelled handler command is killed and waited
    // for, and the pool gives no shard up before its handlers returned.
    let report = run_pool(
        &args,
        redis,
        dead_policy,
        max_local_shards,
        pool,
        handler,
        &stop,
    );
    let report = report?;
    eprintln!(
        "shardq: done: {} acked, {} retried, {} dead, {} stopped at the drain timeout, {} timed out, {} stale results refused",
        report.acked, report.retried, report.dead, report.abandoned, report.timed_out, report.stale
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs the worker pool on the data dir's backend until `stop` (or idle).
fn run_pool(
    args: &WorkArgs,
    redis: Option<backends::Remote>,
    dead_policy: DeadPolicy,
    max_local_shards: usize,
    pool: PoolOptions,
    handler: Arc<shardq_core::Handler>,
    stop: &AtomicBool,
) -> anyhow::Result<shardq_core::PoolReport> {
    let report = match redis {
        None => {
            let mut opts = engine_options(&args.common)?;
            opts.dead_policy = dead_policy;
            let engine = Engine::open(&args.data, opts)?;
            let member = MemberOptions {
                lease_ms: args.lease_ms,
                clock_skew_ms: args
                    .clock_skew_ms
                    .unwrap_or(shardq_fs::membership::CLOCK_SKEW_MS_DEFAULT.min(args.lease_ms / 2)),
                max_local_shards,
                ..MemberOptions::default()
            };
            engine.run_workers(member, pool, handler, stop)?
        }
        Some(remote) => {
            // Leases use the Redis server's clock, so --clock-skew-ms has
            // nothing to correct.
            let mut opts = redis_options(&args.common)?;
            opts.dead_policy = dead_policy;
            let env = backends::open_redis(&args.data, &remote, opts)?;
            let max_shards = if max_local_shards == usize::MAX {
                0
            } else {
                max_local_shards
            };
            let mut coordinator = backends::FollowMap::new(&env, args.lease_ms, max_shards)?;
            let backend: Arc<dyn QueueBackend> = Arc::new(env.backend.clone());
            WorkerPool::run(
                backend,
                &mut coordinator,
                handler,
                Arc::new(SystemClock),
                pool,
                stop,
            )?
        }
    };
    Ok(report)
}

fn pool_options(args: &WorkArgs) -> PoolOptions {
    PoolOptions {
        concurrency: args.concurrency,
        drain_timeout_ms: args.drain_timeout_ms,
        exit_when_idle: args.exit_when_idle,
        on_event: Arc::new(|ev| {
            match ev {
            PoolEvent::Standby(reason) => eprintln!("shardq: standby: {reason}"),
            PoolEvent::Gained(s) => eprintln!("shardq: claimed {s}"),
            PoolEvent::Lost(s) => eprintln!("shardq: lost {s} (lease taken over)"),
            PoolEvent::Draining { in_flight } => {
                eprintln!("shardq: draining: waiting for {in_flight} running jobs")
            }
            PoolEvent::RecordFailed(e) => eprintln!("shardq: warning: {e}"),
            PoolEvent::Cancelling { running } => eprintln!(
                "shardq: drain timeout: stopping {running} running handlers (killed and waited for before the shards are released)"
            ),
            PoolEvent::ShardFailed { shard, error } => eprintln!(
                "shardq: error: shard {shard} stopped: {error} (the other shards keep running; retrying it every {} s)",
                shardq_core::pool::SHARD_RETRY_MS / 1000
            ),
            PoolEvent::ShardRecovered(s) => eprintln!("shardq: shard {s} serves again"),
            other => eprintln!("shardq: {other:?}"),
        }
        }),
        ..PoolOptions::default()
    }
}

/// Redis options from the common flags; durability is Redis's own
/// configuration (appendonly, appendfsync), so `--durability` is not used.
fn redis_options(common: &CommonOpts) -> anyhow::Result<RedisOptions> {
    if common.payload_bytes_max > shardq_core::PAYLOAD_BYTES_LIMIT {
        bail!(
            "invalid --payload-bytes-max {}: at most {}",
            common.payload_bytes_max,
            shardq_core::PAYLOAD_BYTES_LIMIT
        );
    }
    Ok(RedisOptions {
        payload_bytes_max: common.payload_bytes_max,
        ..RedisOptions::default()
    })
}

/// A handler running `cmd` once per job (see `handler_proc`): killed, and
/// waited for, once the pool cancels the run (job timeout, lost shard,
/// drain timeout); the error then says why.
fn command_handler(cmd: Vec<String>) -> Arc<shardq_core::Handler> {
    Arc::new(move |job: &ClaimedJob| {
        let run = shardq_core::current_run();
        let cancelled = || run.as_ref().is_some_and(|r| r.is_cancelled());
        match handler_proc::run_job_command(&cmd, job, &cancelled, None) {
            Err(_) if cancelled() => Err(format!(
                "killed: {}",
                run.as_ref().map(|r| r.cancel_reason()).unwrap_or_default()
            )),
            other => other,
        }
    })
}

fn builtin_handler(spec: &str) -> anyhow::Result<Arc<shardq_core::Handler>> {
    let Some(path) = spec.strip_prefix("append:") else {
        bail!("invalid --handler-builtin {spec:?}: expected append:FILE");
    };
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {path}"))?;
    let file = Mutex::new(file);
    Ok(Arc::new(move |job: &ClaimedJob| {
        let line = format!("{} {} {} {}\n", job.key, job.id, job.attempt, job.shard);
        // One write per line on an O_APPEND file: a kill leaves whole lines.
        let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
        f.write_all(line.as_bytes()).map_err(|e| e.to_string())
    }))
}

/// `status` output: every shard of the map, read one by one so that a
/// shard that cannot be read is reported instead of hiding the others.
#[derive(Debug, serde::Serialize)]
struct StatusReport {
    /// Per shard, in map order.
    shards: Vec<ShardRow>,
    /// Sums over the shards that could be read.
    totals: StatusTotals,
    /// Names of the shards that could not be read.
    failed: Vec<String>,
}

/// One shard in `status`: counts are `None` when the shard could not be
/// read, and `error` says why.
#[derive(Debug, serde::Serialize)]
struct ShardRow {
    name: String,
    ready: Option<u64>,
    delayed: Option<u64>,
    in_flight: Option<u64>,
    dead: Option<u64>,
    owner: Option<String>,
    lease_expires_ms: Option<u64>,
    error: Option<String>,
}

/// Owner and lease end of a shard.
type Lease = (Option<String>, Option<u64>);

/// Reads every shard in `names` with `stats` and `lease`; a failure of one
/// shard is recorded on its row and the next shard is read.
fn collect_status(
    names: &[String],
    stats: &dyn Fn(&str) -> Result<ShardStats, QueueError>,
    lease: &dyn Fn(&str) -> Result<Lease, QueueError>,
) -> StatusReport {
    let mut report = StatusReport {
        shards: Vec::with_capacity(names.len()),
        totals: StatusTotals::default(),
        failed: Vec::new(),
    };
    for name in names {
        let (owner, lease_expires_ms, lease_err) = match lease(name) {
            Ok((o, l)) => (o, l, None),
            Err(e) => (None, None, Some(format!("reading the lease: {e}"))),
        };
        let mut row = ShardRow {
            name: name.clone(),
            ready: None,
            delayed: None,
            in_flight: None,
            dead: None,
            owner,
            lease_expires_ms,
            error: lease_err,
        };
        match stats(name) {
            Ok(st) => {
                report.totals.ready += st.ready;
                report.totals.delayed += st.delayed;
                report.totals.in_flight += st.in_flight;
                report.totals.dead += st.dead;
                row.ready = Some(st.ready);
                row.delayed = Some(st.delayed);
                row.in_flight = Some(st.in_flight);
                row.dead = Some(st.dead);
            }
            Err(e) => {
                row.error = Some(match row.error.take() {
                    None => e.to_string(),
                    Some(first) => format!("{e}; {first}"),
                })
            }
        }
        if row.error.is_some() {
            report.failed.push(name.clone());
        }
        report.shards.push(row);
    }
    report
}

fn status(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let st = match backends::kind(dir)? {
        backends::Kind::Embedded => {
            let engine = Engine::open(dir, EngineOptions::default())?;
            let m = shardq_fs::layout::read_membership(dir)?;
            let names: Vec<String> = engine
                .router()
                .map()
                .shards
                .iter()
                .map(|s| s.name.clone())
                .collect();
            let backend = engine.backend();
            collect_status(&names, &|name| backend.shard_stats(name), &|name| {
                let entry = m.shards.get(name);
                let owner = entry.and_then(|e| e.owner.clone());
                let until = owner.as_ref().and(entry.map(|e| e.lease_expires_ms));
                Ok((owner, until))
            })
        }
        backends::Kind::Redis(remote) => {
            let env = backends::open_redis(dir, &remote, RedisOptions::default())?;
            // Counts per shard of the published map; owners and lease ends
            // (server clock) from the leases.
            let names: Vec<String> = env
                .maps
                .load()?
                .shards
                .iter()
                .map(|s| s.name.clone())
                .collect();
            collect_status(&names, &|name| env.backend.shard_stats(name), &|name| {
                let lease = env.backend.lease_holder(name)?;
                Ok((lease.as_ref().map(|l| l.0.clone()), lease.map(|l| l.1)))
            })
        }
    };
    if json {
        println!("{}", serde_json::to_string(&st)?);
    } else {
        print_status_table(&st);
    }
    if st.failed.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for row in st.shards.iter().filter(|r| r.error.is_some()) {
        eprintln!(
            "shardq: error: shard {:?}: {}",
            row.name,
            row.error.as_deref().unwrap_or_default()
        );
    }
    eprintln!(
        "shardq: status: {} of {} shards could not be read ({}); the totals count only the counts shown",
        st.failed.len(),
        st.shards.len(),
        st.failed.join(", ")
    );
    Ok(ExitCode::from(2))
}

fn print_status_table(st: &StatusReport) {
    let count = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>8}  {:<28} LEASE_EXPIRES_MS",
        "SHARD", "READY", "DELAYED", "IN_FLIGHT", "DEAD", "OWNER"
    );
    for s in &st.shards {
        println!(
            "{:<12} {:>10} {:>10} {:>10} {:>8}  {:<28} {}",
            s.name,
            count(s.ready),
            count(s.delayed),
            count(s.in_flight),
            count(s.dead),
            s.owner.as_deref().unwrap_or("-"),
            s.lease_expires_ms
                .map_or("-".to_string(), |v| v.to_string())
        );
        if let Some(e) = &s.error {
            println!("{:<12} FAILED: {e}", "");
        }
    }
    let t = &st.totals;
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>8}",
        "total", t.ready, t.delayed, t.in_flight, t.dead
    );
}

fn dead(dir: &Path, action: DeadAction) -> anyhow::Result<ExitCode> {
    let (backend, all): (Arc<dyn QueueBackend>, Vec<String>) = match backends::kind(dir)? {
        backends::Kind::Embedded => {
            let engine = Engine::open(dir, EngineOptions::default())?;
            let all = engine
                .router()
                .map()
                .shards
                .iter()
                .map(|s| s.name.clone())
                .collect();
            (engine.backend(), all)
        }
        backends::Kind::Redis(remote) => {
            let env = backends::open_redis(dir, &remote, RedisOptions::default())?;
            let all = env
                .maps
                .load()?
                .shards
                .iter()
                .map(|s| s.name.clone())
                .collect();
            (Arc::new(env.backend), all)
        }
    };
    let pick = |shard: &Option<String>| -> anyhow::Result<Vec<String>> {
        match shard {
            None => Ok(all.clone()),
            Some(s) if all.contains(s) => Ok(vec![s.clone()]),
            Some(s) => bail!("unknown --shard {s:?}: the map has {}", all.join(", ")),
        }
    };
    match action {
        DeadAction::List { shard } => {
            for s in pick(&shard)? {
                for d in backend.dead_list(&s, usize::MAX)? {
                    println!(
                        "{}\t{}\t{}\t{}\t{}",
                        d.shard, d.id, d.key, d.attempts, d.reason
                    );
                }
            }
        }
        DeadAction::Retry { shard, id } => {
            let ids: Vec<JobId> = id.into_iter().map(JobId).collect();
            let mut n = 0;
            for s in pick(&shard)? {
                n += backend.dead_retry(&s, (!ids.is_empty()).then_some(&ids[..]))?;
            }
            println!("retried {n} dead jobs");
        }
        DeadAction::Purge { shard, id } => {
            let ids: Vec<JobId> = id.into_iter().map(JobId).collect();
            let mut n = 0;
            for s in pick(&shard)? {
                n += backend.dead_purge(&s, (!ids.is_empty()).then_some(&ids[..]))?;
            }
            println!("purged {n} dead jobs");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn repair(dir: &Path, shard: &str) -> anyhow::Result<ExitCode> {
    if let backends::Kind::Redis(remote) = backends::kind(dir)? {
        bail!(
            "repair cuts corrupt records out of the embedded engine's logs; the shards of {} live on Redis ({}), which has no such log: check the server's own persistence instead",
            dir.display(),
            remote.map_url
        );
    }
    let report = shardq_fs::repair::repair(dir, shard)?;
    if report.cuts.is_empty() {
        println!("shard {shard}: no corruption found");
    }
    for cut in &report.cuts {
        println!(
            "shard {shard}: segment {} offset {}: cut {} bytes ({}); saved to {}",
            cut.segment,
            cut.offset,
            cut.bytes,
            cut.reason,
            cut.saved_to.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
