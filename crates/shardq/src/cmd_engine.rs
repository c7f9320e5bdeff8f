//! The queue's commands: init, enqueue, work, status, dead, repair.
//!
//! Glue over `shardq-fs` or `shardq-redis`, whichever the data dir's shards
//! live on (`backends` decides): parse, check input, call the library,
//! print, with the same output either way. Bad input gets an error naming
//! the option and value; nothing here writes a log record or a Redis key
//! itself.

use std::fs::OpenOptions;
use std::io::{self, BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use clap::Subcommand;
use shardq_core::producer::{Producer, ProducerOptions};
use shardq_core::reshard::MapStore;
use shardq_core::{
    ClaimedJob, DeadPolicy, JobId, NewJob, PoolEvent, PoolOptions, QueueBackend, SystemClock,
    WorkerPool,
};
use shardq_fs::{
    Durability, Engine, EngineOptions, MemberOptions, ShardStatus, Status, StatusTotals,
};
use shardq_redis::{RedisBackend, RedisMapStore, RedisOptions};
use shardq_route::{Algorithm, HashFn, ShardMap};

use crate::backends;

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
    /// each job once it is stored.
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
    /// On SIGINT/SIGTERM, how long to wait for running jobs, in ms.
    #[arg(long, default_value_t = shardq_core::pool::DRAIN_TIMEOUT_MS_DEFAULT)]
    drain_timeout_ms: u64,
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
    /// Command run per job: payload on stdin; SHARDQ_KEY, SHARDQ_JOB_ID,
    /// SHARDQ_ATTEMPT, SHARDQ_SHARD in its environment. Exit 0 acks.
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

/// Places a batch of jobs (routing, fencing, retries) and returns shard and
/// id per job, in order, once they are stored.
type Place<'a> = dyn FnMut(Vec<NewJob>) -> anyhow::Result<Vec<(String, JobId)>> + 'a;

fn enqueue(args: EnqueueArgs) -> anyhow::Result<ExitCode> {
    match backends::kind(&args.data)? {
        backends::Kind::Embedded => {
            let engine = Engine::open(&args.data, engine_options(&args.common)?)?;
            enqueue_with(&args, &mut |jobs| {
                let placed = engine.enqueue_batch(jobs)?;
                engine.backend().flush()?;
                Ok(placed)
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
                let mut out = Vec::with_capacity(jobs.len());
                // One script per shard per call is bounded; chunks keep each
                // key's order since they go in one after another.
                for chunk in jobs.chunks(shardq_redis::ENQUEUE_BATCH_MAX) {
                    for p in producer.enqueue_batch(chunk)? {
                        out.push((p.shard, p.id));
                    }
                }
                Ok(out)
            })
        }
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
        let (shard, id) = place(vec![job])?
            .pop()
            .context("an enqueue returned no id")?;
        println!("{shard}\t{id}");
        return Ok(ExitCode::SUCCESS);
    }
    let stdin = io::stdin();
    let mut reader = io::BufReader::with_capacity(1 << 16, stdin.lock());
    let mut out = io::BufWriter::new(io::stdout().lock());
    let mut line = Vec::new();
    let mut batch: Vec<NewJob> = Vec::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        let n = (&mut reader)
            .take(STDIN_LINE_BYTES_MAX as u64 + 1)
            .read_until(b'\n', &mut line)
            .context("reading stdin")?;
        let eof = n == 0;
        if !eof {
            line_no += 1;
            if line.len() > STDIN_LINE_BYTES_MAX {
                bail!("stdin line {line_no} is over {STDIN_LINE_BYTES_MAX} bytes; nothing from it was enqueued");
            }
            let text = std::str::from_utf8(&line)
                .with_context(|| format!("stdin line {line_no} is not UTF-8"))?;
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
            batch.push(job);
        }
        // Send what has arrived once no more is waiting in the buffer, so
        // lines are stored as they arrive and a pipe is never stalled.
        let flush = eof || batch.len() >= STDIN_BATCH_MAX || reader.buffer().is_empty();
        if flush && !batch.is_empty() {
            let jobs = std::mem::take(&mut batch);
            let keys: Vec<String> = jobs.iter().map(|j| j.key.clone()).collect();
            let placed = place(jobs)?;
            for (key, (shard, id)) in keys.iter().zip(placed) {
                writeln!(out, "{key}\t{shard}\t{id}")?;
            }
            out.flush()?;
        }
        if eof {
            break;
        }
    }
    Ok(ExitCode::SUCCESS)
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
    let handler: Arc<shardq_core::Handler> = match (&args.handler_builtin, args.cmd.is_empty()) {
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
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let pool = pool_options(&args);
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
            engine.run_workers(member, pool, handler, &stop)?
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
                &stop,
            )?
        }
    };
    eprintln!(
        "shardq: done: {} acked, {} retried, {} dead, {} abandoned",
        report.acked, report.retried, report.dead, report.abandoned
    );
    Ok(ExitCode::SUCCESS)
}

