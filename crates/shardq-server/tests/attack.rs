//! The server tried as an attacker would: cross-site writes from a web
//! page on the same host, foreign `Host` headers, silent and half-sent
//! connections, slow bodies against the server-wide concurrency bound, and
//! workers inventing names to pass the per-worker bound. Each test names
//! the invariant it tries to break.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use shardq_server::Tokens;
use support::*;

/// Sends `request` as it is on a new connection and reads the answer until
/// the server closes or `limit` passes: (status, head, body).
fn raw(s: &shardq_server::Running, request: &str, limit: Duration) -> (u16, String, String) {
    let mut c = TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(limit)).unwrap();
    c.write_all(request.as_bytes()).unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

/// A request with `Connection: close`, the given headers and body.
fn request(
    s: &shardq_server::Running,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> String {
    let mut r = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers
        .iter()
        .any(|h| h.to_ascii_lowercase().starts_with("host:"))
    {
        r.push_str(&format!("Host: {}\r\n", s.addr()));
    }
    for h in headers {
        r.push_str(h);
        r.push_str("\r\n");
    }
    r.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    r
}

/// One dead letter of key `k`: enqueued with one attempt, claimed, failed.
fn make_dead(s: &shardq_server::Running, k: &str) {
    enqueue(s, json!([{"key": k, "payload": "p", "max_attempts": 1}]));
    let got = claim(s, "w", 1, 5000, 30_000);
    assert_eq!(got.len(), 1);
    let v = post_ok(
        s,
        "/v1/fail",
        json!({"receipt": got[0]["receipt"], "reason": "boom"}),
    );
    assert_eq!(v["outcome"], "dead", "{v}");
}

fn dead_count(s: &shardq_server::Running) -> usize {
    get_ok(s, "/v1/dead")["dead"].as_array().unwrap().len()
}

#[test]
fn a_web_page_cannot_purge_dead_letters_through_a_loopback_server() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    wait_until("the shard is owned", Duration::from_secs(20), || {
        owned_shards(&s) == 1
    });
    make_dead(&s, "victim");
    assert_eq!(dead_count(&s), 1);
    let t = Duration::from_secs(10);
    // What a page can send without a preflight: text/plain, a form, or no
    // type at all, with its own Origin; each is refused and purges nothing.
    for headers in [
        vec!["Content-Type: text/plain", "Origin: http://evil.example"],
        vec!["Content-Type: application/x-www-form-urlencoded"],
        vec!["Content-Type: text/plain"],
        vec![],
    ] {
        let (code, _, body) = raw(&s, &request(&s, "POST", "/v1/dead/purge", &headers, ""), t);
        assert!(code == 415 || code == 403, "{headers:?} -> {code} {body}");
        assert_eq!(dead_count(&s), 1, "{headers:?} purged");
    }
    // A JSON body from a foreign origin, or marked cross-site by the
    // browser, is refused too.
    for headers in [
        vec![
            "Content-Type: application/json",
            "Origin: http://evil.example",
        ],
        vec!["Content-Type: application/json", "Origin: null"],
        vec![
            "Content-Type: application/json",
            "Sec-Fetch-Site: cross-site",
        ],
        vec![
            "Content-Type: application/json",
            "Sec-Fetch-Site: same-site",
        ],
    ] {
        let (code, _, body) = raw(
            &s,
            &request(&s, "POST", "/v1/dead/purge", &headers, r#"{"all":true}"#),
            t,
        );
        assert_eq!(code, 403, "{headers:?} -> {body}");
        assert!(body.contains("cross-"), "{body}");
    }
    // A foreign Host (DNS rebinding) is refused even for reads.
    let (code, _, body) = raw(
        &s,
        &request(&s, "GET", "/v1/dead", &["Host: evil.example:80"], ""),
        t,
    );
    assert_eq!(code, 421, "{body}");
    assert!(
        body.contains("evil.example") && body.contains("--allowed-host"),
        "{body}"
    );
    // "All" is never implied: an empty body or {} purges nothing.
    let (code, v) = post(&s, "/v1/dead/purge", json!({}));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("\"all\": true"),
        "{v}"
    );
    let (code, _, _) = raw(
        &s,
        &request(
            &s,
            "POST",
            "/v1/dead/purge",
            &["Content-Type: application/json"],
            "",
        ),
        t,
    );
    assert_eq!(code, 400);
    assert_eq!(dead_count(&s), 1);
    // The server's own page (same origin) and a client outside a browser
    // may, when they say so.
    let own = format!("Origin: http://{}", s.addr());
    let (code, _, body) = raw(
        &s,
        &request(
            &s,
            "POST",
            "/v1/dead/purge",
            &[
                "Content-Type: application/json",
                &own,
                "Sec-Fetch-Site: same-origin",
            ],
            r#"{"all":true}"#,
        ),
        t,
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(dead_count(&s), 0);
}

#[test]
fn every_answer_carries_the_browser_protections() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    for path in ["/", "/dashboard/app.js", "/v1/status", "/no/such/path"] {
        let (code, head, _) = raw(
            &s,
            &request(&s, "GET", path, &[], ""),
            Duration::from_secs(10),
        );
        assert!(code == 200 || code == 404, "{path}: {code}");
        let head = head.to_ascii_lowercase();
        for h in [
            "x-content-type-options: nosniff",
            "x-frame-options: deny",
            "frame-ancestors 'none'",
            "content-security-policy: default-src 'none'; script-src 'self'",
        ] {
            assert!(head.contains(h), "{path} lacks {h}:\n{head}");
        }
    }
}

