//! The queue's commands: init, enqueue, work, status, dead, repair.
//!
//! Glue over `shardq-deploy`, which opens the data dir's shards wherever
//! they live (embedded engine or Redis): parse, check input, call the
//! library, print, with the same output either way. Bad input gets an error naming
//! the option and value; nothing here writes a log record or a Redis key
//! itself. `work` runs handler commands through `shardq-worker`, which also
//! checks the options of its handlers (`WorkOptions::validate`).

use std::fs::OpenOptions;
use std::io::{self, BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use clap::Subcommand;
use shardq_core::producer::{Placed, ProduceError, ProducerOptions};
use shardq_core::{ClaimedJob, DeadPolicy, JobId, NewJob, PoolEvent, PoolOptions, WorkerPool};
use shardq_deploy::spec::{cluster_url, init_map, instance_urls};
use shardq_deploy::{Deployment, StatusReport, WorkerOptions};
use shardq_fs::{Durability, EngineOptions};
use shardq_redis::RedisOptions;
use shardq_worker::WorkOptions;

/// Most jobs sent as one batch by `enqueue --stdin`.
const STDIN_BATCH_MAX: usize = 4096;
/// Longest `KEY<TAB>PAYLOAD` line, in bytes (payload limit plus key and tab).
const STDIN_LINE_BYTES_MAX: usize = shardq_core::PAYLOAD_BYTES_LIMIT + 2048;

#[derive(Debug, Subcommand)]
pub enum EngineCommand {
    /// Create a data dir with shards shard-0..shard-(N-1) and map version 1.
    Init {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Number of shards.
        #[arg(long)]
        shards: usize,
        /// Routing algorithm (rendezvous, ring, jump, modulo, slots).
        #[arg(long, default_value = "rendezvous")]
        algorithm: String,
        /// Hash function (blake2b64, xxh64, xxh3, murmur3, fnv1a64, crc16).
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
        /// With --redis/--redis-cluster: attach this data dir to the
        /// deployment already in the namespace (another data dir's), using
        /// its map, instead of creating one (init refuses a namespace in use).
        #[arg(long)]
        join: bool,
        /// With --redis/--redis-cluster: the deployment's namespace, the
        /// prefix of every key it writes, so several deployments can share
        /// one Redis server.
        #[arg(long, default_value = shardq_redis::keys::NAMESPACE_DEFAULT)]
        namespace: String,
    },
    /// Enqueue a job, or `KEY<TAB>PAYLOAD` lines from stdin with --stdin.
    Enqueue(EnqueueArgs),
    /// Run jobs of the shards this process can claim: CMD runs once per job.
    Work(WorkArgs),
    /// Per-shard ready, delayed, in-flight and dead counts, owners, leases,
    /// and the running or last rebalance (who runs it, how far it got).
    ///
    /// A shard that cannot be read (e.g. a corrupt log) is shown with its
    /// error (`"error"` in --json, counts null) and left out of the totals;
    /// the other shards are still shown, and each failed shard's error and
    /// a summary line go to stderr. Exit status 2 if any shard failed, as
    /// for any other error.
    Status {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The dead-letter list: list, retry or purge dead jobs.
    Dead {
        /// Data dir (embedded or Redis); may also follow the action.
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        #[command(subcommand)]
        action: DeadAction,
    },
    /// Cut corrupt records out of a shard's log (saving them to quarantine/),
    /// so it serves again. Reports every byte range it removed.
    Repair {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Shard name, e.g. shard-0.
        shard: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeadAction {
    /// List dead jobs (ID<TAB>KEY<TAB>ATTEMPTS<TAB>REASON, the id as
    /// SHARD:ID; `--json` for one object like `GET /v1/dead`).
    List {
        #[command(flatten)]
        pick: DeadPick,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Put dead jobs back in their keys: `--id SHARD:ID`... or `--all`.
    Retry {
        #[command(flatten)]
        pick: DeadPick,
        #[command(flatten)]
        which: DeadWhich,
    },
    /// Delete dead jobs for good: `--id SHARD:ID`... or `--all`.
    Purge {
        #[command(flatten)]
        pick: DeadPick,
        #[command(flatten)]
        which: DeadWhich,
    },
}

/// Where the dead jobs are.
#[derive(Debug, clap::Args)]
pub struct DeadPick {
    /// Data dir (embedded or Redis), when not given before the action.
    #[arg(long = "data", value_name = "DIR")]
    data: Option<PathBuf>,
    /// Only this shard's dead jobs (e.g. shard-0).
    #[arg(long)]
    shard: Option<String>,
}

/// Which dead jobs a retry or purge changes: named, or all of them (said,
/// never implied).
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct DeadWhich {
    /// A dead job, as SHARD:ID (as `dead list` and the API print it), or a
    /// bare ID with --shard; repeatable.
    #[arg(long)]
    id: Vec<String>,
    /// Every dead job (of --shard, when given).
    #[arg(long)]
    all: bool,
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
    /// Redis only: after every write, wait until N replicas have it (Redis
    /// `WAIT`, at most 1 s), so acknowledged enqueues, claims and acks
    /// survive a failover; a write the replicas do not confirm fails as
    /// retryable (exit 75) and an enqueue is not reported stored. 0: do not
    /// wait.
    #[arg(long, value_name = "N", default_value_t = 0)]
    redis_wait_replicas: u32,
}

#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
    #[arg(long, value_name = "DIR")]
    data: PathBuf,
    /// Routing key.
    #[arg(long, required_unless_present = "stdin", conflicts_with = "stdin")]
    key: Option<String>,
    /// Payload (UTF-8 text); empty if absent.
    #[arg(long)]
    payload: Option<String>,
    /// Read KEY<TAB>PAYLOAD lines from stdin; prints KEY<TAB>SHARD:ID for
    /// each job once it is stored (without `--stdin`: the job's SHARD:ID,
    /// the form `dead`, the API and the clients use). After an error every stored job has been
    /// printed and the error names the stdin lines NOT enqueued (exit 2), so
    /// exactly those can be sent again.
    #[arg(long)]
    stdin: bool,
    /// Earliest start, as a delay in ms.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Attempts before dead-lettering (default: the key's retry policy,
    /// see `shardq retry show`; 5 unless changed).
    #[arg(long, value_name = "N")]
    max_attempts: Option<u32>,
    /// A unique job: while the key's job with this id waits (or, with
    /// `--unique-while running`, waits or runs), nothing is stored and
    /// that job's SHARD:ID is printed.
    #[arg(long, value_name = "ID", conflicts_with = "debounce_id")]
    unique_id: Option<String>,
    /// `queued` (default) or `running`.
    #[arg(long, value_name = "WHEN", requires = "unique_id")]
    unique_while: Option<String>,
    /// A debounced job: the key's waiting job with this id takes this
    /// payload and runs --debounce after this enqueue (never later than
    /// --debounce-max after the burst's first); with none waiting, a new
    /// job. A burst runs once, with its last payload.
    #[arg(
        long,
        value_name = "ID",
        requires = "debounce",
        conflicts_with = "delay_ms"
    )]
    debounce_id: Option<String>,
    /// How long after the burst's last enqueue its job runs: 500ms, 5s, 1m.
    #[arg(long, value_name = "DURATION", requires = "debounce_id")]
    debounce: Option<String>,
    /// The longest a burst holds its job back (default ten times
    /// --debounce, within 1s and 1d).
    #[arg(long, value_name = "DURATION", requires = "debounce_id")]
    debounce_max: Option<String>,
    /// A job of a batch (`shardq batch open` printed its @N; a batch
    /// job's handler finds it in SHARDQ_BATCH, to add more): stored with
    /// the batch in one step, then enqueued on its key by a worker's next
    /// pass. Prints the job's id in the batch, @M (`shardq job show @M`);
    /// with --stdin, KEY<TAB>@M per line, each chunk of lines added at
    /// once.
    #[arg(
        long,
        value_name = "@N",
        conflicts_with_all = ["unique_id", "debounce_id", "after"]
    )]
    batch: Option<String>,
    /// With --batch: a second enqueue of this key with this id into the
    /// batch stores nothing and prints the first one's @M, so a batch job
    /// that adds to its batch and runs again adds nothing twice.
    #[arg(long, value_name = "ID", requires = "batch")]
    dedup_id: Option<String>,
    /// A dependent: the job waits (state `waiting`, on no shard, not
    /// holding up its key) until every job named here has ended, then is
    /// enqueued on its key; ids are SHARD:ID or a dependent's @N, comma
    /// separated, at most 1000. Prints the dependent's id, @N (`shardq job
    /// show @N` lists its dependencies' outcomes and results). A worker or
    /// an owning server must run for it to be released.
    #[arg(
        long,
        value_name = "ID,...",
        value_delimiter = ',',
        conflicts_with_all = ["stdin", "unique_id", "debounce_id"]
    )]
    after: Vec<String>,
    /// What a dependency that did not complete (cancelled, dead, purged,
    /// forgotten, or a dependent that failed) does: `fail` (default: the
    /// dependent fails, naming it), `ignore` (it runs, without that
    /// result) or `run` (it runs, with every outcome).
    #[arg(long, value_name = "POLICY", requires = "after")]
    on_dependency_failure: Option<String>,
    #[command(flatten)]
    common: CommonOpts,
}

