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
}

struct Real {
    client: usize,
    buffer: usize,
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
        Real { client: c as usize, buffer: b as usize }
    })
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
            }
        }
    }
});
