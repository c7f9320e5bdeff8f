//! One run per key on real processes and a real `redis-server`, through
//! stalls: the worker stopped (SIGSTOP) past its job lease, the Redis
//! server stopped past the shard lease, a worker SIGKILLed while another
//! waits to exit when idle, a rebalance while the worker holding the moving
//! keys' runs is stopped. Handlers are per-job Python processes that take
//! an exclusive `flock` on their key, so two runs of a key at once, in one
//! process or in two, are seen by the second one.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use shardq_testkit::redis::RedisServer;
use support::{
    enqueue_lines, init_shards_with, process_alive, run, signal, status_json, temp_dir, wait_exit,
    wait_until, BIN, WAIT_MAX,
};

/// A per-job handler: logs `start|overlap KEY ATTEMPT PID` (overlap when
/// its key's lock is held by another run), sleeps FIRST s on attempt 1 and
/// LATER s after, then logs `end KEY ATTEMPT PID`.
fn handler(dir: &Path) -> PathBuf {
    let script = dir.join("h.py");
    std::fs::write(
        &script,
        r#"import fcntl, os, sys, time
log, locks, first, later = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
key, attempt = os.environ["SHARDQ_KEY"], int(os.environ["SHARDQ_ATTEMPT"])
sys.stdin.read()
lock = open(os.path.join(locks, key + ".lock"), "w")
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    what = "start"
except OSError:
    what = "overlap"
def note(what):
    with open(log, "a") as f:
        f.write("%s %s %d %d\n" % (what, key, attempt, os.getpid()))
note(what)
time.sleep(first if attempt == 1 else later)
note("end")
"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("locks")).unwrap();
    script
}

/// (what, key, attempt, pid) per handler log line.
fn log_lines(dir: &Path) -> Vec<(String, String, u32, u32)> {
    std::fs::read_to_string(dir.join("runs.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (
                f[0].to_string(),
                f[1].to_string(),
                f[2].parse().unwrap(),
                f[3].parse().unwrap(),
            )
        })
        .collect()
}

/// A data dir of `shards` shards on `server` with `keys` keys of one job.
fn deployment(dir: &Path, server: &RedisServer, shards: usize, keys: usize) -> PathBuf {
    let data = dir.join("data");
    init_shards_with(&data, shards, &["--redis", &server.url()]);
    let lines: String = (0..keys).map(|k| format!("tenant-{k}\tx\n")).collect();
    enqueue_lines(&data, &lines, &[]);
    data
}