impl EnqueueArgs {
    /// The keyed options, durations read.
    fn keyed(&self) -> anyhow::Result<shardq_core::KeyedSpec> {
        let ms = |name, v: &Option<String>| {
            v.as_deref()
                .map(|t| shardq_core::schedule::parse_duration_ms(name, t))
                .transpose()
        };
        Ok(shardq_core::KeyedSpec {
            unique_id: self.unique_id.clone(),
            unique_while: self.unique_while.clone(),
            debounce_id: self.debounce_id.clone(),
            debounce_ms: ms("debounce", &self.debounce)?,
            debounce_max_ms: ms("debounce-max", &self.debounce_max)?,
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct WorkArgs {
    /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
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
    /// Most bytes of a handler's result ($SHARDQ_RESULT_FILE, a stdio
    /// line's result), kept with its finished job (1 to 65536); a larger
    /// one fails the attempt.
    #[arg(long, value_name = "BYTES", default_value_t = shardq_core::job::RESULT_BYTES_MAX)]
    result_bytes_max: usize,
    /// Exit once idle: no shard has a job ready or delayed, or a run in
    /// flight (a run of any process, a dead one's too, can lapse back into
    /// work).
    #[arg(long)]
    exit_when_idle: bool,
    /// Serve Prometheus metrics on http://ADDR/metrics while working
    /// (docs/metrics.md): `PORT` listens on 127.0.0.1, or give `IP:PORT`.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// After a job's last attempt fails: `continue` with the key's next jobs,
    /// or `halt` the key until its dead jobs are retried or purged.
    #[arg(long, default_value = "continue")]
    on_dead: String,
    /// Start CMD once per concurrency slot and feed it one JSON job per line
    /// on stdin, reading one result line per job from its stdout (see
    /// docs/stdio-protocol.md), instead of one process per job.
    #[arg(long)]
    stdio: bool,
    /// With --stdio: jobs written ahead to each handler process (1..=64);
    /// the worker runs concurrency x pipeline jobs at once.
    #[arg(long, default_value_t = shardq_worker::STDIO_PIPELINE_DEFAULT, requires = "stdio")]
    stdio_pipeline: usize,
    /// Test and benchmark only: instead of CMD, append
    /// "KEY JOB_ID ATTEMPT SHARD PAYLOAD" lines to FILE (`append:FILE`; the payload escaped).
    #[arg(long, hide = true)]
    handler_builtin: Option<String>,
    #[command(flatten)]
    common: CommonOpts,
    /// Command run per job, in a process group of its own that is killed
    /// when the attempt ends (and, on Linux, when the worker dies): payload
    /// on stdin; SHARDQ_KEY, SHARDQ_JOB_ID, SHARDQ_ATTEMPT, SHARDQ_SHARD,
    /// SHARDQ_PAYLOAD_BYTES (the payload's length: compare it with what was
    /// read, a worker that dies mid-write leaves a short stdin) and, where
    /// the backend provides it, SHARDQ_FENCE in its environment; with a
    /// dedup id, SHARDQ_DEDUP_ID; for a schedule's job, SHARDQ_SCHEDULE,
    /// SHARDQ_SCHEDULE_TIME (RFC 3339) and SHARDQ_SCHEDULE_TIME_MS. Exit 0 acks,
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
            namespace,
        } => {
            let urls = match (redis, redis_cluster) {
                (Some(r), _) => Some(instance_urls(&r)?),
                (None, Some(c)) => Some(vec![cluster_url(&c)?]),
                (None, None) => None,
            };
            let map = init_map(shards, &algorithm, hash.as_deref())?;
            let done = match urls {
                None if join => bail!("--join needs --redis or --redis-cluster"),
                None => shardq_deploy::init_embedded(&data, &map)?,
                Some(urls) => shardq_deploy::init_redis(
                    &data,
                    map,
                    &urls,
                    Some(&namespace),
                    join,
                    &crate::redis_options(),
                )?,
            };
            let verb = if done.joined { "joined" } else { "initialised" };
            match (&done.map_url, &done.namespace) {
                (Some(url), Some(ns)) => println!(
                    "{verb} {} with {} shards on Redis (map version {}, published at {}, namespace {ns})",
                    data.display(),
                    done.map.shards.len(),
                    done.map.version,
                    shardq_core::secret::redact(url)
                ),
                _ => println!(
                    "{verb} {} with {} shards (map version {})",
                    data.display(),
                    done.map.shards.len(),
                    done.map.version
                ),
            }
            Ok(ExitCode::SUCCESS)
        }
        EngineCommand::Enqueue(args) => enqueue(args),
        EngineCommand::Work(args) => work(args),
        EngineCommand::Status { data, json } => status(&data, json),
        EngineCommand::Dead { data, action } => dead(data, action),
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

/// Opens the data dir with the common options.
fn open(dir: &Path, common: &CommonOpts, dead_policy: DeadPolicy) -> anyhow::Result<Deployment> {
    let mut engine = engine_options(common)?;
    engine.dead_policy = dead_policy;
    let mut redis = redis_options(common)?;
    redis.dead_policy = dead_policy;
    Ok(Deployment::open(
        dir,
        &shardq_deploy::OpenOptions { engine, redis },
    )?)
}

fn enqueue(args: EnqueueArgs) -> anyhow::Result<ExitCode> {
    let deployment = open(&args.data, &args.common, DeadPolicy::default())?;
    if !args.after.is_empty() {
        return enqueue_after(&args, &deployment);
    }
    if let Some(batch) = &args.batch {
        return enqueue_in_batch(&args, batch, &deployment);
    }
    let mut producer = deployment.producer(ProducerOptions::default())?;
    let retry = deployment.retry_settings()?;
    enqueue_with(&args, &retry, &mut |jobs| {
        // The producer splits the batch by the backend's own bounds.
        let mut all = Stored::from_produce(producer.enqueue_batch(jobs), 0);
        if !all.placed.is_empty() {
            if let Err(e) = deployment.flush() {
                let e = anyhow::Error::new(e).context(
                    "syncing the jobs listed above to disk failed: they are written but may not survive a crash",
                );
                all.error = Some(match all.error.take() {
                    None => e,
                    Some(first) => first.context(format!("{e:#}")),
                });
            }
        }
        all
    })
}

/// The job `--key`, `--payload`, `--delay-ms` and `--max-attempts` give
/// (attempts from the key's retry policy when not given), checked.
fn one_job(args: &EnqueueArgs, deployment: &Deployment) -> anyhow::Result<NewJob> {
    let key = args.key.clone().unwrap_or_default();
    let retry = deployment.retry_settings()?;
    let job = NewJob {
        max_attempts: (args.max_attempts).unwrap_or_else(|| retry.for_key(&key).max_attempts),
        delay_ms: args.delay_ms,
        ..NewJob::new(key, args.payload.clone().unwrap_or_default())
    };
    job.validate(shardq_core::job::PAYLOAD_BYTES_MAX_DEFAULT)?;
    Ok(job)
}

/// `enqueue --batch @N`: adds one job to the batch and prints its id, `@M`.
fn enqueue_in_batch(
    args: &EnqueueArgs,
    batch: &str,
    deployment: &Deployment,
) -> anyhow::Result<ExitCode> {
    let n = shardq_core::workflow::parse_batch_id(batch)?;
    if args.stdin {
        if args.dedup_id.is_some() {
            bail!("--dedup-id names one job: it does not go with --stdin");
        }
        let retry = deployment.retry_settings()?;
        return enqueue_with(
            args,
            &retry,
            &mut |jobs| match deployment.add_to_batch(n, jobs) {
                Ok(ids) => Stored {
                    placed: ids
                        .into_iter()
                        .enumerate()
                        .map(|(i, (m, _))| (i, String::new(), JobId(m)))
                        .collect(),
                    error: None,
                },
                Err(e) => Stored {
                    placed: Vec::new(),
                    error: Some(anyhow::Error::new(e)),
                },
            },
        );
    }
    let mut job = one_job(args, deployment)?;
    if let Some(id) = &args.dedup_id {
        shardq_core::job::refuse_reserved_dedup_id(id)?;
        job.dedup_id = Some(id.clone());
        job.validate(shardq_core::job::PAYLOAD_BYTES_MAX_DEFAULT)?;
    }
    let m = deployment
        .add_to_batch(n, &[job])
        .context("the job was NOT enqueued")?;
    println!("@{}", m[0].0);
    Ok(ExitCode::SUCCESS)
}

/// `enqueue --after`: adds one dependent and prints its id, `@N`.
fn enqueue_after(args: &EnqueueArgs, deployment: &Deployment) -> anyhow::Result<ExitCode> {
    use shardq_core::workflow::{parse_dependency, NewDependent, OnDependencyFailure};
    let job = one_job(args, deployment)?;
    let after = args
        .after
        .iter()
        .map(|a| parse_dependency(a.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    let on_failure = match &args.on_dependency_failure {
        Some(p) => OnDependencyFailure::parse(p)?,
        None => OnDependencyFailure::default(),
    };
    let n = deployment
        .add_dependents(&[NewDependent {
            job,
            after,
            on_failure,
        }])
        .context("the dependent was NOT enqueued")?;
    println!("@{}", n[0].0);
    Ok(ExitCode::SUCCESS)
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

fn enqueue_with(
    args: &EnqueueArgs,
    retry: &shardq_core::RetrySettings,
    place: &mut Place<'_>,
) -> anyhow::Result<ExitCode> {
    if !args.stdin {
        let key = args.key.clone().unwrap_or_default();
        let max_attempts = (args.max_attempts).unwrap_or_else(|| retry.for_key(&key).max_attempts);
        let job = args.keyed()?.apply(NewJob {
            key,
            payload: args.payload.clone().unwrap_or_default().into_bytes(),
            delay_ms: args.delay_ms,
            max_attempts,
            dedup_id: None,
            keyed: None,
        })?;
        let stored = place(std::slice::from_ref(&job));
        if let Some((_, shard, id)) = stored.placed.first() {
            println!("{shard}:{id}");
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
            match parse_stdin_line(args, retry, &line, line_no) {
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
                if shard.is_empty() {
                    // A job of a batch: its id in the batch, @M.
                    writeln!(out, "{}\t@{id}", jobs[*i].key)?;
                } else {
                    writeln!(out, "{}\t{shard}:{id}", jobs[*i].key)?;
                }
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
fn parse_stdin_line(
    args: &EnqueueArgs,
    retry: &shardq_core::RetrySettings,
    line: &[u8],
    line_no: u64,
) -> anyhow::Result<NewJob> {
    if line.len() > STDIN_LINE_BYTES_MAX {
        bail!("stdin line {line_no} is over {STDIN_LINE_BYTES_MAX} bytes");
    }
    let text =
        std::str::from_utf8(line).with_context(|| format!("stdin line {line_no} is not UTF-8"))?;
    let text = text.trim_end_matches(['\n', '\r']);
    let Some((key, payload)) = text.split_once('\t') else {
        bail!("stdin line {line_no} {text:?} has no TAB: expected KEY<TAB>PAYLOAD");
    };
    let job = args.keyed()?.apply(NewJob {
        key: key.to_string(),
        payload: payload.as_bytes().to_vec(),
        delay_ms: args.delay_ms,
        max_attempts: (args.max_attempts).unwrap_or_else(|| retry.for_key(key).max_attempts),
        dedup_id: None,
        keyed: None,
    })?;
    job.validate(args.common.payload_bytes_max)
        .with_context(|| format!("stdin line {line_no}"))?;
    Ok(job)
}

/// `shardq work`: runs the handler on the owned shards' jobs until stopped or idle.
fn work(args: WorkArgs) -> anyhow::Result<ExitCode> {
    let options = WorkOptions {
        concurrency: args.concurrency,
        stdio_pipeline: args.stdio.then_some(args.stdio_pipeline),
        job_timeout_ms: args.job_timeout_ms,
        job_lease_ms: args.job_lease_ms,
        result_bytes_max: args.result_bytes_max,
    };
    options.validate()?;
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
    if args.handler_builtin.is_none() && !args.cmd.is_empty() {
        shardq_worker::check_command(&args.cmd).map_err(anyhow::Error::msg)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let handler = work_handler(&args, &options)?;
    let metrics_addr = match &args.metrics_listen {
        Some(a) => Some(
            shardq_metrics::serve::parse_listen(a)
                .map_err(|e| anyhow::anyhow!("--metrics-listen: {e}"))?,
        ),
        None => None,
    };
    let deployment = Arc::new(open(&args.data, &args.common, dead_policy)?);
    let metrics = metrics_addr.map(|_| {
        Arc::new(shardq_metrics::Metrics::for_deployment(Arc::clone(
            &deployment,
        )))
    });
    let _listener = match (metrics_addr, &metrics) {
        (Some(addr), Some(m)) => {
            let l = shardq_metrics::spawn_listener(addr, Arc::clone(m))?;
            eprintln!("shardq: metrics on http://{}/metrics", l.addr());
            Some(l)
        }
        _ => None,
    };
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let mut pool = pool_options(&args, metrics);
    pool.job_timeout_ms = options.job_timeout_ms;
    pool.job_lease_ms = options.job_lease_ms;
    pool.result_bytes_max = options.result_bytes_max;
    pool.concurrency = options.pool_concurrency();
    pool.handlers = Some(options.concurrency);
    wait_for_work_elsewhere(&mut pool, &deployment);
    // The pool cancels runs past the job timeout, on a lost shard and past
    // the drain timeout; a cancelled handler command is killed and waited
    // for, and the pool gives no shard up before its handlers returned.
    warn_unowned_work(&deployment, max_local_shards, &args.max_local_shards);
    // Schedules fire beside the pool, for the shards it owns now.
    let owned = track_owned_shards(&mut pool, &deployment);
    let mut schedules = deployment.spawn_scheduler(
        Arc::new(move || owned.lock().unwrap_or_else(|e| e.into_inner()).clone()),
        Arc::new(|e| eprintln!("shardq: warning: {e}")),
    )?;
    let report = run_pool(&args, &deployment, max_local_shards, pool, handler, &stop);
    schedules.stop();
    print_work_report(&report?, &args.max_local_shards);
    Ok(ExitCode::SUCCESS)
}

/// The handler `work` runs: a builtin, a handler command, or a stdio worker.
fn work_handler(
    args: &WorkArgs,
    options: &WorkOptions,
) -> anyhow::Result<Arc<shardq_core::Handler>> {
    Ok(match (&args.handler_builtin, args.cmd.is_empty()) {
        (Some(_), _) if options.job_timeout_ms.is_some() => {
            bail!("--job-timeout-ms applies to a handler command, not --handler-builtin")
        }
        (Some(_), _) if args.stdio => {
            bail!("--stdio applies to a handler command, not --handler-builtin")
        }
        (Some(spec), true) => builtin_handler(spec)?,
        (Some(_), false) => bail!("give either --handler-builtin or a command after --, not both"),
        (None, true) => bail!(
            "no handler command: give it after --, e.g. `shardq work --data DIR -- ./handle.sh`"
        ),
        (None, false) if args.stdio => {
            shardq_worker::stdio_handler(args.cmd.clone(), options.concurrency)
        }
        (None, false) => shardq_worker::command_handler(args.cmd.clone()),
    })
}

/// Holds the pool's idle exit while dependents or closed batches still wait.
fn wait_for_work_elsewhere(pool: &mut PoolOptions, deployment: &Deployment) {
    // An idle exit waits for dependents still to be released and closed
    // batches still to complete (a store
    // that cannot be read counts as none: the exit is not held by it).
    // The pool asks at every idle look (every few ms): the document is
    // read at most every 100 ms.
    let maps = deployment.maps();
    let seen: std::sync::Mutex<Option<(std::time::Instant, bool)>> = std::sync::Mutex::new(None);
    pool.pending_elsewhere = Some(Arc::new(move || {
        let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
        match *seen {
            Some((at, waiting)) if at.elapsed() < std::time::Duration::from_millis(100) => waiting,
            _ => {
                let waiting =
                    shardq_core::workflow::WaitingStore::load(&*maps).is_ok_and(|f| f.work_ahead());
                *seen = Some((std::time::Instant::now(), waiting));
                waiting
            }
        }
    }));
}

/// Wraps the pool's events to wake dependents and keep the set of owned shards.
fn track_owned_shards(
    pool: &mut PoolOptions,
    deployment: &Deployment,
) -> Arc<std::sync::Mutex<std::collections::BTreeSet<String>>> {
    let owned: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>> = Arc::default();
    let inner = Arc::clone(&pool.on_event);
    let seen = Arc::clone(&owned);
    let dependents = deployment.dependents_wake();
    pool.on_event = Arc::new(move |ev| {
        match &ev {
            // A job ended here: a dependent may go now.
            PoolEvent::RunFinished { .. } => dependents.wake(),
            PoolEvent::Gained(s) => {
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(s.clone());
            }
            PoolEvent::Lost(s) => {
                seen.lock().unwrap_or_else(|e| e.into_inner()).remove(s);
            }
            _ => {}
        }
        inner(ev)
    });
    owned
}

/// The `done:` line at the end of `work`, and the warning about shards left unrun.
fn print_work_report(report: &shardq_core::PoolReport, max_local_shards: &str) {
    eprintln!(
        "shardq: done: {} acked, {} retried, {} dead, {} stopped at the drain timeout, {} timed out, {} stale results refused",
        report.acked, report.retried, report.dead, report.abandoned, report.timed_out, report.stale
    );
    if !report.left_on_other_shards.is_empty() {
        eprintln!(
            "shardq: warning: shards {:?} still have work that this worker did not run: it runs at most {} shard(s) (--max-local-shards); start a worker for each, or give --max-local-shards all",
            report.left_on_other_shards, max_local_shards
        );
    }
}

/// At start: the shards with work that nobody runs, when there are more of
/// them than this worker will take (`--max-local-shards`).
fn warn_unowned_work(deployment: &Deployment, max_local_shards: usize, flag: &str) {
    let Ok(st) = deployment.status() else {
        return;
    };
    let now = deployment.clock().now_ms();
    let unowned: Vec<&str> = st
        .shards
        .iter()
        .filter(|r| r.ready.unwrap_or(0) + r.delayed.unwrap_or(0) + r.in_flight.unwrap_or(0) > 0)
        .filter(|r| r.owner.is_none() || r.lease_expires_ms.is_some_and(|at| at < now))
        .map(|r| r.name.as_str())
        .collect();
    if unowned.len() > max_local_shards {
        eprintln!(
            "shardq: note: shards {unowned:?} have work and no owner; this worker runs at most {flag} of them (--max-local-shards): start a worker for each, or give --max-local-shards all"
        );
    }
}

/// Runs the worker pool on the data dir's backend until `stop` (or idle).
fn run_pool(
    args: &WorkArgs,
    deployment: &Deployment,
    max_local_shards: usize,
    pool: PoolOptions,
    handler: Arc<shardq_core::Handler>,
    stop: &AtomicBool,
) -> anyhow::Result<shardq_core::PoolReport> {
    // On Redis, leases use the server's clock, so --clock-skew-ms has
    // nothing to correct.
    let mut coordinator = deployment.coordinator(&WorkerOptions {
        lease_ms: args.lease_ms,
        clock_skew_ms: args.clock_skew_ms,
        max_shards: max_local_shards,
        role: "work",
    })?;
    let report = WorkerPool::run(
        deployment.queue(),
        &mut *coordinator,
        handler,
        deployment.clock(),
        pool,
        stop,
    )?;
    deployment.flush()?;
    Ok(report)
}

fn pool_options(args: &WorkArgs, metrics: Option<Arc<shardq_metrics::Metrics>>) -> PoolOptions {
    PoolOptions {
        concurrency: args.concurrency,
        drain_timeout_ms: args.drain_timeout_ms,
        exit_when_idle: args.exit_when_idle,
        on_event: Arc::new(move |ev| {
            if let Some(m) = &metrics {
                m.pool_event(&ev);
            }
            match ev {
            PoolEvent::RunStarted { .. } | PoolEvent::RunFinished { .. } => {}
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
        wait_replicas: common.redis_wait_replicas,
        ..crate::redis_options()
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
        // The payload last, escaped, so a line stays one line: a job moved
        // with its key has a new id on its new shard, its payload is the same.
        let payload = String::from_utf8_lossy(&job.payload)
            .escape_default()
            .to_string();
        let line = format!(
            "{} {} {} {} {payload}\n",
            job.key, job.id, job.attempt, job.shard
        );
        // One write per line on an O_APPEND file: a kill leaves whole lines.
        let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
        Ok(f.write_all(line.as_bytes())?)
    }))
}

fn status(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let deployment = Deployment::open(dir, &crate::open_options())?;
    let st = deployment.status()?;
    // The running or last rebalance, whoever runs it: a map store that
    // cannot say costs only this line.
    let rebalance = shardq_core::reshard::stored_progress(&*deployment.maps())
        .ok()
        .flatten();
    // Flow-control groups: their buckets are shared, so any process can
    // read them (a key's own bucket lives in its shard's owner).
    let now = deployment.clock().now_ms();
    let groups = deployment
        .flow()
        .map(|f| f.group_levels(now))
        .unwrap_or_default();
    if json {
        let mut doc = serde_json::to_value(&st)?;
        doc["rebalance"] = serde_json::to_value(&rebalance)?;
        doc["groups"] = serde_json::to_value(&groups)?;
        println!("{doc}");
    } else {
        let map = deployment.map().ok();
        print_status_table(&st, map.as_ref(), now);
        if let Some(p) = &rebalance {
            println!("{}", rebalance_line(p, now));
        }
        if let Some(t) = st.schedules.filter(|t| t.schedules > 0) {
            println!(
                "schedules: {} ({} paused); ticks fired {}, skipped {} (overlap), missed {} (past catch-up); `shardq schedule list` for each",
                t.schedules, t.paused, t.fired, t.skipped, t.missed
            );
        }
        if let Some(t) = st
            .dependents
            .filter(|t| t.waiting + t.released + t.failed > 0)
        {
            println!(
                "dependents: {} waiting; {} released and {} failed so far (`shardq jobs --key KEY` lists a key's waiting ones)",
                t.waiting, t.released, t.failed
            );
        }
        if let Some(t) = st
            .dependents
            .filter(|t| t.batches + t.batch_jobs_released + t.callbacks_fired > 0)
        {
            println!(
                "batches: {} not yet complete; their jobs: {} waiting for release, {} released so far; {} callbacks fired so far (`shardq batch show @N` for one)",
                t.batches, t.batch_jobs_waiting, t.batch_jobs_released, t.callbacks_fired
            );
        }
        for g in &groups {
            let state = match (&g.error, g.held_until_ms) {
                (Some(e), _) => format!("its bucket cannot be read: {e}"),
                (None, Some(t)) => {
                    format!("held by a back-off for {}", human_ms(t.saturating_sub(now)))
                }
                (None, None) if g.rate.is_some() && g.tokens < 1.0 => {
                    "throttled: its bucket is empty".to_string()
                }
                (None, None) if g.rate.is_some() => {
                    format!("{:.1} of {} tokens", g.tokens, g.burst)
                }
                (None, None) => "not held".to_string(),
            };
            let rate = match &g.rate {
                Some(r) => format!("{r} (burst {})", g.burst),
                None => "no rate limit".into(),
            };
            let runs = match g.concurrency {
                Some(n) => format!(", {} of {n} runs at once", g.running),
                None => String::new(),
            };
            println!("group {}: {rate}{runs}, {state}", g.name);
        }
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

/// One line on the deployment's running or last rebalance.
fn rebalance_line(p: &shardq_core::reshard::RebalanceProgress, now_ms: u64) -> String {
    let ago = |at: Option<u64>| at.map_or("?".into(), |t| human_ms(now_ms.saturating_sub(t)));
    let who = if p.runner.is_empty() {
        String::new()
    } else {
        format!(" by {}", p.runner)
    };
    let moved = format!(
        "{} of {} keys and {} jobs moved",
        p.keys_moved, p.keys_to_move, p.jobs_moved
    );
    match (p.is_running(), p.started_ms, p.finished_ms) {
        (true, started, _) => format!(
            "rebalance: {}{who}, started {} ago, {moved}, last word {} ago",
            p.phase,
            ago(started),
            ago(p.updated_ms)
        ),
        (false, Some(started), Some(finished)) => {
            let versions = match (p.from_version, p.to_version) {
                (Some(a), Some(b)) => format!(", map v{a} -> v{b}"),
                _ => String::new(),
            };
            let why = p
                .last_error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}"));
            format!(
                "last rebalance: {}{who} {} ago after {}, {moved}{versions}{why}",
                p.phase,
                ago(Some(finished)),
                human_ms(finished.saturating_sub(started))
            )
        }
        _ => format!("last rebalance: {}{who}", p.phase),
    }
}

/// `12.3 s`, `4 min`, `2.5 h`.
fn human_ms(ms: u64) -> String {
    match ms {
        0..=59_999 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{} min", ms / 60_000),
        _ => format!("{:.1} h", ms as f64 / 3_600_000.0),
    }
}

fn print_status_table(st: &StatusReport, map: Option<&shardq_route::ShardMap>, now_ms: u64) {
    let count = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
    if let Some(m) = map {
        println!(
            "map version {} ({}, {} shards)",
            m.version,
            m.algorithm.name(),
            m.shards.len()
        );
    }
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>8}  {:<8} {:>6}  {:<28} LEASE",
        "SHARD", "READY", "DELAYED", "IN_FLIGHT", "DEAD", "STATE", "WEIGHT", "OWNER"
    );
    for s in &st.shards {
        let spec = map.and_then(|m| m.shards.iter().find(|x| x.name == s.name));
        let lease = match s.lease_expires_ms {
            None => "-".to_string(),
            Some(at) if at >= now_ms => format!("{} left", human_ms(at - now_ms)),
            Some(at) => format!("lapsed {} ago", human_ms(now_ms - at)),
        };
        println!(
            "{:<12} {:>10} {:>10} {:>10} {:>8}  {:<8} {:>6}  {:<28} {}",
            s.name,
            count(s.ready),
            count(s.delayed),
            count(s.in_flight),
            count(s.dead),
            spec.map_or("?", |x| x.state.name()),
            spec.map_or("?".to_string(), |x| x.weight.to_string()),
            s.owner.as_deref().unwrap_or("-"),
            lease
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

/// `SHARD:ID`, or a bare `ID` of `shard`.
fn parse_dead_id(s: &str, shard: Option<&str>) -> anyhow::Result<(String, JobId)> {
    match s.rsplit_once(':') {
        Some((sh, n)) if !sh.is_empty() => {
            let id: u64 = n
                .parse()
                .map_err(|_| anyhow::anyhow!("--id {s:?}: expected SHARD:ID, e.g. shard-2:17"))?;
            if let Some(want) = shard {
                if want != sh {
                    bail!("--id {s:?} is not on --shard {want:?}");
                }
            }
            Ok((sh.to_string(), JobId(id)))
        }
        _ => {
            let id: u64 = s
                .parse()
                .map_err(|_| anyhow::anyhow!("--id {s:?}: expected SHARD:ID, e.g. shard-2:17"))?;
            match shard {
                Some(sh) => Ok((sh.to_string(), JobId(id))),
                None => bail!("--id {s:?}: a bare id needs --shard, or give it as SHARD:ID"),
            }
        }
    }
}

fn dead(data: Option<PathBuf>, action: DeadAction) -> anyhow::Result<ExitCode> {
    let pick = match &action {
        DeadAction::List { pick, .. }
        | DeadAction::Retry { pick, .. }
        | DeadAction::Purge { pick, .. } => pick,
    };
    let dir = match (data, &pick.data) {
        (Some(a), Some(b)) if a != *b => {
            bail!("--data given twice: {} and {}", a.display(), b.display())
        }
        (Some(d), _) => d,
        (None, Some(d)) => d.clone(),
        (None, None) => bail!("--data DIR is required: the data dir of the dead jobs"),
    };
    let deployment = Deployment::open(&dir, &crate::open_options())?;
    let backend = deployment.queue();
    let all = deployment.shard_names()?;
    let shards = match &pick.shard {
        None => all.clone(),
        Some(s) if all.contains(s) => vec![s.clone()],
        Some(s) => bail!("unknown --shard {s:?}: the map has {}", all.join(", ")),
    };
    let change = |which: &DeadWhich, retry: bool| -> anyhow::Result<(usize, u64, Vec<String>)> {
        let mut plan: std::collections::BTreeMap<String, Option<Vec<JobId>>> = Default::default();
        if which.all {
            for s in &shards {
                plan.insert(s.clone(), None);
            }
        } else {
            for s in &which.id {
                let (shard, id) = parse_dead_id(s, pick.shard.as_deref())?;
                if !all.contains(&shard) {
                    bail!(
                        "--id {s:?}: unknown shard {shard:?}: the map has {}",
                        all.join(", ")
                    );
                }
                plan.entry(shard)
                    .or_insert_with(|| Some(Vec::new()))
                    .get_or_insert_with(Vec::new)
                    .push(id);
            }
        }
        let (mut n, mut left, mut keys) = (0, 0, Vec::new());
        for (s, ids) in plan {
            n += if retry {
                backend.dead_retry(&s, ids.as_deref())?
            } else {
                backend.dead_purge(&s, ids.as_deref())?
            };
            let (l, k) = shardq_core::backend::dead_left_moving(&*backend, &s, ids.as_deref())?;
            left += l;
            keys.extend(k);
        }
        Ok((n, left, keys))
    };
    // Dead letters of a key moving now are left as they are: said, and
    // exit 75 (a rerun once the move is done does the rest), as `job
    // cancel` of such a job does.
    let report = |done: &str, (n, left, keys): (usize, u64, Vec<String>)| {
        println!("{done} {n} dead jobs");
        if left == 0 {
            return ExitCode::SUCCESS;
        }
        let keys: Vec<String> = keys
            .iter()
            .map(|k| shardq_core::job::shown_key(k))
            .collect();
        eprintln!(
            "shardq: {left} dead jobs of keys moving to another shard now were left as they are ({}): rerun once the move is done",
            keys.join(", ")
        );
        ExitCode::from(75)
    };
    match &action {
        DeadAction::List { json, .. } => {
            let mut rows = Vec::new();
            for s in &shards {
                for d in backend.dead_list(s, usize::MAX)? {
                    if *json {
                        rows.push(shardq_server::api::dead_value(&d));
                    } else {
                        println!(
                            "{}:{}\t{}\t{}\t{}",
                            d.shard,
                            d.id,
                            shardq_core::job::shown_key(&d.key),
                            d.attempts,
                            // A handler's words: escaped, so no control
                            // character reaches the terminal.
                            shardq_core::job::shown_key(&d.reason)
                        );
                    }
                }
            }
            if *json {
                println!("{}", serde_json::json!({ "dead": rows }));
            }
        }
        DeadAction::Retry { which, .. } => return Ok(report("retried", change(which, true)?)),
        DeadAction::Purge { which, .. } => return Ok(report("purged", change(which, false)?)),
    }
    Ok(ExitCode::SUCCESS)
}

fn repair(dir: &Path, shard: &str) -> anyhow::Result<ExitCode> {
    if let shardq_deploy::Kind::Redis(remote) = shardq_deploy::kind(dir)? {
        bail!(
            "repair cuts corrupt records out of the embedded engine's logs; the shards of {} live on Redis ({}), which has no such log: check the server's own persistence instead",
            dir.display(),
            shardq_core::secret::redact(&remote.map_url)
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
