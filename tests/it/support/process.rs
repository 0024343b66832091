//! The real `tollgate` binary as a child process on free ports (for signals and log output).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{TempDir, client};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Proc {
    pub child: Child,
    pub proxy: String,
    pub admin: String,
    pub path: std::path::PathBuf,
    _dir: TempDir,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Starts tollgate on `yaml`, where `PROXY_PORT` and `ADMIN_PORT` are replaced by free
    /// ports; `args` are added to `run`; stderr is captured when `capture_stderr`.
    pub async fn start(
        yaml: &str,
        args: &[&str],
        env: &[(&str, &str)],
        capture_stderr: bool,
    ) -> Self {
        let dir = TempDir::new();
        let path = dir.path.join("routes.yaml");
        let (p, a) = (free_port(), free_port());
        let text = yaml
            .replace("PROXY_PORT", &p.to_string())
            .replace("ADMIN_PORT", &a.to_string());
        std::fs::write(&path, text).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        cmd.args(["run", "--config", path.to_str().unwrap()])
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(if capture_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        let child = cmd.spawn().unwrap();
        let proc = Proc {
            child,
            proxy: format!("http://127.0.0.1:{p}"),
            admin: format!("http://127.0.0.1:{a}"),
            path,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = client().get(format!("{}/healthz", proc.admin)).send().await
                && r.status() == 200
            {
                return proc;
            }
            assert!(Instant::now() < deadline, "tollgate did not come up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (at most 5 s) for the process to exit and returns whether it exited 0.
    pub async fn exited_ok(&mut self) -> bool {
        self.exit_code().await == Some(0)
    }

    /// Waits (at most 5 s) for the process to exit and returns its exit code.
    pub async fn exit_code(&mut self) -> Option<i32> {
        let t = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(t.elapsed() < Duration::from_secs(5), "did not exit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
}