fn pool_options(args: &WorkArgs) -> PoolOptions {
    PoolOptions {
        concurrency: args.concurrency,
        drain_timeout_ms: args.drain_timeout_ms,
        exit_when_idle: args.exit_when_idle,
        on_event: Arc::new(|ev| match ev {
            PoolEvent::Standby(reason) => eprintln!("shardq: standby: {reason}"),
            PoolEvent::Gained(s) => eprintln!("shardq: claimed {s}"),
            PoolEvent::Lost(s) => eprintln!("shardq: lost {s} (lease taken over)"),
            PoolEvent::Draining { in_flight } => {
                eprintln!("shardq: draining: waiting for {in_flight} running jobs")
            }
            PoolEvent::RecordFailed(e) => eprintln!("shardq: warning: {e}"),
            other => eprintln!("shardq: {other:?}"),
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

fn command_handler(cmd: Vec<String>) -> Arc<shardq_core::Handler> {
    Arc::new(move |job: &ClaimedJob| {
        let mut child = Command::new(&cmd[0])
            .args(&cmd[1..])
            .env("SHARDQ_KEY", &job.key)
            .env("SHARDQ_JOB_ID", job.id.to_string())
            .env("SHARDQ_ATTEMPT", job.attempt.to_string())
            .env("SHARDQ_SHARD", &job.shard)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {:?}: {e}", cmd[0]))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A handler that does not read its stdin is fine.
            let _ = stdin.write_all(&job.payload);
        }
        let status = child
            .wait()
            .map_err(|e| format!("waiting for {:?}: {e}", cmd[0]))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("{:?} exited with {status}", cmd[0]))
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

fn status(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let st = match backends::kind(dir)? {
        backends::Kind::Embedded => Engine::open(dir, EngineOptions::default())?.status()?,
        backends::Kind::Redis(remote) => redis_status(&backends::open_redis(
            dir,
            &remote,
            RedisOptions::default(),
        )?)?,
    };
    if json {
        println!("{}", serde_json::to_string(&st)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>8}  {:<28} LEASE_EXPIRES_MS",
        "SHARD", "READY", "DELAYED", "IN_FLIGHT", "DEAD", "OWNER"
    );
    for s in &st.shards {
        println!(
            "{:<12} {:>10} {:>10} {:>10} {:>8}  {:<28} {}",
            s.name,
            s.ready,
            s.delayed,
            s.in_flight,
            s.dead,
            s.owner.as_deref().unwrap_or("-"),
            s.lease_expires_ms
                .map_or("-".to_string(), |v| v.to_string())
        );
    }
    let t = &st.totals;
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>8}",
        "total", t.ready, t.delayed, t.in_flight, t.dead
    );
    Ok(ExitCode::SUCCESS)
}

/// The embedded engine's status, from Redis: counts per shard of the
/// published map, owners and lease ends (server clock) from the leases.
fn redis_status(env: &backends::RedisEnv) -> anyhow::Result<Status> {
    let map = env.maps.load()?;
    let mut shards = Vec::new();
    let mut totals = StatusTotals::default();
    for s in &map.shards {
        let st = env.backend.shard_stats(&s.name)?;
        let lease = env.backend.lease_holder(&s.name)?;
        totals.ready += st.ready;
        totals.delayed += st.delayed;
        totals.in_flight += st.in_flight;
        totals.dead += st.dead;
        shards.push(ShardStatus {
            name: s.name.clone(),
            ready: st.ready,
            delayed: st.delayed,
            in_flight: st.in_flight,
            dead: st.dead,
            owner: lease.as_ref().map(|l| l.0.clone()),
            lease_expires_ms: lease.map(|l| l.1),
        });
    }
    Ok(Status { shards, totals })
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
