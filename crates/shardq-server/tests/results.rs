//! Job results over HTTP: a result given with `POST /v1/ack` is kept with
//! the finished job and answered by `GET /v1/jobs/{id}` and by
//! `GET /v1/jobs/{id}/result`, whose long poll is woken by the ack; bad
//! results are refused naming the field, with nothing acked.

use std::time::{Duration, Instant};

use serde_json::json;

mod support;

use support::{claim, enqueue, get, get_ok, init_dir, options, post, start, wait_until, WAIT_MAX};

#[test]
fn a_result_given_with_the_ack_is_kept_and_a_waiting_reader_is_woken() {
    let dir = init_dir(2, "rendezvous");
    let s = start(dir.path(), options());
    let placed = enqueue(
        &s,
        json!([{"key": "r-a", "payload": "x"}, {"key": "r-b", "payload": "y"}]),
    );
    let (a, b) = (
        placed[0]["id"].as_str().unwrap().to_string(),
        placed[1]["id"].as_str().unwrap().to_string(),
    );
    // Not finished yet: a short wait answers the live job.
    let v = get_ok(&s, &format!("/v1/jobs/{a}/result?wait_ms=50"));
    assert_eq!(v["state"], "queued", "{v}");
    assert!(v.get("outcome").is_none(), "{v}");
    let runs = claim(&s, "w1", 10, 0, 30_000);
    assert_eq!(runs.len(), 2);
    let receipt = |id: &str| {
        runs.iter().find(|r| r["id"] == id).expect("claimed")["receipt"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (ra, rb) = (receipt(&a), receipt(&b));
    // Bad results: refused naming the field, nothing acked.
    for (results, says) in [
        (
            json!([{"result": "a"}]),
            "results: 1 results for 2 receipts",
        ),
        (
            json!([{"result": "a", "result_b64": "YQ=="}, null]),
            "results[0]",
        ),
        (json!([null, {"result_b64": "%%"}]), "results[1].result_b64"),
        (
            json!([{"result": "z".repeat(65_537)}, null]),
            "over the 65536-byte bound",
        ),
    ] {
        let (code, v) = post(
            &s,
            "/v1/ack",
            json!({"receipts": [ra, rb], "results": results}),
        );
        assert_eq!(code, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains(says), "{says}: {v}");
    }
    assert_eq!(get_ok(&s, &format!("/v1/jobs/{a}"))["state"], "running");
    // A reader waits; the ack wakes it well before its 20 s wait ends.
    let url = s.url();
    let a2 = a.clone();
    let reader = std::thread::spawn(move || {
        let started = Instant::now();
        let body = ureq::get(&format!("{url}/v1/jobs/{a2}/result?wait_ms=20000"))
            .call()
            .expect("result answers")
            .into_string()
            .unwrap();
        (started.elapsed(), body)
    });
    // The reader waits before the ack (one that came later would be
    // answered at once, as checked below).
    wait_until("the reader waiting", WAIT_MAX, || {
        s.load().polls_waiting == 1
    });
    let (code, v) = post(
        &s,
        "/v1/ack",
        json!({"receipts": [ra, rb], "results": [{"result": "done: x"}, {"result_b64": "/wB8"}]}),
    );
    assert_eq!(code, 200, "{v}");
    let (waited, body) = reader.join().unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["outcome"].as_str(), v["result"].as_str()),
        (Some("completed"), Some("done: x")),
        "{v}"
    );
    assert!(
        waited < Duration::from_secs(10),
        "answered once acked, not at the wait's end: {waited:?}"
    );
    let vb = get_ok(&s, &format!("/v1/jobs/{b}"));
    assert_eq!(
        (vb["result_b64"].as_str(), vb.get("result")),
        (Some("/wB8"), None),
        "{vb}"
    );
    // wait_ms past the long-poll bound is refused naming it.
    let (code, v) = get(&s, &format!("/v1/jobs/{a}/result?wait_ms=30001"));
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("wait_ms"), "{v}");
}
