//! Status codes, the thread-local last-error message and the panic boundary.

use std::cell::RefCell;
use std::ffi::c_char;

use tpu_sync::{Error, ErrorKind};

/// Result of every fallible function. Values are stable: new codes are appended, retired codes are
/// never reused.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tpu_sync_status {
    /// Success.
    TPU_SYNC_OK = 0,
    /// An argument is invalid (size, index, alignment, value out of range, bad UTF-8 or JSON).
    TPU_SYNC_INVALID_ARGUMENT = 1,
    /// A required pointer argument is NULL.
    TPU_SYNC_NULL_POINTER = 2,
    /// A handle is NULL, already freed, or of another type.
    TPU_SYNC_INVALID_HANDLE = 3,
    /// The PJRT plugin could not be loaded.
    TPU_SYNC_PLUGIN_LOAD = 4,
    /// A PJRT call failed (message has the PJRT code and text).
    TPU_SYNC_PJRT = 5,
    /// The plugin lacks what the operation needs.
    TPU_SYNC_UNSUPPORTED = 6,
    /// A KV or parallel layout is inconsistent.
    TPU_SYNC_LAYOUT = 7,
    /// A block id is out of range or a block list is malformed.
    TPU_SYNC_BLOCK_RANGE = 8,
    /// The two sides of a transfer disagree.
    TPU_SYNC_MISMATCH = 9,
    /// A peer violated the wire protocol.
    TPU_SYNC_PROTOCOL = 10,
    /// A checksum did not match.
    TPU_SYNC_CHECKSUM = 11,
    /// The remote peer reported an error.
    TPU_SYNC_REMOTE = 12,
    /// The peer closed the connection or died.
    TPU_SYNC_PEER_CLOSED = 13,
    /// A deadline passed.
    TPU_SYNC_TIMEOUT = 14,
    /// The request id is not registered.
    TPU_SYNC_UNKNOWN_REQUEST = 15,
    /// Host memory could not be allocated or mapped.
    TPU_SYNC_HOST_MEMORY = 16,
    /// An operating-system I/O error.
    TPU_SYNC_IO = 17,
    /// The operation was cancelled.
    TPU_SYNC_CANCELLED = 18,
    /// An output buffer is too small; the needed size was written to `len_out`.
    TPU_SYNC_BUFFER_TOO_SMALL = 19,
    /// An asynchronous operation has not completed yet (a wait ran out of time, or a poll found
    /// it running). Not a failure of the operation itself: wait again later.
    TPU_SYNC_PENDING = 20,
    /// Staging memory would exceed its byte budget: the request was refused at once and nothing
    /// already staged was touched (free staged requests, or raise the budget).
    TPU_SYNC_STAGING_EXHAUSTED = 21,
    /// A panic was caught inside the library (a bug; the message says where).
    TPU_SYNC_PANIC = 100,
}

