//! Per-block checksums: xxh3-64 (XXH3 64-bit, seed 0, default secret) of a block's stored bytes.
//!
//! The hash is computed by the `twox-hash` crate, which selects its SIMD code at run time (AVX2
//! on CPUs that have it, else SSE2; NEON on aarch64): about twice the speed of the compile-time
//! SSE2 code of `xxhash-rust` on an AVX2 machine, with the same values (a unit test compares
//! them), so checksums written by earlier builds (shm segments, disk blocks, peers) still match.
//!
//! Copies into and out of the store go through [`copy_and_checksum`], which copies in chunks of
//! [`CHUNK`] bytes and hashes each chunk of the *destination* right after copying it, while it is
//! still in the first-level cache, so a checksummed copy costs about one pass over memory instead
//! of two. Streaming xxh3 over chunks gives the same value as one call over the whole block.
//!
//! Memory that another thread may be writing at the same time (a store slot that an optimistic
//! reader copies from while an evicting writer reuses it) is only ever read through raw-pointer
//! copies, never through a `&[u8]`: the caller validates the slot's generation afterwards and
//! discards whatever it read if the slot changed.

use std::hash::Hasher as _;

use twox_hash::XxHash3_64;

/// Bytes copied and hashed per step: small enough that the chunk just copied is still in the
/// first-level data cache (32-48 KiB per core on current x86 and ARM server cores) when it is
/// hashed.
pub const CHUNK: usize = 16 << 10;

/// A streaming xxh3-64 (run-time SIMD selection; the same values as `xxhash_rust::xxh3`).
#[derive(Default, Clone)]
pub struct Xxh3(XxHash3_64);

impl Xxh3 {
    /// A new hasher (seed 0).
    pub fn new() -> Xxh3 {
        Xxh3::default()
    }

    /// Adds `data`.
    pub fn update(&mut self, data: &[u8]) {
        self.0.write(data);
    }

    /// The xxh3-64 of everything added.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

/// xxh3-64 of `data`.
pub fn checksum(data: &[u8]) -> u64 {
    XxHash3_64::oneshot(data)
}

/// xxh3-64 of the concatenation of `parts` (the same value as [`checksum`] of the joined bytes;
/// one part is hashed in one call).
pub fn checksum_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut it = parts.into_iter();
    let Some(first) = it.next() else {
        return checksum(&[]);
    };
    let Some(second) = it.next() else {
        return checksum(first);
    };
    let mut h = XxHash3_64::default();
    h.write(first);
    h.write(second);
    for p in it {
        h.write(p);
    }
    h.finish()
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
            // The same values as xxhash-rust's XXH3 (what earlier builds stored and sent).
            assert_eq!(c, xxhash_rust::xxh3::xxh3_64(&src));
            let cut = len / 3;
            assert_eq!(checksum_parts([&src[..cut], &src[cut..]]), c);
            assert_eq!(checksum_parts([&src[..]]), c);
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
