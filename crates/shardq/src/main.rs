//! The `shardq` binary: thin glue over the library crates. Each command group
//! lives in its own module; this file only sets how a closed stdout ends the
//! process (SIGPIPE), parses arguments and dispatches.

use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

mod cmd_batch;
mod cmd_demo;
mod cmd_engine;
mod cmd_flow;
mod cmd_jobs;
mod cmd_pg;
mod cmd_reshard;
mod cmd_retention;
mod cmd_retry;
mod cmd_route;
mod cmd_schedule;
mod cmd_serve;
mod demo;

/// shardq: a sharded job queue that routes each key to a shard with
/// consistent hashing, keeps each key's jobs in order, and reshards live.
#[derive(Debug, Parser)]
#[command(name = "shardq", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    redis: RedisBounds,
}

/// How long a command waits for a Redis server (Redis data dirs only;
/// the embedded engine ignores them). Global: given to any command, before
/// or after its name, they bound every Redis call it makes.
#[derive(Debug, Clone, Copy, clap::Args)]
struct RedisBounds {
    /// Redis only: time to open one TCP connection to a server, in ms
    /// (10 to 60000).
    #[arg(
        long,
        global = true,
        value_name = "MS",
        default_value_t = shardq_redis::CONNECT_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64)
            .range(shardq_redis::TIMEOUT_MS_MIN..=shardq_redis::TIMEOUT_MS_MAX)
    )]
    redis_connect_timeout_ms: u64,
    /// Redis only: longest wait for one reply, in ms (10 to 60000); a
    /// slower reply counts as a failed attempt, retried within
    /// --redis-retry-budget-ms. Keep it above the slowest script (a move's
    /// copy round of 1,024 jobs); `--redis-wait-replicas` waits at most
    /// three quarters of it.
    #[arg(
        long,
        global = true,
        value_name = "MS",
        default_value_t = shardq_redis::RESPONSE_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64)
            .range(shardq_redis::TIMEOUT_MS_MIN..=shardq_redis::TIMEOUT_MS_MAX)
    )]
    redis_reply_timeout_ms: u64,
    /// Redis only: how long one call keeps retrying an unreachable, hung
    /// or loading server before it fails as "retry later" (exit 75), in ms
    /// (0 to 600000; 0 tries once). The attempt in flight at the end still
    /// gets its own connect and reply timeouts.
    #[arg(
        long,
        global = true,
        value_name = "MS",
        default_value_t = shardq_redis::RETRY_BUDGET_MS_DEFAULT,
        value_parser = clap::value_parser!(u64).range(0..=shardq_redis::RETRY_BUDGET_MS_MAX)
    )]
    redis_retry_budget_ms: u64,
}

/// The global Redis bounds of this run, set once by `main` after parsing.
static REDIS_BOUNDS: std::sync::OnceLock<RedisBounds> = std::sync::OnceLock::new();

/// Redis options with this run's bounds (`--redis-connect-timeout-ms`,
/// `--redis-reply-timeout-ms`, `--redis-retry-budget-ms`) and every other
/// field at its default.
pub(crate) fn redis_options() -> shardq_redis::RedisOptions {
    let mut opts = shardq_redis::RedisOptions::default();
    if let Some(b) = REDIS_BOUNDS.get() {
        opts.connect_timeout_ms = b.redis_connect_timeout_ms;
        opts.response_timeout_ms = b.redis_reply_timeout_ms;
        opts.retry_budget_ms = b.redis_retry_budget_ms;
    }
    opts
}

