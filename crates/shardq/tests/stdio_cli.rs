//! `shardq work --stdio`: one long-lived handler per slot, one JSON line per
//! job. Every job runs once and in per-key order, handlers are not started
//! per job, and a handler that dies or breaks the protocol fails only its
//! job and is replaced.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use support::{enqueue_lines, init_shards, quick_retries, run, status_json, temp_dir, BIN};

/// `work --stdio --exit-when-idle --concurrency C EXTRA -- python3 SCRIPT`.
fn stdio_command(data: &Path, script: &Path, concurrency: usize, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "work",
        "--data",
        data.to_str().unwrap(),
        "--concurrency",
        &concurrency.to_string(),
        "--max-local-shards",
        "all",
        "--exit-when-idle",
        "--stdio",
    ])
    .args(extra)
    .args(["--", "python3", script.to_str().unwrap()]);
    cmd
}

/// Runs `work --stdio --exit-when-idle` with a Python handler script.
fn work_stdio(data: &Path, script: &Path, concurrency: usize) -> (bool, String) {
    let out = stdio_command(data, script, concurrency, &[])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A handler that logs `KEY PAYLOAD PID` per job to `log`; `extra` is
/// Python run per job with `job` bound, before the answer.
fn handler(dir: &Path, log: &Path, extra: &str) -> std::path::PathBuf {
    let script = dir.join("h.py");
    let text = format!(
        r#"import json, os, sys
log = open({log:?}, "a")
for line in sys.stdin:
    job = json.loads(line)
{extra}
    log.write("%s %s %d\n" % (job["key"], job["payload"], os.getpid()))
    log.flush()
    sys.stdout.write(json.dumps({{"receipt": job["receipt"], "ok": True}}) + "\n")
    sys.stdout.flush()
"#,
        log = log.to_str().unwrap()
    );
    std::fs::write(&script, text).unwrap();
    script
}

fn runs(log: &Path) -> Vec<(String, u64, u32)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut it = l.split(' ');
            (
                it.next().unwrap().to_string(),
                it.next().unwrap().parse().unwrap(),
                it.next().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn stdio_handlers_run_every_job_once_in_key_order_without_a_process_per_job() {
    let dir = temp_dir("stdio-order");
    let data = dir.join("data");
    init_shards(&data, 4);
    let lines: String = (0..600)
        .map(|i| format!("t-{}\t{}\n", i % 20, i / 20))
        .collect();
    enqueue_lines(&data, &lines, &[]);
    let log = dir.join("runs.log");
    let script = handler(&dir, &log, "");
    let (ok, err) = work_stdio(&data, &script, 4);
    assert!(ok, "{err}");
    let runs = runs(&log);
    assert_eq!(runs.len(), 600, "every job once");
    let mut per_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (k, seq, _) in &runs {
        per_key.entry(k.clone()).or_default().push(*seq);
    }
    for (k, seqs) in &per_key {
        assert_eq!(seqs, &(0..30).collect::<Vec<u64>>(), "key {k} out of order");
    }
    let pids: BTreeSet<u32> = runs.iter().map(|r| r.2).collect();
    assert!(
        pids.len() <= 4,
        "{} handler processes for 4 slots: one per job?",
        pids.len()
    );
    assert_eq!(status_json(&data)["totals"]["ready"], 0);
}

#[test]
fn a_stdio_handler_that_dies_fails_its_job_and_is_replaced() {
    let dir = temp_dir("stdio-crash");
    let data = dir.join("data");
    init_shards(&data, 1);
    // Job 3 runs again at once, not after the default 10 s backoff.
    quick_retries(&data);
    let lines: String = (0..10).map(|i| format!("k\t{i}\n")).collect();
    enqueue_lines(&data, &lines, &[]);
    let log = dir.join("runs.log");
    let marker = dir.join("crashed");
    // Dies (no answer) the first time it sees job 3.
    let extra = format!(
        "    if job[\"payload\"] == \"3\" and not os.path.exists({m:?}):\n        open({m:?}, \"w\").close()\n        os._exit(7)",
        m = marker.to_str().unwrap()
    );
    let script = handler(&dir, &log, &extra);
    let (ok, err) = work_stdio(&data, &script, 1);
    assert!(ok, "{err}");
    assert!(err.contains("1 retried"), "{err}");
    let runs = runs(&log);
    let seqs: Vec<u64> = runs.iter().map(|r| r.1).collect();
    assert_eq!(
        seqs,
        (0..10).collect::<Vec<u64>>(),
        "order kept across the restart"
    );
    let pids: BTreeSet<u32> = runs.iter().map(|r| r.2).collect();
    assert_eq!(pids.len(), 2, "the dead handler was replaced once");
}

#[test]
fn a_stdio_answer_for_another_receipt_fails_the_job() {
    let dir = temp_dir("stdio-receipt");
    let data = dir.join("data");
    init_shards(&data, 1);
    enqueue_lines(&data, "k\tx\n", &["--max-attempts", "1"]);
    let script = dir.join("bad.py");
    std::fs::write(
        &script,
        "import json, sys\nfor line in sys.stdin:\n    sys.stdout.write(json.dumps({\"receipt\": \"shard-0:999.1\", \"ok\": True}) + \"\\n\")\n    sys.stdout.flush()\n",
    )
    .unwrap();
    let (ok, err) = work_stdio(&data, &script, 1);
    assert!(ok, "{err}");
    let (ok, dead, err) = run(&["dead", "--data", data.to_str().unwrap(), "list"]);
    assert!(ok, "{err}");
    assert!(
        dead.contains("answered for receipt \"shard-0:999.1\""),
        "{dead}"
    );
}

/// Runs `work --stdio --exit-when-idle --concurrency C --stdio-pipeline P`
/// with the Python handler `script`, and fails the test if it has not
/// exited within `bound` (a wedged worker is killed first).
fn work_stdio_within(
    data: &Path,
    script: &Path,
    concurrency: usize,
    pipeline: usize,
    bound: std::time::Duration,
) -> (bool, String) {
    let mut child = stdio_command(
        data,
        script,
        concurrency,
        &["--stdio-pipeline", &pipeline.to_string()],
    )
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > bound {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    if status.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        status.is_some(),
        "the worker was still running after {bound:?} with {} ready: {err}",
        status_json(data)["totals"]["ready"]
    );
    (out.status.success(), err)
}

/// A handler that reads its jobs with `os.read` (no read-ahead buffer of its
/// own) and logs `KEY PAYLOAD PID ATTEMPT` per job it starts; `on_job` is
/// Python run per job with `job`, `n` (jobs this process started) and
/// `answer()` bound, and must answer.
fn raw_handler(dir: &Path, log: &Path, on_job: &str) -> std::path::PathBuf {
    let script = dir.join("raw.py");
    let text = format!(
        r#"import json, os, sys
log = open({log:?}, "a")
buf = b""
def next_line(more=True):
    global buf
    while b"\n" not in buf:
        chunk = os.read(0, 65536)
        if not chunk:
            sys.exit(0)
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    return line
def lines_ahead():
    return buf.count(b"\n")
def answer(job):
    sys.stdout.write(json.dumps({{"receipt": job["receipt"], "ok": True}}) + "\n")
    sys.stdout.flush()
n = 0
while True:
    job = json.loads(next_line())
    n += 1
    log.write("%s %s %d %d\n" % (job["key"], job["payload"], os.getpid(), job["attempt"]))
    log.flush()
{on_job}
"#,
        log = log.to_str().unwrap()
    );
    std::fs::write(&script, text).unwrap();
    script
}

/// (key, payload, pid, attempt) per started job.
fn raw_runs(log: &Path) -> Vec<(String, u64, u32, u32)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (
                f[0].to_string(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
                f[3].parse().unwrap(),
            )
        })
        .collect()
}

