//! `openapi.json` against what the server does, route by route: every JSON
//! answer of a documented route is checked against the schema the document
//! gives it, and every integer bound of a request body is tried at its
//! edges (the bound taken, one past it refused naming the field).
//!
//! The check is a small validator of the OpenAPI 3.0 schema subset the
//! document uses (`$ref`, `oneOf`, `type`, `nullable`, `enum`, `minimum`,
//! `maximum`, `required`, `properties`, `additionalProperties`, `items`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};

mod support;

use support::{call, claim, init_dir, options, post_ok, start, wait_until};

fn doc() -> Value {
    serde_json::from_str(shardq_server::OPENAPI_JSON).unwrap()
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let name = r
                .strip_prefix("#/components/schemas/")
                .expect("a local ref");
            let s = &doc["components"]["schemas"][name];
            assert!(!s.is_null(), "{r} names no schema");
            resolve(doc, s)
        }
        None => schema,
    }
}

/// Where `v` breaks `schema`, as "PATH: what" lines.
fn check(doc: &Value, schema: &Value, v: &Value, at: &str, errs: &mut Vec<String>) {
    let schema = resolve(doc, schema);
    if let Some(options) = schema.get("oneOf").and_then(Value::as_array) {
        let fits = options.iter().any(|o| {
            let mut e = Vec::new();
            check(doc, o, v, at, &mut e);
            e.is_empty()
        });
        if !fits {
            errs.push(format!("{at}: {v} fits none of oneOf"));
        }
        return;
    }
    if v.is_null() {
        if schema["nullable"] != json!(true) && schema.get("type").is_some() {
            errs.push(format!("{at}: null, but the document says not nullable"));
        }
        return;
    }
    let ty = schema.get("type").and_then(Value::as_str);
    let type_ok = match ty {
        None => true,
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some(other) => panic!("{at}: a type the validator does not know: {other}"),
    };
    if !type_ok {
        errs.push(format!("{at}: {v} is not of type {}", ty.unwrap_or("")));
        return;
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        if !values.contains(v) {
            errs.push(format!("{at}: {v} is not one of {values:?}"));
        }
    }
    if let Some(n) = v.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
            if n < min {
                errs.push(format!("{at}: {n} below the documented minimum {min}"));
            }
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64) {
            if n > max {
                errs.push(format!("{at}: {n} above the documented maximum {max}"));
            }
        }
    }
    if let Some(obj) = v.as_object() {
        for r in schema["required"].as_array().into_iter().flatten() {
            let r = r.as_str().unwrap();
            if !obj.contains_key(r) {
                errs.push(format!("{at}: required field {r:?} missing"));
            }
        }
        let props = schema["properties"].as_object();
        for (k, fv) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(s) => check(doc, s, fv, &format!("{at}.{k}"), errs),
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        errs.push(format!("{at}: field {k:?} is not documented"))
                    }
                    Some(s @ Value::Object(_)) => check(doc, s, fv, &format!("{at}.{k}"), errs),
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), v.as_array()) {
        for (i, item) in list.iter().enumerate() {
            check(doc, items, item, &format!("{at}[{i}]"), errs);
        }
    }
}

/// The documented schema of `method path`'s answer `code`.
fn answer_schema<'a>(doc: &'a Value, method: &str, path: &str, code: u16) -> &'a Value {
    let op = &doc["paths"][path][method.to_lowercase()];
    assert!(!op.is_null(), "{method} {path} is not documented");
    let s = &op["responses"][code.to_string()]["content"]["application/json"]["schema"];
    assert!(
        !s.is_null(),
        "{method} {path} documents no JSON answer {code}"
    );
    s
}

/// Calls `method target` (the documented `path` with its parameters
/// filled in) and checks the answer against the document; returns it.
fn checked(
    s: &shardq_server::Running,
    method: &str,
    path: &str,
    target: &str,
    body: Option<Value>,
    errs: &mut Vec<String>,
) -> (u16, Value) {
    let doc = doc();
    let text = body.map(|b| b.to_string());
    let (code, v) = call(s, method, target, text.as_deref(), None);
    let schema = answer_schema(&doc, method, path, code);
    check(&doc, schema, &v, &format!("{method} {target} {code}"), errs);
    (code, v)
}

