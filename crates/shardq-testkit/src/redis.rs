//! Real `redis-server` processes for tests: standalone instances, replicas
//! and small clusters on free loopback ports, in temporary directories,
//! killed when dropped, and a switchable TCP proxy in front of them.
//!
//! Used by the Redis backend's tests and benches and by other crates' tests
//! (the server's, the CLI's). A server is a [`LocalServer`] of
//! `shardq_redis::local` (what the demo runs on) with what tests do to it:
//! crash and restart it, snapshot and restore it, pause it, replicate and
//! promote it. Servers bind 127.0.0.1 only and never persist unless asked
//! (AOF for crash tests). A missing `redis-server` is a test failure with a
//! clear message, never a silent pass. This module must never touch a
//! server it did not start.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

pub use shardq_redis::local::SERVER_START_TIMEOUT_MS;
use shardq_redis::local::{free_port, port_free, LocalOptions, LocalServer};

/// How long a new cluster may take to agree on its slots.
pub const CLUSTER_READY_TIMEOUT_MS: u64 = 20_000;
/// Ports tried for a cluster node (its port and its bus port free) before
/// giving up.
pub const CLUSTER_PORT_TRIES_MAX: u32 = 200;
const POLL_MS: u64 = 20;

const NEEDED: &str = "the Redis tests need a real redis-server";

/// How to run one server.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerOptions {
    /// Append-only file on, fsync on every write (`appendfsync always`).
    pub aof_always: bool,
    /// `cluster-enabled yes`.
    pub cluster: bool,
    /// More `redis-server` arguments (e.g. `--rename-command CONFIG ""`).
    pub extra_args: &'static [&'static str],
}

impl ServerOptions {
    /// The `redis-server` arguments these options add, with `--replicaof`
    /// for a replica of `primary`.
    fn args(&self, primary: Option<u16>) -> Vec<String> {
        // A primary starts a replica's full sync at once, not after
        // redis-server's default 5 s wait for more replicas to share it:
        // each `start_replica` (and a replica's sync after a failover)
        // waited those 5 s.
        let mut args: Vec<String> = ["--repl-diskless-sync-delay", "0"]
            .map(String::from)
            .to_vec();
        if self.aof_always {
            args.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
        }
        if self.cluster {
            // The node's config file is `nodes.conf` in the server's
            // working directory (redis-server's default, relative to it).
            args.extend(
                ["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"].map(String::from),
            );
        }
        if let Some(p) = primary {
            args.extend(["--replicaof".into(), "127.0.0.1".into(), p.to_string()]);
        }
        args.extend(self.extra_args.iter().map(|a| a.to_string()));
        args
    }
}

/// One `redis-server` child process.
#[derive(Debug)]
pub struct RedisServer {
    server: LocalServer,
}

