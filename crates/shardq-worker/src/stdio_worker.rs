//! `shardq work --stdio -- CMD`: long-lived handler processes, one per
//! concurrency slot, fed one job per line instead of one process per job.
//!
//! The protocol (docs/stdio-protocol.md): shardq writes one JSON object per
//! job on the handler's stdin, the job object of the server's `/v1/claim`
//! (`id`, `shard`, `key`, `payload` when the payload is UTF-8 or else
//! `payload_b64`, `attempt`, `receipt`, `fence`, `lease_expires_ms`, and
//! `dedup_id` and `schedule` when the job has them), and
//! reads one result line per job from its stdout:
//! `{"receipt":"...","ok":true}` or `{"receipt":"...","ok":false,"reason":"..."}`;
//! an `ok: true` line may carry the job's result, `result` (text) or
//! `result_b64` (bytes), kept with the finished job.
//! Up to `--stdio-pipeline` jobs are written ahead to each process (of
//! different keys: the pool never runs two jobs of a key at once), so the
//! round trip through the pipes does not idle the handler; it still reads
//! and answers them one by one. Answers are matched by receipt.
//!
//! Each handler gets its own process group and, on Linux, a parent-death
//! SIGKILL, like a per-job handler. A handler that dies, answers for a
//! receipt it was not given (a second answer included), writes a line that
//! is not a result, or holds a run the pool cancelled (job timeout, lost
//! shard, drain timeout) is killed (its whole group) at once, by whichever
//! thread sees it first, whether or not it holds a job, and reaped; the
//! oldest job it held (the one it was running) fails, the jobs only written
//! ahead to it run on the slot's next process in the same run, without
//! using an attempt. This module never leaves a handler running once the
//! worker is done with it, and knows nothing of queues beyond the job it is
//! given.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use shardq_core::schedule::ScheduleTick;
use shardq_core::{BackOff, ClaimedJob, HandlerError};

/// Longest result line read from a handler (1 MiB); a longer one is a
/// protocol error.
pub const RESULT_LINE_BYTES_MAX: u64 = 1 << 20;
/// How often a run waiting for its answer checks for cancellation.
const POLL_MS: u64 = 5;

/// One job as a handler reads it: the `/v1/claim` job object.
#[derive(Debug, Serialize)]
pub struct StdioJob<'a> {
    /// `SHARD:ID`, unique within the deployment.
    pub id: String,
    /// The job's shard.
    pub shard: &'a str,
    /// Routing key.
    pub key: &'a str,
    /// The payload, when it is UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<&'a str>,
    /// The payload in base64, when it is not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_b64: Option<String>,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// What the result line must name: `SHARD:ID.FENCE`.
    pub receipt: String,
    /// This run's fencing token.
    pub fence: u64,
    /// When the run's job lease ends unless extended (shardq extends it
    /// while the handler works).
    pub lease_expires_ms: u64,
    /// The dedup id the job was enqueued with, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup_id: Option<&'a str>,
    /// The schedule and tick of a schedule's job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleTick>,
    /// A released dependent's id, `@N` (its dependencies' outcomes and
    /// results: `shardq job show @N --json`, `GET /v1/jobs/@N`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dependent: Option<String>,
    /// The batch of a job of a batch or of a callback, `@N` (add to it
    /// with `shardq enqueue --batch @N`; read it with `shardq batch show`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    /// A batch callback's kind: `complete`, `success` or `death`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_callback: Option<&'static str>,
}

