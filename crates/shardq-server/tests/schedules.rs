//! Schedules over HTTP: a schedule set through `PUT /v1/schedules/{id}`
//! fires in the server that owns its key's shard, one job per tick, and
//! its state shows it; bad input is refused naming the field and the
//! value; an unknown id is a 404; two servers over one data dir store each
//! tick once.

use std::time::Duration;

use serde_json::{json, Value};

mod support;

use support::{call, get, get_ok, init_dir, options, start, wait_until};

fn put(s: &shardq_server::Running, id: &str, body: Value) -> (u16, Value) {
    call(
        s,
        "PUT",
        &format!("/v1/schedules/{id}"),
        Some(&body.to_string()),
        None,
    )
}

#[test]
fn a_schedule_set_over_http_fires_once_per_tick_in_the_owning_servers() {
    let dir = init_dir(2, "rendezvous");
    // Two servers over one data dir: each runs the shards it holds, and a
    // tick fired by both (a lease moving between them) stores one job.
    let a = start(dir.path(), options());
    let b = start(dir.path(), options());
    let (code, v) = put(
        &a,
        "beat",
        json!({"key": "tenant-9", "every": "1s", "overlap": "all"}),
    );
    assert_eq!(code, 200, "{v}");
    wait_until("five fires", Duration::from_secs(20), || {
        get_ok(&b, "/v1/schedules/beat")["state"]["fired"].as_u64() >= Some(5)
    });
    let (code, _) = call(&a, "POST", "/v1/schedules/beat/pause", Some("{}"), None);
    assert_eq!(code, 200);
    // A pass in flight when the pause was stored may still record a fire:
    // wait until each server's schedule thread has ended a round begun
    // after the pause (two past the count read now).
    let passes = |s: &shardq_server::Running| {
        get_ok(s, "/v1/status")["server"]["schedule_passes"]
            .as_u64()
            .expect("a server that runs shards counts its schedule passes")
    };
    let (pa, pb) = (passes(&a), passes(&b));
    wait_until(
        "each server's passes after the pause",
        Duration::from_secs(10),
        || passes(&a) >= pa + 2 && passes(&b) >= pb + 2,
    );
    let view = get_ok(&a, "/v1/schedules/beat");
    let since = view["since_ms"].as_u64().unwrap();
    let decided = view["state"]["decided_ms"].as_u64().unwrap();
    let ticks = decided / 1000 - since / 1000;
    assert_eq!(view["state"]["fired"].as_u64(), Some(ticks), "{view}");
    let jobs = get_ok(&a, "/v1/keys/tenant-9/jobs");
    let live = jobs["jobs"].as_array().map_or(0, Vec::len) as u64;
    assert_eq!(live, ticks, "one job per decided tick: {jobs}");
    // Every decided tick has its job: a backfill over them stores none.
    let (code, v) = call(
        &a,
        "POST",
        "/v1/schedules/beat/backfill",
        Some(&json!({"from": since + 1, "to": decided}).to_string()),
        None,
    );
    assert_eq!(
        (code, &v["stored"], &v["ticks"]),
        (200, &json!(0), &json!(ticks)),
        "{v}"
    );
    // Each job names its schedule and its own tick, in the listing and in
    // the claim a worker gets.
    let listed = jobs["jobs"].as_array().unwrap();
    let mut seen: Vec<u64> = listed
        .iter()
        .map(|j| {
            assert_eq!(j["schedule"]["id"], "beat", "{j}");
            assert_eq!(j["schedule"]["triggered"], false, "{j}");
            let t = j["schedule"]["tick_ms"].as_u64().unwrap();
            assert_eq!(j["dedup_id"], format!("schedule:beat@{t}"), "{j}");
            assert!(t % 1000 == 0 && t > since && t <= decided, "{j}");
            t
        })
        .collect();
    seen.dedup();
    assert_eq!(seen.len() as u64, ticks, "a tick per job: {seen:?}");
    // The key's shard is run by one of the two servers: ask both.
    let mut claimed = Vec::new();
    for srv in [&a, &b] {
        let (code, v) = call(
            srv,
            "POST",
            "/v1/claim",
            Some(&json!({"worker": "w-1", "max": 16, "wait_ms": 1000}).to_string()),
            None,
        );
        assert_eq!(code, 200, "{v}");
        claimed.extend(v["jobs"].as_array().unwrap().iter().cloned());
    }
    assert!(!claimed.is_empty(), "no scheduled job was claimed");
    for j in &claimed {
        assert_eq!(j["schedule"]["id"], "beat", "{j}");
        assert!(
            seen.contains(&j["schedule"]["tick_ms"].as_u64().unwrap()),
            "{j}"
        );
    }
    // A producer may not pass its job off as a schedule's.
    let (code, v) = call(
        &a,
        "POST",
        "/v1/jobs",
        Some(&json!({"jobs": [{"key": "tenant-9", "payload": "x", "dedup_id": "schedule:beat@1000"}]}).to_string()),
        None,
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("kept for the jobs of schedules"),
        "{v}"
    );
}

#[test]
fn bad_schedules_are_refused_naming_the_field_and_unknown_ids_are_404() {
    let dir = init_dir(1, "rendezvous");
    let s = start(dir.path(), options());
    for (body, words) in [
        (
            json!({"key": "k", "cron": "0 25 * * *"}),
            "invalid cron \"0 25 * * *\"",
        ),
        (
            json!({"key": "k", "cron": "0 2 * * *", "tz": "Nowhere/City"}),
            "invalid tz \"Nowhere/City\"",
        ),
        (
            json!({"key": "k", "every": "500ms"}),
            "invalid every 500 ms",
        ),
        (
            json!({"key": "k", "every": "1m", "cron": "* * * * *"}),
            "invalid recurrence",
        ),
        (json!({"key": "k"}), "invalid recurrence"),
        (
            json!({"key": "k", "every": "1m", "jitter": "2h"}),
            "invalid jitter 7200000 ms",
        ),
        (
            json!({"key": "k", "every": "1m", "start": "yesterday"}),
            "invalid start \"yesterday\"",
        ),
        (
            json!({"key": "k", "every": "1m", "colour": "blue"}),
            "colour",
        ),
        (json!({"key": "", "every": "1m"}), "key"),
    ] {
        let (code, v) = put(&s, "x", body.clone());
        assert_eq!(code, 400, "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(words), "{body}: {v}");
    }
    let (code, v) = put(&s, "bad%20id", json!({"key": "k", "every": "1m"}));
    assert_eq!(code, 400, "{v}");
    assert_eq!(
        get_ok(&s, "/v1/schedules")["schedules"],
        json!([]),
        "nothing stored"
    );
    for (method, path) in [
        ("GET", "/v1/schedules/none"),
        ("POST", "/v1/schedules/none/pause"),
        ("POST", "/v1/schedules/none/trigger"),
    ] {
        let body = (method == "POST").then_some("{}");
        let (code, v) = call(&s, method, path, body, None);
        assert_eq!(code, 404, "{method} {path}: {v}");
    }
    let (code, v) = get(&s, "/v1/schedules/none");
    assert!(
        code == 404 && v["error"].as_str().unwrap().contains("none"),
        "{v}"
    );
}
