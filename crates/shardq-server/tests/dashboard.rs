//! The dashboard's endpoints against real HTTP: the page and its assets,
//! `/v1/ring`, `/v1/hot`, `/v1/reshard` on an embedded data dir with
//! queued work and a pending target, and the viewer (the API without shard
//! leases). The page itself is tested in a browser (`tests/browser/`).

use std::path::Path;

use serde_json::{json, Value};
use shardq_server::{dashboard, spawn, Running};

mod support;

use support::{enqueue_n, get, get_ok, init_dir, options, post, wait_until, WAIT_MAX};

#[test]
fn the_page_and_its_assets_are_served_from_the_binary() {
    let dir = init_dir(2, "rendezvous");
    let s = spawn(dir.path(), options()).unwrap();
    for (path, kind, needle) in [
        ("/", "text/html", "/dashboard/app.js"),
        ("/dashboard/app.js", "text/javascript", "/v1/status"),
        ("/dashboard/style.css", "text/css", "--ready"),
    ] {
        let r = ureq::get(&format!("{}{path}", s.url())).call().unwrap();
        assert_eq!(r.status(), 200);
        assert!(
            r.content_type().starts_with(kind),
            "{path}: {}",
            r.content_type()
        );
        let body = r.into_string().unwrap();
        assert!(body.contains(needle), "{path} lacks {needle}");
        // No network at run time: nothing names another host (the SVG
        // namespace is a name, never fetched).
        let rest = body.replace("http://www.w3.org/2000/svg", "");
        assert!(
            !rest.contains("http://") && !rest.contains("https://"),
            "{path} names a remote URL"
        );
    }
}

#[test]
fn ring_shares_follow_weights_and_cover_the_circle() {
    let dir = init_dir(3, "ring");
    let s = spawn(dir.path(), options()).unwrap();
    let v = get_ok(&s, "/v1/ring");
    assert_eq!(v["algorithm"], "ring");
    assert_eq!(v["method"], "ring-points");
    let shares: Vec<f64> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["share"].as_f64().unwrap())
        .collect();
    assert_eq!(shares.len(), 3);
    assert!(
        (shares.iter().sum::<f64>() - 1.0).abs() < 1e-9,
        "{shares:?}"
    );
    let arcs = v["arcs"].as_array().unwrap();
    assert_eq!(arcs[0]["start"], 0.0);
    assert_eq!(arcs.last().unwrap()["end"], 1.0);
    // A warming shard routes nothing.
    let (code, r) = post(
        &s,
        "/v1/admin/add-shard",
        json!({"name": "shard-9", "weight": 2}),
    );
    assert_eq!(code, 200, "{r}");
    wait_until(
        "the warming shard to show in /v1/ring with no share",
        WAIT_MAX,
        || {
            let v = get_ok(&s, "/v1/ring");
            v["shards"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x["name"] == "shard-9" && x["state"] == "warming" && x["share"] == 0.0)
        },
    );
}

#[test]
fn hot_keys_are_the_deepest_and_top_is_bounded() {
    let dir = init_dir(2, "rendezvous");
    // Nobody claims: a server owning no shard would still show the work.
    let s = spawn(dir.path(), options()).unwrap();
    enqueue_n(&s, "deep", 7);
    enqueue_n(&s, "mid", 3);
    enqueue_n(&s, "shallow", 1);
    let v = get_ok(&s, "/v1/hot?top=2");
    let mut all: Vec<(String, u64)> = Vec::new();
    for sh in v["shards"].as_array().unwrap() {
        let top = sh["top"].as_array().unwrap();
        assert!(top.len() <= 2, "{sh}");
        for k in top {
            all.push((
                k["key"].as_str().unwrap().into(),
                k["depth"].as_u64().unwrap(),
            ));
        }
    }
    assert!(all.contains(&("deep".into(), 7)), "{v}");
    for bad in [
        "/v1/hot?top=0",
        "/v1/hot?top=101",
        "/v1/hot?top=x",
        "/v1/hot?nope=1",
    ] {
        let (code, e) = get(&s, bad);
        assert_eq!(code, 400, "{bad}: {e}");
        assert!(
            e["error"].as_str().unwrap().contains("top") || bad.contains("nope"),
            "{e}"
        );
    }
}

#[test]
fn reshard_shows_a_pending_target_and_idle_without_one() {
    let dir = init_dir(2, "rendezvous");
    let s = spawn(dir.path(), options()).unwrap();
    let v = get_ok(&s, "/v1/reshard");
    assert_eq!(v["phase"], "idle", "{v}");
    assert_eq!(v["paused_total"], 0);
    let (code, r) = post(&s, "/v1/admin/add-shard", json!({"name": "shard-5"}));
    assert_eq!(code, 200, "{r}");
    let mut last = Value::Null;
    wait_until("/v1/reshard to show the target pending", WAIT_MAX, || {
        last = get_ok(&s, "/v1/reshard");
        last["phase"] == "pending"
    });
    assert!(last["target_version"].as_u64().is_some(), "{last}");
}

fn viewer(dir: &Path) -> Running {
    dashboard::spawn_viewer(dir, options()).unwrap()
}

#[test]
fn the_viewer_serves_the_api_without_taking_shards() {
    let dir = init_dir(2, "rendezvous");
    let v = viewer(dir.path());
    let ready = get_ok(&v, "/readyz");
    assert_eq!(ready["owned"], json!([]), "{ready}");
    enqueue_n(&v, "k", 2);
    let st = get_ok(&v, "/v1/status");
    assert_eq!(st["totals"]["ready"], 2, "{st}");
    // Claims hand out nothing: no shard is run here.
    let (code, c) = post(&v, "/v1/claim", json!({"worker": "w", "max": 5}));
    assert_eq!((code, c), (200, json!({"jobs": []})));
    // A real server over the same dir takes every shard.
    let s = spawn(dir.path(), options()).unwrap();
    let ready = get_ok(&s, "/readyz");
    assert_eq!(ready["owned"].as_array().unwrap().len(), 2, "{ready}");
    v.stop().unwrap();
    s.stop().unwrap();
}
