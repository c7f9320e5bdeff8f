//! The versioned shard map: which shards exist, their weights and states,
//! which algorithm and hash route keys to them, and per-key overrides.
//!
//! The YAML layout follows the specification's "Publish the Shard Map" step:
//!
//! ```yaml
//! version: 7
//! algorithm: rendezvous      # modulo | ring | rendezvous | jump | slots
//! hash: blake2b64            # blake2b64 | xxh64 | xxh3 | murmur3 | fnv1a64 | crc16
//! vnodes: 256                # ring only
//! shards:
//!   - { name: redis-0, url: "redis://127.0.0.1:7001/0", weight: 1 }
//!   - { name: redis-4, weight: 1, state: warming }
//! overrides: { big-tenant: redis-0 }
//! ```
//!
//! Parsing validates everything and reports the field and value of the first
//! problem; it never panics on any input. This module reads no files: callers
//! hand it text.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_yaml_ng::{Mapping, Value};

use crate::error::MapError;
use crate::hash::HashFn;
use crate::slots::SLOT_COUNT;

/// Longest shard name, in bytes. Names become directory names and Redis key
/// parts, so they are short and made of a safe alphabet.
pub const SHARD_NAME_BYTES_MAX: usize = 64;
/// Largest shard weight. Bounds the ring's size (`vnodes * weight` points).
pub const WEIGHT_MAX: u32 = 1000;
/// Largest number of shards in one map.
pub const SHARDS_MAX: usize = 4096;
/// Default virtual nodes per unit of weight on the ring (as in the specification).
pub const VNODES_DEFAULT: u32 = 256;
/// Largest `vnodes` value.
pub const VNODES_MAX: u32 = 4096;
/// Largest number of points a ring may hold (`vnodes * total weight`).
pub const RING_POINTS_MAX: u64 = 1 << 24;

/// How keys are routed to the active shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Algorithm {
    /// `shards[h(key) % N]`: the baseline that moves almost every key.
    Modulo,
    /// Hash ring with `vnodes * weight` points per shard.
    Ring,
    /// Highest random weight; weighted by the logarithmic method.
    #[default]
    Rendezvous,
    /// Lamping-Veach jump consistent hash over the active shards in map order.
    Jump,
    /// Redis Cluster slots: CRC16 of the hashtag mod 16384, slots dealt to shards.
    Slots,
}

impl Algorithm {
    /// Every algorithm, in documentation order.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::Modulo,
        Algorithm::Ring,
        Algorithm::Rendezvous,
        Algorithm::Jump,
        Algorithm::Slots,
    ];

    /// The name used in shard maps and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Modulo => "modulo",
            Algorithm::Ring => "ring",
            Algorithm::Rendezvous => "rendezvous",
            Algorithm::Jump => "jump",
            Algorithm::Slots => "slots",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown algorithm {s:?}; expected one of modulo, ring, rendezvous, jump, slots"))
    }
}

/// Whether a shard takes new keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ShardState {
    /// Routable: the algorithm may pick it.
    #[default]
    Active,
    /// Deployed and visible, but receives nothing (except through an override).
    Warming,
    /// On its way out: receives nothing new (except through an override).
    Draining,
}

impl ShardState {
    /// The name used in shard maps.
    pub fn name(self) -> &'static str {
        match self {
            ShardState::Active => "active",
            ShardState::Warming => "warming",
            ShardState::Draining => "draining",
        }
    }
}

impl FromStr for ShardState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "active" => Ok(ShardState::Active),
            "warming" => Ok(ShardState::Warming),
            "draining" => Ok(ShardState::Draining),
            _ => Err(format!(
                "unknown state {s:?}; expected active, warming or draining"
            )),
        }
    }
}

/// An inclusive range of Redis Cluster slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRange {
    /// First slot.
    pub start: u16,
    /// Last slot, inclusive.
    pub end: u16,
}

impl fmt::Display for SlotRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.start == self.end {
            write!(f, "{}", self.start)
        } else {
            write!(f, "{}-{}", self.start, self.end)
        }
    }
}

/// One shard of the map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// Unique name: letters, digits, `-`, `_`, `.`; 1 to 64 bytes; not `.` or `..`.
    pub name: String,
    /// Where the shard lives (`file:`, `redis://...`); `None` means the embedded engine.
    pub url: Option<String>,
    /// Relative capacity, 1 to [`WEIGHT_MAX`].
    pub weight: u32,
    /// Whether the algorithm may route to it.
    pub state: ShardState,
    /// Explicit Redis Cluster slot ranges (the `slots` algorithm only).
    pub slots: Vec<SlotRange>,
}

