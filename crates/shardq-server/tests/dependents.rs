//! Dependents over HTTP: a graph sent in one request is stored whole (a
//! root released at the next pass, each node after the ones it names),
//! each node's handler is told its id and reads its dependencies' results,
//! a waiting node is listed with its key and its result waited for; bad
//! graphs and bad ids are refused naming the field and value, with nothing
//! stored.

use std::time::Duration;

use serde_json::{json, Value};

mod support;

use support::{claim, enqueue, get, get_ok, init_dir, options, post, post_ok, start, wait_until};

/// Claims until a job of `key` is handed out (the resolver releases it
/// within a pass or so).
fn claim_key(s: &shardq_server::Running, key: &str) -> Value {
    let mut found = None;
    wait_until(
        &format!("a job of {key} to be claimable"),
        Duration::from_secs(10),
        || {
            for j in claim(s, "w", 4, 200, 30_000) {
                if j["key"] == key {
                    found = Some(j);
                } else {
                    post_ok(
                        s,
                        "/v1/fail",
                        json!({ "receipt": j["receipt"], "reason": "not yet", "retry_in_ms": 0 }),
                    );
                }
            }
            found.is_some()
        },
    );
    found.unwrap()
}

#[test]
fn a_graph_is_stored_whole_and_runs_in_dependency_order_with_results() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    let ids: Vec<String> = enqueue(
        &s,
        json!([
            {"key": "g-root", "payload": "r"},
            {"key": "g-mid", "payload": "m", "after": [0]},
            {"key": "g-end", "payload": "e", "after": [0, 1], "on_dependency_failure": "run"},
        ]),
    )
    .iter()
    .map(|j| {
        assert_eq!(j["waiting"], true, "{j}");
        assert_eq!(j["shard"], "", "{j}");
        j["id"].as_str().unwrap().to_string()
    })
    .collect();
    assert!(ids.iter().all(|i| i.starts_with('@')), "{ids:?}");
    // The end waits; its key lists it.
    let v = get_ok(&s, "/v1/keys/g-end/jobs");
    assert_eq!(v["waiting"][0]["id"], ids[2], "{v}");
    assert_eq!(v["waiting"][0]["state"], "waiting", "{v}");
    let root = claim_key(&s, "g-root");
    assert_eq!(root["dependent"], ids[0], "{root}");
    post_ok(
        &s,
        "/v1/ack",
        json!({ "receipts": [root["receipt"]], "results": [{"result": "root-result"}] }),
    );
    let mid = claim_key(&s, "g-mid");
    assert_eq!(mid["dependent"], ids[1], "{mid}");
    let v = get_ok(&s, &format!("/v1/jobs/{}", ids[1]));
    assert_eq!(v["state"], "released", "{v}");
    assert_eq!(v["after"][0]["id"], ids[0], "{v}");
    assert_eq!(v["after"][0]["outcome"], "completed", "{v}");
    assert_eq!(v["after"][0]["result"], "root-result", "{v}");
    assert_eq!(v["job"]["state"], "running", "{v}");
    // The end's result is waited for by its @N id.
    let (code, v) = get(&s, &format!("/v1/jobs/{}/result?wait_ms=0", ids[2]));
    assert_eq!((code, &v["state"]), (200, &json!("waiting")), "{v}");
    post_ok(
        &s,
        "/v1/ack",
        json!({ "receipts": [mid["receipt"]], "results": [{"result": "mid-result"}] }),
    );
    let end = claim_key(&s, "g-end");
    post_ok(
        &s,
        "/v1/ack",
        json!({ "receipts": [end["receipt"]], "results": [{"result": "done"}] }),
    );
    let (code, v) = get(&s, &format!("/v1/jobs/{}/result?wait_ms=5000", ids[2]));
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (&v["outcome"], &v["result"], &v["dependent"]),
        (&json!("completed"), &json!("done"), &json!(ids[2])),
        "{v}"
    );
    let st = get_ok(&s, "/v1/status");
    assert_eq!(st["dependents"]["released"], 3, "{st}");
}

#[test]
fn bad_graphs_and_ids_are_refused_naming_them_and_nothing_is_stored() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let job = enqueue(&s, json!([{"key": "k", "payload": "p"}]))[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let cases: Vec<(Value, &str)> = vec![
        (
            json!([{"key": "a", "payload": "x", "after": [1]}, {"key": "b", "payload": "x", "after": [0]}]),
            "cycles",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [0]}]),
            "jobs[0].after[0]",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [5]}]),
            "jobs[0].after[0]",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [job, job]}]),
            "jobs[0].after[1]",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": ["shard-0:999999"]}]),
            "shard-0:999999",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": ["@42"]}]),
            "@42",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [true]}]),
            "jobs[0].after[0]",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [job], "unique_id": "u"}]),
            "unique_id",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [job], "on_dependency_failure": "maybe"}]),
            "\"maybe\"",
        ),
        (
            json!([{"key": "a", "payload": "x", "on_dependency_failure": "run"}]),
            "jobs[0].on_dependency_failure",
        ),
        (
            json!([{"key": "a", "payload": "x", "after": [job]}, {"key": "b", "payload": "x", "on_dependency_failure": "run"}]),
            "jobs[1].on_dependency_failure",
        ),
        (
            json!([{"key": "a", "payload": "x", "dedup_id": "d", "after": [job]}, {"key": "a", "payload": "y", "dedup_id": "d", "after": [job]}]),
            "jobs[1].dedup_id",
        ),
        (
            json!([{"key": "a", "payload": "x".repeat(70_000), "after": [job]}]),
            "65536",
        ),
    ];
    for (jobs, says) in cases {
        let (code, v) = post(&s, "/v1/jobs", json!({ "jobs": jobs }));
        assert_eq!(code, 400, "{jobs}: {v}");
        let msg = v["error"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains(says), "{jobs}: {msg}");
    }
    let st = get_ok(&s, "/v1/status");
    assert_eq!(st["dependents"]["waiting"], 0, "{st}");
    // A graph whose jobs carry dedup ids, sent again after a lost answer,
    // is stored once.
    let graph = json!({ "jobs": [
        {"key": "d-root", "payload": "r", "dedup_id": "order-7/root"},
        {"key": "d-end", "payload": "e", "dedup_id": "order-7/end", "after": [0, job]},
    ]});
    let first = post_ok(&s, "/v1/jobs", graph.clone());
    let again = post_ok(&s, "/v1/jobs", graph);
    for i in 0..2 {
        assert_eq!(
            first["jobs"][i]["id"], again["jobs"][i]["id"],
            "{first} {again}"
        );
        assert_eq!(
            (
                &first["jobs"][i]["duplicate"],
                &again["jobs"][i]["duplicate"]
            ),
            (&json!(false), &json!(true))
        );
    }
    let st = get_ok(&s, "/v1/status");
    assert_eq!(
        st["dependents"]["waiting"].as_u64().unwrap_or(0)
            + st["dependents"]["released"].as_u64().unwrap_or(0),
        2,
        "{st}"
    );
    let (code, v) = get(&s, "/v1/jobs/@x");
    assert_eq!(code, 400, "{v}");
    let (code, v) = get(&s, "/v1/jobs/@999");
    assert_eq!(code, 404, "{v}");
}
