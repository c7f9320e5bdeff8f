//! A running job cancelled from another process (`shardq job cancel`)
//! frees its key at once: the worker notices the cancel within about a
//! second (`CANCEL_CHECK_MS`), kills the handler, and the key's next job
//! starts as soon as that handler is gone, not at the next job-lease
//! heartbeat (a third of the 30 s job lease) nor when the lease lapses.
//! On the embedded engine and on Redis (a `redis-server` the test starts
//! on a free loopback port), with command handlers and `--stdio` handlers.
//!
//! The held job's handler sleeps far longer than every timeout and writes
//! its pid; the next job's handler writes its start time and whether that
//! pid still exists, so the test sees both the delay and that the
//! cancelled handler was gone before the next one started.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod support;
use support::{ok, temp_dir, wait_exit, wait_until, BIN, WAIT_MAX};

/// The job lease of the workers here (the default, said out loud): its
/// heartbeat, every 10 s, is what noticed a cancel before.
const JOB_LEASE_MS: &str = "30000";
/// Longest wait from the cancel to the key's next start: well below the
/// heartbeat, above the check interval (1 s) plus killing the handler and
/// a loaded machine's slack.
const NEXT_START_MAX: Duration = Duration::from_secs(3);

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// The worker: one slot, exits once idle, its stderr in `dir/worker.err`.
fn worker(dir: &Path, data: &str, handler: &[&str], stdio: bool) -> Child {
    let mut args = vec![
        "work",
        "--data",
        data,
        "--concurrency",
        "1",
        "--job-lease-ms",
        JOB_LEASE_MS,
        "--exit-when-idle",
    ];
    if stdio {
        args.push("--stdio");
    }
    args.push("--");
    args.extend_from_slice(handler);
    Command::new(BIN)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("worker.err")).unwrap())
        .spawn()
        .unwrap()
}

/// A command handler: `hold` writes its pid (the `sleep` it becomes) and
/// sleeps ten minutes; any other job logs `next MS ALIVE`, ALIVE being
/// whether the held handler's pid still exists.
fn command_handler(dir: &Path) -> Vec<String> {
    let script = format!(
        r#"read p
if [ "$p" = hold ]; then
  echo $$ > {dir}/hold.pid
  echo "hold $(date +%s%3N)" >> {dir}/log
  exec sleep 600
fi
if kill -0 "$(cat {dir}/hold.pid)" 2>/dev/null; then alive=yes; else alive=no; fi
echo "next $(date +%s%3N) $alive" >> {dir}/log"#,
        dir = dir.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

/// The same as a `--stdio` handler: one Python process per slot, which
/// the cancel kills with the held job; its replacement runs the next job.
fn stdio_handler(dir: &Path) -> Vec<String> {
    let script = dir.join("h.py");
    let text = format!(
        r#"import json, os, sys, time
d = {dir:?}
def log(line):
    with open(os.path.join(d, "log"), "a") as f:
        f.write(line + "\n")
for line in sys.stdin:
    job = json.loads(line)
    if job["payload"] == "hold":
        with open(os.path.join(d, "hold.pid"), "w") as f:
            f.write(str(os.getpid()))
        log("hold %d" % int(time.time() * 1000))
        time.sleep(600)
    with open(os.path.join(d, "hold.pid")) as f:
        pid = int(f.read())
    try:
        os.kill(pid, 0)
        alive = "yes"
    except OSError:
        alive = "no"
    log("next %d %s" % (int(time.time() * 1000), alive))
    sys.stdout.write(json.dumps({{"receipt": job["receipt"], "ok": True}}) + "\n")
    sys.stdout.flush()
"#,
        dir = dir.to_str().unwrap()
    );
    std::fs::write(&script, text).unwrap();
    vec!["python3".into(), script.to_str().unwrap().into()]
}

/// Enqueues `hold` then `next` on one key, starts the worker, cancels
/// `hold` once its handler runs, and checks the next job's start.
fn a_cancel_frees_the_key(name: &str, init_extra: &[&str], stdio: bool) {
    let dir = temp_dir(name);
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let mut init = vec!["init", "--data", d, "--shards", "1"];
    init.extend_from_slice(init_extra);
    ok(&init);
    let hold = ok(&["enqueue", "--data", d, "--key", "k", "--payload", "hold"]);
    ok(&["enqueue", "--data", d, "--key", "k", "--payload", "next"]);
    let handler = if stdio {
        stdio_handler(&dir)
    } else {
        command_handler(&dir)
    };
    let handler: Vec<&str> = handler.iter().map(String::as_str).collect();
    let mut child = worker(&dir, d, &handler, stdio);
    let log = || std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    let err = || std::fs::read_to_string(dir.join("worker.err")).unwrap_or_default();
    wait_until("the held job's handler", WAIT_MAX, || {
        log().contains("hold") && dir.join("hold.pid").exists()
    });
    // Past the first check after the start, so no check is due at once.
    std::thread::sleep(Duration::from_millis(1_300));
    let cancelled_ms = now_ms();
    let cancelled_at = Instant::now();
    let out = ok(&["job", "cancel", "--data", d, hold.trim()]);
    assert!(out.contains("stop"), "a running job's cancel: {out}");
    wait_until("the key's next job", WAIT_MAX, || log().contains("next"));
    let waited = cancelled_at.elapsed();
    eprintln!("{name}: the key's next job seen {waited:?} after the cancel");
    let status = wait_exit(&mut child, "the worker", WAIT_MAX);
    assert!(status.success(), "the worker failed: {}", err());
    let text = log();
    let next: Vec<&str> = (text.lines())
        .find(|l| l.starts_with("next "))
        .expect("the next job ran")
        .split(' ')
        .collect();
    let started_ms: u128 = next[1].parse().unwrap();
    assert_eq!(
        next[2],
        "no",
        "the next job started while the cancelled run's handler still ran:\n{text}\n{}",
        err()
    );
    assert!(
        waited < NEXT_START_MAX
            && started_ms.saturating_sub(cancelled_ms) < NEXT_START_MAX.as_millis(),
        "the key's next job started {} ms after the cancel (seen after {waited:?}); \
         a cancelled run must free its key within about a second:\n{text}\n{}",
        started_ms.saturating_sub(cancelled_ms),
        err()
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("hold")).count(),
        1,
        "the cancelled job ran again:\n{text}"
    );
    let shown = ok(&["job", "show", "--data", d, hold.trim(), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(v["outcome"], "cancelled", "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cancelled_command_run_frees_its_key_within_a_second() {
    a_cancel_frees_the_key("cancel-cmd", &[], false);
}

#[test]
fn a_cancelled_command_run_frees_its_key_within_a_second_on_redis() {
    let server = shardq_testkit::redis::RedisServer::start();
    a_cancel_frees_the_key("cancel-cmd-redis", &["--redis", &server.url()], false);
}

#[test]
fn a_cancelled_stdio_run_frees_its_key_within_a_second() {
    a_cancel_frees_the_key("cancel-stdio", &[], true);
}

#[test]
fn a_cancelled_stdio_run_frees_its_key_within_a_second_on_redis() {
    let server = shardq_testkit::redis::RedisServer::start();
    a_cancel_frees_the_key("cancel-stdio-redis", &["--redis", &server.url()], true);
}
