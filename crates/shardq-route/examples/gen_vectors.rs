//! Writes the cross-language routing vectors, `testdata/routing-vectors.json`:
//!
//! ```text
//! cargo run -p shardq-route --example gen_vectors > testdata/routing-vectors.json
//! ```
//!
//! Every client in every language must reproduce these values exactly, so the
//! file is checked in and `tests/vectors.rs` fails when routing changes or
//! when this generator's output drifts from the checked-in file. The
//! generator only prints: it reads nothing and depends on no clock or
//! randomness, so two runs give the same bytes.
//!
//! 64-bit values are written as decimal strings because JSON numbers are
//! doubles in most languages and cannot hold every `u64`.

use std::fmt::Write as _;

use serde::Serialize;
use shardq_route::hash::HashFn;
use shardq_route::jump::jump;
use shardq_route::rendezvous::weighted_score;
use shardq_route::ring::Ring;
use shardq_route::{hashtag, slot, Algorithm, Router, ShardState};

/// The command that regenerates the file, recorded in it.
pub const GENERATED_BY: &str =
    "cargo run -p shardq-route --example gen_vectors > testdata/routing-vectors.json";

/// Bumped when the layout of the file changes (not when values change).
pub const FORMAT_VERSION: u32 = 1;

fn main() {
    print!("{}", generate());
}

/// A key of exactly `len` bytes; lengths straddle the size classes of xxh3
/// (0, 1-3, 4-8, 9-16, 17-128, 129-240, >240) and the 256-byte join buffer.
fn key_of_len(len: usize) -> String {
    (0..len)
        .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
        .collect()
}

/// Keys whose hashes are pinned: edge cases of encoding, braces and length.
pub fn hash_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "",
        "a",
        "abc",
        "t-0",
        "t-1",
        "t-42",
        "t-99999",
        "tenant-0000000012345",
        "redis-0#0",
        "redis-0:t-42",
        "123456789",
        "somekey",
        "tenant-é",
        "租户-7",
        "🦀-crab",
        "{user1000}.following",
        "{user1000}.followers",
        "foo{}{bar}",
        "foo{{bar}}zap",
        "foo{bar}{zap}",
        "foo{hash_tag}",
        "{租户}-queue",
        "open{only",
        "close}only{",
        "key with spaces",
        "tab\tand\nnewline",
        "big-tenant",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for len in [
        4, 8, 9, 16, 17, 128, 129, 240, 241, 247, 248, 255, 256, 257, 300, 1024,
    ] {
        keys.push(key_of_len(len));
    }
    keys.push(format!("long-{}", "abcdefghij".repeat(30)));
    keys.push("租户".repeat(100));
    keys
}

/// The ~200 keys routed through every map: tenants plus the edge cases.
pub fn route_keys() -> Vec<String> {
    let mut keys: Vec<String> = (0..160).map(|i| format!("t-{i}")).collect();
    keys.extend(hash_keys());
    keys.extend(["{user1000}.a", "{user1000}.b", "{user1001}.a", "{t-7}.jobs"].map(String::from));
    keys
}

/// One shard map under test: a name saying what it exercises, and its YAML.
pub struct MapCase {
    pub name: &'static str,
    pub yaml: &'static str,
}

