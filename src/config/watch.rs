//! Watching the config file for changes.
//!
//! The watch is on the file's directory, not the file: editors save by writing a temp file and
//! renaming it over the old one, and a Kubernetes ConfigMap update swaps a `..data` symlink, and
//! both replace the inode a file watch would be holding. Any event in the directory wakes the
//! watcher; it waits until the directory has been quiet for [`SETTLE`] (a save in several
//! steps, truncate then write, or create, write and rename, is read once it is done, not in
//! between), then compares the file's bytes with the last ones it saw, so only a real change is
//! reloaded (and a bad file is reported once, not per event).
//!
//! The files the config names that are read with it (overrides files) are watched the same way:
//! a change to one reloads the whole config, which reads it again. Their bytes are compared by
//! hash, not kept: a million-entry table is tens of megabytes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

/// Editors write in several steps; one reload per burst, read once no event came for this long.
const SETTLE: Duration = Duration::from_millis(200);

/// A file written to without pause (a log someone put beside the config) is still read this
/// long after the first event, so the config beside it is not starved of reloads.
const SETTLE_AT_MOST: Duration = Duration::from_secs(2);

/// A handle that keeps the OS watch alive; drop it to stop watching.
pub struct ConfigWatch {
    watcher: notify::RecommendedWatcher,
    changed: Arc<tokio::sync::Notify>,
    path: PathBuf,
    last: Option<Vec<u8>>,
    /// The file could not be read at the last look (and that was logged): logged once per
    /// absence, not per event.
    unreadable: bool,
    /// Files the config reads with it, each with the hash of its bytes at the last look
    /// (`None`: unreadable then).
    others: Vec<(PathBuf, Option<u64>)>,
    /// Directories watched (the config file's first).
    dirs: Vec<PathBuf>,
}

fn dir_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn hash_of(path: &Path) -> Option<u64> {
    Some(content_hash(&std::fs::read(path).ok()?))
}

/// A file's bytes, hashed the same way in every process (a fixed seed).
pub fn content_hash(bytes: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0).hash_one(bytes)
}

impl ConfigWatch {
    /// Starts watching `path` (through its directory); the file's bytes now are what
    /// [`changed`](Self::changed) compares with first, unless they are not the bytes the
    /// running config was loaded from (`loaded`, their hash): saved between the load and now,
    /// they are a change, and `changed` resolves at once.
    pub fn new(path: &Path, loaded: Option<u64>) -> notify::Result<Self> {
        let changed = Arc::new(tokio::sync::Notify::new());
        let n = changed.clone();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Opens and reads change nothing, and the watcher's own read of the file
                // (and the reload's) would otherwise wake it again, forever.
                if event.is_ok_and(|e| !matches!(e.kind, notify::EventKind::Access(_))) {
                    n.notify_one();
                }
            })?;
        let dir = dir_of(path);
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        let mut last = std::fs::read(path).ok();
        if let Some(loaded) = loaded
            && last.as_deref().map(content_hash) != Some(loaded)
        {
            last = None;
            changed.notify_one();
        }
        Ok(Self {
            watcher,
            changed,
            path: path.to_path_buf(),
            last,
            unreadable: false,
            others: Vec::new(),
            dirs: vec![dir],
        })
    }

    /// Watches `files` too (the running config's overrides files), from their contents now;
    /// the ones no longer named are dropped. Cheap when the list is the same as before.
    pub fn also_watch(&mut self, files: &[PathBuf]) {
        if self.others.len() == files.len() && self.others.iter().zip(files).all(|(o, f)| &o.0 == f)
        {
            return;
        }
        self.others = files.iter().map(|f| (f.clone(), hash_of(f))).collect();
        for f in files {
            let dir = dir_of(f);
            if self.dirs.contains(&dir) {
                continue;
            }
            match self.watcher.watch(&dir, RecursiveMode::NonRecursive) {
                Ok(()) => self.dirs.push(dir),
                Err(e) => tracing::warn!(
                    path = %f.display(),
                    error = %e,
                    "cannot watch a file the config reads; reload with SIGHUP or POST /admin/reload after changing it"
                ),
            }
        }
    }

    /// Whether a file the config reads differs from the last look (and remembers it now).
    fn others_changed(&mut self) -> bool {
        let mut changed = false;
        for (path, last) in &mut self.others {
            let now = hash_of(path);
            if now != *last {
                *last = now;
                changed = true;
            }
        }
        changed
    }

    /// Resolves when the file's contents (or a file's it reads) differ from the last seen ones.
    pub async fn changed(&mut self) {
        loop {
            self.changed.notified().await;
            let give_up = tokio::time::Instant::now() + SETTLE_AT_MOST;
            // Each event restarts the wait: `notified()` also takes a permit an event left
            // while nobody waited, so nothing between the checks is missed.
            while tokio::time::timeout(SETTLE, self.changed.notified())
                .await
                .is_ok()
                && tokio::time::Instant::now() < give_up
            {}
            // Mid-rename the file can be briefly absent, but not once the directory has been
            // quiet: a file deleted (or made unreadable) is said once, and the next event that
            // brings it back is read as any change.
            let now = match std::fs::read(&self.path) {
                Ok(now) => now,
                Err(e) => {
                    if !self.unreadable {
                        self.unreadable = true;
                        tracing::warn!(
                            path = %self.path.display(),
                            error = %e,
                            "the config file cannot be read; the running config stays"
                        );
                    }
                    continue;
                }
            };
            self.unreadable = false;
            let others = self.others_changed();
            if self.last.as_deref() != Some(&now[..]) {
                self.last = Some(now);
                return;
            }
            if others {
                return;
            }
        }
    }
}
