//! The crate's error type.
//!
//! Every fallible operation returns [`Result`]. Errors are values: nothing in this crate panics on
//! bad input from a caller, a plugin or a peer. Each variant documents where it comes from; the
//! C ABI maps variants one to one onto stable status codes (see `tpu-sync-ffi`).

use std::path::PathBuf;

/// Convenience alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tpu-sync.
#[derive(Debug, thiserror::Error)]
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
    /// The two sides of a transfer disagree (layouts, plan digest, protocol version, ...).
    #[error("mismatch: {0}")]
    Mismatch(String),
    /// A peer sent something that violates the wire protocol (bad frame, over-delivery, ...).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A chunk's checksum did not match its payload.
    #[error("checksum mismatch: {0}")]
    Checksum(String),
    /// The remote peer reported an error for this request.
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
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The operation was cancelled by the caller.
    #[error("cancelled: {0}")]
    Cancelled(String),
}

impl Error {
    /// Wraps an `std::io::Error` with a short description of the operation.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Returns true for errors caused by the network peer (closed, timed out, protocol).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            Error::PeerClosed(_) | Error::Timeout(_) | Error::Protocol(_) | Error::Remote(_)
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