/// Every map: each algorithm, weighted and not, with warming and draining
/// shards, overrides, explicit slot ranges and each hash function. Rings use
/// few vnodes so that slower reference clients stay fast.
pub fn map_cases() -> Vec<MapCase> {
    vec![
        MapCase {
            name: "modulo-4-blake2b64",
            yaml: "version: 1\nalgorithm: modulo\nhash: blake2b64\nshards:\n  - { name: redis-0 }\n  - { name: redis-1 }\n  - { name: redis-2 }\n  - { name: redis-3 }\n",
        },
        MapCase {
            name: "modulo-xxh3-warming-overrides",
            yaml: "version: 3\nalgorithm: modulo\nhash: xxh3\nshards:\n  - { name: redis-0, weight: 2 }\n  - { name: redis-1 }\n  - { name: redis-2, state: warming }\n  - { name: redis-3 }\n  - { name: redis-4, state: draining }\noverrides:\n  \"t-3\": redis-2\n  \"big-tenant\": redis-4\n  \"tenant-é\": redis-0\n",
        },
        MapCase {
            name: "modulo-crc16",
            yaml: "version: 1\nalgorithm: modulo\nhash: crc16\nshards: [{name: a}, {name: b}, {name: c}]\n",
        },
        MapCase {
            name: "ring-4-v16-blake2b64",
            yaml: "version: 1\nalgorithm: ring\nhash: blake2b64\nvnodes: 16\nshards:\n  - { name: redis-0 }\n  - { name: redis-1 }\n  - { name: redis-2 }\n  - { name: redis-3 }\n",
        },
        MapCase {
            name: "ring-weighted-v16-xxh64-warming",
            yaml: "version: 2\nalgorithm: ring\nhash: xxh64\nvnodes: 16\nshards:\n  - { name: small, weight: 1 }\n  - { name: medium, weight: 2 }\n  - { name: large, weight: 3 }\n  - { name: next, weight: 1, state: warming }\n",
        },
        MapCase {
            // 8192 points in crc16's 65536 values: about 290 collide, pinning
            // the tie rule. Names differ in length on purpose: CRC16 never
            // collides on equal-length inputs that differ in a 16-bit window.
            name: "ring-crc16-v2048-ties",
            yaml: "version: 1\nalgorithm: ring\nhash: crc16\nvnodes: 2048\nshards:\n  - { name: a }\n  - { name: bb }\n  - { name: ccc-x }\n  - { name: redis-three }\n",
        },
        MapCase {
            name: "ring-fnv1a64-v16-draining-overrides",
            yaml: "version: 9\nalgorithm: ring\nhash: fnv1a64\nvnodes: 16\nshards:\n  - { name: q-0 }\n  - { name: q-1, state: draining }\n  - { name: q-2 }\n  - { name: q-3, weight: 2 }\noverrides: { \"t-1\": q-1, \"t-2\": q-2, \"租户-7\": q-0 }\n",
        },
        MapCase {
            name: "ring-murmur3-v16",
            yaml: "version: 1\nalgorithm: ring\nhash: murmur3\nvnodes: 16\nshards: [{name: m-0}, {name: m-1}, {name: m-2}, {name: m-3}, {name: m-4}]\n",
        },
        MapCase {
            name: "ring-xxh3-v16",
            yaml: "version: 1\nalgorithm: ring\nhash: xxh3\nvnodes: 16\nshards: [{name: redis-0}, {name: redis-1}, {name: redis-2}]\n",
        },
        MapCase {
            // The specification's map: redis-4 deployed but not yet routable.
            name: "rendezvous-seed-warming",
            yaml: "version: 7\nalgorithm: rendezvous\nshards:\n  - { name: redis-0, url: \"redis://redis-0:6379\", weight: 1 }\n  - { name: redis-1, url: \"redis://redis-1:6379\", weight: 1 }\n  - { name: redis-2, url: \"redis://redis-2:6379\", weight: 1 }\n  - { name: redis-3, url: \"redis://redis-3:6379\", weight: 1 }\n  - { name: redis-4, url: \"redis://redis-4:6379\", weight: 1, state: warming }\noverrides: {}\n",
        },
        MapCase {
            name: "rendezvous-5-blake2b64",
            yaml: "version: 8\nalgorithm: rendezvous\nhash: blake2b64\nshards: [{name: redis-0}, {name: redis-1}, {name: redis-2}, {name: redis-3}, {name: redis-4}]\n",
        },
        MapCase {
            name: "rendezvous-weighted-murmur3-overrides",
            yaml: "version: 4\nalgorithm: rendezvous\nhash: murmur3\nshards:\n  - { name: w1, weight: 1 }\n  - { name: w2, weight: 2 }\n  - { name: w5, weight: 5 }\n  - { name: w1b, weight: 1 }\n  - { name: w9, weight: 9, state: warming }\noverrides:\n  \"big-tenant\": w9\n  \"t-5\": w1\n",
        },
        MapCase {
            // Equal weights other than 1 take the unweighted path.
            name: "rendezvous-equal-weights-xxh3",
            yaml: "version: 1\nalgorithm: rendezvous\nhash: xxh3\nshards:\n  - { name: e-0, weight: 3 }\n  - { name: e-1, weight: 3 }\n  - { name: e-2, weight: 3 }\n  - { name: e-3, weight: 7, state: warming }\n",
        },
        MapCase {
            name: "rendezvous-weighted-xxh64",
            yaml: "version: 1\nalgorithm: rendezvous\nhash: xxh64\nshards: [{name: a, weight: 10}, {name: b, weight: 1}, {name: c, weight: 100}, {name: d, weight: 1000}]\n",
        },
        MapCase {
            name: "rendezvous-weighted-crc16",
            yaml: "version: 1\nalgorithm: rendezvous\nhash: crc16\nshards: [{name: a, weight: 1}, {name: b, weight: 2}, {name: c, weight: 1}]\n",
        },
        MapCase {
            name: "rendezvous-16-fnv1a64",
            yaml: "version: 1\nalgorithm: rendezvous\nhash: fnv1a64\nshards: [{name: s-0}, {name: s-1}, {name: s-2}, {name: s-3}, {name: s-4}, {name: s-5}, {name: s-6}, {name: s-7}, {name: s-8}, {name: s-9}, {name: s-10}, {name: s-11}, {name: s-12}, {name: s-13}, {name: s-14}, {name: s-15}]\n",
        },
        MapCase {
            name: "jump-7-xxh64-draining",
            yaml: "version: 1\nalgorithm: jump\nhash: xxh64\nshards: [{name: j-0}, {name: j-1}, {name: j-2}, {name: j-3, state: draining}, {name: j-4}, {name: j-5}, {name: j-6}]\n",
        },
        MapCase {
            name: "jump-16-fnv1a64",
            yaml: "version: 1\nalgorithm: jump\nhash: fnv1a64\nshards: [{name: s-0}, {name: s-1}, {name: s-2}, {name: s-3}, {name: s-4}, {name: s-5}, {name: s-6}, {name: s-7}, {name: s-8}, {name: s-9}, {name: s-10}, {name: s-11}, {name: s-12}, {name: s-13}, {name: s-14}, {name: s-15}]\n",
        },
        MapCase {
            name: "jump-murmur3-one-active",
            yaml: "version: 1\nalgorithm: jump\nhash: murmur3\nshards: [{name: only}, {name: soon, state: warming}]\noverrides: { \"t-9\": soon }\n",
        },
        MapCase {
            name: "slots-3-blake2b64",
            yaml: "version: 1\nalgorithm: slots\nhash: blake2b64\nshards: [{name: node-a}, {name: node-b}, {name: node-c}]\n",
        },
        MapCase {
            // Explicit ranges win; the rest is dealt by weighted rendezvous
            // over every active shard; a warming shard's ranges are ignored.
            name: "slots-explicit-weighted-xxh3",
            yaml: "version: 5\nalgorithm: slots\nhash: xxh3\nshards:\n  - { name: node-a, slots: [\"0-5460\"] }\n  - { name: node-b, slots: [\"5461-10922\", 16383] }\n  - { name: node-c, weight: 2 }\n  - { name: node-d, state: warming, slots: [\"10923-12000\"] }\noverrides: { \"{user1000}.a\": node-d }\n",
        },
        MapCase {
            name: "slots-fnv1a64-explicit-single",
            yaml: "version: 1\nalgorithm: slots\nhash: fnv1a64\nshards:\n  - { name: node-a, slots: 3443 }\n  - { name: node-b }\n  - { name: node-c }\n",
        },
    ]
}

