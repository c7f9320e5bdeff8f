//! The commands README.md and docs/ show, walked. Every `shardq` line of
//! their code blocks names commands that exist and options they take
//! (checked against each command's own `--help`), so no document shows a
//! command that has drifted. The lines an operator runs against a
//! deployment on one machine (routing, the embedded engine, jobs, dead
//! letters, retries, resharding) are then run, in the order shown, against
//! a fresh deployment in a scratch directory, and must succeed; a line
//! naming a job that does not exist there (`shard-2:17`) must fail only as
//! "not found" (exit 1), never as a usage error.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use support::{temp_dir, BIN};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A documented command: the file, its line, and its words after `shardq`.
struct Shown {
    file: String,
    line: usize,
    words: Vec<String>,
}

/// Splits a shell line into words: single and double quotes group, and
/// are removed.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            (None, c) => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Every `shardq ...` line in the fenced code blocks of README.md and
/// docs/*.md: its comment (` # ...`) cut off, optional parts (`[...]`)
/// taken in.
fn documented() -> Vec<Shown> {
    let root = repo_root();
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut in_code = false;
        for (i, raw) in text.lines().enumerate() {
            if raw.trim_start().starts_with("```") {
                in_code = !in_code;
                continue;
            }
            if !in_code {
                continue;
            }
            // The command, also at the end of a pipe.
            let Some(at) = raw
                .trim_start()
                .strip_prefix("shardq ")
                .map(|_| raw.len() - raw.trim_start().len())
                .or_else(|| raw.find("| shardq ").map(|p| p + 2))
            else {
                continue;
            };
            let mut line = &raw[at..];
            if let Some(c) = line.find(" #") {
                line = &line[..c];
            }
            let line = line.replace(['[', ']'], "");
            // Past `--` is the handler's own command line.
            let w: Vec<String> = words(&line)
                .into_iter()
                .skip(1)
                .take_while(|w| w != "--")
                .collect();
            if w.is_empty() {
                continue;
            }
            out.push(Shown {
                file: name.clone(),
                line: i + 1,
                words: w,
            });
        }
    }
    out
}

/// `shardq PATH... --help`.
fn help(path: &[&str]) -> String {
    let mut args: Vec<&str> = path.to_vec();
    args.push("--help");
    let o = Command::new(BIN).args(&args).output().unwrap();
    assert!(
        o.status.success(),
        "shardq {} --help failed",
        path.join(" ")
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The subcommand names a help text lists under `Commands:`.
fn subcommands(help: &str) -> Vec<String> {
    help.split("Commands:")
        .nth(1)
        .map(|rest| {
            rest.lines()
                .skip(1)
                .take_while(|l| l.starts_with("  "))
                .filter_map(|l| l.split_whitespace().next().map(str::to_string))
                .filter(|c| c != "help")
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_documented_command_and_option_exists() {
    let shown = documented();
    assert!(
        shown.len() >= 30,
        "found only {} documented commands",
        shown.len()
    );
    let mut helps: BTreeMap<Vec<String>, String> = BTreeMap::new();
    let mut problems = Vec::new();
    for s in &shown {
        // The command path: each word the current command lists as one of
        // its subcommands (options of a parent may come before a child).
        let mut path: Vec<String> = Vec::new();
        let mut texts = vec![helps.entry(Vec::new()).or_insert_with(|| help(&[])).clone()];
        for w in &s.words {
            if w.starts_with('-') {
                continue;
            }
            let subs = subcommands(texts.last().unwrap());
            if subs.iter().any(|c| c == w) {
                path.push(w.clone());
                let p: Vec<&str> = path.iter().map(String::as_str).collect();
                let text = helps
                    .entry(path.clone())
                    .or_insert_with(|| help(&p))
                    .clone();
                texts.push(text);
            }
        }
        if path.is_empty() {
            problems.push(format!(
                "{}:{}: `shardq {}` names no command",
                s.file,
                s.line,
                s.words.join(" ")
            ));
            continue;
        }
        for w in s.words.iter().filter(|w| w.starts_with("--")) {
            let flag = w.split('=').next().unwrap();
            let known = texts[1..].iter().any(|t| {
                t.lines().any(|l| {
                    l.split([' ', ',', '='])
                        .any(|part| part == flag || part.starts_with(&format!("{flag}=")))
                })
            });
            if !known {
                problems.push(format!(
                    "{}:{}: `shardq {}` has {flag}, which `shardq {} --help` does not list",
                    s.file,
                    s.line,
                    s.words.join(" "),
                    path.join(" ")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What a documented line needs that a scratch directory on one machine
/// does not have (servers, files of the reader's own, long-running
/// processes): such lines are checked by the test above only.
fn runs_here(words: &[String]) -> bool {
    const RUN: [&str; 19] = [
        "route",
        "slot",
        "plan",
        "init",
        "enqueue",
        "status",
        "dead",
        "job",
        "jobs",
        "retry",
        "schedule",
        "add-shard",
        "rebalance",
        "remove-shard",
        "set-weight",
        "pin",
        "unpin",
        "hot",
        "repair",
    ];
    let outside = [
        "--redis",
        "--redis-cluster",
        "--url",
        "OLD.yaml",
        // A shell variable set by an earlier line (`$URL`, a job id).
        "$",
        "./rq",
        "DIR",
        "--stdin",
    ];
    RUN.contains(&words[0].as_str()) && !words.iter().any(|w| outside.iter().any(|o| w.contains(o)))
}

#[test]
fn the_documented_operator_commands_run_in_order() {
    let root = repo_root();
    let examples = root.join("examples").to_string_lossy().into_owned();
    let mut by_file: BTreeMap<String, Vec<Shown>> = BTreeMap::new();
    for s in documented() {
        if runs_here(&s.words) {
            by_file.entry(s.file.clone()).or_default().push(s);
        }
    }
    assert!(
        by_file.get("README.md").is_some_and(|v| v.len() >= 20),
        "README.md shows fewer operator commands than expected"
    );
    let mut ran = 0;
    for (file, lines) in by_file {
        let dir = temp_dir(&format!("docs-{}", file.replace('.', "-")));
        for s in lines {
            let args: Vec<String> = s
                .words
                .iter()
                .map(|w| w.replace("examples/", &format!("{examples}/")))
                .collect();
            let o = Command::new(BIN)
                .args(&args)
                .current_dir(&dir)
                .output()
                .unwrap();
            let code = o.status.code();
            let err = String::from_utf8_lossy(&o.stderr);
            let unknown_job = args.iter().any(|a| a == "shard-2:17");
            let ok = if unknown_job {
                code == Some(0) || (code == Some(1) && err.contains("shard-2:17"))
            } else {
                code == Some(0)
            };
            assert!(
                ok,
                "{file}:{}: `shardq {}` exited {code:?}: {err}",
                s.line,
                args.join(" ")
            );
            ran += 1;
        }
    }
    assert!(ran >= 20, "ran only {ran} documented commands");
}
