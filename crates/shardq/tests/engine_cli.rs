//! Engine commands on the command line: bad input gets a clear error naming
//! the value and changes nothing; SIGTERM drains and releases the shard.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_shardq");
const WAIT_MAX: Duration = Duration::from_secs(30);

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(BIN).args(args).output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn status_json(data: &Path) -> serde_json::Value {
    let (ok, out, err) = run(&["status", "--data", data.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn bad_input_is_refused_clearly_and_loses_nothing() {
    let dir = temp_dir("bad");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    assert!(run(&["enqueue", "--data", d, "--key", "keep", "--payload", "x"]).0);
    let long_key = "k".repeat(1025);
    // One argv string is capped at 128 KiB, so the limit is lowered here.
    let big = "p".repeat(1001);
    let foreign = dir.to_str().unwrap();
    let missing = dir.join("nope");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["enqueue", "--data", d, "--key", ""],
            "must not be empty",
        ),
        (vec!["enqueue", "--data", d, "--key", &long_key], "1025"),
        (
            vec![
                "enqueue",
                "--data",
                d,
                "--key",
                "k",
                "--payload",
                &big,
                "--payload-bytes-max",
                "1000",
            ],
            "1001 bytes, over the limit of 1000",
        ),
        (
            vec!["enqueue", "--data", foreign, "--key", "k"],
            "not a shardq data dir",
        ),
        (
            vec!["enqueue", "--data", missing.to_str().unwrap(), "--key", "k"],
            "does not exist",
        ),
        (
            vec!["work", "--data", d, "--concurrency", "0", "--", "true"],
            "invalid --concurrency 0",
        ),
        (
            vec![
                "work",
                "--data",
                d,
                "--max-local-shards",
                "none",
                "--",
                "true",
            ],
            "\"none\"",
        ),
        (
            vec!["init", "--data", d, "--shards", "2"],
            "already a shardq data dir",
        ),
        (
            vec!["init", "--data", foreign, "--shards", "0"],
            "invalid --shards 0",
        ),
        (
            vec![
                "enqueue",
                "--data",
                d,
                "--key",
                "k",
                "--durability",
                "sometimes",
            ],
            "\"sometimes\"",
        ),
        (vec!["repair", "--data", d, "shard-9"], "shard-9"),
    ];
    for (args, needle) in cases {
        let (ok, _, err) = run(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    let v = status_json(&data);
    assert_eq!(
        v["totals"]["ready"], 1,
        "the good job is still there, and only it"
    );

    std::fs::write(data.join("membership.json"), "{oops").unwrap();
    let (ok, _, err) = run(&["status", "--data", d]);
    assert!(
        !ok && err.contains("membership.json") && err.contains("corrupt"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("membership.json")).unwrap(),
        "{oops"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_drains_running_jobs_and_releases_claims() {
    let dir = temp_dir("term");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let marker = dir.join("started");
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    assert!(run(&["enqueue", "--data", d, "--key", "k"]).0);
    let script = format!("touch {}; sleep 0.5", marker.display());
    let mut child = Command::new(BIN)
        .args([
            "work",
            "--data",
            d,
            "--lease-ms",
            "60000",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !marker.exists() {
        assert!(start.elapsed() < WAIT_MAX, "the job never started");
        thread::sleep(Duration::from_millis(10));
    }
    let v = status_json(&data);
    assert!(v["shards"][0]["owner"].is_string(), "{v}");
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < WAIT_MAX,
            "worker did not stop after SIGTERM"
        );
        thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    assert!(err.contains("draining") && err.contains("1 acked"), "{err}");
    let v = status_json(&data);
    assert!(v["shards"][0]["owner"].is_null(), "claim not released: {v}");
    assert_eq!(v["totals"]["ready"], 0);
    assert_eq!(v["totals"]["in_flight"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}
