//! The server against real HTTP: a server started in-process on
//! 127.0.0.1:0 over an embedded data dir (and one over a real redis-server),
//! driven by a plain HTTP client. Waits are bounded polls.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use shardq_server::{routes, Role, Server, Tokens};

mod support;

use support::{
    call, claim, enqueue, enqueue_n, get, get_ok, init_dir, options, owned_shards, post, post_ok,
    quick_retries, start, totals, wait_until,
};

#[test]
fn enqueue_claim_ack_round_trip_and_stale_receipts() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    let placed = enqueue(
        &s,
        json!([{"key": "t-1", "payload": "hello"}, {"key": "t-2", "payload_b64": "/wA="}]),
    );
    assert_eq!(placed.len(), 2);
    assert_eq!(placed[0]["key"], "t-1");
    assert_eq!(placed[0]["duplicate"], false);
    let id0 = placed[0]["id"].as_str().unwrap();
    assert!(
        id0.starts_with(&format!("{}:", placed[0]["shard"].as_str().unwrap())),
        "{id0}"
    );

    let mut got = Vec::new();
    wait_until("both jobs claimed", Duration::from_secs(10), || {
        got.extend(claim(&s, "w-1", 10, 1000, 30_000));
        got.len() >= 2
    });
    assert_eq!(got.len(), 2);
    let by_key: BTreeMap<&str, &Value> = got
        .iter()
        .map(|j| (j["key"].as_str().unwrap(), j))
        .collect();
    assert_eq!(by_key["t-1"]["payload"], "hello");
    assert_eq!(by_key["t-1"]["id"], placed[0]["id"]);
    assert_eq!(by_key["t-2"]["payload_b64"], "/wA=");
    assert!(by_key["t-2"].get("payload").is_none());
    assert_eq!(by_key["t-1"]["attempt"], 1);
    let receipts: Vec<&str> = got.iter().map(|j| j["receipt"].as_str().unwrap()).collect();
    for (j, r) in got.iter().zip(&receipts) {
        assert_eq!(*r, format!("{}.{}", j["id"].as_str().unwrap(), j["fence"]));
    }
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": receipts }));
    assert_eq!((code, v["acked"].as_u64()), (200, Some(2)), "{v}");
    // Acking again: stale, 409 naming it, nothing changes.
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [receipts[0]] }));
    assert_eq!(code, 409, "{v}");
    assert_eq!(v["stale"], json!([receipts[0]]));
    assert_eq!(v["acked"], 0);
    let t = totals(&s);
    assert_eq!(
        (t["ready"].as_u64(), t["in_flight"].as_u64()),
        (Some(0), Some(0)),
        "{t}"
    );
    s.stop().unwrap();
}

#[test]
fn a_shard_not_owned_here_gets_409() {
    let dir = init_dir(2, "rendezvous");
    let mut o = options();
    o.worker.max_shards = 1;
    let s = start(dir.path(), o);
    let (code, v) = get(&s, "/readyz");
    assert_eq!(code, 200, "{v}");
    let owned: Vec<String> = serde_json::from_value(v["owned"].clone()).unwrap();
    assert_eq!(owned.len(), 1, "{v}");
    let other = if owned[0] == "shard-0" {
        "shard-1"
    } else {
        "shard-0"
    };
    let r = format!("{other}:1.5");
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [r] }));
    assert_eq!(code, 409, "{v}");
    assert_eq!(v["not_owned"], json!([r]));
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("not owned by this server"),
        "{v}"
    );
    let (code, v) = post(&s, "/v1/fail", json!({ "receipt": r, "reason": "x" }));
    assert_eq!(code, 409, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("not owned by this server"),
        "{v}"
    );
}

#[test]
fn per_key_order_holds_with_concurrent_claimers() {
    const KEYS: usize = 16;
    const PER_KEY: usize = 12;
    let dir = init_dir(3, "rendezvous");
    let s = Arc::new(start(dir.path(), options()));
    for round in 0..PER_KEY {
        let jobs: Vec<Value> = (0..KEYS)
            .map(|k| json!({"key": format!("k-{k}"), "payload": format!("{round}")}))
            .collect();
        enqueue(&s, Value::Array(jobs));
    }
    // Per key: the next payload index expected, and whether a run is out.
    let state: Arc<Mutex<HashMap<String, (usize, bool)>>> = Arc::new(Mutex::new(HashMap::new()));
    let acked = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    for w in 0..4 {
        let (s, state, acked) = (Arc::clone(&s), Arc::clone(&state), Arc::clone(&acked));
        threads.push(std::thread::spawn(move || {
            let t = Instant::now();
            while acked.load(Ordering::SeqCst) < KEYS * PER_KEY {
                assert!(t.elapsed() < Duration::from_secs(60), "claimers timed out");
                let jobs = claim(&s, &format!("w-{w}"), 5, 200, 30_000);
                for j in &jobs {
                    let key = j["key"].as_str().unwrap().to_string();
                    let idx: usize = j["payload"].as_str().unwrap().parse().unwrap();
                    let mut st = state.lock().unwrap();
                    let e = st.entry(key.clone()).or_insert((0, false));
                    assert!(!e.1, "key {key} has two jobs claimed at once");
                    assert_eq!(e.0, idx, "key {key}: job {idx} claimed before job {}", e.0);
                    *e = (idx + 1, true);
                }
                for j in &jobs {
                    // Mark the key free before the ack: the backend keeps it
                    // blocked until the ack lands, so no claim can slip in.
                    let key = j["key"].as_str().unwrap().to_string();
                    state.lock().unwrap().get_mut(&key).unwrap().1 = false;
                    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [j["receipt"]] }));
                    assert_eq!(code, 200, "{v}");
                    acked.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let st = state.lock().unwrap();
    assert_eq!(st.len(), KEYS);
    assert!(
        st.values().all(|&(next, out)| next == PER_KEY && !out),
        "{st:?}"
    );
    assert_eq!(totals(&s)["ready"], 0);
}

#[test]
fn a_lapsed_lease_is_redelivered_and_its_receipt_refused() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    enqueue(&s, json!([{"key": "k", "payload": "p"}]));
    let first = claim(&s, "w-1", 1, 2000, 100);
    assert_eq!(first.len(), 1);
    let old = first[0]["receipt"].as_str().unwrap().to_string();
    let mut again = Vec::new();
    wait_until(
        "re-delivery after the lease lapsed",
        Duration::from_secs(10),
        || {
            again = claim(&s, "w-2", 1, 500, 30_000);
            !again.is_empty()
        },
    );
    assert_eq!(again[0]["id"], first[0]["id"]);
    assert_eq!(again[0]["attempt"], 2);
    assert!(again[0]["fence"].as_u64() > first[0]["fence"].as_u64());
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [old] }));
    assert_eq!(code, 409, "{v}");
    assert_eq!(v["stale"], json!([old]));
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [again[0]["receipt"]] }));
    assert_eq!(code, 200, "{v}");
}

#[test]
fn extend_keeps_a_run_and_fail_retries_later() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    enqueue(&s, json!([{"key": "k", "payload": "p"}]));
    let j = claim(&s, "w-1", 1, 2000, 300);
    assert_eq!(j.len(), 1);
    let r = j[0]["receipt"].clone();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1200) {
        let (code, v) = post(
            &s,
            "/v1/extend",
            json!({ "receipts": [r], "lease_ms": 300 }),
        );
        assert_eq!((code, v["extended"].as_u64()), (200, Some(1)), "{v}");
        assert!(
            claim(&s, "w-2", 1, 0, 30_000).is_empty(),
            "the extended run was handed out again"
        );
        std::thread::sleep(Duration::from_millis(80));
    }
    // Fail it with a retry delay: the next attempt comes no sooner. Timed
    // from before the request: the server's clock at the fail is no
    // earlier, however late its answer arrives on a loaded machine.
    let failed_at = Instant::now();
    let (code, v) = post(
        &s,
        "/v1/fail",
        json!({ "receipt": r, "reason": "boom", "retry_in_ms": 300 }),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["outcome"], "retry");
    let (code, v) = post(&s, "/v1/fail", json!({ "receipt": r, "reason": "again" }));
    assert_eq!(code, 409, "a second fail of the same run: {v}");
    let mut next = Vec::new();
    wait_until("the retry", Duration::from_secs(10), || {
        next = claim(&s, "w-1", 1, 1000, 30_000);
        !next.is_empty()
    });
    assert!(
        failed_at.elapsed() >= Duration::from_millis(250),
        "{:?}",
        failed_at.elapsed()
    );
    assert_eq!(next[0]["attempt"], 2);
    let (code, v) = post(
        &s,
        "/v1/extend",
        json!({ "receipts": [r], "lease_ms": 1000 }),
    );
    assert_eq!(code, 409, "{v}");
    assert_eq!(v["stale"], json!([r]));
}

