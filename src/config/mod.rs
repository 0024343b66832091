//! `routes.yaml`: read, parse, validate, summarise.
//!
//! Loading happens in two stages so that every refusal can point at a line and
//! column. `raw` mirrors the YAML exactly (unknown keys refused, values kept as
//! written together with their position); `validate` turns it into the domain
//! types below, which the rest of the proxy uses without re-checking anything.
//! A `Config` that exists is a config that is safe to run.

mod after;
mod calendar;
mod consumers;
mod limit;
mod overrides_file;
mod rate;
mod raw;
pub mod redis;
mod redis_section;
mod rejection;
pub mod reserve;
mod summary;
mod types;
mod validate;
pub mod watch;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use self::calendar::{CalendarUnit, CalendarWindows};
pub use self::summary::summary;
pub use self::types::{
    AlgorithmKind, ConcurrencyConfig, Config, Consistency, KeyPart, LimitConfig, ListenerTls,
    OnError, OnLimit, OnMissing, Override, OverrideRate, OverridesFile, OverridesTable, PathMatch,
    Piece, Plan, Rate, RedisConfig, RedisTarget, RejectionConfig, RouteConfig, RouteMatch, Scope,
    SentinelTarget, ServerConfig, SettleConfig, TableEntry, Template, TemplateError, UpstreamCa,
    When,
};
pub use self::validate::{Listener, listen_addr, same_port};

/// A config that cannot be used, with the place to fix it.
///
/// Displayed as `PATH:LINE:COL: message`, the format editors and CI annotators
/// jump from. `line` and `column` are 1-based; both are 0 only when the file
/// could not be read at all, and then the display is `PATH: message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(path, *line, *column, message))]
pub struct ConfigError {
    /// The config file the error is in.
    pub path: PathBuf,
    /// 1-based; 0 when the file could not be read.
    pub line: u64,
    /// 1-based; 0 when the file could not be read.
    pub column: u64,
    /// What is wrong and, usually, how to fix it; a warning's message starts
    /// with `warning:`.
    pub message: String,
}

fn render(path: &Path, line: u64, column: u64, message: &str) -> String {
    if line == 0 {
        format!("{}: {message}", path.display())
    } else {
        format!("{}:{line}:{column}: {message}", path.display())
    }
}

/// Reads and validates the file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let bytes = std::fs::read(path).map_err(|e| ConfigError {
        path: path.to_path_buf(),
        line: 0,
        column: 0,
        message: format!("cannot read the config file: {e}"),
    })?;
    let source_hash = watch::content_hash(&bytes);
    let text = utf8(bytes).map_err(|e| e.in_file(path))?;
    let mut config = parse_str(path, &text)?;
    config.source_hash = Some(source_hash);
    Ok(config)
}

/// A file's bytes as text; not UTF-8, refused at the bad byte (an editor shows it, a generic
/// I/O error does not).
fn utf8(bytes: Vec<u8>) -> Result<String, Invalid> {
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let valid = std::str::from_utf8(valid).unwrap_or_default();
        let line = valid.matches('\n').count() as u64 + 1;
        let column = valid.rsplit('\n').next().unwrap_or("").chars().count() as u64 + 1;
        Invalid::new(Pos { line, column }, "the file is not valid UTF-8")
    })
}

/// Parses and validates `text`; `path` is used in error messages, and its directory is where
/// relative file paths in the config (`server.tls`, `server.upstream_ca`) are resolved from.
pub fn parse_str(path: &Path, text: &str) -> Result<Config, ConfigError> {
    if is_empty(text) {
        // A file an editor has truncated and not yet written again reads as empty; loaded, it
        // would be a gateway with no routes (every request 404) until the next save. Nobody
        // means an empty file, so it is refused, and a reload keeps the running config.
        return Err(Invalid::new(
            Pos { line: 1, column: 1 },
            "the file is empty (no YAML document); a config with no routes is `routes: []`",
        )
        .in_file(path));
    }
    let raw = raw::parse(text).map_err(|e| e.in_file(path))?;
    let base = path.parent().unwrap_or(Path::new(""));
    let mut warnings = Vec::new();
    let mut config = validate::config(raw, base, &mut warnings).map_err(|e| e.in_file(path))?;
    warnings.sort_by_key(|w| (w.at.line, w.at.column));
    config.warnings = warnings.into_iter().map(|w| w.in_file(path)).collect();
    Ok(config)
}

/// Nothing but blank lines, comments and document markers.
fn is_empty(text: &str) -> bool {
    text.trim_start_matches('\u{feff}').lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#') || line == "---" || line == "..."
    })
}

/// A refusal before it knows which file it belongs to (unless it is in a file the config names,
/// such as an overrides file, which it then carries).
#[derive(Debug)]
struct Invalid {
    at: Pos,
    message: String,
    file: Option<PathBuf>,
}

impl Invalid {
    fn new(at: Pos, message: impl Into<String>) -> Self {
        Self {
            at,
            message: message.into(),
            file: None,
        }
    }

    /// The same refusal, in the file at `path` rather than the config file.
    fn in_other_file(mut self, path: &Path) -> Self {
        self.file = Some(path.to_path_buf());
        self
    }

    fn in_file(self, path: &Path) -> ConfigError {
        ConfigError {
            path: self.file.unwrap_or_else(|| path.to_path_buf()),
            line: self.at.line,
            column: self.at.column,
            message: self.message,
        }
    }
}

/// A 1-based line and column in the YAML text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pos {
    line: u64,
    column: u64,
}

impl Pos {
    /// serde-saphyr reports 0:0 when it lost track of a node (values buffered by
    /// untagged enums); the contract promises a position, so fall back to the top.
    fn of(location: serde_saphyr::Location) -> Self {
        if location.line() == 0 {
            Self { line: 1, column: 1 }
        } else {
            Self {
                line: location.line(),
                column: location.column(),
            }
        }
    }
}