impl<'a> StdioJob<'a> {
    /// The line for `job`.
    pub fn of(job: &'a ClaimedJob) -> StdioJob<'a> {
        let (batch, batch_callback) = shardq_core::workflow::batch_fields(job.dedup_id.as_deref());
        let (payload, payload_b64) = match std::str::from_utf8(&job.payload) {
            Ok(text) => (Some(text), None),
            Err(_) => (
                None,
                Some(base64::engine::general_purpose::STANDARD.encode(&job.payload)),
            ),
        };
        StdioJob {
            id: format!("{}:{}", job.shard, job.id),
            shard: &job.shard,
            key: &job.key,
            payload,
            payload_b64,
            attempt: job.attempt,
            receipt: format!("{}:{}", job.shard, job.receipt()),
            fence: job.fence,
            lease_expires_ms: job.lease_until_ms,
            dedup_id: job.dedup_id.as_deref(),
            schedule: job.dedup_id.as_deref().and_then(ScheduleTick::of_dedup_id),
            dependent: (job.dedup_id.as_deref())
                .and_then(shardq_core::workflow::dependent_of_dedup_id)
                .map(|n| format!("@{n}")),
            batch,
            batch_callback,
        }
    }
}

/// A result line.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StdioResult {
    receipt: String,
    ok: bool,
    #[serde(default)]
    reason: Option<String>,
    /// With `ok: false`: back off instead of failing (the downstream
    /// limits the handler): no attempt used, the key waits this long.
    #[serde(default)]
    backoff_ms: Option<u64>,
    /// With `backoff_ms`: hold the key's whole flow-control group.
    #[serde(default)]
    backoff_group: bool,
    /// With `ok: true`: the job's result, as text.
    #[serde(default)]
    result: Option<String>,
    /// With `ok: true`: the job's result, in base64 (bytes that are not
    /// text).
    #[serde(default)]
    result_b64: Option<String>,
}

impl StdioResult {
    /// The result bytes an `ok: true` line carries, if any.
    fn result_bytes(&self) -> Result<Option<Vec<u8>>, String> {
        match (&self.result, &self.result_b64) {
            (Some(_), Some(_)) => {
                Err("the handler answered both result and result_b64; the attempt fails".into())
            }
            (Some(t), None) => Ok(Some(t.clone().into_bytes())),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .map(Some)
                .map_err(|e| format!("the handler's result_b64 is not base64: {e}")),
            (None, None) => Ok(None),
        }
    }
}

/// What a waiting run gets back.
enum Answer {
    /// The handler's result line.
    Done(StdioResult),
    /// The handler broke (died, broke the protocol, was killed) while this
    /// was the oldest job it held: the one it was running. The attempt fails.
    Broke(String),
    /// The handler broke while this job was only written ahead: it never
    /// started, so it runs again on the slot's next handler, in the same run.
    NotStarted(String),
}

/// What a handler process and its reader thread share.
struct Shared {
    pgid: libc::pid_t,
    /// Jobs written and not answered, by write order: the first is the one
    /// the handler runs (it reads and answers them one by one).
    waiting: BTreeMap<u64, Waiter>,
    next_seq: u64,
    /// Why the handler is of no more use, once it is not.
    broken: Option<String>,
    /// Set (under this lock) just before the group leader is reaped: from
    /// then on the group id may be reused and nobody may signal it.
    reaped: bool,
}

struct Waiter {
    receipt: String,
    tx: mpsc::Sender<Answer>,
}

type SharedRef = Arc<Mutex<Shared>>;

/// Ends a handler: kills its group at once (it stays unreaped, so the group
/// id cannot be reused, until its `Proc` drops), fails the job it was
/// running and gives back the ones only written ahead. Idempotent.
fn stop(shared: &Mutex<Shared>, why: &str) {
    let waiting = {
        let mut s = lock(shared);
        if s.broken.is_none() {
            s.broken = Some(why.to_string());
        }
        if !s.reaped {
            // SAFETY: kill(2) on the group this handler created; its leader
            // is not reaped yet (checked under the lock that guards the
            // reap), so the id cannot have been reused.
            unsafe {
                libc::kill(-s.pgid, libc::SIGKILL);
            }
        }
        std::mem::take(&mut s.waiting)
    };
    for (i, (_, w)) in waiting.into_iter().enumerate() {
        let answer = if i == 0 {
            Answer::Broke(why.to_string())
        } else {
            Answer::NotStarted(why.to_string())
        };
        let _ = w.tx.send(answer);
    }
}