#[test]
fn dedup_returns_the_original_ids_across_restarts() {
    let dir = init_dir(2, "rendezvous");
    let body = json!([
        {"key": "a", "payload": "1", "dedup_id": "req-1/a"},
        {"key": "b", "payload": "2", "dedup_id": "req-1/b"},
        {"key": "c", "payload": "3"}
    ]);
    let s = start(dir.path(), options());
    let first = enqueue(&s, body.clone());
    let second = enqueue(&s, body.clone());
    for i in 0..2 {
        assert_eq!(first[i]["id"], second[i]["id"]);
        assert_eq!(
            (
                first[i]["duplicate"].clone(),
                second[i]["duplicate"].clone()
            ),
            (json!(false), json!(true))
        );
    }
    assert_eq!(second[2]["duplicate"], false, "no dedup_id: stored again");
    assert_eq!(totals(&s)["ready"], 4);
    s.stop().unwrap();

    let s = start(dir.path(), options());
    let third = enqueue(&s, json!([body[0].clone(), body[1].clone()]));
    for i in 0..2 {
        assert_eq!(third[i]["id"], first[i]["id"]);
        assert_eq!(third[i]["duplicate"], true);
    }
    assert_eq!(totals(&s)["ready"], 4);
    // A dedup id twice in one request is bad input.
    let (code, v) = post(
        &s,
        "/v1/jobs",
        json!({"jobs": [body[0].clone(), body[0].clone()]}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("jobs[1].dedup_id"),
        "{v}"
    );
}

const TOKENS: &[(&str, &str)] = &[
    ("produce-token-0123456789", "produce"),
    ("work-token-0123456789ab", "work"),
    ("read-token-0123456789ab", "read"),
    ("admin-token-0123456789a", "admin"),
];

#[test]
fn tokens_and_roles_allow_exactly_their_paths() {
    let dir = init_dir(2, "rendezvous");
    let text: String = TOKENS.iter().map(|(t, r)| format!("{t} {r}\n")).collect();
    let mut o = options();
    o.tokens = Some(Tokens::parse(&format!("# test\n{text}"), "test").unwrap());
    let s = start(dir.path(), o);
    for route in routes() {
        let path = route
            .path
            .replace("{key}", "t-1")
            .replace("{id}", "shard-0:1");
        let body = (route.method != "GET").then_some("{}");
        match route.role {
            None if path == "/" || path.starts_with("/dashboard/") => {
                // The dashboard's page and assets: not JSON.
                let r = ureq::get(&format!("{}{path}", s.url())).call().unwrap();
                assert_eq!(r.status(), 200, "GET {path}");
            }
            None => {
                let (code, v) = call(&s, route.method, &path, body, None);
                assert_eq!(code, 200, "{} {path}: {v}", route.method);
            }
            Some(role) => {
                let (code, v) = call(&s, route.method, &path, body, None);
                assert_eq!(code, 401, "{} {path} without a token: {v}", route.method);
                let (code, _) = call(
                    &s,
                    route.method,
                    &path,
                    body,
                    Some("not-a-token-at-all-000"),
                );
                assert_eq!(code, 401, "{} {path} with a wrong token", route.method);
                for (token, name) in TOKENS {
                    let has: Role = name.parse().unwrap();
                    let (code, v) = call(&s, route.method, &path, body, Some(token));
                    if has == role {
                        assert!(
                            code != 401 && code != 403,
                            "{} {path} with role {name}: {code} {v}",
                            route.method
                        );
                    } else {
                        assert_eq!(code, 403, "{} {path} with role {name}: {v}", route.method);
                        assert!(v["error"].as_str().unwrap().contains(role.name()), "{v}");
                    }
                }
            }
        }
    }
    // Without tokens, only loopback.
    let mut o = options();
    o.listen = "0.0.0.0:0".parse().unwrap();
    let e = Server::open(dir.path(), o).err().unwrap().to_string();
    assert!(
        e.contains("without authentication") && e.contains("0.0.0.0"),
        "{e}"
    );
}

/// An operator reads a job by the id enqueue gave, lists a key's live jobs
/// in key order, cancels a queued job (it never runs) and a running one
/// (its run's ack is refused, and the job goes when its lease lapses); a
/// bad id or limit is refused naming it.
#[test]
fn jobs_are_shown_listed_and_cancelled_by_id() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let ids: Vec<String> = support::enqueue_n(&s, "k", 3)
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_string())
        .collect();
    // A short job lease: the running job's cancel ends with it.
    let run = claim(&s, "w", 1, 0, 500).remove(0);
    assert_eq!(run["id"], ids[0]);

    let (code, b) = get(&s, &format!("/v1/jobs/{}", ids[1]));
    assert_eq!(code, 200, "{b}");
    assert_eq!(
        (&b["state"], &b["payload"], &b["attempts"], &b["key"]),
        (&json!("queued"), &json!("1"), &json!(0), &json!("k"))
    );
    let (code, list) = get(&s, "/v1/keys/k/jobs");
    assert_eq!(code, 200, "{list}");
    let states: Vec<&str> = list["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["running", "queued", "queued"]);
    assert_eq!(list["jobs"][0]["run"]["fence"], run["fence"]);
    assert_eq!(
        get(&s, "/v1/keys/k/jobs?limit=1").1["jobs"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let cancel = |id: &str| call(&s, "DELETE", &format!("/v1/jobs/{id}"), Some("{}"), None);
    let (code, v) = cancel(&ids[1]);
    assert_eq!((code, &v["cancelled"]), (200, &json!(true)), "{v}");
    let (code, v) = cancel(&ids[1]);
    assert_eq!(code, 404, "{v}");
    // Gone from the live jobs; shown as cancelled while the retention keeps it.
    let (code, v) = get(&s, &format!("/v1/jobs/{}", ids[1]));
    assert_eq!((code, &v["outcome"]), (200, &json!("cancelled")), "{v}");
    let (code, v) = call(&s, "DELETE", &format!("/v1/jobs/{}", ids[2]), None, None);
    assert_eq!(code, 415, "a DELETE without a JSON content type: {v}");

    // The running job: its run is asked to stop; with no word from its
    // worker (no ack, fail or stale check) the key's last job waits for
    // the run's lease, then runs; the job is gone. (A refused ack or fail
    // ends the run at once: `an_ack_refused_after_a_cancel_frees_the_key_at_once`.)
    let (code, v) = cancel(&ids[0]);
    assert_eq!((code, &v["stopping"]), (200, &json!(true)), "{v}");
    assert!(
        claim(&s, "w", 10, 0, 60_000).is_empty(),
        "the next job started under the run"
    );
    let mut next = Vec::new();
    wait_until(
        "the next job to start once the cancelled run's 500 ms lease lapsed",
        Duration::from_secs(30),
        || {
            next = claim(&s, "w", 10, 0, 60_000);
            !next.is_empty()
        },
    );
    let got: Vec<&Value> = next.iter().map(|j| &j["payload"]).collect();
    assert_eq!(
        got,
        [&json!("2")],
        "the cancelled job ran, or the next did not"
    );

    for (path, field) in [
        ("/v1/jobs/17", "id"),
        ("/v1/jobs/shard-9:1", "id"),
        ("/v1/keys/k/jobs?limit=0", "limit"),
        ("/v1/keys/k/jobs?limit=1001", "limit"),
    ] {
        let (code, v) = get(&s, path);
        assert_eq!(code, 400, "{path}: {v}");
        assert!(
            v["error"].as_str().unwrap().starts_with(field),
            "{path}: {v}"
        );
    }
}

/// Two jobs of key `k`; the first claimed (a 30 s lease): their ids and
/// the run.
fn claim_the_first_of_two(s: &shardq_server::Running) -> (Vec<String>, Value) {
    let ids: Vec<String> = support::enqueue_n(s, "k", 2)
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_string())
        .collect();
    let run = claim(s, "w", 1, 0, 30_000).remove(0);
    assert_eq!(run["id"], ids[0]);
    (ids, run)
}

/// Cancels running job `id`: its run is asked to stop.
fn cancel_running(s: &shardq_server::Running, id: &str) {
    let (code, v) = call(s, "DELETE", &format!("/v1/jobs/{id}"), Some("{}"), None);
    assert_eq!((code, &v["stopping"]), (200, &json!(true)), "{v}");
}

/// The claim `next` got the key's second job at once, and job `first`
/// ended cancelled.
fn next_at_once_and_the_first_cancelled(s: &shardq_server::Running, first: &str, next: &[Value]) {
    let got: Vec<&Value> = next.iter().map(|j| &j["payload"]).collect();
    assert_eq!(got, [&json!("1")], "the key's next job, at once");
    let (code, v) = get(s, &format!("/v1/jobs/{first}"));
    assert_eq!((code, &v["outcome"]), (200, &json!("cancelled")), "{v}");
}

/// `POST /v1/stale` names a run a cancel stopped at once, without ending
/// it (asked again, the key still starts nothing), and names nothing of a
/// current run; the worker's fail of the stopped run, refused with 409,
/// ends it, and the key's next job starts at once, long before the 30 s
/// job lease would lapse.
#[test]
fn a_cancelled_run_is_named_stale_at_once_and_its_fail_frees_the_key() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let (ids, run) = claim_the_first_of_two(&s);
    let receipt = run["receipt"].clone();
    let (code, v) = post(&s, "/v1/stale", json!({ "receipts": [receipt] }));
    assert_eq!((code, &v["stale"]), (200, &json!([])), "{v}");
    cancel_running(&s, &ids[0]);
    for _ in 0..2 {
        let (code, v) = post(&s, "/v1/stale", json!({ "receipts": [receipt] }));
        assert_eq!((code, &v["stale"]), (200, &json!([receipt])), "{v}");
        assert!(
            claim(&s, "w", 10, 0, 30_000).is_empty(),
            "the next job started while the stale run's handler may still run"
        );
    }
    let (code, v) = post(
        &s,
        "/v1/fail",
        json!({ "receipt": receipt, "reason": "cancelled" }),
    );
    assert_eq!(code, 409, "a cancelled run's fail: {v}");
    let next = claim(&s, "w", 10, 0, 30_000);
    next_at_once_and_the_first_cancelled(&s, &ids[0], &next);
}

