//! `shardq serve`: the HTTP/JSON API over a data dir (embedded or Redis),
//! as a worker process holding shard leases. This module only turns flags
//! into `shardq_server::ServerOptions`; it must never hold server logic,
//! and it reads tokens only from a file, never from the command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use shardq_server::limits;

/// Environment variable naming the tokens file when `--tokens` is absent.
pub const TOKENS_FILE_ENV: &str = "SHARDQ_TOKENS_FILE";

/// `shardq serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Data dir (embedded or Redis).
    #[arg(long)]
    data: PathBuf,
    /// Address to listen on. Without tokens only a loopback address is accepted.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Tokens file: one `TOKEN ROLE[,ROLE...]` per line (roles produce, work,
    /// read, admin; `#` comments). Default: $SHARDQ_TOKENS_FILE.
    #[arg(long)]
    tokens: Option<PathBuf>,
    /// How long a dedup_id is remembered, in ms.
    #[arg(long, default_value_t = limits::DEDUP_WINDOW_MS_DEFAULT)]
    dedup_window_ms: u64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = limits::BODY_BYTES_MAX_DEFAULT)]
    body_bytes_max: usize,
    /// Most jobs per enqueue request.
    #[arg(long, default_value_t = limits::JOBS_PER_REQUEST_MAX_DEFAULT)]
    jobs_per_request_max: usize,
    /// Requests served at once, claims aside (more wait for a slot).
    #[arg(long, default_value_t = limits::CONCURRENCY_MAX_DEFAULT)]
    concurrency_max: usize,
    /// Claims served at once, long polls included (a budget of their own,
    /// so idle polls never hold the slots producers need).
    #[arg(long, default_value_t = limits::POLLS_MAX_DEFAULT)]
    polls_max: usize,
    /// Bytes of request bodies read at once over every request (503 with
    /// Retry-After past it).
    #[arg(long, default_value_t = limits::BODY_BYTES_IN_FLIGHT_MAX_DEFAULT)]
    body_bytes_in_flight_max: usize,
    /// Most runs one worker name may hold at once.
    #[arg(long, default_value_t = limits::CLAIMS_PER_WORKER_MAX_DEFAULT)]
    claims_per_worker_max: usize,
    /// Most runs the workers of one token (all workers, without tokens) may
    /// hold at once.
    #[arg(long, default_value_t = limits::CLAIMS_PER_TOKEN_MAX_DEFAULT)]
    claims_per_token_max: usize,
    /// Longest time a request body may take to arrive, in ms (408 past it).
    #[arg(long, default_value_t = limits::BODY_READ_TIMEOUT_MS_DEFAULT)]
    body_read_timeout_ms: u64,
    /// Most connections open at once (further ones are closed at once);
    /// lowered to fit the open-files limit.
    #[arg(long, default_value_t = shardq_server::conn::CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// Longest wait for a request header, and longest idle time of a
    /// keep-alive connection, in ms.
    #[arg(long, default_value_t = shardq_server::conn::HEADER_READ_TIMEOUT_MS)]
    header_read_timeout_ms: u64,
    /// Longest a write of an answer may make no progress (the client reads
    /// nothing) before the connection is closed, in ms.
    #[arg(long, default_value_t = shardq_server::conn::WRITE_STALL_MS_DEFAULT)]
    write_stall_ms: u64,
    /// Another host name this server answers to (the `Host` header), such
    /// as the name a proxy forwards; repeatable. Requests naming any other
    /// host are refused (421), so that a web page cannot reach the server
    /// through DNS rebinding.
    #[arg(long = "allowed-host", value_name = "HOST[:PORT]")]
    allowed_hosts: Vec<String>,
    /// Shard lease, in ms.
    #[arg(long)]
    lease_ms: Option<u64>,
    /// Most shards this server runs at once (default: no limit).
    #[arg(long, conflicts_with = "no_shards")]
    max_shards: Option<usize>,
    /// Take no shard: serve the API and the dashboard as a front (enqueue,
    /// read, reshard) while `shardq work` or other servers run the shards.
    #[arg(long)]
    no_shards: bool,
    /// Show a Postgres outbox (`shardq pg install`) in /v1/status, the
    /// metrics and the dashboard: its depth, lag, relay and the
    /// transactions holding keys. A postgres:// URL.
    #[arg(long, value_name = "URL")]
    outbox_postgres: Option<String>,
    /// The outbox's schema.
    #[arg(long, default_value = "shardq", requires = "outbox_postgres")]
    outbox_schema: String,
    /// Job timeout of runs whose claim gives no `timeout_ms`, in ms: past
    /// it the server fails the run (an attempt used, retried or
    /// dead-lettered), whatever the worker's extends, and refuses its late
    /// result. Default: none.
    #[arg(long, value_name = "MS")]
    job_timeout_ms: Option<u64>,
    /// What a dead job does to its key's later jobs: `continue` (the
    /// default) runs them; `halt` holds the key until its dead jobs are
    /// retried or purged (as `shardq work --on-dead halt`).
    #[arg(long, default_value = "continue", value_parser = ["continue", "halt"])]
    on_dead: String,
    /// Redis only: after every write, wait until N replicas have it (Redis
    /// `WAIT`, at most 1 s), so acknowledged enqueues, claims and acks
    /// survive a failover; a write the replicas do not confirm fails as
    /// retryable. 0: do not wait.
    #[arg(long, value_name = "N", default_value_t = 0)]
    redis_wait_replicas: u32,
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if let Some(ms) = args.job_timeout_ms {
        shardq_core::validate_job_timeout_ms(ms).context("--job-timeout-ms")?;
    }
    let dead_policy = match args.on_dead.as_str() {
        "halt" => shardq_core::DeadPolicy::Halt,
        _ => shardq_core::DeadPolicy::Continue,
    };
    let tokens_path = args
        .tokens
        .clone()
        .or_else(|| std::env::var_os(TOKENS_FILE_ENV).map(PathBuf::from));
    let tokens = match tokens_path {
        Some(p) => {
            let t = shardq_server::Tokens::load(&p).map_err(anyhow::Error::msg)?;
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(&p) {
                let mode = m.permissions().mode() & 0o777;
                if mode & 0o044 != 0 {
                    eprintln!(
                        "shardq serve: warning: tokens file {} has mode {mode:03o}: other users can read the tokens; run `chmod 600 {}`",
                        p.display(),
                        p.display()
                    );
                }
            }
            Some(t)
        }
        None => None,
    };
    let mut worker = shardq_deploy::WorkerOptions {
        role: "serve",
        ..shardq_deploy::WorkerOptions::default()
    };
    if let Some(l) = args.lease_ms {
        worker.lease_ms = l;
    }
    if let Some(m) = args.max_shards {
        worker.max_shards = m;
    }
    let opts = shardq_server::ServerOptions {
        listen: args.listen,
        tokens,
        limits: shardq_server::Limits {
            body_bytes_max: args.body_bytes_max,
            jobs_per_request_max: args.jobs_per_request_max,
            concurrency_max: args.concurrency_max,
            polls_max: args.polls_max,
            body_bytes_in_flight_max: args.body_bytes_in_flight_max,
            claims_per_worker_max: args.claims_per_worker_max,
            claims_per_token_max: args.claims_per_token_max,
            body_read_timeout_ms: args.body_read_timeout_ms,
            job_timeout_ms: args.job_timeout_ms,
            ..shardq_server::Limits::default()
        },
        allowed_hosts: args.allowed_hosts,
        take_shards: !args.no_shards,
        outbox: args.outbox_postgres.map(|url| (url, args.outbox_schema)),
        conn: shardq_server::conn::ConnLimits {
            connections_max: args.connections_max,
            header_read_timeout_ms: args.header_read_timeout_ms,
            write_stall_ms: args.write_stall_ms,
        },
        dedup_window_ms: args.dedup_window_ms,
        worker,
        open: shardq_deploy::OpenOptions {
            redis: shardq_redis::RedisOptions {
                wait_replicas: args.redis_wait_replicas,
                dead_policy,
                ..crate::redis_options()
            },
            engine: shardq_fs::EngineOptions {
                dead_policy,
                ..shardq_fs::EngineOptions::default()
            },
        },
    };
    shardq_server::serve_until_signal(&args.data, opts)
        .with_context(|| format!("serving data dir {}", args.data.display()))?;
    Ok(ExitCode::SUCCESS)
}
