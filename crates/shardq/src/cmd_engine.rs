//! Placeholder: the embedded engine's commands (init, enqueue, work, status, dead).

use std::process::ExitCode;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum EngineCommand {}

pub fn run(cmd: EngineCommand) -> anyhow::Result<ExitCode> {
    match cmd {}
}
