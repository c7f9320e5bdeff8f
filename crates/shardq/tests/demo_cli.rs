//! `shardq demo` end to end: on Redis instances started on the ports of
//! `--redis-ports`, and with `--serve`, whose dashboard still shows the
//! demo's rebalance (who ran it, how it ended) after the report.

mod support;

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{free_port, run, BIN, WAIT_MAX};

/// A small, quick demo: few tenants, short phases, a light load.
const QUICK: &[&str] = &[
    "demo",
    "--tenants",
    "300",
    "--shards",
    "2",
    "--phase-s",
    "0.5",
    "--rate",
    "1500",
    "--work-us",
    "100",
    "--json",
];

#[test]
fn a_redis_demo_starts_its_servers_on_the_ports_it_is_given() {
    // A range of 40 ports from a spot this process picks: the demo takes
    // the first three free ones.
    let lo = 42_000 + (std::process::id() % 5_000) as u16;
    let hi = lo + 39;
    let range = format!("{lo}-{hi}");
    let mut args = QUICK.to_vec();
    args.extend(["--backend", "redis", "--redis-ports", &range]);
    let (ok, out, err) = run(&args);
    assert!(ok, "demo failed: {err}");
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["order_violations"], 0, "{report}");
    assert_eq!(report["lost_jobs"], 0, "{report}");
    let location = report["location"].as_str().unwrap();
    let ports: Vec<u16> = location
        .split("ports ")
        .nth(1)
        .and_then(|rest| rest.split(" (").next())
        .unwrap_or_else(|| panic!("no ports in {location:?}"))
        .split(", ")
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(ports.len(), 3, "{location}");
    assert!(
        ports.iter().all(|p| (lo..=hi).contains(p)),
        "{ports:?} not in {range}"
    );

    // A range with too few free ports is refused, naming it; and a bad one.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let p = taken.local_addr().unwrap().port();
    let one = format!("{p}-{p}");
    let (ok, _, err) = run(&[
        "demo",
        "--shards",
        "2",
        "--backend",
        "redis",
        "--redis-ports",
        &one,
    ]);
    assert!(
        !ok && err.contains(&format!("--redis-ports {one}: 0 free")) && err.contains("needs 3"),
        "{err}"
    );
    let (ok, _, err) = run(&["demo", "--backend", "redis", "--redis-ports", "9-3"]);
    assert!(!ok && err.contains("LOW is above HIGH"), "{err}");
    let (ok, _, err) = run(&["demo", "--redis-ports", "30000-30010"]);
    assert!(!ok && err.contains("is for --backend redis"), "{err}");
}

#[test]
fn the_demo_dashboard_still_shows_its_rebalance_after_the_report() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut args = QUICK.to_vec();
    args.extend(["--serve", "--listen", &listen, "--serve-after-s", "20"]);
    let mut child = Command::new(BIN)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The report is printed once the demo is done; the dashboard stays up.
    let mut stdout = child.stdout.take().unwrap();
    let mut out = String::new();
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    while !out.ends_with('\n') {
        assert!(
            started.elapsed() < WAIT_MAX,
            "no report after {WAIT_MAX:?}: {out}"
        );
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "the demo ended without a report: {out}");
        out.push_str(std::str::from_utf8(&buf[..n]).unwrap());
    }
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    let got: Value = ureq::get(&format!("http://{listen}/v1/admin/rebalance"))
        .timeout(Duration::from_secs(10))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(got["phase"], "finished", "{got}");
    assert!(
        got["runner"].as_str().unwrap().starts_with("shardq demo"),
        "{got}"
    );
    assert_eq!(
        got["keys_moved"], report["keys_drained"],
        "{got} vs {report}"
    );
    assert!(got["started_ms"].as_u64().unwrap() <= got["finished_ms"].as_u64().unwrap());
}
