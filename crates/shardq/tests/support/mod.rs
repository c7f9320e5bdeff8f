//! Helpers shared by the process-level tests that run the real `shardq`
//! binary: temp dirs, running a command, `status --json`, bounded waits and
//! "is this process still alive".
//!
//! Each test file compiles this module on its own and uses part of it.
//! Nothing here may sleep for a fixed time to let something happen: waits
//! poll a condition up to a bound and fail the test naming what they waited
//! for.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_shardq");
/// Bound on every wait in these tests.
pub const WAIT_MAX: Duration = Duration::from_secs(30);

/// A fresh empty directory for test `name`, unique to this process.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `shardq ARGS`: (success, stdout, stderr).
pub fn run(args: &[&str]) -> (bool, String, String) {
    let o = output(args);
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Runs `shardq ARGS` and returns its whole output.
pub fn output(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("runs shardq")
}

/// `shardq status --json` of `data`, asserting it succeeds.
pub fn status_json(data: &Path) -> serde_json::Value {
    let (ok, out, err) = run(&["status", "--data", data.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

/// Polls `cond` every 10 ms until it holds; panics naming `what` after `bound`.
pub fn wait_until(what: &str, bound: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < bound,
            "gave up after {bound:?} waiting for {what}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` exists and is not a zombie (a killed orphan may
/// linger as a zombie where nobody reaps it; it runs nothing).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => match stat.rfind(')') {
            Some(i) => !matches!(stat[i + 1..].trim_start().chars().next(), Some('Z' | 'X')),
            None => true,
        },
        Err(_) => false,
    }
}

/// The pids written one per line to `file` (missing file: none).
pub fn read_pids(file: &Path) -> Vec<u32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The write end of a pipe whose read end is already closed: a write to it
/// fails with EPIPE (or raises SIGPIPE), as when `| head` has exited.
pub fn pipe_without_reader() -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe() writes two fds into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe()");
    // SAFETY: both fds were just created and are owned by nobody else.
    unsafe {
        drop(std::os::fd::OwnedFd::from_raw_fd(fds[0]));
        std::os::fd::OwnedFd::from_raw_fd(fds[1])
    }
}
