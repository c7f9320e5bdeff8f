//! Membership follows the published shard map: a shard removed from the map
//! is released and stops counting toward `max_local_shards`, so a shard
//! added later is claimed; a removed shard is never claimed again.

use std::path::Path;
use std::sync::Arc;

use shardq_core::{Clock, Coordinator, ManualClock};
use shardq_fs::layout::{read_membership, write_atomic, SHARD_MAP_FILE};
use shardq_fs::map_store::deploy_shard;
use shardq_fs::{Engine, FsCoordinator, MemberOptions};
use shardq_route::{Algorithm, ShardMap};

mod support;

use support::{data_dir_with, member};

fn publish(dir: &Path, shards: &[&str], version: u64) {
    let mut map = ShardMap::with_shards(Algorithm::Rendezvous, shards.iter().copied()).unwrap();
    map.version = version;
    write_atomic(&dir.join(SHARD_MAP_FILE), map.to_yaml().as_bytes()).unwrap();
}

#[test]
fn a_shard_removed_from_the_map_is_released_and_a_new_one_claimed() {
    let dir = data_dir_with("follow-map", &["shard-0", "shard-1"]);
    let clock = ManualClock::new(1_000_000);
    let c: Arc<dyn Clock> = Arc::new(clock.clone());
    let mut a = FsCoordinator::new(&dir, member("a@1"), Arc::clone(&c)).unwrap();
    let mut b = FsCoordinator::new(&dir, member("b@2"), Arc::clone(&c)).unwrap();
    assert_eq!(a.tick().unwrap().gained, ["shard-0"]);
    assert_eq!(b.tick().unwrap().gained, ["shard-1"]);

    // shard-0 leaves the map, shard-2 joins it.
    deploy_shard(&dir, "shard-2").unwrap();
    publish(&dir, &["shard-1", "shard-2"], 2);
    clock.advance(10_000);
    let t = a.tick().unwrap();
    assert_eq!(t.lost, ["shard-0"], "a removed shard is dropped");
    assert_eq!(t.gained, ["shard-2"], "and the new one claimed at max 1");
    assert_eq!(t.owned, ["shard-2"]);
    let m = read_membership(&dir).unwrap();
    assert_eq!(m.shards["shard-0"].owner, None, "its entry is released");
    assert_eq!(m.shards["shard-2"].owner.as_deref(), Some("a@1"));
    assert_eq!(b.tick().unwrap().owned, ["shard-1"], "b is unaffected");

    // Status can say why each shard is or is not run.
    let engine = Engine::open(&dir, shardq_fs::EngineOptions::default()).unwrap();
    let now = clock.now_ms();
    let why = engine.run_reason("shard-0", now).unwrap();
    assert!(
        why.contains("not in the published map (version 2)"),
        "{why}"
    );
    let why = engine.run_reason("shard-2", now).unwrap();
    assert!(
        why.contains("run by a@1") && why.contains("lease ends in 30000 ms"),
        "{why}"
    );
    clock.advance(31_000);
    let why = engine.run_reason("shard-2", clock.now_ms()).unwrap();
    assert!(why.contains("lease lapsed 1000 ms ago"), "{why}");

    a.tick().unwrap();
    b.tick().unwrap();

    // Nobody claims the removed shard, however free it is.
    let mut s = FsCoordinator::new(&dir, member("s@3"), Arc::clone(&c)).unwrap();
    assert!(s.tick().unwrap().owned.is_empty());
    assert!(
        !s.standby_reason().contains("shard-0"),
        "{}",
        s.standby_reason()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_shard_in_the_map_without_a_membership_entry_gets_one() {
    let dir = data_dir_with("no-entry", &["shard-0"]);
    let clock = ManualClock::new(1_000_000);
    let c: Arc<dyn Clock> = Arc::new(clock.clone());
    // A shard directory made without a membership entry (an older deploy).
    deploy_shard(&dir, "shard-1").unwrap();
    let mut m = read_membership(&dir).unwrap();
    m.shards.remove("shard-1");
    shardq_fs::layout::write_membership(&dir, &m).unwrap();
    publish(&dir, &["shard-0", "shard-1"], 2);
    let mut a = FsCoordinator::new(
        &dir,
        MemberOptions {
            max_local_shards: usize::MAX,
            ..member("a@1")
        },
        c,
    )
    .unwrap();
    assert_eq!(a.tick().unwrap().owned, ["shard-0", "shard-1"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Settings changes in a data dir lose nothing: writers in threads through
/// three handles on the dir (as three processes would be), each change a
/// compare-and-set under the settings lock; readers never see a torn file.
#[test]
fn settings_changes_in_a_data_dir_are_never_lost() {
    let dir = data_dir_with("settings-cas", &["shard-0"]);
    let stores: Vec<Arc<dyn shardq_core::reshard::MapStore>> = (0..3)
        .map(|_| {
            Arc::new(shardq_fs::map_store::FileMapStore::open(&dir).unwrap())
                as Arc<dyn shardq_core::reshard::MapStore>
        })
        .collect();
    shardq_testkit::contract::settings_changes_are_never_lost(&stores);
}

/// A shard name that collides with what a data dir holds (its files, a
/// hidden lock file, a file of another program, a directory that is no
/// shard's) is refused as bad input, naming it, and nothing is created; a
/// shard directory an interrupted add left is taken again.
#[test]
fn shard_names_that_collide_with_the_data_dirs_files_are_refused() {
    let dir = data_dir_with("names", &["shard-0"]);
    std::fs::write(dir.join("notes"), b"x").unwrap();
    std::fs::create_dir(dir.join("backup")).unwrap();
    for name in [
        "membership.json",
        ".membership.lock",
        "shardmap.yaml",
        "tokens",
        "a.seg",
        "notes",
        "backup",
        "settings.flow.json",
    ] {
        let e = deploy_shard(&dir, name).unwrap_err();
        assert_eq!(e.kind(), shardq_core::ErrorKind::BadInput, "{name}: {e}");
        assert!(e.to_string().contains(name), "{e}");
        let m = read_membership(&dir).unwrap();
        assert!(!m.shards.contains_key(name), "{name}");
    }
    assert!(std::fs::metadata(dir.join("notes")).unwrap().is_file());
    deploy_shard(&dir, "shard-1").unwrap();
    // Rerun, as after a crash halfway: taken again.
    deploy_shard(&dir, "shard-1").unwrap();
    assert!(read_membership(&dir)
        .unwrap()
        .shards
        .contains_key("shard-1"));
}
