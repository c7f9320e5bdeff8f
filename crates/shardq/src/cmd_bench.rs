//! `shardq bench ...`: dispatch to the benchmark commands.

use std::process::ExitCode;

use clap::Subcommand;

use crate::{bench_chx, bench_route};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// ns per lookup for every algorithm and hash, against a bare-hash baseline.
    Route(bench_route::Args),
    /// Seed 001's experiments A/B/C on every router, the embedded queue and RabbitMQ.
    Chx(bench_chx::Args),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Route(args) => bench_route::run(args),
        BenchCommand::Chx(args) => bench_chx::run(args),
    }
}
