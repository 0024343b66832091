//! Watching the config file for changes.
//!
//! The watch is on the file's directory, not the file: editors save by writing a temp file and
//! renaming it over the old one, and a Kubernetes ConfigMap update swaps a `..data` symlink, and
//! both replace the inode a file watch would be holding. Any event in the directory wakes the
//! watcher; it waits for the burst to settle, then compares the file's bytes with the last ones
//! it saw, so only a real change is reloaded (and a bad file is reported once, not per event).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

/// Editors write in several steps; one reload per burst.
const SETTLE: Duration = Duration::from_millis(150);

/// A handle that keeps the OS watch alive; drop it to stop watching.
pub struct ConfigWatch {
    _watcher: notify::RecommendedWatcher,
    changed: Arc<tokio::sync::Notify>,
    path: PathBuf,
    last: Option<Vec<u8>>,
}

impl ConfigWatch {
    pub fn new(path: &Path) -> notify::Result<Self> {
        let changed = Arc::new(tokio::sync::Notify::new());
        let n = changed.clone();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                if event.is_ok() {
                    n.notify_one();
                }
            })?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        Ok(Self {
            _watcher: watcher,
            changed,
            path: path.to_path_buf(),
            last: std::fs::read(path).ok(),
        })
    }

    /// Resolves when the file's contents differ from the last seen ones.
    pub async fn changed(&mut self) {
        loop {
            self.changed.notified().await;
            tokio::time::sleep(SETTLE).await;
            // Mid-rename the file can be briefly absent: wait for the next event.
            let Ok(now) = std::fs::read(&self.path) else {
                continue;
            };
            if self.last.as_deref() != Some(&now[..]) {
                self.last = Some(now);
                return;
            }
        }
    }
}
