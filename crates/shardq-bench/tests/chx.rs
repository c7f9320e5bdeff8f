//! The consistent-hash harness on shardq's own routers, at sizes small enough
//! for every `cargo test`: each system's measured numbers against what its
//! algorithm promises (and, for jump and modulo, against what it cannot do).
//!
//! Routing is deterministic (stable hashes, fixed key names), so these
//! figures are the same on every run; the bounds were chosen with margin
//! over the measured values, not tuned to them.

use std::path::PathBuf;

use shardq_bench::chx::{self, report, EmbeddedTarget, Params, Quiet, RouterTarget, SystemReport};
use shardq_route::Algorithm;

/// Small enough for debug builds, large enough that sampling noise stays
/// well inside the bounds below (A: 2,500 keys per queue).
fn params() -> Params {
    Params {
        queues: 8,
        messages: 40_000,
        keys: 20_000,
        rebalance_keys: 5_000,
        affinity_keys: 2_000,
        copies: 4,
    }
}

/// What one system must show.
struct Expect {
    algorithm: Algorithm,
    /// A: max/min strictly below this, when the algorithm promises evenness.
    max_min_below: Option<f64>,
    /// B add: moved % within this many points of 1/(N+1).
    add_within_pp: Option<f64>,
    /// B add: every moved key went to the new queue.
    add_only_to_new: bool,
    /// B2: no key moved unless it was on the removed queue (`Some(false)`:
    /// the scheme is known to move others, and must be seen doing so).
    remove_minimal: Option<bool>,
}

const CASES: [Expect; 5] = [
    Expect {
        algorithm: Algorithm::Ring,
        max_min_below: Some(1.10),
        add_within_pp: Some(2.0),
        add_only_to_new: true,
        remove_minimal: Some(true),
    },
    Expect {
        algorithm: Algorithm::Rendezvous,
        max_min_below: Some(1.10),
        add_within_pp: Some(2.0),
        add_only_to_new: true,
        remove_minimal: Some(true),
    },
    Expect {
        algorithm: Algorithm::Slots,
        max_min_below: Some(1.15),
        add_within_pp: Some(2.0),
        add_only_to_new: true,
        remove_minimal: Some(true),
    },
    // Jump: perfect on add, but removing a middle bucket renumbers the rest.
    Expect {
        algorithm: Algorithm::Jump,
        max_min_below: Some(1.15),
        add_within_pp: Some(2.0),
        add_only_to_new: true,
        remove_minimal: Some(false),
    },
    // Modulo: the baseline that moves almost everything.
    Expect {
        algorithm: Algorithm::Modulo,
        max_min_below: None,
        add_within_pp: None,
        add_only_to_new: false,
        remove_minimal: Some(false),
    },
];

fn run(algorithm: Algorithm) -> SystemReport {
    let report = chx::run_system(&mut RouterTarget::new(algorithm), &params(), &mut Quiet);
    assert!(report.complete(), "{algorithm}: {:?}", report.note);
    report
}

fn check(expect: &Expect) {
    let r = run(expect.algorithm);
    let name = expect.algorithm.name();
    let d = r.distribution.as_ref().unwrap();
    assert_eq!(d.total(), params().messages, "{name}: A lost messages");
    if let Some(bound) = expect.max_min_below {
        assert!(
            d.max_min() < bound,
            "{name}: A max/min {:.4} >= {bound}",
            d.max_min()
        );
    }

    let add = r.add.as_ref().unwrap();
    let ideal = 100.0 / (params().queues + 1) as f64;
    assert!((add.ideal_pct() - ideal).abs() < 1e-9);
    if let Some(pp) = expect.add_within_pp {
        assert!(
            (add.moved_pct() - ideal).abs() <= pp,
            "{name}: B moved {:.2}% of keys, want {ideal:.2} +- {pp}",
            add.moved_pct()
        );
    }
    if expect.add_only_to_new {
        assert_eq!(
            add.moved_to_new, add.moved,
            "{name}: B moved keys between old queues"
        );
        assert_eq!(add.needless, 0, "{name}");
    } else {
        // Modulo: most keys move, and most of those between old queues.
        assert!(
            add.moved_pct() > 80.0,
            "{name}: modulo moved only {:.2}%",
            add.moved_pct()
        );
        assert!(add.needless > add.moved_to_new, "{name}");
    }

    let remove = r.remove.as_ref().unwrap();
    assert!(
        remove.on_removed > 0,
        "{name}: the removed queue held no key"
    );
    assert!(
        remove.moved >= remove.on_removed,
        "{name}: keys of the removed queue stayed"
    );
    match expect.remove_minimal {
        Some(true) => assert_eq!(
            remove.needless, 0,
            "{name}: B2 moved {} keys that were not on the removed queue",
            remove.needless
        ),
        Some(false) => assert!(
            remove.needless > remove.on_removed,
            "{name}: expected B2 to move more bystanders ({}) than removed keys ({})",
            remove.needless,
            remove.on_removed
        ),
        None => {}
    }

    let c = r.affinity.as_ref().unwrap();
    assert_eq!(c.messages, c.keys * u64::from(c.copies));
    assert_eq!(c.split_keys, 0, "{name}: C split keys across queues");
    assert_eq!(c.single_queue_keys, c.keys);
}