/// A handler that succeeds after its job was cancelled: the ack is
/// refused (409, the job stays cancelled) and ends the run, so the key's
/// next job starts at once, not when the run's job lease lapses.
#[test]
fn an_ack_refused_after_a_cancel_frees_the_key_at_once() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let (ids, run) = claim_the_first_of_two(&s);
    cancel_running(&s, &ids[0]);
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [run["receipt"]] }));
    assert_eq!(code, 409, "a cancelled run's ack: {v}");
    let next = claim(&s, "w", 10, 0, 30_000);
    next_at_once_and_the_first_cancelled(&s, &ids[0], &next);
}

/// `GET /v1/history` counts this server's enqueues, claims, acks and
/// fails per second, its totals agree, and a bad window is refused.
#[test]
fn history_counts_what_this_server_did() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    support::enqueue_n(&s, "h", 5);
    let runs = claim(&s, "w", 1, 0, 60_000);
    post_ok_ack(&s, &runs[0]["receipt"]);
    let run = claim(&s, "w", 1, 0, 60_000).remove(0);
    let (code, v) = post(
        &s,
        "/v1/fail",
        json!({"receipt": run["receipt"], "reason": "no"}),
    );
    assert_eq!(code, 200, "{v}");
    let h = support::get_ok(&s, "/v1/history?seconds=120");
    let sum = |name: &str| {
        h[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(h["acked"].as_array().unwrap().len(), 120);
    assert_eq!(
        (sum("enqueued"), sum("claimed"), sum("acked"), sum("failed")),
        (5, 2, 1, 1),
        "{h}"
    );
    assert_eq!(
        h["totals"],
        json!({"enqueued": 5, "claimed": 2, "acked": 1, "failed": 1})
    );
    // Each second with claims has a wait, and one without has none.
    let claimed = h["claimed"].as_array().unwrap();
    let waits = h["wait_max_ms"].as_array().unwrap();
    assert_eq!(waits.len(), 120);
    for (c, w) in claimed.iter().zip(waits) {
        if c == &json!(0) {
            assert_eq!(w, &json!(0), "a wait in a second without claims: {h}");
        }
    }
    for bad in ["/v1/history?seconds=0", "/v1/history?seconds=3601"] {
        let (code, v) = get(&s, bad);
        assert_eq!(code, 400, "{bad}: {v}");
    }
}

/// `GET /v1/keys?prefix=` lists the keys with work that start with the
/// prefix, across shards, in key order, with their counts, cut at the
/// limit (saying so); a bad limit is refused.
#[test]
fn keys_are_found_by_prefix_across_shards() {
    let dir = init_dir(3, "rendezvous");
    let s = start(dir.path(), options());
    for k in ["acme-1", "acme-2", "acme-3", "zeta"] {
        support::enqueue_n(&s, k, 2);
    }
    let v = support::get_ok(&s, "/v1/keys?prefix=acme-");
    let keys: Vec<&str> = v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["acme-1", "acme-2", "acme-3"], "{v}");
    assert_eq!(
        (v["keys"][0]["depth"].as_u64(), &v["more"]),
        (Some(2), &json!(false))
    );
    let shards: std::collections::BTreeSet<&str> = v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["shard"].as_str().unwrap())
        .collect();
    assert!(!shards.is_empty());
    let v = support::get_ok(&s, "/v1/keys?prefix=acme-&limit=2");
    assert_eq!(
        (v["keys"].as_array().unwrap().len(), &v["more"]),
        (2, &json!(true))
    );
    assert!(support::get_ok(&s, "/v1/keys?prefix=nope")["keys"]
        .as_array()
        .unwrap()
        .is_empty());
    assert_eq!(get(&s, "/v1/keys?prefix=a&limit=0").0, 400);
    assert_eq!(get(&s, "/v1/keys").0, 400, "the prefix is required");
}

fn post_ok_ack(s: &shardq_server::Running, receipt: &Value) {
    let (code, v) = post(s, "/v1/ack", json!({ "receipts": [receipt] }));
    assert_eq!((code, &v["acked"]), (200, &json!(1)), "{v}");
}

