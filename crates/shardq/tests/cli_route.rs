//! The routing commands as a user runs them: `shardq route`, `slot`, `plan`.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};

use support::{output, run_stdin, temp_dir, BIN};

/// The path of the example map `name`.
fn example(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/maps")
        .join(name);
    path.to_str().unwrap().to_string()
}

#[test]
fn route_from_stdin_keeps_input_order_and_matches_args() {
    let keys: Vec<String> = (0..5000).map(|i| format!("t-{i}")).collect();
    let input = keys.join("\n") + "\n";
    let map = example("ring-4.yaml");
    let out = run_stdin(&["route", "--map", &map], input.as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), keys.len());
    for (line, key) in lines.iter().zip(&keys) {
        let (k, shard) = line.split_once('\t').unwrap();
        assert_eq!(k, key);
        assert!(shard.starts_with("redis-") && shard != "redis-4");
    }
    // The same keys as arguments give the same shards.
    let mut args = vec!["route", "--map", &map];
    args.extend(keys[..50].iter().map(String::as_str));
    let args_out = output(&args);
    let args_text = String::from_utf8(args_out.stdout).unwrap();
    assert_eq!(args_text.lines().collect::<Vec<_>>(), lines[..50]);
}

#[test]
fn slot_prints_redis_cluster_slots() {
    let out = output(&["slot", "123456789", "{user1000}.following", "foo{hash_tag}"]);
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "123456789\t12739\n{user1000}.following\t3443\nfoo{hash_tag}\t2515\n"
    );
}

/// (algorithm, lowest and highest moved fraction, all moves to the new shard?)
#[test]
fn plan_reproduces_the_seed_numbers() {
    let cases = [
        ("modulo", 0.79, 0.81, false),
        ("ring", 0.19, 0.225, true),
        ("rendezvous", 0.19, 0.21, true),
    ];
    for (alg, lo, hi, all_to_new) in cases {
        let (from, to) = (
            example(&format!("{alg}-4.yaml")),
            example(&format!("{alg}-5.yaml")),
        );
        let out = output(&[
            "plan",
            "--from",
            &from,
            "--to",
            &to,
            "--generate",
            "100000",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["keys"], 100_000);
        let f = v["moved_fraction"].as_f64().unwrap();
        assert!((lo..=hi).contains(&f), "{alg}: moved {f}");
        let moves = v["moves"].as_object().unwrap();
        let to_new: u64 = moves.values().filter_map(|m| m["redis-4"].as_u64()).sum();
        if all_to_new {
            assert_eq!(to_new, v["moved"].as_u64().unwrap(), "{alg}: {moves:?}");
        }
        let after: u64 = v["after"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(after, 100_000);
    }
}

#[test]
fn bad_map_is_a_clear_error_not_a_panic() {
    let dir = temp_dir("route-bad-map");
    let cases = [
        (
            "version: 1\nshards: [{name: a, weight: 0}]\n",
            "shards[0].weight",
        ),
        (
            "version: 1\nshards: [{name: a}]\noverrides: {t: zz}\n",
            "unknown shard \"zz\"",
        ),
        ("{{{", "not valid YAML"),
    ];
    for (i, (yaml, want)) in cases.iter().enumerate() {
        let path = dir.join(format!("map{i}.yaml"));
        std::fs::write(&path, yaml).unwrap();
        let out = output(&["route", "--map", path.to_str().unwrap(), "k"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(want) && err.contains("map"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = output(&["route", "--map", "/nonexistent/map.yaml", "k"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read shard map"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn route_exits_quietly_when_its_reader_closes_early() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::ExitStatusExt;

    let mut child = Command::new(BIN)
        .arg("route")
        .arg("--map")
        .arg(example("ring-4.yaml"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Far more output than a pipe holds, so route is still writing when
    // the reader goes away (like `shardq route ... | head -3`).
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let keys: String = (0..200_000).map(|i| format!("t-{i}\n")).collect();
        let _ = stdin.write_all(keys.as_bytes());
    });
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    for _ in 0..3 {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0);
        assert!(line.starts_with("t-"), "{line:?}");
    }
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(out.status.code(), Some(101), "{err}");
    assert!(
        out.status.success() || out.status.signal() == Some(13),
        "{:?}: {err}",
        out.status
    );
}
