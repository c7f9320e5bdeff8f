//! The `shardq-bench` binary: routing speed (`route`) and the
//! consistent-hash harness (`chx`). These commands live here, not in the
//! `shardq` binary, so the product links neither the AMQP client nor the
//! chart library. This file sets how a closed stdout ends the process
//! (SIGPIPE), parses arguments and dispatches; the flags and the output of
//! each command are those `shardq bench ...` had.

use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

mod bench_chx;
mod bench_route;

/// shardq-bench: shardq's benchmark harnesses: routing speed, and the
/// consistent-hash experiments over shardq's routers, the embedded queue
/// and RabbitMQ.
#[derive(Debug, Parser)]
#[command(name = "shardq-bench", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// ns per lookup for every algorithm and hash, against a bare-hash baseline.
    Route(bench_route::Args),
    /// Seed 001's experiments A/B/C on every router, the embedded queue and RabbitMQ.
    Chx(bench_chx::Args),
}

fn main() -> ExitCode {
    // A closed pipe (`shardq-bench route | head`) ends the process quietly,
    // as for any Unix filter. SAFETY: sets a disposition (no handler
    // function) before any thread of ours is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Route(args) => bench_route::run(args),
        Command::Chx(args) => bench_chx::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) if is_broken_pipe(&err) => ExitCode::SUCCESS,
        // No error of these commands carries a queue error kind: like the
        // CLI's own refusals, they exit 2 (a run that finished incomplete
        // exits 1, from the command itself).
        Err(err) => {
            eprintln!(
                "shardq-bench: error: {}",
                shardq_core::secret::redact(&chain_text(&err))
            );
            ExitCode::from(2)
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
        let mut empty = Vec::new();
        let cli = super::Cli::command();
        for sub in cli.get_subcommands() {
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" || arg.is_positional() {
                    continue;
                }
                if arg
                    .get_help()
                    .is_none_or(|h| h.to_string().trim().is_empty())
                {
                    empty.push(format!(
                        "shardq-bench {} --{}",
                        sub.get_name(),
                        arg.get_long().unwrap_or(id)
                    ));
                }
            }
        }
        assert!(empty.is_empty(), "options without help: {empty:?}");
    }
}
