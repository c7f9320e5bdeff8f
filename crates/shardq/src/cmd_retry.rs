//! `shardq retry show|set|clear`: the deployment's retry policies (a
//! default, and rules for a key or for every key starting with a prefix),
//! kept beside its map (embedded: `settings.retry.json`; Redis: the
//! deployment's settings hash), read by every worker and server when it
//! starts. Glue: parse, call `shardq-deploy` with the edits of
//! `shardq-core` (`RetrySettings::put_policy` and `remove_policy`), print.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use shardq_core::{BackoffKind, PolicyTarget, RetryChange, RetryPolicy, RetrySettings};
use shardq_deploy::Deployment;

/// Which policy a command is about: the default, one key's, or a prefix's.
#[derive(Debug, Args)]
pub struct Target {
    /// The rule of this one key (it wins over every prefix).
    #[arg(long, value_name = "KEY", conflicts_with = "prefix")]
    key: Option<String>,
    /// The rule of every key starting with PREFIX (the longest matching
    /// prefix wins), so tiers such as `free:` need no rule per key.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<String>,
}

impl Target {
    /// The policy the flags name: a key's, a prefix's, or the default.
    fn target(&self) -> PolicyTarget {
        match (&self.key, &self.prefix) {
            (Some(k), _) => PolicyTarget::Key(k.clone()),
            (None, Some(p)) => PolicyTarget::Prefix(p.clone()),
            (None, None) => PolicyTarget::Default,
        }
    }
}

/// The `--backoff` word.
fn backoff_kind(word: &str) -> anyhow::Result<BackoffKind> {
    match word {
        "exponential" => Ok(BackoffKind::Exponential),
        "fixed" => Ok(BackoffKind::Fixed),
        other => anyhow::bail!("--backoff {other:?}: expected `exponential` or `fixed`"),
    }
}

#[derive(Debug, Subcommand)]
pub enum RetryAction {
    /// Show the retry policies: the default and every rule, or with
    /// `--key` the policy that key gets (and which rule gives it), with the
    /// wait before each attempt.
    Show {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The policy this key gets.
        #[arg(long, value_name = "KEY")]
        key: Option<String>,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Change the default policy, or set a key's or a prefix's rule: the
    /// options given replace those fields, the others keep the values the
    /// target has now (a new rule starts from what its keys get today).
    /// Workers and servers started afterwards use it (restart running
    /// ones); attempts apply to jobs enqueued afterwards.
    Set {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[command(flatten)]
        target: Target,
        /// Attempts a job gets when its producer gives none (1 to 1000).
        #[arg(long, value_name = "N")]
        max_attempts: Option<u32>,
        /// `exponential` (base, doubling per attempt, up to max) or `fixed`
        /// (base after every attempt).
        #[arg(long, value_name = "KIND")]
        backoff: Option<String>,
        /// Delay after the first failed attempt, in ms (1 ms to 1 year).
        #[arg(long, value_name = "MS")]
        base_ms: Option<u64>,
        /// Longest delay, in ms (at least the base).
        #[arg(long, value_name = "MS")]
        max_ms: Option<u64>,
        /// Up to this percentage taken off each delay, so jobs that failed
        /// together come back spread out (0 to 100).
        #[arg(long, value_name = "PCT")]
        jitter_pct: Option<u8>,
    },
    /// Remove a key's or a prefix's rule (its keys go back to the next
    /// rule that matches, or the default), or without `--key`/`--prefix`
    /// put the default back (5 attempts; 10 s doubling to 1 h, up to 20%
    /// jitter) and keep the rules.
    Clear {
        /// Data dir of the deployment (embedded or Redis: `shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[command(flatten)]
        target: Target,
    },
}

/// Opens the data dir with the default options (shared with `retention`).
pub(crate) fn open(data: &std::path::Path) -> anyhow::Result<Deployment> {
    Ok(Deployment::open(data, &crate::open_options())?)
}

/// The waits before attempts 2..=max_attempts (at most the first 9 shown)
/// and their sum over every attempt, jitter left out.
fn schedule(p: &RetryPolicy) -> (Vec<u64>, u64) {
    let waits: Vec<u64> = (1..p.max_attempts).map(|a| p.backoff.delay_ms(a)).collect();
    let sum = waits.iter().fold(0u64, |a, w| a.saturating_add(*w));
    (waits.into_iter().take(9).collect(), sum)
}

fn kind_word(k: BackoffKind) -> &'static str {
    match k {
        BackoffKind::Exponential => "exponential",
        BackoffKind::Fixed => "fixed",
    }
}

fn policy_json(p: &RetryPolicy) -> serde_json::Value {
    let (waits, sum) = schedule(p);
    serde_json::json!({
        "max_attempts": p.max_attempts,
        "backoff": kind_word(p.backoff.kind),
        "base_ms": p.backoff.base_ms,
        "max_ms": p.backoff.max_ms,
        "jitter_pct": p.backoff.jitter_pct,
        "waits_ms": waits,
        "total_wait_ms": sum,
    })
}