#[test]
fn silent_and_half_sent_connections_are_closed() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.conn.header_read_timeout_ms = 300;
    o.conn.connections_max = 64;
    let s = start(dir.path(), o);
    let mut silent: Vec<TcpStream> = (0..64)
        .map(|_| TcpStream::connect(s.addr()).unwrap())
        .collect();
    let mut half = TcpStream::connect(s.addr()).unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        .unwrap();
    // A keep-alive connection that made one request and then went quiet.
    let mut kept = TcpStream::connect(s.addr()).unwrap();
    kept.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", s.addr()).as_bytes())
        .unwrap();
    silent.push(half);
    let t = Instant::now();
    for (i, c) in silent
        .iter_mut()
        .chain(std::iter::once(&mut kept))
        .enumerate()
    {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = Vec::new();
        // The server closes it (a FIN, or a reset): read_to_end ends. A
        // read timeout would mean the connection was left open.
        match c.read_to_end(&mut buf) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("connection {i} was still open after 10 s: {e}"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(10));
    // With the idle ones gone, a new client is served.
    assert_eq!(get(&s, "/healthz").0, 200);
}

#[test]
fn connections_past_the_limit_are_closed_at_once_and_the_server_keeps_serving() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.conn.connections_max = 16;
    // Long enough that "closed at once" below (within 2.5 s, room for a
    // loaded machine) cannot be the held ones' own timeout.
    o.conn.header_read_timeout_ms = 4_000;
    // Renewed every third of it: a loaded machine may be late by a second.
    o.worker.lease_ms = 2_000;
    let s = start(dir.path(), o);
    wait_until("the shard is owned", Duration::from_secs(20), || {
        owned_shards(&s) == 1
    });
    let held: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(s.addr()).unwrap())
        .collect();
    wait_until("the server holds the 16", WAIT_MAX, || {
        s.load().connections_open >= 16
    });
    // More are accepted and closed at once rather than left waiting. A
    // connection made before the flood (a client's keep-alive from the
    // wait above) may end during it and free one slot, which one extra
    // then takes: of three extras, at least two are closed at once.
    let closed_at_once = (0..3)
        .filter(|_| {
            let mut extra = TcpStream::connect(s.addr()).unwrap();
            extra
                .set_read_timeout(Some(Duration::from_millis(2_500)))
                .unwrap();
            let mut b = [0u8; 1];
            matches!(extra.read(&mut b), Ok(0))
        })
        .count();
    assert!(
        closed_at_once >= 2,
        "connections past the limit closed at once: {closed_at_once} of 3"
    );
    // Once the silent ones time out the server serves again, and its lease
    // (2 s) was renewed throughout.
    drop(held);
    wait_until("a request is served", Duration::from_secs(10), || {
        ureq::get(&format!("{}/healthz", s.url())).call().is_ok()
    });
    assert_eq!(owned_shards(&s), 1, "the lease survived the flood");
}

