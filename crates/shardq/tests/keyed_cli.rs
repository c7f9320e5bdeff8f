//! Unique and debounced jobs through the real binary, on the embedded
//! engine and on Redis: bursts of debounced enqueues from producers racing
//! each other (and one SIGKILLed mid-burst) leave at most one waiting job
//! per key and id, which runs once with the burst's last payload, read from
//! the handler's own log; a unique id answers its waiting job to every
//! racing producer.

mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use shardq_testkit::redis::RedisServer;
use support::{ok, run, temp_dir, BIN};

/// Keys of a burst.
const KEYS: usize = 8;
/// Lines per producer.
const LINES: usize = 400;

/// A producer of `LINES` debounced lines over `KEYS` keys, payload
/// `TAG-N` (N grows per key), through `enqueue --stdin`; SIGKILLed after
/// half its lines when `kill`. Its stdout (one id per stored line).
fn producer(d: &str, tag: &str, kill: bool) -> String {
    let mut p = Command::new(BIN)
        .args(["enqueue", "--data", d, "--stdin", "--debounce-id", "sync"])
        .args(["--debounce", "3s", "--debounce-max", "20s"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts a producer");
    let mut stdin = p.stdin.take().unwrap();
    for n in 0..LINES {
        let line = format!("burst-{}\t{tag}-{n:04}\n", n % KEYS);
        if stdin.write_all(line.as_bytes()).is_err() {
            break;
        }
        if kill && n == LINES / 2 {
            let _ = stdin.flush();
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(p.id() as i32, libc::SIGKILL) };
            break;
        }
    }
    drop(stdin);
    let out = p.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The live jobs of `key` (`jobs --json`).
fn live(d: &str, key: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["jobs", "--data", d, "--key", key, "--json"])).unwrap();
    v["jobs"].as_array().cloned().unwrap_or_default()
}

fn bursts_run_once_with_their_last_payload(data: &Path, dir: &Path) {
    let d = data.to_str().unwrap();
    // Three producers race on the same keys and id; one is SIGKILLed.
    let racers: Vec<_> = [("a", false), ("b", false), ("c", true)]
        .into_iter()
        .map(|(tag, kill)| {
            let d = d.to_string();
            std::thread::spawn(move || producer(&d, tag, kill))
        })
        .collect();
    let outs: Vec<String> = racers.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(outs[0].lines().count() == LINES && outs[1].lines().count() == LINES);
    // Every line of a key was answered with the key's one job.
    let mut answered: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for line in outs.iter().flat_map(|o| o.lines()) {
        let (key, id) = line.split_once('\t').expect("KEY<TAB>ID");
        answered.entry(key).or_default().push(id);
    }
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    for k in 0..KEYS {
        let key = format!("burst-{k}");
        let jobs = live(d, &key);
        assert_eq!(jobs.len(), 1, "one waiting job for {key}: {jobs:?}");
        let id = jobs[0]["id"].as_str().unwrap();
        assert!(
            answered[key.as_str()].iter().all(|a| *a == id),
            "{key}: every enqueue answered {id}"
        );
        last.insert(key, jobs[0]["payload"].as_str().unwrap().to_string());
    }
    // The job runs once, with what the store holds as the last payload.
    let log = dir.join("ran.log");
    let line = format!(
        "read p; echo \"$SHARDQ_KEY $SHARDQ_DEDUP_ID $p\" >> {}",
        log.display()
    );
    let (good, _, err) = run(&[
        "work",
        "--data",
        d,
        "--max-local-shards",
        "all",
        "--exit-when-idle",
        "--",
        "sh",
        "-c",
        &line,
    ]);
    assert!(good, "{err}");
    let text = std::fs::read_to_string(&log).unwrap();
    let mut runs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in text.lines() {
        let mut f = l.splitn(3, ' ');
        let (key, id, payload) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
        assert_eq!(id, "debounce:sync", "{l}");
        runs.entry(key.to_string())
            .or_default()
            .push(payload.to_string());
    }
    for (key, payload) in &last {
        assert_eq!(
            runs.get(key),
            Some(&vec![payload.clone()]),
            "{key} ran once"
        );
    }
    // Unique: racing enqueues all get the one waiting job.
    let ids: Vec<String> = (0..4)
        .map(|i| {
            let d = d.to_string();
            std::thread::spawn(move || {
                let p = format!("u{i}");
                let out = ok(&[
                    "enqueue",
                    "--data",
                    &d,
                    "--key",
                    "uk",
                    "--payload",
                    &p,
                    "--unique-id",
                    "nightly-import",
                ]);
                out.trim().to_string()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    assert_eq!(live(d, "uk").len(), 1);
}

#[test]
fn debounced_bursts_and_unique_ids_hold_on_the_embedded_engine() {
    let dir = temp_dir("keyed-fs");
    let data = dir.join("data");
    ok(&["init", "--data", data.to_str().unwrap(), "--shards", "3"]);
    bursts_run_once_with_their_last_payload(&data, &dir);
}

#[test]
fn debounced_bursts_and_unique_ids_hold_on_redis() {
    let server = RedisServer::start();
    let dir = temp_dir("keyed-redis");
    let data = dir.join("data");
    ok(&[
        "init",
        "--data",
        data.to_str().unwrap(),
        "--shards",
        "3",
        "--redis",
        &server.url(),
    ]);
    bursts_run_once_with_their_last_payload(&data, &dir);
}

#[test]
fn keyed_options_are_refused_by_name() {
    let dir = temp_dir("keyed-bad");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    ok(&["init", "--data", d, "--shards", "1"]);
    for (args, words) in [
        (
            vec!["--unique-id", "a", "--unique-while", "soon"],
            "invalid unique while \"soon\"",
        ),
        (
            vec!["--debounce-id", "a", "--debounce", "2 fortnights"],
            "invalid debounce",
        ),
        (
            vec!["--debounce-id", "a", "--debounce", "2d"],
            "invalid debounce",
        ),
        (vec!["--unique-id", ""], "invalid unique id"),
    ] {
        let mut all = vec!["enqueue", "--data", d, "--key", "k", "--payload", "x"];
        all.extend(args.iter());
        let (good, _, err) = run(&all);
        assert!(!good && err.contains(words), "{args:?}: {err}");
    }
    let (good, _, err) = run(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "k",
        "--unique-id",
        "a",
        "--debounce-id",
        "b",
        "--debounce",
        "1s",
    ]);
    assert!(!good && err.contains("cannot be used with"), "{err}");
    assert_eq!(live(d, "k").len(), 0, "nothing stored");
}