/// Every bad body or query answers 400 naming the field and the value,
/// and nothing is stored. Long on purpose: one table of bad inputs, each
/// sent and checked the same way, then the check that none was stored.
#[test]
fn bad_input_gets_400_naming_the_field_and_value_and_stores_nothing() {
    let dir = init_dir(2, "rendezvous");
    let mut o = options();
    o.open.engine.payload_bytes_max = 1000;
    let s = start(dir.path(), o);
    let long_key = "x".repeat(1025);
    let jobs = |j: Value| json!({ "jobs": j }).to_string();
    let ok_job = json!({"key": "fine", "payload": "p"});
    let cases: Vec<(&str, &str, String, Vec<&str>)> = vec![
        ("POST", "/v1/jobs", "{not json".into(), vec!["invalid JSON"]),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k", "payload": "p", "max_attempts": "five"}])),
            vec!["jobs[0].max_attempts", "\"five\""],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k", "payload": "p", "max_attempts": 0}])),
            vec!["jobs[0].max_attempts", "0"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([ok_job, {"key": "", "payload": "p"}])),
            vec!["jobs[1].key", "\"\""],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": long_key, "payload": "p"}])),
            vec!["jobs[0].key", "1025"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([ok_job, {"key": "k", "payload": "y".repeat(2000)}])),
            vec!["jobs[1].payload", "2000 bytes"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([ok_job, {"key": "k", "payload_b64": "@@@"}])),
            vec!["jobs[1].payload_b64", "\"@@@\""],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k", "payload": "p", "payload_b64": "cA=="}])),
            vec!["jobs[0]", "both"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k"}])),
            vec!["jobs[0]", "no payload"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k", "payload": "p", "priority": 1}])),
            vec!["jobs[0]", "priority"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k", "payload": "p", "delay_ms": 99_999_999_999_999u64}])),
            vec!["jobs[0].delay_ms", "99999999999999"],
        ),
        (
            "POST",
            "/v1/jobs",
            jobs(json!([{"key": "k", "payload": "p", "dedup_id": ""}])),
            vec!["jobs[0].dedup_id", "\"\""],
        ),
        ("POST", "/v1/jobs", jobs(json!([])), vec!["jobs", "empty"]),
        (
            "POST",
            "/v1/jobs",
            jobs(Value::Array(vec![ok_job.clone(); 1001])),
            vec!["jobs", "1001"],
        ),
        (
            "POST",
            "/v1/jobs",
            json!({"jobs": [{"key": 7, "payload": "p"}]}).to_string(),
            vec!["jobs[0].key", "7"],
        ),
        (
            "POST",
            "/v1/claim",
            json!({"worker": "w", "max": 0}).to_string(),
            vec!["max", "0"],
        ),
        (
            "POST",
            "/v1/claim",
            json!({"worker": "w", "max": 1001}).to_string(),
            vec!["max", "1001"],
        ),
        (
            "POST",
            "/v1/claim",
            json!({"worker": "w", "max": -1}).to_string(),
            vec!["max", "-1"],
        ),
        (
            "POST",
            "/v1/claim",
            json!({"worker": "w", "wait_ms": 30_001}).to_string(),
            vec!["wait_ms", "30001"],
        ),
        (
            "POST",
            "/v1/claim",
            json!({"worker": "w", "lease_ms": 5}).to_string(),
            vec!["lease_ms", "5"],
        ),
        (
            "POST",
            "/v1/claim",
            json!({"worker": ""}).to_string(),
            vec!["worker", "\"\""],
        ),
        (
            "POST",
            "/v1/ack",
            json!({"receipts": ["garbage"]}).to_string(),
            vec!["receipts[0]", "\"garbage\""],
        ),
        (
            "POST",
            "/v1/ack",
            json!({"receipts": ["nope:1.2"]}).to_string(),
            vec!["receipts[0]", "\"nope\""],
        ),
        (
            "POST",
            "/v1/ack",
            json!({"receipts": []}).to_string(),
            vec!["receipts", "empty"],
        ),
        (
            "POST",
            "/v1/fail",
            json!({"receipt": "shard-0:1.1", "retry_in_ms": 99_999_999_999_999u64}).to_string(),
            vec!["retry_in_ms", "99999999999999"],
        ),
        (
            "POST",
            "/v1/extend",
            json!({"receipts": ["shard-0:1.1"], "lease_ms": 1}).to_string(),
            vec!["lease_ms", "1"],
        ),
        (
            "POST",
            "/v1/stale",
            json!({"receipts": []}).to_string(),
            vec!["receipts", "empty"],
        ),
        (
            "POST",
            "/v1/stale",
            json!({"receipts": ["nope:1.2"]}).to_string(),
            vec!["receipts[0]", "\"nope\""],
        ),
        (
            "POST",
            "/v1/stale",
            json!({"receipts": ["shard-0:x"]}).to_string(),
            vec!["receipts[0]", "shard-0:x"],
        ),
        (
            "GET",
            "/v1/dead?shard=nope",
            String::new(),
            vec!["shard", "\"nope\""],
        ),
        ("GET", "/v1/dead?limit=0", String::new(), vec!["limit", "0"]),
        (
            "POST",
            "/v1/dead/retry",
            json!({"ids": ["shard-0"]}).to_string(),
            vec!["ids[0]", "\"shard-0\""],
        ),
        (
            "POST",
            "/v1/admin/add-shard",
            json!({"name": "bad name!"}).to_string(),
            vec!["name", "\"bad name!\""],
        ),
        (
            "POST",
            "/v1/admin/set-weight",
            json!({"name": "shard-0", "weight": 0}).to_string(),
            vec!["weight", "0"],
        ),
        (
            "POST",
            "/v1/admin/rebalance",
            json!({"batch": 0}).to_string(),
            vec!["batch", "0"],
        ),
    ];
    for (method, path, body, needles) in &cases {
        let body = (method == &"POST").then_some(body.as_str());
        let (code, v) = call(&s, method, path, body, None);
        assert_eq!(code, 400, "{method} {path} {body:?}: {v}");
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error field: {v}"));
        for n in needles {
            assert!(msg.contains(n), "{method} {path}: {msg:?} lacks {n:?}");
        }
    }
    let (code, v) = call(&s, "GET", &format!("/v1/keys/{long_key}"), None, None);
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("key"), "{v}");
    let t = totals(&s);
    assert_eq!(
        (t["ready"].as_u64(), t["delayed"].as_u64()),
        (Some(0), Some(0)),
        "stored: {t}"
    );
    // Unknown paths and methods are JSON too.
    assert_eq!(call(&s, "GET", "/v2/nothing", None, None).0, 404);
    assert_eq!(call(&s, "GET", "/v1/jobs", None, None).0, 405);
}

#[test]
fn every_served_path_is_documented_and_vice_versa() {
    let doc: Value = serde_json::from_str(shardq_server::OPENAPI_JSON).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut documented = BTreeSet::new();
    for (path, ops) in doc["paths"].as_object().unwrap() {
        for (method, op) in ops.as_object().unwrap() {
            documented.insert((method.to_uppercase(), path.clone()));
            let role = op
                .get("x-shardq-role")
                .and_then(|r| r.as_str())
                .unwrap_or("");
            let served = routes()
                .into_iter()
                .find(|r| r.path == path && r.method.eq_ignore_ascii_case(method));
            if let Some(r) = served {
                assert_eq!(
                    role,
                    r.role.map(|r| r.name()).unwrap_or(""),
                    "{method} {path}: documented role"
                );
            }
        }
    }
    let served: BTreeSet<(String, String)> = routes()
        .into_iter()
        .map(|r| (r.method.to_string(), r.path.to_string()))
        .collect();
    assert_eq!(served, documented);
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let (code, v) = get(&s, "/v1/openapi.json");
    assert_eq!((code, &v), (200, &doc));
}

#[test]
fn add_shard_and_rebalance_under_load_reach_the_new_shard() {
    let dir = init_dir(2, "rendezvous");
    let s = Arc::new(start(dir.path(), options()));
    let stop = Arc::new(AtomicBool::new(false));
    let seen_new = Arc::new(AtomicBool::new(false));
    let producer = {
        let (s, stop, seen_new) = (Arc::clone(&s), Arc::clone(&stop), Arc::clone(&seen_new));
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let jobs: Vec<Value> = (0..20)
                    .map(|k| json!({"key": format!("t-{k}"), "payload": format!("{n}")}))
                    .collect();
                for j in enqueue(&s, Value::Array(jobs)) {
                    if j["shard"] == "shard-9" {
                        seen_new.store(true, Ordering::SeqCst);
                    }
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let claimed_new = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (s, stop, claimed_new) = (Arc::clone(&s), Arc::clone(&stop), Arc::clone(&claimed_new));
        let acked = Arc::clone(&acked);
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let jobs = claim(&s, "w", 50, 100, 30_000);
                if jobs.is_empty() {
                    continue;
                }
                if jobs.iter().any(|j| j["shard"] == "shard-9") {
                    claimed_new.store(true, Ordering::SeqCst);
                }
                let rs: Vec<Value> = jobs.iter().map(|j| j["receipt"].clone()).collect();
                let (code, v) = post(&s, "/v1/ack", json!({ "receipts": rs }));
                assert_eq!(code, 200, "{v}");
                acked.fetch_add(rs.len(), Ordering::SeqCst);
            }
        })
    };
    wait_until(
        "the load to run: 200 jobs acked",
        Duration::from_secs(30),
        || acked.load(Ordering::SeqCst) >= 200 || worker.is_finished() || producer.is_finished(),
    );
    let (code, v) = post(&s, "/v1/admin/add-shard", json!({"name": "shard-9"}));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["state"], "warming");
    let (code, v) = post(&s, "/v1/admin/rebalance", json!({"batch": 4}));
    assert_eq!(code, 202, "{v}");
    let mut phases = BTreeSet::new();
    let mut last = Value::Null;
    wait_until("the rebalance to finish", Duration::from_secs(60), || {
        let (code, v) = get(&s, "/v1/admin/rebalance");
        assert_eq!(code, 200, "{v}");
        phases.insert(v["phase"].as_str().unwrap().to_string());
        assert_ne!(v["phase"], "failed", "{v}");
        last = v;
        last["phase"] == "finished"
    });
    assert!(
        last["keys_moved"].as_u64() <= last["keys_to_move"].as_u64(),
        "{last}"
    );
    // What moved with the keys, and the longest pause, are reported.
    assert!(
        last["jobs_moved"].is_u64() && last["pause_ms_max"].is_f64(),
        "{last}"
    );
    assert!(
        last["to_version"].as_u64() > last["from_version"].as_u64(),
        "{last}"
    );
    wait_until(
        "jobs enqueued to and claimed from shard-9",
        Duration::from_secs(30),
        || seen_new.load(Ordering::SeqCst) && claimed_new.load(Ordering::SeqCst),
    );
    stop.store(true, Ordering::SeqCst);
    producer.join().unwrap();
    worker.join().unwrap();
    let (code, v) = get(&s, "/v1/keys/t-1");
    assert_eq!(code, 200, "{v}");
    assert!(v["shard"].is_string() && v["depth"].is_u64(), "{v}");
    assert!(phases.contains("finished"), "{phases:?}");
}

