//! Batches over HTTP: one opened, jobs added in one request (sent again
//! with dedup ids: stored once), a job of the batch told its batch, the
//! batch closed, its callbacks claimed once each with their kind, the batch
//! shown complete; bad bodies and ids refused naming the field and value.

use std::time::Duration;

use serde_json::{json, Value};

mod support;

use support::{claim, get, get_ok, init_dir, options, post, post_ok, start, wait_until};

/// Claims and acks everything until `want` callbacks have been claimed
/// (the resolver releases jobs and callbacks within a pass or so); the
/// callbacks claimed, in order.
fn run_until_callbacks(s: &shardq_server::Running, want: usize) -> Vec<Value> {
    let mut callbacks = Vec::new();
    wait_until(
        &format!("{want} callbacks"),
        Duration::from_secs(10),
        || {
            for j in claim(s, "w", 16, 200, 30_000) {
                assert_eq!(j["batch"], "@1", "{j}");
                if j.get("batch_callback").is_some() {
                    callbacks.push(j.clone());
                }
                post_ok(
                    s,
                    "/v1/ack",
                    json!({ "receipts": [j["receipt"]], "results": [{"result": format!("r-{}", j["payload"].as_str().unwrap())}] }),
                );
            }
            callbacks.len() >= want
        },
    );
    callbacks
}

#[test]
fn a_batch_over_http_fires_its_callbacks_once_each() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    let v = post_ok(
        &s,
        "/v1/batches",
        json!({"key": "cb", "on_complete": "done", "on_success": "all-ok", "on_death": "died"}),
    );
    assert_eq!(v, json!({"id": "@1", "duplicate": false}));
    let jobs: Vec<Value> = (0..6)
        .map(|i| json!({"key": format!("k{}", i % 3), "payload": format!("p{i}"), "batch": "@1", "dedup_id": format!("d{i}")}))
        .collect();
    let first = post_ok(&s, "/v1/jobs", json!({ "jobs": jobs.clone() }));
    let again = post_ok(&s, "/v1/jobs", json!({ "jobs": jobs }));
    for (a, b) in first["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(again["jobs"].as_array().unwrap())
    {
        assert_eq!(
            (a["waiting"].clone(), a["batch"].clone()),
            (json!(true), json!("@1")),
            "{a}"
        );
        assert_eq!(a["id"], b["id"]);
        assert_eq!(
            (a["duplicate"].clone(), b["duplicate"].clone()),
            (json!(false), json!(true))
        );
    }
    let v = get_ok(&s, "/v1/batches/@1");
    assert_eq!(v["state"], "open", "{v}");
    assert_eq!(v["counts"]["jobs"], 6, "{v}");
    // Open: the jobs run, no callback fires.
    wait_until("the batch's jobs to end", Duration::from_secs(10), || {
        for j in claim(&s, "w", 16, 100, 30_000) {
            assert!(
                j.get("batch_callback").is_none(),
                "a callback while open: {j}"
            );
            assert_eq!(j["batch"], "@1", "{j}");
            post_ok(
                &s,
                "/v1/ack",
                json!({ "receipts": [j["receipt"]], "results": [{"result": "x"}] }),
            );
        }
        get_ok(&s, "/v1/batches/@1")["counts"]["completed"] == 6
    });
    assert_eq!(
        post_ok(&s, "/v1/batches/@1/close", json!({})),
        json!({"id": "@1", "closed": true})
    );
    assert_eq!(
        post_ok(&s, "/v1/batches/@1/close", json!({}))["closed"],
        false
    );
    let cbs = run_until_callbacks(&s, 2);
    let mut kinds: Vec<&str> = cbs
        .iter()
        .map(|c| c["batch_callback"].as_str().unwrap())
        .collect();
    kinds.sort();
    assert_eq!(kinds, ["complete", "success"]);
    let v = get_ok(&s, "/v1/batches/@1");
    assert_eq!(v["state"], "complete", "{v}");
    assert!(v["callbacks"]["death"]["fired"].is_null(), "{v}");
    assert!(v["callbacks"]["complete"]["fired"].is_string(), "{v}");
    assert_eq!(v["jobs"][0]["result"], "x", "{v}");
    // Its @N as a job id answers the batch; it has no result of its own.
    assert_eq!(get_ok(&s, "/v1/jobs/@1"), v);
    let (code, r) = get(&s, "/v1/jobs/@1/result");
    assert_eq!(code, 400, "{r}");
    assert!(r["error"].as_str().unwrap().contains("batch"), "{r}");
    // No callback twice, and a complete batch takes no job.
    std::thread::sleep(Duration::from_millis(300)); // negative check: three passes
    assert!(claim(&s, "w", 16, 100, 30_000).is_empty());
    let (code, v) = post(
        &s,
        "/v1/jobs",
        json!({"jobs": [{"key": "k", "payload": "late", "batch": "@1"}]}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("@1"), "{v}");
}

#[test]
fn bad_batches_are_refused_naming_them() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    for (body, says) in [
        (json!({"key": "cb"}), "on_complete"),
        (json!({"key": "", "on_complete": "x"}), "key"),
        (
            json!({"key": "cb", "on_complete": "x", "colour": 1}),
            "colour",
        ),
        (json!([]), ""),
    ] {
        let (code, v) = post(&s, "/v1/batches", body.clone());
        assert_eq!(code, 400, "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(says), "{body}: {v}");
    }
    post_ok(&s, "/v1/batches", json!({"key": "cb", "on_death": "x"}));
    for (jobs, says) in [
        (json!([{"key": "k", "payload": "p", "batch": "7"}]), "\"7\""),
        (json!([{"key": "k", "payload": "p", "batch": "@99"}]), "@99"),
        (
            json!([{"key": "k", "payload": "p", "batch": "@1"}, {"key": "k", "payload": "q"}]),
            "jobs[1].batch",
        ),
        (
            json!([{"key": "k", "payload": "p", "batch": "@1", "after": ["@1"]}]),
            "after",
        ),
        (
            json!([{"key": "k", "payload": "p", "batch": "@1", "dedup_id": "batch:@1:death"}]),
            "dedup_id",
        ),
    ] {
        let (code, v) = post(&s, "/v1/jobs", json!({ "jobs": jobs }));
        assert_eq!(code, 400, "{jobs}: {v}");
        assert!(v["error"].as_str().unwrap().contains(says), "{jobs}: {v}");
    }
    assert_eq!(get_ok(&s, "/v1/batches/@1")["counts"]["jobs"], 0);
    let (code, v) = get(&s, "/v1/batches/@42");
    assert_eq!(code, 404, "{v}");
    let (code, v) = get(&s, "/v1/batches/42");
    assert_eq!(code, 400, "{v}");
}
