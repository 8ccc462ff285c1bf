//! The C ABI fed with arbitrary handles, sizes, offsets and strings: every call returns a status,
//! none crashes. Uses one real client and buffer (XLA CPU plugin) for the size checks.
#![no_main]
use std::ffi::CString;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tsffi as ffi;

#[derive(Debug, Arbitrary)]
enum Call {
    DeviceCount(u64),
    BufferRead { handle: u64, real: bool, offset: u64, len: u16 },
    BufferWrite { real: bool, offset: u64, len: u16 },
    BufferSize(u64),
    PlanNew { src: String, dst: String, tokens: u32 },
    PlanFree(u64),
    Stats(u32),
    StatusName(u32),
    FromHost { device: u8, len: u16, dims: Vec<i64>, dtype: u32 },
    /// A copy batch over the real buffer (or an arbitrary handle) with arbitrary ranges.
    CopySubmit { dir: u32, ops: Vec<(bool, u64, u64, u16, u16)>, outstanding: u8, cancel: bool },
    CopyHandleCalls(u64),
    View { offset: u8, len: u32, dims: Vec<i64>, dtype: u32, kind: Option<String> },
    ReleaseWait(u64),
    StoreNew(String),
    StorePut { keys: Vec<u8>, lens: Vec<u16>, parent: bool },
    StoreGet { keys: Vec<u8>, lens: Vec<u16> },
    StoreDevice { keys: Vec<u8>, pieces: Vec<(u64, u64)>, per: Vec<u8>, get: bool },
    StoreKeys { tokens: u16, block: u8, cap: u8 },
    StoreMisc { keys: Vec<u8>, which: u8, handle: Option<u64> },
    LeaseCalls(u64),
    Adopt { api: u64, client: u64, buffer: u64 },
    EndpointNew(String),
    /// Endpoint calls on the real endpoint (or an arbitrary handle) with arbitrary ids, JSON,
    /// peer maps and rank lists; transfers are always waited for and freed.
    EndpointCall { handle: Option<u64>, which: u8, id: u64, a: String, b: String, tokens: u16, ranks: Vec<u8> },
    TransferCalls(u64),
}

struct Real {
    client: usize,
    buffer: usize,
    store: usize,
    endpoint: usize,
}

fn real() -> &'static Real {
    static R: OnceLock<Real> = OnceLock::new();
    R.get_or_init(|| unsafe {
        let mut c = std::ptr::null_mut();
        assert_eq!(ffi::tpu_sync_client_new(std::ptr::null(), 1, &mut c), ffi::tpu_sync_status::TPU_SYNC_OK);
        let data = vec![7u8; 4096];
        let dims = [4096i64];
        let mut b = std::ptr::null_mut();
        let st = ffi::tpu_sync_buffer_from_host(c, 0, data.as_ptr() as *const _, 4096, dims.as_ptr(), 1, 1, &mut b);
        assert_eq!(st, ffi::tpu_sync_status::TPU_SYNC_OK);
        let cfg = CString::new(
            r#"{"namespace":"fuzz","block_bytes":4096,"capacity_bytes":65536,"lock_memory":false}"#,
        )
        .unwrap();
        let mut s = std::ptr::null_mut();
        assert_eq!(ffi::tpu_sync_store_new(cfg.as_ptr(), c, &mut s), ffi::tpu_sync_status::TPU_SYNC_OK);
        let ecfg = CString::new(r#"{"listen":"127.0.0.1:0","timeout_s":1}"#).unwrap();
        let mut e = std::ptr::null_mut();
        assert_eq!(ffi::tpu_sync_endpoint_new(ecfg.as_ptr(), &mut e), ffi::tpu_sync_status::TPU_SYNC_OK);
        Real { client: c as usize, buffer: b as usize, store: s as usize, endpoint: e as usize }
    })
}