#[test]
fn slow_bodies_hold_at_most_the_servers_concurrency_and_time_out() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.limits.concurrency_max = 2;
    o.limits.body_read_timeout_ms = 700;
    let s = start(dir.path(), o);
    // Two slow bodies on two different routes: each route alone would have
    // had room for both under a per-route bound.
    let t0 = Instant::now();
    let slow: Vec<_> = ["/v1/jobs", "/v1/ack"]
        .into_iter()
        .map(|path| {
            let mut c = TcpStream::connect(s.addr()).unwrap();
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{{\"jobs\"",
                s.addr()
            );
            c.write_all(head.as_bytes()).unwrap();
            c
        })
        .collect();
    wait_until("both slow bodies in service", WAIT_MAX, || {
        let l = s.load();
        l.requests_in_service == 2 && l.body_bytes_reading == 200
    });
    // The health probes and the metrics hold no slot: they answer at
    // once, and the metrics show what holds the slots.
    let (code, _) = get(&s, "/healthz");
    assert_eq!(code, 200);
    let (code, m) = get(&s, "/metrics");
    assert_eq!(code, 200);
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "/healthz or /metrics waited {:?} behind the slow bodies",
        t0.elapsed()
    );
    let m = m.as_str().unwrap();
    for line in [
        "shardq_http_requests_in_service 2",
        "shardq_http_body_bytes_reading 200",
        "shardq_http_polls_in_service 0",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} in:\n{m}");
    }
    let (code, _) = get(&s, "/v1/status");
    let waited = t0.elapsed();
    assert_eq!(code, 200);
    assert!(
        waited >= Duration::from_millis(600),
        "a third request was served after {waited:?}, while two slow bodies held the server's 2 slots"
    );
    for mut c in slow {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut text = String::new();
        let _ = c.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("did not arrive within 700 ms"), "{text}");
    }
}

#[test]
fn a_huge_list_is_refused_while_it_is_parsed() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.limits.body_bytes_max = 8 << 20;
    let s = start(dir.path(), o);
    let one = r#"{"key":"k","payload":""},"#;
    let n = (8 << 20) / one.len() - 10;
    let mut body = String::from(r#"{"jobs":["#);
    for _ in 0..n {
        body.push_str(one);
    }
    body.pop();
    body.push_str("]}");
    let (code, v) = call(&s, "POST", "/v1/jobs", Some(&body), None);
    assert_eq!(code, 400, "{v}");
    let e = v["error"].as_str().unwrap();
    assert!(
        e.contains("jobs") && e.contains("more than 10000 items"),
        "{e}"
    );
    // Receipts and ids are bounded the same way.
    let receipts: Vec<String> = (0..1001).map(|i| format!("s0:{i}:1")).collect();
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": receipts }));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("more than 1000"),
        "{v}"
    );
    assert_eq!(totals(&s)["ready"], 0, "nothing was stored");
}

#[test]
fn control_characters_in_keys_are_refused() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    for key in ["a\u{0}b", "fake\nline", "tab\tkey", "\u{1b}[2Jwiped"] {
        let (code, v) = post(
            &s,
            "/v1/jobs",
            json!({"jobs": [{"key": key, "payload": "p"}]}),
        );
        assert_eq!(code, 400, "{key:?}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.contains("jobs[0].key") && e.contains("control character"),
            "{e}"
        );
        assert!(!e.contains('\u{1b}') && !e.contains('\n'), "{e:?}");
    }
    assert_eq!(totals(&s)["ready"], 0);
}

const TOKEN_A: &str = "aaaaaaaaaaaaaaaaaaaa";
const TOKEN_B: &str = "bbbbbbbbbbbbbbbbbbbb";

