//! The binary as an operator runs it: `check`, `--version`, and a bad file's one-line error.

use std::process::Command;

fn tollgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

#[test]
fn check_accepts_the_shipped_routes_yaml_and_prints_a_summary() {
    let out = tollgate()
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/routes.yaml"),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for word in [
        "users",
        "search",
        "default",
        "per-ip",
        "per-user",
        "per-api-key",
    ] {
        assert!(stdout.contains(word), "summary lacks {word}:\n{stdout}");
    }
}

#[test]
fn check_refuses_a_bad_file_with_path_line_col() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.yaml");
    std::fs::write(
        &path,
        "routes:\n  - name: a\n    upstream: http://127.0.0.1:1\n    limits:\n      - name: l\n        rate: 10/fortnight\n",
    )
    .unwrap();
    let out = tollgate()
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let expected = format!("{}:6:15: ", path.display());
    assert!(stderr.starts_with(&expected), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_field_is_refused_by_check_with_its_position() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.yaml");
    std::fs::write(&path, "server:\n  listen: 127.0.0.1:8080\n  bogus: 1\n").unwrap();
    let out = tollgate()
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!("{}:3:3: ", path.display())),
        "{stderr}"
    );
    assert!(stderr.contains("bogus"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A setting that loads but does less than it seems to: `check` passes (exit 0, summary on
/// stdout) and names it on stderr at its line and column.
#[test]
fn check_passes_a_file_with_warnings_and_names_them_with_path_line_col() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("warn.yaml");
    std::fs::write(
        &path,
        "routes:\n  - name: a\n    upstream: http://127.0.0.1:1\n    limits:\n      - name: l\n        algorithm: fixed_window\n        rate: 10/1s\n        burst: 5\n",
    )
    .unwrap();
    let out = tollgate()
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim_end(),
        format!(
            "{}:8:16: warning: burst applies to gcra only and is ignored: fixed_window admits at most the rate's count per period",
            path.display()
        )
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("fixed_window"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_prints_the_crate_version() {
    let out = tollgate().arg("--version").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
}

/// Runs tollgate with `args`, where `PATH` stands for a file holding a bad config, in that
/// file's directory; asserts exit 1 and stderr starting with the error's `PATH:1:` position,
/// the form `check` prints.
fn assert_bad_file_refused(tag: &str, args: &[&str]) {
    let dir = std::env::temp_dir().join(format!("tollgate-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.yaml");
    std::fs::write(&path, "routes: 5\n").unwrap();
    let file = path.to_str().unwrap();
    let args: Vec<&str> = args
        .iter()
        .map(|a| if *a == "PATH" { file } else { a })
        .collect();
    let out = tollgate().args(&args).current_dir(&dir).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{args:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!("{}:1:", path.display())),
        "{args:?}: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_with_a_bad_file_exits_1_without_serving() {
    assert_bad_file_refused("cli3", &["run", "--config", "PATH"]);
}

#[test]
fn config_given_before_run_is_the_file_served() {
    assert_bad_file_refused("cli5", &["--config", "PATH", "run"]);
}

#[test]
fn config_given_before_check_is_the_file_checked() {
    assert_bad_file_refused("cli4", &["--config", "PATH", "check"]);
}

/// `check` shows the addresses `run` would serve with the same options, wherever they are
/// written (they used to be ignored before `check` and refused after it).
#[test]
fn check_summarises_listen_and_admin_overrides() {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/routes.yaml");
    for args in [
        &[
            "--listen",
            "127.0.0.1:21284",
            "--admin",
            "21285",
            "check",
            "--config",
            shipped,
        ][..],
        &[
            "check",
            "--config",
            shipped,
            "--listen",
            "127.0.0.1:21284",
            "--admin",
            "21285",
        ],
    ] {
        let out = tollgate().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        let summary = String::from_utf8_lossy(&out.stdout);
        assert!(summary.contains("listen   127.0.0.1:21284"), "{summary}");
        assert!(summary.contains("admin    127.0.0.1:21285"), "{summary}");
    }
    // Overrides that would collide are refused as `run` would fail on them.
    let out = tollgate()
        .args([
            "check",
            "--config",
            shipped,
            "--listen",
            "127.0.0.1:21286",
            "--admin",
            "21286",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("same port"));
}

/// `tollgate run` on the shipped routes.yaml with both addresses overridden, to its exit.
fn run_shipped(listen: &str, admin: &str) -> std::process::Output {
    tollgate()
        .args([
            "run",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/routes.yaml"),
            "--listen",
            listen,
            "--admin",
            admin,
        ])
        .output()
        .unwrap()
}

/// `run` gives the reason `check` gives, not the second bind's "address in use", which would
/// send an operator looking for another process on a port that is free.
#[test]
fn run_with_listen_and_admin_on_one_port_says_so() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let out = run_shipped(&addr, &addr);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("would bind the same port"), "{err}");
    assert!(!err.contains("in use"), "{err}");
}

#[test]
fn run_on_a_busy_port_exits_1_naming_the_address_and_the_cause_once() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = run_shipped(&addr, "127.0.0.1:0");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot listen on {addr}")), "{err}");
    assert_eq!(err.matches("os error").count(), 1, "{err}");
}

/// With `--log-format json` every line on stderr is a JSON object, the reason `run` stops
/// included (a bad file: its `PATH:LINE:COL: message`; a busy port), whatever `RUST_LOG` says
/// (empty, or `off`); a `RUST_LOG` that does not parse is the default level with a warning.
#[test]
fn json_logs_hold_the_fatal_error_and_an_empty_rust_log_still_logs() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.yaml");
    std::fs::write(&path, "routes: 5\n").unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/routes.yaml");
    let cases: [(&[&str], String); 2] = [
        (
            &[
                "run",
                "--log-format",
                "json",
                "--config",
                path.to_str().unwrap(),
            ],
            format!("{}:1:", path.display()),
        ),
        (
            &[
                "run",
                "--log-format",
                "json",
                "--config",
                shipped,
                "--listen",
                &addr,
                "--admin",
                "127.0.0.1:0",
            ],
            format!("cannot listen on {addr}"),
        ),
    ];
    for ((args, wanted), rust_log) in cases.into_iter().zip(["", "off"]) {
        let out = tollgate()
            .args(args)
            .env("RUST_LOG", rust_log)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<serde_json::Value> = stderr
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        let last = lines
            .last()
            .unwrap_or_else(|| panic!("nothing logged: {args:?}"));
        assert_eq!(last["level"], "ERROR", "{last}");
        let message = last["fields"]["message"].as_str().unwrap();
        assert!(message.contains(&wanted), "{message}");
        let stamp = last["timestamp"].as_str().unwrap();
        assert!(stamp.len() == 27 && stamp.ends_with('Z'), "{stamp}");
    }
    // A RUST_LOG that does not parse is the default level, and says so.
    let out = tollgate()
        .args([
            "run",
            "--log-format",
            "json",
            "--config",
            path.to_str().unwrap(),
        ])
        .env("RUST_LOG", "tollgate==x")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("\"level\":\"WARN\"") && l.contains("RUST_LOG is not a filter")),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
