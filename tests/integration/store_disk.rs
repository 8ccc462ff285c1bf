//! The disk tier: DRAM victims spill to block files (io_uring, O_DIRECT) and load back through
//! DRAM byte-exact; the pwritev/preadv fallback does the same; restarts find the files; missing,
//! truncated and corrupt files are misses (dropped with their chain below them), never crashes;
//! the prefix rule holds across both tiers.

use crate::store_util;

use std::io::{Seek, SeekFrom, Write};

use store_util::*;
use tpu_sync::store::disk::FILE_HEADER;
use tpu_sync::store::{BlockKey, DiskOptions, IoBackend, KvStore, StopReason, StoreConfig};

const LEN: usize = 16_000; // padded to 16 KiB in files and slots

fn disk_config(dir: &std::path::Path, slots: u64, disk_blocks: u64) -> StoreConfig {
    let mut c = config(LEN as u64, slots);
    c.disk = Some(DiskOptions::new(
        dir,
        disk_blocks * (FILE_HEADER as u64 + 16384),
    ));
    c
}

fn spill_and_reload(io_uring: bool) {
    let d = TempDir::new("spill");
    let mut c = disk_config(&d.0, 4, 64);
    c.disk.as_mut().unwrap().io_uring = io_uring;
    let s = KvStore::open(c).unwrap();
    let info = s.info().unwrap();
    let (_, backend, direct, cap) = info.disk.unwrap();
    assert_eq!(cap, 64);
    if io_uring {
        // io_uring may be unavailable under some sandboxes: then setup must have failed.
        if let IoBackend::Fallback(why) = &backend {
            assert!(why.contains("io_uring_setup failed"), "{why}");
            eprintln!("io_uring unavailable here: {why}");
        }
    } else {
        assert!(matches!(backend, IoBackend::Fallback(ref w) if w.contains("option")));
    }
    assert!(direct, "O_DIRECT on {}", d.0.display());
    let keys = chain(16, 1);
    let r = put_chain(&s, &keys, LEN);
    assert_eq!((r.stored, r.full_at), (16, None));
    let st = s.stats();
    assert_eq!(st.spills, 12);
    assert_eq!((st.dram_blocks, st.disk_blocks), (4, 12));
    let l = s.lookup_detail(&keys);
    assert_eq!((l.hits, l.in_dram, l.disk_only), (16, 4, 12));
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 16, "{g:?}");
    // The 4 DRAM blocks are delivered before loading the 12 others through DRAM evicts them.
    assert_eq!((g.from_dram, g.from_disk), (4, 12), "{g:?}");
    assert_eq!(s.lookup(&keys), 16);
    assert_exact(&keys, &bufs, 16);
    // Files are header + padded data.
    let f = s.debug_file_path(keys[0]).unwrap();
    assert_eq!(
        std::fs::metadata(&f).unwrap().len(),
        FILE_HEADER as u64 + 16384
    );
    s.debug_check().unwrap();
}

#[test]
fn spilled_blocks_reload_byte_exact_with_io_uring() {
    spill_and_reload(true);
}

#[test]
fn spilled_blocks_reload_byte_exact_with_the_fallback() {
    spill_and_reload(false);
}

#[test]
fn a_restart_without_shm_finds_flushed_and_spilled_blocks() {
    let d = TempDir::new("restart");
    let keys = chain(10, 3);
    {
        let s = KvStore::open(disk_config(&d.0, 4, 64)).unwrap();
        put_chain(&s, &keys, LEN);
        // 6 spilled; the 4 still only in DRAM are written now.
        assert_eq!(s.flush_to_disk().unwrap(), 4);
        assert_eq!(s.flush_to_disk().unwrap(), 0);
    }
    let s = KvStore::open(disk_config(&d.0, 4, 64)).unwrap();
    assert_eq!(s.info().unwrap().restored_disk_blocks, 10);
    let l = s.lookup_detail(&keys);
    assert_eq!((l.hits, l.disk_only), (10, 10));
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!((g.delivered, g.from_disk), (10, 10));
    assert_exact(&keys, &bufs, 10);
    // Without a disk tier there is nothing to flush to.
    let plain = KvStore::open(config(LEN as u64, 2)).unwrap();
    assert!(plain.flush_to_disk().is_err());
}