/// A data dir (in `dir`) of a deployment of `shards` shards on `redis`.
fn init_redis_dir(
    dir: &tempfile::TempDir,
    redis: &shardq_testkit::redis::RedisServer,
    shards: usize,
) -> std::path::PathBuf {
    let data = dir.path().join("data");
    let map = shardq_deploy::spec::init_map(shards, "rendezvous", None).unwrap();
    shardq_deploy::init_redis(&data, map, &[redis.url()], None, false, &Default::default())
        .unwrap();
    data
}

#[test]
fn redis_round_trip_with_dedup() {
    let redis = shardq_testkit::redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let data = init_redis_dir(&dir, &redis, 2);
    let mut o = options();
    o.limits.jobs_per_request_max = 3000;
    let s = start(&data, o);
    let body = json!([{"key": "t-1", "payload": "hi", "dedup_id": "d-1"}]);
    let first = enqueue(&s, body.clone());
    let again = enqueue(&s, body);
    assert_eq!(first[0]["id"], again[0]["id"]);
    assert_eq!(again[0]["duplicate"], true);
    let mut got = Vec::new();
    wait_until("the claim", Duration::from_secs(10), || {
        got = claim(&s, "w", 10, 1000, 30_000);
        !got.is_empty()
    });
    assert_eq!(got.len(), 1, "one stored job: {got:?}");
    assert_eq!(got[0]["payload"], "hi");
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [got[0]["receipt"]] }));
    assert_eq!(code, 200, "{v}");
    let (code, v) = post(&s, "/v1/ack", json!({ "receipts": [got[0]["receipt"]] }));
    assert_eq!(code, 409, "{v}");
    // A batch (looked up in one pipeline): the known id comes back as a
    // duplicate, the new ones are stored once even when the batch is sent
    // twice.
    let batch = json!([
        {"key": "t-2", "payload": "a", "dedup_id": "d-2"},
        {"key": "t-1", "payload": "hi", "dedup_id": "d-1"},
        {"key": "t-3", "payload": "b", "dedup_id": "d-3"},
    ]);
    let one = enqueue(&s, batch.clone());
    let two = enqueue(&s, batch);
    let dup: Vec<bool> = one.iter().map(|j| j["duplicate"] == true).collect();
    assert_eq!(dup, [false, true, false], "{one:?}");
    assert!(two.iter().all(|j| j["duplicate"] == true), "{two:?}");
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(a["id"], b["id"]);
    }
    let (_, st) = get(&s, "/v1/status");
    assert_eq!(st["totals"]["ready"], 2, "{st}");
    // A dedup id belongs to its key: another tenant's job with the same id
    // is stored, and is a duplicate of itself only.
    let other = enqueue(
        &s,
        json!([{"key": "victim", "payload": "v", "dedup_id": "d-1"}]),
    );
    assert_eq!(other[0]["duplicate"], false, "{other:?}");
    assert_ne!(other[0]["id"], first[0]["id"]);
    let other_again = enqueue(
        &s,
        json!([{"key": "victim", "payload": "v", "dedup_id": "d-1"}]),
    );
    assert_eq!(other_again[0]["duplicate"], true);
    assert_eq!(other_again[0]["id"], other[0]["id"]);
    s.stop().unwrap();
}

/// A rebalance run by another process is the one the server shows and
/// refuses to start beside; one this server tried while another held the
/// lock leaves no record of its own.
#[test]
fn the_rebalance_of_another_process_is_shown_and_respected() {
    use shardq_core::reshard::{stored_progress, RebalanceProgress, SETTING_REBALANCE};
    let dir = init_dir(2, "rendezvous");
    let deployment =
        shardq_deploy::Deployment::open(dir.path(), &shardq_deploy::OpenOptions::default())
            .unwrap();
    let maps = deployment.maps();
    let now = shardq_core::Clock::now_ms(&shardq_core::SystemClock);
    let write = |p: &RebalanceProgress| {
        maps.store_setting(SETTING_REBALANCE, Some(&serde_json::to_string(p).unwrap()))
            .unwrap();
    };
    let mut other = RebalanceProgress::started(now, "shardq rebalance (pid 1)");
    other.phase = "moving".into();
    other.keys_to_move = 40;
    other.keys_moved = 12;
    write(&other);
    let s = start(dir.path(), options());
    let (code, v) = post(&s, "/v1/admin/rebalance", json!({}));
    assert_eq!(code, 409, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("by shardq rebalance (pid 1)"),
        "{v}"
    );
    let (_, v) = get(&s, "/v1/admin/rebalance");
    assert_eq!(
        (&v["phase"], &v["keys_moved"]),
        (&json!("moving"), &json!(12)),
        "{v}"
    );

    // Once it has ended, a try of this server's that the lock refuses (a
    // run holds it, say one that has not written yet) leaves no record of
    // its own: the ended run stays the one shown, not a "failed" try.
    other.phase = "finished".into();
    other.finished_ms = Some(now);
    write(&other);
    let held = maps.try_lock_rebalance().unwrap();
    let (code, v) = post(&s, "/v1/admin/rebalance", json!({}));
    assert_eq!(code, 202, "{v}");
    wait_until("the refused try to end", Duration::from_secs(20), || {
        get(&s, "/v1/admin/rebalance").1["phase"] != "pinning"
    });
    let (_, v) = get(&s, "/v1/admin/rebalance");
    assert_eq!(
        (&v["phase"], &v["runner"]),
        (&json!("finished"), &json!("shardq rebalance (pid 1)")),
        "{v}"
    );
    drop(held);
    assert_eq!(stored_progress(&*maps).unwrap().unwrap(), other);
}

/// The deployment's retry policies reach the API: a job enqueued without
/// `max_attempts` gets its key's (a prefix rule's here), one that names its
/// own keeps it, and a fail without `retry_in_ms` waits its key's backoff
/// (the rule's hour, not the default's seconds).
#[test]
fn enqueue_and_fail_follow_the_keys_retry_policy() {
    let dir = init_dir(1, "rendezvous");
    let d = shardq_deploy::Deployment::open(dir.path(), &Default::default()).unwrap();
    let mut settings = d.retry_settings().unwrap();
    settings.rules.prefixes.insert(
        "slow:".into(),
        shardq_core::RetryPolicy {
            max_attempts: 3,
            backoff: shardq_core::Backoff {
                base_ms: 3_600_000,
                max_ms: 3_600_000,
                kind: shardq_core::BackoffKind::Fixed,
                jitter_pct: 0,
            },
        },
    );
    d.set_retry_settings(&settings).unwrap();
    drop(d);
    let s = start(dir.path(), options());
    enqueue(
        &s,
        json!([
            {"key": "slow:a", "payload": "p"},
            {"key": "slow:b", "payload": "p", "max_attempts": 7},
            {"key": "other", "payload": "p"}
        ]),
    );
    let jobs = claim(&s, "w-1", 3, 2000, 30_000);
    assert_eq!(jobs.len(), 3, "{jobs:?}");
    let by_key = |k: &str| jobs.iter().find(|j| j["key"] == k).unwrap().clone();
    assert_eq!(by_key("slow:a")["max_attempts"], 3, "the prefix's attempts");
    assert_eq!(
        by_key("slow:b")["max_attempts"],
        7,
        "the job's own attempts"
    );
    assert_eq!(by_key("other")["max_attempts"], 5, "the default attempts");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let fail = |k: &str| {
        let v = post_ok(
            &s,
            "/v1/fail",
            json!({"receipt": by_key(k)["receipt"], "reason": "down"}),
        );
        v["retry_at_ms"].as_u64().expect("a retry")
    };
    let slow = fail("slow:a");
    let other = fail("other");
    assert!(
        slow >= now + 3_590_000,
        "the rule's hour: {slow} vs now {now}"
    );
    assert!(
        other < now + 60_000,
        "a key without a rule waits the default's seconds: {other} vs now {now}"
    );
}

