//! `shardq work --stdio -- CMD`: long-lived handler processes, one per
//! concurrency slot, fed one job per line instead of one process per job.
//!
//! The protocol (docs/stdio-protocol.md): shardq writes one JSON object per
//! job on the handler's stdin, the job object of the server's `/v1/claim`
//! (`id`, `shard`, `key`, `payload` when the payload is UTF-8 or else
//! `payload_b64`, `attempt`, `receipt`, `fence`, `lease_expires_ms`), and
//! reads one result line per job from its stdout:
//! `{"receipt":"...","ok":true}` or `{"receipt":"...","ok":false,"reason":"..."}`.
//! Up to `--stdio-pipeline` jobs are written ahead to each process (of
//! different keys: the pool never runs two jobs of a key at once), so the
//! round trip through the pipes does not idle the handler; it still reads
//! and answers them one by one. Answers are matched by receipt.
//!
//! Each handler gets its own process group and, on Linux, a parent-death
//! SIGKILL, like a per-job handler. A handler that dies, answers for a
//! receipt it was not given, writes a line that is not a result, or holds a
//! run the pool cancelled (job timeout, lost shard, drain timeout) is killed
//! (its whole group) and reaped; every job it held fails, and its slot
//! starts a new process for the next job. This module never leaves a
//! handler running once the worker is done with it, and knows nothing of
//! queues beyond the job it is given.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use shardq_core::ClaimedJob;

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
}

impl<'a> StdioJob<'a> {
    /// The line for `job`.
    pub fn of(job: &'a ClaimedJob) -> StdioJob<'a> {
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
}

/// What a waiting run gets back: the handler's answer, or why there is none.
type Answer = Result<StdioResult, String>;

/// A running handler process and the runs waiting for its answers.
struct Proc {
    child: Child,
    pgid: libc::pid_t,
    stdin: ChildStdin,
    program: String,
    /// Receipt -> where its answer goes; shared with the reader thread.
    waiting: Arc<Mutex<HashMap<String, mpsc::Sender<Answer>>>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the group this process created; its leader is
        // not reaped yet, so the id cannot have been reused.
        unsafe {
            libc::kill(-self.pgid, libc::SIGKILL);
        }
        let _ = self.child.wait();
        fail_all(&self.waiting, "the handler was stopped");
    }
}

fn fail_all(waiting: &Mutex<HashMap<String, mpsc::Sender<Answer>>>, why: &str) {
    let all: Vec<_> = lock(waiting).drain().collect();
    for (_, tx) in all {
        let _ = tx.send(Err(why.to_string()));
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
    let pgid = child.id() as libc::pid_t;
    let stdin = child.stdin.take().ok_or("the handler has no stdin pipe")?;
    let stdout = child
        .stdout
        .take()
        .ok_or("the handler has no stdout pipe")?;
    let waiting: Arc<Mutex<HashMap<String, mpsc::Sender<Answer>>>> = Arc::default();
    let reader_waiting = Arc::clone(&waiting);
    let name = program.clone();
    thread::Builder::new()
        .name("shardq-stdio-reader".into())
        .spawn(move || read_answers(stdout, &reader_waiting, &name))
        .map_err(|e| format!("starting the reader of handler {program:?}: {e}"))?;
    Ok(Proc {
        child,
        pgid,
        stdin,
        program: program.clone(),
        waiting,
    })
}

/// Hands each result line to the run it names; on a broken protocol or the
/// end of the handler's stdout every waiting run gets the reason.
fn read_answers(
    stdout: std::process::ChildStdout,
    waiting: &Mutex<HashMap<String, mpsc::Sender<Answer>>>,
    program: &str,
) {
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
        let Some(tx) = lock(waiting).remove(&r.receipt) else {
            break format!(
                "handler {program:?} answered for receipt {:?}, which it was not running",
                r.receipt
            );
        };
        let _ = tx.send(Ok(r));
    };
    fail_all(waiting, &why);
}

/// The handler processes of `work --stdio` and the jobs they run.
struct Procs {
    cmd: Vec<String>,
    slots: Vec<Mutex<Option<Proc>>>,
}

impl Procs {
    /// Runs `job` on handler process `slot` (starting one if needed). A
    /// handler that fails the protocol, dies, or holds a cancelled run is
    /// killed and reaped; the slot's next job starts a new one.
    fn run(&self, slot: usize, job: &ClaimedJob) -> Result<(), String> {
        let run = shardq_core::current_run();
        let line = serde_json::to_string(&StdioJob::of(job))
            .map_err(|e| format!("encoding job {}: {e}", job.id))?;
        let receipt = format!("{}:{}", job.shard, job.receipt());
        let (tx, rx) = mpsc::channel();
        {
            let mut cell = lock(&self.slots[slot]);
            if cell.is_none() {
                *cell = Some(start(&self.cmd, slot)?);
            }
            let p = cell.as_mut().expect("started above");
            lock(&p.waiting).insert(receipt.clone(), tx);
            let written = p
                .stdin
                .write_all(line.as_bytes())
                .and_then(|()| p.stdin.write_all(b"\n"))
                .and_then(|()| p.stdin.flush());
            if let Err(e) = written {
                let why = format!("writing job {receipt} to handler {:?}: {e}", p.program);
                *cell = None;
                return Err(why);
            }
        }
        loop {
            if let Some(r) = run.as_ref().filter(|r| r.is_cancelled()) {
                let why = format!("killed: {}", r.cancel_reason());
                let mut cell = lock(&self.slots[slot]);
                // Only if the answer is still outstanding: the handler may be
                // stuck on it.
                if cell
                    .as_ref()
                    .is_some_and(|p| lock(&p.waiting).contains_key(&receipt))
                {
                    *cell = None;
                }
                return Err(why);
            }
            match rx.recv_timeout(Duration::from_millis(POLL_MS)) {
                Ok(Ok(r)) if r.ok => return Ok(()),
                Ok(Ok(r)) => {
                    return Err(r
                        .reason
                        .unwrap_or_else(|| "handler reported failure".into()))
                }
                Ok(Err(why)) => {
                    // The protocol broke or the handler died: replace it.
                    let mut cell = lock(&self.slots[slot]);
                    if cell.as_ref().is_some_and(|p| lock(&p.waiting).is_empty()) {
                        *cell = None;
                    }
                    return Err(why);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err("the handler's answer was lost".to_string())
                }
            }
        }
    }
}

thread_local! {
    /// Which handler process this worker thread writes to.
    static SLOT_OF_THREAD: RefCell<Option<usize>> = const { RefCell::new(None) };
}

/// The handler of `work --stdio`: CMD runs as `procs` long-lived processes;
/// each pool worker thread writes to one of them, so with `pipeline` threads
/// per process a handler has up to that many jobs written ahead (it still
/// reads and answers them one by one, in order).
pub fn stdio_handler(cmd: Vec<String>, procs: usize) -> Arc<shardq_core::Handler> {
    let procs = Arc::new(Procs {
        cmd,
        slots: (0..procs.max(1)).map(|_| Mutex::new(None)).collect(),
    });
    let next = Arc::new(AtomicUsize::new(0));
    Arc::new(move |job: &ClaimedJob| {
        let n = procs.slots.len();
        let slot = SLOT_OF_THREAD.with(|s| {
            *s.borrow_mut()
                .get_or_insert_with(|| next.fetch_add(1, Ordering::SeqCst) % n)
        });
        procs.run(slot, job)
    })
}
