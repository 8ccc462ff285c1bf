//! Helpers shared by the host KV tier tests (`tests/store_*.rs`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use tpu_sync::arena::ArenaOptions;
use tpu_sync::pattern::mix64;
use tpu_sync::store::{BlockKey, Namespace, StoreConfig};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A name unique to this process and call, e.g. for shm segments and temp dirs.
pub fn unique(tag: &str) -> String {
    format!(
        "t{}-{}-{}",
        std::process::id(),
        tag,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The test namespace.
pub fn ns() -> Namespace {
    Namespace::new("store-test llama-like bf16 tp=1 block=16 NHD")
}

/// A chain of `n` keys built from token ids derived from `seed`.
pub fn chain(n: usize, seed: u64) -> Vec<BlockKey> {
    let toks: Vec<u32> = (0..n * 16)
        .map(|i| (mix64(seed ^ (i as u64) << 8) % 50_000) as u32)
        .collect();
    ns().chain_keys(&toks, 16)
}

/// Deterministic, non-zero, non-repeating bytes of block `key`, `len` bytes long.
pub fn bytes_of(key: BlockKey, len: usize) -> Vec<u8> {
    let s = (key.0 as u64) ^ ((key.0 >> 64) as u64);
    (0..len)
        .map(|i| (mix64(s ^ (i as u64).wrapping_mul(0x9E37)) as u8) | 1)
        .collect()
}

/// A small store configuration: unlocked, no huge pages (tests run in parallel on 2 cores).
pub fn config(block_bytes: u64, slots: u64) -> StoreConfig {
    let geo_slot = if block_bytes >= 4096 {
        block_bytes.next_multiple_of(4096)
    } else {
        block_bytes.next_multiple_of(64)
    };
    let mut c = StoreConfig::new(ns(), block_bytes, geo_slot * slots);
    c.memory = ArenaOptions {
        lock: false,
        huge_pages: false,
        populate: true,
    };
    c
}

/// Removes a named segment from /dev/shm when dropped.
pub struct ShmGuard(pub String);

impl ShmGuard {
    pub fn new(tag: &str) -> ShmGuard {
        ShmGuard(unique(tag))
    }
    pub fn path(&self) -> PathBuf {
        tpu_sync::store::shm::segment_path(Path::new("/dev/shm"), &self.0)
    }
}

impl Drop for ShmGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

/// A temporary directory removed (recursively) when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        Self::under(&std::env::temp_dir(), tag)
    }
    pub fn under(root: &Path, tag: &str) -> TempDir {
        let p = root.join(format!("tpu-sync-{}", unique(tag)));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Puts `keys` (one chain) with their `bytes_of` contents of `len` bytes.
pub fn put_chain(
    s: &tpu_sync::store::KvStore,
    keys: &[BlockKey],
    len: usize,
) -> tpu_sync::store::PutReport {
    let data: Vec<Vec<u8>> = keys.iter().map(|&k| bytes_of(k, len)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    s.put_from_host(None, keys, &refs).unwrap()
}

/// Gets `keys` into fresh buffers of `len` bytes; returns the report and the buffers.
pub fn get_chain(
    s: &tpu_sync::store::KvStore,
    keys: &[BlockKey],
    len: usize,
) -> (tpu_sync::store::GetReport, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|v| v.as_mut_slice()).collect();
    let r = s.get_to_host(keys, &mut refs).unwrap();
    (r, bufs)
}

/// Asserts that the first `n` buffers hold exactly their keys' bytes.
pub fn assert_exact(keys: &[BlockKey], bufs: &[Vec<u8>], n: usize) {
    for i in 0..n {
        assert!(
            bufs[i] == bytes_of(keys[i], bufs[i].len()),
            "block {i} ({}) is not byte-exact",
            keys[i]
        );
    }
}