/// Every documented route with a JSON answer, called on a deployment with
/// live, running, finished and dead jobs, a key held by a back-off, a
/// policy without a burst and a group: each answer fits its schema.
#[test]
fn every_answer_fits_its_documented_schema() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let mut errs = Vec::new();
    let e = &mut errs;
    let ids = place_jobs(&s, e);
    settle_runs(&s, e);
    read_every_view(&s, &ids, e);
    // A key held by a handler's back-off: shown by both key views, lifted.
    back_off_and_resume(&s, e);
    cancel_and_clear(&s, &ids[3], e);
    // Schedules: set, read, pause, resume, trigger, backfill, delete.
    one_schedule_through_its_life(&s, e);
    // Many at once: a dry run, a stored apply, a pruning one, a bad one.
    many_schedules_at_once(&s, e);
    // A batch: opened, a job added, shown (by both of its paths), closed;
    // an unknown one.
    one_batch_through_its_life(&s, e);
    let bad = json!({"schedules": {"n4": {"key": "k", "every": "500ms"}}});
    let (code, v) = checked(&s, "PUT", "/v1/schedules", "/v1/schedules", Some(bad), e);
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("\"n4\""), "{v}");
    assert!(
        errs.is_empty(),
        "answers the document does not describe:\n{}",
        errs.join("\n")
    );
}

/// Sets group `g` and policy `k`, places two jobs of `k`, one of `d` that
/// dies on its first failure and a delayed one of `later`; returns their ids.
fn place_jobs(s: &shardq_server::Running, e: &mut Vec<String>) -> Vec<String> {
    checked(
        s,
        "PUT",
        "/v1/groups/{name}",
        "/v1/groups/g",
        Some(json!({"rate": "5/s"})),
        e,
    );
    let policy = json!({"concurrency": 256, "rate": "10/s", "group": "g"});
    checked(
        s,
        "PUT",
        "/v1/policies/{key}",
        "/v1/policies/k",
        Some(policy),
        e,
    );
    let body = json!({"jobs": [
        {"key": "k", "payload": "a"},
        {"key": "k", "payload": "b"},
        {"key": "d", "payload": "dead", "max_attempts": 1},
        {"key": "later", "payload": "x", "delay_ms": 600000},
    ]});
    let (_, placed) = checked(s, "POST", "/v1/jobs", "/v1/jobs", Some(body), e);
    (placed["jobs"].as_array().unwrap().iter())
        .map(|j| j["id"].as_str().unwrap().to_string())
        .collect()
}

/// Claims the three due runs, then kills `d`, acks `k a`, extends `k b`,
/// asks which are stale and claims once more with nothing due.
fn settle_runs(s: &shardq_server::Running, e: &mut Vec<String>) {
    let mut runs = Vec::new();
    wait_until("three runs", Duration::from_secs(10), || {
        runs.extend(claim(s, "w", 10, 500, 30_000));
        runs.len() >= 3
    });
    let receipt = |key: &str, payload: &str| {
        let r = (runs.iter())
            .find(|j| j["key"] == key && j["payload"] == payload)
            .unwrap_or_else(|| panic!("no run of {key} {payload}: {runs:?}"));
        r["receipt"].as_str().unwrap().to_string()
    };
    let dead = receipt("d", "dead");
    let acked = receipt("k", "a");
    let running = receipt("k", "b");
    checked(
        s,
        "POST",
        "/v1/fail",
        "/v1/fail",
        Some(json!({"receipt": dead, "reason": "no"})),
        e,
    );
    checked(
        s,
        "POST",
        "/v1/ack",
        "/v1/ack",
        Some(json!({"receipts": [acked]})),
        e,
    );
    let ext = json!({"receipts": [running], "lease_ms": 30000});
    checked(s, "POST", "/v1/extend", "/v1/extend", Some(ext), e);
    let ask = json!({"receipts": [running, acked]});
    let (code, v) = checked(s, "POST", "/v1/stale", "/v1/stale", Some(ask), e);
    assert_eq!((code, &v["stale"]), (200, &json!([acked])), "{v}");
    let claim_body = json!({"worker": "w2", "max": 1, "wait_ms": 0});
    checked(s, "POST", "/v1/claim", "/v1/claim", Some(claim_body), e);
}

