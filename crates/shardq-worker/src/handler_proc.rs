//! Runs one job's handler command as a child process that cannot outlive
//! the attempt that started it.
//!
//! Every handler gets its own process group, and on Linux a parent-death
//! signal (SIGKILL when the thread that spawned it dies, so a SIGKILLed
//! worker takes its handlers along). [`run_job_command`] polls the child and
//! kills the whole group with SIGKILL when the worker asks it to stop or the
//! job timeout passes; when the handler exits by itself, whatever it left
//! running in its group is killed too, so no process of an attempt keeps
//! working while the key's next job runs elsewhere.
//!
//! The payload goes to the handler's stdin from a separate thread, so a
//! handler that reads slowly (or not at all) never blocks the poll loop. A
//! failed payload write fails the attempt, except a broken pipe: the handler
//! closed its stdin itself. The handler learns the payload length from
//! `SHARDQ_PAYLOAD_BYTES` and can check it read all of it.
//!
//! The handler's stderr passes through the worker's own stderr, and its last
//! bytes ([`STDERR_TAIL_BYTES`]) are kept: a failed attempt's reason ends
//! with them, so a dead letter says what the handler said, not only its
//! exit status.
//!
//! A handler may leave a result: the file `SHARDQ_RESULT_FILE` names,
//! written before it exits 0, is read ([`ResultFile::take`], at most
//! [`shardq_core::job::RESULT_BYTES_MAX`]) and given to the pool
//! ([`shardq_core::pool::set_result`]), which keeps it with the finished
//! job; the file is removed whatever the outcome. The files live in a
//! directory of this process only its user can read.
//!
//! This module must never return while a child it started is unreaped, and
//! must never signal a process group other than the one it created (the
//! group is killed only while its leader is a zombie or alive, so its id
//! cannot have been reused). It knows nothing of queues, leases or retries:
//! the caller decides what a failed attempt means.

