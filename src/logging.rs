//! The CLI's log output: `--log-format text` (env_logger, the default, as before) or `json`
//! (a `tracing` subscriber writing one JSON object per line; `log` records from the library are
//! forwarded to it by `tracing-log`, and the library's spans close with their timings).

use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// env_logger lines.
    Text,
    /// One JSON object per line (tracing-subscriber).
    Json,
}

/// Environment variable read when `--log-format` is not given (`text` or `json`); set by `json`
/// so that child processes (`demo`'s halves) log the same way.
pub const ENV_FORMAT: &str = "TPU_SYNC_LOG_FORMAT";

/// Installs the logger of `format` (`None`: [`ENV_FORMAT`], else text); the level comes from
/// RUST_LOG (default `warn`).
pub fn init(format: Option<LogFormat>) {
    let format = format.unwrap_or_else(|| match std::env::var(ENV_FORMAT).as_deref() {
        Ok("json") => LogFormat::Json,
        _ => LogFormat::Text,
    });
    let filter = std::env::var("RUST_LOG").unwrap_or_default();
    let filter = if filter.trim().is_empty() {
        "warn".to_string()
    } else {
        filter
    };
    match format {
        LogFormat::Text => {
            env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
                .init();
        }
        LogFormat::Json => {
            let targets: tracing_subscriber::filter::Targets = filter.parse().unwrap_or_else(|e| {
                errln!("RUST_LOG={filter:?} ignored ({e}); using warn");
                tracing_subscriber::filter::Targets::new().with_default(tracing::Level::WARN)
            });
            let sub = tracing_subscriber::fmt()
                .json()
                .with_writer(std::io::stderr)
                .with_current_span(true)
                .with_span_list(true)
                .with_span_events(FmtSpan::CLOSE)
                .with_max_level(tracing::Level::TRACE)
                .finish()
                .with(targets);
            // Before any thread exists (main calls this first): children inherit the format.
            std::env::set_var(ENV_FORMAT, "json");
            if tracing::subscriber::set_global_default(sub).is_ok() {
                // The library logs through `log`: forward its records (with their level filter).
                let level = log::LevelFilter::Trace;
                let _ = tracing_log::LogTracer::builder()
                    .with_max_level(level)
                    .init();
            }
        }
    }
}
