//! The crate's error type.
//!
//! Every fallible operation returns [`Result`]. Errors are values: nothing in this crate panics on
//! bad input from a caller, a plugin or a peer. Each variant documents where it comes from.
//!
//! An [`Error`] has a [`kind`](Error::kind) (an [`ErrorKind`], which the C ABI maps one to one
//! onto its stable status codes), a message, and for OS errors a [`source`](std::error::Error::source).
//! Errors are [`Clone`]: the network layer fans one failure out to every waiter of a transfer. The
//! kind, not the message text, is what code branches on; it also travels over the wire, so a
//! remote failure arrives with the kind the peer raised ([`Error::new`] rebuilds it).

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Convenience alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tpu-sync.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The PJRT plugin shared library could not be opened or does not export `GetPjrtApi`.
    #[error("cannot load PJRT plugin {path}: {reason}")]
    PluginLoad {
        /// Path that was given.
        path: PathBuf,
        /// Why it failed (dlopen/dlsym message or a version check).
        reason: String,
    },
    /// A PJRT call returned a `PJRT_Error`.
    #[error("{call} failed: {code_name} ({code}): {message}")]
    Pjrt {
        /// Name of the `PJRT_Api` function that failed.
        call: &'static str,
        /// `PJRT_Error_Code` (absl status code numbering).
        code: i32,
        /// Human name of the code.
        code_name: &'static str,
        /// The plugin's message.
        message: String,
    },
    /// The plugin lacks a function or extension that the requested operation needs.
    #[error("unsupported by plugin {plugin}: {what}")]
    Unsupported {
        /// Plugin platform name (e.g. `cpu`, `cuda`, `tpu`) or path.
        plugin: String,
        /// What is missing and which path was tried.
        what: String,
    },
    /// A caller passed an invalid argument (sizes, indices, alignment, handles).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A KV layout or parallel layout is inconsistent (heads do not divide, zero sizes, ...).
    #[error("invalid layout: {0}")]
    Layout(String),
    /// A block id lies outside the layout's `num_blocks`, or a block list is malformed.
    #[error("block id out of range: {0}")]
    BlockRange(String),
    /// The two sides of a transfer disagree (layouts, plan digest, protocol version, ...), or a
    /// buffer does not match the layout it is registered under.
    #[error("mismatch: {0}")]
    Mismatch(String),
    /// A peer sent something that violates the wire protocol (bad frame, over-delivery, ...).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A chunk's checksum did not match its payload.
    #[error("checksum mismatch: {0}")]
    Checksum(String),
    /// The remote peer reported an error of a kind this side does not reproduce (an older peer
    /// that sends no kind, or a kind that only makes sense locally).
    #[error("remote error: {0}")]
    Remote(String),
    /// The peer closed the connection or died before the transfer completed.
    #[error("peer closed: {0}")]
    PeerClosed(String),
    /// An operation did not complete within its deadline.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The request id is not registered (or was already released).
    #[error("unknown request: {0}")]
    UnknownRequest(String),
    /// Host memory could not be allocated or mapped.
    #[error("host memory: {0}")]
    HostMemory(String),
    /// An operating-system I/O error.
    #[error("i/o error: {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error (shared, so that the error can be cloned).
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The operation was cancelled by the caller.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// Staging memory (pinned, locked host memory) would exceed its byte budget: the request is
    /// refused at once, and nothing already staged is touched.
    #[error("staging exhausted: {0}")]
    StagingExhausted(String),
}

