//! `shardq route`, `shardq slot`, `shardq plan`: the routing core on the
//! command line. Streams keys with buffered I/O and one reused line buffer,
//! so a million keys route in well under a second.

use std::fs;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use shardq_route::{Plan, Router};

/// Longest key accepted on stdin, in bytes; longer lines are an error, not a silent cut.
const KEY_LINE_BYTES_MAX: usize = 64 * 1024;
/// Most keys `plan --generate` will make.
const GENERATE_MAX: u64 = 100_000_000;

#[derive(Debug, clap::Args)]
pub struct RouteArgs {
    /// Shard map (YAML).
    #[arg(long, value_name = "FILE")]
    map: PathBuf,
    /// Keys to route; with none, keys are read from stdin, one per line.
    keys: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct SlotArgs {
    /// Keys; with none, keys are read from stdin, one per line.
    keys: Vec<String>,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["keys", "generate"])))]
pub struct PlanArgs {
    /// The current shard map.
    #[arg(long, value_name = "OLD.yaml")]
    from: PathBuf,
    /// The proposed shard map.
    #[arg(long, value_name = "NEW.yaml")]
    to: PathBuf,
    /// File of keys, one per line.
    #[arg(long, value_name = "FILE")]
    keys: Option<PathBuf>,
    /// Generate N keys from --pattern instead of reading a file.
    #[arg(long, value_name = "N")]
    generate: Option<u64>,
    /// Pattern for generated keys; `{}` is replaced by 0..N.
    #[arg(long, default_value = "t-{}")]
    pattern: String,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// Reads and compiles a shard map file, naming the file in any error.
pub fn load_router(path: &Path) -> anyhow::Result<Router> {
    let text = fs::read_to_string(path)
        .with_context(|| format!("cannot read shard map {}", path.display()))?;
    Router::from_yaml(&text).with_context(|| format!("shard map {}", path.display()))
}

/// Calls `f` for every line of `input` (without the line ending), reusing one buffer.
fn for_each_line(
    input: impl Read,
    mut f: impl FnMut(&[u8]) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut reader = BufReader::with_capacity(1 << 16, input);
    let mut line = Vec::with_capacity(256);
    let mut number = 0u64;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .context("reading keys from stdin")?;
        if n == 0 {
            return Ok(());
        }
        number += 1;
        if line.last() == Some(&b'\n') {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
        }
        if line.len() > KEY_LINE_BYTES_MAX {
            bail!(
                "line {number}: key is {} bytes; at most {KEY_LINE_BYTES_MAX} allowed",
                line.len()
            );
        }
        f(&line)?;
    }
}

pub fn route(args: RouteArgs) -> anyhow::Result<ExitCode> {
    let router = load_router(&args.map)?;
    let stdout = io::stdout();
    let mut out = BufWriter::with_capacity(1 << 16, stdout.lock());
    let mut emit = |key: &[u8]| -> anyhow::Result<()> {
        let shard = &router.map().shards[router.route_index(key)].name;
        out.write_all(key)?;
        out.write_all(b"\t")?;
        out.write_all(shard.as_bytes())?;
        out.write_all(b"\n")?;
        Ok(())
    };
    for_each_key(&args.keys, &mut emit)?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Calls `emit` for each key argument, or for each stdin line when there are none.
fn for_each_key(
    keys: &[String],
    emit: &mut impl FnMut(&[u8]) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if keys.is_empty() {
        return for_each_line(io::stdin().lock(), emit);
    }
    keys.iter().try_for_each(|key| emit(key.as_bytes()))
}

pub fn slot(args: SlotArgs) -> anyhow::Result<ExitCode> {
    let stdout = io::stdout();
    let mut out = BufWriter::with_capacity(1 << 16, stdout.lock());
    let mut emit = |key: &[u8]| -> anyhow::Result<()> {
        out.write_all(key)?;
        writeln!(out, "\t{}", shardq_route::slot(key))?;
        Ok(())
    };
    for_each_key(&args.keys, &mut emit)?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

pub fn plan(args: PlanArgs) -> anyhow::Result<ExitCode> {
    let from = load_router(&args.from)?;
    let to = load_router(&args.to)?;
    let keys: Vec<String> = match (&args.keys, args.generate) {
        (Some(path), _) => {
            let file = fs::File::open(path)
                .with_context(|| format!("cannot open key file {}", path.display()))?;
            let mut keys = Vec::new();
            for_each_line(file, |k| {
                keys.push(String::from_utf8_lossy(k).into_owned());
                Ok(())
            })
            .with_context(|| format!("key file {}", path.display()))?;
            keys
        }
        (None, Some(n)) => {
            if n > GENERATE_MAX {
                bail!("--generate {n}: at most {GENERATE_MAX} keys");
            }
            if !args.pattern.contains("{}") {
                bail!(
                    "--pattern {:?} has no `{{}}` placeholder for the key number",
                    args.pattern
                );
            }
            let (head, tail) = args.pattern.split_once("{}").unwrap_or((&args.pattern, ""));
            (0..n).map(|i| format!("{head}{i}{tail}")).collect()
        }
        (None, None) => bail!("give --keys FILE or --generate N"),
    };
    let plan = Plan::compute(&from, &to, keys.iter().map(String::as_str));
    if args.json {
        let mut out = io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&plan)?)?;
    } else {
        print_plan(&mut io::stdout().lock(), &plan, &from, &to)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn ratio(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "inf (a routable shard got no keys)".into()
    }
}

fn print_plan(out: &mut impl Write, plan: &Plan, from: &Router, to: &Router) -> io::Result<()> {
    writeln!(
        out,
        "map v{} ({}) -> v{} ({}): {} of {} keys move ({:.1}%)",
        from.version(),
        from.map().algorithm,
        to.version(),
        to.map().algorithm,
        plan.moved,
        plan.keys,
        plan.moved_fraction * 100.0
    )?;
    let mut names: Vec<&String> = plan.before.keys().chain(plan.after.keys()).collect();
    names.sort();
    names.dedup();
    writeln!(out)?;
    writeln!(out, "{:<20} {:>10} {:>10}", "shard", "before", "after")?;
    for name in &names {
        let b = plan.before.get(*name).copied().unwrap_or(0);
        let a = plan.after.get(*name).copied().unwrap_or(0);
        writeln!(out, "{name:<20} {b:>10} {a:>10}")?;
    }
    writeln!(
        out,
        "{:<20} {:>10} {:>10}",
        "max/min",
        ratio(plan.before_max_min),
        ratio(plan.after_max_min)
    )?;
    if plan.moved > 0 {
        writeln!(out)?;
        writeln!(out, "moves (from -> to: keys)")?;
        for (from_shard, dests) in &plan.moves {
            for (to_shard, n) in dests {
                writeln!(out, "  {from_shard} -> {to_shard}: {n}")?;
            }
        }
    }
    Ok(())
}
