//! `shardq work --stdio`: one long-lived handler per slot, one JSON line per
//! job. Every job runs once and in per-key order, handlers are not started
//! per job, and a handler that dies or breaks the protocol fails only its
//! job and is replaced.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use support::{enqueue_lines, init_shards, run, status_json, temp_dir, BIN};

/// Runs `work --stdio --exit-when-idle` with a Python handler script.
fn work_stdio(data: &Path, script: &Path, concurrency: usize) -> (bool, String) {
    let out = Command::new(BIN)
        .args([
            "work",
            "--data",
            data.to_str().unwrap(),
            "--concurrency",
            &concurrency.to_string(),
            "--max-local-shards",
            "all",
            "--exit-when-idle",
            "--stdio",
            "--",
            "python3",
            script.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A handler that logs `KEY PAYLOAD PID` per job to `log`; `extra` is
/// Python run per job with `job` bound, before the answer.
fn handler(dir: &Path, log: &Path, extra: &str) -> std::path::PathBuf {
    let script = dir.join("h.py");
    let text = format!(
        r#"import json, os, sys
log = open({log:?}, "a")
for line in sys.stdin:
    job = json.loads(line)
{extra}
    log.write("%s %s %d\n" % (job["key"], job["payload"], os.getpid()))
    log.flush()
    sys.stdout.write(json.dumps({{"receipt": job["receipt"], "ok": True}}) + "\n")
    sys.stdout.flush()
"#,
        log = log.to_str().unwrap()
    );
    std::fs::write(&script, text).unwrap();
    script
}

fn runs(log: &Path) -> Vec<(String, u64, u32)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut it = l.split(' ');
            (
                it.next().unwrap().to_string(),
                it.next().unwrap().parse().unwrap(),
                it.next().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn stdio_handlers_run_every_job_once_in_key_order_without_a_process_per_job() {
    let dir = temp_dir("stdio-order");
    let data = dir.join("data");
    init_shards(&data, 4);
    let lines: String = (0..600)
        .map(|i| format!("t-{}\t{}\n", i % 20, i / 20))
        .collect();
    enqueue_lines(&data, &lines, &[]);
    let log = dir.join("runs.log");
    let script = handler(&dir, &log, "");
    let (ok, err) = work_stdio(&data, &script, 4);
    assert!(ok, "{err}");
    let runs = runs(&log);
    assert_eq!(runs.len(), 600, "every job once");
    let mut per_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (k, seq, _) in &runs {
        per_key.entry(k.clone()).or_default().push(*seq);
    }
    for (k, seqs) in &per_key {
        assert_eq!(seqs, &(0..30).collect::<Vec<u64>>(), "key {k} out of order");
    }
    let pids: BTreeSet<u32> = runs.iter().map(|r| r.2).collect();
    assert!(
        pids.len() <= 4,
        "{} handler processes for 4 slots: one per job?",
        pids.len()
    );
    assert_eq!(status_json(&data)["totals"]["ready"], 0);
}

#[test]
fn a_stdio_handler_that_dies_fails_its_job_and_is_replaced() {
    let dir = temp_dir("stdio-crash");
    let data = dir.join("data");
    init_shards(&data, 1);
    let lines: String = (0..10).map(|i| format!("k\t{i}\n")).collect();
    enqueue_lines(&data, &lines, &[]);
    let log = dir.join("runs.log");
    let marker = dir.join("crashed");
    // Dies (no answer) the first time it sees job 3.
    let extra = format!(
        "    if job[\"payload\"] == \"3\" and not os.path.exists({m:?}):\n        open({m:?}, \"w\").close()\n        os._exit(7)",
        m = marker.to_str().unwrap()
    );
    let script = handler(&dir, &log, &extra);
    let (ok, err) = work_stdio(&data, &script, 1);
    assert!(ok, "{err}");
    assert!(err.contains("1 retried"), "{err}");
    let runs = runs(&log);
    let seqs: Vec<u64> = runs.iter().map(|r| r.1).collect();
    assert_eq!(
        seqs,
        (0..10).collect::<Vec<u64>>(),
        "order kept across the restart"
    );
    let pids: BTreeSet<u32> = runs.iter().map(|r| r.2).collect();
    assert_eq!(pids.len(), 2, "the dead handler was replaced once");
}

#[test]
fn a_stdio_answer_for_another_receipt_fails_the_job() {
    let dir = temp_dir("stdio-receipt");
    let data = dir.join("data");
    init_shards(&data, 1);
    enqueue_lines(&data, "k\tx\n", &["--max-attempts", "1"]);
    let script = dir.join("bad.py");
    std::fs::write(
        &script,
        "import json, sys\nfor line in sys.stdin:\n    sys.stdout.write(json.dumps({\"receipt\": \"shard-0:999.1\", \"ok\": True}) + \"\\n\")\n    sys.stdout.flush()\n",
    )
    .unwrap();
    let (ok, err) = work_stdio(&data, &script, 1);
    assert!(ok, "{err}");
    let (ok, dead, err) = run(&["dead", "--data", data.to_str().unwrap(), "list"]);
    assert!(ok, "{err}");
    assert!(
        dead.contains("answered for receipt \"shard-0:999.1\""),
        "{dead}"
    );
}