/// GETs every read-only view (the jobs by the ids `place_jobs` returned):
/// each answers 200.
fn read_every_view(s: &shardq_server::Running, ids: &[String], e: &mut Vec<String>) {
    for (path, target) in [
        ("/healthz", "/healthz".to_string()),
        ("/readyz", "/readyz".to_string()),
        ("/v1/status", "/v1/status".to_string()),
        ("/v1/keys", "/v1/keys?prefix=k".to_string()),
        ("/v1/keys/{key}", "/v1/keys/k".to_string()),
        (
            "/v1/keys/{key}/jobs",
            "/v1/keys/k/jobs?finished=5".to_string(),
        ),
        ("/v1/jobs/{id}", format!("/v1/jobs/{}", ids[0])),
        ("/v1/jobs/{id}", format!("/v1/jobs/{}", ids[1])),
        ("/v1/jobs/{id}", format!("/v1/jobs/{}", ids[3])),
        ("/v1/dead", "/v1/dead".to_string()),
        ("/v1/ring", "/v1/ring".to_string()),
        ("/v1/hot", "/v1/hot".to_string()),
        ("/v1/history", "/v1/history?seconds=60".to_string()),
        ("/v1/reshard", "/v1/reshard".to_string()),
        ("/v1/admin/rebalance", "/v1/admin/rebalance".to_string()),
        ("/v1/policies", "/v1/policies".to_string()),
        ("/v1/policies/{key}", "/v1/policies/k".to_string()),
        ("/v1/groups", "/v1/groups".to_string()),
        ("/v1/groups/{name}", "/v1/groups/g".to_string()),
    ] {
        let (code, v) = checked(s, "GET", path, &target, None, e);
        assert_eq!(code, 200, "GET {target}: {v}");
    }
}

/// Holds key `bo` by a handler's back-off, checks both key views show it,
/// then resumes it twice (lifted, then nothing to lift).
fn back_off_and_resume(s: &shardq_server::Running, e: &mut Vec<String>) {
    post_ok(
        s,
        "/v1/jobs",
        json!({"jobs": [{"key": "bo", "payload": "h"}]}),
    );
    let mut held = Vec::new();
    wait_until("the run of bo", Duration::from_secs(10), || {
        held.extend((claim(s, "w3", 1, 500, 30_000).into_iter()).filter(|j| j["key"] == "bo"));
        !held.is_empty()
    });
    let back_off = json!({"receipt": held[0]["receipt"], "backoff_ms": 600000});
    checked(s, "POST", "/v1/fail", "/v1/fail", Some(back_off), e);
    for (path, target) in [
        ("/v1/keys/{key}", "/v1/keys/bo"),
        ("/v1/keys/{key}/jobs", "/v1/keys/bo/jobs"),
    ] {
        let (code, v) = checked(s, "GET", path, target, None, e);
        assert!(code == 200 && !v["back_off"].is_null(), "GET {target}: {v}");
    }
    for resumed in [true, false] {
        let (code, v) = checked(
            s,
            "POST",
            "/v1/keys/{key}/resume",
            "/v1/keys/bo/resume",
            Some(json!({})),
            e,
        );
        assert_eq!((code, &v["resumed"]), (200, &json!(resumed)), "{v}");
    }
}

