//! Every validation rule with its exact position, and the shipped files.

mod after;
mod calendar;
mod consumers;
mod errors;
mod limits;
mod reserve;
mod sentinel;
mod tls;
mod valid;

use std::path::Path;

use super::{Config, ConfigError, parse_str};

fn parse(yaml: &str) -> Result<Config, ConfigError> {
    parse_str(Path::new("routes.yaml"), yaml)
}

fn lines(lines: &[&str]) -> String {
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

/// One route (`api`) with one limit (`l`); `extra` goes into the limit's
/// mapping from line 6 on, where keys start at column 9 (so a value after
/// `key: ` starts at column 9 + len("key: ")).
fn with_limit(extra: &[&str]) -> String {
    limit_file(&[], extra)
}

/// Like [`with_limit`] with a two-line `redis:` section first: extra lines
/// start at line 8.
fn with_redis_limit(extra: &[&str]) -> String {
    limit_file(&["redis:", "  url: redis://127.0.0.1:6379"], extra)
}

fn limit_file(prefix: &[&str], extra: &[&str]) -> String {
    let mut all: Vec<String> = prefix.iter().map(|l| (*l).to_owned()).collect();
    all.extend(
        [
            "routes:",
            "  - name: api",
            "    upstream: http://127.0.0.1:9000",
            "    limits:",
            "      - name: l",
        ]
        .map(str::to_owned),
    );
    all.extend(extra.iter().map(|l| format!("        {l}")));
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    lines(&refs)
}

#[track_caller]
fn assert_err(yaml: &str, line: u64, column: u64, fragment: &str) {
    let e = match parse(yaml) {
        Ok(cfg) => panic!("expected an error at {line}:{column}, got {cfg:#?}"),
        Err(e) => e,
    };
    assert!(
        e.message.contains(fragment),
        "message {:?} lacks {fragment:?}",
        e.message
    );
    assert_eq!(
        (e.line, e.column),
        (line, column),
        "wrong position for: {e}"
    );
    assert_eq!(
        e.to_string(),
        format!("routes.yaml:{line}:{column}: {}", e.message)
    );
}

#[track_caller]
fn ok(yaml: &str) -> Config {
    parse(yaml).unwrap_or_else(|e| panic!("{e}\n--- yaml ---\n{yaml}"))
}
