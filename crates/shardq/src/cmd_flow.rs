//! `shardq policy show|set|clear` and `shardq group show|set|clear`: flow
//! control per key (rate limits, a group, weight and priority), kept in the
//! deployment's `flow` setting beside its map and read again by every
//! worker and server within a second. Glue: parse, call `shardq-core`'s
//! checked edits through `shardq-deploy`, print.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use shardq_core::{FlowPolicy, FlowSettings, GroupLimit, PolicyTarget, QueueError, Rate};

use crate::cmd_retry::open;

/// Which policy a command is about.
#[derive(Debug, Args)]
pub struct PolicyWhich {
    /// The key whose own policy this is (it wins over every prefix).
    #[arg(value_name = "KEY", conflicts_with_all = ["prefix", "default"])]
    key: Option<String>,
    /// The policy of every key starting with PREFIX (the longest matching
    /// prefix wins), so tiers such as `free:` and `paid:` need no entry per
    /// key.
    #[arg(long, value_name = "PREFIX", conflicts_with = "default")]
    prefix: Option<String>,
    /// The deployment's default, for keys without a policy.
    #[arg(long)]
    default: bool,
}

impl PolicyWhich {
    fn target(&self) -> anyhow::Result<PolicyTarget> {
        let t = match (&self.key, &self.prefix, self.default) {
            (Some(k), _, _) => PolicyTarget::Key(k.clone()),
            (None, Some(p), _) => PolicyTarget::Prefix(p.clone()),
            (None, None, true) => PolicyTarget::Default,
            (None, None, false) => {
                anyhow::bail!("name the policy: a KEY, --prefix PREFIX or --default")
            }
        };
        t.validate()?;
        Ok(t)
    }
}

