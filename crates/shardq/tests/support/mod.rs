//! Helpers shared by the process-level tests that run the real `shardq`
//! binary: temp dirs, running a command, `status --json`, signals, free
//! ports, bounded waits (on a condition, on a child's exit) and "is this
//! process still alive".
//!
//! Each test file compiles this module on its own and uses part of it.
//! Nothing here may sleep for a fixed time to let something happen: waits
//! poll a condition up to a bound and fail the test naming what they waited
//! for.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

// Not every test file waits.
#[allow(unused_imports)]
pub use shardq_testkit::wait::{wait_until, WAIT_MAX};

pub const BIN: &str = env!("CARGO_BIN_EXE_shardq");

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

/// Runs `shardq ARGS`, asserting it succeeds (the failure names the
/// arguments and stderr); returns stdout.
pub fn ok(args: &[&str]) -> String {
    let out = output(args);
    assert!(
        out.status.success(),
        "shardq {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
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

/// Waits until `child` exits, up to `bound`; its status. Past the bound
/// the child is killed (not left behind holding the test's output open)
/// and the test fails naming `what`.
pub fn wait_exit(child: &mut Child, what: &str, bound: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() >= bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!("gave up after {bound:?} waiting for {what} to exit");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// `kill SIG PID` (say `-STOP`), asserting it is delivered.
pub fn signal(pid: u32, sig: &str) {
    let sent = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {sig} {pid}");
}

/// A loopback port free now (the OS's pick for port 0, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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

/// A 4-shard data dir with jobs on every shard, then one byte flipped in the
/// middle of the first record of shard-1 (records follow it, so it is not a
/// torn tail). Returns the data dir and the ready count per shard before.
pub fn data_dir_with_corrupt_shard_1(dir: &Path) -> (PathBuf, Vec<u64>) {
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "4"]).0);
    let lines: String = (0..40).map(|i| format!("seed-{i}\tp{i}\n")).collect();
    let out = run_stdin(&["enqueue", "--data", d, "--stdin"], lines.as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = status_json(&data);
    let before: Vec<u64> = (0..4)
        .map(|i| v["shards"][i]["ready"].as_u64().unwrap())
        .collect();
    assert!(before[1] >= 2, "shard-1 needs two records: {v}");
    let seg = std::fs::read_dir(data.join("shard-1"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "seg"))
        .expect("shard-1 has a segment");
    let mut bytes = std::fs::read(&seg).unwrap();
    // The first record follows the segment header.
    let at = shardq_fs::record::SEGMENT_HEADER_BYTES;
    let body_len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    assert!(
        at + 8 + body_len < bytes.len(),
        "the first record is not the last"
    );
    bytes[at + 8 + body_len / 2] ^= 0xff;
    std::fs::write(&seg, &bytes).unwrap();
    (data, before)
}

/// Runs `shardq ARGS` with `input` on stdin.
pub fn run_stdin(args: &[&str], input: &[u8]) -> std::process::Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out
}

/// `shardq init --data DATA --shards N`, asserting it succeeds.
pub fn init_shards(data: &Path, shards: usize) {
    init_shards_with(data, shards, &[]);
}

/// `shardq init --data DATA --shards N EXTRA` (say `--redis URL`),
/// asserting it succeeds.
pub fn init_shards_with(data: &Path, shards: usize, extra: &[&str]) {
    let shards = shards.to_string();
    let mut args = vec![
        "init",
        "--data",
        data.to_str().unwrap(),
        "--shards",
        &shards,
    ];
    args.extend_from_slice(extra);
    let (ok, _, err) = run(&args);
    assert!(ok, "{err}");
}

/// Failed attempts of `data`'s jobs come back after `RETRY_MS` rather than
/// the default backoff (10 s doubling): `shardq retry set --backoff fixed
/// --base-ms RETRY_MS`, for a test whose jobs fail and retry but which
/// does not measure the backoff. Workers started afterwards use it.
pub fn quick_retries(data: &Path) {
    let base = RETRY_MS.to_string();
    let (ok, _, err) = run(&[
        "retry",
        "set",
        "--data",
        data.to_str().unwrap(),
        "--backoff",
        "fixed",
        "--base-ms",
        &base,
    ]);
    assert!(ok, "{err}");
}

/// The backoff [`quick_retries`] sets, in ms.
pub const RETRY_MS: u64 = 20;