/// Policies and groups over HTTP: set, shown with where they come from,
/// checked whole (a bad value or a missing group is a 400 naming it, a
/// used group stays), and held by this server's own claims within a
/// second, without a restart.
#[test]
fn policies_and_groups_are_set_over_http_and_held_by_claims() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let put = |path: &str, body: Value| call(&s, "PUT", path, Some(&body.to_string()), None);
    let (code, v) = put("/v1/policies/k?scope=prefix", json!({"group": "api"}));
    assert!(
        code == 400 && v["error"].as_str().unwrap().contains("api"),
        "{v}"
    );
    let (code, v) = put("/v1/policies/k", json!({"rate": "5/fortnight"}));
    assert!(
        code == 400 && v["error"].as_str().unwrap().contains("fortnight"),
        "{v}"
    );
    let (code, v) = put("/v1/groups/api", json!({"rate": "1/h", "burst": 3}));
    assert_eq!(code, 200, "{v}");
    let (code, v) = put(
        "/v1/policies/lim:?scope=prefix",
        json!({"rate": "1/h", "burst": 2}),
    );
    assert_eq!(code, 200, "{v}");
    let (code, v) = put("/v1/policies/grp:?scope=prefix", json!({"group": "api"}));
    assert_eq!(code, 200, "{v}");
    let v = get_ok(&s, "/v1/policies/lim:a");
    assert_eq!(
        (&v["from"], &v["prefix"]),
        (&json!("prefix"), &json!("lim:")),
        "{v}"
    );
    assert_eq!(
        (&v["policy"]["rate"], &v["policy"]["burst"]),
        (&json!("1/h"), &json!(2))
    );
    assert_eq!(get_ok(&s, "/v1/groups")["api"]["burst"], 3);
    let (code, v) = call(&s, "DELETE", "/v1/groups/api", Some("{}"), None);
    assert!(
        code == 400 && v["error"].as_str().unwrap().contains("grp:"),
        "{v}"
    );
    enqueue_n(&s, "lim:a", 5);
    for i in 0..3 {
        enqueue_n(&s, &format!("grp:{i}"), 2);
    }
    enqueue_n(&s, "free", 3);
    // The server reads the settings again within a second; claim and ack
    // until nothing more starts for a while.
    let mut started: Vec<String> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < deadline {
        for j in claim(&s, "w", 16, 100, 30_000) {
            let receipt = j["receipt"].clone();
            post_ok(&s, "/v1/ack", json!({ "receipts": [receipt] }));
            started.push(j["key"].as_str().unwrap().to_string());
        }
    }
    let n = |p: &str| started.iter().filter(|k| k.starts_with(p)).count();
    assert_eq!(
        (n("lim:"), n("grp:"), n("free")),
        (2, 3, 3),
        "a key's burst of 2, the group's 3 over its keys, the free key all: {started:?}"
    );
    let st = get_ok(&s, "/v1/status");
    assert_eq!(st["flow"]["groups"]["api"]["starts"], 3, "{st}");
    let held = st["flow"]["held_keys"].as_array().unwrap();
    assert!(
        held.iter().any(|h| h["by"] == "group api") && held.iter().any(|h| h["by"] == "its rate"),
        "keys held and why: {held:?}"
    );
    let (_, m) = call(&s, "GET", "/metrics", None, None);
    let m = m.as_str().unwrap();
    assert!(
        m.contains("shardq_flow_group_starts_total{group=\"api\"} 3"),
        "{m}"
    );
    let (code, v) = call(
        &s,
        "DELETE",
        "/v1/policies/lim:?scope=prefix",
        Some("{}"),
        None,
    );
    assert_eq!((code, &v["removed"]), (200, &json!(true)), "{v}");
    assert_eq!(get_ok(&s, "/v1/policies/lim:a")["from"], "default");
}

/// A key's concurrency set over HTTP: HTTP claims hand out that many of
/// its jobs at once, in order, never more (whether a claim came before the
/// server read the setting again or after); above the bound it is a 400
/// naming the value.
#[test]
fn a_keys_concurrency_set_over_http_holds_for_claims() {
    let dir = init_dir(1, "rendezvous");
    concurrency_over_http(dir.path());
}

/// The same on a Redis shard (the claim script starts the key's jobs two
/// at once).
#[test]
fn a_keys_concurrency_set_over_http_holds_for_claims_on_redis() {
    let redis = shardq_testkit::redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    concurrency_over_http(&init_redis_dir(&dir, &redis, 1));
}

/// A concurrency of 2 put over HTTP on a prefix: claims get the key's first
/// two jobs, then one more as one is acked; 257 is refused, naming it.
fn concurrency_over_http(data: &std::path::Path) {
    let s = start(data, options());
    let put = |path: &str, body: Value| call(&s, "PUT", path, Some(&body.to_string()), None);
    let (code, v) = put("/v1/policies/c:?scope=prefix", json!({"concurrency": 257}));
    assert!(
        code == 400 && v["error"].as_str().unwrap().contains("257"),
        "{v}"
    );
    let (code, v) = put("/v1/policies/c:?scope=prefix", json!({"concurrency": 2}));
    assert_eq!(code, 200, "{v}");
    let ids: Vec<Value> = enqueue_n(&s, "c:k", 5);
    let mut got: Vec<Value> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < deadline {
        got.extend(claim(&s, "w", 16, 100, 30_000));
    }
    let id_of = |j: &Value| j["id"].clone();
    assert_eq!(
        got.iter().map(id_of).collect::<Vec<_>>(),
        ids[..2].iter().map(id_of).collect::<Vec<_>>(),
        "two at once, the first two: {got:?}"
    );
    post_ok(
        &s,
        "/v1/ack",
        json!({ "receipts": [got[1]["receipt"].clone()] }),
    );
    let next = claim(&s, "w", 16, 100, 30_000);
    assert_eq!(
        next.iter().map(id_of).collect::<Vec<_>>(),
        ids[2..3].iter().map(id_of).collect::<Vec<_>>(),
        "one slot freed, the next job: {next:?}"
    );
}

/// `POST /v1/fail` with `backoff_ms` ends the run without using an
/// attempt: the job is claimable again only after the wait, with the same
/// attempt number, and its old receipt is refused.
#[test]
fn a_fail_with_backoff_uses_no_attempt_and_holds_the_key() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    enqueue(
        &s,
        json!([{"key": "bo", "payload": "p", "max_attempts": 1}]),
    );
    let job = claim(&s, "w", 1, 0, 30_000).remove(0);
    let (code, v) = post(
        &s,
        "/v1/fail",
        json!({"receipt": job["receipt"], "retry_in_ms": 5, "backoff_ms": 10}),
    );
    assert_eq!(code, 400, "not both: {v}");
    let (code, v) = post(
        &s,
        "/v1/fail",
        json!({"receipt": job["receipt"], "backoff_ms": 600, "backoff_group": true}),
    );
    assert_eq!(
        (code, &v["outcome"], &v["group"]),
        (200, &json!("backoff"), &Value::Null),
        "{v}"
    );
    let (code, _) = post(
        &s,
        "/v1/fail",
        json!({"receipt": job["receipt"], "backoff_ms": 1}),
    );
    assert_eq!(code, 409, "the old receipt is over");
    let t = Instant::now();
    let again = claim(&s, "w", 1, 5_000, 30_000);
    assert_eq!(again.len(), 1);
    assert!(
        t.elapsed() >= Duration::from_millis(450),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(
        (&again[0]["id"], &again[0]["attempt"]),
        (&job["id"], &json!(1))
    );
}