use std::io::{self, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use shardq_core::{BackOff, ClaimedJob, Handler, HandlerError};

/// How often a running handler is checked (exit, stop, timeout).
pub const POLL_MS: u64 = 5;
/// After the handler's group is killed, longest wait for its other members
/// to be gone (the leader itself is always waited for).
pub const GROUP_EXIT_WAIT_MS: u64 = 1_000;
/// After the handler exited, longest wait for the payload writer to report.
/// It can only still be blocked if a process outside the handler's group
/// holds the pipe open without reading.
pub const PAYLOAD_WRITE_WAIT_MS: u64 = 1_000;
/// Bytes of the end of a handler's stderr kept for a failed attempt's
/// reason (which core cuts at `FAIL_REASON_BYTES_MAX` in all).
pub const STDERR_TAIL_BYTES: usize = 768;
/// After the handler's group is gone, longest wait for the end of its
/// stderr (only a process outside the group can still hold it open).
pub const STDERR_DRAIN_WAIT_MS: u64 = 200;

/// A handler running `cmd` once per job (see [`run_job_command`]): killed,
/// and waited for, once the pool cancels the run (job timeout, lost shard,
/// drain timeout); the error then says why, as `killed: REASON`.
pub fn command_handler(cmd: Vec<String>) -> Arc<Handler> {
    Arc::new(move |job: &ClaimedJob| {
        let run = shardq_core::current_run();
        let cancelled = || run.as_ref().is_some_and(|r| r.is_cancelled());
        match run_job_command(&cmd, job, &cancelled, None) {
            Err(_) if cancelled() => Err(format!(
                "killed: {}",
                run.as_ref().map(|r| r.cancel_reason()).unwrap_or_default()
            )
            .into()),
            other => other,
        }
    })
}

/// The job's fence as the handler sees it in `SHARDQ_FENCE`.
fn job_fence(job: &ClaimedJob) -> Option<String> {
    Some(job.fence.to_string())
}

/// Where a job came from, for its handler's environment: its dedup id
/// (`SHARDQ_DEDUP_ID`) and, for a schedule's job, the schedule
/// (`SHARDQ_SCHEDULE`), its tick as RFC 3339 (`SHARDQ_SCHEDULE_TIME`) and
/// in ms (`SHARDQ_SCHEDULE_TIME_MS`), `SHARDQ_SCHEDULE_TRIGGERED=1` for
/// an operator's trigger, and for a released dependent its id
/// (`SHARDQ_DEPENDENT=@N`: `shardq job show @N --json` lists its
/// dependencies' outcomes and results), for a job of a batch or a
/// callback its batch (`SHARDQ_BATCH=@N`) and a callback's kind
/// (`SHARDQ_BATCH_CALLBACK`). An absent one is removed from the
/// environment the worker passes on.
pub fn job_origin_env(job: &ClaimedJob) -> [(&'static str, Option<String>); 8] {
    let (batch, callback) = shardq_core::workflow::batch_fields(job.dedup_id.as_deref());
    let tick = job
        .dedup_id
        .as_deref()
        .and_then(shardq_core::schedule::ScheduleTick::of_dedup_id);
    [
        ("SHARDQ_DEDUP_ID", job.dedup_id.clone()),
        ("SHARDQ_SCHEDULE", tick.as_ref().map(|t| t.id.clone())),
        (
            "SHARDQ_SCHEDULE_TIME",
            tick.as_ref()
                .map(|t| shardq_core::schedule::show_time(t.tick_ms)),
        ),
        (
            "SHARDQ_SCHEDULE_TIME_MS",
            tick.as_ref().map(|t| t.tick_ms.to_string()),
        ),
        (
            "SHARDQ_SCHEDULE_TRIGGERED",
            tick.as_ref().filter(|t| t.triggered).map(|_| "1".into()),
        ),
        (
            "SHARDQ_DEPENDENT",
            job.dedup_id
                .as_deref()
                .and_then(shardq_core::workflow::dependent_of_dedup_id)
                .map(|n| format!("@{n}")),
        ),
        ("SHARDQ_BATCH", batch),
        ("SHARDQ_BATCH_CALLBACK", callback.map(String::from)),
    ]
}

/// Checks, before any job is claimed, that `cmd`'s program can be run: a
/// path (with a `/`) must be an executable file; a bare name must be one on
/// `$PATH`. A handler that cannot start is the worker's error, not a job's
/// failure: the worker stops and no attempt is used.
pub fn check_command(cmd: &[String]) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let Some(program) = cmd.first() else {
        return Err("no handler command given".to_string());
    };
    let runnable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = std::path::Path::new(program);
        return match std::fs::metadata(p) {
            Err(e) => Err(format!(
                "handler command {program:?} cannot be run: {e} (from {}); no job was claimed",
                std::env::current_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            )),
            Ok(m) if !m.is_file() => Err(format!(
                "handler command {program:?} cannot be run: not a file; no job was claimed"
            )),
            Ok(_) if !runnable(p) => Err(format!(
                "handler command {program:?} cannot be run: not executable (`chmod +x {program}`); no job was claimed"
            )),
            Ok(_) => Ok(()),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| runnable(&d.join(program))) {
        return Ok(());
    }
    Err(format!(
        "handler command {program:?} cannot be run: no executable of that name on $PATH; no job was claimed"
    ))
}

/// Runs `cmd` for `job`: payload on stdin; `SHARDQ_KEY`, `SHARDQ_JOB_ID`,
/// `SHARDQ_ATTEMPT`, `SHARDQ_SHARD`, `SHARDQ_PAYLOAD_BYTES` (and
/// `SHARDQ_FENCE` when the job has one, and [`job_origin_env`]) in its
/// environment.
///
/// Ok only if the handler exited 0 and its payload was written in full (or
/// it closed its stdin early). When `should_stop()` turns true or `timeout`
/// passes, the handler's process group is killed with SIGKILL and waited
/// for, and the error says why (`killed: job timeout 500 ms`, `killed:
/// worker stopping`). Never returns with the child unreaped.
///
/// Exit [`BACKOFF_EXIT_CODE`] with a [`BACKOFF_LINE`] on stderr is a
/// back-off: the error is a [`BackOff`] (see [`backoff_asked`]).
pub fn run_job_command(
    cmd: &[String],
    job: &ClaimedJob,
    should_stop: &dyn Fn() -> bool,
    timeout: Option<Duration>,
) -> Result<(), HandlerError> {
    let Some(program) = cmd.first() else {
        return Err("no handler command given".into());
    };
    let mut command = Command::new(program);
    command
        .args(&cmd[1..])
        .env("SHARDQ_KEY", &job.key)
        .env("SHARDQ_JOB_ID", job.id.to_string())
        .env("SHARDQ_ATTEMPT", job.attempt.to_string())
        .env("SHARDQ_SHARD", &job.shard)
        .env("SHARDQ_PAYLOAD_BYTES", job.payload.len().to_string())
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    match job_fence(job) {
        Some(fence) => command.env("SHARDQ_FENCE", fence),
        None => command.env_remove("SHARDQ_FENCE"),
    };
    let result_file = ResultFile::for_run(job)?;
    command.env("SHARDQ_RESULT_FILE", &result_file.path);
    for (name, value) in job_origin_env(job) {
        match value {
            Some(v) => command.env(name, v),
            None => command.env_remove(name),
        };
    }
    die_with_parent(&mut command);
    let started = Instant::now();
    let mut child = command
        .spawn()
        .map_err(|e| format!("starting handler {program:?}: {e}"))?;
    // With process_group(0) the group id is the child's pid.
    let pgid = child.id() as libc::pid_t;
    let writer = start_payload_writer(&mut child, &job.payload);
    let stderr = start_stderr_tail(&mut child);

    let mut killed: Option<String> = None;
    loop {
        match exited_unreaped(pgid) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                killed = Some(format!("killed: cannot watch handler pid {pgid}: {e}"));
                break;
            }
        }
        if should_stop() {
            killed = Some("killed: worker stopping".to_string());
            break;
        }
        if let Some(limit) = timeout {
            if started.elapsed() >= limit {
                killed = Some(format!("killed: job timeout {} ms", limit.as_millis()));
                break;
            }
        }
        thread::sleep(Duration::from_millis(POLL_MS));
    }
    // The leader is alive or a zombie here, so `pgid` is still ours. Kill
    // the group both when stopping and after a normal exit: nothing the
    // attempt started may keep running past it.
    kill_group(pgid);
    let status = wait_child(&mut child, program)?;
    wait_group_gone(pgid);
    let written = writer.map(|rx| {
        rx.recv_timeout(Duration::from_millis(PAYLOAD_WRITE_WAIT_MS))
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the write did not finish within {PAYLOAD_WRITE_WAIT_MS} ms of the handler's exit (a process outside its group holds its stdin open)"),
                ))
            })
    });
    let said = || {
        let tail = stderr
            .as_ref()
            .map(|t| t.wait(Duration::from_millis(STDERR_DRAIN_WAIT_MS)))
            .unwrap_or_default();
        if tail.trim().is_empty() {
            String::new()
        } else {
            format!("; its stderr ended: {tail}")
        }
    };
    if let Some(reason) = killed {
        return Err(format!("{reason}{}", said()).into());
    }
    if status.code() == Some(BACKOFF_EXIT_CODE) {
        let text = stderr
            .as_ref()
            .map(|t| t.raw(Duration::from_millis(STDERR_DRAIN_WAIT_MS)))
            .unwrap_or_default();
        if let Some(b) = backoff_asked(&text)? {
            return Err(Box::new(b));
        }
    }
    if !status.success() {
        return Err(format!("handler {program:?} {}{}", describe(status), said()).into());
    }
    succeeded(written, &result_file, program, job)
}

