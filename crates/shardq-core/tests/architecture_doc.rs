//! ARCHITECTURE.md names real files: every `*.rs` it mentions under a crate's
//! heading exists in that crate, and every path with a `/` exists in the
//! repository (or in the crate). A module moved or renamed without its
//! paragraph fails here.

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
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
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
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
