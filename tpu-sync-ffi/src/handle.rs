//! The handle registry: opaque C handles are tokens looked up here, never dereferenced.
//!
//! A token maps to the object (an `Arc`) and its kind. Lookup clones the `Arc`, so a handle freed
//! on one thread while another thread is inside a call on it stays alive until that call returns.
//! Tokens are unique for the life of the process (a counter, never reused), so a stale handle can
//! never alias a newer object.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::status::{tpu_sync_status, Failure, FfiResult};

/// Kinds of handles (also the `kind` argument of [`tpu_sync_handle_stats`]).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum tpu_sync_handle_kind {
    /// All kinds together (only as a [`tpu_sync_handle_stats`] argument).
    TPU_SYNC_HANDLE_ALL = 0,
    /// `tpu_sync_client`.
    TPU_SYNC_HANDLE_CLIENT = 1,
    /// `tpu_sync_buffer`.
    TPU_SYNC_HANDLE_BUFFER = 2,
    /// `tpu_sync_plan`.
    TPU_SYNC_HANDLE_PLAN = 3,
    /// `tpu_sync_store`.
    TPU_SYNC_HANDLE_STORE = 4,
    /// `tpu_sync_endpoint`.
    TPU_SYNC_HANDLE_ENDPOINT = 5,
    /// `tpu_sync_transfer`.
    TPU_SYNC_HANDLE_TRANSFER = 6,
    /// `tpu_sync_staging`.
    TPU_SYNC_HANDLE_STAGING = 7,
    /// `tpu_sync_lease` (pinned host-store blocks).
    TPU_SYNC_HANDLE_LEASE = 8,
    /// `tpu_sync_copy` (an asynchronous batch of device copies).
    TPU_SYNC_HANDLE_COPY = 9,
    /// `tpu_sync_release` (tells when a view's memory was released by the plugin).
    TPU_SYNC_HANDLE_RELEASE = 10,
    /// `tpu_sync_directory` (the cluster prefix directory on etcd).
    TPU_SYNC_HANDLE_DIRECTORY = 11,
    /// `tpu_sync_publisher` (one store published into the directory).
    TPU_SYNC_HANDLE_PUBLISHER = 12,
    /// `tpu_sync_remote_server` (a store served to other instances).
    TPU_SYNC_HANDLE_REMOTE_SERVER = 13,
}

/// The last defined kind (for range checks).
pub(crate) const LAST_KIND: u32 = tpu_sync_handle_kind::TPU_SYNC_HANDLE_REMOTE_SERVER as u32;

impl tpu_sync_handle_kind {
    fn name(self) -> &'static str {
        use tpu_sync_handle_kind::*;
        match self {
            TPU_SYNC_HANDLE_ALL => "any",
            TPU_SYNC_HANDLE_CLIENT => "tpu_sync_client",
            TPU_SYNC_HANDLE_BUFFER => "tpu_sync_buffer",
            TPU_SYNC_HANDLE_PLAN => "tpu_sync_plan",
            TPU_SYNC_HANDLE_STORE => "tpu_sync_store",
            TPU_SYNC_HANDLE_ENDPOINT => "tpu_sync_endpoint",
            TPU_SYNC_HANDLE_TRANSFER => "tpu_sync_transfer",
            TPU_SYNC_HANDLE_STAGING => "tpu_sync_staging",
            TPU_SYNC_HANDLE_LEASE => "tpu_sync_lease",
            TPU_SYNC_HANDLE_COPY => "tpu_sync_copy",
            TPU_SYNC_HANDLE_RELEASE => "tpu_sync_release",
            TPU_SYNC_HANDLE_DIRECTORY => "tpu_sync_directory",
            TPU_SYNC_HANDLE_PUBLISHER => "tpu_sync_publisher",
            TPU_SYNC_HANDLE_REMOTE_SERVER => "tpu_sync_remote_server",
        }
    }
}

type Entry = (tpu_sync_handle_kind, Arc<dyn Any + Send + Sync>);

struct Registry {
    next: u64,
    live: HashMap<u64, Entry>,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        Mutex::new(Registry {
            next: 0x1000,
            live: HashMap::new(),
        })
    })
}

fn lock() -> std::sync::MutexGuard<'static, Registry> {
    registry().lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers `obj` and returns its new token as an opaque pointer.
pub(crate) fn insert<T: Any + Send + Sync, H>(kind: tpu_sync_handle_kind, obj: Arc<T>) -> *mut H {
    let mut r = lock();
    let token = r.next;
    r.next += 16;
    r.live.insert(token, (kind, obj));
    token as usize as *mut H
}

fn bad_handle(kind: tpu_sync_handle_kind, why: &str) -> Failure {
    Failure(
        tpu_sync_status::TPU_SYNC_INVALID_HANDLE,
        format!("{} handle {why}", kind.name()),
    )
}

/// Looks up a live handle of `kind` and type `T`.
pub(crate) fn get<T: Any + Send + Sync, H>(
    kind: tpu_sync_handle_kind,
    h: *const H,
) -> FfiResult<Arc<T>> {
    if h.is_null() {
        return Err(bad_handle(kind, "is NULL"));
    }
    let r = lock();
    match r.live.get(&(h as usize as u64)) {
        None => Err(bad_handle(
            kind,
            "is not live (never created, or already freed)",
        )),
        Some((k, _)) if *k != kind => Err(bad_handle(kind, &format!("is a {}", k.name()))),
        Some((_, obj)) => obj
            .clone()
            .downcast::<T>()
            .map_err(|_| bad_handle(kind, "has an unexpected type")),
    }
}

/// Removes a handle; the object is dropped when no call uses it any more.
pub(crate) fn remove<H>(
    kind: tpu_sync_handle_kind,
    h: *const H,
) -> FfiResult<Arc<dyn Any + Send + Sync>> {
    if h.is_null() {
        return Err(bad_handle(kind, "is NULL"));
    }
    let mut r = lock();
    let key = h as usize as u64;
    match r.live.get(&key) {
        None => Err(bad_handle(kind, "is not live (already freed?)")),
        Some((k, _)) if *k != kind => Err(bad_handle(kind, &format!("is a {}", k.name()))),
        Some(_) => Ok(r.live.remove(&key).expect("present").1),
    }
}

/// Number of live handles of `kind` (`TPU_SYNC_HANDLE_ALL` = 0 for all kinds) written to
/// `count_out`. Use it to check for leaked handles.
///
/// Errors: `TPU_SYNC_NULL_POINTER` if `count_out` is NULL; `TPU_SYNC_INVALID_ARGUMENT` for an
/// unknown kind.
///
/// # Safety
/// `count_out` must be NULL or point to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_handle_stats(kind: u32, count_out: *mut u64) -> tpu_sync_status {
    crate::status::boundary("tpu_sync_handle_stats", || {
        if count_out.is_null() {
            return Err(crate::status::null("count_out"));
        }
        if kind > LAST_KIND {
            return Err(crate::status::invalid(format!(
                "unknown handle kind {kind}"
            )));
        }
        let r = lock();
        let n = r
            .live
            .values()
            .filter(|(k, _)| kind == 0 || *k as u32 == kind)
            .count() as u64;
        // SAFETY: checked non-NULL; caller contract says writable.
        unsafe { *count_out = n };
        Ok(())
    })
}