/// A running handler process.
struct Proc {
    child: Child,
    stdin: ChildStdin,
    program: String,
    shared: SharedRef,
}

impl Drop for Proc {
    fn drop(&mut self) {
        stop(&self.shared, "the handler was stopped");
        lock(&self.shared).reaped = true;
        let _ = self.child.wait();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn start(cmd: &[String], slot: usize) -> Result<Proc, String> {
    let Some(program) = cmd.first() else {
        return Err("no handler command given".to_string());
    };
    let mut command = Command::new(program);
    command
        .args(&cmd[1..])
        .env("SHARDQ_STDIO", "1")
        .env("SHARDQ_SLOT", slot.to_string())
        .env_remove("SHARDQ_FENCE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0);
    crate::handler_proc::die_with_parent(&mut command);
    let mut child = command
        .spawn()
        .map_err(|e| format!("starting stdio handler {program:?}: {e}"))?;
    let shared: SharedRef = Arc::new(Mutex::new(Shared {
        pgid: child.id() as libc::pid_t,
        waiting: BTreeMap::new(),
        next_seq: 0,
        broken: None,
        reaped: false,
    }));
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the handler has no stdin or stdout pipe".to_string());
    };
    // From here on a failure drops `proc`, which kills and reaps the child.
    let proc = Proc {
        child,
        stdin,
        program: program.clone(),
        shared: Arc::clone(&shared),
    };
    let reader_shared = Arc::clone(&shared);
    let name = program.clone();
    thread::Builder::new()
        .name("shardq-stdio-reader".into())
        .spawn(move || read_answers(stdout, &reader_shared, &name))
        .map_err(|e| format!("starting the reader of handler {program:?}: {e}"))?;
    Ok(proc)
}

/// Hands each result line to the run it names; on a broken protocol or the
/// end of the handler's stdout the handler is stopped at once.
fn read_answers(stdout: std::process::ChildStdout, shared: &Mutex<Shared>, program: &str) {
    let mut reader = BufReader::new(stdout);
    let why = loop {
        let mut line = String::new();
        match (&mut reader)
            .take(RESULT_LINE_BYTES_MAX + 1)
            .read_line(&mut line)
        {
            Ok(0) => break format!("handler {program:?} exited (closed its stdout)"),
            Err(e) => break format!("reading handler {program:?}: {e}"),
            Ok(_) if line.len() as u64 > RESULT_LINE_BYTES_MAX => {
                break format!(
                    "handler {program:?} wrote a result line over {RESULT_LINE_BYTES_MAX} bytes"
                )
            }
            Ok(_) => {}
        }
        let r: StdioResult = match serde_json::from_str(line.trim()) {
            Ok(r) => r,
            Err(e) => {
                break format!(
                    "handler {program:?} wrote {:?}, not a result line ({e})",
                    shardq_core::job::cut_at_char(line.trim(), 200)
                )
            }
        };
        let waiter = {
            let mut s = lock(shared);
            let seq = s
                .waiting
                .iter()
                .find(|(_, w)| w.receipt == r.receipt)
                .map(|(seq, _)| *seq);
            seq.and_then(|seq| s.waiting.remove(&seq))
        };
        let Some(w) = waiter else {
            break format!(
                "handler {program:?} answered for receipt {:?}, which it was not running",
                r.receipt
            );
        };
        let _ = w.tx.send(Answer::Done(r));
    };
    stop(shared, &why);
}

/// The handler processes of `work --stdio` and the jobs they run.
struct Procs {
    cmd: Vec<String>,
    slots: Vec<Mutex<Option<Proc>>>,
    /// Runs inside each slot now (written to its handler or about to be).
    load: Mutex<Vec<usize>>,
}

/// A run's hold on its slot, given back when the run returns.
struct SlotHeld<'a> {
    procs: &'a Procs,
    slot: usize,
}

impl Drop for SlotHeld<'_> {
    fn drop(&mut self) {
        lock(&self.procs.load)[self.slot] -= 1;
    }
}

