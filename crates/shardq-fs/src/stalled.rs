//! A process stopped while it holds one of the data dir's short locks.
//!
//! The append lock, the membership lock, the map and settings locks and a
//! flow group's lock are each held for one read-modify-write. A holder that
//! is *stopped* (SIGSTOP, Ctrl-Z: state `T`) keeps its flock for as long as
//! it stays stopped, and every other process would be refused that shard
//! (or that change) the whole time. The engine already survives a holder
//! that dies anywhere inside its critical section (the kernel drops the
//! flock and the next holder repairs a torn tail), so a waiter that has
//! waited its full bound and finds the holder stopped kills it (SIGKILL)
//! and goes on as after a crash: fencing by making the stalled holder dead.
//!
//! Only a holder that is stopped is killed: a slow one (running, sleeping,
//! in the disk: `R`, `S`, `D`), one stopped by a debugger (`t`), this
//! process itself, and one this user may not signal are left alone, and the
//! caller reports the lock busy, naming the holder. The holder is found in
//! `/proc/locks` by the lock file's inode, checked to have that file open,
//! and signalled through a pidfd, so a reused pid is never hit.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::OnceLock;

use rustix::fs::{fstat, stat};
use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};

/// Who holds a lock that a waiter could not take within its bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// Not found in `/proc/locks` (it let go meanwhile, or it lives in a
    /// pid namespace this process cannot see).
    Unknown,
    /// This process, through another open file of the lock.
    Own,
    /// Holds it and is not stopped: `state` as `/proc/PID/stat` gives it.
    Busy { pid: i32, state: char },
    /// Stopped, but signalling it failed (another user's process).
    Unkillable { pid: i32, error: String },
    /// Was stopped and has been killed.
    Killed { pid: i32 },
}

impl Holder {
    /// Whether the lock should come free soon: the holder was killed, is
    /// exiting (a zombie), or is no longer seen (another waiter killed it,
    /// or it let go meanwhile).
    pub fn going(&self) -> bool {
        matches!(
            self,
            Holder::Killed { .. }
                | Holder::Unknown
                | Holder::Busy {
                    state: 'Z' | 'X',
                    ..
                }
        )
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Unknown => write!(f, "its holder is not visible in /proc/locks"),
            Holder::Own => write!(f, "held by this process itself"),
            Holder::Busy { pid, state } => {
                write!(
                    f,
                    "held by process {pid} (state {state}: not stopped, so left alone)"
                )
            }
            Holder::Unkillable { pid, error } => {
                write!(
                    f,
                    "held by process {pid}, stopped, which could not be killed: {error}"
                )
            }
            Holder::Killed { pid } => {
                write!(f, "held by process {pid}, stopped, which was killed")
            }
        }
    }
}

/// Where a kill is told (the binary prints it as a warning); unset, it is
/// told nowhere.
static NOTICE: OnceLock<fn(&str)> = OnceLock::new();

/// Sets where a kill of a stopped holder is told, once per process.
pub fn on_kill(notice: fn(&str)) {
    let _ = NOTICE.set(notice);
}

/// Finds who holds `f`'s exclusive flock (`f` names the lock file, at
/// `what` for messages) and, if that process is stopped, kills it.
pub fn kill_if_stopped(f: &File, what: &str) -> Holder {
    let Some(pid) = flock_holder(f) else {
        return Holder::Unknown;
    };
    if pid == std::process::id() as i32 {
        return Holder::Own;
    }
    let Some(raw) = Pid::from_raw(pid) else {
        return Holder::Unknown;
    };
    // The pidfd pins the process seen now: if it exits and its pid is
    // reused before the signal, the signal fails instead of hitting the
    // newcomer. What is read below, while it lives, is its own.
    let pidfd = match pidfd_open(raw, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(_) => return Holder::Unknown,
    };
    let Some(state) = process_state(pid) else {
        return Holder::Unknown;
    };
    if !has_open(pid, f) {
        return Holder::Unknown;
    }
    if state != 'T' {
        return Holder::Busy { pid, state };
    }
    match pidfd_send_signal(pidfd.as_fd(), Signal::KILL) {
        Ok(()) => {
            if let Some(notice) = NOTICE.get() {
                notice(&format!(
                    "killed process {pid}: it was stopped (SIGSTOP) while holding {what}, \
                     which every other process of this data dir was waiting for"
                ));
            }
            Holder::Killed { pid }
        }
        Err(e) => Holder::Unkillable {
            pid,
            error: io::Error::from(e).to_string(),
        },
    }
}

