//! Local `redis-server` child processes: one per [`LocalServer`], bound to
//! 127.0.0.1 on a free port picked here (or one the caller chose), working
//! in a new temporary directory, killed and removed when dropped.
//!
//! `shardq demo --backend redis` runs on these. By default a server keeps
//! nothing on disk (no RDB snapshots, no append-only file); more
//! `redis-server` arguments may ask otherwise. This module never touches a
//! server it did not start: a server counts as started only once the
//! process answering on its port is the child this module spawned.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// How long a server may take to answer after it was spawned.
pub const SERVER_START_TIMEOUT_MS: u64 = 10_000;
/// Lowest port [`free_port`] tries. With [`PORT_SPAN`] the range stays
/// below 55535, so port + 10000 (a cluster node's bus port) is a port too.
pub const PORT_MIN: u16 = 21_000;
/// Number of ports in the range [`free_port`] tries.
pub const PORT_SPAN: u16 = 20_000;
/// Ports [`free_port`] tries before giving up.
pub const PORT_TRIES_MAX: u32 = 200;
const POLL_MS: u64 = 20;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The error when the binary is missing.
pub const MISSING: &str = "redis-server was not found on PATH: install the Debian package \
`redis-server` (apt-get install -y redis-server)";

/// How to run one server.
#[derive(Debug, Clone, Default)]
pub struct LocalOptions {
    /// This port instead of a free one picked here (the caller checked it
    /// is free: `shardq demo --redis-ports`).
    pub port: Option<u16>,
    /// More `redis-server` arguments, passed after this module's own (for
    /// a setting given twice, the later one holds: `--appendonly yes`).
    pub args: Vec<String>,
}

/// Whether nothing listens on loopback `port` (a bind succeeds).
pub fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A loopback port nothing listens on, from the range
/// [`PORT_MIN`]..[`PORT_MIN`] + [`PORT_SPAN`]. Each call tries another
/// port first, and processes start apart from each other, so servers
/// started at once rarely race for one port (a lost race is an error of
/// [`LocalServer::start`], never someone else's server taken for ours).
pub fn free_port() -> Result<u16, String> {
    for _ in 0..PORT_TRIES_MAX {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let seed = std::process::id().wrapping_mul(7919).wrapping_add(n * 131);
        let port = PORT_MIN + (seed % PORT_SPAN as u32) as u16;
        if port_free(port) {
            return Ok(port);
        }
    }
    Err(format!(
        "no free loopback port found after {PORT_TRIES_MAX} tries"
    ))
}

/// One `redis-server` child process.
#[derive(Debug)]
pub struct LocalServer {
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl LocalServer {
    /// Starts a server with `opts` in a new temporary directory; returns
    /// once it answers. A missing binary, a port another process holds or
    /// no answer in time is an error naming the port.
    pub fn start(opts: LocalOptions) -> Result<LocalServer, String> {
        let port = match opts.port {
            Some(p) => p,
            None => free_port()?,
        };
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("shardq-redis-{}-{n}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut server = LocalServer {
            port,
            dir,
            args: opts.args,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The server's working directory (its snapshots and append-only
    /// files, when it writes any, and its log `redis.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The process id of the running server; `None` once stopped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, and the process reaped; the directory stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server if it runs and starts it again on the same port,
    /// directory and arguments (it loads whatever it kept there).
    pub fn start_again(&mut self) -> Result<(), String> {
        self.stop();
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .args(["--appendonly", "no"])
            .arg("--daemonize")
            .arg("no")
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(MISSING.into()),
            Err(e) => return Err(format!("starting redis-server: {e}")),
        };
        self.child = Some(child);
        self.wait_ready()
    }

    /// Waits until the server this started answers; a server of another
    /// process on the same port (it took the port first) is not taken for
    /// it: the answer must come from this child's process id.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_millis(SERVER_START_TIMEOUT_MS);
        let pid = self.pid();
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    let log =
                        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
                    // Reaped: nothing is left to stop.
                    self.child = None;
                    return Err(format!(
                        "redis-server on port {} exited with {status}: {err}\n{log}",
                        self.port
                    ));
                }
            }
            if let Ok(client) = redis::Client::open(self.url()) {
                if let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(200))
                {
                    // Whatever holds the port may accept and never answer.
                    let _ = con.set_read_timeout(Some(Duration::from_millis(200)));
                    let _ = con.set_write_timeout(Some(Duration::from_millis(200)));
                    if let Ok(info) = redis::cmd("INFO").arg("server").query::<String>(&mut con) {
                        let theirs = info
                            .lines()
                            .find_map(|l| l.strip_prefix("process_id:"))
                            .and_then(|v| v.trim().parse::<u32>().ok());
                        if theirs == pid {
                            return Ok(());
                        }
                    }
                }
            }
            if Instant::now() > deadline {
                // Not ours, or not answering: leave no child behind.
                self.stop();
                return Err(format!(
                    "redis-server on port {} did not answer within {SERVER_START_TIMEOUT_MS} ms (another process may hold the port)",
                    self.port
                ));
            }
            thread::sleep(Duration::from_millis(POLL_MS));
        }
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
