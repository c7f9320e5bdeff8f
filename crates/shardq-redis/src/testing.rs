//! Real `redis-server` processes for tests: standalone instances and small
//! clusters on free loopback ports, in temporary directories, killed when
//! dropped.
//!
//! Used by this crate's tests and by other crates' (the CLI's). Servers bind
//! 127.0.0.1 only and never persist unless asked (AOF for crash tests). A
//! missing `redis-server` is a test failure with a clear message, never a
//! silent pass. This module must never touch a server it did not start.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// How long a server may take to answer PING after it was spawned.
pub const SERVER_START_TIMEOUT_MS: u64 = 10_000;
/// How long a new cluster may take to agree on its slots.
pub const CLUSTER_READY_TIMEOUT_MS: u64 = 20_000;
/// Lowest port tried; the cluster bus uses port + 10000, so ports stay
/// below 55535.
pub const PORT_MIN: u16 = 21_000;
/// Number of ports in the range tried.
pub const PORT_SPAN: u16 = 20_000;
/// Ports tried before giving up.
pub const PORT_TRIES_MAX: u32 = 200;
const POLL_MS: u64 = 20;

static NEXT: AtomicU32 = AtomicU32::new(0);

const MISSING: &str = "redis-server was not found on PATH: the Redis backend tests need a real \
server; install the Debian package `redis-server` (apt-get install -y redis-server)";

/// How to run one server.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerOptions {
    /// Append-only file on, fsync on every write (`appendfsync always`).
    pub aof_always: bool,
    /// `cluster-enabled yes`.
    pub cluster: bool,
    /// More `redis-server` arguments (e.g. `--rename-command CONFIG ""`).
    pub extra_args: &'static [&'static str],
    /// This port instead of a free one picked here (the caller checked it
    /// is free: `shardq demo --redis-ports`).
    pub port: Option<u16>,
}

/// One `redis-server` child process.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    opts: ServerOptions,
    /// The primary's port, for a replica.
    primary: Option<u16>,
    child: Option<Child>,
}

/// Whether nothing listens on loopback `port` (a bind succeeds).
pub fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

fn pick_port(bus: bool) -> u16 {
    for _ in 0..PORT_TRIES_MAX {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        // Spread processes apart so parallel test binaries rarely collide.
        let seed = std::process::id().wrapping_mul(7919).wrapping_add(n * 131);
        let port = PORT_MIN + (seed % PORT_SPAN as u32) as u16;
        if port_free(port) && (!bus || port_free(port + 10_000)) {
            return port;
        }
    }
    panic!("no free loopback port found after {PORT_TRIES_MAX} tries");
}

/// Runs `redis-cli -p port args...` and returns its output.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-h")
        .arg("127.0.0.1")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running redis-cli: {e}; {MISSING}"));
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    s
}

impl RedisServer {
    /// A standalone server with no persistence.
    pub fn start() -> RedisServer {
        RedisServer::start_with(ServerOptions::default())
    }

    /// A server with `opts`, on a free port, in a new temporary directory.
    pub fn start_with(opts: ServerOptions) -> RedisServer {
        RedisServer::start_inner(opts, None)
    }

    /// A replica of this server (`--replicaof`), returned once its link to
    /// the primary is up and the initial sync is done.
    pub fn start_replica(&self) -> RedisServer {
        let replica = RedisServer::start_inner(ServerOptions::default(), Some(self.port));
        let deadline = Instant::now() + Duration::from_millis(SERVER_START_TIMEOUT_MS);
        while !replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
        {
            assert!(
                Instant::now() < deadline,
                "replica on port {} did not sync with port {} within {SERVER_START_TIMEOUT_MS} ms",
                replica.port,
                self.port
            );
            thread::sleep(Duration::from_millis(POLL_MS));
        }
        replica
    }

    /// Waits until `replicas` replicas hold every write made so far (a
    /// write of its own, then `WAIT`).
    pub fn wait_replicated(&self, replicas: u32) {
        let out = self.cli(&["set", "shardq-test:replicated", "1"]);
        assert!(out.trim() == "OK", "SET on port {}: {out}", self.port);
        let mut con = self.connection();
        let n: u64 = redis::cmd("WAIT")
            .arg(replicas)
            .arg(SERVER_START_TIMEOUT_MS)
            .query(&mut con)
            .unwrap_or_else(|e| panic!("WAIT on port {}: {e}", self.port));
        assert!(
            n >= u64::from(replicas),
            "only {n} of {replicas} replicas of port {} caught up",
            self.port
        );
    }