/// Cancels the delayed job `id` and reads it back, then resumes and deletes
/// the group, deletes the policy and purges the dead.
fn cancel_and_clear(s: &shardq_server::Running, id: &str, e: &mut Vec<String>) {
    let (code, v) = checked(
        s,
        "DELETE",
        "/v1/jobs/{id}",
        &format!("/v1/jobs/{id}"),
        Some(json!({})),
        e,
    );
    assert_eq!(code, 200, "{v}");
    let (code, v) = checked(
        s,
        "GET",
        "/v1/jobs/{id}",
        &format!("/v1/jobs/{id}"),
        None,
        e,
    );
    assert_eq!(code, 200, "a cancelled job is shown: {v}");
    checked(
        s,
        "POST",
        "/v1/groups/{name}/resume",
        "/v1/groups/g/resume",
        Some(json!({})),
        e,
    );
    checked(
        s,
        "DELETE",
        "/v1/policies/{key}",
        "/v1/policies/k",
        Some(json!({})),
        e,
    );
    checked(
        s,
        "DELETE",
        "/v1/groups/{name}",
        "/v1/groups/g",
        Some(json!({})),
        e,
    );
    checked(
        s,
        "POST",
        "/v1/dead/purge",
        "/v1/dead/purge",
        Some(json!({"all": true})),
        e,
    );
}

/// Schedule `n1`: set, read, paused, resumed, triggered, backfilled over two
/// days and deleted; an unknown schedule is a 404.
fn one_schedule_through_its_life(s: &shardq_server::Running, e: &mut Vec<String>) {
    let spec = json!({"key": "sched-k", "cron": "30 2 * * *", "tz": "Europe/Berlin",
        "payload": "p", "start": 1_700_000_000_000u64});
    checked(
        s,
        "PUT",
        "/v1/schedules/{id}",
        "/v1/schedules/n1",
        Some(spec),
        e,
    );
    for (path, target) in [
        ("/v1/schedules", "/v1/schedules"),
        ("/v1/schedules/{id}", "/v1/schedules/n1"),
    ] {
        let (code, v) = checked(s, "GET", path, target, None, e);
        assert_eq!(code, 200, "GET {target}: {v}");
    }
    for action in ["pause", "resume", "trigger"] {
        let (code, v) = checked(
            s,
            "POST",
            &format!("/v1/schedules/{{id}}/{action}"),
            &format!("/v1/schedules/n1/{action}"),
            Some(json!({})),
            e,
        );
        assert_eq!(code, 200, "{action}: {v}");
    }
    let range = json!({"from": "2026-03-28T00:00:00Z", "to": 1_774_828_800_000u64});
    let (code, v) = checked(
        s,
        "POST",
        "/v1/schedules/{id}/backfill",
        "/v1/schedules/n1/backfill",
        Some(range),
        e,
    );
    assert_eq!((code, &v["ticks"]), (200, &json!(2)), "{v}");
    let (code, _) = checked(
        s,
        "GET",
        "/v1/schedules/{id}",
        "/v1/schedules/nope",
        None,
        e,
    );
    assert_eq!(code, 404);
    checked(
        s,
        "DELETE",
        "/v1/schedules/{id}",
        "/v1/schedules/n1",
        Some(json!({})),
        e,
    );
}

/// A schedules file applied as a dry run, stored, then pruned to one: each
/// answer counts what it added and removed.
fn many_schedules_at_once(s: &shardq_server::Running, e: &mut Vec<String>) {
    let file =
        json!({"n2": {"key": "k2", "every": "1m"}, "n3": {"key": "k3", "cron": "0 * * * *"}});
    for (body, added, removed) in [
        (json!({"schedules": file, "dry_run": true}), 2, 0),
        (json!({"schedules": file}), 2, 0),
        (
            json!({"schedules": {"n2": {"key": "k2", "every": "1m"}}, "prune": true}),
            0,
            1,
        ),
    ] {
        let (code, v) = checked(s, "PUT", "/v1/schedules", "/v1/schedules", Some(body), e);
        assert_eq!(code, 200, "{v}");
        assert_eq!(
            v["applied"]["added"].as_array().unwrap().len(),
            added,
            "{v}"
        );
        assert_eq!(
            v["applied"]["removed"].as_array().unwrap().len(),
            removed,
            "{v}"
        );
    }
}

