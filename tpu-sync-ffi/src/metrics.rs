//! Prometheus metrics of the process (`tpu_sync::metrics`): the text exposition for engines that
//! serve their own `/metrics`, and the library's own opt-in HTTP endpoint.

use std::ffi::c_char;

use crate::api::{out_string, str_arg};
use crate::status::{boundary, tpu_sync_status};

/// Writes every tpu-sync metric of this process in the Prometheus text exposition format 0.0.4
/// (`Content-Type: text/plain; version=0.0.4`) into `buf` (NUL-terminated): counters, histograms
/// and gauges named `tpu_sync_*`, listed in `docs/observability.md`. `buf`/`buf_len`/`len_out`
/// as for `tpu_sync_client_info`: when `buf_len` is too small, returns
/// `TPU_SYNC_BUFFER_TOO_SMALL` with the needed length (without the NUL) in `len_out` (the text
/// may grow between two calls: allow some slack).
///
/// Thread-safety: any thread, concurrently with every other call.
///
/// # Safety
/// `buf` NULL or writable for `buf_len` bytes; `len_out` NULL or writable. The library keeps no
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_metrics_text(
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_metrics_text", || {
        let t = tpu_sync::metrics::text();
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&t, buf, buf_len, len_out) }
    })
}

/// Starts this process's metrics HTTP endpoint (`GET /metrics`) on `addr` plus `rank` on the
/// port, or finds the one already running (then `addr` is ignored), and writes the address
/// served (`IP:PORT`) into `buf` as `tpu_sync_metrics_text` does. `addr` is `PORT`, `:PORT`
/// (both `127.0.0.1`), `HOST:PORT` or `IP:PORT`; port 0 picks a free port. Several processes
/// of one instance pass their rank (0, 1, ...) to serve on consecutive ports
/// (`docs/observability.md` has the scrape configuration). The endpoint lives until the process
/// exits. The environment variable `TPU_SYNC_METRICS_ADDR` (with `TPU_SYNC_METRICS_RANK`) does
/// the same at the first use of the library.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for an address that does not parse or a port that `rank`
/// pushes past 65535 (also for `"off"`: nothing to serve); `TPU_SYNC_IO` when it cannot bind.
///
/// # Safety
/// `addr` NUL-terminated; `buf`/`len_out` as for `tpu_sync_metrics_text`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_metrics_serve(
    addr: *const c_char,
    rank: u32,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_metrics_serve", || {
        // SAFETY: caller contract: NUL-terminated.
        let a = unsafe { str_arg(addr, "addr") }?;
        let parsed = tpu_sync::metrics::parse_addr(a, rank)?.ok_or_else(|| {
            crate::status::invalid(format!("metrics address {a:?} means no endpoint"))
        })?;
        let bound = tpu_sync::metrics::serve_global(parsed)?;
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&bound.to_string(), buf, buf_len, len_out) }
    })
}

/// Switches metrics recording on (`on` != 0, the default) or off for the whole process, e.g. to
/// measure what it costs. Gauges of current state still report. Never fails.
#[no_mangle]
pub extern "C" fn tpu_sync_metrics_set_enabled(on: i32) -> tpu_sync_status {
    boundary("tpu_sync_metrics_set_enabled", || {
        tpu_sync::metrics::set_enabled(on != 0);
        Ok(())
    })
}
