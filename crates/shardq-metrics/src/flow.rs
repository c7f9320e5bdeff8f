//! The flow-control series: what this process's [`FlowControl`] admitted
//! and held back, read from its [`FlowStats`] when a scrape comes (the
//! counters advance by what changed since the last scrape).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shardq_core::{FlowControl, FlowStats};

/// Label set of the per-group series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabel {
    /// The group's name.
    pub group: String,
}

/// The series, and what the last scrape saw.
pub(crate) struct FlowSeries {
    source: Mutex<Option<Arc<FlowControl>>>,
    seen: Mutex<FlowStats>,
    group_starts: Family<GroupLabel, Counter>,
    group_throttled: Family<GroupLabel, Counter>,
    group_held: Family<GroupLabel, Gauge>,
    group_running: Family<GroupLabel, Gauge>,
    key_throttled: Counter,
    held_keys: Gauge,
    errors: Counter,
}

impl FlowSeries {
    pub(crate) fn register(r: &mut Registry) -> FlowSeries {
        let s = FlowSeries {
            source: Mutex::new(None),
            seen: Mutex::new(FlowStats::default()),
            group_starts: Family::default(),
            group_throttled: Family::default(),
            group_held: Family::default(),
            group_running: Family::default(),
            key_throttled: Counter::default(),
            held_keys: Gauge::default(),
            errors: Counter::default(),
        };
        r.register(
            "shardq_flow_group_starts",
            "Runs this process started that counted against a flow-control group's limit, per group",
            s.group_starts.clone(),
        );
        r.register(
            "shardq_flow_group_throttled",
            "Starts this process held back because a group's bucket was empty or held, per group",
            s.group_throttled.clone(),
        );
        r.register(
            "shardq_flow_group_held",
            "1 while a group's bucket is empty or held (a handler's back-off) as this process last saw it, per group",
            s.group_held.clone(),
        );
        r.register(
            "shardq_flow_group_running",
            "Runs holding one of a group's run slots now, over every process of the deployment, per group that caps its runs at once",
            s.group_running.clone(),
        );
        r.register(
            "shardq_flow_key_throttled",
            "Starts this process held back because a key's own bucket was empty",
            s.key_throttled.clone(),
        );
        r.register(
            "shardq_flow_errors",
            "Failed reads of the flow settings or of a group's bucket (a group that cannot be read holds its keys back)",
            s.errors.clone(),
        );
        r.register(
            "shardq_flow_held_keys",
            "Keys this process holds back now (over their own or their group's limit)",
            s.held_keys.clone(),
        );
        s
    }

    pub(crate) fn set_source(&self, flow: Arc<FlowControl>) {
        *self.source.lock().unwrap_or_else(|p| p.into_inner()) = Some(flow);
    }

    /// Brings the series up to the source's stats at `now_ms`.
    pub(crate) fn update(&self, now_ms: u64) {
        let Some(flow) = self
            .source
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        else {
            return;
        };
        let now = flow.stats();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let advance = |family: &Family<GroupLabel, Counter>,
                       new: &BTreeMap<String, u64>,
                       old: &BTreeMap<String, u64>| {
            for (g, n) in new {
                let was = old.get(g).copied().unwrap_or(0);
                family
                    .get_or_create(&GroupLabel { group: g.clone() })
                    .inc_by(n.saturating_sub(was));
            }
        };
        advance(&self.group_starts, &now.group_starts, &seen.group_starts);
        advance(
            &self.group_throttled,
            &now.group_throttled,
            &seen.group_throttled,
        );
        self.key_throttled
            .inc_by(now.key_throttled.saturating_sub(seen.key_throttled));
        self.errors.inc_by(now.errors.saturating_sub(seen.errors));
        for g in now.group_starts.keys().chain(now.group_throttled.keys()) {
            let held = now.held_groups.get(g).is_some_and(|&at| at > now_ms);
            self.group_held
                .get_or_create(&GroupLabel { group: g.clone() })
                .set(i64::from(held));
        }
        let held_keys = now
            .held_keys
            .values()
            .filter(|h| h.until_ms > now_ms)
            .count();
        self.held_keys.set(held_keys as i64);
        *seen = now;
        drop(seen);
        // Read from the shared store: the same for every process.
        let settings = flow.settings();
        for (g, limit) in &settings.groups {
            if limit.concurrency.is_some() {
                if let Some(n) = flow.group_running(g, now_ms) {
                    self.group_running
                        .get_or_create(&GroupLabel { group: g.clone() })
                        .set(n as i64);
                }
            }
        }
    }
}
