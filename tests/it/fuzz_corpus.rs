//! Every committed fuzz input, replayed on stable through the same harnesses the fuzz targets
//! run (`tollgate::fuzzing`): the minimised corpora under `fuzz/corpus/<target>/` and the
//! findings kept under `fuzz/regressions/<target>/`. A harness panics when its property does not
//! hold, so a finding that comes back fails here, without nightly or libFuzzer. How to fuzz:
//! `docs/fuzzing.md`.

use std::path::{Path, PathBuf};

use tollgate::fuzzing::TARGETS;

fn inputs(folder: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Replays every input of every target; names the input that fails.
fn replay(kind: &str) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(kind);
    let mut n = 0;
    for (target, harness) in TARGETS {
        for file in inputs(&root.join(target)) {
            let data = std::fs::read(&file).expect("a corpus file");
            let run = std::panic::catch_unwind(|| harness(&data));
            assert!(run.is_ok(), "{target}: {} fails", file.display());
            n += 1;
        }
    }
    n
}

#[test]
fn every_corpus_input_holds() {
    let n = replay("corpus");
    // Each target has a committed corpus: an empty replay would prove nothing.
    for (target, _) in TARGETS {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        assert!(!inputs(&dir).is_empty(), "no corpus for {target}");
    }
    assert!(n > 0);
}

#[test]
fn every_kept_finding_stays_fixed() {
    replay("regressions");
}