impl Shard {
    /// An active shard of weight 1 with no URL.
    pub fn new(name: impl Into<String>) -> Self {
        Shard {
            name: name.into(),
            url: None,
            weight: 1,
            state: ShardState::Active,
            slots: Vec::new(),
        }
    }
}

/// A validated shard map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    /// Monotonic version; every published change increments it.
    pub version: u64,
    /// Routing algorithm.
    pub algorithm: Algorithm,
    /// Hash function for keys and ring points.
    pub hash: HashFn,
    /// Ring points per unit of weight.
    pub vnodes: u32,
    /// Shards in map order (the order `modulo` and `jump` use).
    pub shards: Vec<Shard>,
    /// Key -> shard name; wins over the algorithm, in every state.
    pub overrides: BTreeMap<String, String>,
}

/// Checks a shard name against the allowed alphabet and length.
pub fn validate_shard_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("shard name must not be empty".into());
    }
    if name.len() > SHARD_NAME_BYTES_MAX {
        return Err(format!(
            "shard name is {} bytes; at most {SHARD_NAME_BYTES_MAX} allowed",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err("shard name must not be `.` or `..`".into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "shard name contains {c:?}; only ASCII letters, digits, `-`, `_` and `.` are allowed"
        ));
    }
    Ok(())
}

fn render(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => serde_json::to_string(other).unwrap_or_else(|_| format!("{other:?}")),
    }
}

fn as_u64(value: &Value, field: &str, reason: &str) -> Result<u64, MapError> {
    value
        .as_u64()
        .ok_or_else(|| MapError::invalid(field, render(value), reason))
}

fn as_str<'a>(value: &'a Value, field: &str, reason: &str) -> Result<&'a str, MapError> {
    value
        .as_str()
        .ok_or_else(|| MapError::invalid(field, render(value), reason))
}

/// Refuses a top-level field the map does not have.
fn refuse_unknown_fields(top: &Mapping) -> Result<(), MapError> {
    let known = [
        "version",
        "algorithm",
        "hash",
        "vnodes",
        "shards",
        "overrides",
    ];
    for k in top.keys() {
        let name = k.as_str().unwrap_or("");
        if !known.contains(&name) {
            return Err(MapError::invalid(
                render(k),
                "(field name)",
                format!("unknown field; expected one of {}", known.join(", ")),
            ));
        }
    }
    Ok(())
}

/// The named choice in string field `field` (an algorithm, a hash), or the
/// default when the field is absent.
fn parse_named<T>(top: &Mapping, field: &str) -> Result<T, MapError>
where
    T: FromStr<Err = String> + Default,
{
    match top.get(field) {
        None | Some(Value::Null) => Ok(T::default()),
        Some(v) => {
            let s = as_str(v, field, "expected a string")?;
            s.parse()
                .map_err(|reason: String| MapError::invalid(field, render(v), reason))
        }
    }
}

/// The `vnodes` field (1 to [`VNODES_MAX`]), or its default when absent.
fn parse_vnodes(top: &Mapping) -> Result<u32, MapError> {
    match top.get("vnodes") {
        None | Some(Value::Null) => Ok(VNODES_DEFAULT),
        Some(v) => {
            let reason = format!("vnodes must be an integer from 1 to {VNODES_MAX}");
            let n = as_u64(v, "vnodes", &reason)?;
            if n == 0 || n > u64::from(VNODES_MAX) {
                return Err(MapError::invalid("vnodes", render(v), reason));
            }
            Ok(n as u32)
        }
    }
}

/// The `overrides` field, key to shard name (none when absent).
fn parse_overrides(top: &Mapping) -> Result<BTreeMap<String, String>, MapError> {
    let mut overrides = BTreeMap::new();
    match top.get("overrides") {
        None | Some(Value::Null) => {}
        Some(Value::Mapping(m)) => {
            for (k, v) in m {
                let key = match k {
                    Value::String(s) => s.clone(),
                    // YAML reads `123: shard-0` as a number; keys are strings.
                    Value::Number(n) => n.to_string(),
                    other => {
                        return Err(MapError::invalid(
                            "overrides",
                            render(other),
                            "override keys must be strings",
                        ))
                    }
                };
                let field = format!("overrides.{key}");
                let shard = as_str(v, &field, "an override must name a shard")?;
                overrides.insert(key, shard.to_string());
            }
        }
        Some(v) => {
            return Err(MapError::invalid(
                "overrides",
                render(v),
                "overrides must be a mapping of key: shard",
            ))
        }
    }
    Ok(overrides)
}