/// `shardq work` with the handler, its stderr in `DIR/NAME.log`.
fn worker(dir: &Path, data: &Path, name: &str, flags: &[&str], first_s: &str) -> Child {
    let script = handler(dir);
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(BIN)
        .args([
            "work",
            "--data",
            data.to_str().unwrap(),
            "--concurrency",
            "4",
        ])
        .args(flags)
        .args(["--", "python3", script.to_str().unwrap()])
        .arg(dir.join("runs.log"))
        .arg(dir.join("locks"))
        .args([first_s, "1"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn worker_log(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// Waits (bounded) for `child` to exit; returns whether it succeeded.
fn exits(child: &mut Child, what: &str) -> bool {
    wait_exit(child, what, WAIT_MAX).success()
}

/// No two runs of a key overlapped; every job was acked (nothing ready, in
/// flight or dead); every key ended a run.
fn assert_one_run_at_a_time_and_all_done(dir: &Path, data: &Path, keys: usize) {
    let lines = log_lines(dir);
    let overlaps: Vec<_> = lines.iter().filter(|l| l.0 == "overlap").collect();
    assert!(
        overlaps.is_empty(),
        "two runs of a key at once: {overlaps:?}"
    );
    let ended: BTreeSet<&str> = lines
        .iter()
        .filter(|l| l.0 == "end")
        .map(|l| l.1.as_str())
        .collect();
    assert_eq!(ended.len(), keys, "{lines:?}");
    let v = status_json(data);
    for field in ["ready", "in_flight", "dead"] {
        assert_eq!(v["totals"][field], 0, "{field}: {v}");
    }
}

/// Issue item 1: a worker stopped for longer than the job lease. The runs
/// it held lapsed; after SIGCONT each key runs once more (attempt 2), only
/// after the lapsed run's handler was killed, and is acked.
#[test]
fn a_worker_stalled_past_the_job_lease_runs_each_key_once_at_a_time() {
    let server = RedisServer::start();
    let dir = temp_dir("stall-worker");
    let data = deployment(&dir, &server, 1, 4);
    let flags = [
        "--lease-ms",
        "60000",
        "--job-lease-ms",
        "1500",
        "--exit-when-idle",
    ];
    let mut w = worker(&dir, &data, "w", &flags, "4");
    wait_until("4 handlers to start", WAIT_MAX, || {
        log_lines(&dir).len() >= 4
    });
    signal(w.id(), "-STOP");
    // Real time: the stall itself, two 1.5 s job leases, so the runs lapse in Redis.
    std::thread::sleep(Duration::from_millis(3_000));
    signal(w.id(), "-CONT");
    assert!(
        exits(&mut w, "the worker to finish"),
        "{}",
        worker_log(&dir, "w")
    );
    assert_one_run_at_a_time_and_all_done(&dir, &data, 4);
    let lines = log_lines(&dir);
    assert!(
        lines.iter().all(|l| l.2 <= 2),
        "a job ran again past the stall's one lapse: {lines:?}"
    );
    assert!(
        worker_log(&dir, "w").contains("4 acked"),
        "{}",
        worker_log(&dir, "w")
    );
}

/// Issue item 2: the Redis server stopped past the shard lease, with two
/// workers. The worker whose every renewal failed gives its shard up and,
/// with it, its handlers: they are killed while the server is still
/// stopped. Afterwards every job runs to its ack, never twice at once.
#[test]
fn a_worker_whose_every_renewal_fails_stops_its_handlers() {
    let server = RedisServer::start();
    let dir = temp_dir("stall-redis");
    let data = deployment(&dir, &server, 1, 4);
    // Redis bounds below the lease (real `shardq` flags, docs/redis.md):
    // a call to the stopped server gives up within a second, so A sees its
    // renewals fail and gives its shard up (killing its handlers) within
    // about its lease, not after each call in flight spent the default
    // 2 s reply timeouts and 5 s of retries (14 s in all here).
    let flags = [
        "--lease-ms",
        "3000",
        "--redis-reply-timeout-ms",
        "500",
        "--redis-retry-budget-ms",
        "500",
    ];
    let mut a = worker(&dir, &data, "a", &flags, "600");
    wait_until("A's 4 handlers to start", WAIT_MAX, || {
        log_lines(&dir).len() >= 4
    });
    let mut b = worker(&dir, &data, "b", &flags, "600");
    wait_until("B to stand by", WAIT_MAX, || {
        worker_log(&dir, "b").contains("standby")
    });
    let first: Vec<u32> = log_lines(&dir).iter().map(|l| l.3).collect();
    server.pause();
    wait_until(
        "A's handlers to be killed while Redis is stopped",
        Duration::from_secs(30),
        || first.iter().all(|p| !process_alive(*p)),
    );
    server.resume();
    wait_until("every job to be acked", WAIT_MAX, || {
        let v = status_json(&data);
        v["totals"]["ready"] == 0 && v["totals"]["in_flight"] == 0
    });
    for w in [&mut a, &mut b] {
        signal(w.id(), "-TERM");
        let logs = format!("{}\n{}", worker_log(&dir, "a"), worker_log(&dir, "b"));
        assert!(exits(w, "a worker to stop"), "{logs}");
    }
    assert_one_run_at_a_time_and_all_done(&dir, &data, 4);
}

/// Issue item 6: a worker SIGKILLed mid-run leaves its shard leased to a
/// dead process, its runs in flight. A second worker with --exit-when-idle
/// that owns the other shard must not exit when that one is done: the dead
/// worker's lease and runs lapse back into work, which it then runs.
#[test]
fn exit_when_idle_waits_for_work_held_by_a_dead_worker() {
    let server = RedisServer::start();
    let dir = temp_dir("idle-dead");
    let data = deployment(&dir, &server, 2, 24);
    let flags = ["--lease-ms", "6000", "--max-local-shards", "1"];
    let mut x = worker(&dir, &data, "x", &flags, "600");
    wait_until("X's handlers to start", WAIT_MAX, || {
        log_lines(&dir).len() >= 4
    });
    signal(x.id(), "-KILL");
    let _ = x.wait();
    let flags = [
        "--lease-ms",
        "6000",
        "--max-local-shards",
        "all",
        "--exit-when-idle",
    ];
    let mut y = worker(&dir, &data, "y", &flags, "0.05");
    assert!(exits(&mut y, "Y to finish"), "{}", worker_log(&dir, "y"));
    let v = status_json(&data);
    for field in ["ready", "in_flight", "dead"] {
        assert_eq!(
            v["totals"][field], 0,
            "Y exited with work left: {field}: {v}"
        );
    }
}

/// Issue 18, item 6: a rebalance while the worker running the moving keys
/// is stopped (SIGSTOP) with their runs in flight. The move waits for those
/// runs, which end when the stopped worker's job leases lapse and a second
/// worker takes its shard over; the keys then move with their backlogs.
/// After SIGCONT the stopped worker's late results are refused: every job
/// runs to its ack and no two runs of a key overlap.
#[test]
fn a_rebalance_past_a_stopped_worker_moves_its_keys_once_their_runs_lapse() {
    let server = RedisServer::start();
    let dir = temp_dir("stall-move");
    let data = dir.join("data");
    let keys = 8;
    init_shards_with(&data, 1, &["--redis", &server.url()]);
    let lines: String = (0..3)
        .flat_map(|_| (0..keys).map(|k| format!("tenant-{k}\tx\n")))
        .collect();
    enqueue_lines(&data, &lines, &[]);
    let flags = ["--lease-ms", "3000", "--job-lease-ms", "1500"];
    let mut w1 = worker(&dir, &data, "w1", &flags, "1");
    wait_until("4 handlers to start", WAIT_MAX, || {
        log_lines(&dir).len() >= 4
    });
    signal(w1.id(), "-STOP");
    let d = data.to_str().unwrap();
    let (ok, _, err) = run(&["add-shard", "--data", d, "shard-1", "--url", &server.url()]);
    assert!(ok, "{err}");
    let more = [
        "--lease-ms",
        "3000",
        "--job-lease-ms",
        "1500",
        "--max-local-shards",
        "all",
    ];
    let mut w2 = worker(&dir, &data, "w2", &more, "1");
    let (ok, out, err) = run(&[
        "rebalance",
        "--data",
        d,
        "--json",
        "--drain-timeout-ms",
        "60000",
    ]);
    assert!(ok, "rebalance: {err}");
    let report: serde_json::Value =
        serde_json::from_str(out.lines().last().unwrap_or("{}")).unwrap();
    let moved = report["keys_moved"].as_u64().unwrap_or(0);
    assert!(
        moved > 0 && report["jobs_moved"].as_u64() >= Some(moved),
        "the keys did not move with their backlogs: {out}"
    );
    signal(w1.id(), "-CONT");
    wait_until("every job to be acked", WAIT_MAX, || {
        let t = &status_json(&data)["totals"];
        t["ready"] == 0 && t["in_flight"] == 0 && t["delayed"] == 0
    });
    for (w, name) in [(&mut w1, "w1"), (&mut w2, "w2")] {
        signal(w.id(), "-TERM");
        assert!(
            exits(w, "a worker to drain and exit"),
            "{}",
            worker_log(&dir, name)
        );
    }
    assert_one_run_at_a_time_and_all_done(&dir, &data, keys);
    let lines = log_lines(&dir);
    let ends = lines.iter().filter(|l| l.0 == "end").count();
    assert!(
        ends >= 3 * keys,
        "{ends} runs ended for {} jobs: {lines:?}",
        3 * keys
    );
}
