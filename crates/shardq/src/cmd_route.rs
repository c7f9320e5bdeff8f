//! `shardq route`, `shardq slot`, `shardq plan`.

use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct RouteArgs {}
#[derive(Debug, clap::Args)]
pub struct SlotArgs {}
#[derive(Debug, clap::Args)]
pub struct PlanArgs {}

pub fn route(_a: RouteArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not implemented yet")
}
pub fn slot(_a: SlotArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not implemented yet")
}
pub fn plan(_a: PlanArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not implemented yet")
}