#[test]
fn ring() {
    check(&CASES[0]);
}

#[test]
fn rendezvous() {
    check(&CASES[1]);
}

#[test]
fn slots() {
    check(&CASES[2]);
}

#[test]
fn jump() {
    check(&CASES[3]);
}

#[test]
fn modulo() {
    check(&CASES[4]);
}

/// The embedded engine routes with a rendezvous map, so enqueuing real jobs
/// and reading shard depths back must give exactly the router's numbers.
#[test]
fn embedded_engine_matches_its_router() {
    let params = Params {
        messages: 8_000,
        keys: 4_000,
        rebalance_keys: 2_000,
        affinity_keys: 500,
        ..params()
    };
    let engine = chx::run_system(&mut EmbeddedTarget::new(), &params, &mut Quiet);
    assert!(engine.complete(), "{:?}", engine.note);
    let router = chx::run_system(
        &mut RouterTarget::new(Algorithm::Rendezvous),
        &params,
        &mut Quiet,
    );
    assert_eq!(engine.distribution, router.distribution);
    assert_eq!(engine.add, router.add);
    assert_eq!(engine.remove, router.remove);
    assert_eq!(engine.affinity, router.affinity);
    assert_eq!(engine.remove.unwrap().needless, 0);
}

/// A fresh directory under the system temp dir, removed before use.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-chx-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn result_files_hold_every_system() {
    let params = Params {
        messages: 4_000,
        keys: 2_000,
        rebalance_keys: 1_000,
        affinity_keys: 200,
        ..params()
    };
    let mut reports: Vec<SystemReport> = [Algorithm::Ring, Algorithm::Modulo]
        .into_iter()
        .map(|a| chx::run_system(&mut RouterTarget::new(a), &params, &mut Quiet))
        .collect();
    reports.push(SystemReport::skipped(
        "rabbitmq",
        "no broker at amqp://127.0.0.1:1",
    ));
    let info = report::RunInfo::detect("0.0.0-test", Some("amqp://127.0.0.1:1"));
    let dir = scratch_dir("files");
    let written = report::write_all(&dir, &params, &info, &reports).unwrap();
    assert_eq!(written.len(), report::FILES.len());

    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    // file, expected data lines (header excluded), fragments it must contain.
    let cases: &[(&str, usize, &[&str])] = &[
        (
            "distribution.csv",
            2 * 8 + 1,
            &["ring,q0,", "rabbitmq,,,,,,skipped: no broker"],
        ),
        (
            "rebalance.csv",
            2 * 2 + 1,
            &["ring,add,1000,", "modulo,remove,1000,", "rabbitmq,"],
        ),
        ("affinity.csv", 3, &["ring,200,4,800,0,200,"]),
        (
            "run_metadata.csv",
            0,
            &[
                "shardq_version,0.0.0-test",
                "ring.b_add_moved_pct,",
                "queues,8",
            ],
        ),
        (
            "summary.txt",
            0,
            &["ring ", "modulo ", "rabbitmq         skipped: no broker"],
        ),
        ("distribution.svg", 0, &["<svg", "ring (max/min"]),
        ("rebalance.svg", 0, &["<svg", "modulo"]),
    ];
    for &(file, lines, fragments) in cases {
        let text = read(file);
        if lines > 0 {
            assert_eq!(text.lines().count(), lines + 1, "{file}:\n{text}");
        }
        for f in fragments {
            assert!(text.contains(f), "{file} lacks {f:?}:\n{text}");
        }
    }
    let json = report::headline_json(&params, &info, &reports);
    assert_eq!(json["systems"]["modulo"]["c_split_keys"], 0);
    assert!(json["systems"]["rabbitmq"]["note"]
        .as_str()
        .unwrap()
        .starts_with("skipped: no broker"));
    let _ = std::fs::remove_dir_all(&dir);
}