/// A handler that exited 0: its attempt succeeds if its payload was
/// written in full (or it closed its stdin early), with the result it
/// left in its result file.
fn succeeded(
    written: Option<io::Result<()>>,
    result_file: &ResultFile,
    program: &str,
    job: &ClaimedJob,
) -> Result<(), HandlerError> {
    match written {
        None | Some(Ok(())) => {}
        // The handler closed its stdin before reading all of it: its choice.
        Some(Err(e)) if e.kind() == io::ErrorKind::BrokenPipe => {}
        Some(Err(e)) => {
            return Err(format!(
                "writing the {}-byte payload to handler {program:?}: {e}; the handler may have seen a truncated payload",
                job.payload.len()
            )
            .into())
        }
    }
    if let Some(result) = result_file.take()? {
        shardq_core::pool::set_result(result);
    }
    Ok(())
}

/// The file a command handler may write its result to
/// (`SHARDQ_RESULT_FILE`): one per run, in a directory of this process
/// that only its user can enter; removed when dropped.
pub struct ResultFile {
    /// Where the handler writes (it does not exist until it does).
    pub path: std::path::PathBuf,
}

impl ResultFile {
    /// The result file of `job`'s run (its directory made when missing).
    pub fn for_run(job: &ClaimedJob) -> Result<ResultFile, String> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = std::env::temp_dir().join(format!("shardq-results-{}", std::process::id()));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("making the result directory {}: {e}", dir.display()))?;
        let path = dir.join(format!("{}-{}-{}", job.shard, job.id.0, job.fence));
        let _ = std::fs::remove_file(&path);
        Ok(ResultFile { path })
    }

    /// The result the handler wrote, if it wrote one; a result over
    /// [`shardq_core::job::RESULT_BYTES_MAX`] is refused (read no further)
    /// with a reason that says so.
    pub fn take(&self) -> Result<Option<Vec<u8>>, String> {
        let len = match std::fs::metadata(&self.path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(format!(
                    "reading the result file {}: {e}",
                    self.path.display()
                ))
            }
        };
        let max = shardq_core::job::RESULT_BYTES_MAX;
        if len > max as u64 {
            return Err(format!(
                "the handler's result file is {len} bytes, over the {max}-byte bound on results"
            ));
        }
        std::fs::read(&self.path)
            .map(Some)
            .map_err(|e| format!("reading the result file {}: {e}", self.path.display()))
    }
}

