//! Handler commands of `shardq work` as real processes: no handler process
//! outlives its attempt (drain timeout after SIGTERM, SIGKILL of the worker,
//! job timeout), and a handler can tell a whole payload from a cut one.
//!
//! Handlers write their pids to files; "gone" means no such process exists
//! (or only a zombie, which runs nothing).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

mod support;
use support::{
    ok, process_alive, quick_retries, read_pids, run, signal, status_json, temp_dir, wait_until,
    BIN, WAIT_MAX,
};

/// Starts `shardq work --data DATA EXTRA -- sh -c SCRIPT`. Its stderr goes
/// to a file next to DATA, not a pipe: a handler inherits it, and reading a
/// pipe to its end would wait for the handler too.
fn start_worker(data: &Path, extra: &[&str], script: &str) -> Worker {
    let err_path = data.with_extension("worker-stderr");
    let err = std::fs::File::create(&err_path).unwrap();
    let child = Command::new(BIN)
        .args(["work", "--data", data.to_str().unwrap()])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stderr(err)
        .spawn()
        .unwrap();
    Worker { child, err_path }
}

struct Worker {
    child: Child,
    err_path: PathBuf,
}

impl Worker {
    fn id(&self) -> u32 {
        self.child.id()
    }
}

/// A one-shard deployment in a scratch dir named by `tag` whose keys
/// starting `GROUP:` are in group GROUP of `concurrency` runs at once: the
/// dir and the data dir.
fn grouped_deployment(tag: &str, group: &str, concurrency: &str) -> (PathBuf, PathBuf) {
    let dir = temp_dir(tag);
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    ok(&["init", "--data", d, "--shards", "1"]);
    ok(&[
        "group",
        "set",
        "--data",
        d,
        group,
        "--concurrency",
        concurrency,
    ]);
    let prefix = format!("{group}:");
    ok(&[
        "policy", "set", "--data", d, "--prefix", &prefix, "--group", group,
    ]);
    (dir, data)
}

/// A worker a failed test leaves is not left running.
impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (bounded) for the worker to exit; returns its status and stderr.
fn wait_exit(worker: &mut Worker, bound: Duration) -> (ExitStatus, String) {
    let status = support::wait_exit(&mut worker.child, "the worker", bound);
    let err = std::fs::read_to_string(&worker.err_path).unwrap();
    (status, err)
}

fn init_with_job(data: &Path, extra: &[&str]) {
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    let mut args = vec!["enqueue", "--data", d, "--key", "k", "--payload", "job"];
    args.extend_from_slice(extra);
    let (ok, _, err) = run(&args);
    assert!(ok, "{err}");
}

