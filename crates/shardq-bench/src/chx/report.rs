//! Result files for the consistent-hash harness: CSVs, a text summary, a
//! JSON headline object and SVG charts.
//!
//! A system that was not measured still gets a row in every file, with its
//! reason (`skipped: ...` / `failed: ...`) in the `note` column, so a missing
//! broker can never look like a pass. Charts use plotters' SVG backend only,
//! which needs no system fonts.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::{json, Value};

use super::{Params, Rebalance, SystemReport};
use crate::error::ChxError;

/// Where and on what the run happened; rows of `run_metadata.csv`.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// shardq's version.
    pub shardq_version: String,
    /// The broker URL, when one was given.
    pub broker_url: Option<String>,
    /// Host name.
    pub host: String,
    /// Operating system and architecture.
    pub os: String,
    /// Logical CPUs.
    pub cpus: usize,
    /// CPU model name, when known.
    pub cpu_model: String,
    /// Start of the run, seconds since the Unix epoch.
    pub started_unix_s: u64,
    /// Wall time of the run in seconds.
    pub elapsed_s: f64,
}

impl RunInfo {
    /// Reads host, OS and CPU from the running machine.
    pub fn detect(shardq_version: &str, broker_url: Option<&str>) -> RunInfo {
        let host = fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "unknown".into());
        let cpu_model = fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        RunInfo {
            shardq_version: shardq_version.to_string(),
            broker_url: broker_url.map(str::to_string),
            host,
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            started_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            elapsed_s: 0.0,
        }
    }
}

/// Files [`write_all`] creates, relative to the output directory.
pub const FILES: [&str; 7] = [
    "distribution.csv",
    "rebalance.csv",
    "affinity.csv",
    "run_metadata.csv",
    "summary.txt",
    "distribution.svg",
    "rebalance.svg",
];