    /// `REPLICAOF NO ONE`: a replica becomes a primary (a failover).
    pub fn promote(&self) {
        let out = self.cli(&["replicaof", "no", "one"]);
        assert!(
            out.trim() == "OK",
            "REPLICAOF NO ONE on port {}: {out}",
            self.port
        );
    }

    fn start_inner(opts: ServerOptions, primary: Option<u16>) -> RedisServer {
        RedisServer::try_start_inner(opts, primary).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`RedisServer::start_with`], with a failure to start (no binary, a
    /// port someone else took, no answer in time) as an error naming the
    /// port instead of a panic.
    pub fn try_start_with(opts: ServerOptions) -> Result<RedisServer, String> {
        RedisServer::try_start_inner(opts, None)
    }

    fn try_start_inner(opts: ServerOptions, primary: Option<u16>) -> Result<RedisServer, String> {
        let port = opts.port.unwrap_or_else(|| pick_port(opts.cluster));
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("shardq-redis-{}-{n}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut server = RedisServer {
            port,
            dir,
            opts,
            primary,
            child: None,
        };
        server.try_spawn()?;
        Ok(server)
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .arg("--daemonize")
            .arg("no")
            .arg("--logfile")
            .arg(self.dir.join("redis.log"));
        if self.opts.aof_always {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if self.opts.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"])
                .arg("--cluster-config-file")
                .arg(self.dir.join("nodes.conf"));
        }
        if let Some(p) = self.primary {
            cmd.arg("--replicaof").arg("127.0.0.1").arg(p.to_string());
        }
        cmd.args(self.opts.extra_args);
        cmd.stdin(Stdio::null())
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

    fn spawn(&mut self) {
        self.try_spawn().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits until the server this started answers; a server of another
    /// process on the same port (it took the port first) is not taken for
    /// it: the answer must come from this child's process id.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_millis(SERVER_START_TIMEOUT_MS);
        let pid = self.child.as_ref().map(Child::id);
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
                return Err(format!(
                    "redis-server on port {} did not answer within {SERVER_START_TIMEOUT_MS} ms (another process may hold the port)",
                    self.port
                ));
            }
            thread::sleep(Duration::from_millis(POLL_MS));
        }
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The server's working directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fresh connection (for assertions).
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.url()))
    }

    /// Runs `redis-cli` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    /// SIGKILL, as a crash would; the data dir stays.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and directory (with AOF
    /// on, it reloads what it had acknowledged; without, it loads
    /// `dump.rdb` if there is one).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Kills the server and starts it again from the RDB snapshot at
    /// `snapshot` (a copy of an earlier `dump.rdb`), as a restore from an
    /// old backup would.
    pub fn restart_from_snapshot(&mut self, snapshot: &Path) {
        self.kill();
        let dump = self.dir.join("dump.rdb");
        std::fs::copy(snapshot, &dump).unwrap_or_else(|e| {
            panic!("copying {} to {}: {e}", snapshot.display(), dump.display())
        });
        self.spawn();
    }

    /// Runs `SAVE` and copies the snapshot to `name` in the server's
    /// directory; returns its path.
    pub fn snapshot(&self, name: &str) -> PathBuf {
        let out = self.cli(&["save"]);
        assert!(out.trim() == "OK", "SAVE on port {}: {out}", self.port);
        let to = self.dir.join(name);
        std::fs::copy(self.dir.join("dump.rdb"), &to)
            .unwrap_or_else(|e| panic!("copying the snapshot to {}: {e}", to.display()));
        to
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing (a hung
    /// host), until [`RedisServer::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self
            .child
            .as_ref()
            .map(|c| c.id())
            .unwrap_or_else(|| panic!("redis-server on port {} is not running", self.port));
        let status = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .unwrap_or_else(|e| panic!("kill {sig} {pid}: {e}"));
        assert!(status.success(), "kill {sig} {pid}: {status}");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused server would not die of SIGKILL any later, but resume
        // anyway so nothing waits on it.
        if self.child.is_some() {
            let _ = self.child.as_ref().map(|c| {
                Command::new("kill")
                    .arg("-CONT")
                    .arg(c.id().to_string())
                    .status()
            });
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of masters without replicas, made with
/// `redis-cli --cluster create`.
#[derive(Debug)]
pub struct RedisCluster {
    /// The masters, in creation order.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` servers (at least 3) and joins them.
    pub fn start(masters: usize) -> RedisCluster {
        assert!(masters >= 3, "redis-cli --cluster create needs 3 masters");
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| {
                RedisServer::start_with(ServerOptions {
                    cluster: true,
                    ..ServerOptions::default()
                })
            })
            .collect();
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = nodes[0].cli(&argv);
        assert!(
            out.contains("All 16384 slots covered"),
            "redis-cli --cluster create failed:\n{out}"
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_consistent();
        cluster
    }

    /// Waits until every node reports `cluster_state:ok` and agrees on who
    /// serves each slot.
    pub fn wait_consistent(&self) {
        let deadline = Instant::now() + Duration::from_millis(CLUSTER_READY_TIMEOUT_MS);
        loop {
            let ok = self
                .nodes
                .iter()
                .all(|n| n.cli(&["cluster", "info"]).contains("cluster_state:ok"));
            let views: Vec<Vec<(u16, u16, u16)>> =
                self.nodes.iter().map(|n| slot_ranges(n.port())).collect();
            if ok && views.windows(2).all(|w| w[0] == w[1]) && !views[0].is_empty() {
                return;
            }
            if Instant::now() > deadline {
                panic!("cluster did not become consistent within {CLUSTER_READY_TIMEOUT_MS} ms");
            }
            thread::sleep(Duration::from_millis(POLL_MS * 5));
        }
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// Index of the node serving `slot`, as node `from` sees it.
    pub fn node_for_slot(&self, slot: u16) -> usize {
        let port = slot_ranges(self.nodes[0].port())
            .into_iter()
            .find(|&(a, b, _)| a <= slot && slot <= b)
            .map(|(_, _, p)| p)
            .unwrap_or_else(|| panic!("slot {slot} is not served"));
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .unwrap_or_else(|| panic!("slot {slot} is served by unknown port {port}"))
    }

    /// The cluster node id of node `i`.
    pub fn node_id(&self, i: usize) -> String {
        self.nodes[i].cli(&["cluster", "myid"]).trim().to_string()
    }
}

/// (first slot, last slot, port) per range, from CLUSTER SLOTS at `port`.
pub fn slot_ranges(port: u16) -> Vec<(u16, u16, u16)> {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return Vec::new();
    };
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
        return Vec::new();
    };
    let v: redis::Value = match redis::cmd("CLUSTER").arg("SLOTS").query(&mut con) {
        Ok(v) => v,
        Err(_) => return Vec::new(),
    };
    let mut out = Vec::new();
    if let redis::Value::Array(ranges) = v {
        for r in ranges {
            if let redis::Value::Array(parts) = r {
                let int = |v: &redis::Value| match v {
                    redis::Value::Int(i) => *i,
                    _ => -1,
                };
                if parts.len() < 3 {
                    continue;
                }
                let master = match &parts[2] {
                    redis::Value::Array(m) if m.len() >= 2 => int(&m[1]),
                    _ => -1,
                };
                out.push((int(&parts[0]) as u16, int(&parts[1]) as u16, master as u16));
            }
        }
    }
    out.sort();
    out
}

/// A TCP proxy on a free loopback port that forwards every connection to
/// one server, switchable at run time (a virtual IP or a DNS name moving to
/// a promoted replica in a failover). A thread per direction of each
/// connection; [`TcpProxy::switch_to`] closes the connections already made.
#[derive(Debug)]
pub struct TcpProxy {
    port: u16,
    target: std::sync::Arc<std::sync::atomic::AtomicU16>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl TcpProxy {
    /// A proxy to `127.0.0.1:target`.
    pub fn start(target: u16) -> TcpProxy {
        use std::sync::atomic::{AtomicBool, AtomicU16};
        use std::sync::{Arc, Mutex};
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .unwrap_or_else(|e| panic!("binding a loopback port for the proxy: {e}"));
        let port = listener.local_addr().expect("proxy address").port();
        let proxy = TcpProxy {
            port,
            target: Arc::new(AtomicU16::new(target)),
            conns: Arc::new(Mutex::new(Vec::new())),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (target, conns, stop) = (
            Arc::clone(&proxy.target),
            Arc::clone(&proxy.conns),
            Arc::clone(&proxy.stop),
        );
        thread::spawn(move || {
            for client in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let to = ("127.0.0.1", target.load(Ordering::SeqCst));
                let Ok(server) = std::net::TcpStream::connect(to) else {
                    continue;
                };
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                {
                    let mut list = conns.lock().unwrap_or_else(|p| p.into_inner());
                    if let (Ok(c3), Ok(s3)) = (client.try_clone(), server.try_clone()) {
                        list.push(c3);
                        list.push(s3);
                    }
                }
                thread::spawn(move || pipe(client, server));
                thread::spawn(move || pipe(s2, c2));
            }
        });
        proxy
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Forwards new connections to `127.0.0.1:target` and closes the ones
    /// made before.
    pub fn switch_to(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.switch_to(0);
        // Wake the accept loop so it sees the stop.
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Copies `from` to `to` until either side closes, then closes both.
fn pipe(mut from: std::net::TcpStream, mut to: std::net::TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
