//! ARCHITECTURE.md names real files, and every source file. Two checks:
//!
//! * every `*.rs` it mentions under a crate's heading exists in that crate,
//!   and every path with a `/` exists in the repository (or in the crate):
//!   a module moved or renamed without its paragraph fails here;
//! * every `.rs` file under `crates/*/src/` (recursively) is named. The
//!   rule: a backticked span equal to the file's path relative to its
//!   crate's `src/` (`api/flow.rs`, `chx/rabbitmq.rs`, `lib.rs`) on a line
//!   of that crate's section, which runs from its `### `crates/NAME``
//!   heading to the next `##` or `###` heading; or, anywhere in the
//!   document, a backticked span equal to its full repository path
//!   (`crates/NAME/src/api/flow.rs`). A module added without a word about
//!   it fails here, and so does one named only in another crate's section
//!   (`backend.rs` is a file of several crates).

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn architecture_md(root: &Path) -> String {
    std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md")
}

/// Backticked words of a line.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

fn is_pathlike(span: &str) -> bool {
    let exts = [".rs", ".md", ".json", ".yaml", ".toml", ".sh", ".py", ".ts"];
    !span.contains(' ') && !span.contains('*') && exts.iter().any(|e| span.ends_with(e))
}

#[test]
fn every_path_architecture_md_names_exists() {
    let root = repo_root();
    let text = architecture_md(&root);
    let mut crate_dir: Option<PathBuf> = None;
    let mut missing = Vec::new();
    let mut checked = 0;
    for (n, line) in text.lines().enumerate() {
        if let Some(h) = line.strip_prefix("### ") {
            crate_dir = code_spans(h)
                .first()
                .map(|c| root.join(c))
                .filter(|d| d.is_dir());
            continue;
        }
        if line.starts_with("## ") {
            crate_dir = None;
        }
        for span in code_spans(line).into_iter().filter(|s| is_pathlike(s)) {
            let mut candidates = vec![root.join(span)];
            if let Some(dir) = &crate_dir {
                candidates.push(dir.join(span));
                candidates.push(dir.join("src").join(span));
                if let Ok(entries) = std::fs::read_dir(dir.join("src")) {
                    for e in entries.flatten() {
                        candidates.push(e.path().join(span));
                    }
                }
            }
            // Names of files in a data directory (made at run time) are not
            // repository paths; they are documented in docs/design.md.
            let runtime = !span.contains('/') && !span.ends_with(".rs") && !span.ends_with(".md");
            checked += 1;
            if !runtime && !candidates.iter().any(|c| c.exists()) {
                missing.push(format!("line {}: {span}", n + 1));
            }
        }
    }
    assert!(
        checked > 20,
        "too few paths found ({checked}); did the format change?"
    );
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names files that do not exist: {missing:?}"
    );
}

/// Every `.rs` file under `dir`, recursively, as paths relative to `base`
/// with `/` between the parts.
fn rs_files(base: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            rs_files(base, &path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            let rel = path.strip_prefix(base).expect("under base");
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push(parts.join("/"));
        }
    }
}

/// Every crate with a `src/` directory: (name, its `.rs` files relative to
/// `src/`), sorted.
fn crate_sources(root: &Path) -> Vec<(String, Vec<String>)> {
    let mut crates = Vec::new();
    let entries = std::fs::read_dir(root.join("crates")).expect("crates/");
    for e in entries.flatten() {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        rs_files(&src, &src, &mut files);
        files.sort();
        crates.push((e.file_name().to_string_lossy().into_owned(), files));
    }
    crates.sort();
    crates
}

/// The backticked spans on the lines of crate `name`'s sections: each runs
/// from a `### ` heading whose first span is `crates/NAME` to the next
/// `#`, `##` or `###` heading. `None` when the crate has no section.
fn section_spans<'a>(text: &'a str, name: &str) -> Option<Vec<&'a str>> {
    let heading = format!("crates/{name}");
    let mut inside = false;
    let mut found = false;
    let mut spans = Vec::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("### ") {
            inside = code_spans(h).first().map(|c| c.trim_end_matches('/')) == Some(&heading);
            found |= inside;
            continue;
        }
        if line.starts_with("# ") || line.starts_with("## ") {
            inside = false;
        }
        if inside {
            spans.extend(code_spans(line));
        }
    }
    found.then_some(spans)
}

#[test]
fn architecture_md_names_every_source_file() {
    let root = repo_root();
    let text = architecture_md(&root);
    let everywhere: Vec<&str> = text.lines().flat_map(code_spans).collect();
    let mut unnamed = Vec::new();
    let mut no_section = Vec::new();
    let mut files_seen = 0;
    for (name, files) in crate_sources(&root) {
        let section = section_spans(&text, &name);
        if section.is_none() {
            no_section.push(format!("crates/{name}"));
        }
        let section = section.unwrap_or_default();
        for rel in files {
            files_seen += 1;
            let full = format!("crates/{name}/src/{rel}");
            if !section.contains(&rel.as_str()) && !everywhere.contains(&full.as_str()) {
                unnamed.push(full);
            }
        }
    }
    assert!(
        files_seen > 20,
        "too few source files found ({files_seen}); is the layout still crates/*/src?"
    );
    assert!(
        no_section.is_empty() && unnamed.is_empty(),
        "ARCHITECTURE.md does not name every source file.\n\
         Crates without a section headed ### `crates/NAME`: {no_section:?}\n\
         Files not named (write the path relative to the crate's src/ in \
         backticks in the crate's section, or the full path anywhere):\n  {}",
        unnamed.join("\n  ")
    );
}