#[derive(Serialize)]
struct HashRow<'a> {
    key: &'a str,
    blake2b64: String,
    xxh64: String,
    xxh3: String,
    murmur3: String,
    fnv1a64: String,
    crc16: String,
}

#[derive(Serialize)]
struct SlotRow<'a> {
    key: &'a str,
    hashtag: &'a str,
    slot: u16,
}

#[derive(Serialize)]
struct JumpRow {
    key: String,
    buckets: u32,
    bucket: u32,
}

#[derive(Serialize)]
struct ScoreRow {
    weight: u32,
    x: String,
    /// The IEEE-754 bits of the score as 16 hex digits, so a reader can
    /// compare exactly without trusting any decimal float printer.
    score_bits: String,
}

fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("vector rows serialise")
}

fn array(out: &mut String, name: &str, rows: &[String], last: bool) {
    let _ = writeln!(out, "  {}: [", json(&name));
    for (i, row) in rows.iter().enumerate() {
        let comma = if i + 1 < rows.len() { "," } else { "" };
        let _ = writeln!(out, "    {row}{comma}");
    }
    let _ = writeln!(out, "  ]{}", if last { "" } else { "," });
}

/// The whole file, byte for byte.
pub fn generate() -> String {
    let hash_rows = hash_rows();
    let slot_rows = slot_rows();
    let jump_rows = jump_rows();
    let score_rows = score_rows();

    let mut out = String::new();
    out.push_str("{\n");
    let _ = writeln!(out, "  \"generated_by\": {},", json(&GENERATED_BY));
    let _ = writeln!(out, "  \"format_version\": {FORMAT_VERSION},");
    let _ = writeln!(
        out,
        "  \"about\": {},",
        json(&"Routing vectors every shardq client must reproduce. u64 values are decimal strings. \
               maps[].owners lists [key, shard] as routed (overrides first). \
               weighted_scores[].score_bits is the IEEE-754 double of weight / -ln(((x >> 12) + 0.5) / 2^52) in hex.")
    );
    array(&mut out, "hashes", &hash_rows, false);
    array(&mut out, "slots", &slot_rows, false);
    array(&mut out, "jump", &jump_rows, false);
    array(&mut out, "weighted_scores", &score_rows, false);
    write_maps(&mut out, &route_keys());
    out.push_str("}\n");
    out
}