/// An operator lifts a handler's back-off of a key over HTTP
/// (`POST /v1/keys/{key}/resume`, admin: the role test covers every route):
/// the key's job starts at the next claim, its attempt unused, while
/// another key's back-off stands; both key views show a back-off until it
/// is lifted. A key none holds answers `resumed: false`; a bad or empty
/// key or a body with fields is a 400, a key moving to another shard a 409
/// with `state: moving`, a path below the route a 404, each with its kind.
#[test]
fn a_keys_back_off_is_lifted_over_http() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    enqueue(
        &s,
        json!([{"key": "held", "payload": "h"}, {"key": "other", "payload": "o"}]),
    );
    let mut runs = Vec::new();
    wait_until("two runs", Duration::from_secs(10), || {
        runs.extend(claim(&s, "w", 2, 500, 30_000));
        runs.len() >= 2
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for r in &runs {
        let v = post_ok(
            &s,
            "/v1/fail",
            json!({"receipt": r["receipt"], "backoff_ms": 600_000}),
        );
        assert_eq!(v["outcome"], "backoff", "{v}");
    }
    let id_of = |k: &str| runs.iter().find(|r| r["key"] == k).unwrap()["id"].clone();
    for path in ["/v1/keys/held", "/v1/keys/held/jobs"] {
        let v = get_ok(&s, path);
        assert_eq!(v["back_off"]["jobs"], json!([id_of("held")]), "{path}: {v}");
        let until = v["back_off"]["until_ms"].as_u64().unwrap();
        assert!(until >= now + 590_000, "{path}: {v}");
    }
    let v = post_ok(&s, "/v1/keys/held/resume", json!({}));
    assert_eq!(v["resumed"], true, "{v}");
    assert_eq!(v["back_off"]["jobs"], json!([id_of("held")]), "{v}");
    assert_eq!(v["shard"], runs[0]["shard"], "{v}");
    for path in ["/v1/keys/held", "/v1/keys/held/jobs"] {
        assert_eq!(get_ok(&s, path)["back_off"], Value::Null, "{path}");
    }
    let t = Instant::now();
    let again = claim(&s, "w", 2, 5_000, 30_000);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(again.len(), 1, "only the resumed key starts: {again:?}");
    assert_eq!(
        (&again[0]["id"], &again[0]["attempt"]),
        (&id_of("held"), &json!(1))
    );
    post_ok(&s, "/v1/ack", json!({"receipts": [again[0]["receipt"]]}));
    assert!(!get_ok(&s, "/v1/keys/other")["back_off"].is_null());
    // No back-off: nothing changes, and it says so.
    for key in ["held", "never-seen"] {
        let v = post_ok(&s, &format!("/v1/keys/{key}/resume"), json!({}));
        assert_eq!(
            (&v["resumed"], &v["back_off"]),
            (&json!(false), &Value::Null)
        );
    }
    // Refusals, each with its kind.
    let long = "k".repeat(shardq_core::KEY_BYTES_MAX + 1);
    for (path, body) in [
        (format!("/v1/keys/{long}/resume"), "{}"),
        ("/v1/keys//resume".to_string(), "{}"),
        ("/v1/keys/other/resume".to_string(), r#"{"all":true}"#),
    ] {
        let (code, v) = call(&s, "POST", &path, Some(body), None);
        assert_eq!((code, &v["kind"]), (400, &json!("bad_input")), "{v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains(if body == "{}" { "key" } else { "all" }),
            "{v}"
        );
    }
    let (code, v) = call(&s, "POST", "/v1/keys/other/resume/now", Some("{}"), None);
    assert_eq!((code, &v["kind"]), (404, &json!("not_found")), "{v}");
    // A key moving to another shard (sealed for a rebalance) is left as it is.
    let d = shardq_deploy::Deployment::open(dir.path(), &Default::default()).unwrap();
    let (q, shard) = (d.queue(), runs[0]["shard"].as_str().unwrap().to_string());
    let mut fence = q.fence(&shard).unwrap();
    fence.sealed_keys.insert("other".into(), "elsewhere".into());
    q.set_fence(&shard, &fence).unwrap();
    let (code, v) = post(&s, "/v1/keys/other/resume", json!({}));
    assert_eq!(
        (code, &v["kind"], &v["state"]),
        (409, &json!("conflict"), &json!("moving")),
        "{v}"
    );
    assert!(!get_ok(&s, "/v1/keys/other")["back_off"].is_null());
    fence.sealed_keys.remove("other");
    q.set_fence(&shard, &fence).unwrap();
    let v = post_ok(&s, "/v1/keys/other/resume", json!({}));
    assert_eq!(v["back_off"]["jobs"], json!([id_of("other")]), "{v}");
    let last = claim(&s, "w", 2, 5_000, 30_000);
    assert_eq!(last.len(), 1, "{last:?}");
    assert_eq!(last[0]["id"], id_of("other"));
}

/// Weights hold over every shard the server runs: one claim of one job at
/// a time goes to the best-ranked ready key over all of them, so a key of
/// weight 4 and one of weight 1 on two different shards start 4:1 (each
/// shard taking its turn, they started 1:1).
#[test]
fn weights_share_claims_across_the_servers_shards() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    wait_until(
        "the server owns its 2 shards",
        Duration::from_secs(30),
        || owned_shards(&s) == 2,
    );
    // A claim first, so the server has read the (empty) settings: the
    // policies below are then in use only because a server puts what it
    // stored itself in use at once, not because its first read is late.
    assert!(claim(&s, "w", 1, 0, 30_000).is_empty());
    let put = |path: &str, body: Value| call(&s, "PUT", path, Some(&body.to_string()), None);
    for (p, w) in [("w1:", 1), ("w4:", 4)] {
        let (code, v) = put(
            &format!("/v1/policies/{p}?scope=prefix"),
            json!({ "weight": w }),
        );
        assert_eq!(code, 200, "{v}");
    }
    let map = std::fs::read_to_string(dir.path().join("shardmap.yaml")).unwrap();
    let router = shardq_route::Router::from_yaml(&map).unwrap();
    let light = "w1:a";
    let heavy = (0..64)
        .map(|i| format!("w4:{i}"))
        .find(|k| router.route(k) != router.route(light))
        .expect("a key on another shard");
    // No wait: a server puts the settings it stored itself in use at once.
    enqueue_n(&s, light, 60);
    enqueue_n(&s, &heavy, 60);
    let mut light_starts = 0;
    for _ in 0..50 {
        let jobs = claim(&s, "w", 1, 1000, 30_000);
        assert_eq!(jobs.len(), 1, "one job per claim");
        if jobs[0]["key"] == light {
            light_starts += 1;
        }
        post_ok(
            &s,
            "/v1/ack",
            json!({ "receipts": [jobs[0]["receipt"].clone()] }),
        );
    }
    assert!(
        (light_starts - 10i32).abs() <= 2,
        "weights 1:4 over two shards, 50 claims: {light_starts} of the weight-1 key"
    );
}

/// Every acknowledged settings change is stored: 40 concurrent `PUT
/// /v1/policies/KEY` spread over two servers of one data dir all answer
/// 200 and all are there afterwards; a group deleted while policies
/// naming it are put either stays (the policies name it) or goes (no
/// policy names it): never a policy naming a group that is gone.
#[test]
fn concurrent_settings_changes_on_two_servers_are_all_stored() {
    let dir = init_dir(2, "rendezvous");
    let a = start(dir.path(), options());
    let b = start(dir.path(), options());
    let servers = [&a, &b];
    std::thread::scope(|scope| {
        for i in 0..40 {
            let s = servers[i % 2];
            scope.spawn(move || {
                let (code, v) = call(
                    s,
                    "PUT",
                    &format!("/v1/policies/k{i}"),
                    Some(r#"{"concurrency":2,"rate":"5/s"}"#),
                    None,
                );
                assert_eq!(code, 200, "PUT k{i}: {v}");
            });
        }
    });
    let all = get_ok(&a, "/v1/policies");
    for i in 0..40 {
        assert_eq!(
            all["keys"][format!("k{i}")]["concurrency"],
            2,
            "k{i} lost: {all}"
        );
    }
    for round in 0..10 {
        let g = format!("g{round}");
        let (code, v) = call(
            &a,
            "PUT",
            &format!("/v1/groups/{g}"),
            Some(r#"{"concurrency":3}"#),
            None,
        );
        assert_eq!(code, 200, "{v}");
        let body = format!(r#"{{"group":"{g}"}}"#);
        let (put, del) = std::thread::scope(|scope| {
            let put = scope.spawn(|| {
                call(
                    &b,
                    "PUT",
                    &format!("/v1/policies/p{round}"),
                    Some(&body),
                    None,
                )
            });
            let del = scope.spawn(|| call(&a, "DELETE", &format!("/v1/groups/{g}"), None, None));
            (put.join().unwrap(), del.join().unwrap())
        });
        let all = get_ok(&a, "/v1/policies");
        let stored_policy = all["keys"][format!("p{round}")]["group"] == g.as_str();
        let group_there = all["groups"].get(&g).is_some();
        // A policy naming a group keeps it: the delete is refused (400)
        // once the policy is stored, or the policy is refused once the
        // group is gone; both answered, neither lost.
        assert_eq!(put.0 == 200, stored_policy, "put {put:?}, stored: {all}");
        assert_eq!(
            del.0 == 200 && del.1["removed"] == true,
            !group_there,
            "delete {del:?}, stored: {all}"
        );
        assert!(
            !stored_policy || group_there,
            "policy names a deleted group: {all}"
        );
    }
}

/// A shard added live is run by a server within about a second of being
/// published, not a whole lease tick later: with 30 s leases (a 10 s
/// tick), the new shard is owned well before the next regular tick.
#[test]
fn a_shard_added_live_is_taken_within_a_second_or_so() {
    let dir = init_dir(2, "rendezvous");
    let mut o = options();
    o.worker.lease_ms = 30_000;
    let s = start(dir.path(), o);
    assert_eq!(owned_shards(&s), 2);
    // The first tick ran before `start` returned (`OwnerThread::start`),
    // so the next regular one is ~10 s away.
    let (code, v) = post(&s, "/v1/admin/add-shard", json!({"name": "shard-9"}));
    assert_eq!(code, 200, "{v}");
    let t = std::time::Instant::now();
    wait_until("the new shard to be run", Duration::from_secs(5), || {
        owned_shards(&s) == 3
    });
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A finished job is answered by `GET /v1/jobs/{id}` while the retention
/// keeps it (its outcome and attempts), and a cancelled one too.
#[test]
fn finished_and_cancelled_jobs_are_shown_by_id() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let jobs = enqueue_n(&s, "k", 2);
    let first = jobs[0]["id"].as_str().unwrap().to_string();
    let second = jobs[1]["id"].as_str().unwrap().to_string();
    let run = claim(&s, "w", 1, 0, 30_000).remove(0);
    post_ok(&s, "/v1/ack", json!({ "receipts": [run["receipt"]] }));
    let (code, v) = call(
        &s,
        "DELETE",
        &format!("/v1/jobs/{second}"),
        Some("{}"),
        None,
    );
    assert_eq!(code, 200, "{v}");
    let v = get_ok(&s, &format!("/v1/jobs/{first}"));
    assert_eq!(
        (&v["outcome"], &v["attempts"]),
        (&json!("completed"), &json!(1)),
        "{v}"
    );
    let v = get_ok(&s, &format!("/v1/jobs/{second}"));
    assert_eq!(v["outcome"], "cancelled", "{v}");
    let (code, v) = get(&s, "/v1/jobs/shard-0:999");
    assert_eq!(code, 404, "{v}");
}

/// A claim's `timeout_ms` is kept by the server: a worker that keeps
/// extending a hung run past it still has the run failed at its deadline
/// (an attempt used, the reason says so), its late extend and ack are
/// refused (409), and the key's next attempt starts; out of attempts the
/// job is dead. A bad timeout is refused naming the field.
#[test]
fn a_claims_job_timeout_fails_the_run_whatever_its_extends() {
    let dir = init_dir(1, "rendezvous");
    // The second attempt is claimable at once, not after the default
    // 10 s backoff.
    quick_retries(dir.path());
    let s = start(dir.path(), options());
    let (code, v) = post(&s, "/v1/claim", json!({"worker": "w", "timeout_ms": 0}));
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("timeout_ms"), "{v}");
    enqueue(
        &s,
        json!([{"key": "k", "payload": "hang", "max_attempts": 2}]),
    );
    let take = || {
        let mut got = Vec::new();
        wait_until("a run", Duration::from_secs(10), || {
            got = post_ok(
                &s,
                "/v1/claim",
                json!({"worker": "w", "max": 1, "wait_ms": 500, "timeout_ms": 400}),
            )["jobs"]
                .as_array()
                .unwrap()
                .clone();
            !got.is_empty()
        });
        got.remove(0)
    };
    let run = take();
    assert!(run["timeout_expires_ms"].as_u64().is_some(), "{run}");
    let receipt = run["receipt"].as_str().unwrap().to_string();
    let started = Instant::now();
    // A worker whose handler hangs, extending every 100 ms.
    let refused_after = loop {
        let (code, _) = post(
            &s,
            "/v1/extend",
            json!({"receipts": [receipt], "lease_ms": 30000}),
        );
        if code == 409 {
            break started.elapsed();
        }
        assert_eq!(code, 200);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never timed out"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        refused_after >= Duration::from_millis(350),
        "timed out early: {refused_after:?}"
    );
    let (code, v) = post(&s, "/v1/ack", json!({"receipts": [receipt]}));
    assert_eq!(code, 409, "a late ack: {v}");
    let id = run["id"].as_str().unwrap();
    let job = get_ok(&s, &format!("/v1/jobs/{id}"));
    assert_eq!(job["attempts"], 1, "{job}");
    // The second attempt times out too: dead, with the reason.
    let again = take();
    assert_eq!(
        (again["id"].as_str(), again["attempt"].as_u64()),
        (Some(id), Some(2))
    );
    wait_until("the job dead", Duration::from_secs(5), || {
        let d = get_ok(&s, "/v1/dead");
        d["dead"].as_array().is_some_and(|l| {
            l.iter().any(|j| {
                j["id"] == id
                    && j["reason"]
                        .as_str()
                        .unwrap_or("")
                        .contains("job timeout of 400 ms")
            })
        })
    });
}

/// `serve --on-dead halt`: a key with a dead job starts none of its later
/// jobs until the dead job is retried or purged; other keys run on.
#[test]
fn halt_on_dead_holds_the_key_for_http_workers() {
    let dir = init_dir(1, "rendezvous");
    let mut opts = options();
    opts.open.engine.dead_policy = shardq_core::DeadPolicy::Halt;
    let s = start(dir.path(), opts);
    enqueue(
        &s,
        json!([
            {"key": "k", "payload": "poison", "max_attempts": 1},
            {"key": "k", "payload": "after"},
        ]),
    );
    let mut got = Vec::new();
    wait_until("the poison job", Duration::from_secs(10), || {
        got.extend(claim(&s, "w", 10, 500, 30_000));
        !got.is_empty()
    });
    assert_eq!(got.len(), 1, "one run of k at a time: {got:?}");
    let r = got[0]["receipt"].clone();
    let out = post_ok(&s, "/v1/fail", json!({"receipt": r, "reason": "bad"}));
    assert_eq!(out["outcome"], "dead");
    enqueue(&s, json!([{"key": "other", "payload": "x"}]));
    let mut later = Vec::new();
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        later.extend(claim(&s, "w", 10, 300, 30_000));
    }
    let keys: Vec<&str> = later.iter().map(|j| j["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["other"], "k halted behind its dead job");
    post_ok(&s, "/v1/dead/purge", json!({"all": true}));
    let mut next = Vec::new();
    wait_until("k's next job", Duration::from_secs(10), || {
        next.extend(claim(&s, "w", 10, 500, 30_000));
        !next.is_empty()
    });
    assert_eq!(next[0]["payload"], "after");
}

/// Unique and debounced jobs over `POST /v1/jobs`: a unique job answers
/// the waiting one (`duplicate`), a burst of debounced jobs in one request
/// and across requests leaves one job with the last payload and its start
/// pushed; mixes and bad values are refused naming the job and the field,
/// and a plain dedup id in the keyed namespaces is refused.
#[test]
fn unique_and_debounced_jobs_over_http() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    let u = enqueue(
        &s,
        json!([{"key": "t-u", "payload": "a", "unique_id": "sync"},
               {"key": "t-u", "payload": "b", "unique_id": "sync", "unique_while": "running"}]),
    );
    assert_eq!(
        (u[0]["duplicate"].clone(), u[1]["duplicate"].clone()),
        (json!(false), json!(true))
    );
    assert_eq!(u[0]["id"], u[1]["id"], "{u:?}");
    let burst: Vec<Value> = (0..5)
        .map(|i| json!({"key": "t-d", "payload": format!("v{i}"), "debounce_id": "recalc", "debounce_ms": 60_000}))
        .collect();
    let d = enqueue(&s, Value::Array(burst));
    let later = enqueue(
        &s,
        json!([{"key": "t-d", "payload": "last", "debounce_id": "recalc", "debounce_ms": 60_000}]),
    );
    assert!(
        d.iter()
            .chain(&later)
            .all(|x| x["id"] == d[0]["id"] && x["duplicate"] == false),
        "{d:?} {later:?}"
    );
    let job = get_ok(&s, &format!("/v1/jobs/{}", d[0]["id"].as_str().unwrap()));
    assert_eq!(
        (job["payload"].clone(), job["state"].clone()),
        (json!("last"), json!("delayed")),
        "{job}"
    );
    assert_eq!(job["dedup_id"], "debounce:recalc");
    let listed = get_ok(&s, "/v1/keys/t-d/jobs");
    assert_eq!(listed["jobs"].as_array().unwrap().len(), 1, "{listed}");
    for (body, words) in [
        (
            json!({"key": "k", "payload": "x", "unique_id": "a", "debounce_id": "b", "debounce_ms": 5}),
            "not both",
        ),
        (
            json!({"key": "k", "payload": "x", "debounce_id": "b"}),
            "debounce",
        ),
        (
            json!({"key": "k", "payload": "x", "unique_id": "a", "unique_while": "later"}),
            "queued or running",
        ),
        (
            json!({"key": "k", "payload": "x", "unique_id": "a", "dedup_id": "c"}),
            "dedup id",
        ),
        (
            json!({"key": "k", "payload": "x", "debounce_id": "b", "debounce_ms": 5, "delay_ms": 7}),
            "delay",
        ),
        (
            json!({"key": "k", "payload": "x", "debounce_id": "b", "debounce_ms": 90_000_000}),
            "debounce",
        ),
        (
            json!({"key": "k", "payload": "x", "dedup_id": "unique:a"}),
            "kept for unique",
        ),
        (
            json!({"key": "k", "payload": "x", "dedup_id": "pg:shardq:7"}),
            "kept for the Postgres outbox",
        ),
    ] {
        let (code, v) = post(
            &s,
            "/v1/jobs",
            json!({"jobs": [{"key": "ok", "payload": "y"}, body]}),
        );
        assert_eq!(code, 400, "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("jobs[1]") && e.contains(words), "{words}: {e}");
    }
}
