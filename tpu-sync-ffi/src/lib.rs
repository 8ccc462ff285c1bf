//! # libtpu_sync: the C ABI of tpu-sync
//!
//! This crate exports `extern "C"` functions over the `tpu_sync` library, for serving engines
//! written in other languages (the Python package in `bindings/python` loads it with cffi). The
//! header `include/tpu_sync.h` is generated from this crate by cbindgen and committed;
//! `tests/header.rs` fails when it is out of date (`make header` regenerates it).
//!
//! ## Conventions (all functions)
//!
//! * **Status codes.** Every fallible function returns a [`tpu_sync_status`]; `TPU_SYNC_OK` (0) is
//!   success. Values are stable and never reused. On failure a message is stored in a thread-local
//!   slot, read with [`tpu_sync_last_error`].
//! * **Outputs** are written through out-pointers (`*_out`), only on success; on failure they are
//!   left unchanged.
//! * **Handles** are opaque pointers to `tpu_sync_*` types. They are tokens, never dereferenced by
//!   the library: every call looks the token up in a registry, so a NULL handle, a freed handle
//!   used again, a double free or a handle of the wrong type returns `TPU_SYNC_INVALID_HANDLE`
//!   instead of crashing. Tokens are never reused within a process. Each type has `*_new` (or
//!   `*_open`/`*_create`) and `*_free`; the caller owns a handle from creation until `*_free`.
//! * **Strings** passed in are NUL-terminated UTF-8 unless a length parameter is given; strings
//!   returned are copied into caller buffers (`buf`, `buf_len`, `len_out`) or are static.
//! * **Thread-safety.** Every function may be called from any thread, concurrently, on the same or
//!   different handles, unless its documentation says otherwise.
//! * **Panics** never cross the boundary: a panic inside the library is caught and returned as
//!   `TPU_SYNC_PANIC`.
//! * **ABI version.** [`TPU_SYNC_ABI_VERSION`] changes whenever an existing signature or value
//!   changes; check it against [`tpu_sync_abi_version`] at load time.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)] // each function's safety contract is in its doc comment.

mod completion;
mod handle;
mod status;

pub mod api;
pub mod cluster;
pub mod device;
pub mod endpoint;
pub mod kv_events;
pub mod metrics;
pub mod store;
pub mod store_groups;

pub use api::*;
pub use cluster::*;
pub use completion::{tpu_sync_callback, tpu_sync_callbacks_disable};
pub use device::*;
pub use endpoint::*;
pub use handle::{tpu_sync_handle_kind, tpu_sync_handle_stats};
pub use kv_events::*;
pub use metrics::*;
pub use status::{tpu_sync_last_error, tpu_sync_status, tpu_sync_status_name};
pub use store::*;
pub use store_groups::*;