impl tpu_sync_status {
    /// Name of the code.
    pub fn name(self) -> &'static str {
        use tpu_sync_status::*;
        match self {
            TPU_SYNC_OK => "TPU_SYNC_OK",
            TPU_SYNC_INVALID_ARGUMENT => "TPU_SYNC_INVALID_ARGUMENT",
            TPU_SYNC_NULL_POINTER => "TPU_SYNC_NULL_POINTER",
            TPU_SYNC_INVALID_HANDLE => "TPU_SYNC_INVALID_HANDLE",
            TPU_SYNC_PLUGIN_LOAD => "TPU_SYNC_PLUGIN_LOAD",
            TPU_SYNC_PJRT => "TPU_SYNC_PJRT",
            TPU_SYNC_UNSUPPORTED => "TPU_SYNC_UNSUPPORTED",
            TPU_SYNC_LAYOUT => "TPU_SYNC_LAYOUT",
            TPU_SYNC_BLOCK_RANGE => "TPU_SYNC_BLOCK_RANGE",
            TPU_SYNC_MISMATCH => "TPU_SYNC_MISMATCH",
            TPU_SYNC_PROTOCOL => "TPU_SYNC_PROTOCOL",
            TPU_SYNC_CHECKSUM => "TPU_SYNC_CHECKSUM",
            TPU_SYNC_REMOTE => "TPU_SYNC_REMOTE",
            TPU_SYNC_PEER_CLOSED => "TPU_SYNC_PEER_CLOSED",
            TPU_SYNC_TIMEOUT => "TPU_SYNC_TIMEOUT",
            TPU_SYNC_UNKNOWN_REQUEST => "TPU_SYNC_UNKNOWN_REQUEST",
            TPU_SYNC_HOST_MEMORY => "TPU_SYNC_HOST_MEMORY",
            TPU_SYNC_IO => "TPU_SYNC_IO",
            TPU_SYNC_CANCELLED => "TPU_SYNC_CANCELLED",
            TPU_SYNC_BUFFER_TOO_SMALL => "TPU_SYNC_BUFFER_TOO_SMALL",
            TPU_SYNC_PENDING => "TPU_SYNC_PENDING",
            TPU_SYNC_STAGING_EXHAUSTED => "TPU_SYNC_STAGING_EXHAUSTED",
            TPU_SYNC_PANIC => "TPU_SYNC_PANIC",
        }
    }
}

/// The status code of a library error (one exhaustive mapping).
pub(crate) fn status_of(e: &Error) -> tpu_sync_status {
    use tpu_sync_status::*;
    match e.kind() {
        ErrorKind::PluginLoad => TPU_SYNC_PLUGIN_LOAD,
        ErrorKind::Pjrt => TPU_SYNC_PJRT,
        ErrorKind::Unsupported => TPU_SYNC_UNSUPPORTED,
        ErrorKind::InvalidArgument => TPU_SYNC_INVALID_ARGUMENT,
        ErrorKind::Layout => TPU_SYNC_LAYOUT,
        ErrorKind::BlockRange => TPU_SYNC_BLOCK_RANGE,
        ErrorKind::Mismatch => TPU_SYNC_MISMATCH,
        ErrorKind::Protocol => TPU_SYNC_PROTOCOL,
        ErrorKind::Checksum => TPU_SYNC_CHECKSUM,
        ErrorKind::Remote => TPU_SYNC_REMOTE,
        ErrorKind::PeerClosed => TPU_SYNC_PEER_CLOSED,
        ErrorKind::Timeout => TPU_SYNC_TIMEOUT,
        ErrorKind::UnknownRequest => TPU_SYNC_UNKNOWN_REQUEST,
        ErrorKind::HostMemory => TPU_SYNC_HOST_MEMORY,
        ErrorKind::Io => TPU_SYNC_IO,
        ErrorKind::Cancelled => TPU_SYNC_CANCELLED,
        ErrorKind::StagingExhausted => TPU_SYNC_STAGING_EXHAUSTED,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn set_last_error(msg: String) {
    LAST_ERROR.with(|l| *l.borrow_mut() = msg);
}

/// A failure inside an exported function: status plus message.
#[derive(Debug, Clone)]
pub(crate) struct Failure(pub tpu_sync_status, pub String);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(status_of(&e), e.to_string())
    }
}

pub(crate) type FfiResult<T = ()> = std::result::Result<T, Failure>;

pub(crate) fn invalid(msg: impl Into<String>) -> Failure {
    Failure(tpu_sync_status::TPU_SYNC_INVALID_ARGUMENT, msg.into())
}

pub(crate) fn null(name: &str) -> Failure {
    Failure(
        tpu_sync_status::TPU_SYNC_NULL_POINTER,
        format!("`{name}` is NULL"),
    )
}