/// How often one run is given back to a new handler before it fails anyway
/// (a handler that breaks before it reads any job would loop forever).
const GIVE_BACKS_MAX: u32 = 3;

impl Procs {
    /// The slot with the fewest runs in it (the first of those): an idle
    /// handler gets a job before any is written ahead to a busy one, so as
    /// long as no more runs are in flight than handlers, none waits in a
    /// pipe (a rate's tokens are taken as the handler starts).
    fn take_slot(&self) -> SlotHeld<'_> {
        let mut load = lock(&self.load);
        let slot = (0..load.len()).min_by_key(|&i| load[i]).unwrap_or(0);
        load[slot] += 1;
        SlotHeld { procs: self, slot }
    }

    /// Runs `job` on the least busy handler process (starting one if needed). A
    /// handler that fails the protocol, dies, or holds a cancelled run is
    /// killed and reaped at once; the job it was running fails, the jobs
    /// written ahead to it run on the slot's next handler.
    fn run(&self, job: &ClaimedJob) -> Result<(), HandlerError> {
        let held = self.take_slot();
        let slot = held.slot;
        let run = shardq_core::current_run();
        let line = serde_json::to_string(&StdioJob::of(job))
            .map_err(|e| format!("encoding job {}: {e}", job.id))?;
        let receipt = format!("{}:{}", job.shard, job.receipt());
        let mut given_back = 0u32;
        loop {
            if let Some(r) = run.as_ref().filter(|r| r.is_cancelled()) {
                return Err(format!("killed: {}", r.cancel_reason()).into());
            }
            let (rx, shared) = self.write(slot, &receipt, &line)?;
            let answer = loop {
                if let Some(r) = run.as_ref().filter(|r| r.is_cancelled()) {
                    let why = format!("killed: {}", r.cancel_reason());
                    // Only if the answer is still outstanding: the handler
                    // may be stuck on it.
                    if lock(&shared).waiting.values().any(|w| w.receipt == receipt) {
                        stop(&shared, &why);
                        self.reap(slot, &shared);
                    }
                    return Err(why.into());
                }
                match rx.recv_timeout(Duration::from_millis(POLL_MS)) {
                    Ok(answer) => break answer,
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err("the handler's answer was lost".into())
                    }
                }
            };
            match answer {
                Answer::Done(r) if r.ok && (r.backoff_ms.is_some() || r.backoff_group) => {
                    return Err(
                        "the handler answered ok: true with backoff_ms or backoff_group \
                         (a back-off is ok: false); the attempt fails"
                            .into(),
                    )
                }
                Answer::Done(StdioResult {
                    backoff_ms: None,
                    backoff_group: true,
                    ..
                }) => {
                    return Err("the handler answered backoff_group without backoff_ms; \
                         the attempt fails"
                        .into())
                }
                Answer::Done(r) if r.ok => {
                    if let Some(result) = r.result_bytes()? {
                        shardq_core::pool::set_result(result);
                    }
                    return Ok(());
                }
                Answer::Done(StdioResult {
                    backoff_ms: Some(ms),
                    backoff_group,
                    ..
                }) => {
                    shardq_core::flow::validate_backoff_ms(ms)?;
                    return Err(Box::new(BackOff {
                        ms,
                        group: backoff_group,
                    }));
                }
                Answer::Done(r) => {
                    return Err(r
                        .reason
                        .unwrap_or_else(|| "handler reported failure".into())
                        .into())
                }
                Answer::Broke(why) => {
                    self.reap(slot, &shared);
                    return Err(why.into());
                }
                Answer::NotStarted(why) => {
                    self.reap(slot, &shared);
                    given_back += 1;
                    if given_back > GIVE_BACKS_MAX {
                        return Err(format!(
                            "{why} (the job was given to {given_back} handlers, none started it)"
                        )
                        .into());
                    }
                }
            }
        }
    }

    /// Writes `line` to the slot's handler (a new one when there is none or
    /// it broke) and registers `receipt` for its answer.
    fn write(
        &self,
        slot: usize,
        receipt: &str,
        line: &str,
    ) -> Result<(mpsc::Receiver<Answer>, SharedRef), String> {
        let (tx, rx) = mpsc::channel();
        let mut cell = lock(&self.slots[slot]);
        if cell
            .as_ref()
            .is_some_and(|p| lock(&p.shared).broken.is_some())
        {
            *cell = None;
        }
        if cell.is_none() {
            *cell = Some(start(&self.cmd, slot)?);
        }
        let p = cell.as_mut().expect("started above");
        let shared = Arc::clone(&p.shared);
        {
            let mut s = lock(&shared);
            if let Some(why) = s.broken.clone() {
                // Broke between the check and now: this job never reached it.
                let _ = tx.send(Answer::NotStarted(why));
            } else {
                let seq = s.next_seq;
                s.next_seq += 1;
                s.waiting.insert(
                    seq,
                    Waiter {
                        receipt: receipt.to_string(),
                        tx,
                    },
                );
            }
        }
        let written = p
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| p.stdin.write_all(b"\n"))
            .and_then(|()| p.stdin.flush());
        if let Err(e) = written {
            stop(
                &shared,
                &format!("writing job {receipt} to handler {:?}: {e}", p.program),
            );
        }
        Ok((rx, shared))
    }

    /// Drops (kills and reaps) the slot's handler if it is still the one
    /// `shared` belongs to.
    fn reap(&self, slot: usize, shared: &SharedRef) {
        let mut cell = lock(&self.slots[slot]);
        if cell
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(&p.shared, shared))
        {
            *cell = None;
        }
    }
}