fn parse_slot_range(value: &Value, field: &str) -> Result<SlotRange, MapError> {
    let reason = "expected a slot (0-16383) or an inclusive range such as \"0-5460\"";
    let bad = || MapError::invalid(field, render(value), reason);
    let (start, end) = match value {
        Value::Number(n) => {
            let s = n.as_u64().ok_or_else(bad)?;
            (s, s)
        }
        Value::String(s) => match s.split_once('-') {
            Some((a, b)) => (
                a.trim().parse::<u64>().map_err(|_| bad())?,
                b.trim().parse::<u64>().map_err(|_| bad())?,
            ),
            None => {
                let v = s.trim().parse::<u64>().map_err(|_| bad())?;
                (v, v)
            }
        },
        _ => return Err(bad()),
    };
    if start > end || end >= SLOT_COUNT as u64 {
        return Err(bad());
    }
    Ok(SlotRange {
        start: start as u16,
        end: end as u16,
    })
}

impl ShardMap {
    /// A version-1 map of active, weight-1 shards with the default hash.
    pub fn with_shards<I, S>(algorithm: Algorithm, names: I) -> Result<Self, MapError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let map = ShardMap {
            version: 1,
            algorithm,
            hash: HashFn::default(),
            vnodes: VNODES_DEFAULT,
            shards: names.into_iter().map(Shard::new).collect(),
            overrides: BTreeMap::new(),
        };
        map.validate()?;
        Ok(map)
    }

    /// Parses and validates a YAML shard map.
    pub fn from_yaml(text: &str) -> Result<Self, MapError> {
        let doc: Value =
            serde_yaml_ng::from_str(text).map_err(|e| MapError::Yaml(e.to_string()))?;
        let top = doc.as_mapping().ok_or_else(|| {
            MapError::invalid(
                "(document)",
                render(&doc),
                "the shard map must be a YAML mapping",
            )
        })?;
        refuse_unknown_fields(top)?;
        let version = match top.get("version") {
            None | Some(Value::Null) => {
                return Err(MapError::Missing {
                    field: "version".into(),
                })
            }
            Some(v) => as_u64(v, "version", "version must be a non-negative integer")?,
        };
        let algorithm: Algorithm = parse_named(top, "algorithm")?;
        let hash: HashFn = parse_named(top, "hash")?;
        let vnodes = parse_vnodes(top)?;
        let shard_values = match top.get("shards") {
            None | Some(Value::Null) => {
                return Err(MapError::Missing {
                    field: "shards".into(),
                })
            }
            Some(Value::Sequence(seq)) => seq,
            Some(v) => {
                return Err(MapError::invalid(
                    "shards",
                    render(v),
                    "shards must be a list",
                ))
            }
        };
        let mut shards = Vec::with_capacity(shard_values.len());
        for (i, sv) in shard_values.iter().enumerate() {
            shards.push(Self::parse_shard(i, sv)?);
        }
        let overrides = parse_overrides(top)?;
        let map = ShardMap {
            version,
            algorithm,
            hash,
            vnodes,
            shards,
            overrides,
        };
        map.validate()?;
        Ok(map)
    }

    fn parse_shard(i: usize, sv: &Value) -> Result<Shard, MapError> {
        let at = |f: &str| format!("shards[{i}].{f}");
        let m = sv.as_mapping().ok_or_else(|| {
            MapError::invalid(
                format!("shards[{i}]"),
                render(sv),
                "each shard must be a mapping with at least a name",
            )
        })?;
        for k in m.keys() {
            let name = k.as_str().unwrap_or("");
            if !["name", "url", "weight", "state", "slots"].contains(&name) {
                return Err(MapError::invalid(
                    format!("shards[{i}].{}", render(k)),
                    "(field name)",
                    "unknown field; expected name, url, weight, state or slots",
                ));
            }
        }
        let name = match m.get("name") {
            None | Some(Value::Null) => return Err(MapError::Missing { field: at("name") }),
            Some(v) => as_str(v, &at("name"), "a shard name must be a string")?.to_string(),
        };
        let url = match m.get("url") {
            None | Some(Value::Null) => None,
            Some(v) => Some(as_str(v, &at("url"), "a url must be a string")?.to_string()),
        };
        let weight = match m.get("weight") {
            None | Some(Value::Null) => 1,
            Some(v) => {
                let reason = format!("weight must be an integer from 1 to {WEIGHT_MAX}");
                let w = as_u64(v, &at("weight"), &reason)?;
                if w == 0 || w > u64::from(WEIGHT_MAX) {
                    return Err(MapError::invalid(at("weight"), render(v), reason));
                }
                w as u32
            }
        };
        let state = match m.get("state") {
            None | Some(Value::Null) => ShardState::Active,
            Some(v) => {
                let s = as_str(v, &at("state"), "expected a string")?;
                s.parse()
                    .map_err(|reason: String| MapError::invalid(at("state"), render(v), reason))?
            }
        };
        let slots = match m.get("slots") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Sequence(seq)) => seq
                .iter()
                .enumerate()
                .map(|(j, v)| parse_slot_range(v, &format!("shards[{i}].slots[{j}]")))
                .collect::<Result<_, _>>()?,
            Some(v) => vec![parse_slot_range(v, &at("slots"))?],
        };
        Ok(Shard {
            name,
            url,
            weight,
            state,
            slots,
        })
    }

    /// Checks every rule a map must satisfy. Called by the parser; call it
    /// again after editing a map in code.
    pub fn validate(&self) -> Result<(), MapError> {
        if self.vnodes == 0 || self.vnodes > VNODES_MAX {
            return Err(MapError::invalid(
                "vnodes",
                self.vnodes.to_string(),
                format!("vnodes must be an integer from 1 to {VNODES_MAX}"),
            ));
        }
        if self.shards.is_empty() {
            return Err(MapError::invalid(
                "shards",
                "[]",
                "the map must list at least one shard",
            ));
        }
        if self.shards.len() > SHARDS_MAX {
            return Err(MapError::invalid(
                "shards",
                format!("({} shards)", self.shards.len()),
                format!("at most {SHARDS_MAX} shards are allowed"),
            ));
        }
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        let mut total_weight: u64 = 0;
        let mut slot_owner: Vec<Option<usize>> = Vec::new();
        for (i, s) in self.shards.iter().enumerate() {
            validate_shard_name(&s.name).map_err(|reason| {
                MapError::invalid(format!("shards[{i}].name"), format!("{:?}", s.name), reason)
            })?;
            if let Some(first) = seen.insert(&s.name, i) {
                return Err(MapError::DuplicateShard {
                    name: s.name.clone(),
                    first,
                    second: i,
                });
            }
            if s.weight == 0 || s.weight > WEIGHT_MAX {
                return Err(MapError::invalid(
                    format!("shards[{i}].weight"),
                    s.weight.to_string(),
                    format!("weight must be an integer from 1 to {WEIGHT_MAX}"),
                ));
            }
            if s.state == ShardState::Active {
                total_weight += u64::from(s.weight);
            }
            if !s.slots.is_empty() {
                if slot_owner.is_empty() {
                    slot_owner = vec![None; SLOT_COUNT];
                }
                for r in &s.slots {
                    for slot in r.start..=r.end {
                        if let Some(prev) = slot_owner[slot as usize] {
                            if prev != i {
                                return Err(MapError::SlotConflict {
                                    slot,
                                    first: self.shards[prev].name.clone(),
                                    second: s.name.clone(),
                                });
                            }
                        }
                        slot_owner[slot as usize] = Some(i);
                    }
                }
            }
        }
        if total_weight == 0 {
            return Err(MapError::NoActiveShard);
        }
        if self.algorithm == Algorithm::Ring
            && total_weight * u64::from(self.vnodes) > RING_POINTS_MAX
        {
            return Err(MapError::invalid(
                "vnodes",
                self.vnodes.to_string(),
                format!(
                    "vnodes x total active weight ({total_weight}) exceeds the ring bound of {RING_POINTS_MAX} points"
                ),
            ));
        }
        for (key, shard) in &self.overrides {
            if !seen.contains_key(shard.as_str()) {
                return Err(MapError::UnknownOverrideShard {
                    key: key.clone(),
                    shard: shard.clone(),
                });
            }
        }
        Ok(())
    }

    /// Index of the shard named `name`.
    pub fn shard_index(&self, name: &str) -> Option<usize> {
        self.shards.iter().position(|s| s.name == name)
    }

    /// The shard named `name`.
    pub fn shard(&self, name: &str) -> Option<&Shard> {
        self.shards.iter().find(|s| s.name == name)
    }

    /// Renders the map as YAML that [`ShardMap::from_yaml`] reads back unchanged.
    pub fn to_yaml(&self) -> String {
        let mut out = String::new();
        use std::fmt::Write as _;
        let _ = writeln!(out, "version: {}", self.version);
        let _ = writeln!(out, "algorithm: {}", self.algorithm);
        let _ = writeln!(out, "hash: {}", self.hash);
        let _ = writeln!(out, "vnodes: {}", self.vnodes);
        let _ = writeln!(out, "shards:");
        for s in &self.shards {
            let _ = write!(out, "  - {{ name: {}", s.name);
            if let Some(url) = &s.url {
                let _ = write!(out, ", url: {}", yaml_string(url));
            }
            let _ = write!(out, ", weight: {}", s.weight);
            if s.state != ShardState::Active {
                let _ = write!(out, ", state: {}", s.state.name());
            }
            if !s.slots.is_empty() {
                let ranges: Vec<String> = s.slots.iter().map(|r| format!("\"{r}\"")).collect();
                let _ = write!(out, ", slots: [{}]", ranges.join(", "));
            }
            let _ = writeln!(out, " }}");
        }
        if self.overrides.is_empty() {
            let _ = writeln!(out, "overrides: {{}}");
        } else {
            let _ = writeln!(out, "overrides:");
            for (k, v) in &self.overrides {
                let _ = writeln!(out, "  {}: {}", yaml_string(k), v);
            }
        }
        out
    }
}