impl Drop for ResultFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The exit status with which a handler backs off (EX_TEMPFAIL, "try again
/// later") when its stderr also says for how long: its downstream limits
/// it. The run ends without using an attempt; the wait is the last
/// `shardq-backoff: MS [group]` line of its stderr. Exit 75 without such a
/// line is an ordinary failed attempt (as any non-zero exit), so a script
/// that used 75 for its own reasons keeps using up its attempts.
pub const BACKOFF_EXIT_CODE: i32 = 75;
/// The line a backing-off handler writes to its stderr.
pub const BACKOFF_LINE: &str = "shardq-backoff:";

/// The back-off a handler's stderr asks for: its last `shardq-backoff: MS
/// [group]` line, none without one; a line that does not read is a failed
/// attempt naming it.
pub fn backoff_asked(stderr: &str) -> Result<Option<BackOff>, String> {
    let Some(line) = stderr
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix(BACKOFF_LINE))
    else {
        return Ok(None);
    };
    let mut words = line.split_whitespace();
    let bad = |why: &str| {
        format!(
            "the handler exited {BACKOFF_EXIT_CODE} (back off) with {BACKOFF_LINE}{line:?}: {why}; expected `{BACKOFF_LINE} MS` or `{BACKOFF_LINE} MS group`"
        )
    };
    let ms: u64 = (words.next())
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| bad("no whole number of ms"))?;
    shardq_core::flow::validate_backoff_ms(ms).map_err(|e| bad(&e.to_string()))?;
    let group = match words.next() {
        None | Some("key") => false,
        Some("group") => true,
        Some(_) => return Err(bad("the scope is `key` or `group`")),
    };
    Ok(Some(BackOff { ms, group }))
}

