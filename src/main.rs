//! The `tollgate` binary: command line → logging → library; errors → exit codes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use tollgate::app::{App, AppError, Options};
use tollgate::config::Listener;

/// Large key tables on transparent huge pages (see `tollgate::alloc`).
#[global_allocator]
static ALLOC: tollgate::alloc::HugePages = tollgate::alloc::HugePages;

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A rate-limiting HTTP reverse proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Serve (the default).
    Run(RunArgs),
    /// Validate the config, print a summary, exit 0; on error print PATH:LINE:COL: message, exit 1.
    Check {
        /// The routes file [default: the one given before `check`, else routes.yaml].
        #[arg(long)]
        config: Option<PathBuf>,
        /// Shown in the summary instead of server.listen, as `run --listen` would serve.
        #[arg(long, value_parser = |s: &str| listen_arg(s, Listener::Proxy))]
        listen: Option<SocketAddr>,
        /// Shown in the summary instead of server.admin, as `run --admin` would serve.
        #[arg(long, value_parser = |s: &str| listen_arg(s, Listener::Admin))]
        admin: Option<SocketAddr>,
    },
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// The routes file [default: routes.yaml].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Proxy listener address (overrides server.listen): IP:PORT, :PORT or PORT (every
    /// interface), localhost:PORT.
    #[arg(long, value_parser = |s: &str| listen_arg(s, Listener::Proxy))]
    listen: Option<SocketAddr>,
    /// Admin listener address (overrides server.admin): as --listen, but :PORT and PORT are
    /// loopback.
    #[arg(long, value_parser = |s: &str| listen_arg(s, Listener::Admin))]
    admin: Option<SocketAddr>,
    /// Log line format (stderr) [default: text].
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        // `tollgate --config X check` checks X, not ./routes.yaml.
        // Options may come before the subcommand too (`tollgate --config X check`); given on
        // both sides, the subcommand's win.
        Some(Command::Check {
            config,
            listen,
            admin,
        }) => check(
            &config.or(cli.run.config).unwrap_or_else(default_config),
            listen.or(cli.run.listen),
            admin.or(cli.run.admin),
        ),
        Some(Command::Run(args)) => run(RunArgs {
            config: args.config.or(cli.run.config),
            listen: args.listen.or(cli.run.listen),
            admin: args.admin.or(cli.run.admin),
            log_format: args.log_format.or(cli.run.log_format),
        }),
        None => run(cli.run),
    }
}

/// `--listen` / `--admin` take what `server.listen` takes.
fn listen_arg(s: &str, listener: Listener) -> Result<SocketAddr, String> {
    tollgate::config::listen_addr(s, listener).ok_or_else(|| {
        format!("`{s}` is not a listen address: write IP:PORT, :PORT, PORT or localhost:PORT")
    })
}

fn default_config() -> PathBuf {
    PathBuf::from("routes.yaml")
}

