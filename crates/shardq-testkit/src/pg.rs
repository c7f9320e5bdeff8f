//! A real PostgreSQL server for the outbox's tests: `initdb` into a new
//! temporary directory, `postgres` on a free loopback port (its socket in
//! that directory), trust authentication for the `postgres` user, stopped
//! and removed on drop. Run as root, the server runs as the `postgres`
//! user (PostgreSQL refuses root).
//!
//! Needs Debian's `postgresql` package (`.ci/run` installs it): the
//! binaries are found in `/usr/lib/postgresql/<version>/bin`, newest
//! first, or on `PATH`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest wait for a server to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// What the tests need, said when it is missing.
const NEEDED: &str = "the Postgres outbox's tests need PostgreSQL's initdb and postgres (Debian's postgresql package)";

/// One running PostgreSQL server.
pub struct PgServer {
    child: Option<Child>,
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
}

/// The directory holding `initdb` and `postgres`.
fn bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .find(|d| d.join("postgres").exists() && d.join("initdb").exists());
    found.unwrap_or_else(|| panic!("{NEEDED}: not found"))
}

/// The `postgres` user's uid and gid, when this process is root.
fn pg_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    // SAFETY: a NUL-terminated name; the record is read at once, before
    // any other call of the passwd functions in this process.
    let pw = unsafe { libc::getpwnam(c"postgres".as_ptr()) };
    assert!(
        !pw.is_null(),
        "{NEEDED}: no postgres user to run it as (root may not)"
    );
    // SAFETY: non-null, from getpwnam above.
    Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

/// A command for `program` of `bin`, as the `postgres` user when this
/// process is root.
fn as_pg_user(bin: &Path, program: &str) -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(bin.join(program));
    if let Some((uid, gid)) = pg_user() {
        c.uid(uid).gid(gid);
    }
    c
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}

/// The directory of [`template`], once made.
static TEMPLATE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Removes the template's directory when the process exits.
extern "C" fn remove_template() {
    if let Some(data) = TEMPLATE.get().and_then(|d| d.parent()) {
        let _ = std::fs::remove_dir_all(data);
    }
}

/// A data dir made by `initdb` once per process (trust authentication,
/// UTF8, locale C), owned by the user the servers run as: each server
/// starts from a copy of it (an `initdb` takes about a second). It is
/// removed when the process exits.
fn template(bin: &Path) -> &'static Path {
    TEMPLATE.get_or_init(|| {
        // SAFETY: registers a function taking and returning nothing.
        unsafe { libc::atexit(remove_template) };
        let dir = std::env::temp_dir().join(format!("shardq-pg-{}-template", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("making the template's directory");
        if let Some((uid, gid)) = pg_user() {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
                .unwrap_or_else(|e| panic!("{NEEDED}: chown to the postgres user: {e}"));
        }
        let data = dir.join("data");
        let out = as_pg_user(bin, "initdb")
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "-D",
            ])
            .arg(&data)
            .output()
            .unwrap_or_else(|e| panic!("{NEEDED}: initdb: {e}"));
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        data
    })
}

impl PgServer {
    /// A new server on a free loopback port, accepting connections.
    pub fn start() -> PgServer {
        static N: AtomicUsize = AtomicUsize::new(0);
        let bin = bin_dir();
        let dir = std::env::temp_dir().join(format!(
            "shardq-pg-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("making the server's directory");
        if let Some((uid, gid)) = pg_user() {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
                .unwrap_or_else(|e| panic!("{NEEDED}: chown to the postgres user: {e}"));
        }
        // A copy of this process's one `initdb`.
        let out = Command::new("cp")
            .arg("-a")
            .arg(template(&bin))
            .arg(dir.join("data"))
            .output()
            .unwrap_or_else(|e| panic!("cp: {e}"));
        assert!(
            out.status.success(),
            "copying the initdb template failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut server = PgServer {
            child: None,
            dir,
            port: free_port(),
            bin,
        };
        server.start_again();
        server
    }

    /// Starts the server again on its port and data (after [`PgServer::stop`]),
    /// returning once it accepts connections.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        let child = as_pg_user(&self.bin, "postgres")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=50",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{NEEDED}: postgres: {e}"));
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err()
            || !self.accepts_queries()
        {
            assert!(
                Instant::now() < deadline,
                "postgres on port {} did not accept connections within {START_TIMEOUT:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (a fast shutdown: open sessions end, committed
    /// work stays), returning once it has exited.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGINT is the fast shutdown.
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }

    /// Whether a login works (the server is past its start-up).
    fn accepts_queries(&self) -> bool {
        Command::new("psql")
            .arg(self.url())
            .args(["-XAtc", "SELECT 1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Its loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for the `postgres` database as the `postgres` user.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