#[derive(Debug, Subcommand)]
pub enum PolicyAction {
    /// Show every policy and group, or with KEY the policy that key gets
    /// and where it comes from (its own, a prefix's or the default).
    Show {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The policy this key gets.
        #[arg(value_name = "KEY")]
        key: Option<String>,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Set a key's, a prefix's or the default policy. The options given
    /// replace those fields; the others keep what the target gets today.
    /// Every worker and server uses it within a second, no restart.
    Set {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[command(flatten)]
        which: PolicyWhich,
        /// Runs of one key at once, 1 to 256 (default 1: one at a time,
        /// strictly in order; more start in order and may finish out of
        /// it).
        #[arg(long, value_name = "N")]
        concurrency: Option<u32>,
        /// Job starts of each key, counted over every worker: N/s, N/m or
        /// N/h; `none` removes the limit.
        #[arg(long, value_name = "RATE")]
        rate: Option<String>,
        /// Starts a key may make at once after a quiet time (default: one
        /// second of its rate).
        #[arg(long, value_name = "N")]
        burst: Option<u64>,
        /// Share of worker slots among ready keys of one priority (1 to
        /// 1000, default 1).
        #[arg(long, value_name = "W")]
        weight: Option<u32>,
        /// Priority class, higher first (-1000 to 1000, default 0).
        #[arg(long, value_name = "P", allow_hyphen_values = true)]
        priority: Option<i32>,
        /// The group whose shared limit the keys' starts also count against
        /// (`shardq group set` makes it); `none` leaves the group.
        #[arg(long, value_name = "NAME")]
        group: Option<String>,
    },
    /// Remove every policy and group at once, without reading them (the
    /// way out of a stored setting that does not read).
    Reset {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
    },
    /// Remove a key's or a prefix's policy (its keys follow the next
    /// policy that matches), or put the default back to no limits.
    Clear {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[command(flatten)]
        which: PolicyWhich,
    },
}

#[derive(Debug, Subcommand)]
pub enum GroupAction {
    /// Show every group, or one, and the policies that name it.
    Show {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The group.
        #[arg(value_name = "NAME")]
        name: Option<String>,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Create or change a group: a rate shared by every key whose policy
    /// names it, over all shards, processes and machines.
    Set {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The group.
        #[arg(value_name = "NAME")]
        name: String,
        /// Job starts of all its keys together: N/s, N/m or N/h; `none`
        /// removes it (a new group needs this or --concurrency).
        #[arg(long, value_name = "RATE")]
        rate: Option<String>,
        /// Starts the group may make at once after a quiet time (default:
        /// one second of its rate).
        #[arg(long, value_name = "N")]
        burst: Option<u64>,
        /// Runs of all its keys at once, over every worker process and
        /// machine (1 to 10000); `none` removes it.
        #[arg(long, value_name = "N")]
        concurrency: Option<String>,
    },
    /// Lift the hold a handler's group back-off put on a group: its keys
    /// start again at once (every worker and server within a second).
    Resume {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The group.
        #[arg(value_name = "NAME")]
        name: String,
    },
    /// Remove a group (refused while a policy names it) and lift its hold.
    Clear {
        /// Data dir of the deployment (`shardq init` made it).
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// The group.
        #[arg(value_name = "NAME")]
        name: String,
    },
}

/// A policy in one line.
pub(crate) fn policy_line(p: &FlowPolicy) -> String {
    let mut parts = Vec::new();
    match (p.rate, p.burst_or_default()) {
        (Some(r), Some(b)) => parts.push(format!("rate {r} (burst {b})")),
        _ => parts.push("no rate limit".into()),
    }
    if let Some(g) = &p.group {
        parts.push(format!("group {g}"));
    }
    parts.push(format!("weight {}", p.weight));
    parts.push(format!("priority {}", p.priority));
    parts.push(format!("concurrency {}", p.concurrency));
    parts.join(", ")
}

fn group_line(g: &GroupLimit) -> String {
    let mut parts = Vec::new();
    match g.rate {
        Some(r) => parts.push(format!("rate {r} (burst {})", g.burst_or_default())),
        None => parts.push("no rate limit".into()),
    }
    match g.concurrency {
        Some(n) => parts.push(format!("{n} at once")),
        None => parts.push("no concurrency limit".into()),
    }
    parts.join(", ")
}

fn policy_json(p: &FlowPolicy) -> serde_json::Value {
    let mut v = serde_json::to_value(p).unwrap_or_default();
    // Defaults spelt out, for scripts.
    v["concurrency"] = p.concurrency.into();
    v["weight"] = p.weight.into();
    v["priority"] = p.priority.into();
    v["rate"] = p.rate.map(|r| r.to_string()).into();
    v["burst"] = p.burst_or_default().into();
    v["group"] = p.group.clone().into();
    v
}

fn group_json(s: &FlowSettings, name: &str, g: &GroupLimit) -> serde_json::Value {
    serde_json::json!({
        "rate": g.rate.map(|r| r.to_string()),
        "burst": g.rate.map(|_| g.burst_or_default()),
        "concurrency": g.concurrency,
        "used_by": users_of(s, name),
    })
}

/// The policies naming group `name`.
fn users_of(s: &FlowSettings, name: &str) -> Vec<String> {
    let named = |p: &FlowPolicy| p.group.as_deref() == Some(name);
    let mut v = Vec::new();
    if named(&s.default) {
        v.push("default".to_string());
    }
    v.extend(
        s.prefixes
            .iter()
            .filter(|(_, p)| named(p))
            .map(|(k, _)| format!("prefix {k}")),
    );
    v.extend(
        s.keys
            .iter()
            .filter(|(_, p)| named(p))
            .map(|(k, _)| format!("key {k}")),
    );
    v
}

fn rate_arg(text: &str) -> anyhow::Result<Option<Rate>> {
    if text == "none" {
        return Ok(None);
    }
    Ok(Some(text.parse()?))
}

pub fn policy(action: PolicyAction) -> anyhow::Result<ExitCode> {
    match action {
        PolicyAction::Show { data, key, json } => {
            let s = open(&data)?.flow_settings()?;
            if let Some(key) = key {
                shardq_core::validate_key(&key)?;
                let p = s.for_key(&key);
                let from = match s.source_of(&key) {
                    shardq_core::PolicySource::Key => format!("key {key:?}"),
                    shardq_core::PolicySource::Prefix(p) => format!("prefix {p:?}"),
                    shardq_core::PolicySource::Default => "default".into(),
                };
                if json {
                    let mut v = policy_json(p);
                    v["key"] = key.clone().into();
                    v["from"] = from.into();
                    println!("{v}");
                } else {
                    println!("{key}\t{}\t(from the {from} policy)", policy_line(p));
                }
                return Ok(ExitCode::SUCCESS);
            }
            if json {
                let all = |m: &std::collections::BTreeMap<String, FlowPolicy>| {
                    m.iter()
                        .map(|(k, p)| (k.clone(), policy_json(p)))
                        .collect::<serde_json::Map<_, _>>()
                };
                let groups: serde_json::Map<_, _> = (s.groups.iter())
                    .map(|(n, g)| (n.clone(), group_json(&s, n, g)))
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({
                        "default": policy_json(&s.default),
                        "prefixes": all(&s.prefixes),
                        "keys": all(&s.keys),
                        "groups": groups,
                    })
                );
            } else {
                println!("default\t{}", policy_line(&s.default));
                for (p, r) in &s.prefixes {
                    println!("prefix {p}\t{}", policy_line(r));
                }
                for (k, r) in &s.keys {
                    println!("key {k}\t{}", policy_line(r));
                }
                for (n, g) in &s.groups {
                    println!("group {n}\t{}", group_line(g));
                }
            }
        }
        PolicyAction::Set {
            data,
            which,
            concurrency,
            rate,
            burst,
            weight,
            priority,
            group,
        } => {
            let target = which.target()?;
            let d = open(&data)?;
            // Run again on the settings then stored if another writer
            // changed them meanwhile.
            let p = d.update_flow_settings(|s| -> anyhow::Result<_> {
                let mut p = s.policy_of(&target);
                if let Some(n) = concurrency {
                    p.concurrency = n;
                }
                if let Some(r) = &rate {
                    p.rate = rate_arg(r)?;
                    if p.rate.is_none() {
                        p.burst = None;
                    }
                }
                if let Some(b) = burst {
                    p.burst = Some(b);
                }
                if let Some(w) = weight {
                    p.weight = w;
                }
                if let Some(pr) = priority {
                    p.priority = pr;
                }
                if let Some(g) = &group {
                    p.group = (g != "none").then(|| g.clone());
                }
                s.put_policy(&target, p.clone())?;
                Ok(p)
            })?;
            println!(
                "policy ({target}): {}; every worker uses it within a second",
                policy_line(&p)
            );
        }
        PolicyAction::Reset { data } => {
            open(&data)?.reset_flow_settings()?;
            println!("every policy and group removed; every worker follows within a second");
        }
        PolicyAction::Clear { data, which } => {
            let target = which.target()?;
            let d = open(&data)?;
            let removed =
                d.update_flow_settings(|s| Ok::<_, anyhow::Error>(s.remove_policy(&target)))?;
            if !removed {
                println!("{target} has no policy; nothing changed");
                return Ok(ExitCode::SUCCESS);
            }
            println!("policy ({target}) removed; every worker follows it within a second");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn group(action: GroupAction) -> anyhow::Result<ExitCode> {
    match action {
        GroupAction::Show { data, name, json } => {
            let s = open(&data)?.flow_settings()?;
            let shown: Vec<(&String, &GroupLimit)> = match &name {
                Some(n) => {
                    let g = s.groups.get_key_value(n).ok_or_else(|| {
                        anyhow::anyhow!("no group {n:?} (groups: {:?})", s.groups.keys())
                    })?;
                    vec![g]
                }
                None => s.groups.iter().collect(),
            };
            if json {
                let v: serde_json::Map<_, _> = (shown.iter())
                    .map(|(n, g)| ((*n).clone(), group_json(&s, n, g)))
                    .collect();
                println!("{}", serde_json::Value::Object(v));
            } else {
                if shown.is_empty() {
                    println!(
                        "no groups (`shardq group set --data DIR NAME --rate N/s` or `--concurrency N` makes one)"
                    );
                }
                for (n, g) in shown {
                    let users = users_of(&s, n);
                    println!(
                        "{n}\t{}\tused by {}",
                        group_line(g),
                        if users.is_empty() {
                            "no policy".into()
                        } else {
                            users.join(", ")
                        }
                    );
                }
            }
        }
        GroupAction::Set {
            data,
            name,
            rate,
            burst,
            concurrency,
        } => {
            shardq_core::flow::validate_group_name(&name)?;
            let d = open(&data)?;
            // Run again on the settings then stored if another writer
            // changed them meanwhile.
            let g = d.update_flow_settings(|s| -> anyhow::Result<_> {
                let old = s.groups.get(&name).cloned();
                if old.is_none() && rate.is_none() && concurrency.is_none() {
                    anyhow::bail!(
                        "group {name:?} is new: give it a --rate (N/s, N/m or N/h), a --concurrency or both"
                    );
                }
                let rate = match rate.as_deref().map(str::trim) {
                    Some("none") => None,
                    Some(r) => Some(r.parse::<Rate>()?),
                    None => old.as_ref().and_then(|g| g.rate),
                };
                let concurrency = match concurrency.as_deref().map(str::trim) {
                    Some("none") => None,
                    Some(n) => Some(n.parse::<u32>().map_err(|_| QueueError::InvalidOption {
                        name: "concurrency",
                        value: format!("{n:?}"),
                        allowed: format!(
                            "a whole number from 1 to {}, or none",
                            shardq_core::flow::GROUP_CONCURRENCY_MAX
                        ),
                    })?),
                    None => old.as_ref().and_then(|g| g.concurrency),
                };
                let g = GroupLimit {
                    rate,
                    // A burst kept from before goes with its rate; one given
                    // without a rate is refused by name.
                    burst: burst.or(old.and_then(|g| g.burst).filter(|_| rate.is_some())),
                    concurrency,
                };
                s.put_group(&name, g.clone())?;
                Ok(g)
            })?;
            println!(
                "group {name}: {}; every worker uses it within a second",
                group_line(&g)
            );
        }
        GroupAction::Resume { data, name } => {
            open(&data)?.resume_group(&name)?;
            println!("group {name} resumed: its keys start again (every worker within a second)");
        }
        GroupAction::Clear { data, name } => {
            let d = open(&data)?;
            let removed = d.remove_group(&name)?;
            if !removed {
                println!("no group {name:?}; nothing changed");
                return Ok(ExitCode::SUCCESS);
            }
            println!("group {name} removed");
        }
    }
    Ok(ExitCode::SUCCESS)
}
