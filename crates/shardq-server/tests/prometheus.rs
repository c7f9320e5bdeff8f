//! `GET /metrics` scraped by a real Prometheus server (Debian's
//! `prometheus` binary, installed by `.ci/run`): a server in-process on an
//! embedded data dir with jobs on it, Prometheus scraping it every second
//! on a free loopback port, and its query API compared with `/v1/status`.
//! Every wait is a bounded poll. Without `prometheus` on the PATH the test
//! fails, saying what to install.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use shardq_deploy::WorkerOptions;
use shardq_server::{spawn, Running, ServerOptions};

mod support;

use support::{init_at, owned_shards, post_ok, status};

/// Longest wait for Prometheus to start and show a scraped value.
const PROMETHEUS_WAIT: Duration = Duration::from_secs(90);

fn prometheus_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("prometheus"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no `prometheus` binary on the PATH ({}): install Debian's prometheus package \
                 (apt-get install prometheus; .ci/run does so when it is missing)",
                path.to_string_lossy()
            )
        })
}

/// Kills and reaps the Prometheus process when the test ends, however.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn start_prometheus(dir: &Path, target: &str) -> Prometheus {
    let binary = prometheus_binary();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: shardq\n    metrics_path: /metrics\n    \
             static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let log = dir.join("prometheus.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(&binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
    Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
        log,
    }
}

/// The instant vector of `query`, by shard (series without a shard label
/// under ""); `None` while Prometheus does not answer yet.
fn query(p: &Prometheus, q: &str) -> Option<BTreeMap<String, f64>> {
    let resp = ureq::get(&format!("{}/api/v1/query", p.url))
        .query("query", q)
        .timeout(Duration::from_secs(5))
        .call()
        .ok()?;
    let v: Value = resp.into_json().ok()?;
    if v["status"] != "success" {
        return None;
    }
    let mut out = BTreeMap::new();
    for r in v["data"]["result"].as_array()? {
        let shard = r["metric"]["shard"].as_str().unwrap_or("").to_string();
        let value: f64 = r["value"][1].as_str()?.parse().ok()?;
        out.insert(shard, value);
    }
    Some(out)
}