/// Quotes a string for YAML with JSON rules (JSON strings are valid YAML).
fn yaml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "version: 7\nalgorithm: ring\nshards:\n  - { name: a }\n  - { name: b, weight: 2, state: warming }\noverrides: { t-1: b }\n";

    #[test]
    fn parses_and_round_trips() {
        let m = ShardMap::from_yaml(GOOD).unwrap();
        assert_eq!(m.version, 7);
        assert_eq!(m.algorithm, Algorithm::Ring);
        assert_eq!(m.hash, HashFn::Blake2b64);
        assert_eq!(m.vnodes, 256);
        assert_eq!(m.shards[1].weight, 2);
        assert_eq!(m.shards[1].state, ShardState::Warming);
        assert_eq!(m.overrides["t-1"], "b");
        let again = ShardMap::from_yaml(&m.to_yaml()).unwrap();
        assert_eq!(again, m);
    }

    /// One case per rule: the YAML and a fragment the error must contain.
    #[test]
    fn bad_maps_name_field_and_value() {
        let cases: &[(&str, &str)] = &[
            ("version: [", "not valid YAML"),
            ("- 1", "must be a YAML mapping"),
            ("shards: [{name: a}]", "missing field `version`"),
            ("version: x\nshards: [{name: a}]", "`version` has invalid value \"x\""),
            ("version: 1.5\nshards: [{name: a}]", "`version` has invalid value 1.5"),
            ("version: -1\nshards: [{name: a}]", "`version` has invalid value -1"),
            ("version: 1", "missing field `shards`"),
            ("version: 1\nshards: []", "at least one shard"),
            ("version: 1\nshards: [{name: \"\"}]", "must not be empty"),
            ("version: 1\nshards: [{name: ../x}]", "`shards[0].name` has invalid value \"../x\""),
            ("version: 1\nshards: [{name: ..}]", "must not be `.` or `..`"),
            ("version: 1\nshards: [{name: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa}]", "65 bytes"),
            ("version: 1\nshards: [{name: a}, {name: a}]", "duplicate shard name \"a\""),
            ("version: 1\nshards: [{name: a, weight: 0}]", "`shards[0].weight` has invalid value 0"),
            ("version: 1\nshards: [{name: a, weight: -2}]", "`shards[0].weight` has invalid value -2"),
            ("version: 1\nshards: [{name: a, weight: 1.5}]", "`shards[0].weight` has invalid value 1.5"),
            ("version: 1\nshards: [{name: a, weight: heavy}]", "invalid value \"heavy\""),
            ("version: 1\nalgorithm: maglev\nshards: [{name: a}]", "unknown algorithm \"maglev\""),
            ("version: 1\nhash: sha1\nshards: [{name: a}]", "unknown hash \"sha1\""),
            ("version: 1\nshards: [{name: a, state: asleep}]", "unknown state \"asleep\""),
            ("version: 1\nshards: [{name: a}]\noverrides: {t: b}", "names unknown shard \"b\""),
            ("version: 1\nshards: [{name: a, state: warming}]", "no shard is active"),
            ("version: 1\nshards: [{name: a, colour: red}]", "unknown field"),
            ("version: 1\nshard: [{name: a}]", "unknown field"),
            ("version: 1\nvnodes: 0\nshards: [{name: a}]", "`vnodes` has invalid value 0"),
            ("version: 1\nshards: [{name: a, slots: [\"0-16384\"]}]", "\"0-16384\""),
            ("version: 1\nshards: [{name: a, slots: [\"0-10\"]}, {name: b, slots: [5]}]", "slot 5 is assigned to both"),
        ];
        for (yaml, want) in cases {
            let err = ShardMap::from_yaml(yaml).expect_err(yaml).to_string();
            assert!(
                err.contains(want),
                "map {yaml:?}: error {err:?} lacks {want:?}"
            );
        }
    }
}
