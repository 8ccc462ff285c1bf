//! `libtpu_sync`: the C library of tpu-sync, built from the sources of `tpu-sync-ffi` (included
//! by path, so that the shipped `cdylib`/`staticlib` can be named `libtpu_sync` without clashing
//! with the core crate's `tpu_sync` rlib, and so that cbindgen sees every exported function when
//! maturin generates the Python cffi bindings). See `tpu-sync-ffi/include/tpu_sync.h`.
#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

#[path = "../../src/completion.rs"]
mod completion;
#[path = "../../src/handle.rs"]
mod handle;
#[path = "../../src/status.rs"]
mod status;

#[path = "../../src/api.rs"]
pub mod api;
#[path = "../../src/device.rs"]
pub mod device;
#[path = "../../src/endpoint.rs"]
pub mod endpoint;
#[path = "../../src/kv_events.rs"]
pub mod kv_events;
#[path = "../../src/metrics.rs"]
pub mod metrics;
#[path = "../../src/store.rs"]
pub mod store;

pub use api::*;
pub use completion::tpu_sync_callback;
pub use device::*;
pub use endpoint::*;
pub use handle::{tpu_sync_handle_kind, tpu_sync_handle_stats};
pub use kv_events::*;
pub use metrics::*;
pub use status::{tpu_sync_last_error, tpu_sync_status, tpu_sync_status_name};
pub use store::*;
