//! `shardq work --stdio -- CMD`: one long-lived handler process per worker
//! slot, fed one job per line instead of one process per job.
//!
//! The protocol (documented in docs/stdio-protocol.md): shardq writes one
//! JSON object per job on the handler's stdin, the job object of the
//! server's `/v1/claim` (`id`, `shard`, `key`, `payload` when the payload is
//! UTF-8 or else `payload_b64`, `attempt`, `receipt`, `fence`,
//! `lease_expires_ms`), and reads one result line per job from its stdout:
//! `{"receipt":"...","ok":true}` or `{"receipt":"...","ok":false,"reason":"..."}`.
//! A slot sends its next job only after the result of the last one.
//!
//! Each handler gets its own process group and, on Linux, a parent-death
//! SIGKILL, like a per-job handler. A handler that dies, answers for another
//! receipt, writes a line that is not a result, or runs past the pool's
//! cancellation (job timeout, lost shard, drain timeout) fails its job and is
//! killed (its whole group) and reaped; the slot starts a new one for its
//! next job. This module never lets a handler outlive the worker thread
//! that owns it, and knows nothing of queues beyond the job it is given.

use std::cell::RefCell;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use shardq_core::ClaimedJob;

/// Longest result line read from a handler (1 MiB); a longer one is a
/// protocol error.
pub const RESULT_LINE_BYTES_MAX: u64 = 1 << 20;
/// How often a slot waiting for a result checks for cancellation.
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

/// A running handler process of one slot.
struct Slot {
    child: Child,
    pgid: libc::pid_t,
    stdin: ChildStdin,
    lines: mpsc::Receiver<io::Result<String>>,
    program: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the group this slot created; its leader is not
        // reaped yet, so the id cannot have been reused.
        unsafe {
            libc::kill(-self.pgid, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

thread_local! {
    /// The handler process of the worker thread running this slot.
    static SLOT: RefCell<Option<Slot>> = const { RefCell::new(None) };
}

fn start(cmd: &[String]) -> Result<Slot, String> {
    let Some(program) = cmd.first() else {
        return Err("no handler command given".to_string());
    };
    let mut command = Command::new(program);
    command
        .args(&cmd[1..])
        .env("SHARDQ_STDIO", "1")
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
    let (tx, lines) = mpsc::channel();
    thread::Builder::new()
        .name("shardq-stdio-reader".into())
        .spawn(move || {
            let mut reader = BufReader::new(stdout);
            loop {
                let mut line = String::new();
                let read = (&mut reader)
                    .take(RESULT_LINE_BYTES_MAX + 1)
                    .read_line(&mut line);
                let end = matches!(read, Ok(0) | Err(_));
                let too_long = line.len() as u64 > RESULT_LINE_BYTES_MAX;
                let msg = match read {
                    Ok(0) => Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the handler closed its stdout",
                    )),
                    Ok(_) if too_long => Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a result line over {RESULT_LINE_BYTES_MAX} bytes"),
                    )),
                    Ok(_) => Ok(line),
                    Err(e) => Err(e),
                };
                if tx.send(msg).is_err() || end || too_long {
                    return;
                }
            }
        })
        .map_err(|e| format!("starting the reader of handler {program:?}: {e}"))?;
    Ok(Slot {
        child,
        pgid,
        stdin,
        lines,
        program: program.clone(),
    })
}

/// Runs `job` on this slot's handler (starting one if needed). On any
/// failure but a clean `ok:false` the handler is killed and reaped, and the
/// next job starts a new one.
fn run_on_slot(cmd: &[String], job: &ClaimedJob) -> Result<(), String> {
    let run = shardq_core::current_run();
    let cancelled = || run.as_ref().is_some_and(|r| r.is_cancelled());
    let line = serde_json::to_string(&StdioJob::of(job))
        .map_err(|e| format!("encoding job {}: {e}", job.id))?;
    let want = format!("{}:{}", job.shard, job.receipt());
    SLOT.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(start(cmd)?);
        }
        let s = slot.as_mut().expect("started above");
        let outcome = (|| {
            s.stdin
                .write_all(line.as_bytes())
                .and_then(|()| s.stdin.write_all(b"\n"))
                .and_then(|()| s.stdin.flush())
                .map_err(|e| format!("writing job {want} to handler {:?}: {e}", s.program))?;
            loop {
                if cancelled() {
                    let why = run.as_ref().map(|r| r.cancel_reason()).unwrap_or_default();
                    return Err(format!("killed: {why}"));
                }
                match s.lines.recv_timeout(Duration::from_millis(POLL_MS)) {
                    Ok(Ok(text)) => {
                        let r: StdioResult = serde_json::from_str(text.trim()).map_err(|e| {
                            format!(
                                "handler {:?} wrote {:?}, not a result line ({e})",
                                s.program,
                                shardq_core::job::cut_at_char(text.trim(), 200)
                            )
                        })?;
                        if r.receipt != want {
                            return Err(format!(
                                "handler {:?} answered for receipt {:?} while job {want} ran",
                                s.program, r.receipt
                            ));
                        }
                        return Ok(Some(r));
                    }
                    Ok(Err(e)) => {
                        return Err(format!("handler {:?} failed: {e}", s.program));
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(format!("handler {:?} exited", s.program));
                    }
                }
            }
        })();
        match outcome {
            Ok(Some(r)) if r.ok => Ok(()),
            Ok(Some(r)) => Err(r
                .reason
                .unwrap_or_else(|| "handler reported failure".into())),
            Ok(None) => Ok(()),
            Err(e) => {
                // Kill and reap it now (Drop); the next job starts a new one.
                *slot = None;
                Err(e)
            }
        }
    })
}

/// The handler of `work --stdio`: CMD runs once per worker slot.
pub fn stdio_handler(cmd: Vec<String>) -> Arc<shardq_core::Handler> {
    let cmd = Arc::new(cmd);
    Arc::new(move |job: &ClaimedJob| run_on_slot(&cmd, job))
}
