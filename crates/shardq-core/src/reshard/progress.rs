//! The progress record a rebalance keeps in the map store
//! (`RebalanceProgress`, `SETTING_REBALANCE`) for every dashboard and
//! `status`.

use super::*;

/// The deployment setting holding the progress of the running, or last,
/// rebalance (a [`RebalanceProgress`] as JSON): whoever runs it (`shardq
/// rebalance`, a server, the demo), every dashboard of the deployment
/// shows it, and it stays after the run ends until the next one starts.
pub const SETTING_REBALANCE: &str = "rebalance";

/// Least time between two progress writes while keys switch, in ms (a
/// phase change is written at once).
pub const PROGRESS_WRITE_EVERY_MS: u64 = 500;

/// The progress of a rebalance, as stored under [`SETTING_REBALANCE`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RebalanceProgress {
    /// `pinning`, `moving`, `finished` or `failed`.
    pub phase: String,
    /// Keys with work to move (known after pinning).
    pub keys_to_move: usize,
    /// Keys switched so far.
    pub keys_moved: usize,
    /// Jobs (queued, delayed, dead) copied to new shards with their keys so far.
    pub jobs_moved: u64,
    /// Longest enqueue pause of a batch so far, in ms.
    pub pause_ms_max: f64,
    /// Published map version when it started.
    pub from_version: Option<u64>,
    /// Published map version when it finished.
    pub to_version: Option<u64>,
    /// True when there was nothing to do.
    pub nothing_to_do: bool,
    /// Why it failed, if it did.
    pub last_error: Option<String>,
    /// When it started (ms since the epoch).
    pub started_ms: Option<u64>,
    /// When it ended (ms since the epoch).
    pub finished_ms: Option<u64>,
    /// When this record was written (ms since the epoch): a running
    /// phase not updated for long is a run that may have died.
    #[serde(default)]
    pub updated_ms: Option<u64>,
    /// Who runs it ([`RebalanceOptions::runner`]).
    #[serde(default)]
    pub runner: String,
}

impl RebalanceProgress {
    /// A run that started at `now_ms`.
    pub fn started(now_ms: u64, runner: &str) -> RebalanceProgress {
        RebalanceProgress {
            phase: "pinning".into(),
            started_ms: Some(now_ms),
            updated_ms: Some(now_ms),
            runner: runner.to_string(),
            ..RebalanceProgress::default()
        }
    }

    /// Whether the run is in a running phase.
    pub fn is_running(&self) -> bool {
        matches!(self.phase.as_str(), "pinning" | "moving")
    }

    /// Takes in one event of the run.
    pub fn note(&mut self, ev: &RebalanceEvent) {
        match *ev {
            RebalanceEvent::Pinned { pinned, .. } => {
                self.phase = "moving".into();
                self.keys_to_move = pinned;
            }
            RebalanceEvent::Moving { .. } | RebalanceEvent::Waiting { .. } => {
                self.phase = "moving".into()
            }
            RebalanceEvent::Switched {
                done,
                total,
                jobs,
                pause_ms,
                ..
            } => {
                self.phase = "moving".into();
                self.keys_moved = done;
                self.keys_to_move = total;
                self.jobs_moved += jobs;
                self.pause_ms_max = self.pause_ms_max.max(pause_ms);
            }
            RebalanceEvent::Finished { version } => self.to_version = Some(version),
        }
    }

    /// Takes in the run's end at `now_ms`.
    pub fn ended(&mut self, result: &Result<RebalanceReport, ReshardError>, now_ms: u64) {
        self.finished_ms = Some(now_ms);
        self.updated_ms = Some(now_ms);
        match result {
            Ok(r) => {
                self.phase = "finished".into();
                self.from_version = Some(r.from_version);
                self.to_version = Some(r.to_version);
                self.keys_moved = r.moved.len();
                self.jobs_moved = r.jobs_moved;
                self.keys_to_move = self.keys_to_move.max(r.moved.len());
                self.nothing_to_do = r.nothing_to_do;
                self.pause_ms_max = self.pause_ms_max.max(r.pause_percentile_ms(100.0));
            }
            Err(e) => {
                self.phase = "failed".into();
                self.last_error = Some(e.to_string());
            }
        }
    }
}

/// The deployment's stored rebalance progress, if one was written and
/// parses (a record this build cannot read is reported as none).
pub fn stored_progress(store: &dyn MapStore) -> Result<Option<RebalanceProgress>, ReshardError> {
    Ok(store
        .load_setting(SETTING_REBALANCE)?
        .and_then(|doc| serde_json::from_str(&doc).ok()))
}

/// Writes a run's progress to the map store, at phase changes and at most
/// every [`PROGRESS_WRITE_EVERY_MS`] between them. A write that fails is
/// dropped: progress is for the eyes, and never fails the run it shows.
pub(super) struct ProgressRecorder<'a> {
    pub(super) store: &'a dyn MapStore,
    pub(super) clock: &'a dyn Clock,
    pub(super) progress: RebalanceProgress,
    pub(super) written_ms: u64,
    pub(super) written_phase: String,
    /// Another run's record replaced this one's (this run lost its lock
    /// while stalled, and a new run started): it writes no more.
    pub(super) superseded: bool,
}

impl ProgressRecorder<'_> {
    pub(super) fn write(&mut self, now_ms: u64) {
        if self.superseded {
            return;
        }
        if !self.written_phase.is_empty() {
            // Only over its own record: a run that stalled past its lock
            // must not overwrite the next run's.
            if let Ok(Some(cur)) = stored_progress(self.store) {
                if cur.started_ms != self.progress.started_ms || cur.runner != self.progress.runner
                {
                    self.superseded = true;
                    return;
                }
            }
        }
        self.progress.updated_ms = Some(now_ms);
        if let Ok(doc) = serde_json::to_string(&self.progress) {
            let _ = self.store.store_setting(SETTING_REBALANCE, Some(&doc));
        }
        self.written_ms = now_ms;
        self.written_phase.clone_from(&self.progress.phase);
    }

    pub(super) fn note(&mut self, ev: &RebalanceEvent) {
        self.progress.note(ev);
        let now = self.clock.now_ms();
        let done = self.progress.keys_to_move > 0
            && self.progress.keys_moved >= self.progress.keys_to_move;
        if self.progress.phase != self.written_phase
            || done
            || now.saturating_sub(self.written_ms) >= PROGRESS_WRITE_EVERY_MS
        {
            self.write(now);
        }
    }
}
