//! Per-block checksums: xxh3-64 (the `xxhash-rust` crate) of a block's stored bytes.
//!
//! Copies into and out of the store go through [`copy_and_checksum`], which copies in chunks of
//! [`CHUNK`] bytes and hashes each chunk of the *destination* right after copying it, while it is
//! still in cache, so a checksummed copy costs about one pass over memory instead of two.
//! Streaming xxh3 over chunks gives the same value as one call over the whole block.
//!
//! Memory that another thread may be writing at the same time (a store slot that an optimistic
//! reader copies from while an evicting writer reuses it) is only ever read through raw-pointer
//! copies, never through a `&[u8]`: the caller validates the slot's generation afterwards and
//! discards whatever it read if the slot changed.

use xxhash_rust::xxh3::Xxh3;

/// Bytes copied and hashed per step (fits in L2 on current x86 and ARM server cores).
pub const CHUNK: usize = 128 << 10;

/// xxh3-64 of `data`.
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// Copies `len` bytes from `src` to `dst` and returns the xxh3-64 of the bytes written to `dst`.
/// `mid_copy` (a test hook) runs once, after the first chunk, when the copy has more than one
/// chunk or, for a single chunk, after half of it.
///
/// # Safety
/// `src..src+len` must be readable and `dst..dst+len` writable and owned by the caller for the
/// duration of the call; the ranges must not overlap. `src` may be concurrently written by another
/// thread (the copy then holds torn bytes, which the caller must detect and discard); `dst` must
/// not be accessed by anyone else.
pub unsafe fn copy_and_checksum(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    mid_copy: Option<&(dyn Fn() + Send + Sync)>,
) -> u64 {
    // SAFETY: forwarded.
    unsafe { copy_chunked(src, dst, len, true, mid_copy) }
}

/// [`copy_and_checksum`] without the hash (returns 0): the copy a get does when checksum
/// verification is off. Same contract.
///
/// # Safety
/// As for [`copy_and_checksum`].
pub unsafe fn copy_only(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    mid_copy: Option<&(dyn Fn() + Send + Sync)>,
) -> u64 {
    // SAFETY: forwarded.
    unsafe { copy_chunked(src, dst, len, false, mid_copy) }
}

unsafe fn copy_chunked(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    hash: bool,
    mid_copy: Option<&(dyn Fn() + Send + Sync)>,
) -> u64 {
    if !hash && mid_copy.is_none() {
        // SAFETY: forwarded from the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return 0;
    }
    let mut h = Xxh3::new();
    let mut off = 0;
    let step = match mid_copy {
        Some(_) if len <= CHUNK => len.div_ceil(2).max(1),
        _ => CHUNK,
    };
    let mut hook = mid_copy;
    while off < len {
        let n = step.min(len - off);
        // SAFETY: both ranges are in bounds per the caller's contract and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), n) };
        if hash {
            // SAFETY: `dst` is exclusively the caller's; we just wrote these `n` bytes.
            h.update(unsafe { std::slice::from_raw_parts(dst.add(off), n) });
        }
        off += n;
        if let Some(f) = hook.take() {
            f();
        }
    }
    if hash {
        h.digest()
    } else {
        0
    }
}

/// xxh3-64 of `len` bytes at `src`, read through a small bounce buffer (so no reference to
/// possibly concurrently written memory is created).
///
/// # Safety
/// `src..src+len` must be readable for the duration of the call. It may be concurrently written
/// (the result is then meaningless and the caller must detect the change by other means).
pub unsafe fn checksum_raw(src: *const u8, len: usize) -> u64 {
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; CHUNK.min(len.max(1))];
    let mut off = 0;
    while off < len {
        let n = buf.len().min(len - off);
        // SAFETY: in bounds per the caller's contract; `buf` is ours.
        unsafe { std::ptr::copy_nonoverlapping(src.add(off), buf.as_mut_ptr(), n) };
        h.update(&buf[..n]);
        off += n;
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_equals_one_shot() {
        for len in [0usize, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17] {
            let src: Vec<u8> = (0..len)
                .map(|i| crate::pattern::mix64(i as u64) as u8)
                .collect();
            let mut dst = vec![0u8; len];
            let calls = std::sync::atomic::AtomicU32::new(0);
            let hook = || {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            };
            // SAFETY: distinct vectors of `len` bytes.
            let c = unsafe { copy_and_checksum(src.as_ptr(), dst.as_mut_ptr(), len, Some(&hook)) };
            assert_eq!(dst, src);
            assert_eq!(c, checksum(&src));
            // SAFETY: in bounds.
            assert_eq!(unsafe { checksum_raw(src.as_ptr(), len) }, c);
            assert_eq!(calls.into_inner(), u32::from(len > 0));
            let mut again = vec![0u8; len];
            // SAFETY: distinct vectors of `len` bytes.
            let z = unsafe { copy_only(src.as_ptr(), again.as_mut_ptr(), len, None) };
            assert_eq!(z, 0);
            assert_eq!(again, src);
        }
    }
}