/// A batch opened, a job added, shown by both of its paths and closed; an
/// unknown batch is a 404 to both close and read.
fn one_batch_through_its_life(s: &shardq_server::Running, e: &mut Vec<String>) {
    let (code, b) = checked(
        s,
        "POST",
        "/v1/batches",
        "/v1/batches",
        Some(json!({"key": "cb", "on_complete": "done", "on_death": "x"})),
        e,
    );
    assert_eq!(code, 200, "{b}");
    let bid = b["id"].as_str().unwrap().to_string();
    let body = json!({"jobs": [{"key": "bk", "payload": "p", "batch": bid, "dedup_id": "b1"}]});
    let (code, v) = checked(s, "POST", "/v1/jobs", "/v1/jobs", Some(body), e);
    assert_eq!(code, 200, "{v}");
    let at = format!("/v1/batches/{bid}");
    checked(s, "GET", "/v1/batches/{id}", &at, None, e);
    checked(
        s,
        "GET",
        "/v1/jobs/{id}",
        &format!("/v1/jobs/{bid}"),
        None,
        e,
    );
    let close = format!("/v1/batches/{bid}/close");
    let (code, v) = checked(
        s,
        "POST",
        "/v1/batches/{id}/close",
        &close,
        Some(json!({})),
        e,
    );
    assert_eq!(code, 200, "{v}");
    for target in ["/v1/batches/@999/close", "/v1/batches/@999"] {
        let (method, path) = if target.ends_with("close") {
            ("POST", "/v1/batches/{id}/close")
        } else {
            ("GET", "/v1/batches/{id}")
        };
        let (code, v) = checked(
            s,
            method,
            path,
            target,
            Some(json!({})).filter(|_| method == "POST"),
            e,
        );
        assert_eq!(code, 404, "{target}: {v}");
    }
}

/// Every integer bound of the policy and group bodies, tried at its edges:
/// the documented bound is taken, one past it is refused naming the field.
#[test]
fn documented_body_bounds_are_the_servers() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let doc = doc();
    post_ok(
        &s,
        "/v1/jobs",
        json!({"jobs": [{"key": "warm", "payload": "x"}]}),
    );
    for (schema, path) in [
        ("FlowPolicy", "/v1/policies/k"),
        ("GroupLimit", "/v1/groups/g"),
    ] {
        let props = doc["components"]["schemas"][schema]["properties"]
            .as_object()
            .unwrap();
        for (field, p) in props {
            if p["type"] != "integer" {
                continue;
            }
            // A burst needs a rate beside it.
            let with = |n: i64| {
                let mut body = json!({ field.as_str(): n });
                if field == "burst" {
                    body["rate"] = json!("5/s");
                }
                body.to_string()
            };
            for (edge, past) in [("minimum", -1), ("maximum", 1)] {
                let Some(n) = p[edge].as_i64() else { continue };
                let (code, v) = call(&s, "PUT", path, Some(&with(n)), None);
                assert_eq!(
                    code, 200,
                    "{schema}.{field} at its documented {edge} {n}: {v}"
                );
                let (code, v) = call(&s, "PUT", path, Some(&with(n + past)), None);
                assert_eq!(
                    code, 400,
                    "{schema}.{field} past its documented {edge}: {v}"
                );
                let msg = v["error"].as_str().unwrap_or("");
                assert!(msg.contains(field.as_str()), "{schema}.{field}: {v}");
            }
        }
    }
}

/// A request line hyper cannot parse (a space, `<` or `>` in its target)
/// gets a bare 400 and the connection closed, before any route: the
/// document says so, and so does the server.
#[test]
fn an_unparsable_request_line_gets_the_documented_bare_400() {
    let doc = doc();
    let said = doc["info"]["description"].as_str().unwrap();
    assert!(said.contains("cannot parse"), "{said}");
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    let addr = s.url().trim_start_matches("http://").to_string();
    for target in ["/v1/keys/a b", "/v1/keys/<k>"] {
        let mut c = TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(c, "GET {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
        let mut got = String::new();
        let _ = c.read_to_string(&mut got);
        assert!(got.starts_with("HTTP/1.1 400"), "{target}: {got}");
    }
}