/// Runs `f` behind the panic boundary, records the error message, returns the status.
pub(crate) fn boundary(name: &str, f: impl FnOnce() -> FfiResult) -> tpu_sync_status {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => tpu_sync_status::TPU_SYNC_OK,
        Ok(Err(Failure(s, m))) => {
            set_last_error(format!("{name}: {m}"));
            s
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            set_last_error(format!("{name}: internal panic: {what}"));
            tpu_sync_status::TPU_SYNC_PANIC
        }
    }
}

/// Copies the calling thread's last error message into `buf` (NUL-terminated, truncated to
/// `buf_len - 1` bytes) and writes the full message length (without NUL) to `len_out`.
///
/// `buf` may be NULL when `buf_len` is 0 (to query the length); `len_out` may be NULL. The message
/// describes the most recent failing call on this thread; it is empty if none failed.
/// Always returns `TPU_SYNC_OK` unless `buf` is NULL with `buf_len > 0`.
///
/// # Safety
/// `buf` must point to `buf_len` writable bytes; `len_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_last_error(
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    let r = std::panic::catch_unwind(|| {
        LAST_ERROR.with(|l| {
            let msg = l.borrow();
            if !len_out.is_null() {
                // SAFETY: caller contract: NULL or writable.
                unsafe { *len_out = msg.len() };
            }
            if buf_len == 0 {
                return tpu_sync_status::TPU_SYNC_OK;
            }
            if buf.is_null() {
                return tpu_sync_status::TPU_SYNC_NULL_POINTER;
            }
            let n = msg.len().min(buf_len - 1);
            // SAFETY: `buf` has `buf_len > n` writable bytes (caller contract).
            unsafe {
                std::ptr::copy_nonoverlapping(msg.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
            tpu_sync_status::TPU_SYNC_OK
        })
    });
    r.unwrap_or(tpu_sync_status::TPU_SYNC_PANIC)
}

/// Static NUL-terminated name of a status value (e.g. `"TPU_SYNC_TIMEOUT"`), or
/// `"TPU_SYNC_UNKNOWN_STATUS"` for values this library does not define. Never NULL; the string is
/// static and must not be freed.
#[no_mangle]
pub extern "C" fn tpu_sync_status_name(status: u32) -> *const c_char {
    use tpu_sync_status::*;
    let all = [
        TPU_SYNC_OK,
        TPU_SYNC_INVALID_ARGUMENT,
        TPU_SYNC_NULL_POINTER,
        TPU_SYNC_INVALID_HANDLE,
        TPU_SYNC_PLUGIN_LOAD,
        TPU_SYNC_PJRT,
        TPU_SYNC_UNSUPPORTED,
        TPU_SYNC_LAYOUT,
        TPU_SYNC_BLOCK_RANGE,
        TPU_SYNC_MISMATCH,
        TPU_SYNC_PROTOCOL,
        TPU_SYNC_CHECKSUM,
        TPU_SYNC_REMOTE,
        TPU_SYNC_PEER_CLOSED,
        TPU_SYNC_TIMEOUT,
        TPU_SYNC_UNKNOWN_REQUEST,
        TPU_SYNC_HOST_MEMORY,
        TPU_SYNC_IO,
        TPU_SYNC_CANCELLED,
        TPU_SYNC_BUFFER_TOO_SMALL,
        TPU_SYNC_PENDING,
        TPU_SYNC_STAGING_EXHAUSTED,
        TPU_SYNC_PANIC,
    ];
    let name = all
        .iter()
        .find(|s| **s as u32 == status)
        .map(|s| s.name())
        .unwrap_or("TPU_SYNC_UNKNOWN_STATUS");
    // Static names: leak-free NUL-terminated copies built once.
    static NAMES: std::sync::OnceLock<std::collections::HashMap<&'static str, std::ffi::CString>> =
        std::sync::OnceLock::new();
    let map = NAMES.get_or_init(|| {
        all.iter()
            .map(|s| s.name())
            .chain(["TPU_SYNC_UNKNOWN_STATUS"])
            .map(|n| (n, std::ffi::CString::new(n).expect("no NUL in names")))
            .collect()
    });
    map[name].as_ptr()
}
