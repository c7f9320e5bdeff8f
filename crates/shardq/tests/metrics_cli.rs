//! `shardq work --metrics-listen`: the worker serves `/metrics` while it
//! runs, with the per-shard gauges of the deployment and the counters of
//! its own pool. Waits are bounded polls.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::*;

/// `GET /metrics` on `addr` over a plain socket: the body.
fn scrape(addr: &str) -> Option<String> {
    let mut c = TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        c,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    c.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// Sum of every sample of `name` in `text`.
fn total(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn work_serves_metrics_while_it_runs() {
    let dir = temp_dir("metrics-work");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    for i in 0..6 {
        let key = format!("k{i}");
        assert!(run(&["enqueue", "--data", d, "--key", &key, "--payload", "x"]).0);
    }
    let bad = run(&[
        "work",
        "--data",
        d,
        "--metrics-listen",
        "nowhere",
        "--",
        "true",
    ]);
    assert!(!bad.0 && bad.2.contains("\"nowhere\""), "{}", bad.2);
    let out = dir.join("ran.txt");
    let builtin = format!("append:{}", out.display());
    let mut child = Command::new(BIN)
        .args([
            "work",
            "--data",
            d,
            "--max-local-shards",
            "all",
            "--metrics-listen",
            "127.0.0.1:0",
            "--handler-builtin",
            &builtin,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("shardq: metrics on http://") {
                let _ = tx.send(rest.trim_end_matches("/metrics").to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(WAIT_MAX)
        .expect("the worker printed where it serves metrics");
    let mut last = String::new();
    wait_until("6 acks and an empty queue in /metrics", WAIT_MAX, || {
        last = scrape(&addr).unwrap_or_default();
        total(&last, "shardq_jobs_acked_total") == 6.0
            && last.contains("shardq_shard_ready{shard=\"shard-0\"} 0")
            && last.contains("shardq_shard_ready{shard=\"shard-1\"} 0")
    });
    assert_eq!(total(&last, "shardq_jobs_claimed_total"), 6.0, "{last}");
    assert_eq!(total(&last, "shardq_job_run_seconds_count"), 6.0, "{last}");
    assert!(
        last.contains("shardq_shard_up{shard=\"shard-0\"} 1"),
        "{last}"
    );
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}
