//! Process-level attacks on the one promise (a key's jobs run one at a
//! time, in order, and nothing acknowledged is lost), against the real
//! binary: a handler far longer than its job lease, a worker stopped with
//! SIGSTOP past its shard lease while another waits to take over, and one
//! corrupt shard among healthy ones.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{
    data_dir_with_corrupt_shard_1, enqueue_lines, init_shards, signal, status_json, temp_dir,
    wait_until, BIN, WAIT_MAX,
};

/// A handler logging `start KEY SEQ` and `end KEY SEQ` around `sleep`.
fn logging_handler(log: &Path, sleep: &str) -> String {
    format!(
        "seq=$(cat); echo \"start $SHARDQ_KEY $seq\" >> {log}; sleep {sleep}; echo \"end $SHARDQ_KEY $seq\" >> {log}",
        log = log.display()
    )
}

fn worker(data: &Path, extra: &[&str], script: &str, stderr: &Path) -> Child {
    let mut args = vec!["work", "--data", data.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    Command::new(BIN)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap()
}

/// Checks the log: per key, runs never overlap (start/end alternate) and
/// the sequence numbers start in order; returns the starts per key.
fn check_log(log: &Path) -> BTreeMap<String, Vec<u64>> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut open: BTreeMap<String, u64> = BTreeMap::new();
    let mut starts: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for line in text.lines() {
        let mut it = line.split(' ');
        let (what, key, seq) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let seq: u64 = seq.parse().unwrap();
        match what {
            "start" => {
                if let Some(other) = open.insert(key.to_string(), seq) {
                    panic!("key {key}: job {seq} started while job {other} still ran");
                }
                starts.entry(key.to_string()).or_default().push(seq);
            }
            _ => {
                assert_eq!(
                    open.remove(key),
                    Some(seq),
                    "key {key}: end of {seq} without its start"
                );
            }
        }
    }
    starts
}

/// Regression (Redis item 5, on the embedded engine too): a handler longer
/// than its job lease used to be claimed again while it ran. Heartbeats
/// keep its run; each job runs once, in order.
#[test]
fn a_handler_far_longer_than_its_job_lease_runs_once() {
    let dir = temp_dir("chaos-lease");
    let data = dir.join("data");
    init_shards(&data, 1);
    enqueue_lines(&data, "k\t0\nk\t1\nk\t2\nother\t0\n", &[]);
    let log = dir.join("runs.log");
    let mut w = worker(
        &data,
        &[
            "--concurrency",
            "4",
            "--job-lease-ms",
            "200",
            "--exit-when-idle",
        ],
        &logging_handler(&log, "0.7"),
        &dir.join("stderr"),
    );
    assert!(w.wait().unwrap().success());
    let starts = check_log(&log);
    assert_eq!(starts["k"], [0, 1, 2], "each job once, in order");
    assert_eq!(starts["other"], [0]);
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert!(err.contains("4 acked") && err.contains("0 stale"), "{err}");
}

/// A worker stopped (SIGSTOP) past its shard lease keeps its shards' locks:
/// a second worker waits instead of running the key's jobs beside the
/// stopped one's handler, and after SIGCONT everything runs once, in order.
#[test]
fn a_worker_stopped_past_its_lease_is_not_run_over() {
    let dir = temp_dir("chaos-stop");
    let data = dir.join("data");
    init_shards(&data, 2);
    let lines: String = (0..20)
        .map(|i| format!("t-{}\t{}\n", i % 4, i / 4))
        .collect();
    enqueue_lines(&data, &lines, &[]);
    let log = dir.join("runs.log");
    let script = logging_handler(&log, "0.2");
    let common = [
        "--concurrency",
        "2",
        "--lease-ms",
        "400",
        "--max-local-shards",
        "all",
    ];
    let mut a = worker(&data, &common, &script, &dir.join("a.err"));
    wait_until("worker A to start a job", WAIT_MAX, || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("start"))
    });
    signal(a.id(), "-STOP");
    let mut b_args = common.to_vec();
    b_args.push("--exit-when-idle");
    let mut b = worker(&data, &b_args, &script, &dir.join("b.err"));
    // Real time: several of A's 400 ms shard leases must lapse while A is stopped.
    std::thread::sleep(Duration::from_millis(1500));
    signal(a.id(), "-CONT");
    wait_until("every job to run", WAIT_MAX, || {
        status_json(&data)["totals"]["ready"] == 0 && status_json(&data)["totals"]["in_flight"] == 0
    });
    signal(a.id(), "-TERM");
    assert!(a.wait().unwrap().success());
    signal(b.id(), "-TERM");
    let _ = b.wait();
    let starts = check_log(&log);
    for k in 0..4 {
        let seqs = &starts[&format!("t-{k}")];
        let mut dedup = seqs.clone();
        dedup.dedup();
        assert_eq!(dedup, (0..5).collect::<Vec<u64>>(), "key t-{k}: {seqs:?}");
    }
}

/// Regression (item 13): one corrupt shard stopped the whole worker. Now
/// the worker runs every healthy shard's jobs, names the corrupt one, and
/// leaves its jobs untouched.
#[test]
fn one_corrupt_shard_among_healthy_ones_stops_only_itself_in_a_worker() {
    let dir = temp_dir("chaos-corrupt");
    let (data, before) = data_dir_with_corrupt_shard_1(&dir);
    let out = Command::new(BIN)
        .args([
            "work",
            "--data",
            data.to_str().unwrap(),
            "--max-local-shards",
            "all",
            "--exit-when-idle",
            "--handler-builtin",
            &format!("append:{}", dir.join("runs.txt").display()),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a failed shard must fail a batch run: {err}"
    );
    assert!(err.contains("shard-1") && err.contains("corrupt"), "{err}");
    let ran = std::fs::read_to_string(dir.join("runs.txt")).unwrap_or_default();
    let healthy: u64 = [0, 2, 3].iter().map(|&i| before[i]).sum();
    assert_eq!(
        ran.lines().count() as u64,
        healthy,
        "every healthy shard's jobs ran"
    );
    assert!(!ran.contains("shard-1"), "nothing of the corrupt shard ran");
}