#[test]
fn handler_outliving_its_worker_after_the_drain_timeout_is_killed() {
    let dir = temp_dir("h-drain");
    let data = dir.join("data");
    let pids = dir.join("pids");
    init_with_job(&data, &[]);
    // The handler and a child of it (same process group) both sleep 30 s.
    let script = format!(
        "echo $$ >> {p}; sleep 30 & echo $! >> {p}; wait",
        p = pids.display()
    );
    let mut worker = start_worker(
        &data,
        &["--lease-ms", "60000", "--drain-timeout-ms", "200"],
        &script,
    );
    wait_until("the handler and its child", WAIT_MAX, || {
        read_pids(&pids).len() == 2
    });
    let handler_pids = read_pids(&pids);
    assert!(handler_pids.iter().all(|&p| process_alive(p)));
    let sent = Instant::now();
    signal(worker.id(), "-TERM");
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "the worker waited for the 30 s handler: {:?}",
        sent.elapsed()
    );
    for p in &handler_pids {
        assert!(
            !process_alive(*p),
            "handler process {p} outlived the worker"
        );
    }
    // The killed attempt was recorded as failed, not left in flight.
    assert!(
        err.contains("1 retried") && err.contains("stopping 1 running handlers"),
        "{err}"
    );
    let v = status_json(&data);
    assert_eq!(v["totals"]["in_flight"], 0, "{v}");
    assert_eq!(
        v["totals"]["ready"].as_u64().unwrap() + v["totals"]["delayed"].as_u64().unwrap(),
        1,
        "the job is still queued: {v}"
    );
    assert!(v["shards"][0]["owner"].is_null(), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn handler_of_a_sigkilled_worker_dies_too() {
    let dir = temp_dir("h-kill");
    let data = dir.join("data");
    let pids = dir.join("pids");
    init_with_job(&data, &[]);
    let script = format!("echo $$ >> {}; exec sleep 30", pids.display());
    let mut worker = start_worker(&data, &["--lease-ms", "60000"], &script);
    wait_until("the handler", WAIT_MAX, || read_pids(&pids).len() == 1);
    let handler = read_pids(&pids)[0];
    assert!(process_alive(handler));
    signal(worker.id(), "-KILL");
    let (status, _) = wait_exit(&mut worker, WAIT_MAX);
    assert!(!status.success());
    // The parent-death signal is immediate; 5 s is a generous bound.
    wait_until(
        "the handler to die with its worker",
        Duration::from_secs(5),
        || !process_alive(handler),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn job_timeout_kills_a_hung_handler_and_fails_the_attempt() {
    let dir = temp_dir("h-timeout");
    let data = dir.join("data");
    let pids = dir.join("pids");
    init_with_job(&data, &["--max-attempts", "2"]);
    // The second attempt starts at once, not after the default 10 s
    // backoff.
    quick_retries(&data);
    let script = format!(
        "echo $$ >> {p}; sleep 30 & echo $! >> {p}; wait",
        p = pids.display()
    );
    let started = Instant::now();
    let mut worker = start_worker(
        &data,
        &["--job-timeout-ms", "300", "--exit-when-idle"],
        &script,
    );
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "attempts were not cut at 300 ms: {:?}",
        started.elapsed()
    );
    assert!(err.contains("1 retried") && err.contains("1 dead"), "{err}");
    let all = read_pids(&pids);
    assert_eq!(all.len(), 4, "two attempts, two processes each: {all:?}");
    for p in &all {
        assert!(
            !process_alive(*p),
            "handler process {p} survived its timeout"
        );
    }
    let (ok, out, err) = run(&["dead", "--data", data.to_str().unwrap(), "list"]);
    assert!(ok, "{err}");
    let fields: Vec<&str> = out.trim_end().split('\t').collect();
    assert_eq!(fields.len(), 4, "one dead job: {out:?}");
    assert!(
        fields[0].starts_with("shard-0:"),
        "the id as SHARD:ID: {out:?}"
    );
    assert_eq!(fields[1], "k");
    assert_eq!(fields[2], "2", "both attempts used: {out:?}");
    assert!(fields[3].contains("killed: job timeout 300 ms"), "{out:?}");
    // Refused with a handler that cannot be killed per job.
    let (ok, _, err) = run(&[
        "work",
        "--data",
        data.to_str().unwrap(),
        "--job-timeout-ms",
        "0",
        "--",
        "true",
    ]);
    assert!(!ok && err.contains("invalid --job-timeout-ms 0"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn handler_sees_the_payload_length_and_a_slow_reader_gets_it_whole() {
    let dir = temp_dir("h-payload");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let seen = dir.join("seen");
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    // Ten times a pipe buffer: the writer blocks until the handler reads.
    let big = "x".repeat(640 * 1024);
    let input = format!("slow\t{big}\nskip\t{big}\nsmall\tabc\n");
    let mut producer = Command::new(BIN)
        .args(["enqueue", "--data", d, "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut producer.stdin.take().unwrap(), input.as_bytes()).unwrap();
    assert!(producer.wait().unwrap().success());
    // `slow` reads only after a pause; `skip` never reads its stdin.
    let script = format!(
        "case $SHARDQ_KEY in skip) exit 0;; slow) sleep 0.5;; esac; \
         n=$(wc -c | tr -d ' '); echo \"$SHARDQ_KEY $SHARDQ_PAYLOAD_BYTES $n\" >> {}",
        seen.display()
    );
    let mut worker = start_worker(&data, &["--exit-when-idle"], &script);
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    assert!(
        err.contains("3 acked") && err.contains("0 retried"),
        "{err}"
    );
    let text = std::fs::read_to_string(&seen).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let len = big.len();
    assert_eq!(lines, vec![format!("slow {len} {len}"), "small 3 3".into()]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A handler that cannot start is the worker's error: it stops at once
/// naming the command, claims nothing and uses no attempt (it used to
/// dead-letter every job and exit 0).
#[test]
fn a_handler_that_cannot_start_stops_the_worker_and_uses_no_attempt() {
    let dir = temp_dir("no-handler");
    let data = dir.join("data");
    init_with_job(&data, &[]);
    let d = data.to_str().unwrap();
    let script = dir.join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    for cmd in [
        "./does-not-exist.sh",
        script.to_str().unwrap(),
        "no-such-handler-on-path-4821",
    ] {
        let (ok, _, err) = run(&["work", "--data", d, "--exit-when-idle", "--", cmd]);
        assert!(!ok, "{cmd}: the worker ran");
        assert!(
            err.contains(cmd)
                && err.contains("cannot be run")
                && err.contains("no job was claimed"),
            "{cmd}: {err}"
        );
    }
    let st = status_json(&data);
    assert_eq!(st["totals"]["ready"], 1, "{st}");
    assert_eq!(st["totals"]["dead"], 0, "{st}");
    // Its attempt count is untouched: the first real run is attempt 1.
    let out = dir.join("seen");
    let (ok, _, err) = run(&[
        "work",
        "--data",
        d,
        "--exit-when-idle",
        "--",
        "sh",
        "-c",
        &format!("echo $SHARDQ_ATTEMPT > {}", out.display()),
    ]);
    assert!(ok, "{err}");
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), "1");
}

/// A failing handler's last words reach its dead letter: the reason ends
/// with the end of its stderr (escaped onto one line, its start cut), the
/// worker's own stderr still carries every byte, and `job show` gives the
/// dead job's payload with that reason.
#[test]
fn a_dead_letter_keeps_the_end_of_its_handlers_stderr() {
    let dir = temp_dir("h-stderr");
    let data = dir.join("data");
    init_with_job(&data, &["--max-attempts", "1"]);
    let script = "cat > /dev/null; i=0; while [ $i -lt 100 ]; do echo \"noise line $i\" >&2; i=$((i+1)); done; \
                  printf 'fatal: upstream said 503\\n\\033[2Jbye\\n' >&2; exit 3";
    let mut worker = start_worker(&data, &["--exit-when-idle"], script);
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    assert!(
        err.contains("noise line 0\n") && err.contains("fatal: upstream said 503"),
        "the handler's stderr passes through the worker's: {err}"
    );
    let d = data.to_str().unwrap();
    let (ok, out, err) = run(&["dead", "--data", d, "list", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let dead = &v["dead"][0];
    let reason = dead["reason"].as_str().unwrap();
    assert!(reason.contains("exited with status 3"), "{reason}");
    assert!(
        reason.contains("fatal: upstream said 503\\n\\u{1b}[2Jbye"),
        "the end of stderr, escaped onto one line: {reason}"
    );
    assert!(
        !reason.contains("noise line 0\\n"),
        "the start is cut: {reason}"
    );
    assert!(
        reason.len() <= shardq_core::job::FAIL_REASON_BYTES_MAX,
        "{}",
        reason.len()
    );
    let id = dead["id"].as_str().unwrap();
    let (ok, out, err) = run(&["job", "show", "--data", d, id, "--json"]);
    assert!(ok, "{err}");
    let job: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&job["state"], &job["payload"]),
        (&"dead".into(), &"job".into())
    );
    assert_eq!(job["reason"].as_str(), Some(reason));
    // Every attempt's start time is kept, in order, and shown.
    let starts: Vec<u64> = job["attempt_starts_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(
        starts.len() as u64,
        job["attempts"].as_u64().unwrap(),
        "{job}"
    );
    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
    assert!(starts[0] >= job["created_ms"].as_u64().unwrap(), "{job}");
    assert_eq!(dead["attempt_starts_ms"], job["attempt_starts_ms"]);
    let (ok, out, err) = run(&["job", "show", "--data", d, id]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("attempt 1\tstarted {} (", starts[0])),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The deployment's retry policies reach its workers and its producers:
/// the default (here a fast 50 ms) for keys without a rule, a prefix's rule
/// for its keys (a fixed 1.5 s wait and 2 attempts, stamped on jobs enqueued
/// without `--max-attempts`), and a key's own rule over its prefix's.
#[test]
fn a_worker_waits_each_keys_retry_policy() {
    let dir = temp_dir("h-retry");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    let set = |extra: &[&str]| {
        let mut args = vec!["retry", "set", "--data", d];
        args.extend_from_slice(extra);
        let (ok, out, err) = run(&args);
        assert!(ok, "{args:?}: {err}");
        out
    };
    set(&["--base-ms", "50", "--max-ms", "50", "--jitter-pct", "0"]);
    let out = set(&[
        "--prefix",
        "slow:",
        "--backoff",
        "fixed",
        "--base-ms",
        "1500",
        "--max-attempts",
        "2",
    ]);
    assert!(
        out.contains("prefix \"slow:\"") && out.contains("2 attempts"),
        "{out}"
    );
    set(&[
        "--key",
        "slow:own",
        "--max-attempts",
        "4",
        "--base-ms",
        "300",
    ]);
    // A bad value is refused, naming the field and the value.
    let (ok, _, err) = run(&[
        "retry",
        "set",
        "--data",
        d,
        "--key",
        "k",
        "--max-attempts",
        "0",
    ]);
    assert!(
        !ok && err.contains("max attempts") && err.contains('0'),
        "{err}"
    );
    let (ok, out, err) = run(&["retry", "show", "--data", d, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["prefixes"]["slow:"]["backoff"], "fixed", "{v}");
    assert_eq!(v["prefixes"]["slow:"]["base_ms"], 1500, "{v}");
    assert_eq!(v["default"]["base_ms"], 50, "{v}");
    let (ok, out, err) = run(&["retry", "show", "--data", d, "--key", "slow:own", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // The key's rule started from its prefix's (fixed) and changed two fields.
    assert_eq!(
        (&v["max_attempts"], &v["base_ms"], &v["backoff"]),
        (&4.into(), &300.into(), &"fixed".into()),
        "{v}"
    );
    assert_eq!(v["from"], "key \"slow:own\"", "{v}");
    for key in ["slow:a", "fast", "slow:own"] {
        let (ok, _, err) = run(&["enqueue", "--data", d, "--key", key, "--payload", key]);
        assert!(ok, "{err}");
    }
    let (ok, out, err) = run(&["jobs", "--data", d, "--key", "slow:a", "--json"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("\"max_attempts\":2"),
        "the prefix's attempts: {out}"
    );
    let (ok, out, err) = run(&["jobs", "--data", d, "--key", "slow:own", "--json"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("\"max_attempts\":4"),
        "the key rule's attempts: {out}"
    );
    let stamps = dir.join("stamps");
    // Every job's attempt 1 fails, attempt 2 succeeds; each writes its key
    // and its start in ms.
    let script = format!(
        "read p; echo \"$p $(date +%s%3N)\" >> {s}; [ \"$SHARDQ_ATTEMPT\" = 2 ]",
        s = stamps.display()
    );
    let mut worker = start_worker(&data, &["--exit-when-idle"], &script);
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    let text = std::fs::read_to_string(&stamps).unwrap();
    let gap = |key: &str| -> u64 {
        let t: Vec<u64> = (text.lines())
            .filter_map(|l| l.strip_prefix(&format!("{key} ")))
            .map(|t| t.trim().parse().unwrap())
            .collect();
        assert_eq!(t.len(), 2, "{key}: two attempts: {text}");
        t[1] - t[0]
    };
    assert!(gap("slow:a") >= 1500, "the prefix's 1.5 s: {text}");
    let own = gap("slow:own");
    assert!(
        (300..1500).contains(&own),
        "the key rule's 300 ms beats its prefix's 1.5 s: {own} ms in {text}"
    );
    assert!(
        gap("fast") < 1500,
        "the default's 50 ms, not the prefix's wait: {text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finished jobs stay visible after their worker is gone: `jobs --key`
/// (another process) lists a key's completed jobs, newest first, with
/// their attempts and last failure, and a cancelled one; the retention's
/// count and age bound what it shows.
#[test]
fn a_keys_finished_jobs_outlive_the_worker_within_the_retention() {
    let dir = temp_dir("h-finished");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    let (ok, _, err) = run(&[
        "retry",
        "set",
        "--data",
        d,
        "--base-ms",
        "20",
        "--max-ms",
        "20",
    ]);
    assert!(ok, "{err}");
    for p in ["flaky", "plain"] {
        let (ok, _, err) = run(&["enqueue", "--data", d, "--key", "k", "--payload", p]);
        assert!(ok, "{err}");
    }
    let late = run(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "other",
        "--payload",
        "late",
        "--delay-ms",
        "600000",
    ])
    .1;
    // `flaky` fails its first attempt with a message; the rest succeed.
    let script = "read p; if [ \"$p\" = flaky ] && [ \"$SHARDQ_ATTEMPT\" = 1 ]; then echo upstream down >&2; exit 3; fi";
    let mut worker = start_worker(&data, &["--exit-when-idle"], script);
    wait_until("the two jobs of k done", WAIT_MAX, || {
        let (_, out, _) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
        serde_json::from_str::<serde_json::Value>(&out)
            .is_ok_and(|v| v["finished"].as_array().is_some_and(|r| r.len() == 2))
    });
    // The delayed job keeps the worker from being idle until another
    // process cancels it; then it exits, and the job is kept as cancelled.
    let (ok, _, err) = run(&["job", "cancel", "--data", d, late.trim()]);
    assert!(ok, "{err}");
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    let (ok, out, err) = run(&["jobs", "--data", d, "--key", "other", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["finished"][0]["id"], late.trim(), "{v}");
    assert_eq!(v["finished"][0]["outcome"], "cancelled", "{v}");
    let (ok, cancelled, err) = run(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "k",
        "--payload",
        "late",
        "--delay-ms",
        "600000",
    ]);
    assert!(ok, "{err}");
    let late = cancelled;
    let (ok, _, err) = run(&["job", "cancel", "--data", d, late.trim()]);
    assert!(ok, "{err}");
    let (ok, out, err) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["jobs"].as_array().map(Vec::len), Some(0), "{v}");
    let finished = v["finished"].as_array().unwrap();
    let seen: Vec<(&str, u64)> = finished
        .iter()
        .map(|f| {
            (
                f["outcome"].as_str().unwrap(),
                f["attempts"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [("cancelled", 0), ("completed", 1), ("completed", 2)],
        "{v}"
    );
    assert_eq!(finished[0]["id"], late.trim(), "{v}");
    let flaky = &finished[2];
    assert!(
        flaky["reason"].as_str().unwrap().contains("upstream down"),
        "the last failure's stderr: {flaky}"
    );
    assert_eq!(
        flaky["attempt_starts_ms"].as_array().map(Vec::len),
        Some(2),
        "{flaky}"
    );
    let (ok, table, err) = run(&["jobs", "--data", d, "--key", "k"]);
    assert!(
        ok && table.contains("FINISHED\tOUTCOME") && table.contains("completed"),
        "{table}{err}"
    );
    // The retention bounds what is shown: its count, then its age.
    let (ok, _, err) = run(&["retention", "set", "--data", d, "--finished-jobs", "1"]);
    assert!(ok, "{err}");
    let (_, out, _) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["finished"].as_array().map(Vec::len), Some(1), "{v}");
    let (ok, _, err) = run(&["retention", "set", "--data", d, "--finished-age-ms", "1"]);
    assert!(ok, "{err}");
    // Real time: the finished jobs must grow older than the 1 ms retention.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (_, out, _) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["finished"].as_array().map(Vec::len), Some(0), "{v}");
    let (ok, _, err) = run(&["retention", "set", "--data", d, "--finished-jobs", "100001"]);
    assert!(!ok && err.contains("100001"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts per key: the keys of `key_prefix`, from "KEY MS" lines, sorted.
fn starts_of(text: &str, key_prefix: &str) -> Vec<u64> {
    let mut t: Vec<u64> = (text.lines())
        .filter(|l| l.starts_with(key_prefix))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse().ok())
        .collect();
    t.sort_unstable();
    t
}

/// The most starts in any window of `window_ms` (a window starting at each
/// start).
fn most_in_window(starts: &[u64], window_ms: u64) -> usize {
    (0..starts.len())
        .map(|i| {
            starts[i..]
                .iter()
                .take_while(|&&t| t < starts[i] + window_ms)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// Enqueues `keys` (each with its count of jobs) into the deployment in
/// `dir`/data, runs two `shardq work --exit-when-idle --concurrency 4`
/// processes with the handler `script` (`STAMPS` in it names the file it
/// appends to) and a job lease of `lease_ms` until both exit, and returns
/// what the handlers wrote.
fn two_workers_run(dir: &Path, keys: &[(String, u32)], script: &str, lease_ms: u64) -> String {
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    for (key, n) in keys {
        for i in 0..*n {
            let args = [
                "enqueue",
                "--data",
                d,
                "--key",
                key,
                "--payload",
                &i.to_string(),
            ];
            let (ok, _, err) = run(&args);
            assert!(ok, "{args:?}: {err}");
        }
    }
    let stamps = dir.join("stamps");
    let script = script.replace("STAMPS", &stamps.display().to_string());
    let lease = lease_ms.to_string();
    let extra = [
        "--exit-when-idle",
        "--concurrency",
        "4",
        "--lease-ms",
        &lease,
    ];
    let mut a = start_worker(&data, &extra, &script);
    let mut b = start_worker(&data, &extra, &script);
    for w in [&mut a, &mut b] {
        let (status, err) = wait_exit(w, WAIT_MAX);
        assert!(status.success(), "{err}");
    }
    std::fs::read_to_string(&stamps).unwrap()
}

/// A key's rate limit and a group's shared limit hold over two worker
/// processes, each owning one shard, counted by the starts the handlers
/// saw; keys without a limit run at once meanwhile. Bad values are refused
/// by name.
#[test]
fn rate_limits_hold_over_two_worker_processes() {
    let dir = temp_dir("h-flow");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let ok = |args: &[&str]| {
        let (ok, out, err) = run(args);
        assert!(ok, "{args:?}: {err}");
        out
    };
    for (args, field, value) in [
        (vec!["--rate", "0/s"], "rate", "0/s"),
        (vec!["--rate", "5/d"], "rate", "5/d"),
        (vec!["--rate", "5/s", "--burst", "0"], "burst", "0"),
        (vec!["--concurrency", "257"], "concurrency", "257"),
        (vec!["--group", "missing"], "group", "missing"),
        (vec!["--weight", "0"], "weight", "0"),
    ] {
        let mut a = vec!["policy", "set", "--data", d, "k"];
        a.extend(args);
        let (ok, _, err) = run(&a);
        assert!(
            !ok && err.contains(field) && err.contains(value),
            "{a:?}: {err}"
        );
    }
    ok(&[
        "group", "set", "--data", d, "api", "--rate", "20/s", "--burst", "2",
    ]);
    ok(&[
        "policy", "set", "--data", d, "--prefix", "lim:", "--rate", "10/s", "--burst", "1",
    ]);
    let out = ok(&[
        "policy", "set", "--data", d, "--prefix", "grp:", "--group", "api",
    ]);
    assert!(out.contains("group api"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["policy", "show", "--data", d, "grp:7", "--json"])).unwrap();
    assert_eq!(
        (&v["group"], &v["from"]),
        (&"api".into(), &"prefix \"grp:\"".into()),
        "{v}"
    );
    let (gone, _, err) = run(&["group", "clear", "--data", d, "api"]);
    assert!(!gone && err.contains("grp:"), "a used group stays: {err}");
    let mut keys = vec![("lim:a".to_string(), 12)];
    keys.extend((0..6).map(|i| (format!("grp:{i}"), 5)));
    keys.push(("free".to_string(), 20));
    let text = two_workers_run(
        &dir,
        &keys,
        "echo \"$SHARDQ_KEY $(date +%s%3N)\" >> STAMPS",
        1_000,
    );
    let lim = starts_of(&text, "lim:");
    let grp = starts_of(&text, "grp:");
    assert_eq!(
        (lim.len(), grp.len(), starts_of(&text, "free").len()),
        (12, 30, 20)
    );
    // Burst 1 at 10/s: at most 1 + 10 per second (a stamp is taken in the
    // handler, a few ms after the start: one more allowed for that).
    assert!(most_in_window(&lim, 1_000) <= 12, "{lim:?}");
    assert!(
        lim[11] - lim[0] >= 1_000,
        "12 starts at 10/s take 1.1 s: {lim:?}"
    );
    // The group's 20/s over both processes: burst 2 + 20 a second.
    assert!(most_in_window(&grp, 1_000) <= 23, "{grp:?}");
    assert!(
        grp[29] - grp[0] >= 1_300,
        "30 starts at 20/s take 1.4 s: {grp:?}"
    );
    // `status` reads the group's shared bucket: what the workers left.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["status", "--data", d, "--json"])).unwrap();
    let g = &v["groups"][0];
    assert_eq!(
        (&g["name"], &g["rate"], &g["burst"]),
        (&"api".into(), &"20/s".into(), &2.into()),
        "{v}"
    );
    let tokens = g["tokens"].as_f64().unwrap();
    assert!((0.0..=2.0).contains(&tokens), "{v}");
    let text = ok(&["status", "--data", d]);
    assert!(text.contains("group api: 20/s (burst 2)"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The most runs at once among "KEY start MS" / "KEY end MS" lines of
/// keys starting with `key_prefix` (an end before a start at the same ms).
/// A worker with `leases` that exits when idle and runs every job for
/// 0.2 s, stamping `KEY start MS PAYLOAD FENCE` and `KEY end MS PAYLOAD`
/// lines into `stamps`: it takes over from a killed one.
fn takeover_worker(data: &Path, leases: &[&str], stamps: &Path) -> Worker {
    let script = format!(
        "read p; echo \"$SHARDQ_KEY start $(date +%s%3N) $p $SHARDQ_FENCE\" >> {s}; sleep 0.2; \
         echo \"$SHARDQ_KEY end $(date +%s%3N) $p\" >> {s}",
        s = stamps.display()
    );
    let mut extra = leases.to_vec();
    extra.push("--exit-when-idle");
    start_worker(data, &extra, &script)
}

fn most_at_once(text: &str, key_prefix: &str) -> usize {
    let mut events: Vec<(u64, i32)> = (text.lines())
        .filter(|l| l.starts_with(key_prefix))
        .filter_map(|l| {
            let mut w = l.split_whitespace().skip(1);
            let delta = if w.next()? == "start" { 1 } else { -1 };
            Some((w.next()?.parse().ok()?, delta))
        })
        .collect();
    events.sort_unstable();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    most as usize
}

/// A group's concurrency holds over two worker processes, each owning one
/// shard: the group's keys never run more than its limit at once, counted
/// by the handlers' own start and end stamps, while keys outside it run
/// meanwhile; a run that ends frees its slot for a key of either process.
/// Bad values are refused by name.
#[test]
fn a_groups_concurrency_holds_over_two_worker_processes() {
    let dir = temp_dir("h-slots");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let ok = |args: &[&str]| {
        let (ok, out, err) = run(args);
        assert!(ok, "{args:?}: {err}");
        out
    };
    for (args, named) in [
        (vec!["--concurrency", "2", "--burst", "5"], "burst"),
        (vec!["--concurrency", "0"], "0"),
        (vec!["--concurrency", "10001"], "10001"),
        (vec!["--concurrency", "two"], "two"),
        (vec![], "--concurrency"),
    ] {
        let mut a = vec!["group", "set", "--data", d, "db"];
        a.extend(args);
        let (ok, _, err) = run(&a);
        assert!(!ok && err.contains(named), "{a:?}: {err}");
    }
    let out = ok(&["group", "set", "--data", d, "db", "--concurrency", "2"]);
    assert!(
        out.contains("2 at once") && out.contains("no rate limit"),
        "{out}"
    );
    ok(&[
        "policy", "set", "--data", d, "--prefix", "db:", "--group", "db",
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["group", "show", "--data", d, "--json"])).unwrap();
    assert_eq!(
        (&v["db"]["concurrency"], &v["db"]["rate"]),
        (&2.into(), &serde_json::Value::Null),
        "{v}"
    );
    let mut keys: Vec<(String, u32)> = (0..8).map(|i| (format!("db:{i}"), 2)).collect();
    keys.push(("free".to_string(), 4));
    let text = two_workers_run(
        &dir,
        &keys,
        "echo \"$SHARDQ_KEY start $(date +%s%3N)\" >> STAMPS; sleep 0.3; echo \"$SHARDQ_KEY end $(date +%s%3N)\" >> STAMPS",
        5_000,
    );
    let count = |p: &str| {
        text.lines()
            .filter(|l| l.starts_with(p) && l.contains(" end "))
            .count()
    };
    assert_eq!((count("db:"), count("free")), (16, 4), "{text}");
    assert_eq!(
        most_at_once(&text, "db:"),
        2,
        "never more than two of the group at once, and two when ready: {text}"
    );
    // Every run ended: no slot is left taken.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["status", "--data", d, "--json"])).unwrap();
    let g = &v["groups"][0];
    assert_eq!(
        (&g["concurrency"], &g["running"]),
        (&2.into(), &0.into()),
        "{v}"
    );
    let text = ok(&["status", "--data", d]);
    assert!(
        text.contains("group db: no rate limit, 0 of 2 runs at once"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker SIGKILLed while its runs hold all of a group's slots leaves no
/// slot behind for good: with those two jobs cancelled (their keys start
/// nothing again, so nothing gives the slots back), the slots lapse with
/// the runs' leases, and the worker that takes over runs the group's other
/// jobs two at once, never more.
#[test]
fn a_killed_workers_group_slots_lapse_with_its_runs() {
    let (dir, data) = grouped_deployment("h-slots-kill", "db", "2");
    let d = data.to_str().unwrap();
    for i in 0..6 {
        ok(&[
            "enqueue",
            "--data",
            d,
            "--key",
            &format!("db:{i}"),
            "--payload",
            "x",
        ]);
    }
    let leases = [
        "--lease-ms",
        "1500",
        "--job-lease-ms",
        "1500",
        "--concurrency",
        "4",
    ];
    let first = dir.join("first");
    let script = format!(
        "echo \"$SHARDQ_KEY $SHARDQ_SHARD:$SHARDQ_JOB_ID\" >> {}; sleep 30",
        first.display()
    );
    let mut a = start_worker(&data, &leases, &script);
    let started = || {
        std::fs::read_to_string(&first)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    wait_until("two runs of the group", WAIT_MAX, || started() >= 2);
    // A negative check: no third run of the group may start within 0.5 s.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(started(), 2, "four free slots, two runs of the group");
    a.child.kill().unwrap();
    let _ = a.child.wait();
    for line in std::fs::read_to_string(&first).unwrap().lines() {
        let id = line.split_whitespace().nth(1).unwrap();
        ok(&["job", "cancel", "--data", d, id]);
    }
    let second = dir.join("second");
    let mut b = takeover_worker(&data, &leases, &second);
    let (status, err) = wait_exit(&mut b, WAIT_MAX);
    assert!(status.success(), "{err}");
    let text = std::fs::read_to_string(&second).unwrap();
    let ends = text.lines().filter(|l| l.contains(" end ")).count();
    assert_eq!(ends, 4, "every other job ran to its end: {text}");
    assert_eq!(most_at_once(&text, "db:"), 2, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A key of concurrency 3 runs three jobs at once in a worker, never more,
/// while a key without a policy runs one; the worker is SIGKILLed with
/// those runs in flight, and the worker that takes over runs the key's jobs
/// again from its first, in order (by their runs' fences), three at once,
/// each to its end.
#[test]
fn a_keys_concurrency_holds_through_a_sigkilled_worker() {
    key_concurrency_through_a_sigkill("h-key-conc", &[]);
}

/// The same on a Redis shard: the key's record holds its three runs, each
/// with its own fence, and the worker that takes over starts them again.
#[test]
fn a_keys_concurrency_holds_through_a_sigkilled_worker_on_redis() {
    let server = shardq_testkit::redis::RedisServer::start();
    key_concurrency_through_a_sigkill("h-key-conc-redis", &["--redis", &server.url()]);
}

/// A deployment of one shard (`init` with `init_extra`) whose key `c:k`
/// may run three jobs at once; see the tests above.
fn key_concurrency_through_a_sigkill(name: &str, init_extra: &[&str]) {
    let dir = temp_dir(name);
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let mut init = vec!["init", "--data", d, "--shards", "1"];
    init.extend_from_slice(init_extra);
    let (ok, _, err) = run(&init);
    assert!(ok, "{err}");
    let ok = |args: &[&str]| {
        let (ok, out, err) = run(args);
        assert!(ok, "{args:?}: {err}");
        out
    };
    ok(&[
        "policy",
        "set",
        "--data",
        d,
        "--prefix",
        "c:",
        "--concurrency",
        "3",
    ]);
    for i in 0..9 {
        ok(&[
            "enqueue",
            "--data",
            d,
            "--key",
            "c:k",
            "--payload",
            &i.to_string(),
        ]);
    }
    for i in 0..3 {
        ok(&[
            "enqueue",
            "--data",
            d,
            "--key",
            "plain",
            "--payload",
            &i.to_string(),
        ]);
    }
    let leases = [
        "--lease-ms",
        "1500",
        "--job-lease-ms",
        "1500",
        "--concurrency",
        "8",
    ];
    let first = dir.join("first");
    let script = format!(
        "read p; echo \"$SHARDQ_KEY $p\" >> {}; sleep 30",
        first.display()
    );
    let mut a = start_worker(&data, &leases, &script);
    let lines = || std::fs::read_to_string(&first).unwrap_or_default();
    wait_until("four runs", WAIT_MAX, || lines().lines().count() >= 4);
    // A negative check: no fifth run may start within 0.5 s.
    std::thread::sleep(Duration::from_millis(500));
    let text = lines();
    let started: Vec<&str> = text.lines().collect();
    assert_eq!(
        started.len(),
        4,
        "eight slots, three runs of c:k and one of plain: {text}"
    );
    let mut ck: Vec<&str> = (started.iter())
        .filter_map(|l| l.strip_prefix("c:k "))
        .collect();
    ck.sort_unstable();
    assert_eq!(ck, ["0", "1", "2"], "{text}");
    a.child.kill().unwrap();
    let _ = a.child.wait();
    let second = dir.join("second");
    let mut b = takeover_worker(&data, &leases, &second);
    let (status, err) = wait_exit(&mut b, WAIT_MAX);
    assert!(status.success(), "{err}");
    let text = std::fs::read_to_string(&second).unwrap();
    let of = |key: &str, what: &str| -> Vec<u32> {
        (text.lines())
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|w| w[0] == key && w[1] == what)
            .map(|w| w[3].parse().unwrap())
            .collect()
    };
    let mut ended = of("c:k", "end");
    ended.sort_unstable();
    assert_eq!(
        ended,
        (0..9).collect::<Vec<u32>>(),
        "each ran to its end: {text}"
    );
    // Handlers of one key run at once, so their lines may come in any
    // order: the runs' fences give the order the store started them in.
    let mut starts: Vec<(u64, u32)> = (text.lines())
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w[0] == "c:k" && w[1] == "start")
        .map(|w| (w[4].parse().unwrap(), w[3].parse().unwrap()))
        .collect();
    starts.sort_unstable();
    let order: Vec<u32> = starts.iter().map(|(_, p)| *p).collect();
    assert_eq!(order, (0..9).collect::<Vec<u32>>(), "in order: {text}");
    assert_eq!(most_at_once(&text, "c:k"), 3, "{text}");
    assert_eq!(most_at_once(&text, "plain"), 1, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A command handler backs off with exit status 75 and a
/// `shardq-backoff: MS` line: the run uses no attempt (a job of one attempt
/// runs again and is not dead), its key starts nothing for the wait (its
/// next job waits behind it), and other keys run meanwhile.
#[test]
fn a_command_handler_backs_off_without_using_an_attempt() {
    let dir = temp_dir("h-backoff");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    for (key, p) in [
        ("bo", "first"),
        ("bo", "second"),
        ("other", "x"),
        ("other", "y"),
    ] {
        let (ok, _, err) = run(&[
            "enqueue",
            "--data",
            d,
            "--key",
            key,
            "--payload",
            p,
            "--max-attempts",
            "1",
        ]);
        assert!(ok, "{err}");
    }
    let stamps = dir.join("stamps");
    let mark = dir.join("backed-off");
    let script = format!(
        "read p; now=$(date +%s%3N); \
         if [ \"$p\" = first ] && [ ! -e {m} ]; then touch {m}; \
           echo \"$SHARDQ_KEY $p $SHARDQ_ATTEMPT $now backoff\" >> {s}; \
           echo 'shardq-backoff: 800' >&2; exit 75; fi; \
         echo \"$SHARDQ_KEY $p $SHARDQ_ATTEMPT $now\" >> {s}",
        m = mark.display(),
        s = stamps.display()
    );
    let mut worker = start_worker(&data, &["--exit-when-idle", "--concurrency", "2"], &script);
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    let text = std::fs::read_to_string(&stamps).unwrap();
    let bo: Vec<Vec<&str>> = (text.lines())
        .filter(|l| l.starts_with("bo "))
        .map(|l| l.split(' ').collect())
        .collect();
    assert_eq!(bo.len(), 3, "{text}");
    let at = |i: usize| bo[i][3].parse::<u64>().unwrap();
    assert_eq!(
        (bo[0][1], bo[0].get(4)),
        ("first", Some(&"backoff")),
        "{text}"
    );
    assert_eq!(
        (bo[1][1], bo[1][2]),
        ("first", "1"),
        "the same attempt again: {text}"
    );
    assert!(at(1) >= at(0) + 800, "the key waited its back-off: {text}");
    assert_eq!(bo[2][1], "second", "the next job waited behind it: {text}");
    let others: Vec<u64> = (text.lines())
        .filter(|l| l.starts_with("other "))
        .map(|l| l.split(' ').nth(3).unwrap().parse().unwrap())
        .collect();
    assert!(
        others.iter().all(|&t| t < at(1)),
        "others ran meanwhile: {text}"
    );
    let (ok, out, _) = run(&["dead", "--data", d, "list", "--json"]);
    assert!(ok && !out.contains("\"bo\""), "nothing dead: {out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A group back-off of a day is lifted by `group resume` (the group's
/// other keys start again within seconds, with the worker running on; the
/// key that backed off keeps its own wait), and a group removed by `group
/// clear` takes its hold along: a group made again with the same name
/// starts without one.
#[test]
fn a_group_back_off_is_lifted_by_group_resume_and_by_group_clear() {
    let (dir, data) = grouped_deployment("h-group-resume", "g", "4");
    let d = data.to_str().unwrap();
    ok(&["enqueue", "--data", d, "--key", "g:a", "--payload", "hold"]);
    let bs: Vec<String> = (1..=8).map(|i| format!("b{i}")).collect();
    for p in &bs {
        ok(&["enqueue", "--data", d, "--key", "g:b", "--payload", p]);
    }
    let stamps = dir.join("stamps");
    let held = dir.join("held");
    let script = format!(
        "read p; if [ \"$p\" = hold ]; then touch {h}; \
           echo 'shardq-backoff: 86400000 group' >&2; exit 75; fi; \
         echo \"$p\" >> {s}",
        h = held.display(),
        s = stamps.display()
    );
    let mut worker = start_worker(&data, &["--concurrency", "1"], &script);
    wait_until("the group back-off", WAIT_MAX, || held.exists());
    // Held for a day: the group's other key stops (a run or two claimed
    // with the back-off's may still end). Real time: 1.5 s for those to end.
    std::thread::sleep(Duration::from_millis(1500));
    let ran = || std::fs::read_to_string(&stamps).map_or(0, |t| t.lines().count());
    let before = ran();
    // A negative check: no run of the held group may start within 1.5 s.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(ran(), before, "a held group went on running");
    assert!(before < 3, "{before} of 8 ran while held");
    let out = ok(&["status", "--data", d, "--json"]);
    assert!(out.contains("held_until_ms"), "{out}");
    ok(&["group", "resume", "--data", d, "g"]);
    wait_until("the group's other key to run", WAIT_MAX, || ran() == 8);
    let order: Vec<String> = std::fs::read_to_string(&stamps)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(order, bs, "in order");

    // Held again by a new back-off, then the group is removed and made
    // again: its keys run, no hold left.
    std::fs::remove_file(&held).unwrap();
    ok(&["enqueue", "--data", d, "--key", "g:c", "--payload", "hold"]);
    wait_until("the second group back-off", WAIT_MAX, || held.exists());
    ok(&["enqueue", "--data", d, "--key", "g:b", "--payload", "b9"]);
    // A negative check: the held group's new job may not start within 1.5 s.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(ran(), 8, "held again");
    ok(&["policy", "clear", "--data", d, "--prefix", "g:"]);
    ok(&["group", "clear", "--data", d, "g"]);
    ok(&["group", "set", "--data", d, "g", "--concurrency", "4"]);
    ok(&[
        "policy", "set", "--data", d, "--prefix", "g:", "--group", "g",
    ]);
    // The remade group has no hold in the shared store.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["status", "--data", d, "--json"])).unwrap();
    let g = v["groups"]
        .as_array()
        .and_then(|a| a.iter().find(|g| g["name"] == "g"))
        .cloned()
        .unwrap_or_else(|| panic!("no group g in {v}"));
    assert!(g["held_until_ms"].is_null(), "the old hold stayed: {g}");
    wait_until("the remade group's key to run", WAIT_MAX, || ran() == 9);
    let _ = worker.child.kill();
    let _ = worker.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A handler backs off two keys for a minute; `shardq key resume` from
/// another process lifts one while the worker runs: that key's job starts
/// again within a second or two with its attempt unused, while the other
/// key's back-off stands. `jobs --key` shows a back-off until it is lifted;
/// a key no back-off holds (resumed already, or a job its producer
/// delayed) is answered so with exit 0 and changes nothing; a key sealed
/// for a move exits 3 and changes nothing.
#[test]
fn a_keys_back_off_is_lifted_by_key_resume() {
    key_resume_lifts_one_keys_back_off("h-key-resume", &[]);
}

/// The same on Redis shards.
#[test]
fn a_keys_back_off_is_lifted_by_key_resume_on_redis() {
    let server = shardq_testkit::redis::RedisServer::start();
    key_resume_lifts_one_keys_back_off("h-key-resume-redis", &["--redis", &server.url()]);
}

/// Long on purpose: one scenario against one data dir, each `key resume`
/// case checked in turn on the state the one before it left.
fn key_resume_lifts_one_keys_back_off(name: &str, init_extra: &[&str]) {
    let dir = temp_dir(name);
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let mut init = vec!["init", "--data", d, "--shards", "2"];
    init.extend_from_slice(init_extra);
    ok(&init);
    for key in ["held", "other"] {
        ok(&[
            "enqueue",
            "--data",
            d,
            "--key",
            key,
            "--payload",
            "first",
            "--max-attempts",
            "1",
        ]);
    }
    ok(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "later",
        "--payload",
        "x",
        "--delay-ms",
        "60000",
    ]);
    let stamps = dir.join("stamps");
    let script = format!(
        "read p; now=$(date +%s%3N); \
         if [ ! -e {dir}/$SHARDQ_KEY.backed ]; then touch {dir}/$SHARDQ_KEY.backed; \
           echo \"$SHARDQ_KEY backoff $SHARDQ_ATTEMPT $now\" >> {s}; \
           echo 'shardq-backoff: 60000' >&2; exit 75; fi; \
         echo \"$SHARDQ_KEY $p $SHARDQ_ATTEMPT $now\" >> {s}",
        dir = dir.display(),
        s = stamps.display()
    );
    let mut worker = start_worker(
        &data,
        &["--concurrency", "2", "--max-local-shards", "all"],
        &script,
    );
    let backed = |k: &str| dir.join(format!("{k}.backed")).exists();
    wait_until("both back-offs", WAIT_MAX, || {
        backed("held") && backed("other")
    });
    let lines = || std::fs::read_to_string(&stamps).unwrap_or_default();
    // A negative check: neither backed-off key may run again within 1 s.
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(lines().lines().count(), 2, "held keys ran: {}", lines());
    let jobs = |k: &str| -> serde_json::Value {
        serde_json::from_str(&ok(&["jobs", "--data", d, "--key", k, "--json"])).unwrap()
    };
    let held = jobs("held");
    let held_id = held["jobs"][0]["id"].clone();
    assert_eq!(
        held["back_off"]["jobs"],
        serde_json::json!([held_id]),
        "{held}"
    );
    let text = ok(&["jobs", "--data", d, "--key", "held"]);
    assert!(
        text.contains("BACK-OFF") && text.contains("key resume"),
        "{text}"
    );
    assert!(
        jobs("later")["back_off"].is_null(),
        "a delay is not a back-off"
    );

    let resumed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let out = ok(&["key", "resume", "--data", d, "held"]);
    assert!(
        out.contains("resumed key held") && out.contains(held_id.as_str().unwrap()),
        "{out}"
    );
    wait_until("the resumed key's job", Duration::from_secs(5), || {
        lines().contains("held first")
    });
    let text = lines();
    let started: Vec<&str> = (text.lines())
        .find(|l| l.starts_with("held first"))
        .unwrap()
        .split(' ')
        .collect();
    assert_eq!(
        started[2], "1",
        "its one attempt, unused by the back-off: {text}"
    );
    let at: u64 = started[3].parse().unwrap();
    assert!(
        at < resumed_at + 2_000,
        "started {} ms after the resume: {text}",
        at.saturating_sub(resumed_at)
    );
    assert!(jobs("held")["back_off"].is_null());
    // A negative check: the other key may not run within 1 s of the resume.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        !lines().contains("other first"),
        "the other key's back-off stands: {}",
        lines()
    );
    assert!(!jobs("other")["back_off"].is_null());

    // Nothing to lift: said so, exit 0, nothing changes.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["key", "resume", "--data", d, "held", "--json"])).unwrap();
    assert_eq!(
        (&v["resumed"], &v["back_off"]),
        (&serde_json::json!(false), &serde_json::Value::Null),
        "{v}"
    );
    let out = ok(&["key", "resume", "--data", d, "later"]);
    assert!(out.contains("no back-off holds it"), "{out}");
    assert_eq!(jobs("later")["jobs"][0]["state"], "delayed");
    let (fine, _, err) = run(&["key", "resume", "--data", d, ""]);
    assert!(!fine && err.contains("empty"), "{err}");
    assert_eq!(
        support::output(&["key", "resume", "--data", d, ""])
            .status
            .code(),
        Some(2)
    );

    // A key moving to another shard (sealed for a rebalance): exit 3,
    // nothing changed.
    let other_shard = jobs("other")["shard"].as_str().unwrap().to_string();
    let deployment = shardq_deploy::Deployment::open(&data, &Default::default()).unwrap();
    let q = deployment.queue();
    let mut fence = q.fence(&other_shard).unwrap();
    fence.sealed_keys.insert("other".into(), "elsewhere".into());
    q.set_fence(&other_shard, &fence).unwrap();
    let o = support::output(&["key", "resume", "--data", d, "other"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("moving") && err.contains("nothing changed"),
        "{err}"
    );
    assert!(!jobs("other")["back_off"].is_null(), "still held");
    fence.sealed_keys.remove("other");
    q.set_fence(&other_shard, &fence).unwrap();

    ok(&["key", "resume", "--data", d, "other"]);
    wait_until("the other key's job", Duration::from_secs(5), || {
        lines().contains("other first")
    });
    let _ = worker.child.kill();
    let _ = worker.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A group's rate holds for the handler starts its downstream sees while
/// every slot is busy: 4 slots held 3 s by jobs outside the group, then
/// the group's jobs, at 1/s with a burst of 3. No run of the group is
/// claimed while no handler can start it (its token would be taken at the
/// claim and a bucketful would start at once when the slots free), so over
/// any window of w seconds the group starts at most burst + rate x w jobs
/// (one more for the handlers' own stamps). Tried with command handlers,
/// with `--stdio` handlers and jobs written ahead to them (a run goes to
/// an idle handler, never behind a busy one's job), and on a Redis shard:
/// the three wait on real time (held slots, a 1/s rate), so they run side
/// by side; more load only slows starts, and the bound is an upper one.
#[test]
fn a_groups_rate_holds_for_handler_starts_with_busy_slots() {
    let server = shardq_testkit::redis::RedisServer::start();
    let redis = server.url();
    support::side_by_side(vec!["command", "stdio", "redis"], |_, trial| {
        let _named = support::Named(format!("busy-slot trial {trial}"));
        match trial {
            "command" => group_starts_with_busy_slots("h-group-busy", &[], false),
            "stdio" => group_starts_with_busy_slots("h-group-busy-stdio", &[], true),
            _ => group_starts_with_busy_slots("h-group-busy-redis", &["--redis", &redis], false),
        }
    });
}

fn group_starts_with_busy_slots(name: &str, init_extra: &[&str], stdio: bool) {
    let dir = temp_dir(name);
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let mut init = vec!["init", "--data", d, "--shards", "1"];
    init.extend_from_slice(init_extra);
    ok(&init);
    ok(&[
        "group", "set", "--data", d, "g", "--rate", "1/s", "--burst", "3",
    ]);
    ok(&[
        "policy", "set", "--data", d, "--prefix", "g:", "--group", "g",
    ]);
    for i in 0..4 {
        ok(&[
            "enqueue",
            "--data",
            d,
            "--key",
            &format!("b{i}"),
            "--payload",
            "busy",
        ]);
    }
    for i in 0..8 {
        ok(&[
            "enqueue",
            "--data",
            d,
            "--key",
            &format!("g:{i}"),
            "--payload",
            "g",
        ]);
    }
    let stamps = dir.join("stamps");
    let s = stamps.display();
    let mut extra = vec!["--concurrency", "4", "--exit-when-idle"];
    let script = if stdio {
        extra.extend(["--stdio", "--stdio-pipeline", "4"]);
        let handler = dir.join("handler.py");
        std::fs::write(
            &handler,
            format!(
                "import json, sys, time\n\
                 for line in sys.stdin:\n\
                 \x20   job = json.loads(line)\n\
                 \x20   if job['payload'] == 'busy':\n\
                 \x20       time.sleep(3)\n\
                 \x20   else:\n\
                 \x20       with open('{s}', 'a') as f:\n\
                 \x20           f.write('%s %d\\n' % (job['key'], time.time() * 1000))\n\
                 \x20   print(json.dumps({{'receipt': job['receipt'], 'ok': True}}), flush=True)\n"
            ),
        )
        .unwrap();
        format!("exec python3 {}", handler.display())
    } else {
        format!(
            "read p; if [ \"$p\" = busy ]; then sleep 3; \
             else echo \"$SHARDQ_KEY $(date +%s%3N)\" >> {s}; fi"
        )
    };
    let mut worker = start_worker(&data, &extra, &script);
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    let text = std::fs::read_to_string(&stamps).unwrap();
    let starts = starts_of(&text, "g:");
    assert_eq!(starts.len(), 8, "{text}");
    for w in [500, 1_000, 2_000] {
        let bound = 3 + w as usize / 1_000 + 1;
        assert!(
            most_in_window(&starts, w) <= bound,
            "more than burst 3 + 1/s x {w} ms (+1) starts: {starts:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A running job cancelled from another process: its handler is stopped,
/// and the key's next job starts as soon as the handler is gone, not when
/// the cancelled run's 30 s job lease lapses; the cancelled job is kept as
/// cancelled and never runs again.
#[test]
fn a_cancelled_runs_key_goes_on_once_its_handler_is_gone() {
    let dir = temp_dir("h-cancel-run");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    ok(&["init", "--data", d, "--shards", "1"]);
    let hold = ok(&["enqueue", "--data", d, "--key", "k", "--payload", "hold"]);
    ok(&["enqueue", "--data", d, "--key", "k", "--payload", "next"]);
    let stamps = dir.join("stamps");
    let script = format!(
        "read p; echo \"$p\" >> {s}; if [ \"$p\" = hold ]; then sleep 60; fi",
        s = stamps.display()
    );
    let mut worker = start_worker(&data, &["--exit-when-idle", "--lease-ms", "30000"], &script);
    let ran = || std::fs::read_to_string(&stamps).unwrap_or_default();
    wait_until("the held job to start", WAIT_MAX, || ran().contains("hold"));
    let cancelled_at = Instant::now();
    ok(&["job", "cancel", "--data", d, hold.trim()]);
    wait_until("the key's next job", WAIT_MAX, || ran().contains("next"));
    let waited = cancelled_at.elapsed();
    assert!(
        waited < Duration::from_secs(20),
        "the next job waited {waited:?}, as long as the cancelled run's lease"
    );
    let (status, err) = wait_exit(&mut worker, WAIT_MAX);
    assert!(status.success(), "{err}");
    assert_eq!(ran(), "hold\nnext\n", "the cancelled job ran once");
    let out = ok(&["job", "show", "--data", d, hold.trim(), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["outcome"], "cancelled", "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}
