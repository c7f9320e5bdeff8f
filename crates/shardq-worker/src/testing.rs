//! Helpers of this crate's unit tests: claimed jobs made up on the spot,
//! and a look at whether a process still runs.

use std::path::Path;
use std::time::{Duration, Instant};

use shardq_core::{ClaimedJob, JobId};

/// A claimed job of `key` with `payload`, as a pool would hand it over.
pub fn job(id: u64, key: &str, payload: &[u8]) -> ClaimedJob {
    ClaimedJob {
        shard: "shard-0".to_string(),
        id: JobId(id),
        key: key.to_string(),
        payload: payload.to_vec(),
        attempt: 2,
        max_attempts: 5,
        created_ms: 1_000,
        not_before_ms: 1_000,
        fence: 7,
        lease_until_ms: 31_000,
        dedup_id: Some("schedule:nightly@1800000000000".to_string()),
    }
}

/// `sh -c SCRIPT sh ARGS...`.
pub fn sh(script: &str, args: &[&str]) -> Vec<String> {
    let mut cmd = vec!["sh".to_string(), "-c".to_string(), script.to_string()];
    cmd.push("sh".to_string());
    cmd.extend(args.iter().map(|a| a.to_string()));
    cmd
}

/// `python3 -c SCRIPT ARGS...`.
pub fn python(script: &str, args: &[&str]) -> Vec<String> {
    let mut cmd = vec!["python3".to_string(), "-c".to_string(), script.to_string()];
    cmd.extend(args.iter().map(|a| a.to_string()));
    cmd
}

/// Whether process `pid` runs: it exists and is neither a zombie nor
/// dead (a killed process nobody has reaped yet is dead).
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which is in parentheses.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("");
    !matches!(state, "Z" | "X" | "x")
}

/// Waits up to `limit` for `done()`; whether it came true.
pub fn wait_for(limit: Duration, done: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    done()
}

/// The pid a handler wrote to `path`, once it is there.
pub fn read_pid(path: &Path) -> u32 {
    assert!(
        wait_for(Duration::from_secs(10), || std::fs::read_to_string(path)
            .is_ok_and(|t| t.ends_with('\n'))),
        "no pid in {}",
        path.display()
    );
    let text = std::fs::read_to_string(path).expect("pid file");
    text.trim().parse().expect("a pid")
}