/// Every job of `per_key` x `keys` ran and was acked, per key in order
/// (a job may run again after a failed attempt, never out of order), and
/// nothing is left ready, in flight or dead.
fn assert_all_done_in_order(
    data: &Path,
    runs: &[(String, u64, u32, u32)],
    keys: usize,
    per_key: u64,
) {
    let mut per: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (k, seq, _, _) in runs {
        per.entry(k.clone()).or_default().push(*seq);
    }
    assert_eq!(per.len(), keys, "every key ran");
    for (k, seqs) in &per {
        let mut firsts = seqs.clone();
        firsts.dedup();
        assert_eq!(
            firsts,
            (0..per_key).collect::<Vec<u64>>(),
            "key {k}: {seqs:?}"
        );
    }
    let v = status_json(data);
    for field in ["ready", "in_flight", "dead"] {
        assert_eq!(v["totals"][field], 0, "{field}: {v}");
    }
}

#[test]
fn a_stdio_handler_that_breaks_the_protocol_after_an_answer_is_replaced_not_wedged() {
    // Every third job of a process gets one more line after its answer,
    // when the handler may hold no other job: an extra answer, a line that
    // is not a result, an answer for a receipt it was never given.
    let extras = [
        (
            "twice",
            r#"sys.stdout.write(json.dumps({"receipt": job["receipt"], "ok": True}) + "\n")"#,
        ),
        ("garbage", r#"sys.stdout.write("not json\n")"#),
        (
            "foreign",
            r#"sys.stdout.write(json.dumps({"receipt": "shard-0:999999.1", "ok": True}) + "\n")"#,
        ),
    ];
    for (name, extra) in extras {
        let dir = temp_dir(&format!("stdio-extra-{name}"));
        let data = dir.join("data");
        init_shards(&data, 2);
        // The failed attempts run again at once, not after the default
        // 10 s doubling backoff.
        quick_retries(&data);
        let lines: String = (0..120)
            .map(|i| format!("t-{}\t{}\n", i % 12, i / 12))
            .collect();
        enqueue_lines(&data, &lines, &["--max-attempts", "100"]);
        let log = dir.join("runs.log");
        let on_job = format!(
            "    answer(job)\n    if n % 3 == 0:\n        {extra}\n        sys.stdout.flush()\n"
        );
        let script = raw_handler(&dir, &log, &on_job);
        let (ok, err) = work_stdio_within(&data, &script, 2, 4, std::time::Duration::from_secs(60));
        assert!(ok, "{name}: {err}");
        let runs = raw_runs(&log);
        assert_all_done_in_order(&data, &runs, 12, 10);
        let pids: BTreeSet<u32> = runs.iter().map(|r| r.2).collect();
        assert!(
            pids.len() > 2,
            "{name}: the broken handlers were replaced: {pids:?}"
        );
        for pid in pids {
            assert!(
                !support::process_alive(pid),
                "{name}: handler {pid} left running"
            );
        }
    }
}

#[test]
fn jobs_written_ahead_to_a_handler_that_dies_run_again_without_losing_an_attempt() {
    let dir = temp_dir("stdio-ahead");
    let data = dir.join("data");
    init_shards(&data, 1);
    // The job the dead handler ran is retried at once, not after the
    // default 10 s backoff.
    quick_retries(&data);
    let lines: String = (0..16).map(|i| format!("k-{i}\t0\n")).collect();
    // One attempt each: an attempt charged to a job that never started
    // would dead-letter it.
    enqueue_lines(&data, &lines, &["--max-attempts", "2"]);
    let log = dir.join("runs.log");
    let marker = dir.join("died");
    // The first process takes its first job, waits until two more are
    // written ahead to it, and dies without starting them.
    let on_job = format!(
        "    if n == 1 and not os.path.exists({m:?}):\n        open({m:?}, \"w\").close()\n        while lines_ahead() < 2:\n            chunk = os.read(0, 65536)\n            if not chunk:\n                break\n            buf += chunk\n        os._exit(7)\n    answer(job)\n",
        m = marker.to_str().unwrap()
    );
    let script = raw_handler(&dir, &log, &on_job);
    let (ok, err) = work_stdio_within(&data, &script, 1, 4, std::time::Duration::from_secs(60));
    assert!(ok, "{err}");
    assert!(marker.exists(), "the first handler died");
    assert!(err.contains("16 acked, 1 retried, 0 dead"), "{err}");
    let runs = raw_runs(&log);
    assert_all_done_in_order(&data, &runs, 16, 1);
    let again: Vec<_> = runs.iter().filter(|r| r.3 > 1).collect();
    assert_eq!(
        again.len(),
        1,
        "only the job the handler ran used an attempt: {runs:?}"
    );
}

/// A stdio handler backs off with `backoff_ms`: no attempt is used (a job
/// of one attempt is not dead), and the key waits the time asked.
#[test]
fn a_stdio_handler_backs_off_without_using_an_attempt() {
    let dir = temp_dir("stdio-backoff");
    let data = dir.join("data");
    init_shards(&data, 1);
    let d = data.to_str().unwrap();
    for p in ["first", "second"] {
        let (ok, _, err) = run(&[
            "enqueue",
            "--data",
            d,
            "--key",
            "bo",
            "--payload",
            p,
            "--max-attempts",
            "1",
        ]);
        assert!(ok, "{err}");
    }
    let log = dir.join("log");
    let script = dir.join("h.py");
    std::fs::write(
        &script,
        format!(
            r#"import json, sys, time
log = open({log:?}, "a")
backed = False
for line in sys.stdin:
    job = json.loads(line)
    now = int(time.time() * 1000)
    if job["payload"] == "first" and not backed:
        backed = True
        log.write("%s %d %d backoff\n" % (job["payload"], job["attempt"], now)); log.flush()
        sys.stdout.write(json.dumps({{"receipt": job["receipt"], "ok": False, "backoff_ms": 700}}) + "\n")
    else:
        log.write("%s %d %d\n" % (job["payload"], job["attempt"], now)); log.flush()
        sys.stdout.write(json.dumps({{"receipt": job["receipt"], "ok": True}}) + "\n")
    sys.stdout.flush()
"#,
            log = log.to_str().unwrap()
        ),
    )
    .unwrap();
    let (ok, err) = work_stdio(&data, &script, 1);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(
        (lines[1][0], lines[1][1]),
        ("first", "1"),
        "same attempt: {text}"
    );
    let t = |i: usize| lines[i][2].parse::<u64>().unwrap();
    assert!(t(1) >= t(0) + 700, "{text}");
    assert_eq!(lines[2][0], "second", "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