#[test]
fn invented_worker_names_do_not_pass_the_tokens_bound() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.tokens =
        Some(Tokens::parse(&format!("{TOKEN_A} produce,work\n{TOKEN_B} work\n"), "test").unwrap());
    o.limits.claims_per_token_max = 3;
    let s = start(dir.path(), o);
    let jobs: Vec<Value> = (0..10)
        .map(|i| json!({"key": format!("k{i}"), "payload": "p"}))
        .collect();
    let (code, v) = call(
        &s,
        "POST",
        "/v1/jobs",
        Some(&json!({ "jobs": jobs }).to_string()),
        Some(TOKEN_A),
    );
    assert_eq!(code, 200, "{v}");
    wait_until("the shard is owned", Duration::from_secs(20), || {
        owned_shards(&s) == 1
    });
    let claim_as = |token: &str, worker: &str| {
        call(
            &s,
            "POST",
            "/v1/claim",
            Some(
                &json!({"worker": worker, "max": 1, "wait_ms": 2000, "lease_ms": 30000})
                    .to_string(),
            ),
            // The scheme in lower case is accepted.
            Some(token),
        )
    };
    for i in 0..3 {
        let (code, v) = claim_as(TOKEN_A, &format!("invented-{i}"));
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["jobs"].as_array().unwrap().len(), 1);
    }
    let (code, v) = claim_as(TOKEN_A, "invented-3");
    assert_eq!(code, 429, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("limit per token is 3"),
        "{v}"
    );
    // Another token has a bound of its own.
    let (code, v) = claim_as(TOKEN_B, "other");
    assert_eq!(code, 200, "{v}");
    // `bearer` in lower case is the same scheme.
    let r = ureq::get(&format!("{}/v1/status", s.url()))
        .set("Authorization", &format!("bearer {TOKEN_A}"))
        .call();
    assert!(
        matches!(r, Err(ureq::Error::Status(403, _))),
        "lower-case scheme is read (403: the token lacks `read`), not 401"
    );
}

#[test]
fn one_tenants_dedup_id_never_suppresses_anothers_job() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    let attacker = enqueue(
        &s,
        json!([{"key": "attacker", "payload": "a", "dedup_id": "invoice-2026-0001"}]),
    );
    let victim = enqueue(
        &s,
        json!([{"key": "victim", "payload": "v", "dedup_id": "invoice-2026-0001"}]),
    );
    assert_eq!(victim[0]["duplicate"], false, "{victim:?}");
    assert_eq!(victim[0]["key"], "victim");
    assert_ne!(victim[0]["id"], attacker[0]["id"]);
    // Each key's re-send is its own duplicate; one request may carry the
    // same id for two keys.
    let again = enqueue(
        &s,
        json!([
            {"key": "victim", "payload": "v", "dedup_id": "invoice-2026-0001"},
            {"key": "third", "payload": "t", "dedup_id": "invoice-2026-0001"},
        ]),
    );
    assert_eq!(again[0]["duplicate"], true);
    assert_eq!(again[0]["id"], victim[0]["id"]);
    assert_eq!(again[1]["duplicate"], false);
    let t = totals(&s);
    assert_eq!(
        t["ready"].as_u64().unwrap() + t["delayed"].as_u64().unwrap(),
        3,
        "{t}"
    );
}