/// How commands open a data dir: the defaults, with this run's Redis
/// bounds.
pub(crate) fn open_options() -> shardq_deploy::OpenOptions {
    shardq_deploy::OpenOptions {
        redis: redis_options(),
        ..shardq_deploy::OpenOptions::default()
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Route keys to shards with a shard map (KEY<TAB>SHARD per key).
    Route(cmd_route::RouteArgs),
    /// Print the Redis Cluster slot of keys (KEY<TAB>SLOT per key).
    Slot(cmd_route::SlotArgs),
    /// Show how many keys move, and where, between two shard maps.
    Plan(cmd_route::PlanArgs),
    /// Run the whole story: load, add a shard, rebalance live, and report.
    Demo(cmd_demo::DemoArgs),
    #[command(flatten)]
    Engine(cmd_engine::EngineCommand),
    /// One job: show it, or cancel it (by its SHARD:ID).
    #[command(subcommand)]
    Job(cmd_jobs::JobAction),
    /// A key's live jobs, in key order: its run in flight, queued, delayed
    /// and dead jobs.
    Jobs(cmd_jobs::JobsArgs),
    /// A key: lift a handler's back-off of it (`key resume`).
    #[command(subcommand)]
    Key(cmd_jobs::KeyAction),
    /// Retry policies (attempts and backoff): the default, per key and per
    /// key prefix: show, set or clear them.
    #[command(subcommand)]
    Retry(cmd_retry::RetryAction),
    /// How many finished jobs each shard keeps, and how long (what `jobs
    /// --key` lists as finished): show, set or clear it.
    #[command(subcommand)]
    Retention(cmd_retention::RetentionAction),
    /// Enqueue inside your own Postgres transaction: install the outbox
    /// (a table and the SQL function shardq.enqueue), run the relay that
    /// moves committed rows into this deployment, or show its status.
    #[command(subcommand)]
    Pg(cmd_pg::PgAction),
    /// Recurring schedules: a key's job enqueued once per tick of a cron
    /// expression (in a time zone) or an interval, by whichever worker
    /// runs the key's shard: set, list, show, pause, resume, trigger,
    /// backfill or delete them.
    #[command(subcommand)]
    Schedule(cmd_schedule::ScheduleAction),
    /// Batches: jobs grouped under one id, with callbacks that run once
    /// when the batch is complete, succeeded, or at its first dead job:
    /// open, close or show one (jobs join with `enqueue --batch @N`).
    #[command(subcommand)]
    Batch(cmd_batch::BatchAction),
    /// Flow control per key: rate limits, a group, weight and priority,
    /// for a key, a key prefix or the default: show, set or clear them.
    #[command(subcommand)]
    Policy(cmd_flow::PolicyAction),
    /// Groups: a rate limit and/or a cap on runs at once, shared by every
    /// key whose policy names the group, over every worker: show, set or
    /// clear them.
    #[command(subcommand)]
    Group(cmd_flow::GroupAction),
    #[command(flatten)]
    Reshard(cmd_reshard::ReshardCommand),
    /// Serve the HTTP/JSON API over a data dir (a worker process holding shard leases).
    Serve(cmd_serve::ServeArgs),
}

/// No transparent huge pages for `serve`: each thread's heap touches its
/// own sparse pages, and with THP every first touch zeroes 2 MiB. Under load
/// this made the server four times as large (130 MiB against 35 MiB for
/// 100k jobs) and spent a fifth of its CPU time zeroing pages. Only `serve`:
/// the flag is inherited by child processes, and `work` starts the user's
/// handlers, which may want huge pages. Best effort: a kernel without the
/// flag runs as before.
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    let _ = rustix::thread::disable_transparent_huge_pages(true);
}

fn main() -> ExitCode {
    sigpipe_default(true);
    let cli = Cli::parse();
    let _ = REDIS_BOUNDS.set(cli.redis);
    // A process stopped while it held one of the data dir's short locks is
    // killed by the next that waits for it (see shardq_fs::stalled): say so.
    shardq_fs::stalled::on_kill(|m| eprintln!("shardq: warning: {m}"));
    if matches!(cli.command, Command::Serve(_)) {
        no_huge_pages();
    }
    if matches!(
        cli.command,
        Command::Engine(cmd_engine::EngineCommand::Work(_))
    ) {
        // `work` writes payloads to handlers' stdin, where a closed pipe is
        // the handler's choice and must come back as EPIPE, not kill the
        // worker; its own output goes to stderr.
        sigpipe_default(false);
    }
    let result = match cli.command {
        Command::Route(args) => cmd_route::route(args),
        Command::Slot(args) => cmd_route::slot(args),
        Command::Plan(args) => cmd_route::plan(args),
        Command::Demo(args) => cmd_demo::run(args),
        Command::Engine(cmd) => cmd_engine::run(cmd),
        Command::Job(action) => cmd_jobs::job(action),
        Command::Jobs(args) => cmd_jobs::jobs(args),
        Command::Key(action) => cmd_jobs::key(action),
        Command::Retry(action) => cmd_retry::run(action),
        Command::Retention(action) => cmd_retention::run(action),
        Command::Pg(action) => cmd_pg::run(action),
        Command::Schedule(action) => cmd_schedule::run(action),
        Command::Batch(action) => cmd_batch::run(action),
        Command::Policy(action) => cmd_flow::policy(action),
        Command::Group(action) => cmd_flow::group(action),
        Command::Reshard(cmd) => cmd_reshard::run(cmd),
        Command::Serve(args) => cmd_serve::run(args),
    };
    match result {
        Ok(code) => code,
        // A closed pipe (`shardq route ... | head`) is the reader's choice, not a failure.
        Err(err) if is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!(
                "shardq: error: {}",
                shardq_core::secret::redact(&chain_text(&err))
            );
            ExitCode::from(exit_code(&err))
        }
    }
}

