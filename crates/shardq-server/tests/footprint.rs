//! What a request costs the server in memory and CPU when an attacker or a
//! quiet fleet shapes it: a 16 MiB body of tiny jobs, and hundreds of idle
//! long polls. Both read this process's own counters (`/proc/self`), so
//! the tests of this file run one at a time.

mod support;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::json;
use support::*;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// User plus system CPU time of this process, in seconds.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name (which is in parentheses).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

#[test]
fn a_body_of_tiny_jobs_does_not_grow_the_server_past_its_own_size() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let one = r#"{"key":"k","payload":""},"#;
    let n = (16 << 20) / one.len() - 10;
    let mut body = String::from(r#"{"jobs":["#);
    for _ in 0..n {
        body.push_str(one);
    }
    body.pop();
    body.push_str("]}");
    let before = rss_bytes();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let (code, v) = call(&s, "POST", "/v1/jobs", Some(&body), None);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    assert_eq!(code, 400, "{v}");
    let grew = peak
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(before);
    eprintln!(
        "a 16 MiB body of {n} tiny jobs: the process grew {} MiB",
        grew >> 20
    );
    // The body is 16 MiB; the client's copy and the server's make ~32 MiB.
    // Parsing all 671,000 jobs before the count check grew it by ~220 MB.
    assert!(
        grew < 96 << 20,
        "a 16 MiB body of {n} tiny jobs grew the process by {} MiB",
        grew >> 20
    );
}

#[test]
fn idle_long_polls_cost_next_to_no_cpu() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    wait_until("both shards are owned", Duration::from_secs(20), || {
        owned_shards(&s) == 2
    });
    let url = s.url();
    const WAITERS: usize = 300;
    let waiters: Vec<_> = (0..WAITERS)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                ureq::post(&format!("{url}/v1/claim"))
                    .timeout(Duration::from_secs(30))
                    .send_json(json!({"worker": format!("w{i}"), "max": 1, "wait_ms": 4000}))
                    .map(|r| r.status().to_string())
                    .unwrap_or_else(|e| format!("{e}"))
            })
        })
        .collect();
    wait_until("the polls waiting", WAIT_MAX, || {
        s.load().polls_waiting == WAITERS as u64
    });
    let (c0, t0) = (cpu_s(), Instant::now());
    // Real time: the window the idle polls' CPU is measured over.
    std::thread::sleep(Duration::from_millis(2000));
    let cores = (cpu_s() - c0) / t0.elapsed().as_secs_f64();
    eprintln!("{WAITERS} idle long polls: {cores:.3} cores");
    // An enqueue still reaches a waiter.
    enqueue(&s, json!([{"key": "k", "payload": "p"}]));
    let mut statuses = Vec::new();
    for w in waiters {
        statuses.push(w.join().unwrap());
    }
    let failed: Vec<_> = statuses.iter().filter(|c| *c != "200").collect();
    assert!(
        failed.is_empty(),
        "{} of {WAITERS} long polls failed: {failed:?}",
        failed.len()
    );
    assert!(
        cores < 0.25,
        "{WAITERS} idle long polls used {cores:.2} cores (each re-polled every 10 ms)"
    );
    assert_eq!(totals(&s)["in_flight"], 1, "one waiter took the job");
}