/// The kind of an [`Error`]: what callers branch on, what the C ABI turns into a status code,
/// and what travels over the wire with a remote failure. Names are stable (they are part of the
/// wire format, in `snake_case`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// [`Error::PluginLoad`].
    PluginLoad,
    /// [`Error::Pjrt`].
    Pjrt,
    /// [`Error::Unsupported`].
    Unsupported,
    /// [`Error::InvalidArgument`].
    InvalidArgument,
    /// [`Error::Layout`].
    Layout,
    /// [`Error::BlockRange`].
    BlockRange,
    /// [`Error::Mismatch`].
    Mismatch,
    /// [`Error::Protocol`].
    Protocol,
    /// [`Error::Checksum`].
    Checksum,
    /// [`Error::Remote`].
    Remote,
    /// [`Error::PeerClosed`].
    PeerClosed,
    /// [`Error::Timeout`].
    Timeout,
    /// [`Error::UnknownRequest`].
    UnknownRequest,
    /// [`Error::HostMemory`].
    HostMemory,
    /// [`Error::Io`].
    Io,
    /// [`Error::Cancelled`].
    Cancelled,
    /// [`Error::StagingExhausted`].
    StagingExhausted,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 17] = [
        ErrorKind::PluginLoad,
        ErrorKind::Pjrt,
        ErrorKind::Unsupported,
        ErrorKind::InvalidArgument,
        ErrorKind::Layout,
        ErrorKind::BlockRange,
        ErrorKind::Mismatch,
        ErrorKind::Protocol,
        ErrorKind::Checksum,
        ErrorKind::Remote,
        ErrorKind::PeerClosed,
        ErrorKind::Timeout,
        ErrorKind::UnknownRequest,
        ErrorKind::HostMemory,
        ErrorKind::Io,
        ErrorKind::Cancelled,
        ErrorKind::StagingExhausted,
    ];

    /// The stable `snake_case` name (as on the wire and in metrics labels).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::PluginLoad => "plugin_load",
            ErrorKind::Pjrt => "pjrt",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Layout => "layout",
            ErrorKind::BlockRange => "block_range",
            ErrorKind::Mismatch => "mismatch",
            ErrorKind::Protocol => "protocol",
            ErrorKind::Checksum => "checksum",
            ErrorKind::Remote => "remote",
            ErrorKind::PeerClosed => "peer_closed",
            ErrorKind::Timeout => "timeout",
            ErrorKind::UnknownRequest => "unknown_request",
            ErrorKind::HostMemory => "host_memory",
            ErrorKind::Io => "io",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::StagingExhausted => "staging_exhausted",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::io("i/o", e)
    }
}

impl Error {
    /// The error for a part of the library that this build left out: `what` was asked for, and
    /// the cargo feature `feature` of the `tpu-sync` crate (off in this build) provides it.
    #[allow(dead_code)]
    pub(crate) fn feature_missing(what: &str, feature: &str) -> Self {
        Error::InvalidArgument(format!(
            "{what}: this tpu-sync was built without its `{feature}` cargo feature"
        ))
    }

