//! Job results through the real binary: a command handler's
//! `$SHARDQ_RESULT_FILE` and a stdio handler's `result`/`result_b64` are
//! kept with the finished job and shown by `job show`; a result over the
//! bound fails its attempt with a reason that says so, and the job dies
//! with it rather than finishing without its result.

mod support;

use support::{init_shards, ok, run, temp_dir};

fn show(d: &str, id: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["job", "show", "--data", d, id, "--json"])).unwrap()
}

fn ids(d: &str, lines: &str, extra: &[&str]) -> Vec<String> {
    let out = support::run_stdin(
        &[&["enqueue", "--data", d, "--stdin"], extra].concat(),
        lines.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.rsplit('\t').next().unwrap().to_string())
        .collect()
}

#[test]
fn a_command_handlers_result_file_is_kept_and_an_oversized_one_fails_the_attempt() {
    let dir = temp_dir("result-cmd");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let placed = ids(
        d,
        "small\tp1\nnone\tp2\nbig\tp3\n",
        &["--max-attempts", "1"],
    );
    assert_eq!(placed.len(), 3, "{placed:?}");
    // small writes a result, none writes nothing, big writes 70,000 bytes.
    let script = r#"read p
case "$SHARDQ_KEY" in
  small) printf 'done:%s' "$p" > "$SHARDQ_RESULT_FILE" ;;
  big) head -c 70000 /dev/zero > "$SHARDQ_RESULT_FILE" ;;
esac"#;
    // The worker's temporary directory is this test's own: a worker that
    // another test SIGKILLed leaves its result files in the shared one,
    // which the check below must not take for this worker's.
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let out = std::process::Command::new(support::BIN)
        .args(["work", "--data", d, "--max-local-shards", "all"])
        .args(["--exit-when-idle", "--", "sh", "-c", script])
        .env("TMPDIR", &tmp)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v = show(d, &placed[0]);
    assert_eq!(
        (v["outcome"].as_str(), v["result"].as_str()),
        (Some("completed"), Some("done:p1")),
        "{v}"
    );
    let v = show(d, &placed[1]);
    assert_eq!(v["outcome"], "completed", "{v}");
    assert!(
        v.get("result").is_none() && v.get("result_b64").is_none(),
        "{v}"
    );
    let v = show(d, &placed[2]);
    assert_eq!(v["state"], "dead", "{v}");
    let reason = v["reason"].as_str().unwrap();
    assert!(
        reason.contains("70000 bytes, over the 65536-byte bound"),
        "{reason}"
    );
    // The text view shows a result too.
    let text = ok(&["job", "show", "--data", d, &placed[0]]);
    assert!(text.contains("result\t\"done:p1\""), "{text}");
    // No result file is left behind in the worker's directory.
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("shardq-results-")
        })
        .flat_map(|e| std::fs::read_dir(e.path()).into_iter().flatten())
        .filter_map(Result::ok)
        .filter(|f| {
            f.file_name()
                .to_string_lossy()
                .contains(&format!("-{}-", placed[0].rsplit(':').next().unwrap()))
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_stdio_handlers_result_is_kept_as_text_or_bytes() {
    let dir = temp_dir("result-stdio");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let placed = ids(d, "t\thello\nb\tbytes\n", &[]);
    let handler = r#"
import base64, json, sys
for line in sys.stdin:
    job = json.loads(line)
    if job["key"] == "t":
        out = {"receipt": job["receipt"], "ok": True, "result": "len=%d" % len(job["payload"])}
    else:
        raw = b"\xff\x00" + job["payload"].encode()
        out = {"receipt": job["receipt"], "ok": True, "result_b64": base64.b64encode(raw).decode()}
    print(json.dumps(out), flush=True)
"#;
    let (good, _, err) = run(&[
        "work",
        "--data",
        d,
        "--max-local-shards",
        "all",
        "--exit-when-idle",
        "--stdio",
        "--",
        "python3",
        "-c",
        handler,
    ]);
    assert!(good, "{err}");
    let v = show(d, &placed[0]);
    assert_eq!(v["result"], "len=5", "{v}");
    let v = show(d, &placed[1]);
    assert_eq!(v["result_b64"], "/wBieXRlcw==", "{v}");
}

#[test]
fn result_bytes_max_lowers_the_bound_and_out_of_range_is_refused() {
    let dir = temp_dir("result-max");
    let data = dir.join("q");
    init_shards(&data, 1);
    let d = data.to_str().unwrap();
    for bad in ["0", "65537"] {
        let (good, _, err) = run(&["work", "--data", d, "--result-bytes-max", bad, "--", "true"]);
        assert!(
            !good && err.contains("--result-bytes-max") && err.contains(bad),
            "{err}"
        );
    }
    let placed = ids(d, "k\tp\n", &["--max-attempts", "1"]);
    let (good, _, err) = run(&[
        "work",
        "--data",
        d,
        "--exit-when-idle",
        "--result-bytes-max",
        "4",
        "--",
        "sh",
        "-c",
        "printf 'too long' > \"$SHARDQ_RESULT_FILE\"",
    ]);
    assert!(good, "{err}");
    let v = show(d, &placed[0]);
    assert_eq!(v["state"], "dead", "{v}");
    assert!(
        v["reason"]
            .as_str()
            .unwrap()
            .contains("8 bytes, over the 4-byte bound"),
        "{v}"
    );
}