/// Stores a chain of 8 with 2 DRAM slots (blocks 0..6 end up on disk only), damages block 3's file
/// with `damage`, and checks that a get stops there with a miss and the chain is cut there.
fn damaged_file(damage: impl FnOnce(&std::path::Path), expect: &str) {
    let d = TempDir::new("damage");
    let s = KvStore::open(disk_config(&d.0, 2, 64)).unwrap();
    let keys = chain(8, 4);
    put_chain(&s, &keys, LEN);
    let l = s.lookup_detail(&keys);
    assert_eq!((l.hits, l.disk_only), (8, 6));
    let f = s.debug_file_path(keys[3]).unwrap();
    damage(&f);
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 3, "{g:?}");
    match &g.stop {
        Some(StopReason::BadFile(why)) => assert!(why.contains(expect), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_exact(&keys, &bufs, 3);
    assert!(!f.exists(), "a bad file is deleted");
    assert_eq!(s.lookup(&keys), 3, "the chain is cut at the bad block");
    assert_eq!(s.stats().bad_files, 1);
    s.debug_check().unwrap();
    // Stored again, the chain is whole again.
    put_chain(&s, &keys, LEN);
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 8);
    assert_exact(&keys, &bufs, 8);
}

#[test]
fn a_corrupt_file_is_a_miss() {
    damaged_file(
        |f| {
            let mut h = std::fs::OpenOptions::new().write(true).open(f).unwrap();
            h.seek(SeekFrom::Start(FILE_HEADER as u64 + 777)).unwrap();
            h.write_all(&[0x5a]).unwrap();
        },
        "data checksum mismatch",
    );
}

#[test]
fn a_truncated_file_is_a_miss() {
    damaged_file(
        |f| {
            let h = std::fs::OpenOptions::new().write(true).open(f).unwrap();
            h.set_len(FILE_HEADER as u64 + 100).unwrap();
        },
        "truncated",
    );
}

#[test]
fn a_missing_file_is_a_miss() {
    damaged_file(|f| std::fs::remove_file(f).unwrap(), "file missing");
}

#[test]
fn a_damaged_header_is_a_miss() {
    damaged_file(
        |f| {
            let mut h = std::fs::OpenOptions::new().write(true).open(f).unwrap();
            h.seek(SeekFrom::Start(40)).unwrap();
            h.write_all(&[0xff, 0xee]).unwrap();
        },
        "header checksum",
    );
}

#[test]
fn bad_files_found_at_open_are_dropped() {
    let d = TempDir::new("scan");
    let keys = chain(6, 5);
    let paths: Vec<_>;
    {
        let s = KvStore::open(disk_config(&d.0, 2, 64)).unwrap();
        put_chain(&s, &keys, LEN);
        s.flush_to_disk().unwrap();
        paths = keys
            .iter()
            .map(|k| s.debug_file_path(*k).unwrap())
            .collect();
    }
    // Block 4's header is damaged; a leftover temporary file and a foreign file sit beside them.
    let mut h = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[4])
        .unwrap();
    h.write_all(b"garbage!").unwrap();
    drop(h);
    let dir = paths[0].parent().unwrap();
    std::fs::write(dir.join(".0123.1.2.tmp"), b"partial").unwrap();
    std::fs::write(dir.join("notes.txt"), b"user file").unwrap();
    let s = KvStore::open(disk_config(&d.0, 2, 64)).unwrap();
    assert_eq!(s.info().unwrap().restored_disk_blocks, 5);
    assert_eq!(s.lookup(&keys), 4);
    assert!(!paths[4].exists());
    assert!(!dir.join(".0123.1.2.tmp").exists());
    assert!(
        dir.join("notes.txt").exists(),
        "files that are not ours are left alone"
    );
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 4);
    assert_exact(&keys, &bufs, 4);
}

