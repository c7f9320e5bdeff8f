//! Several `shardq serve` processes over one data dir: they split the
//! shards by leases, a client polling both gets every job, and when one is
//! SIGKILLed the other takes its shards after the lease, with nothing lost
//! and every key's jobs acked in order.

mod support;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{free_port, run, temp_dir, BIN, WAIT_MAX};

fn serve(data: &Path, port: u16, extra: &[&str]) -> Child {
    let mut args = vec![
        "serve".to_string(),
        "--data".into(),
        data.to_str().unwrap().into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--lease-ms".into(),
        "1000".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new(BIN)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// POST; `None` when the server does not answer (killed).
fn post(port: u16, path: &str, body: Value) -> Option<(u16, Value)> {
    let res = ureq::post(&format!("http://127.0.0.1:{port}{path}"))
        .timeout(Duration::from_secs(10))
        .send_json(body);
    match res {
        Ok(r) => Some((r.status(), r.into_json().unwrap())),
        Err(ureq::Error::Status(code, r)) => Some((code, r.into_json().unwrap_or(Value::Null))),
        Err(_) => None,
    }
}

fn owned(port: u16) -> Option<usize> {
    let r = ureq::get(&format!("http://127.0.0.1:{port}/readyz"))
        .timeout(Duration::from_secs(5))
        .call()
        .ok()?;
    let v: Value = r.into_json().ok()?;
    v["owned"].as_array().map(Vec::len)
}

fn wait_owned(port: u16, n: usize) {
    let start = Instant::now();
    while owned(port) != Some(n) {
        assert!(
            start.elapsed() < WAIT_MAX,
            "server on {port} never owned {n} shards"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_servers_split_the_shards_and_one_takes_over_when_the_other_dies() {
    let dir = temp_dir("serve-two");
    let data = dir.join("data");
    let (ok, _, err) = run(&["init", "--data", data.to_str().unwrap(), "--shards", "4"]);
    assert!(ok, "{err}");
    let (pa, pb) = (free_port(), free_port());
    let mut a = serve(&data, pa, &["--max-shards", "2"]);
    wait_owned(pa, 2);
    let mut b = serve(&data, pb, &[]);
    wait_owned(pb, 2);

    const KEYS: u64 = 24;
    const PER_KEY: u64 = 15;
    let jobs: Vec<Value> = (0..PER_KEY)
        .flat_map(|seq| {
            (0..KEYS).map(move |k| json!({"key": format!("t-{k}"), "payload": seq.to_string()}))
        })
        .collect();
    let (code, v) = post(pb, "/v1/jobs", json!({ "jobs": jobs })).unwrap();
    assert_eq!(code, 200, "{v}");

    // One client polling both servers; it acks to the server that gave the
    // job. Halfway, server A is SIGKILLed.
    let mut acked: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut total_acked = 0u64;
    let mut killed = false;
    let start = Instant::now();
    while total_acked < KEYS * PER_KEY {
        assert!(start.elapsed() < WAIT_MAX * 2, "only {total_acked} acked");
        if !killed && total_acked >= KEYS * PER_KEY / 2 {
            a.kill().unwrap();
            let _ = a.wait();
            killed = true;
        }
        for port in [pa, pb] {
            if killed && port == pa {
                continue;
            }
            let Some((200, v)) = post(
                port,
                "/v1/claim",
                json!({"worker": "w", "max": 16, "wait_ms": 100, "lease_ms": 2000}),
            ) else {
                continue;
            };
            for job in v["jobs"].as_array().unwrap() {
                let receipt = job["receipt"].as_str().unwrap();
                let answer = post(port, "/v1/ack", json!({ "receipts": [receipt] }));
                if let Some((200, _)) = answer {
                    let key = job["key"].as_str().unwrap().to_string();
                    let seq: u64 = job["payload"].as_str().unwrap().parse().unwrap();
                    acked.entry(key).or_default().push(seq);
                    total_acked += 1;
                }
            }
        }
    }
    assert!(killed);
    let _ = a.wait();
    assert_eq!(owned(pb), Some(4), "the survivor took every shard");
    for (key, seqs) in &acked {
        assert_eq!(
            seqs,
            &(0..PER_KEY).collect::<Vec<u64>>(),
            "key {key}: acks out of order or missing"
        );
    }
    assert_eq!(acked.len() as u64, KEYS);
    b.kill().unwrap();
    let _ = b.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A flood of silent connections against a server with few file
/// descriptors (`ulimit -n 320`): the connection bound keeps descriptors
/// free, so the lease ticks never fail, and the silent sockets are closed
/// after the header timeout, so requests are served again.
#[test]
fn a_flood_of_idle_sockets_leaves_the_leases_and_the_server_working() {
    let dir = temp_dir("serve-flood");
    let data = dir.join("data");
    let (ok, _, err) = run(&["init", "--data", data.to_str().unwrap(), "--shards", "2"]);
    assert!(ok, "{err}");
    let port = free_port();
    let log = dir.join("serve.log");
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -n 320 && exec {BIN} serve --data {} --listen 127.0.0.1:{port} --lease-ms 1000 --header-read-timeout-ms 1500",
            data.display()
        ))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_owned(port, 2);
    // 400 sockets that send nothing: more than the server has descriptors.
    let flood: Vec<std::net::TcpStream> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(flood.len() >= 300, "{} connected", flood.len());
    // Real time: through three 1 s lease periods and past the 1.5 s header
    // timeout, after which the server answers again and still holds both shards.
    std::thread::sleep(Duration::from_millis(3_500));
    wait_owned(port, 2);
    let (code, v) = post(
        port,
        "/v1/jobs",
        json!({"jobs": [{"key": "k", "payload": "p"}]}),
    )
    .expect("the server answers after the flood");
    assert_eq!(code, 200, "{v}");
    drop(flood);
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains("Too many open files") && !text.contains("lease"),
        "the lease machinery failed during the flood:\n{text}"
    );
}

/// `serve --no-shards` is a front for the API: it takes no shard from the
/// workers (a server started after it owns them all), and a job enqueued
/// through it is run by the worker server.
#[test]
fn a_front_server_takes_no_shard_and_its_enqueues_reach_the_workers() {
    let dir = temp_dir("serve-front");
    let data = dir.join("data");
    let (ok, _, err) = run(&["init", "--data", data.to_str().unwrap(), "--shards", "2"]);
    assert!(ok, "{err}");
    let (front_port, worker_port) = (free_port(), free_port());
    let mut front = serve(&data, front_port, &["--no-shards"]);
    let mut worker = serve(&data, worker_port, &[]);
    wait_owned(worker_port, 2);
    support::wait_until("the front answers", WAIT_MAX, || {
        owned(front_port).is_some()
    });
    assert_eq!(owned(front_port), Some(0), "the front owns nothing");
    let (code, v) = post(
        front_port,
        "/v1/jobs",
        json!({"jobs": [{"key": "k", "payload": "p"}]}),
    )
    .unwrap();
    assert_eq!(code, 200, "{v}");
    let (code, v) = post(
        worker_port,
        "/v1/claim",
        json!({"worker": "w", "max": 1, "wait_ms": 5000}),
    )
    .unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["jobs"].as_array().map(Vec::len), Some(1), "{v}");
    // A negative check: the front takes no shard over a 1 s lease period.
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(owned(front_port), Some(0));
    // The owner names what kind of process holds the leases.
    let st = support::status_json(&data);
    for shard in st["shards"].as_array().unwrap() {
        let owner = shard["owner"].as_str().unwrap_or("");
        assert!(owner.starts_with("serve:"), "{st}");
    }
    for c in [&mut front, &mut worker] {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// An error says its cause once: a busy port reads "Address already in
/// use" one time, not twice (the cause's words were repeated by the chain).
#[test]
fn a_busy_port_is_named_once() {
    let dir = temp_dir("serve-busy");
    let data = dir.join("data");
    let (ok, _, err) = run(&["init", "--data", data.to_str().unwrap(), "--shards", "1"]);
    assert!(ok, "{err}");
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let out = Command::new(BIN)
        .args([
            "serve",
            "--data",
            data.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("Address already in use").count(), 1, "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
}