/// Writes every result file into `dir` (created if missing) and returns their paths.
pub fn write_all(
    dir: &Path,
    params: &Params,
    info: &RunInfo,
    reports: &[SystemReport],
) -> Result<Vec<PathBuf>, ChxError> {
    fs::create_dir_all(dir).map_err(|source| ChxError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let texts = [
        ("distribution.csv", distribution_csv(reports)),
        ("rebalance.csv", rebalance_csv(reports)),
        ("affinity.csv", affinity_csv(reports)),
        ("run_metadata.csv", metadata_csv(params, info, reports)),
        ("summary.txt", summary(params, info, reports)),
    ];
    let mut written = Vec::new();
    for (name, text) in texts {
        let path = dir.join(name);
        fs::write(&path, text).map_err(|source| ChxError::Io {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    let path = dir.join("distribution.svg");
    distribution_chart(&path, reports)?;
    written.push(path);
    let path = dir.join("rebalance.svg");
    rebalance_chart(&path, reports)?;
    written.push(path);
    Ok(written)
}

/// Quotes a CSV field when it holds a comma, quote or newline.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn note(r: &SystemReport) -> String {
    csv_field(r.note.as_deref().unwrap_or(""))
}

/// `system,queue,count,ideal,deviation,deviation_pct,note`; deviation is count - ideal.
pub fn distribution_csv(reports: &[SystemReport]) -> String {
    let mut out = String::from("system,queue,count,ideal,deviation,deviation_pct,note\n");
    for r in reports {
        match &r.distribution {
            Some(d) => {
                let ideal = d.ideal();
                for (q, &c) in d.queues.iter().zip(&d.counts) {
                    let dev = c as f64 - ideal;
                    let _ = writeln!(
                        out,
                        "{},{q},{c},{ideal:.2},{dev:+.2},{:+.3},{}",
                        r.system,
                        100.0 * dev / ideal,
                        note(r)
                    );
                }
            }
            None => {
                let _ = writeln!(out, "{},,,,,,{}", r.system, note(r));
            }
        }
    }
    out
}

/// `system,experiment,keys,moved,moved_pct,moved_to_new_pct,ideal_pct,changed_queue,needless_moved,note`.
///
/// `ideal_pct` is 1/(N+1) for `add` and the removed queue's share for
/// `remove`; `needless_moved` counts keys that moved without having to
/// (zero for a minimal scheme); `moved_to_new_pct` is empty for `remove`.
pub fn rebalance_csv(reports: &[SystemReport]) -> String {
    let mut out = String::from(
        "system,experiment,keys,moved,moved_pct,moved_to_new_pct,ideal_pct,changed_queue,needless_moved,note\n",
    );
    for r in reports {
        let rows: Vec<&Rebalance> = r.add.iter().chain(r.remove.iter()).collect();
        if rows.is_empty() {
            let _ = writeln!(out, "{},,,,,,,,,{}", r.system, note(r));
        }
        for b in rows {
            let to_new = b
                .moved_to_new_pct()
                .map(|p| format!("{p:.3}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{},{},{},{},{:.3},{to_new},{:.3},{},{},{}",
                r.system,
                b.change.name(),
                b.keys,
                b.moved,
                b.moved_pct(),
                b.ideal_pct(),
                b.changed_queue,
                b.needless,
                note(r)
            );
        }
    }
    out
}

/// `system,keys,copies,messages,split_keys,single_queue_keys,note`.
pub fn affinity_csv(reports: &[SystemReport]) -> String {
    let mut out = String::from("system,keys,copies,messages,split_keys,single_queue_keys,note\n");
    for r in reports {
        match &r.affinity {
            Some(a) => {
                let _ = writeln!(
                    out,
                    "{},{},{},{},{},{},{}",
                    r.system,
                    a.keys,
                    a.copies,
                    a.messages,
                    a.split_keys,
                    a.single_queue_keys,
                    note(r)
                );
            }
            None => {
                let _ = writeln!(out, "{},,,,,,{}", r.system, note(r));
            }
        }
    }
    out
}

/// The broker's version, if a broker was measured.
pub fn broker_version(reports: &[SystemReport]) -> Option<&str> {
    reports
        .iter()
        .find(|r| r.system == "rabbitmq" && !r.version.is_empty())
        .map(|r| r.version.as_str())
}

/// The headline numbers of one system, as a JSON object (nulls where not measured).
fn headline(r: &SystemReport) -> Value {
    let finite = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
    json!({
        "version": r.version,
        "a_max_min": r.distribution.as_ref().map(|d| finite(d.max_min())),
        "a_max_ideal": r.distribution.as_ref().map(|d| d.max_ideal()),
        "a_stddev_pct": r.distribution.as_ref().map(|d| d.stddev_pct()),
        "b_add_moved_pct": r.add.as_ref().map(|b| b.moved_pct()),
        "b_add_moved_to_new_pct": r.add.as_ref().and_then(|b| b.moved_to_new_pct()),
        "b_add_ideal_pct": r.add.as_ref().map(|b| b.ideal_pct()),
        "b_remove_moved_pct": r.remove.as_ref().map(|b| b.moved_pct()),
        "b_remove_ideal_pct": r.remove.as_ref().map(|b| b.ideal_pct()),
        "b_remove_needless_moved": r.remove.as_ref().map(|b| b.needless),
        "b_remove_needless_pct": r.remove.as_ref().map(|b| super::pct(b.needless, b.keys)),
        "c_split_keys": r.affinity.as_ref().map(|a| a.split_keys),
        "note": r.note,
    })
}

/// The headline numbers of the run as one JSON object.
pub fn headline_json(params: &Params, info: &RunInfo, reports: &[SystemReport]) -> Value {
    let systems: serde_json::Map<String, Value> = reports
        .iter()
        .map(|r| (r.system.clone(), headline(r)))
        .collect();
    json!({
        "shardq_version": info.shardq_version,
        "broker_version": broker_version(reports),
        "broker_url": info.broker_url,
        "host": info.host,
        "cpus": info.cpus,
        "cpu_model": info.cpu_model,
        "params": params,
        "elapsed_s": info.elapsed_s,
        "systems": systems,
    })
}

/// `field,value` rows: versions, machine, parameters and headline numbers
/// (`<system>.<headline>`).
pub fn metadata_csv(params: &Params, info: &RunInfo, reports: &[SystemReport]) -> String {
    let mut out = String::from("field,value\n");
    let mut row = |k: &str, v: String| {
        let _ = writeln!(out, "{},{}", csv_field(k), csv_field(&v));
    };
    row("shardq_version", info.shardq_version.clone());
    row(
        "broker_version",
        broker_version(reports).unwrap_or("").to_string(),
    );
    row("broker_url", info.broker_url.clone().unwrap_or_default());
    row("host", info.host.clone());
    row("os", info.os.clone());
    row("cpus", info.cpus.to_string());
    row("cpu_model", info.cpu_model.clone());
    row("started_unix_s", info.started_unix_s.to_string());
    row("elapsed_s", format!("{:.1}", info.elapsed_s));
    row("queues", params.queues.to_string());
    row("messages", params.messages.to_string());
    row("keys", params.keys.to_string());
    row("rebalance_keys", params.rebalance_keys.to_string());
    row("affinity_keys", params.affinity_keys.to_string());
    row("copies", params.copies.to_string());
    row("removed_queue_index", params.removed_index().to_string());
    for r in reports {
        if let Value::Object(fields) = headline(r) {
            for (k, v) in fields {
                let v = match v {
                    Value::Null => String::new(),
                    Value::String(s) => s,
                    Value::Number(n) => match n.as_f64() {
                        Some(f) if !n.is_u64() => format!("{f:.4}"),
                        _ => n.to_string(),
                    },
                    other => other.to_string(),
                };
                row(&format!("{}.{k}", r.system), v);
            }
        }
    }
    out
}

/// A fixed-width table of the headline numbers, one row per system.
pub fn summary(params: &Params, info: &RunInfo, reports: &[SystemReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Consistent-hash harness: shardq {} on {} ({} CPUs, {})",
        info.shardq_version, info.host, info.cpus, info.cpu_model
    );
    let _ = writeln!(
        out,
        "A: {} messages over {} keys on {} queues | B: {} keys, {} -> {} queues (add), remove queue #{} of {} | C: {} keys x {} copies",
        params.messages,
        params.keys,
        params.queues,
        params.rebalance_keys,
        params.queues,
        params.queues + 1,
        params.removed_index(),
        params.queues + 1,
        params.affinity_keys,
        params.copies
    );
    if let Some(v) = broker_version(reports) {
        let _ = writeln!(
            out,
            "Broker: {v} at {}",
            info.broker_url.as_deref().unwrap_or("?")
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>10} {:>6}",
        "system",
        "A max/min",
        "max/ideal",
        "B add %",
        "to new %",
        "ideal %",
        "B2 rm %",
        "ideal %",
        "B2 needless",
        "C split"
    );
    for r in reports {
        if r.distribution.is_none() && r.add.is_none() && r.affinity.is_none() {
            let _ = writeln!(
                out,
                "{:<16} {}",
                r.system,
                r.note.as_deref().unwrap_or("no result")
            );
            continue;
        }
        let f =
            |x: Option<f64>, p: usize| x.map(|v| format!("{v:.p$}")).unwrap_or_else(|| "-".into());
        let d = r.distribution.as_ref();
        let a = r.add.as_ref();
        let rm = r.remove.as_ref();
        let _ = writeln!(
            out,
            "{:<16} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>10} {:>6}",
            r.system,
            f(d.map(|d| d.max_min()), 3),
            f(d.map(|d| d.max_ideal()), 3),
            f(a.map(|b| b.moved_pct()), 2),
            f(a.and_then(|b| b.moved_to_new_pct()), 1),
            f(a.map(|b| b.ideal_pct()), 2),
            f(rm.map(|b| b.moved_pct()), 2),
            f(rm.map(|b| b.ideal_pct()), 2),
            rm.map(|b| b.needless.to_string())
                .unwrap_or_else(|| "-".into()),
            r.affinity
                .as_ref()
                .map(|c| c.split_keys.to_string())
                .unwrap_or_else(|| "-".into()),
        );
        if let Some(n) = &r.note {
            let _ = writeln!(out, "{:<16} {n}", "");
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "B add %: keys that changed queue when queue #{} was added; to new %: share of those that went to it.",
        params.queues
    );
    let _ = writeln!(
        out,
        "B2 rm %: keys that changed queue when the middle queue was removed; needless: moved keys that were not on it."
    );
    out
}

/// Colours for the systems, in report order.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Writes `labels[i]` under the centre of slot `i` of `chart`'s x axis.
/// plotters places numeric ticks at "nice" values, which skips slots, so the
/// labels are drawn in pixel space on `root` instead.
fn label_slots(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    chart: &Chart<'_, '_>,
    labels: &[String],
) -> Result<(), String> {
    let style = ("sans-serif", 13)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    for (i, label) in labels.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        root.draw(&Text::new(label.clone(), (x, y + 6), style.clone()))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn chart_err(path: &Path) -> impl Fn(String) -> ChxError + '_ {
    move |reason| ChxError::Chart {
        path: path.to_path_buf(),
        reason,
    }
}

/// One panel per measured system: messages per queue, with the ideal as a line.
pub fn distribution_chart(path: &Path, reports: &[SystemReport]) -> Result<(), ChxError> {
    let measured: Vec<&SystemReport> = reports
        .iter()
        .filter(|r| r.distribution.is_some())
        .collect();
    let cols = 2usize;
    let rows = measured.len().div_ceil(cols).max(1);
    let err = chart_err(path);
    let root = SVGBackend::new(path, (1000, 40 + 260 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (title, body) = root.split_vertically(40);
    title
        .titled(
            "A: messages per queue (line = ideal total/N)",
            ("sans-serif", 20),
        )
        .map_err(|e| err(e.to_string()))?;
    let panels = body.split_evenly((rows, cols));
    for (i, (r, panel)) in measured.iter().zip(panels.iter()).enumerate() {
        let d = r.distribution.as_ref().expect("filtered on distribution");
        let max = d.counts.iter().copied().max().unwrap_or(1) as f64;
        let ideal = d.ideal();
        let n = d.counts.len();
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!("{} (max/min {:.3})", r.system, d.max_min()),
                ("sans-serif", 16),
            )
            .margin(8)
            .x_label_area_size(24)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..n as f64, 0f64..max * 1.15)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|_| String::new())
            .draw()
            .map_err(|e| err(e.to_string()))?;
        label_slots(&root, &chart, &d.queues).map_err(&err)?;
        let colour = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(d.counts.iter().enumerate().map(|(q, &c)| {
                Rectangle::new(
                    [(q as f64 + 0.15, 0.0), (q as f64 + 0.85, c as f64)],
                    colour.filled(),
                )
            }))
            .map_err(|e| err(e.to_string()))?;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, ideal), (n as f64, ideal)],
                BLACK.stroke_width(1),
            )))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// Moved keys in percent per system: add and remove side by side, with the
/// minimum a consistent scheme needs as short black marks.
pub fn rebalance_chart(path: &Path, reports: &[SystemReport]) -> Result<(), ChxError> {
    let measured: Vec<&SystemReport> = reports
        .iter()
        .filter(|r| r.add.is_some() || r.remove.is_some())
        .collect();
    let err = chart_err(path);
    let root = SVGBackend::new(path, (1000, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let n = measured.len().max(1);
    let top = measured
        .iter()
        .flat_map(|r| r.add.iter().chain(r.remove.iter()).map(|b| b.moved_pct()))
        .fold(10.0f64, f64::max);
    let names: Vec<String> = measured.iter().map(|r| r.system.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "B: keys moved (%) — blue: add a queue, orange: remove the middle queue; black: minimum",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..n as f64, 0f64..(top * 1.1).min(100.0))
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|_| String::new())
        .y_desc("% of keys")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    label_slots(&root, &chart, &names).map_err(&err)?;
    for (i, r) in measured.iter().enumerate() {
        let x = i as f64;
        for (b, (lo, hi), colour) in [
            (&r.add, (0.12, 0.48), PALETTE[0]),
            (&r.remove, (0.52, 0.88), PALETTE[1]),
        ] {
            if let Some(b) = b {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x + lo, 0.0), (x + hi, b.moved_pct())],
                        colour.filled(),
                    )))
                    .map_err(|e| err(e.to_string()))?;
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x + lo, b.ideal_pct()), (x + hi, b.ideal_pct())],
                        BLACK.stroke_width(3),
                    )))
                    .map_err(|e| err(e.to_string()))?;
            }
        }
    }
    root.present().map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        for (raw, want) in [
            ("plain", "plain"),
            ("a,b", "\"a,b\""),
            ("say \"hi\"", "\"say \"\"hi\"\"\""),
            ("", ""),
        ] {
            assert_eq!(csv_field(raw), want);
        }
    }

    #[test]
    fn skipped_systems_get_a_row_everywhere() {
        let reports = vec![SystemReport::skipped(
            "rabbitmq",
            "no broker at amqp://127.0.0.1:1, ok",
        )];
        let params = Params::default();
        let info = RunInfo::default();
        for text in [
            distribution_csv(&reports),
            rebalance_csv(&reports),
            affinity_csv(&reports),
            summary(&params, &info, &reports),
        ] {
            assert!(
                text.contains("skipped: no broker at amqp://127.0.0.1:1"),
                "{text}"
            );
        }
    }
}