    /// Wraps an `std::io::Error` with a short description of the operation.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// An error of `kind` with `message` (the form in which a remote failure is rebuilt from its
    /// wire kind and text). Structured kinds get placeholder fields: [`ErrorKind::Pjrt`] has code
    /// `UNKNOWN` and call `"remote"`, [`ErrorKind::Io`] an `Other` OS error.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        let m = message.into();
        match kind {
            ErrorKind::PluginLoad => Error::PluginLoad {
                path: PathBuf::from("(remote)"),
                reason: m,
            },
            ErrorKind::Pjrt => Error::Pjrt {
                call: "remote",
                code: 2,
                code_name: "UNKNOWN",
                message: m,
            },
            ErrorKind::Unsupported => Error::Unsupported {
                plugin: "(remote)".into(),
                what: m,
            },
            ErrorKind::InvalidArgument => Error::InvalidArgument(m),
            ErrorKind::Layout => Error::Layout(m),
            ErrorKind::BlockRange => Error::BlockRange(m),
            ErrorKind::Mismatch => Error::Mismatch(m),
            ErrorKind::Protocol => Error::Protocol(m),
            ErrorKind::Checksum => Error::Checksum(m),
            ErrorKind::Remote => Error::Remote(m),
            ErrorKind::PeerClosed => Error::PeerClosed(m),
            ErrorKind::Timeout => Error::Timeout(m),
            ErrorKind::UnknownRequest => Error::UnknownRequest(m),
            ErrorKind::HostMemory => Error::HostMemory(m),
            ErrorKind::Io => Error::Io {
                context: m,
                source: Arc::new(std::io::Error::other("reported by the peer")),
            },
            ErrorKind::Cancelled => Error::Cancelled(m),
            ErrorKind::StagingExhausted => Error::StagingExhausted(m),
        }
    }

    /// The error's kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::PluginLoad { .. } => ErrorKind::PluginLoad,
            Error::Pjrt { .. } => ErrorKind::Pjrt,
            Error::Unsupported { .. } => ErrorKind::Unsupported,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Layout(_) => ErrorKind::Layout,
            Error::BlockRange(_) => ErrorKind::BlockRange,
            Error::Mismatch(_) => ErrorKind::Mismatch,
            Error::Protocol(_) => ErrorKind::Protocol,
            Error::Checksum(_) => ErrorKind::Checksum,
            Error::Remote(_) => ErrorKind::Remote,
            Error::PeerClosed(_) => ErrorKind::PeerClosed,
            Error::Timeout(_) => ErrorKind::Timeout,
            Error::UnknownRequest(_) => ErrorKind::UnknownRequest,
            Error::HostMemory(_) => ErrorKind::HostMemory,
            Error::Io { .. } => ErrorKind::Io,
            Error::Cancelled(_) => ErrorKind::Cancelled,
            Error::StagingExhausted(_) => ErrorKind::StagingExhausted,
        }
    }

    /// The message without the kind's prefix (`"request 5 is not registered"` for an
    /// [`Error::UnknownRequest`]); for structured kinds the whole display text.
    pub fn detail(&self) -> String {
        match self {
            Error::InvalidArgument(m)
            | Error::Layout(m)
            | Error::BlockRange(m)
            | Error::Mismatch(m)
            | Error::Protocol(m)
            | Error::Checksum(m)
            | Error::Remote(m)
            | Error::PeerClosed(m)
            | Error::Timeout(m)
            | Error::UnknownRequest(m)
            | Error::HostMemory(m)
            | Error::Cancelled(m)
            | Error::StagingExhausted(m) => m.clone(),
            Error::PluginLoad { .. }
            | Error::Pjrt { .. }
            | Error::Unsupported { .. }
            | Error::Io { .. } => self.to_string(),
        }
    }

    /// The same error (same kind, same fields) with `context: ` put before its message.
    pub fn context(self, context: impl std::fmt::Display) -> Error {
        let p = |m: String| format!("{context}: {m}");
        match self {
            Error::PluginLoad { path, reason } => Error::PluginLoad {
                path,
                reason: p(reason),
            },
            Error::Pjrt {
                call,
                code,
                code_name,
                message,
            } => Error::Pjrt {
                call,
                code,
                code_name,
                message: p(message),
            },
            Error::Unsupported { plugin, what } => Error::Unsupported {
                plugin,
                what: p(what),
            },
            Error::InvalidArgument(m) => Error::InvalidArgument(p(m)),
            Error::Layout(m) => Error::Layout(p(m)),
            Error::BlockRange(m) => Error::BlockRange(p(m)),
            Error::Mismatch(m) => Error::Mismatch(p(m)),
            Error::Protocol(m) => Error::Protocol(p(m)),
            Error::Checksum(m) => Error::Checksum(p(m)),
            Error::Remote(m) => Error::Remote(p(m)),
            Error::PeerClosed(m) => Error::PeerClosed(p(m)),
            Error::Timeout(m) => Error::Timeout(p(m)),
            Error::UnknownRequest(m) => Error::UnknownRequest(p(m)),
            Error::HostMemory(m) => Error::HostMemory(p(m)),
            Error::Io { context: c, source } => Error::Io {
                context: p(c),
                source,
            },
            Error::Cancelled(m) => Error::Cancelled(p(m)),
            Error::StagingExhausted(m) => Error::StagingExhausted(p(m)),
        }
    }

    /// Returns true for errors caused by the network peer (closed, timed out, protocol).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self.kind(),
            ErrorKind::PeerClosed | ErrorKind::Timeout | ErrorKind::Protocol | ErrorKind::Remote
        )
    }
}

/// Name of a `PJRT_Error_Code` value (the absl status codes, as numbered in `pjrt_c_api.h`).
pub fn pjrt_code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNRECOGNIZED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_new() {
        for k in ErrorKind::ALL {
            let e = Error::new(k, "boom 7");
            assert_eq!(e.kind(), k);
            assert!(e.to_string().contains("boom 7"), "{e}");
            let c = e.clone().context("rank 3");
            assert_eq!(c.kind(), k);
            assert!(c.to_string().contains("rank 3: "), "{c}");
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.as_str()));
            assert_eq!(serde_json::from_str::<ErrorKind>(&json).unwrap(), k);
        }
    }

    #[test]
    fn io_errors_clone_and_keep_their_source() {
        let e = Error::io(
            "open x",
            std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
        );
        let c = e.clone();
        assert_eq!(c.kind(), ErrorKind::Io);
        let src = std::error::Error::source(&c).expect("source");
        assert!(src.to_string().contains("gone"));
        assert_eq!(Error::UnknownRequest("r 5".into()).detail(), "r 5");
    }
}
