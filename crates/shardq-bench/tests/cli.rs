//! The `shardq-bench` binary: `route` and `chx` run end to end at small
//! sizes, errors exit 2 naming the binary, and every `shardq-bench` command
//! line the documents show names a subcommand and options it has.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_shardq-bench");

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run shardq-bench")
}

/// A scratch directory of this test process, emptied first.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-bench-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn route_measures_every_cell_it_is_asked_for() {
    let o = run(&[
        "route",
        "--json",
        "--shards",
        "4,16",
        "--algorithms",
        "ring,jump",
        "--hashes",
        "xxh3",
        "--ms-per-cell",
        "1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let rows: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    // One bare-hash baseline, then 2 algorithms x 2 shard counts.
    assert_eq!(rows.len(), 5, "{rows:?}");
    assert_eq!(rows[0]["algorithm"], "bare-hash");
    assert_eq!(rows[0]["shards"], Value::Null);
    for r in &rows[1..] {
        assert_eq!(r["hash"], "xxh3");
        assert!(r["ns_per_lookup"].as_f64().unwrap() > 0.0, "{r}");
    }

    let o = run(&[
        "route",
        "--shards",
        "4",
        "--algorithms",
        "modulo",
        "--hashes",
        "fnv1a64",
        "--ms-per-cell",
        "1",
    ]);
    assert!(o.status.success());
    let table = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(lines[0].starts_with("algorithm"), "{table}");
    assert!(lines[1].starts_with("bare-hash"), "{table}");
    assert!(lines[2].starts_with("modulo"), "{table}");
    assert!(lines[3].starts_with("# 4096 keys"), "{table}");
}

#[test]
fn route_refuses_bad_flags_with_exit_2() {
    let o = run(&["route", "--ms-per-cell", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("shardq-bench: error: --ms-per-cell is 0"),
        "{err}"
    );
    let o = run(&["route", "--shards", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn chx_without_a_broker_runs_the_others_and_writes_its_files() {
    let out = temp_dir("chx");
    let out_arg = out.to_string_lossy().into_owned();
    let o = run(&[
        "chx",
        "--out",
        &out_arg,
        "--queues",
        "4",
        "--messages",
        "2000",
        "--keys",
        "1000",
        "--rebalance-keys",
        "500",
        "--affinity-keys",
        "100",
        "--copies",
        "2",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let headline: Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut systems: Vec<&str> = headline["systems"]
        .as_object()
        .unwrap_or_else(|| panic!("no systems in {headline}"))
        .keys()
        .map(String::as_str)
        .collect();
    systems.sort_unstable();
    assert_eq!(
        systems,
        [
            "jump",
            "modulo",
            "rabbitmq",
            "rendezvous",
            "ring",
            "shardq-embedded",
            "slots"
        ]
    );
    // RabbitMQ was not asked for: a note, not a failure.
    assert!(
        err.contains("shardq-bench: note: rabbitmq: skipped: no --rabbitmq URL given"),
        "{err}"
    );
    assert!(out.join("summary.txt").is_file());
    let svgs = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "svg"))
        .count();
    assert!(svgs > 0, "no SVG chart in {}", out.display());
    let _ = std::fs::remove_dir_all(&out);

    let o = run(&["chx", "--queues", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("shardq-bench: error: parameter `queues`"),
        "{err}"
    );
}

/// A documented command line: where it is, and its words after the binary.
struct Shown {
    at: String,
    words: Vec<String>,
}

/// Every command line in the fenced code blocks of the documents that runs
/// this binary: `cargo run ... -p shardq-bench -- SUB ...`,
/// `shardq-bench SUB ...` or `.../shardq-bench SUB ...`; comments cut off.
fn documented() -> Vec<Shown> {
    let root = repo_root();
    let mut files = vec![
        root.join("README.md"),
        root.join("BENCHMARKS.md"),
        root.join("scripts/README.md"),
        root.join("benchmarks/README.md"),
    ];
    for dir in ["docs", "benchmarks/log"] {
        let mut more: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        more.sort();
        files.extend(more);
    }
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.strip_prefix(&root).unwrap().display().to_string();
        let mut in_code = false;
        for (i, raw) in text.lines().enumerate() {
            if raw.trim_start().starts_with("```") {
                in_code = !in_code;
                continue;
            }
            if !in_code {
                continue;
            }
            let line = raw.split(" #").next().unwrap().replace(['[', ']'], "");
            let words: Vec<String> = line
                .split_whitespace()
                .map(|w| w.trim_matches('"').to_string())
                .collect();
            let after = if let Some(p) = words
                .windows(3)
                .position(|w| w[0] == "-p" && w[1] == "shardq-bench" && w[2] == "--")
            {
                p + 3
            } else if let Some(p) = words
                .iter()
                .position(|w| w == "shardq-bench" || w.ends_with("/shardq-bench"))
            {
                p + 1
            } else {
                continue;
            };
            // `cargo build` or `cargo test` of the crate runs no command.
            if let Some(c) = words.iter().position(|w| w == "cargo") {
                if words.get(c + 1).map(String::as_str) != Some("run") {
                    continue;
                }
            }
            out.push(Shown {
                at: format!("{name}:{}", i + 1),
                words: words[after..].to_vec(),
            });
        }
    }
    out
}

#[test]
fn every_documented_command_and_option_exists() {
    let shown = documented();
    assert!(
        shown.len() >= 3,
        "found only {} documented shardq-bench commands",
        shown.len()
    );
    let mut helps: BTreeMap<String, String> = BTreeMap::new();
    let mut problems = Vec::new();
    for s in &shown {
        let Some(sub) = s.words.first() else {
            problems.push(format!("{}: no subcommand", s.at));
            continue;
        };
        if sub != "route" && sub != "chx" {
            problems.push(format!("{}: `{sub}` is not a shardq-bench command", s.at));
            continue;
        }
        let help = helps.entry(sub.clone()).or_insert_with(|| {
            let o = run(&[sub, "--help"]);
            assert!(o.status.success(), "shardq-bench {sub} --help failed");
            String::from_utf8_lossy(&o.stdout).into_owned()
        });
        for w in s.words.iter().filter(|w| w.starts_with("--")) {
            let flag = w.split('=').next().unwrap();
            if !help
                .lines()
                .any(|l| l.split([' ', ',', '=']).any(|part| part == flag))
            {
                problems.push(format!(
                    "{}: `shardq-bench {sub}` has no option {flag}",
                    s.at
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
