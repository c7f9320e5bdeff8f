//! Helpers shared by the server's tests: a data dir, a server started
//! in-process on 127.0.0.1:0, plain HTTP calls that return the status and
//! the JSON body, and bounded waits.
//!
//! Each test file compiles this module on its own and uses part of it.
//! Waits poll a condition up to a bound and fail naming what they waited for.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use shardq_deploy::WorkerOptions;
use shardq_server::{spawn, Running, ServerOptions};
// Not every test file waits.
#[allow(unused_imports)]
pub use shardq_testkit::wait::{wait_until, WAIT_MAX};

/// An embedded data dir of `shards` shards routed by `algorithm`.
pub fn init_dir(shards: usize, algorithm: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_at(dir.path(), shards, algorithm);
    dir
}

/// [`init_dir`] at a path of the caller's.
pub fn init_at(path: &Path, shards: usize, algorithm: &str) {
    let map = shardq_deploy::spec::init_map(shards, algorithm, None).unwrap();
    shardq_deploy::init_embedded(path, &map).unwrap();
}

/// Failed attempts in the deployment at `path` come back after 20 ms
/// rather than the default backoff (10 s doubling, up to 20% jitter), for
/// a test whose jobs fail and retry but which does not measure the
/// backoff. Servers started afterwards use it.
pub fn quick_retries(path: &Path) {
    let d = shardq_deploy::Deployment::open(path, &Default::default()).unwrap();
    let mut settings = d.retry_settings().unwrap();
    settings.default.backoff = shardq_core::Backoff {
        base_ms: 20,
        max_ms: 20,
        kind: shardq_core::BackoffKind::Fixed,
        jitter_pct: 0,
    };
    d.set_retry_settings(&settings).unwrap();
}

/// Options of a test server: an ephemeral loopback port, 3 s shard leases.
pub fn options() -> ServerOptions {
    ServerOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        worker: WorkerOptions {
            lease_ms: 3000,
            ..WorkerOptions::default()
        },
        ..ServerOptions::default()
    }
}

pub fn start(dir: &Path, opts: ServerOptions) -> Running {
    spawn(dir, opts).unwrap()
}

/// One request; any status comes back as (status, body). The body is JSON,
/// except `/metrics`' Prometheus text (a JSON string).
pub fn call(
    s: &Running,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> (u16, Value) {
    let mut req =
        ureq::request(method, &format!("{}{path}", s.url())).timeout(Duration::from_secs(60));
    if let Some(t) = token {
        req = req.set("Authorization", &format!("Bearer {t}"));
    }
    let res = match body {
        Some(b) => req.set("Content-Type", "application/json").send_string(b),
        None => req.call(),
    };
    let (code, resp) = match res {
        Ok(r) => (r.status(), r),
        Err(ureq::Error::Status(code, r)) => (code, r),
        Err(e) => panic!("{method} {path}: {e}"),
    };
    let text = resp.into_string().unwrap();
    if path == "/metrics" && code == 200 {
        return (code, Value::String(text));
    }
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{method} {path} -> {code}: body is not JSON ({e}): {text}"));
    (code, v)
}

pub fn post(s: &Running, path: &str, body: Value) -> (u16, Value) {
    call(s, "POST", path, Some(&body.to_string()), None)
}

pub fn get(s: &Running, path: &str) -> (u16, Value) {
    call(s, "GET", path, None, None)
}

/// [`post`] that must answer 200; its body.
pub fn post_ok(s: &Running, path: &str, body: Value) -> Value {
    let (code, v) = post(s, path, body);
    assert_eq!(code, 200, "POST {path}: {v}");
    v
}

/// [`get`] that must answer 200; its body.
pub fn get_ok(s: &Running, path: &str) -> Value {
    let (code, v) = get(s, path);
    assert_eq!(code, 200, "GET {path}: {v}");
    v
}

/// `POST /v1/jobs` of `jobs` (a JSON array); the reply's jobs.
pub fn enqueue(s: &Running, jobs: Value) -> Vec<Value> {
    post_ok(s, "/v1/jobs", json!({ "jobs": jobs }))["jobs"]
        .as_array()
        .unwrap()
        .clone()
}

/// `n` jobs of `key`, payloads "0", "1", ...
pub fn enqueue_n(s: &Running, key: &str, n: usize) -> Vec<Value> {
    let jobs: Vec<Value> = (0..n)
        .map(|i| json!({"key": key, "payload": i.to_string()}))
        .collect();
    enqueue(s, Value::Array(jobs))
}

pub fn claim(s: &Running, worker: &str, max: u64, wait_ms: u64, lease_ms: u64) -> Vec<Value> {
    post_ok(
        s,
        "/v1/claim",
        json!({"worker": worker, "max": max, "wait_ms": wait_ms, "lease_ms": lease_ms}),
    )["jobs"]
        .as_array()
        .unwrap()
        .clone()
}

pub fn status(s: &Running) -> Value {
    get_ok(s, "/v1/status")
}

pub fn totals(s: &Running) -> Value {
    status(s)["totals"].clone()
}

/// Shards this server holds, from `/readyz`.
pub fn owned_shards(s: &Running) -> usize {
    get(s, "/readyz").1["owned"]
        .as_array()
        .map_or(0, |a| a.len())
}
