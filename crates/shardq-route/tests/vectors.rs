//! Checks every value in the checked-in `testdata/routing-vectors.json`
//! against this crate, and that the generator still writes that file byte
//! for byte.
//!
//! Other languages' clients pass the same file, so any change to a hash, an
//! algorithm, a tie rule or the map parser that moves a key fails here first.
//! A deliberate change means regenerating the file (see its `generated_by`)
//! and shipping the new vectors to every client in the same release.

use std::fmt::Debug;
use std::path::PathBuf;

use serde_json::Value;
use shardq_route::hash::HashFn;
use shardq_route::jump::jump;
use shardq_route::rendezvous::weighted_score;
use shardq_route::ring::Ring;
use shardq_route::{hashtag, slot, Router, ShardState};

#[allow(dead_code)]
#[path = "../examples/gen_vectors.rs"]
mod gen_vectors;

fn vectors_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/routing-vectors.json")
}

fn load_text() -> String {
    let path = vectors_path();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn load() -> Value {
    serde_json::from_str(&load_text()).expect("routing-vectors.json is valid JSON")
}

/// Collects mismatches so one run reports all of them, not just the first.
#[derive(Default)]
struct Checker {
    checked: usize,
    failures: Vec<String>,
}

impl Checker {
    fn check<T: PartialEq + Debug>(&mut self, what: impl FnOnce() -> String, got: T, want: T) {
        self.checked += 1;
        if got != want {
            self.failures
                .push(format!("{}: got {got:?}, want {want:?}", what()));
        }
    }

    fn finish(self, min_checked: usize) {
        assert!(
            self.failures.is_empty(),
            "{} of {} vector checks failed; first ones:\n{}",
            self.failures.len(),
            self.checked,
            self.failures
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        // Guards against a vectors file that silently lost its rows.
        assert!(
            self.checked >= min_checked,
            "only {} checks ran",
            self.checked
        );
    }
}

fn rows<'a>(doc: &'a Value, field: &str) -> &'a Vec<Value> {
    doc[field]
        .as_array()
        .unwrap_or_else(|| panic!("`{field}` is an array"))
}

fn text<'a>(row: &'a Value, field: &str) -> &'a str {
    row[field]
        .as_str()
        .unwrap_or_else(|| panic!("`{field}` is a string in {row}"))
}

fn u64_text(row: &Value, field: &str) -> u64 {
    text(row, field)
        .parse()
        .unwrap_or_else(|e| panic!("`{field}` in {row}: {e}"))
}

#[test]
fn hashes_match() {
    let doc = load();
    let mut c = Checker::default();
    for row in rows(&doc, "hashes") {
        let key = text(row, "key");
        for h in HashFn::ALL {
            c.check(
                || format!("{h}({key:?})"),
                h.hash(key.as_bytes()),
                u64_text(row, h.name()),
            );
        }
    }
    c.finish(40 * HashFn::ALL.len());
}

#[test]
fn slots_and_hashtags_match() {
    let doc = load();
    let mut c = Checker::default();
    for row in rows(&doc, "slots") {
        let key = text(row, "key");
        c.check(
            || format!("hashtag({key:?})"),
            hashtag(key.as_bytes()),
            text(row, "hashtag").as_bytes(),
        );
        c.check(
            || format!("slot({key:?})"),
            u64::from(slot(key.as_bytes())),
            row["slot"].as_u64().unwrap(),
        );
    }
    c.finish(200);
}

#[test]
fn jump_matches() {
    let doc = load();
    let mut c = Checker::default();
    for row in rows(&doc, "jump") {
        let key = u64_text(row, "key");
        let buckets = row["buckets"].as_u64().unwrap() as u32;
        c.check(
            || format!("jump({key}, {buckets})"),
            u64::from(jump(key, buckets)),
            row["bucket"].as_u64().unwrap(),
        );
    }
    c.finish(100);
}

#[test]
fn weighted_scores_match() {
    let doc = load();
    let mut c = Checker::default();
    for row in rows(&doc, "weighted_scores") {
        let x = u64_text(row, "x");
        let weight = row["weight"].as_u64().unwrap() as u32;
        let bits = format!("{:016x}", weighted_score(f64::from(weight), x).to_bits());
        c.check(
            || format!("weighted_score({weight}, {x})"),
            bits.as_str(),
            text(row, "score_bits"),
        );
    }
    c.finish(60);
}

#[test]
fn maps_route_every_key_to_its_owner() {
    let doc = load();
    let mut c = Checker::default();
    for case in rows(&doc, "maps") {
        let name = text(case, "name");
        let router =
            Router::from_yaml(text(case, "yaml")).unwrap_or_else(|e| panic!("map {name}: {e}"));
        let map = router.map();
        c.check(
            || format!("{name}: algorithm"),
            map.algorithm.name(),
            text(case, "algorithm"),
        );
        c.check(
            || format!("{name}: hash"),
            map.hash.name(),
            text(case, "hash"),
        );
        if let Some(want) = case.get("ring_distinct_points") {
            let active = map.shards.iter().filter(|s| s.state == ShardState::Active);
            let ring = Ring::build(
                map.hash,
                map.vnodes,
                active.map(|s| (s.name.as_str(), s.weight)),
            );
            c.check(
                || format!("{name}: ring points"),
                ring.len() as u64,
                want.as_u64().unwrap(),
            );
        }
        for pair in case["owners"].as_array().expect("owners is an array") {
            let key = pair[0].as_str().unwrap();
            let want = pair[1].as_str().unwrap();
            c.check(
                || format!("{name}: route({key:?})"),
                router.route(key),
                want,
            );
        }
    }
    c.finish(20 * 200);
}

#[test]
fn regenerating_gives_the_checked_in_file() {
    let fresh = gen_vectors::generate();
    let checked_in = load_text();
    if fresh != checked_in {
        let line = fresh
            .lines()
            .zip(checked_in.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || "(length differs)".to_string(),
                |i| format!("line {}", i + 1),
            );
        panic!(
            "testdata/routing-vectors.json is stale or routing changed (first difference at {line}); \
             if the change is deliberate, regenerate with: {}",
            gen_vectors::GENERATED_BY
        );
    }
    assert!(checked_in.contains(gen_vectors::GENERATED_BY));
}