/// One line: `attempts, kind from base up to max, jitter; waits`.
fn policy_line(p: &RetryPolicy) -> String {
    let b = &p.backoff;
    let (waits, sum) = schedule(p);
    let shown: Vec<String> = waits.iter().map(|w| human_ms(*w)).collect();
    format!(
        "{} attempts; {} from {} up to {}, up to {}% jitter; waits {}{} ({} in all before it is dead, less the jitter)",
        p.max_attempts,
        kind_word(b.kind),
        human_ms(b.base_ms),
        human_ms(b.max_ms),
        b.jitter_pct,
        if shown.is_empty() { "none".to_string() } else { shown.join(", ") },
        if (p.max_attempts as usize) > 10 { ", ..." } else { "" },
        human_ms(sum),
    )
}

/// `1500` → `1.5 s`, `7200000` → `2 h`.
fn human_ms(ms: u64) -> String {
    let (unit, div) = match ms {
        0..=999 => return format!("{ms} ms"),
        1_000..=59_999 => ("s", 1_000.0),
        60_000..=3_599_999 => ("min", 60_000.0),
        3_600_000..=86_399_999 => ("h", 3_600_000.0),
        _ => ("d", 86_400_000.0),
    };
    let v = ms as f64 / div;
    if (v - v.round()).abs() < 0.05 {
        format!("{} {unit}", v.round())
    } else {
        format!("{v:.1} {unit}")
    }
}

/// Which rule gives `key` its policy, in words.
fn source_of(s: &RetrySettings, key: &str) -> String {
    if s.rules.keys.contains_key(key) {
        return format!("key {key:?}");
    }
    let longest = (s.rules.prefixes.keys())
        .filter(|p| key.starts_with(p.as_str()))
        .max_by_key(|p| p.len());
    match longest {
        Some(p) => format!("prefix {p:?}"),
        None => "default".into(),
    }
}

pub fn run(action: RetryAction) -> anyhow::Result<ExitCode> {
    match action {
        RetryAction::Show { data, key, json } => {
            let s = open(&data)?.retry_settings()?;
            if let Some(key) = key {
                shardq_core::validate_key(&key)?;
                let p = s.for_key(&key);
                if json {
                    let mut v = policy_json(p);
                    v["key"] = key.clone().into();
                    v["from"] = source_of(&s, &key).into();
                    println!("{v}");
                } else {
                    println!(
                        "{key}\t{}\t(from the {} rule)",
                        policy_line(p),
                        source_of(&s, &key)
                    );
                }
                return Ok(ExitCode::SUCCESS);
            }
            if json {
                let rules = |m: &std::collections::BTreeMap<String, RetryPolicy>| {
                    m.iter()
                        .map(|(k, p)| (k.clone(), policy_json(p)))
                        .collect::<serde_json::Map<_, _>>()
                };
                println!(
                    "{}",
                    serde_json::json!({
                        "default": policy_json(&s.default),
                        "keys": rules(&s.rules.keys),
                        "prefixes": rules(&s.rules.prefixes),
                    })
                );
            } else {
                println!("default\t{}", policy_line(&s.default));
                for (p, r) in &s.rules.prefixes {
                    println!("prefix {p}\t{}", policy_line(r));
                }
                for (k, r) in &s.rules.keys {
                    println!("key {k}\t{}", policy_line(r));
                }
            }
        }
        RetryAction::Set {
            data,
            target,
            max_attempts,
            backoff,
            base_ms,
            max_ms,
            jitter_pct,
        } => {
            let d = open(&data)?;
            let target = target.target();
            // The key or prefix first, then the words (as they are read).
            target.validate()?;
            let change = RetryChange {
                max_attempts,
                kind: backoff.as_deref().map(backoff_kind).transpose()?,
                base_ms,
                max_ms,
                jitter_pct,
            };
            // Run again on the settings then stored if another writer
            // changed them meanwhile.
            let p = d.update_retry_settings(|s| -> anyhow::Result<_> {
                Ok(s.put_policy(&target, &change)?)
            })?;
            println!(
                "retry policy ({target}): {}; workers and servers started from now use it",
                policy_line(&p)
            );
        }
        RetryAction::Clear { data, target } => {
            let d = open(&data)?;
            let target = target.target();
            let removed =
                d.update_retry_settings(|s| Ok::<_, anyhow::Error>(s.remove_policy(&target)))?;
            match target {
                // The default is put back whether or not it was changed.
                PolicyTarget::Default => println!(
                    "retry policy, default: back to {}",
                    policy_line(&RetryPolicy::default())
                ),
                _ if !removed => println!("{target} has no retry rule; nothing changed"),
                _ => println!("retry policy, {target}: its rule removed"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human_ms(250), "250 ms");
        assert_eq!(human_ms(10_000), "10 s");
        assert_eq!(human_ms(1_500), "1.5 s");
        assert_eq!(human_ms(160_000), "2.7 min");
        assert_eq!(human_ms(3_600_000), "1 h");
    }

    #[test]
    fn the_default_schedule_spans_minutes_not_a_second() {
        let (waits, sum) = schedule(&RetryPolicy::default());
        assert_eq!(waits, [10_000, 20_000, 40_000, 80_000]);
        assert_eq!(sum, 150_000);
    }
}