#[test]
fn one_dedup_id_sent_to_two_servers_at_once_is_stored_once() {
    let dir = init_dir(2, "rendezvous");
    let a = start(dir.path(), options());
    let b = start(dir.path(), options());
    const TRIALS: usize = 100;
    // Both servers get the same id at the same moment, trial after trial;
    // a 409 (the other holds it right now) is retried, as clients do.
    let send = |s: &shardq_server::Running, i: usize| -> Value {
        let body = json!({"jobs": [{"key": format!("t{}", i % 7), "payload": i.to_string(), "dedup_id": format!("req-{i}")}]});
        let t = Instant::now();
        loop {
            let (code, v) = post(s, "/v1/jobs", body.clone());
            match code {
                200 => return v["jobs"][0].clone(),
                409 => {
                    assert!(t.elapsed() < Duration::from_secs(30), "still busy: {v}");
                    std::thread::sleep(Duration::from_millis(2));
                }
                _ => panic!("{code}: {v}"),
            }
        }
    };
    let barrier = std::sync::Barrier::new(2);
    let replies: Vec<Vec<Value>> = std::thread::scope(|sc| {
        let runs: Vec<_> = [&a, &b]
            .into_iter()
            .map(|s| {
                let (barrier, send) = (&barrier, &send);
                sc.spawn(move || {
                    (0..TRIALS)
                        .map(|i| {
                            barrier.wait();
                            send(s, i)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let (left, right) = (&replies[0], &replies[1]);
    for (i, (x, y)) in left.iter().zip(right).enumerate() {
        assert_eq!(x["id"], y["id"], "trial {i}: two jobs for one id: {x} {y}");
        assert!(
            x["duplicate"] != y["duplicate"],
            "trial {i}: exactly one reply stored it: {x} {y}"
        );
    }
    let t = totals(&a);
    assert_eq!(
        t["ready"].as_u64().unwrap(),
        TRIALS as u64,
        "one job per id: {t}"
    );
}

#[test]
fn a_stalled_map_lock_is_retry_later_not_a_server_failure() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    // Another process stalled while holding the map's publish lock.
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.path().join(shardq_fs::map_store::MAP_LOCK_FILE))
        .unwrap();
    assert!(
        shardq_fs::layout::flock_within(&lock, Duration::ZERO, "the lock")
            .unwrap()
            .is_ok()
    );
    let (code, v) = post(&s, "/v1/admin/add-shard", json!({"name": "shard-9"}));
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["kind"], "retryable", "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains(shardq_fs::map_store::MAP_LOCK_FILE),
        "{v}"
    );
    // Bad input stays bad input, with its kind.
    let (code, v) = post(&s, "/v1/admin/add-shard", json!({"name": "bad name!"}));
    assert_eq!(code, 400, "{v}");
    drop(lock);
}

#[test]
fn a_client_that_never_reads_its_answers_is_closed_after_the_write_bound() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.conn.connections_max = 2;
    o.conn.write_stall_ms = 500;
    o.conn.header_read_timeout_ms = 60_000;
    let s = start(dir.path(), o);
    // Two clients pipeline hundreds of requests for a large answer and
    // never read: the server's writes fill their windows and stall.
    let ask = format!(
        "GET /v1/openapi.json HTTP/1.1\r\nHost: {}\r\n\r\n",
        s.addr()
    )
    .repeat(400);
    let stalled: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut c = TcpStream::connect(s.addr()).unwrap();
            c.write_all(ask.as_bytes()).unwrap();
            c
        })
        .collect();
    // They hold both connections only until the write bound: then a new
    // client is served again.
    wait_until("a new client is served", Duration::from_secs(20), || {
        ureq::get(&format!("{}/healthz", s.url()))
            .timeout(Duration::from_secs(2))
            .call()
            .is_ok()
    });
    drop(stalled);
}

/// The Redis password never reaches a client, with or without a token:
/// with a password in the shard URL and the Redis server stopped, every
/// route's answer (the 503s of `/readyz`, reads, enqueues, moves) names
/// the server without its password, and the data dir's files that hold
/// the URL are the owner's only.
#[test]
fn the_redis_password_reaches_no_answer_and_no_readable_file() {
    use std::os::unix::fs::PermissionsExt;
    const PW: &str = "pw-Xq7-never-shown";
    let mut redis = shardq_testkit::redis::RedisServer::start();
    redis.cli(&["CONFIG", "SET", "requirepass", PW]);
    let url = format!("redis://:{PW}@127.0.0.1:{}/0", redis.port());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let map = shardq_deploy::spec::init_map(2, "rendezvous", None).unwrap();
    shardq_deploy::init_redis(&data, map, &[url], None, false, &Default::default()).unwrap();
    for name in ["remote.json", "shardmap.yaml"] {
        let path = data.join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        if text.contains(PW) {
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{name} holds the password with mode {mode:o}");
        }
    }
    let tokens = "admin-token-0123456789a admin\nread-token-0123456789ab read\n";
    let mut o = options();
    o.tokens = Some(Tokens::parse(tokens, "test").unwrap());
    o.open.redis.retry_attempts = 2;
    o.open.redis.retry_budget_ms = 100;
    let s = start(&data, o);
    // Stop the server: every answer that needs it fails, naming it.
    redis.kill();
    let mut failed = 0;
    for route in shardq_server::routes() {
        let path = route
            .path
            .replace("{key}", "t-1")
            .replace("{id}", "shard-0:1")
            .replace("{name}", "g1");
        if path == "/" || path.starts_with("/dashboard/") {
            continue;
        }
        let body = match (route.method, route.path) {
            ("GET", _) => None,
            ("POST", "/v1/jobs") => Some(r#"{"jobs":[{"key":"t-1","payload":"x"}]}"#),
            _ => Some("{}"),
        };
        for token in [None, Some("admin-token-0123456789a")] {
            let (code, v) = call(&s, route.method, &path, body, token);
            let text = v.to_string();
            assert!(
                !text.contains(PW),
                "{} {path} ({code}) shows the password: {text}",
                route.method
            );
            if code >= 500 {
                failed += 1;
            }
        }
    }
    // The stopped server was met (not every route failed before asking).
    assert!(
        failed >= 5,
        "only {failed} answers failed with Redis stopped"
    );
    let (code, v) = get(&s, "/readyz");
    assert_eq!(code, 503, "{v}");
    assert!(v.to_string().contains(":***@127.0.0.1"), "{v}");
}

/// A header that never ends costs at most the read buffer's bound: past
/// `READ_BUFFER_BYTES_MAX` the server answers 431 and closes, long before
/// the client has sent what it means to (here 200 KiB, once ~400 KB were
/// buffered per connection).
#[test]
fn a_header_that_never_ends_is_refused_at_the_read_buffers_bound() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let mut c = TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {}\r\nX-Long: ", s.addr()).as_bytes())
        .unwrap();
    let chunk = vec![b'a'; 1024];
    let mut sent = 0usize;
    for _ in 0..200 {
        if c.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    assert!(
        text.starts_with("HTTP/1.1 431"),
        "after {sent} bytes of one header: {text:?}"
    );
    // The server goes on serving.
    assert_eq!(get(&s, "/healthz").0, 200);
    const { assert!(shardq_server::conn::READ_BUFFER_BYTES_MAX <= 64 * 1024) };
}

/// Every object route refuses a body that is not a JSON object (an array
/// would be read into the object by position), with a 400 naming it and
/// changing nothing; every error body, whatever its status, carries a
/// `kind`.
#[test]
fn bodies_that_are_not_objects_are_refused_and_every_error_has_a_kind() {
    let dir = init_dir(1, "rendezvous");
    // Without tokens every route is open to loopback.
    let s = start(dir.path(), options());
    let admin = None;
    let (code, v) = call(
        &s,
        "PUT",
        "/v1/policies/k1",
        Some(r#"{"concurrency":3}"#),
        admin,
    );
    assert_eq!(code, 200, "{v}");
    let mut routes = 0;
    for route in shardq_server::routes() {
        if route.method == "GET" || route.method == "DELETE" {
            continue;
        }
        let path = route
            .path
            .replace("{key}", "k1")
            .replace("{id}", "shard-0:1")
            .replace("{name}", "g1");
        for body in ["[]", r#"[3,"5/s"]"#, "7", r#""x""#, "null"] {
            let (code, v) = call(&s, route.method, &path, Some(body), admin);
            assert_eq!(code, 400, "{} {path} {body}: {v}", route.method);
            assert!(v["error"].as_str().unwrap().contains("JSON object"), "{v}");
            assert_eq!(v["kind"], "bad_input", "{v}");
        }
        routes += 1;
    }
    assert!(routes >= 10, "{routes} routes with bodies");
    // The policy is as it was.
    let (code, v) = call(&s, "GET", "/v1/policies/k1", None, admin);
    assert_eq!(code, 200);
    assert_eq!(v["policy"]["concurrency"], 3, "{v}");
    // Errors of every origin carry a kind.
    let dir2 = init_dir(1, "rendezvous");
    let mut o = options();
    o.tokens = Some(Tokens::parse("read-token-0123456789ab read\n", "test").unwrap());
    let t = start(dir2.path(), o);
    let (code, v) = call(&t, "GET", "/v1/status", None, None);
    assert_eq!(
        (code, v["kind"].as_str()),
        (401, Some("unauthorized")),
        "{v}"
    );
    let (code, v) = call(
        &t,
        "PUT",
        "/v1/groups/g1",
        Some("{}"),
        Some("read-token-0123456789ab"),
    );
    assert_eq!((code, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    let (code, v) = call(&s, "GET", "/v1/policies/k1?scope=bogus", None, admin);
    assert_eq!((code, v["kind"].as_str()), (400, Some("bad_input")), "{v}");
    let (code, v) = call(
        &s,
        "PUT",
        "/v1/policies/k1",
        Some(r#"{"rate":"0/s"}"#),
        admin,
    );
    assert_eq!((code, v["kind"].as_str()), (400, Some("bad_input")), "{v}");
}

/// Idle long polls never take the slots producers need: with room for 2
/// requests at once, 6 claims long-polling an empty queue leave an enqueue
/// its slot, and it is answered while they still wait.
#[test]
fn idle_long_polls_do_not_hold_the_slots_of_producers() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.limits.concurrency_max = 2;
    o.limits.polls_max = 8;
    let s = start(dir.path(), o);
    let polls: Vec<_> = (0..6)
        .map(|i| {
            let url = s.url();
            std::thread::spawn(move || {
                ureq::post(&format!("{url}/v1/claim"))
                    .timeout(Duration::from_secs(30))
                    .send_json(json!({"worker": format!("w{i}"), "max": 1, "wait_ms": 4000, "lease_ms": 30000}))
                    .map(|r| r.status())
                    .unwrap_or(0)
            })
        })
        .collect();
    wait_until("the 6 polls waiting", WAIT_MAX, || {
        s.load().polls_waiting == 6
    });
    let (_, m) = get(&s, "/metrics");
    let m = m.as_str().unwrap();
    for line in [
        "shardq_http_polls_in_service 6",
        "shardq_http_polls_waiting 6",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} in:\n{m}");
    }
    let t = Instant::now();
    let (code, v) = call(&s, "GET", "/v1/status", None, None);
    assert_eq!(code, 200, "{v}");
    let status_ms = t.elapsed().as_millis();
    let done_early = polls.iter().filter(|p| p.is_finished()).count();
    assert_eq!(done_early, 0, "the polls should still wait");
    assert!(
        status_ms < 2000,
        "a read waited {status_ms} ms behind idle polls"
    );
    enqueue_n(&s, "k", 1);
    for p in polls {
        assert_eq!(p.join().unwrap(), 200);
    }
}

/// Bodies being read are bounded in bytes over every request: a request
/// whose body does not fit beside the ones in flight is refused at once
/// with 503 and `Retry-After`, before its body is read, and goes in once
/// the others are done.
#[test]
fn bodies_in_flight_are_bounded_in_bytes() {
    let dir = init_dir(1, "rendezvous");
    let mut o = options();
    o.limits.body_bytes_max = 1 << 20;
    o.limits.body_bytes_in_flight_max = 1 << 20;
    let s = start(dir.path(), o);
    // A body of 1 MiB, announced and sent only in part.
    let mut slow = TcpStream::connect(s.addr()).unwrap();
    slow.write_all(
        format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"jobs\":[",
            s.addr(),
            1 << 20
        )
        .as_bytes(),
    )
    .unwrap();
    wait_until("the slow body's bytes reserved", WAIT_MAX, || {
        s.load().body_bytes_reading == 1 << 20
    });
    let body = json!({"jobs": [{"key": "k", "payload": "x".repeat(1000)}]}).to_string();
    let r = ureq::post(&format!("{}/v1/jobs", s.url()))
        .set("Content-Type", "application/json")
        .send_string(&body);
    match r {
        Err(ureq::Error::Status(503, resp)) => {
            assert_eq!(resp.header("Retry-After"), Some("1"));
            let v: Value = resp.into_json().unwrap();
            assert_eq!(v["kind"], "retryable", "{v}");
            assert!(v["error"].as_str().unwrap().contains("budget"), "{v}");
        }
        other => panic!("expected 503, got {other:?}"),
    }
    drop(slow);
    // Once the slow body is gone, the same request goes in.
    wait_until("the budget to free", Duration::from_secs(10), || {
        ureq::post(&format!("{}/v1/jobs", s.url()))
            .set("Content-Type", "application/json")
            .send_string(&body)
            .is_ok()
    });
}