/// Keys from fuzz bytes: a few distinct keys, so that chains hit and miss.
fn keys_of(bytes: &[u8]) -> Vec<ffi::tpu_sync_key> {
    bytes
        .iter()
        .take(32)
        .map(|b| {
            let mut k = ffi::tpu_sync_key::default();
            k.bytes[0] = b % 8;
            k
        })
        .collect()
}

fuzz_target!(|calls: Vec<Call>| {
    let r = real();
    let mut scratch = vec![0u8; 1 << 16];
    for call in calls.into_iter().take(64) {
        // SAFETY (whole block): every pointer passed is either a valid local buffer of the stated
        // length or an arbitrary handle token, which the ABI promises to reject without
        // dereferencing.
        unsafe {
            match call {
                Call::DeviceCount(h) => {
                    let mut n = 0usize;
                    ffi::tpu_sync_client_device_count(h as usize as *const _, &mut n);
                }
                Call::BufferRead { handle, real: use_real, offset, len } => {
                    let h = if use_real { r.buffer } else { handle as usize };
                    ffi::tpu_sync_buffer_read(h as *const _, offset, scratch.as_mut_ptr() as *mut _, len as usize);
                }
                Call::BufferWrite { real: use_real, offset, len } => {
                    let h = if use_real { r.buffer } else { 0x10 };
                    ffi::tpu_sync_buffer_write(h as *const _, offset, scratch.as_ptr() as *const _, len as usize);
                }
                Call::BufferSize(h) => {
                    let mut n = 0u64;
                    ffi::tpu_sync_buffer_size(h as usize as *const _, &mut n);
                }
                Call::PlanNew { src, dst, tokens } => {
                    if let (Ok(s), Ok(d)) = (CString::new(src), CString::new(dst)) {
                        let mut p = std::ptr::null_mut();
                        if ffi::tpu_sync_plan_new(s.as_ptr(), d.as_ptr(), tokens % 4096, &mut p) == ffi::tpu_sync_status::TPU_SYNC_OK {
                            assert_eq!(ffi::tpu_sync_plan_free(p), ffi::tpu_sync_status::TPU_SYNC_OK);
                        }
                    }
                }
                Call::PlanFree(h) => {
                    ffi::tpu_sync_plan_free(h as usize as *mut _);
                }
                Call::Stats(k) => {
                    let mut n = 0u64;
                    ffi::tpu_sync_handle_stats(k, &mut n);
                }
                Call::StatusName(s) => {
                    assert!(!ffi::tpu_sync_status_name(s).is_null());
                }
                Call::FromHost { device, len, dims, dtype } => {
                    let dims: Vec<i64> = dims.into_iter().take(17).collect();
                    let mut b = std::ptr::null_mut();
                    let st = ffi::tpu_sync_buffer_from_host(
                        r.client as *const _,
                        device as usize,
                        scratch.as_ptr() as *const _,
                        len as usize,
                        dims.as_ptr(),
                        dims.len(),
                        dtype,
                        &mut b,
                    );
                    if st == ffi::tpu_sync_status::TPU_SYNC_OK {
                        ffi::tpu_sync_buffer_free(b);
                    }
                }
                Call::CopySubmit { dir, ops, outstanding, cancel } => {
                    let ops: Vec<ffi::tpu_sync_copy_op> = ops
                        .into_iter()
                        .take(16)
                        .map(|(use_real, handle, offset, host_off, len)| ffi::tpu_sync_copy_op {
                            buffer: if use_real { r.buffer as *const _ } else { handle as usize as *const _ },
                            offset: offset % 8192,
                            len: len as u64,
                            // Inside `scratch` (64 KiB) whenever host_off + len fits; ranges past it
                            // are clamped so the host side is always valid memory.
                            host: scratch.as_mut_ptr().add((host_off as usize).min((1 << 16) - len as usize)) as *mut _,
                        })
                        .collect();
                    let mut c = std::ptr::null_mut();
                    let st = ffi::tpu_sync_copy_submit(dir % 4, ops.as_ptr(), ops.len(), outstanding as usize, &mut c);
                    if st == ffi::tpu_sync_status::TPU_SYNC_OK {
                        if cancel {
                            ffi::tpu_sync_copy_cancel(c);
                        }
                        let mut done = false;
                        ffi::tpu_sync_copy_poll(c, &mut done, std::ptr::null_mut());
                        ffi::tpu_sync_copy_wait(c, 0, std::ptr::null_mut());
                        // Frees block until the copies are done: `scratch` is never written later.
                        assert_eq!(ffi::tpu_sync_copy_free(c), ffi::tpu_sync_status::TPU_SYNC_OK);
                    }
                }
                Call::CopyHandleCalls(h) => {
                    let c = h as usize as *mut ffi::tpu_sync_copy;
                    let mut done = false;
                    ffi::tpu_sync_copy_poll(c, &mut done, std::ptr::null_mut());
                    ffi::tpu_sync_copy_wait(c, 0, std::ptr::null_mut());
                    ffi::tpu_sync_copy_cancel(c);
                    ffi::tpu_sync_copy_free(c);
                }
                Call::View { offset, len, dims, dtype, kind } => {
                    let dims: Vec<i64> = dims.into_iter().take(17).collect();
                    let kind = kind.and_then(|k| CString::new(k).ok());
                    let base = (scratch.as_mut_ptr() as usize + 63) & !63;
                    let ptr = (base + offset as usize) as *mut std::ffi::c_void;
                    let avail = (1usize << 16) - 64 - offset as usize;
                    let mut b = std::ptr::null_mut();
                    let mut rel = std::ptr::null_mut();
                    let st = ffi::tpu_sync_client_view(
                        r.client as *const _,
                        0,
                        ptr,
                        (len as usize).min(avail),
                        dims.as_ptr(),
                        dims.len(),
                        dtype,
                        kind.as_ref().map(|k| k.as_ptr()).unwrap_or(std::ptr::null()),
                        &mut b,
                        &mut rel,
                    );
                    if st == ffi::tpu_sync_status::TPU_SYNC_OK {
                        ffi::tpu_sync_buffer_free(b);
                        // The view's memory is `scratch`: wait for the plugin to let go of it.
                        assert_eq!(ffi::tpu_sync_release_wait(rel, 10_000), ffi::tpu_sync_status::TPU_SYNC_OK);
                        ffi::tpu_sync_release_free(rel);
                    }
                }
                Call::ReleaseWait(h) => {
                    ffi::tpu_sync_release_wait(h as usize as *const _, 0);
                    ffi::tpu_sync_release_free(h as usize as *mut _);
                }
                Call::StoreNew(json) => {
                    if let Ok(j) = CString::new(json) {
                        let mut s = std::ptr::null_mut();
                        if ffi::tpu_sync_store_new(j.as_ptr(), std::ptr::null(), &mut s) == ffi::tpu_sync_status::TPU_SYNC_OK {
                            assert_eq!(ffi::tpu_sync_store_free(s), ffi::tpu_sync_status::TPU_SYNC_OK);
                        }
                    }
                }
                Call::StorePut { keys, lens, parent } => {
                    let keys = keys_of(&keys);
                    let lens: Vec<usize> = lens.iter().map(|l| *l as usize % 5000).collect();
                    let n = keys.len().min(lens.len());
                    let srcs: Vec<*const std::ffi::c_void> = (0..n).map(|i| scratch.as_ptr().add(i * 1000) as *const _).collect();
                    let mut res = ffi::tpu_sync_put_result::default();
                    let p = keys.first().copied().unwrap_or_default();
                    ffi::tpu_sync_store_put(
                        r.store as *const _,
                        if parent { &p } else { std::ptr::null() },
                        keys.as_ptr(),
                        n,
                        srcs.as_ptr(),
                        lens.as_ptr(),
                        &mut res,
                    );
                }
                Call::StoreGet { keys, lens } => {
                    let keys = keys_of(&keys);
                    let lens: Vec<usize> = lens.iter().map(|l| *l as usize % 5000).collect();
                    let n = keys.len().min(lens.len()).min(12);
                    let dsts: Vec<*mut std::ffi::c_void> = (0..n).map(|i| scratch.as_mut_ptr().add(i * 5000) as *mut _).collect();
                    let mut res = ffi::tpu_sync_get_result::default();
                    ffi::tpu_sync_store_get(r.store as *const _, keys.as_ptr(), n, dsts.as_ptr(), lens.as_ptr(), &mut res);
                }
                Call::StoreDevice { keys, pieces, per, get } => {
                    let keys = keys_of(&keys);
                    let pieces: Vec<ffi::tpu_sync_device_range> = pieces
                        .into_iter()
                        .take(32)
                        .map(|(o, l)| ffi::tpu_sync_device_range { buffer: r.buffer as *const _, offset: o % 8192, len: l % 8192 })
                        .collect();
                    let per: Vec<usize> = per.iter().map(|p| *p as usize % 5).collect();
                    let n = keys.len().min(per.len());
                    if get {
                        let mut res = ffi::tpu_sync_get_result::default();
                        ffi::tpu_sync_store_get_to_device(r.store as *const _, keys.as_ptr(), n, pieces.as_ptr(), pieces.len(), per.as_ptr(), &mut res);
                    } else {
                        let mut res = ffi::tpu_sync_put_result::default();
                        ffi::tpu_sync_store_put_from_device(r.store as *const _, std::ptr::null(), keys.as_ptr(), n, pieces.as_ptr(), pieces.len(), per.as_ptr(), &mut res);
                    }
                }
                Call::StoreKeys { tokens, block, cap } => {
                    let toks: Vec<u32> = (0..tokens as u32 % 4096).collect();
                    let mut keys = vec![ffi::tpu_sync_key::default(); cap as usize];
                    let mut n = 0usize;
                    ffi::tpu_sync_store_chain_keys(r.store as *const _, toks.as_ptr(), toks.len(), block as usize, std::ptr::null(), keys.as_mut_ptr(), keys.len(), &mut n);
                }
                Call::StoreMisc { keys, which, handle } => {
                    let keys = keys_of(&keys);
                    let s = handle.map(|h| h as usize).unwrap_or(r.store) as *const ffi::tpu_sync_store;
                    let mut n = 0usize;
                    match which % 5 {
                        0 => { ffi::tpu_sync_store_lookup(s, keys.as_ptr(), keys.len(), &mut n, std::ptr::null_mut(), std::ptr::null_mut()); }
                        1 => { ffi::tpu_sync_store_remove(s, keys.as_ptr(), keys.len(), &mut n); }
                        2 => { ffi::tpu_sync_store_clear(s, &mut n); }
                        3 => {
                            let mut l = std::ptr::null_mut();
                            if ffi::tpu_sync_store_pin(s, keys.as_ptr(), keys.len(), &mut l) == ffi::tpu_sync_status::TPU_SYNC_OK {
                                ffi::tpu_sync_lease_count(l, &mut n);
                                assert_eq!(ffi::tpu_sync_lease_free(l), ffi::tpu_sync_status::TPU_SYNC_OK);
                            }
                        }
                        _ => {
                            let mut st = 0u32;
                            ffi::tpu_sync_store_state(s, &mut st);
                            ffi::tpu_sync_store_wait_ready(s, 0);
                        }
                    }
                }
                Call::LeaseCalls(h) => {
                    let mut n = 0usize;
                    ffi::tpu_sync_lease_count(h as usize as *const _, &mut n);
                    ffi::tpu_sync_lease_free(h as usize as *mut _);
                }
                Call::EndpointNew(json) => {
                    // Never let arbitrary JSON bind real ports other than loopback ephemeral ones.
                    if let Ok(j) = CString::new(json) {
                        if !j.to_bytes().windows(6).any(|w| w == b"listen") {
                            let mut e = std::ptr::null_mut();
                            if ffi::tpu_sync_endpoint_new(j.as_ptr(), &mut e) == ffi::tpu_sync_status::TPU_SYNC_OK {
                                assert_eq!(ffi::tpu_sync_endpoint_free(e), ffi::tpu_sync_status::TPU_SYNC_OK);
                            }
                        }
                    }
                }
                Call::EndpointCall { handle, which, id, a, b, tokens, ranks } => {
                    let e = handle.map(|h| h as usize).unwrap_or(r.endpoint) as *const ffi::tpu_sync_endpoint;
                    let (Ok(a), Ok(b)) = (CString::new(a), CString::new(b)) else { continue };
                    let ranks: Vec<u32> = ranks.iter().take(4).map(|r| *r as u32 % 6).collect();
                    let bufs: Vec<*const ffi::tpu_sync_buffer> = ranks.iter().map(|_| r.buffer as *const _).collect();
                    let id = id % (1 << 54);
                    let mut t = std::ptr::null_mut();
                    let mut n = 0usize;
                    let st = match which % 8 {
                        0 => ffi::tpu_sync_endpoint_register(e, id, a.as_ptr(), tokens as u32, ranks.as_ptr(), ranks.len(), bufs.as_ptr(), 1, 1),
                        1 => ffi::tpu_sync_endpoint_pull(e, id, a.as_ptr(), b.as_ptr(), b.as_ptr(), tokens as u32, ranks.as_ptr(), ranks.len(), bufs.as_ptr(), 1, &mut t),
                        2 => ffi::tpu_sync_endpoint_push(e, id, a.as_ptr(), b.as_ptr(), b.as_ptr(), tokens as u32, ranks.as_ptr(), ranks.len(), bufs.as_ptr(), 1, &mut t),
                        3 => ffi::tpu_sync_endpoint_expect_push(e, id, a.as_ptr(), b.as_ptr(), tokens as u32, ranks.as_ptr(), ranks.len(), bufs.as_ptr(), 1, &mut t),
                        4 => ffi::tpu_sync_endpoint_unregister(e, id, std::ptr::null_mut()),
                        5 => { let mut s = 0u32; ffi::tpu_sync_endpoint_source_state(e, id, &mut s) }
                        6 => ffi::tpu_sync_endpoint_stats(e, std::ptr::null_mut(), 0, &mut n),
                        _ => ffi::tpu_sync_endpoint_address(e, std::ptr::null_mut(), 0, &mut n),
                    };
                    if st == ffi::tpu_sync_status::TPU_SYNC_OK && !t.is_null() {
                        ffi::tpu_sync_transfer_cancel(t);
                        assert_eq!(ffi::tpu_sync_transfer_free(t), ffi::tpu_sync_status::TPU_SYNC_OK);
                    }
                }
                Call::TransferCalls(h) => {
                    let t = h as usize as *mut ffi::tpu_sync_transfer;
                    let mut done = false;
                    ffi::tpu_sync_transfer_poll(t, &mut done, std::ptr::null_mut());
                    ffi::tpu_sync_transfer_wait(t, 0, std::ptr::null_mut());
                    ffi::tpu_sync_transfer_cancel(t);
                    ffi::tpu_sync_transfer_free(t);
                }
                Call::Adopt { api, client, buffer } => {
                    // Only NULLs and handles: a forged raw PJRT pointer is outside the contract.
                    let mut c = std::ptr::null_mut();
                    if api == 0 || client == 0 {
                        ffi::tpu_sync_client_adopt(std::ptr::null(), std::ptr::null_mut(), &mut c);
                    }
                    let mut b = std::ptr::null_mut();
                    ffi::tpu_sync_buffer_adopt(buffer as usize as *const _, std::ptr::null_mut(), &mut b);
                }
            }
        }
    }
});