#[test]
fn prefixes_survive_across_both_tiers_when_both_are_full() {
    let d = TempDir::new("full");
    // 2 DRAM slots + 4 disk blocks: 6 blocks fit.
    let s = KvStore::open(disk_config(&d.0, 2, 4)).unwrap();
    let chains: Vec<Vec<BlockKey>> = (0..5).map(|i| chain(3, 100 + i)).collect();
    for c in &chains {
        put_chain(&s, c, LEN);
        s.debug_check().unwrap();
        // Every resident block of every chain has its prefix resident.
        for c2 in &chains {
            let n = s.lookup(c2);
            for (i, k) in c2.iter().enumerate().skip(n) {
                assert_eq!(s.lookup(std::slice::from_ref(k)), 0, "orphan block {i}");
            }
        }
    }
    let st = s.stats();
    assert!(st.dram_blocks <= 2 && st.disk_blocks <= 4, "{st:?}");
    // The last chain is whole and byte-exact.
    let last = &chains[4];
    let (g, bufs) = get_chain(&s, last, LEN);
    assert_eq!(g.delivered, 3, "{g:?}");
    assert_exact(last, &bufs, 3);
}

#[test]
fn a_disk_dir_is_used_by_one_store_at_a_time_and_works_on_tmpfs() {
    // tmpfs accepts O_DIRECT since Linux 6.6 and refuses it (EINVAL) before: either way it works.
    let d = TempDir::under(std::path::Path::new("/dev/shm"), "tmpfs");
    let s = KvStore::open(disk_config(&d.0, 2, 8)).unwrap();
    let e = KvStore::open(disk_config(&d.0, 2, 8)).unwrap_err();
    assert!(e.to_string().contains("in use by another store"), "{e}");
    let keys = chain(4, 6);
    put_chain(&s, &keys, LEN);
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 4);
    assert_exact(&keys, &bufs, 4);
    assert!(s.stats().spills >= 2);
}

#[test]
fn buffered_io_can_be_chosen() {
    let d = TempDir::new("buffered");
    let mut c = disk_config(&d.0, 2, 8);
    c.disk.as_mut().unwrap().direct = false;
    let s = KvStore::open(c).unwrap();
    let keys = chain(6, 7);
    put_chain(&s, &keys, LEN);
    let (_, _, direct, _) = s.info().unwrap().disk.unwrap();
    assert!(!direct);
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 6);
    assert_exact(&keys, &bufs, 6);
}

#[test]
fn foreign_files_and_loose_directories_are_not_trusted() {
    let d = TempDir::new("trust");
    let keys = chain(4, 8);
    let paths: Vec<_>;
    {
        let s = KvStore::open(disk_config(&d.0, 2, 16)).unwrap();
        put_chain(&s, &keys, LEN);
        s.flush_to_disk().unwrap();
        paths = keys
            .iter()
            .map(|k| s.debug_file_path(*k).unwrap())
            .collect();
    }
    let ns_dir = paths[0].parent().unwrap().to_path_buf();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&ns_dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // A block file that belongs to someone else is never read (and is dropped at open).
        let p = std::ffi::CString::new(paths[2].to_str().unwrap()).unwrap();
        // SAFETY: chown of a file this test created.
        assert_eq!(unsafe { libc::chown(p.as_ptr(), 65534, 65534) }, 0);
        let s = KvStore::open(disk_config(&d.0, 2, 16)).unwrap();
        assert_eq!(s.lookup(&keys), 2);
        drop(s);
    }
    // A namespace directory writable by others is refused.
    std::fs::set_permissions(&ns_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = KvStore::open(disk_config(&d.0, 2, 16)).unwrap_err();
    assert!(e.to_string().contains("writable only by it"), "{e}");
}
