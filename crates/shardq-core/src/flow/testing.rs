//! Fixtures shared by the flow modules' unit tests.

use super::{FlowPolicy, FlowSettings, GroupLimit, Rate};

/// Parses `s` as a rate.
pub(super) fn rate(s: &str) -> Rate {
    s.parse().expect("rate")
}

/// Settings with a group `api` (10/s, burst 2), prefix `free:` at 2/s
/// (burst 1), and key `free:vip` in group `api`.
pub(super) fn settings() -> FlowSettings {
    let mut s = FlowSettings::default();
    s.groups.insert(
        "api".into(),
        GroupLimit {
            rate: Some(rate("10/s")),
            burst: Some(2),
            concurrency: None,
        },
    );
    s.prefixes.insert(
        "free:".into(),
        FlowPolicy {
            rate: Some(rate("2/s")),
            burst: Some(1),
            ..FlowPolicy::default()
        },
    );
    s.keys.insert(
        "free:vip".into(),
        FlowPolicy {
            group: Some("api".into()),
            ..FlowPolicy::default()
        },
    );
    s
}