/// Polls `query` until `ok` holds, at most [`PROMETHEUS_WAIT`].
fn wait_for_query(
    p: &mut Prometheus,
    q: &str,
    what: &str,
    ok: impl Fn(&BTreeMap<String, f64>) -> bool,
) -> BTreeMap<String, f64> {
    let started = Instant::now();
    let mut last = None;
    loop {
        if let Some(v) = query(p, q) {
            if ok(&v) {
                return v;
            }
            last = Some(v);
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            panic!(
                "prometheus exited ({status}) while waiting for {what}; its log:\n{}",
                std::fs::read_to_string(&p.log).unwrap_or_default()
            );
        }
        if started.elapsed() > PROMETHEUS_WAIT {
            panic!(
                "timed out after {PROMETHEUS_WAIT:?} waiting for {what} (query {q:?}, last answer {last:?}); prometheus log:\n{}",
                std::fs::read_to_string(&p.log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Per shard: the count `field` from `/v1/status`.
fn per_shard(status: &Value, field: &str) -> BTreeMap<String, f64> {
    status["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap().to_string(),
                r[field].as_u64().unwrap() as f64,
            )
        })
        .collect()
}

/// One claim of up to `max` runs: (key, receipt) each.
fn claim_all(s: &Running, max: u64) -> Vec<(String, String)> {
    let v = post_ok(
        s,
        "/v1/claim",
        json!({"worker": "w1", "max": max, "wait_ms": 0, "lease_ms": 60000}),
    );
    v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["key"].as_str().unwrap().to_string(),
                j["receipt"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn prometheus_scrapes_the_shard_gauges_and_counters() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    init_at(&data, 3, "rendezvous");
    let s = spawn_holding_every_shard(&data, 3);
    let (acked_first, dead, retained) = place_and_settle(&s);
    let st = status(&s);
    let ready = per_shard(&st, "ready");
    let dead_per_shard = per_shard(&st, "dead");
    let total_dead: f64 = dead_per_shard.values().sum();
    assert_eq!(total_dead, dead as f64, "{st}");

    let mut p = start_prometheus(dir.path(), &s.addr().to_string());
    first_scrape_matches(&mut p, &ready, &dead_per_shard, acked_first, dead);
    // Ack every run still held: the counter and the run time histogram move.
    ack_the_rest_and_scrape(&mut p, &s, retained, acked_first, dead);
    drop(p);
    s.stop().unwrap();
}

/// Spawns a server on `data` and waits (bounded) until it holds all
/// `shards` shards.
fn spawn_holding_every_shard(data: &Path, shards: usize) -> Running {
    let s = spawn(
        data,
        ServerOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            worker: WorkerOptions {
                lease_ms: 5000,
                max_shards: usize::MAX,
                ..WorkerOptions::default()
            },
            ..ServerOptions::default()
        },
    )
    .unwrap();
    let t = Instant::now();
    while owned_shards(&s) < shards {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the server did not take the shards"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s
}

/// Places 30 jobs over 10 keys and 4 that die at their first failure, claims
/// one round, fails the doomed, acks five; returns (acked, dead, receipts
/// still held).
fn place_and_settle(s: &Running) -> (usize, usize, Vec<String>) {
    let jobs: Vec<Value> = (0..30)
        .map(|i| json!({"key": format!("tenant-{}", i % 10), "payload": "x"}))
        .collect();
    post_ok(s, "/v1/jobs", json!({ "jobs": jobs }));
    let doomed: Vec<Value> = (0..4)
        .map(|i| json!({"key": format!("doomed-{i}"), "payload": "x", "max_attempts": 1}))
        .collect();
    post_ok(s, "/v1/jobs", json!({ "jobs": doomed }));
    // One round of claims: the head of each of the 14 keys. Fail the
    // doomed ones (dead at once), ack five, keep the rest in flight.
    let runs = claim_all(s, 100);
    assert_eq!(runs.len(), 14, "{runs:?}");
    let (mut acked_first, mut dead) = (0usize, 0usize);
    let mut retained = Vec::new();
    for (key, r) in runs {
        if key.starts_with("doomed-") {
            let v = post_ok(s, "/v1/fail", json!({"receipt": r, "reason": "boom"}));
            assert_eq!(v["outcome"], "dead", "{v}");
            dead += 1;
        } else if acked_first < 5 {
            let v = post_ok(s, "/v1/ack", json!({ "receipts": [r] }));
            assert_eq!(v["acked"], 1, "{v}");
            acked_first += 1;
        } else {
            retained.push(r);
        }
    }
    assert_eq!(dead, 4);
    (acked_first, dead, retained)
}

/// Waits for the first scrapes to show the status's ready and dead gauges,
/// every shard up, and the enqueued, acked and dead-lettered counts.
fn first_scrape_matches(
    p: &mut Prometheus,
    ready: &BTreeMap<String, f64>,
    dead_per_shard: &BTreeMap<String, f64>,
    acked_first: usize,
    dead: usize,
) {
    wait_for_query(
        p,
        "shardq_shard_ready",
        "the ready gauges to equal /v1/status",
        |v| v == ready,
    );
    wait_for_query(
        p,
        "shardq_shard_dead",
        "the dead gauges to equal /v1/status",
        |v| v == dead_per_shard,
    );
    wait_for_query(p, "shardq_shard_up", "every shard up", |v| {
        v.len() == 3 && v.values().all(|&x| x == 1.0)
    });
    wait_for_query(p, "shardq_jobs_enqueued_total", "34 jobs enqueued", |v| {
        sum(v) == 34.0
    });
    wait_for_query(p, "shardq_jobs_acked_total", "the first acks", |v| {
        sum(v) == acked_first as f64
    });
    wait_for_query(
        p,
        "sum(shardq_jobs_dead_lettered_total)",
        "the dead-lettered count",
        |v| v.get("") == Some(&(dead as f64)),
    );
}

/// Acks every run still held, then waits for the acked counter, the run and
/// wait time histograms, the ready gauges and the idle rebalance phase.
fn ack_the_rest_and_scrape(
    p: &mut Prometheus,
    s: &Running,
    retained: Vec<String>,
    acked_first: usize,
    dead: usize,
) {
    let more = retained.len();
    assert!(more > 0);
    let v = post_ok(s, "/v1/ack", json!({ "receipts": retained }));
    assert_eq!(v["acked"], more, "{v}");
    let want = (acked_first + more) as f64;
    wait_for_query(
        p,
        "shardq_jobs_acked_total",
        "the counter to move after more acks",
        |v| sum(v) == want,
    );
    wait_for_query(
        p,
        "shardq_job_run_seconds_count",
        "a run time per ack and fail",
        |v| v.get("") == Some(&(want + dead as f64)),
    );
    wait_for_query(
        p,
        "shardq_job_wait_seconds_count",
        "a wait per claim",
        |v| v.get("") == Some(&14.0),
    );
    // The ready gauges still equal the status after the acks.
    let ready = per_shard(&status(s), "ready");
    wait_for_query(
        p,
        "shardq_shard_ready",
        "the ready gauges to follow /v1/status",
        |v| *v == ready,
    );
    wait_for_query(
        p,
        "shardq_rebalance_phase{phase=\"idle\"}",
        "the idle rebalance phase",
        |v| v.get("") == Some(&1.0),
    );
}

/// The sum of a query's values over every series.
fn sum(v: &BTreeMap<String, f64>) -> f64 {
    v.values().sum::<f64>()
}
