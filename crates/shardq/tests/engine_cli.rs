//! Engine commands on the command line: bad input gets a clear error naming
//! the value and changes nothing; SIGTERM drains and releases the shard;
//! `enqueue --stdin` after a failure prints every stored job and names the
//! lines that were not; `status` shows a corrupt shard next to the others;
//! a closed stdout ends a command quietly; an operator shows, lists and
//! cancels jobs by the ids `enqueue` prints.

use std::collections::BTreeSet;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

mod support;
use support::{
    data_dir_with_corrupt_shard_1, run, run_stdin, status_json, temp_dir, BIN, WAIT_MAX,
};

#[test]
fn bad_input_is_refused_clearly_and_loses_nothing() {
    let dir = temp_dir("bad");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let (ok, out, _) = run(&["enqueue", "--data", d, "--key", "keep", "--payload", "x"]);
    assert!(ok);
    // The job's id in the one form every command takes: SHARD:ID.
    let (shard, id) = out.trim().rsplit_once(':').expect("SHARD:ID");
    assert!(
        shard.starts_with("shard-") && id.parse::<u64>().is_ok(),
        "{out:?}"
    );
    let long_key = "k".repeat(1025);
    // One argv string is capped at 128 KiB, so the limit is lowered here.
    let big = "p".repeat(1001);
    let foreign = dir.to_str().unwrap();
    let missing = dir.join("nope");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["enqueue", "--data", d, "--key", ""],
            "must not be empty",
        ),
        (vec!["enqueue", "--data", d, "--key", &long_key], "1025"),
        (
            vec![
                "enqueue",
                "--data",
                d,
                "--key",
                "k",
                "--payload",
                &big,
                "--payload-bytes-max",
                "1000",
            ],
            "1001 bytes, over the limit of 1000",
        ),
        (
            vec!["enqueue", "--data", foreign, "--key", "k"],
            "not a shardq data dir",
        ),
        (
            vec!["enqueue", "--data", missing.to_str().unwrap(), "--key", "k"],
            "does not exist",
        ),
        (
            vec!["work", "--data", d, "--concurrency", "0", "--", "true"],
            "invalid --concurrency 0",
        ),
        (
            vec![
                "work",
                "--data",
                d,
                "--max-local-shards",
                "none",
                "--",
                "true",
            ],
            "\"none\"",
        ),
        (
            vec!["init", "--data", d, "--shards", "2"],
            "already a shardq data dir",
        ),
        (
            vec!["init", "--data", foreign, "--shards", "0"],
            "invalid --shards 0",
        ),
        (
            vec![
                "enqueue",
                "--data",
                d,
                "--key",
                "k",
                "--durability",
                "sometimes",
            ],
            "\"sometimes\"",
        ),
        (vec!["repair", "--data", d, "shard-9"], "shard-9"),
    ];
    for (args, needle) in cases {
        let (ok, _, err) = run(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    let v = status_json(&data);
    assert_eq!(
        v["totals"]["ready"], 1,
        "the good job is still there, and only it"
    );

    std::fs::write(data.join("membership.json"), "{oops").unwrap();
    let (ok, _, err) = run(&["status", "--data", d]);
    assert!(
        !ok && err.contains("membership.json") && err.contains("corrupt"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("membership.json")).unwrap(),
        "{oops"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_drains_running_jobs_and_releases_claims() {
    let dir = temp_dir("term");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let marker = dir.join("started");
    assert!(run(&["init", "--data", d, "--shards", "1"]).0);
    assert!(run(&["enqueue", "--data", d, "--key", "k"]).0);
    let script = format!("touch {}; sleep 0.5", marker.display());
    let mut child = Command::new(BIN)
        .args([
            "work",
            "--data",
            d,
            "--lease-ms",
            "60000",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !marker.exists() {
        assert!(start.elapsed() < WAIT_MAX, "the job never started");
        thread::sleep(Duration::from_millis(10));
    }
    let v = status_json(&data);
    assert!(v["shards"][0]["owner"].is_string(), "{v}");
    assert!(
        v["shards"][0]["owner"]
            .as_str()
            .unwrap()
            .starts_with("work:"),
        "the owner names its kind: {v}"
    );
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < WAIT_MAX,
            "worker did not stop after SIGTERM"
        );
        thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    assert!(err.contains("draining") && err.contains("1 acked"), "{err}");
    let v = status_json(&data);
    assert!(v["shards"][0]["owner"].is_null(), "claim not released: {v}");
    assert_eq!(v["totals"]["ready"], 0);
    assert_eq!(v["totals"]["in_flight"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Parses the line list of "stdin lines NOT enqueued: 2-4, 9, and every
/// line from 42 on ...": the listed lines and where the open rest starts.
fn not_enqueued_lines(err: &str) -> (BTreeSet<u64>, Option<u64>) {
    let start = err
        .find("stdin lines NOT enqueued: ")
        .expect("names the lines")
        + 26;
    let list = &err[start..err[start..].find(';').unwrap() + start];
    let mut lines = BTreeSet::new();
    let mut rest = None;
    for part in list.split(", ") {
        let part = part.trim_start_matches("and ");
        if let Some(r) = part.strip_prefix("every line from ") {
            rest = Some(r.split(' ').next().unwrap().parse().unwrap());
        } else if let Some((a, b)) = part.split_once('-') {
            lines.extend(a.parse::<u64>().unwrap()..=b.parse().unwrap());
        } else if let Some(r) = part.strip_suffix(" and every line after it") {
            rest = Some(r.parse().unwrap());
        } else {
            lines.insert(part.parse().unwrap());
        }
    }
    (lines, rest)
}

#[test]
fn enqueue_stdin_after_a_mid_batch_error_prints_every_stored_job_and_names_the_rest() {
    let dir = temp_dir("partial");
    let (data, before) = data_dir_with_corrupt_shard_1(&dir);
    let d = data.to_str().unwrap();
    let total = 3000u64;
    let input: String = (1..=total).map(|i| format!("k-{i}\tp{i}\n")).collect();
    let out = run_stdin(&["enqueue", "--data", d, "--stdin"], input.as_bytes());
    let err = String::from_utf8_lossy(&out.stderr);
    // A corrupt shard is damaged data: EX_DATAERR, not a bad flag.
    assert_eq!(out.status.code(), Some(65), "{err}");
    assert!(err.contains("shard-1") && err.contains("corrupt"), "{err}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    // Printed: KEY<TAB>SHARD:ID, never for the corrupt shard.
    let mut printed = BTreeSet::new();
    for line in stdout.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 2, "{line:?}");
        assert!(!f[1].starts_with("shard-1:"), "{line:?}");
        let n: u64 = f[0].strip_prefix("k-").unwrap().parse().unwrap();
        assert!(printed.insert(n), "line {n} printed twice");
    }
    // Every printed job is stored, and nothing else went in.
    let v = status_json_any(&data);
    let stored: u64 = [0, 2, 3]
        .iter()
        .map(|&i| v["shards"][i]["ready"].as_u64().unwrap() - before[i])
        .sum();
    assert_eq!(stored, printed.len() as u64, "{v}");
    assert!(
        !printed.is_empty(),
        "shard-0 comes before shard-1 and succeeds"
    );
    // The named lines are exactly the ones not printed.
    let (missed, rest) = not_enqueued_lines(&err);
    let rest = rest.unwrap_or(total + 1);
    for n in 1..=total {
        let named = missed.contains(&n) || n >= rest;
        assert!(
            named != printed.contains(&n),
            "line {n}: printed {} named {named}: {err}",
            printed.contains(&n)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn enqueue_stdin_bad_line_stores_the_lines_before_it_and_names_the_rest() {
    let dir = temp_dir("badline");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let mut input = String::new();
    for i in 1..=9 {
        input.push_str(&format!("k-{i}\tp\n"));
    }
    input.push_str(&format!("k-10\t{}\n", "x".repeat(101)));
    input.push_str("k-11\tp\n");
    let out = run_stdin(
        &[
            "enqueue",
            "--data",
            d,
            "--stdin",
            "--payload-bytes-max",
            "100",
        ],
        input.as_bytes(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 9);
    assert!(
        err.contains("NOT enqueued: 10 and every line after it") && err.contains("stdin line 10"),
        "{err}"
    );
    assert_eq!(status_json(&data)["totals"]["ready"], 9);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `status --json` whatever its exit status (2 when some shard failed).
fn status_json_any(data: &Path) -> serde_json::Value {
    let o = support::output(&["status", "--data", data.to_str().unwrap(), "--json"]);
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&o.stderr));
    })
}

#[test]
fn status_with_a_corrupt_shard_shows_the_others_and_names_it() {
    let dir = temp_dir("corrupt");
    let (data, before) = data_dir_with_corrupt_shard_1(&dir);
    let d = data.to_str().unwrap();

    let o = support::output(&["status", "--data", d, "--json"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("1 of 4 shards could not be read (shard-1)"),
        "{err}"
    );
    assert!(
        err.contains("shard \"shard-1\"") && err.contains("corrupt"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for i in [0, 2, 3] {
        assert_eq!(v["shards"][i]["ready"], before[i], "{v}");
        assert!(v["shards"][i]["error"].is_null(), "{v}");
    }
    let bad = &v["shards"][1];
    assert_eq!(bad["name"], "shard-1");
    assert!(bad["ready"].is_null(), "no count for an unread shard: {v}");
    let msg = bad["error"].as_str().expect("an error on shard-1");
    assert!(msg.contains("corrupt") && msg.contains(".seg"), "{msg}");
    assert_eq!(v["failed"], serde_json::json!(["shard-1"]));
    assert_eq!(v["totals"]["ready"], before[0] + before[2] + before[3]);

    let (ok, table, _) = run(&["status", "--data", d]);
    assert!(!ok);
    for (i, n) in before.iter().enumerate() {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("shard-{i} ")))
            .unwrap_or_else(|| panic!("no row for shard-{i}: {table}"));
        if i == 1 {
            assert!(row.contains('?'), "{row}");
        } else {
            assert_eq!(
                row.split_whitespace().nth(1),
                Some(&*n.to_string()),
                "{row}"
            );
        }
    }
    assert!(
        table.contains("FAILED: ") && table.contains("corrupt"),
        "{table}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn commands_exit_quietly_when_stdout_is_closed() {
    let dir = temp_dir("epipe");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    // The reader is gone before the first line is written: `println!`
    // used to panic on the EPIPE.
    for args in [
        vec!["status", "--data", d],
        vec!["dead", "--data", d, "list"],
    ] {
        let w = support::pipe_without_reader();
        let o = Command::new(BIN)
            .args(&args)
            .stdout(w)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_ne!(o.status.code(), Some(101), "{args:?}: {err}");
        assert!(
            o.status.success() || o.status.signal() == Some(13),
            "{args:?}: {:?} {err}",
            o.status
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `work --exit-when-idle` at its bound of shards (one by default) stops
/// once its own shards are idle, rather than waiting for work it may not
/// take, and says which shards still have work.
#[test]
fn exit_when_idle_at_its_shard_bound_names_the_shards_it_left() {
    let dir = temp_dir("idle-bound");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let (ok, _, err) = run(&["init", "--data", d, "--shards", "4"]);
    assert!(ok, "{err}");
    let lines: String = (0..40).map(|i| format!("k{i}\tp\n")).collect();
    let out = support::run_stdin(&["enqueue", "--data", d, "--stdin"], lines.as_bytes());
    assert!(out.status.success());
    let out = support::output(&["work", "--data", d, "--exit-when-idle", "--", "true"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("still have work that this worker did not run")
            && err.contains("--max-local-shards"),
        "{err}"
    );
    let st = status_json(&data);
    let left = st["totals"]["ready"].as_u64().unwrap();
    assert!(left > 0 && left < 40, "one shard's jobs ran: {st}");
    // With every shard allowed, nothing is left.
    let out = support::output(&[
        "work",
        "--data",
        d,
        "--exit-when-idle",
        "--max-local-shards",
        "all",
        "--",
        "true",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("still have work"), "{err}");
    assert_eq!(status_json(&data)["totals"]["ready"], 0);
}

/// The dead-letter commands speak the API's id form (`SHARD:ID`, as
/// `dead list` prints it), take `--data` before or after the action, name
/// "all" explicitly, and print JSON for scripts.
#[test]
fn dead_letters_are_named_by_shard_and_id_and_all_is_explicit() {
    let dir = temp_dir("dead-cli");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let lines: String = (0..6).map(|i| format!("k{i}\tp\n")).collect();
    let out = support::run_stdin(
        &["enqueue", "--data", d, "--stdin", "--max-attempts", "1"],
        lines.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = support::output(&[
        "work",
        "--data",
        d,
        "--exit-when-idle",
        "--max-local-shards",
        "all",
        "--",
        "false",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // --data after the action; JSON like GET /v1/dead.
    let (ok, json, err) = run(&["dead", "list", "--data", d, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let dead = v["dead"].as_array().unwrap();
    assert_eq!(dead.len(), 6, "{v}");
    let first = dead[0]["id"].as_str().unwrap().to_string();
    assert!(first.contains(':'), "{first}");
    // Nothing is retried without naming what: --id or --all.
    let (ok, _, err) = run(&["dead", "--data", d, "retry"]);
    assert!(!ok && err.contains("--all"), "{err}");
    // The id as printed; a bare id without --shard is refused clearly.
    let (ok, out, err) = run(&["dead", "--data", d, "purge", "--id", &first]);
    assert!(ok, "{err}");
    assert!(out.contains("purged 1 dead jobs"), "{out}");
    let bare = first.rsplit_once(':').unwrap().1;
    let (ok, _, err) = run(&["dead", "--data", d, "purge", "--id", bare]);
    assert!(!ok && err.contains("needs --shard"), "{err}");
    let (ok, out, err) = run(&["dead", "--data", d, "retry", "--all"]);
    assert!(ok, "{err}");
    assert!(out.contains("retried 5 dead jobs"), "{out}");
    let (ok, out, _) = run(&["dead", "--data", d, "list"]);
    assert!(ok && out.trim().is_empty(), "{out}");
}

/// `status` tells a warming shard from an active one and names the map
/// version; a lease reads as time left, not epoch milliseconds.
#[test]
fn status_shows_the_map_version_and_each_shards_state_and_weight() {
    let dir = temp_dir("status-map");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let (ok, _, err) = run(&["add-shard", "--data", d, "shard-9", "--weight", "3"]);
    assert!(ok, "{err}");
    let (ok, table, err) = run(&["status", "--data", d]);
    assert!(ok, "{err}");
    assert!(table.starts_with("map version 2 "), "{table}");
    let row = |name: &str| -> Vec<String> {
        table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row for {name}: {table}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(row("shard-9")[5..7], ["warming", "3"], "{table}");
    assert_eq!(row("shard-0")[5..7], ["active", "1"], "{table}");
    assert!(!table.contains("LEASE_EXPIRES_MS"), "{table}");
}

/// `hot --json` answers in the shape of `GET /v1/hot`.
#[test]
fn hot_json_has_the_shape_of_the_api() {
    let dir = temp_dir("hot-json");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let lines: String = (0..30).map(|i| format!("k{}\tp\n", i % 5)).collect();
    let out = support::run_stdin(&["enqueue", "--data", d, "--stdin"], lines.as_bytes());
    assert!(out.status.success());
    let (ok, json, err) = run(&["hot", "--data", d, "--top", "2", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["top"], 2, "{v}");
    let shards = v["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2, "{v}");
    let mut keys = 0;
    for s in shards {
        assert!(s["error"].is_null(), "{s}");
        keys += s["keys_with_work"].as_u64().unwrap();
        for k in s["top"].as_array().unwrap() {
            assert_eq!(k["depth"], 6, "{k}");
            assert_eq!(
                (k["in_flight"].as_u64(), k["dead"].as_u64()),
                (Some(0), Some(0))
            );
        }
    }
    assert_eq!(keys, 5, "{v}");
}

/// Enqueues one job of `key` per payload through the CLI: the ids it printed.
fn enqueue_each(d: &str, key: &str, payloads: &[&str]) -> Vec<String> {
    payloads
        .iter()
        .map(|p| {
            let (ok, out, err) = run(&["enqueue", "--data", d, "--key", key, "--payload", p]);
            assert!(ok, "{err}");
            out.trim().to_string()
        })
        .collect()
}

/// A job id from before its key moved still finds its job: `job show` of
/// it shows the copy on the key's new shard (under the copy's id), and,
/// once the copy ran, its outcome and result; `job cancel` of it cancels
/// the copy. When the new shard no longer remembers the copy, `job show`
/// and `job cancel` of the old id say which key it left with and the
/// shard that key is on now (exit 1, with `--json` as an object), where
/// `jobs --key` lists it.
#[test]
fn a_job_id_from_before_a_move_finds_its_copy_or_says_where_it_went() {
    let dir = temp_dir("jobs-moved");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let ids = enqueue_each(d, "k", &["a", "b", "c"]);
    let from = ids[0].split(':').next().unwrap().to_string();
    let to = if from == "shard-0" {
        "shard-1"
    } else {
        "shard-0"
    };
    assert!(run(&["pin", "--data", d, "k", to]).0);
    let (ok, _, err) = run(&["rebalance", "--data", d]);
    assert!(ok, "{err}");
    let show_json = |id: &str| -> serde_json::Value {
        let (ok, out, err) = run(&["job", "show", "--data", d, id, "--json"]);
        assert!(ok, "job show {id}: {err}");
        serde_json::from_str(&out).unwrap()
    };
    let copy = show_json(&ids[1]);
    assert_eq!(
        (
            copy["moved"]["from"].as_str(),
            copy["moved"]["key"].as_str()
        ),
        (Some(ids[1].as_str()), Some("k")),
        "the copy says it is one: {copy}"
    );
    assert_eq!(
        (
            copy["shard"].as_str(),
            copy["payload"].as_str(),
            copy["state"].as_str()
        ),
        (Some(to), Some("b"), Some("queued")),
        "{copy}"
    );
    assert_ne!(
        copy["id"].as_str(),
        Some(ids[1].as_str()),
        "the copy's own id"
    );
    // A cancel of an old id cancels the copy.
    let (ok, out, err) = run(&["job", "cancel", "--data", d, &ids[2], "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cancelled = v["copy"].as_str().expect("the copy named").to_string();
    assert!(cancelled.starts_with(to), "{v}");
    assert_eq!(show_json(&ids[2])["outcome"], "cancelled");
    // The jobs run on the new shard and leave results.
    let (ok, _, err) = run(&[
        "work",
        "--data",
        d,
        "--max-local-shards",
        "all",
        "--exit-when-idle",
        "--",
        "sh",
        "-c",
        r#"read p; printf 'done:%s' "$p" > "$SHARDQ_RESULT_FILE""#,
    ]);
    assert!(ok, "{err}");
    let done = show_json(&ids[0]);
    assert_eq!(
        (
            done["outcome"].as_str(),
            done["result"].as_str(),
            done["shard"].as_str()
        ),
        (Some("completed"), Some("done:a"), Some(to)),
        "{done}"
    );
    // The new shard forgets its imports: the old ids say where they went.
    std::fs::remove_file(data.join(to).join("moved_in.jsonl")).unwrap();
    let show = support::output(&["job", "show", "--data", d, &ids[1]]);
    assert_eq!(show.status.code(), Some(1));
    let text = String::from_utf8_lossy(&show.stderr);
    assert!(
        text.contains("moved with its key k to") && text.contains(&format!("to shard {to}")),
        "{text}"
    );
    let (ok, out, _) = run(&["job", "show", "--data", d, &ids[1], "--json"]);
    assert!(!ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["moved"]["key"], &v["moved"]["shard"]),
        (&"k".into(), &to.into()),
        "{v}"
    );
    let cancel = support::output(&["job", "cancel", "--data", d, &ids[1]]);
    assert_eq!(cancel.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&cancel.stderr).contains(&format!("to shard {to}")));
    let (ok, out, err) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let finished: Vec<(&str, &str)> = v["finished"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["shard"].as_str().unwrap(), j["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        finished,
        [(to, "completed"), (to, "completed"), (to, "cancelled")],
        "newest first: {v}"
    );
}

/// An operator reads a job by the id `enqueue` printed, lists its key's
/// jobs in order, and cancels one: the worker then runs the others, in
/// order, and never the cancelled one; a second cancel finds nothing (exit
/// 1), a show of it shows it cancelled (and of a job that ran, completed),
/// and a malformed id is refused naming it (exit 2).
#[test]
fn an_operator_shows_lists_and_cancels_jobs_by_id() {
    let dir = temp_dir("jobs-cli");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    assert!(run(&["init", "--data", d, "--shards", "2"]).0);
    let ids = enqueue_each(d, "k", &["a", "b", "c"]);
    let (ok, out, err) = run(&["job", "show", "--data", d, &ids[1], "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["state"], &v["payload"], &v["id"]),
        (&"queued".into(), &"b".into(), &ids[1].clone().into())
    );
    let (ok, out, err) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed: Vec<&str> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ids, "the key's jobs in enqueue order");

    let (ok, out, err) = run(&["job", "cancel", "--data", d, &ids[1]]);
    assert!(ok, "{err}");
    assert!(out.contains("cancelled"), "{out}");
    let again = support::output(&["job", "cancel", "--data", d, &ids[1]]);
    assert_eq!(again.status.code(), Some(1), "a second cancel");
    // A cancelled job is shown, as the retention keeps it.
    let show = support::output(&["job", "show", "--data", d, &ids[1]]);
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        show.status.success() && text.contains("state\tcancelled"),
        "{text}"
    );
    let (ok, out, err) = run(&["job", "show", "--data", d, &ids[1], "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["outcome"], &v["key"]),
        (&"cancelled".into(), &"k".into()),
        "{v}"
    );
    let bad = support::output(&["job", "show", "--data", d, "17"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("\"17\""));

    let ran = dir.join("ran");
    let script = format!("cat >> {}; echo >> {}", ran.display(), ran.display());
    let out = support::output(&[
        "work",
        "--data",
        d,
        "--exit-when-idle",
        "--max-local-shards",
        "all",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "a\nc\n");
    let (ok, out, _) = run(&["jobs", "--data", d, "--key", "k", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["jobs"].as_array().unwrap().is_empty(), "{v}");
    let show = support::output(&["job", "show", "--data", d, &ids[0]]);
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        show.status.success() && text.contains("state\tcompleted"),
        "{text}"
    );
    assert!(text.contains("attempts\t1"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