/// The handler of `work --stdio`: CMD runs as `procs` long-lived processes;
/// each run goes to the one with the fewest runs in it, so with `pipeline`
/// pool threads per process a handler has up to that many jobs written
/// ahead (it still reads and answers them one by one, in order).
pub fn stdio_handler(cmd: Vec<String>, procs: usize) -> Arc<shardq_core::Handler> {
    let procs = Arc::new(Procs {
        cmd,
        slots: (0..procs.max(1)).map(|_| Mutex::new(None)).collect(),
        load: Mutex::new(vec![0; procs.max(1)]),
    });
    Arc::new(move |job: &ClaimedJob| procs.run(job))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::testing::{alive, job, python, wait_for};

    /// A stdio handler that logs `PID KEY` per job line it reads to
    /// `argv[1]` and answers by the job's key:
    /// `fail` fails with a reason naming the job id, `backoff` and
    /// `backoff-group` back off, `env` fails with its `SHARDQ_STDIO` and
    /// `SHARDQ_SLOT`, `stranger` answers for a receipt it was not given,
    /// `twice` answers twice, `slow` takes 20 ms; `die-after-next` and
    /// `garbage-after-next` touch `argv[1].got`, read one more job line and
    /// then exit or write a line that is no result; anything else is ok.
    const HANDLER: &str = r#"
import json, os, sys
log = sys.argv[1]
def note(job):
    with open(log, "a") as f:
        f.write("%d %s\n" % (os.getpid(), job["key"]))
def say(reply):
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    job = json.loads(line)
    note(job)
    key, receipt = job["key"], job["receipt"]
    if key in ("die-after-next", "garbage-after-next"):
        open(log + ".got", "w").close()
        note(json.loads(sys.stdin.readline()))
        if key == "die-after-next":
            sys.exit(3)
        say("hello")
        continue
    if key == "fail":
        say({"receipt": receipt, "ok": False, "reason": "nope " + job["id"]})
    elif key.startswith("backoff"):
        say({"receipt": receipt, "ok": False, "backoff_ms": 250,
             "backoff_group": key == "backoff-group"})
    elif key == "env":
        say({"receipt": receipt, "ok": False,
             "reason": os.environ["SHARDQ_STDIO"] + " " + os.environ["SHARDQ_SLOT"]})
    elif key == "stranger":
        say({"receipt": "shard-9:1.1", "ok": True})
    elif key == "twice":
        say({"receipt": receipt, "ok": True})
        say({"receipt": receipt, "ok": True})
    else:
        if key == "slow":
            import time
            time.sleep(0.02)
        say({"receipt": receipt, "ok": True})
"#;

    struct Fixture {
        _dir: tempfile::TempDir,
        log: PathBuf,
        handler: Arc<shardq_core::Handler>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let cmd = python(HANDLER, &[log.to_str().expect("utf-8 path")]);
        Fixture {
            handler: stdio_handler(cmd, 1),
            log,
            _dir: dir,
        }
    }

    /// The `(pid, key)` lines the handlers logged, in order.
    fn logged(log: &Path) -> Vec<(u32, String)> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (pid, key) = l.split_once(' ').expect("PID KEY");
                (pid.parse().expect("pid"), key.to_string())
            })
            .collect()
    }

    fn pids(log: &Path) -> Vec<u32> {
        let mut p: Vec<u32> = logged(log).into_iter().map(|(pid, _)| pid).collect();
        p.dedup();
        p
    }

    #[test]
    fn one_handler_answers_the_jobs_in_order() {
        let f = fixture();
        let keys = ["a", "b", "fail", "c", "env", "d"];
        let results: Vec<_> = (keys.iter().enumerate())
            .map(|(i, k)| (f.handler)(&job(i as u64 + 1, k, b"x")))
            .collect();
        assert!(results[0].is_ok() && results[1].is_ok() && results[3].is_ok());
        assert_eq!(
            results[2].as_ref().unwrap_err().to_string(),
            "nope shard-0:3"
        );
        assert_eq!(results[4].as_ref().unwrap_err().to_string(), "1 0");
        assert!(results[5].is_ok());
        let seen = logged(&f.log);
        let order: Vec<&str> = seen.iter().map(|(_, k)| k.as_str()).collect();
        assert_eq!(order, keys);
        // One long-lived process ran them all.
        assert_eq!(pids(&f.log).len(), 1, "{seen:?}");
    }

    #[test]
    fn pipelined_jobs_get_their_own_answers() {
        let f = fixture();
        // Eight pool threads share the one process: jobs are written ahead
        // and each answer must reach the run it names. Like a pool's, the
        // threads live on until every job is done: the handler process
        // dies with the thread that started it.
        let all_done = Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (1..=8u64)
            .map(|id| {
                let handler = Arc::clone(&f.handler);
                let all_done = Arc::clone(&all_done);
                thread::spawn(move || {
                    let key = if id % 2 == 0 { "fail" } else { "slow" };
                    let result = handler(&job(id, key, b""));
                    all_done.wait();
                    (id, result)
                })
            })
            .collect();
        for t in threads {
            let (id, result) = t.join().expect("thread");
            if id % 2 == 0 {
                let e = result.unwrap_err().to_string();
                assert_eq!(e, format!("nope shard-0:{id}"));
            } else {
                result.expect("ok");
            }
        }
        assert_eq!(logged(&f.log).len(), 8);
        assert_eq!(pids(&f.log).len(), 1);
    }

    #[test]
    fn a_backoff_answer_backs_off() {
        let f = fixture();
        let e = (f.handler)(&job(1, "backoff", b"")).unwrap_err();
        assert_eq!(
            e.downcast_ref::<BackOff>(),
            Some(&BackOff {
                ms: 250,
                group: false
            })
        );
        let e = (f.handler)(&job(2, "backoff-group", b"")).unwrap_err();
        assert_eq!(
            e.downcast_ref::<BackOff>(),
            Some(&BackOff {
                ms: 250,
                group: true
            })
        );
    }

    /// Job 1 makes the handler break once job 2 was written ahead to it:
    /// job 1 fails, job 2 runs on a new process without losing its run.
    fn breaks_with_a_job_written_ahead(poison: &str, why: &str) {
        let f = fixture();
        let first = {
            let handler = Arc::clone(&f.handler);
            let poison = poison.to_string();
            thread::spawn(move || handler(&job(1, &poison, b"")))
        };
        let got = f.log.with_extension("got");
        assert!(
            wait_for(Duration::from_secs(10), || got.exists()),
            "the handler never read job 1"
        );
        let second = {
            let handler = Arc::clone(&f.handler);
            thread::spawn(move || handler(&job(2, "after", b"")))
        };
        let e = first.join().expect("thread").unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
        second
            .join()
            .expect("thread")
            .expect("job 2 ran again and acked");
        let seen = logged(&f.log);
        let after: Vec<u32> = (seen.iter())
            .filter(|(_, k)| k == "after")
            .map(|(p, _)| *p)
            .collect();
        let broken = seen[0].0;
        assert_eq!(seen[0].1, poison);
        // Read by the broken process, then again by its replacement.
        assert_eq!(after.len(), 2, "{seen:?}");
        assert_eq!(after[0], broken, "{seen:?}");
        assert_ne!(after[1], broken, "{seen:?}");
        assert!(!alive(broken), "the broken handler {broken} still runs");
    }

    #[test]
    fn a_handler_dying_mid_job_is_replaced_and_no_job_is_lost() {
        breaks_with_a_job_written_ahead("die-after-next", "exited (closed its stdout)");
    }

    #[test]
    fn a_handler_writing_garbage_is_replaced_and_no_job_is_lost() {
        breaks_with_a_job_written_ahead("garbage-after-next", "not a result line");
    }

    #[test]
    fn an_answer_for_an_unknown_receipt_is_refused() {
        let f = fixture();
        let e = (f.handler)(&job(1, "stranger", b""))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(r#"answered for receipt "shard-9:1.1", which it was not running"#),
            "{e}"
        );
        let broken = pids(&f.log)[0];
        assert!(!alive(broken), "the handler {broken} was left running");
        (f.handler)(&job(2, "next", b"")).expect("a new handler runs the next job");
        assert_eq!(pids(&f.log).len(), 2, "{:?}", logged(&f.log));
    }

    #[test]
    fn a_second_answer_for_a_job_is_refused() {
        let f = fixture();
        (f.handler)(&job(1, "twice", b"")).expect("the first answer counts");
        let first = pids(&f.log)[0];
        assert!(
            wait_for(Duration::from_secs(10), || !alive(first)),
            "the handler {first} answered twice and kept running"
        );
        (f.handler)(&job(2, "next", b"")).expect("a new handler runs the next job");
        let p = pids(&f.log);
        assert_eq!(p.len(), 2, "{:?}", logged(&f.log));
        assert_eq!(p[0], first);
        assert_ne!(p[1], first);
    }

    #[test]
    fn no_handler_outlives_the_worker_that_started_it() {
        let f = fixture();
        (f.handler)(&job(1, "a", b"")).expect("ok");
        let pid = pids(&f.log)[0];
        assert!(alive(pid), "a long-lived handler stays between jobs");
        drop(f.handler);
        assert!(!alive(pid), "the handler {pid} outlived its worker");
    }

    #[test]
    fn the_job_line_is_the_claim_object() {
        let j = job(17, "tenant-a", "héllo".as_bytes());
        let line = serde_json::to_value(StdioJob::of(&j)).expect("json");
        assert_eq!(
            line,
            serde_json::json!({
                "id": "shard-0:17",
                "shard": "shard-0",
                "key": "tenant-a",
                "payload": "héllo",
                "attempt": 2,
                "receipt": "shard-0:17.7",
                "fence": 7,
                "lease_expires_ms": 31_000,
                "dedup_id": "schedule:nightly@1800000000000",
                "schedule": {"id": "nightly", "tick_ms": 1_800_000_000_000u64, "triggered": false},
            })
        );
        // Bytes that are not UTF-8 go in base64.
        let j = job(18, "tenant-a", &[0xff, 0x00, 0x41]);
        let line = serde_json::to_value(StdioJob::of(&j)).expect("json");
        assert_eq!(line["payload_b64"], "/wBB");
        assert!(line.get("payload").is_none());
    }
}
