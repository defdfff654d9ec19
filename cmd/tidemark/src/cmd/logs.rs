//! Where the command's own lines go: `tracing` logs on stderr (colours only at a terminal;
//! `TIDEMARK_LOG_FORMAT=json`: one JSON object per event and nothing else on stderr), and the
//! operator notices and the final error, which follow that choice.

/// True when logs are JSON lines (`TIDEMARK_LOG_FORMAT=json`): then every message for stderr
/// goes through `tracing` too.
static JSON_LOGS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Sets up `tracing` (filter from `RUST_LOG`, else Tidemark's info and everything else's
/// warnings).
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "warn,tidemark_server=info,tidemark_store=info".into());
    // colours only for a person at a terminal, never in files or log collectors
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // TIDEMARK_LOG_FORMAT=json: one JSON object per event (for log collectors), and nothing
    // else on stderr
    let json = std::env::var("TIDEMARK_LOG_FORMAT").is_ok_and(|v| v == "json");
    let _ = JSON_LOGS.set(json);
    if json {
        logs.json().init();
    } else {
        logs.init();
    }
}

fn json() -> bool {
    JSON_LOGS.get().copied().unwrap_or(false)
}

/// A line for the operator on stderr: a log event in JSON mode, plain text otherwise.
pub fn notice(msg: &str) {
    if json() {
        tracing::info!("{msg}");
    } else {
        eprintln!("{msg}");
    }
}

/// The error a command ended with: `error: <e>` with its causes, or an `exiting` event.
pub fn fatal(e: &anyhow::Error) {
    if json() {
        tracing::error!(error = %format!("{e:#}"), "exiting");
    } else {
        eprintln!("error: {e:#}");
    }
}