/// Sets the parent-death signal (Linux): the child gets SIGKILL when the
/// thread that spawned it dies, which a worker's handler thread does only
/// after the handler was reaped, or when the whole worker dies.
#[cfg(target_os = "linux")]
pub(crate) fn die_with_parent(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and calls only prctl
    // and getppid, both async-signal-safe; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then no signal
            // comes, so refuse to run.
            if libc::getppid() != parent {
                return Err(io::Error::other(
                    "the worker exited before the handler started",
                ));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn die_with_parent(_command: &mut Command) {}

/// Writes `payload` to the child's stdin from a new thread and closes it;
/// the receiver gets the outcome. `None` if the child has no stdin pipe.
fn start_payload_writer(
    child: &mut Child,
    payload: &[u8],
) -> Option<mpsc::Receiver<io::Result<()>>> {
    let mut stdin = child.stdin.take()?;
    let (tx, rx) = mpsc::channel();
    let payload = payload.to_vec();
    let spawned = thread::Builder::new()
        .name("shardq-payload".into())
        .spawn(move || {
            let result = stdin.write_all(&payload).and_then(|()| stdin.flush());
            drop(stdin);
            let _ = tx.send(result);
        });
    match spawned {
        Ok(_) => Some(rx),
        Err(e) => {
            // No thread: report it as the write's failure.
            let (tx, rx) = mpsc::channel();
            let _ = tx.send(Err(io::Error::other(format!(
                "starting the payload writer thread: {e}"
            ))));
            Some(rx)
        }
    }
}

/// The end of a handler's stderr, read by a thread that passes every byte
/// on to this process's stderr.
struct StderrTail {
    tail: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u8>>>,
    done: mpsc::Receiver<()>,
}

impl StderrTail {
    /// The last [`STDERR_TAIL_BYTES`] as they were written (from a character
    /// boundary), once the stream ended or `wait` passed.
    fn raw(&self, wait: Duration) -> String {
        let _ = self.done.recv_timeout(wait);
        let bytes: Vec<u8> = self
            .tail
            .lock()
            .map(|t| t.iter().copied().collect())
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        // A cut in the middle of a character shows as one replacement mark.
        text.trim_start_matches('\u{fffd}').trim_end().to_string()
    }

    /// [`StderrTail::raw`] with control characters escaped, so the reason
    /// stays one line.
    fn wait(&self, wait: Duration) -> String {
        self.raw(wait)
            .chars()
            .flat_map(|c| {
                let shown: Vec<char> = if c.is_control() {
                    c.escape_default().collect()
                } else {
                    vec![c]
                };
                shown
            })
            .collect()
    }
}

fn start_stderr_tail(child: &mut Child) -> Option<StderrTail> {
    use std::io::Read;
    let mut from = child.stderr.take()?;
    let tail = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
    let (tx, done) = mpsc::channel();
    let kept = std::sync::Arc::clone(&tail);
    thread::Builder::new()
        .name("shardq-stderr".into())
        .spawn(move || {
            let mut buf = [0u8; 4096];
            let out = io::stderr();
            loop {
                match from.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let _ = out.lock().write_all(&buf[..n]);
                        if let Ok(mut t) = kept.lock() {
                            t.extend(&buf[..n]);
                            let over = t.len().saturating_sub(STDERR_TAIL_BYTES);
                            t.drain(..over);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = tx.send(());
        })
        .ok()?;
    Some(StderrTail { tail, done })
}

/// True once `pid` has exited; leaves it unreaped (a zombie), so its pid and
/// process group id stay reserved until [`wait_child`].
fn exited_unreaped(pid: libc::pid_t) -> io::Result<bool> {
    loop {
        // SAFETY: siginfo_t is plain data; waitid writes it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid pointer to a siginfo_t; WNOWAIT leaves the child
        // waitable, WNOHANG returns at once.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            // SAFETY: waitid filled `info` (si_pid stays 0 if nothing exited).
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// SIGKILL to every process of the group `pgid` (no error if none is left).
fn kill_group(pgid: libc::pid_t) {
    // SAFETY: killpg has no memory effects; the group is ours (see the
    // module docs), ESRCH just means it is empty.
    unsafe {
        libc::killpg(pgid, libc::SIGKILL);
    }
}

/// Waits, bounded, until no process of the killed group `pgid` is left. A
/// member killed but not yet reaped by its new parent still counts, so this
/// can run to the bound where nobody reaps orphans; it never fails.
fn wait_group_gone(pgid: libc::pid_t) {
    let start = Instant::now();
    // SAFETY: signal 0 only checks for existence.
    while unsafe { libc::killpg(pgid, 0) } == 0
        && start.elapsed() < Duration::from_millis(GROUP_EXIT_WAIT_MS)
    {
        thread::sleep(Duration::from_millis(1));
    }
}

fn wait_child(child: &mut Child, program: &str) -> Result<ExitStatus, String> {
    child
        .wait()
        .map_err(|e| format!("waiting for handler {program:?} (pid {}): {e}", child.id()))
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => format!("ended with {status}"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::testing::{alive, job, python, read_pid, sh};

    fn never() -> bool {
        false
    }

    fn run(cmd: &[String], payload: &[u8], timeout: Option<Duration>) -> Result<(), HandlerError> {
        run_job_command(cmd, &job(17, "tenant-a", payload), &never, timeout)
    }

    #[test]
    fn exit_zero_acks_once_the_payload_was_read() {
        let reads = sh(r#"test "$(cat)" = "hello world""#, &[]);
        run(&reads, b"hello world", None).expect("exit 0 acks");
        // The same handler fails on another payload: the ack above is not
        // just any exit.
        let e = run(&reads, b"something else", None).unwrap_err();
        assert_eq!(e.to_string(), r#"handler "sh" exited with status 1"#);
        assert!(e.downcast_ref::<BackOff>().is_none());
    }

    #[test]
    fn a_failure_names_the_status_and_ends_with_the_stderr_tail() {
        // 2,000 bytes of noise, then the words that matter.
        let cmd = sh(
            r#"i=0; while [ $i -lt 200 ]; do printf 'noise-%04d' $i >&2; i=$((i+1)); done
               printf '\ndisk full\n' >&2; exit 3"#,
            &[],
        );
        let e = run(&cmd, b"", None).unwrap_err().to_string();
        assert!(
            e.starts_with(r#"handler "sh" exited with status 3; its stderr ended: "#),
            "{e}"
        );
        // The tail's newline is escaped: the reason stays one line.
        assert!(e.ends_with(r"noise-0199\ndisk full"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        // Only the end is kept.
        assert!(!e.contains("noise-0000"), "{e}");
        assert!(e.len() < STDERR_TAIL_BYTES + 100, "{} bytes: {e}", e.len());
    }

    #[test]
    fn a_handler_killed_by_a_signal_says_so() {
        let e = run(&sh("kill -9 $$", &[]), b"", None).unwrap_err();
        assert_eq!(e.to_string(), r#"handler "sh" was killed by signal 9"#);
    }

    #[test]
    fn the_handler_sees_the_job_in_its_environment_and_on_stdin() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("seen.json");
        let cmd = python(
            r#"
import json, os, sys
payload = sys.stdin.buffer.read()
names = ["SHARDQ_KEY", "SHARDQ_JOB_ID", "SHARDQ_ATTEMPT", "SHARDQ_SHARD",
         "SHARDQ_PAYLOAD_BYTES", "SHARDQ_FENCE", "SHARDQ_DEDUP_ID", "SHARDQ_SCHEDULE",
         "SHARDQ_SCHEDULE_TIME", "SHARDQ_SCHEDULE_TIME_MS", "SHARDQ_SCHEDULE_TRIGGERED"]
seen = {n: os.environ.get(n) for n in names}
seen["payload"] = payload.decode()
seen["pgid_is_pid"] = os.getpgid(0) == os.getpid()
open(sys.argv[1], "w").write(json.dumps(seen))
"#,
            &[out.to_str().expect("utf-8 path")],
        );
        run(&cmd, "héllo".as_bytes(), None).expect("ok");
        let seen: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).expect("written")).expect("json");
        assert_eq!(seen["SHARDQ_KEY"], "tenant-a");
        assert_eq!(seen["SHARDQ_JOB_ID"], "17");
        assert_eq!(seen["SHARDQ_ATTEMPT"], "2");
        assert_eq!(seen["SHARDQ_SHARD"], "shard-0");
        // Bytes, not characters.
        assert_eq!(seen["SHARDQ_PAYLOAD_BYTES"], "6");
        assert_eq!(seen["SHARDQ_FENCE"], "7");
        // A schedule's job names its schedule and tick.
        assert_eq!(seen["SHARDQ_DEDUP_ID"], "schedule:nightly@1800000000000");
        assert_eq!(seen["SHARDQ_SCHEDULE"], "nightly");
        assert_eq!(seen["SHARDQ_SCHEDULE_TIME"], "2027-01-15T08:00:00.000Z");
        assert_eq!(seen["SHARDQ_SCHEDULE_TIME_MS"], "1800000000000");
        assert_eq!(seen["SHARDQ_SCHEDULE_TRIGGERED"], serde_json::Value::Null);
        assert_eq!(seen["payload"], "héllo");
        // The handler leads a process group of its own.
        assert_eq!(seen["pgid_is_pid"], true);
    }

    #[test]
    fn past_its_timeout_the_whole_process_group_is_killed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("grandchild.pid");
        let cmd = sh(
            r#"sleep 30 & echo $! > "$1"; wait"#,
            &[pid_file.to_str().expect("utf-8 path")],
        );
        let started = Instant::now();
        let e = run(&cmd, b"", Some(Duration::from_millis(300))).unwrap_err();
        let took = started.elapsed();
        assert!(
            e.to_string().starts_with("killed: job timeout 300 ms"),
            "{e}"
        );
        assert!(took >= Duration::from_millis(300), "{took:?}");
        assert!(took < Duration::from_secs(10), "{took:?}");
        let grandchild = read_pid(&pid_file);
        assert!(
            !alive(grandchild),
            "the grandchild sleep {grandchild} survived"
        );
    }

    #[test]
    fn what_a_handler_leaves_running_dies_with_its_attempt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("left.pid");
        let cmd = sh(
            r#"sleep 30 >/dev/null 2>&1 & echo $! > "$1"; exit 0"#,
            &[pid_file.to_str().expect("utf-8 path")],
        );
        run(&cmd, b"", None).expect("exit 0 acks");
        let left = read_pid(&pid_file);
        assert!(!alive(left), "the background sleep {left} survived");
    }

    #[test]
    fn a_stopping_worker_kills_its_handler() {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::SeqCst);
        });
        let started = Instant::now();
        let should_stop = || stop.load(Ordering::SeqCst);
        let e = run_job_command(&sh("sleep 30", &[]), &job(1, "k", b""), &should_stop, None)
            .unwrap_err();
        setter.join().expect("setter");
        assert_eq!(e.to_string(), "killed: worker stopping");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_handler_that_closes_its_stdin_early_still_acks() {
        // A payload larger than any pipe buffer, never read.
        let payload = vec![b'x'; 4 << 20];
        run(&sh("exec 0<&-; exit 0", &[]), &payload, None).expect("its choice");
    }

    #[test]
    fn exit_75_with_a_backoff_line_backs_off() {
        let e = run(
            &sh("echo 'shardq-backoff: 250' >&2; exit 75", &[]),
            b"",
            None,
        )
        .unwrap_err();
        assert_eq!(
            e.downcast_ref::<BackOff>(),
            Some(&BackOff {
                ms: 250,
                group: false
            })
        );
        let e = run(
            &sh(
                "echo 'shardq-backoff: 100' >&2; echo 'shardq-backoff: 1500 group' >&2; exit 75",
                &[],
            ),
            b"",
            None,
        )
        .unwrap_err();
        // The last line counts.
        assert_eq!(
            e.downcast_ref::<BackOff>(),
            Some(&BackOff {
                ms: 1500,
                group: true
            })
        );
    }

    #[test]
    fn exit_75_without_a_backoff_line_is_a_failed_attempt() {
        let e = run(&sh("echo 'busy' >&2; exit 75", &[]), b"", None).unwrap_err();
        assert!(e.downcast_ref::<BackOff>().is_none());
        assert_eq!(
            e.to_string(),
            r#"handler "sh" exited with status 75; its stderr ended: busy"#
        );
        // The line with another status is no back-off either.
        let e = run(
            &sh("echo 'shardq-backoff: 250' >&2; exit 1", &[]),
            b"",
            None,
        )
        .unwrap_err();
        assert!(e.downcast_ref::<BackOff>().is_none());
        assert!(e.to_string().contains("exited with status 1"), "{e}");
        run(
            &sh("echo 'shardq-backoff: 250' >&2; exit 0", &[]),
            b"",
            None,
        )
        .expect("exit 0 acks whatever stderr says");
    }

    #[test]
    fn a_backoff_line_that_does_not_read_fails_the_attempt_naming_it() {
        let e = run(
            &sh("echo 'shardq-backoff: soon' >&2; exit 75", &[]),
            b"",
            None,
        )
        .unwrap_err();
        assert!(e.downcast_ref::<BackOff>().is_none());
        assert!(e.to_string().contains("no whole number of ms"), "{e}");
        let e = backoff_asked("shardq-backoff: 10 everyone").unwrap_err();
        assert!(e.contains("the scope is `key` or `group`"), "{e}");
        let over = shardq_core::flow::BACKOFF_MS_MAX + 1;
        let e = backoff_asked(&format!("shardq-backoff: {over}")).unwrap_err();
        assert!(e.contains(&over.to_string()), "{e}");
        assert_eq!(
            backoff_asked("noise\n  shardq-backoff: 40 key  \nmore noise"),
            Ok(Some(BackOff {
                ms: 40,
                group: false
            }))
        );
        assert_eq!(backoff_asked("nothing to see"), Ok(None));
    }

    #[test]
    fn a_command_that_cannot_run_is_refused_before_any_job() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain.sh");
        std::fs::write(&plain, "#!/bin/sh\nexit 0\n").expect("write");
        let plain = plain.to_str().expect("utf-8 path").to_string();
        let e = check_command(std::slice::from_ref(&plain)).unwrap_err();
        assert!(e.contains("not executable") && e.contains(&plain), "{e}");
        let missing = format!("{}/missing.sh", dir.path().display());
        let e = check_command(&[missing]).unwrap_err();
        assert!(
            e.contains("cannot be run") && e.contains("no job was claimed"),
            "{e}"
        );
        let e = check_command(&[dir.path().display().to_string()]).unwrap_err();
        assert!(e.contains("not a file"), "{e}");
        let e = check_command(&["shardq-no-such-program".to_string()]).unwrap_err();
        assert!(e.contains("no executable of that name on $PATH"), "{e}");
        assert_eq!(check_command(&[]).unwrap_err(), "no handler command given");
        check_command(&["sh".to_string()]).expect("sh is on $PATH");
    }

    #[test]
    fn the_command_handler_runs_a_job_outside_a_pool() {
        let handler = command_handler(sh(r#"[ "$SHARDQ_KEY" = tenant-a ]"#, &[]));
        handler(&job(1, "tenant-a", b"")).expect("ok");
        assert!(handler(&job(2, "tenant-b", b"")).is_err());
    }
}