/// The `hashes` rows: every hash function over [`hash_keys`].
fn hash_rows() -> Vec<String> {
    hash_keys()
        .iter()
        .map(|k| {
            let b = k.as_bytes();
            json(&HashRow {
                key: k,
                blake2b64: HashFn::Blake2b64.hash(b).to_string(),
                xxh64: HashFn::Xxh64.hash(b).to_string(),
                xxh3: HashFn::Xxh3.hash(b).to_string(),
                murmur3: HashFn::Murmur3.hash(b).to_string(),
                fnv1a64: HashFn::Fnv1a64.hash(b).to_string(),
                crc16: HashFn::Crc16.hash(b).to_string(),
            })
        })
        .collect()
}

/// The `slots` rows: each of [`route_keys`] with its hashtag and Redis Cluster slot.
fn slot_rows() -> Vec<String> {
    route_keys()
        .iter()
        .map(|k| {
            let tag = std::str::from_utf8(hashtag(k.as_bytes()))
                .expect("braces are ASCII, so a hashtag of UTF-8 is UTF-8");
            json(&SlotRow {
                key: k,
                hashtag: tag,
                slot: slot(k.as_bytes()),
            })
        })
        .collect()
}

/// The `jump` rows: Guava's golden values, then hashed keys over several bucket counts.
fn jump_rows() -> Vec<String> {
    let mut jump_cases: Vec<(u64, u32)> = vec![
        (0, 100),
        (1, 100),
        (2, 100),
        (3, 100),
        (4, 100),
        (10_863_919_174_838_991, 11),
        (2, 100_001),
        (u64::MAX, 1),
        (u64::MAX, 1000),
    ];
    for i in 0..20 {
        let x = HashFn::Xxh64.hash(format!("t-{i}").as_bytes());
        for buckets in [2, 5, 16, 256, 4096] {
            jump_cases.push((x, buckets));
        }
    }
    jump_cases
        .iter()
        .map(|&(key, buckets)| {
            json(&JumpRow {
                key: key.to_string(),
                buckets,
                bucket: jump(key, buckets),
            })
        })
        .collect()
}

/// The `weighted_scores` rows: edge and hashed values of x, each at several weights.
fn score_rows() -> Vec<String> {
    let mut xs: Vec<u64> = vec![
        0,
        1,
        2047,
        2048,
        1 << 63,
        u64::MAX >> 1,
        u64::MAX - 2047,
        u64::MAX,
    ];
    xs.extend((0..10).map(|i| HashFn::Blake2b64.hash(format!("w:{i}").as_bytes())));
    let mut score_rows = Vec::new();
    for &x in &xs {
        for weight in [1u32, 2, 7, 1000] {
            score_rows.push(json(&ScoreRow {
                weight,
                x: x.to_string(),
                score_bits: format!("{:016x}", weighted_score(f64::from(weight), x).to_bits()),
            }));
        }
    }
    score_rows
}

/// The `maps` array, the file's last member: each of [`map_cases`] with the owner of every key.
fn write_maps(out: &mut String, keys: &[String]) {
    let cases = map_cases();
    out.push_str("  \"maps\": [\n");
    for (ci, case) in cases.iter().enumerate() {
        let router = Router::from_yaml(case.yaml)
            .unwrap_or_else(|e| panic!("vector map {} is invalid: {e}", case.name));
        let map = router.map();
        out.push_str("    {\n");
        let _ = writeln!(out, "      \"name\": {},", json(&case.name));
        let _ = writeln!(out, "      \"algorithm\": {},", json(&map.algorithm.name()));
        let _ = writeln!(out, "      \"hash\": {},", json(&map.hash.name()));
        let _ = writeln!(out, "      \"yaml\": {},", json(&case.yaml));
        if map.algorithm == Algorithm::Ring {
            // Distinct points after ties collapse: a cheap first check of a ring build.
            let ring = Ring::build(
                map.hash,
                map.vnodes,
                map.shards
                    .iter()
                    .filter(|s| s.state == ShardState::Active)
                    .map(|s| (s.name.as_str(), s.weight)),
            );
            let _ = writeln!(out, "      \"ring_distinct_points\": {},", ring.len());
        }
        out.push_str("      \"owners\": [\n");
        for (i, key) in keys.iter().enumerate() {
            let comma = if i + 1 < keys.len() { "," } else { "" };
            let _ = writeln!(
                out,
                "        [{}, {}]{comma}",
                json(key),
                json(&router.route(key))
            );
        }
        out.push_str("      ]\n");
        let _ = writeln!(out, "    }}{}", if ci + 1 < cases.len() { "," } else { "" });
    }
    out.push_str("  ]\n");
}
