//! The `shardq` binary: thin glue over the library crates. Each command group
//! lives in its own module; this file only parses arguments and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod backends;
mod bench_chx;
mod bench_route;
mod cmd_bench;
mod cmd_demo;
mod cmd_engine;
mod cmd_reshard;
mod cmd_route;
mod demo;

/// shardq: a sharded job queue that routes each key to a shard with
/// consistent hashing, keeps each key's jobs in order, and reshards live.
#[derive(Debug, Parser)]
#[command(name = "shardq", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Route keys to shards with a shard map (KEY<TAB>SHARD per key).
    Route(cmd_route::RouteArgs),
    /// Print the Redis Cluster slot of keys (KEY<TAB>SLOT per key).
    Slot(cmd_route::SlotArgs),
    /// Show how many keys move, and where, between two shard maps.
    Plan(cmd_route::PlanArgs),
    /// Benchmarks: routing speed, and the consistent-hash harness.
    #[command(subcommand)]
    Bench(cmd_bench::BenchCommand),
    /// Run the whole story: load, add a shard, rebalance live, and report.
    Demo(cmd_demo::DemoArgs),
    #[command(flatten)]
    Engine(cmd_engine::EngineCommand),
    #[command(flatten)]
    Reshard(cmd_reshard::ReshardCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Route(args) => cmd_route::route(args),
        Command::Slot(args) => cmd_route::slot(args),
        Command::Plan(args) => cmd_route::plan(args),
        Command::Bench(cmd) => cmd_bench::run(cmd),
        Command::Demo(args) => cmd_demo::run(args),
        Command::Engine(cmd) => cmd_engine::run(cmd),
        Command::Reshard(cmd) => cmd_reshard::run(cmd),
    };
    match result {
        Ok(code) => code,
        // A closed pipe (`shardq route ... | head`) is the reader's choice, not a failure.
        Err(err) if is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("shardq: error: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