/// A free loopback port whose cluster bus port (port + 10000) is free too.
fn cluster_port() -> u16 {
    for _ in 0..CLUSTER_PORT_TRIES_MAX {
        let port = free_port().unwrap_or_else(|e| panic!("{e}"));
        if port_free(port + 10_000) {
            return port;
        }
    }
    panic!("no free loopback port with a free bus port after {CLUSTER_PORT_TRIES_MAX} tries");
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
        .unwrap_or_else(|e| panic!("running redis-cli: {e}; {NEEDED} and redis-cli on PATH"));
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
    /// the primary is up, the initial sync is done, the primary counts it
    /// online and a write made on the primary afterwards has reached it
    /// (the primary streams to it, so `WAIT` may count it).
    pub fn start_replica(&self) -> RedisServer {
        let replica = RedisServer::start_inner(ServerOptions::default(), Some(self.port()));
        let deadline = Instant::now() + Duration::from_millis(SERVER_START_TIMEOUT_MS);
        let online = format!("port={},state=online", replica.port());
        let marker = format!("shardq-test:replica-{}", replica.port());
        let mut written = 0u64;
        let mut streams = || {
            if !(replica
                .cli(&["info", "replication"])
                .contains("master_link_status:up")
                && self.cli(&["info", "replication"]).contains(&online))
            {
                return false;
            }
            written += 1;
            let out = self.cli(&["set", &marker, &written.to_string()]);
            assert!(out.trim() == "OK", "SET on port {}: {out}", self.port());
            thread::sleep(Duration::from_millis(POLL_MS));
            replica.cli(&["get", &marker]).trim() == written.to_string()
        };
        while !streams() {
            assert!(
                Instant::now() < deadline,
                "replica on port {} did not sync with port {} within {SERVER_START_TIMEOUT_MS} ms",
                replica.port(),
                self.port()
            );
            thread::sleep(Duration::from_millis(POLL_MS));
        }
        replica
    }

    /// Waits until `replicas` replicas hold every write made so far (a
    /// write of its own, then `WAIT`).
    pub fn wait_replicated(&self, replicas: u32) {
        let out = self.cli(&["set", "shardq-test:replicated", "1"]);
        assert!(out.trim() == "OK", "SET on port {}: {out}", self.port());
        let mut con = self.connection();
        let n: u64 = ::redis::cmd("WAIT")
            .arg(replicas)
            .arg(SERVER_START_TIMEOUT_MS)
            .query(&mut con)
            .unwrap_or_else(|e| panic!("WAIT on port {}: {e}", self.port()));
        assert!(
            n >= u64::from(replicas),
            "only {n} of {replicas} replicas of port {} caught up",
            self.port()
        );
    }

    /// `REPLICAOF NO ONE`: a replica becomes a primary (a failover).
    pub fn promote(&self) {
        let out = self.cli(&["replicaof", "no", "one"]);
        assert!(
            out.trim() == "OK",
            "REPLICAOF NO ONE on port {}: {out}",
            self.port()
        );
    }

    fn start_inner(opts: ServerOptions, primary: Option<u16>) -> RedisServer {
        let local = LocalOptions {
            port: opts.cluster.then(cluster_port),
            args: opts.args(primary),
        };
        let server = LocalServer::start(local).unwrap_or_else(|e| panic!("{e} ({NEEDED})"));
        RedisServer { server }
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The server's working directory.
    pub fn dir(&self) -> &Path {
        self.server.dir()
    }

    /// A fresh connection (for assertions).
    pub fn connection(&self) -> ::redis::Connection {
        ::redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.url()))
    }

    /// Runs `redis-cli` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port(), args)
    }

    /// SIGKILL, as a crash would; the data dir stays.
    pub fn kill(&mut self) {
        self.server.stop();
    }

    /// Starts the server again on the same port and directory (with AOF
    /// on, it reloads what it had acknowledged; without, it loads
    /// `dump.rdb` if there is one).
    pub fn restart(&mut self) {
        self.server
            .start_again()
            .unwrap_or_else(|e| panic!("{e} ({NEEDED})"));
    }

    /// Kills the server and starts it again from the RDB snapshot at
    /// `snapshot` (a copy of an earlier `dump.rdb`), as a restore from an
    /// old backup would.
    pub fn restart_from_snapshot(&mut self, snapshot: &Path) {
        self.kill();
        let dump = self.dir().join("dump.rdb");
        std::fs::copy(snapshot, &dump).unwrap_or_else(|e| {
            panic!("copying {} to {}: {e}", snapshot.display(), dump.display())
        });
        self.restart();
    }

    /// Runs `SAVE` and copies the snapshot to `name` in the server's
    /// directory; returns its path.
    pub fn snapshot(&self, name: &str) -> PathBuf {
        let out = self.cli(&["save"]);
        assert!(out.trim() == "OK", "SAVE on port {}: {out}", self.port());
        let to = self.dir().join(name);
        std::fs::copy(self.dir().join("dump.rdb"), &to)
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
            .server
            .pid()
            .unwrap_or_else(|| panic!("redis-server on port {} is not running", self.port()));
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
        // A paused server dies of SIGKILL all the same, but resume it first
        // so nothing waits on it; the server itself then kills the process
        // and removes its directory.
        if let Some(pid) = self.server.pid() {
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(pid.to_string())
                .status();
        }
    }
}

/// Hash slots of a Redis Cluster.
const CLUSTER_SLOTS: usize = 16_384;

/// A Redis Cluster of masters without replicas, made as `redis-cli
/// --cluster create` makes one.
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
        // What `redis-cli --cluster create` does, without its fixed
        // one-second waits for the nodes to join (3 s per cluster): a
        // distinct config epoch per node, an even share of the slots each,
        // every node met from the first; `wait_consistent` then polls.
        let said_ok = |n: &RedisServer, args: &[&str]| {
            let out = n.cli(args);
            assert_eq!(
                out.trim(),
                "OK",
                "CLUSTER {args:?} on port {}: {out}",
                n.port()
            );
        };
        for (i, n) in nodes.iter().enumerate() {
            let epoch = (i + 1).to_string();
            said_ok(n, &["cluster", "set-config-epoch", &epoch]);
            let first = (i * CLUSTER_SLOTS / masters).to_string();
            let last = ((i + 1) * CLUSTER_SLOTS / masters - 1).to_string();
            said_ok(n, &["cluster", "addslotsrange", &first, &last]);
        }
        for n in &nodes[1..] {
            said_ok(
                &nodes[0],
                &["cluster", "meet", "127.0.0.1", &n.port().to_string()],
            );
        }
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
    let Ok(client) = ::redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return Vec::new();
    };
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
        return Vec::new();
    };
    let v: ::redis::Value = match ::redis::cmd("CLUSTER").arg("SLOTS").query(&mut con) {
        Ok(v) => v,
        Err(_) => return Vec::new(),
    };
    let mut out = Vec::new();
    if let ::redis::Value::Array(ranges) = v {
        for r in ranges {
            if let ::redis::Value::Array(parts) = r {
                let int = |v: &::redis::Value| match v {
                    ::redis::Value::Int(i) => *i,
                    _ => -1,
                };
                if parts.len() < 3 {
                    continue;
                }
                let master = match &parts[2] {
                    ::redis::Value::Array(m) if m.len() >= 2 => int(&m[1]),
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