/// The error and its causes, `: `-joined, each said once: an error whose
/// message already ends with its cause's words (`{context}: {source}`)
/// does not get them twice.
fn chain_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.ends_with(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// The exit code of a failed command: from the kind of the first library
/// error in its chain ([`shardq_core::ErrorKind::exit_code`]: 2 bad input,
/// 3 conflict, 75 retry later, 65 damaged data, 76 lost store, 1 other);
/// 2 for the CLI's own refusals of flags and arguments.
fn exit_code(err: &anyhow::Error) -> u8 {
    error_kind(err).map_or(2, shardq_core::ErrorKind::exit_code)
}

fn error_kind(err: &anyhow::Error) -> Option<shardq_core::ErrorKind> {
    use shardq_core::producer::ProduceError;
    use shardq_core::reshard::ReshardError;
    err.chain().find_map(|e| {
        if let Some(e) = e.downcast_ref::<shardq_core::QueueError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<ReshardError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<ProduceError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<shardq_deploy::DeployError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<shardq_fs::FsError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<shardq_redis::RedisError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<shardq_worker::OptionError>() {
            return Some(e.kind());
        }
        if let Some(e) = e.downcast_ref::<shardq_pg::PgError>() {
            return Some(e.kind());
        }
        e.downcast_ref::<shardq_server::ServerError>()
            .map(shardq_server::ServerError::kind)
    })
}

/// With `true`, a write to a closed pipe ends the process quietly through
/// SIGPIPE, as for any Unix filter (`shardq dead list | head`); with `false`
/// (Rust's default), it returns EPIPE to the writer.
///
/// Resetting the signal covers every write to stdout in every command,
/// including `println!`, which panics on EPIPE; handling `BrokenPipe` at each
/// write would miss the next `println!` someone adds. Sockets are not
/// affected: the standard library sends on them with MSG_NOSIGNAL.
fn sigpipe_default(default: bool) {
    let action = if default {
        libc::SIG_DFL
    } else {
        libc::SIG_IGN
    };
    // SAFETY: sets a disposition (no handler function) before any thread
    // of ours is started.
    unsafe {
        libc::signal(libc::SIGPIPE, action);
    }
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every option of every command says what it is for in `--help`.
    #[test]
    fn every_option_has_help() {
        fn walk(cmd: &clap::Command, path: &str, empty: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" || arg.is_positional() {
                    continue;
                }
                if arg
                    .get_help()
                    .is_none_or(|h| h.to_string().trim().is_empty())
                {
                    empty.push(format!("{path} --{}", arg.get_long().unwrap_or(id)));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), empty);
            }
        }
        let mut empty = Vec::new();
        walk(&super::Cli::command(), "shardq", &mut empty);
        assert!(empty.is_empty(), "options without help: {empty:?}");
    }

    /// `init --help` names every hash function the router has.
    #[test]
    fn init_help_names_every_hash() {
        let mut cmd = super::Cli::command();
        let init = cmd.find_subcommand_mut("init").expect("init");
        let help = init.render_long_help().to_string();
        for h in shardq_route::HashFn::ALL {
            assert!(help.contains(h.name()), "init --help lacks {}", h.name());
        }
    }
}