/// The pid `/proc/locks` names as holding a granted exclusive FLOCK on
/// `f`'s inode.
fn flock_holder(f: &File) -> Option<i32> {
    let st = fstat(f).ok()?;
    let ino = st.st_ino as u64;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END"; a waiter's
        // line has "->" after the number and is skipped.
        if fields.len() < 6 || fields[1] != "FLOCK" || fields[3] != "WRITE" {
            return None;
        }
        let pid: i32 = fields[4].parse().ok()?;
        let inode: u64 = fields[5].rsplit(':').next()?.parse().ok()?;
        (inode == ino && pid > 0).then_some(pid)
    })
}

/// The state letter of `/proc/PID/stat` (after the parenthesised name,
/// which may itself hold spaces and parentheses).
fn process_state(pid: i32) -> Option<char> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.trim_start().chars().next()
}

/// Whether `pid` has the file `f` is open on (same device and inode) among
/// its descriptors: the lock line's pid is the process that took the lock,
/// and this checks it still holds the file.
fn has_open(pid: i32, f: &File) -> bool {
    let Ok(mine) = fstat(f) else {
        return false;
    };
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    entries.flatten().any(|e| {
        stat(e.path())
            .map(|s| s.st_dev == mine.st_dev && s.st_ino == mine.st_ino)
            .unwrap_or(false)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::process::{Child, Command, Stdio};

    /// A child that takes `path`'s flock itself, says so, then stops
    /// itself (`stop`) or sleeps.
    fn holder(path: &std::path::Path, stop: bool) -> Child {
        let script = "import fcntl, os, signal, sys, time\n\
                      f = open(sys.argv[1], 'a')\n\
                      fcntl.flock(f, fcntl.LOCK_EX)\n\
                      print('held', flush=True)\n\
                      if sys.argv[2] == 'stop':\n    os.kill(os.getpid(), signal.SIGSTOP)\n\
                      time.sleep(600)\n";
        let mut child = Command::new("python3")
            .args(["-c", script])
            .arg(path)
            .arg(if stop { "stop" } else { "sleep" })
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "held");
        child
    }

    /// Waits until `pid` is in state `T`.
    fn wait_stopped(pid: u32) {
        for _ in 0..500 {
            if process_state(pid as i32) == Some('T') {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("process {pid} never stopped");
    }

    fn try_lock(f: &File) -> bool {
        rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok()
    }

    #[test]
    fn a_stopped_holder_is_killed_and_the_lock_comes_free() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".append.lock");
        let mut child = holder(&path, true);
        wait_stopped(child.id());
        let f = File::options().append(true).open(&path).unwrap();
        assert!(!try_lock(&f), "the stopped child holds the lock");
        assert_eq!(
            kill_if_stopped(&f, "the lock"),
            Holder::Killed {
                pid: child.id() as i32
            }
        );
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9), "{status:?}");
        assert!(try_lock(&f), "the lock is free once its holder is dead");
    }

    #[test]
    fn a_holder_that_is_only_slow_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".append.lock");
        let mut child = holder(&path, false);
        let f = File::options().append(true).open(&path).unwrap();
        let seen = kill_if_stopped(&f, "the lock");
        assert!(
            matches!(seen, Holder::Busy { pid, state: 'S' } if pid == child.id() as i32),
            "{seen:?}"
        );
        assert!(child.try_wait().unwrap().is_none(), "it still runs");
        assert!(!try_lock(&f));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn nobody_holding_is_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::create(dir.path().join("l")).unwrap();
        assert_eq!(kill_if_stopped(&f, "l"), Holder::Unknown);
    }
}