/// Validates and summarises the file; `--listen` / `--admin` show in the summary as `run`
/// would apply them.
fn check(
    path: &std::path::Path,
    listen: Option<SocketAddr>,
    admin: Option<SocketAddr>,
) -> ExitCode {
    match tollgate::config::load(path) {
        Ok(mut cfg) => {
            cfg.server.listen = listen.unwrap_or(cfg.server.listen);
            cfg.server.admin = admin.unwrap_or(cfg.server.admin);
            let (listen, admin) = (cfg.server.listen, cfg.server.admin);
            if tollgate::config::same_port(listen, admin) {
                // The words `run` would stop with on the same addresses.
                eprintln!("{}", AppError::SamePort { listen, admin });
                return ExitCode::FAILURE;
            }
            for w in &cfg.warnings {
                eprintln!("{w}");
            }
            print!("{}", tollgate::config::summary(&cfg));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// See [`init_logging`].
const QUIET_RUSTLS: &str = "rustls::msgs::handshake=error";

/// `RUST_LOG` as the filter; unset or empty means `info` (an empty filter would silence even
/// errors, a refused reload included), and one that does not parse is `info` and said so.
/// Unless the filter names rustls itself, rustls' handshake parser logs errors only: it warns
/// about every TLS client that puts an IP address in SNI (wrk and other OpenSSL-based tools
/// given `https://127.0.0.1/`), which it then ignores as RFC 6066 says to — a line per
/// connection saying nothing an operator can act on.
fn init_logging(format: LogFormat) {
    let given = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let quiet = |f: &str| {
        if f.contains("rustls") {
            f.to_owned()
        } else {
            format!("{f},{QUIET_RUSTLS}")
        }
    };
    let fallback = || tracing_subscriber::EnvFilter::new(quiet("info"));
    let (filter, refused) = match given
        .as_deref()
        .map(|g| tracing_subscriber::EnvFilter::try_new(quiet(g)))
    {
        Some(Ok(filter)) => (filter, None),
        Some(Err(e)) => (fallback(), Some(e)),
        None => (fallback(), None),
    };
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    if let (Some(e), Some(given)) = (refused, given) {
        tracing::warn!(rust_log = %given, error = %e, "RUST_LOG is not a filter; logging at info");
    }
}

/// A reason `run` stops: in JSON mode a line shaped as the JSON logs' (every stderr line then
/// parses), else a plain line (`PATH:LINE:COL: message` for a bad file, as `check` prints it).
/// Written directly, not through the log filter: `RUST_LOG=off` must not make `run` exit 1
/// saying nothing.
fn fatal(format: LogFormat, message: &str) {
    match format {
        LogFormat::Json => eprintln!(
            "{}",
            serde_json::json!({
                "timestamp": log_time_now(),
                "level": "ERROR",
                "fields": {"message": message},
                "target": "tollgate",
            })
        ),
        LogFormat::Text => eprintln!("{message}"),
    }
}

/// Now, as the JSON logs write their timestamps (the logger's own formatter).
fn log_time_now() -> String {
    use tracing_subscriber::fmt::{format::Writer, time::FormatTime};
    let mut now = String::new();
    let _ = tracing_subscriber::fmt::time::SystemTime.format_time(&mut Writer::new(&mut now));
    now
}

fn run(args: RunArgs) -> ExitCode {
    let format = args.log_format.unwrap_or(LogFormat::Text);
    init_logging(format);
    // Panics through the log, once each (`tollgate::panics`).
    tollgate::panics::install_hook();
    let rt = match runtime_builder().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            fatal(format, &format!("tollgate: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        // A bad file reads exactly as `tollgate check` reports it: `PATH:LINE:COL: message`.
        Err(e @ AppError::Config(_)) => {
            fatal(format, &e.to_string());
            ExitCode::FAILURE
        }
        Err(e) => {
            fatal(format, &format!("tollgate: {}", with_causes(&e)));
            ExitCode::FAILURE
        }
    }
}

/// One worker per core the process may run on (`taskset` and cgroup limits honoured), or
/// `TOKIO_WORKER_THREADS`. With a single core, a current-thread runtime: it has no work-stealing
/// queues or cross-thread wakeups to pay for, and nothing could run in parallel anyway.
fn runtime_builder() -> tokio::runtime::Builder {
    let workers = std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if workers <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        b
    }
}

/// An error and its causes on one line, `outer: cause: root`, as operators read it in one log
/// line ("cannot listen on 0.0.0.0:80: Permission denied").
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

async fn serve(args: RunArgs) -> Result<(), AppError> {
    let app = App::from_file(Options {
        config_path: Some(args.config.unwrap_or_else(default_config)),
        listen: args.listen,
        admin: args.admin,
    })
    .await?;
    tracing::info!(proxy = %app.proxy_addr(), admin = %app.admin_addr(), "tollgate listening");
    let shared = app.shared();
    tollgate::panics::count_uncaught_in(shared.gateway.metrics.clone());
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            return;
        };
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the config");
            let _ = shared.reload().await;
        }
    });
    app.run(shutdown_signal()).await;
    tracing::info!("stopped");
    Ok(())
}

/// SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutdown requested: draining (a second SIGTERM/SIGINT exits at once)");
    // An operator who pressed Ctrl-C twice wants out now, not after the grace period.
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second shutdown signal: exiting without finishing the drain");
        std::process::exit(1);
    });
}