/// `shardq enqueue --data DATA --stdin EXTRA` with `lines`, asserting it
/// succeeds.
pub fn enqueue_lines(data: &Path, lines: &str, extra: &[&str]) {
    let mut args = vec!["enqueue", "--data", data.to_str().unwrap(), "--stdin"];
    args.extend_from_slice(extra);
    let out = run_stdin(&args, lines.as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A small deterministic generator for a trial's disturbances (their
/// timing), seeded by [`seed`].
pub struct Lcg(pub u64);

impl Lcg {
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// A seed from the clock, printed so a failing trial can be replayed.
pub fn seed() -> u64 {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {s}");
    s
}

/// Runs `run(i, item)` for each of `items` on a thread of its own, side
/// by side, and waits for them all; the first panic is raised again once
/// every one has ended. For trials that share nothing (a data dir and logs
/// each) and spend their time waiting on leases and handlers rather than
/// on the CPU.
pub fn side_by_side<T: Send>(items: Vec<T>, run: impl Fn(usize, T) + Sync) {
    let run = &run;
    thread::scope(|scope| {
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| scope.spawn(move || run(i, item)))
            .collect();
        let mut first = None;
        for h in handles {
            if let Err(panic) = h.join() {
                first.get_or_insert(panic);
            }
        }
        if let Some(panic) = first {
            std::panic::resume_unwind(panic);
        }
    });
}

/// Says which trial failed when dropped while its thread panics (a trial
/// run by [`side_by_side`] holds one).
pub struct Named(pub String);

impl Drop for Named {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("{} failed", self.0);
        }
    }
}

/// How keys move during a trial.
#[derive(Clone, Debug)]
pub enum Disturb {
    /// `add-shard NEW` (on the Redis server named, for a Redis
    /// deployment) then `rebalance`.
    Grow(Option<String>),
    /// `pin` each of these keys to the other of `shard-0` and `shard-1`.
    Pin(&'static [&'static str]),
}

/// Moves keys of the deployment at `d` as `how` says (`name` names the
/// new shard of a `Grow`).
pub fn disturb(d: &str, name: &str, how: &Disturb) {
    match how {
        Disturb::Grow(url) => {
            let new = format!("grown-{name}");
            let mut args = vec!["add-shard", "--data", d, &new];
            if let Some(u) = url {
                args.extend(["--url", u]);
            }
            ok(&args);
            ok(&["rebalance", "--data", d]);
        }
        Disturb::Pin(keys) => {
            for key in keys.iter() {
                let v: serde_json::Value = serde_json::from_str(&ok(&[
                    "jobs",
                    "--data",
                    d,
                    "--key",
                    key,
                    "--json",
                    "--finished",
                    "0",
                ]))
                .unwrap();
                let to = if v["shard"] == "shard-0" {
                    "shard-1"
                } else {
                    "shard-0"
                };
                ok(&["pin", "--data", d, key, to]);
            }
        }
    }
}

/// Shard and job leases of a trial's workers (3 s): the second worker
/// takes the SIGKILLed one's shards and runs over once these lapse (about
/// 4 s with the clock-skew margin), not after the default 30 s. Renewed
/// every second, they outlast a loaded machine's stalls by far.
pub const TRIAL_LEASE_MS: &str = "3000";

/// A trial's worker: `work --max-local-shards all --concurrency 4` with
/// [`TRIAL_LEASE_MS`] leases, running `sh -c HANDLER` with `LOG` (the
/// handlers' log), `DATA` and `SHARDQ_BIN` set; its stderr appended to
/// LOG.err.
pub fn trial_worker(d: &str, log: &Path, idle_exit: bool, handler: &str) -> Child {
    let mut options = vec![
        "--concurrency",
        "4",
        "--lease-ms",
        TRIAL_LEASE_MS,
        "--job-lease-ms",
        TRIAL_LEASE_MS,
    ];
    if idle_exit {
        options.push("--exit-when-idle");
    }
    worker_with(d, log, &options, handler)
}

/// A worker: `work --data D --max-local-shards all OPTIONS -- sh -c
/// HANDLER` with `LOG`, `DATA` and `SHARDQ_BIN` set; its stderr appended
/// to LOG.err.
pub fn worker_with(d: &str, log: &Path, options: &[&str], handler: &str) -> Child {
    let mut args = vec!["work", "--data", d, "--max-local-shards", "all"];
    args.extend(options);
    args.extend(["--", "sh", "-c", handler]);
    Command::new(BIN)
        .args(&args)
        .env("LOG", log)
        .env("DATA", d)
        .env("SHARDQ_BIN", BIN)
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log.with_extension("err"))
                .expect("opens the worker's log"),
        )
        .spawn()
        .expect("starts a worker")
}
