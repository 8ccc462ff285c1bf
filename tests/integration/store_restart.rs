//! Warm restart from /dev/shm: re-attach and serve every committed block; a process killed with
//! SIGKILL in the middle of a put serves only whole blocks after the restart; header mismatches
//! (namespace, geometry, damaged header, loose permissions) reformat with a reason; foreign owners
//! and concurrent users are refused; segments are listed and removed.

use crate::store_util;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use store_util::*;
use tpu_sync::store::{self, Attach, Hooks, KvStore, Namespace, StoreConfig};

const LEN: usize = 20_000;
const CHILD_ENV: &str = "TPU_SYNC_STORE_CRASH_CHILD";
const SEGMENTS_ENV: &str = "TPU_SYNC_STORE_SEGMENTS_CHILD";

fn shm_config(name: &str, slots: u64) -> StoreConfig {
    let mut c = config(LEN as u64, slots);
    c.shm_name = Some(name.to_string());
    c
}

#[test]
fn reattach_serves_every_committed_block() {
    let g = ShmGuard::new("reattach");
    let keys = chain(6, 1);
    {
        let s = KvStore::open(shm_config(&g.0, 8)).unwrap();
        assert_eq!(s.info().unwrap().attach, Attach::Created);
        put_chain(&s, &keys, LEN);
    }
    let meta = std::fs::metadata(g.path()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let s = KvStore::open(shm_config(&g.0, 8)).unwrap();
    let info = s.info().unwrap();
    assert_eq!(info.attach, Attach::Attached);
    assert_eq!(info.restored_dram_blocks, 6);
    assert_eq!(info.segment.as_deref(), Some(g.path().as_path()));
    assert_eq!(s.lookup(&keys), 6);
    let (r, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(r.delivered, 6);
    assert_exact(&keys, &bufs, 6);
    // The prefix rule survives the restart: evicting for new blocks takes the tail.
    put_chain(&s, &chain(3, 2), LEN);
    assert_eq!(s.lookup(&keys), 5);
    s.debug_check().unwrap();
}

#[test]
fn header_mismatches_reformat_with_a_reason() {
    let g = ShmGuard::new("mismatch");
    let keys = chain(2, 3);
    let fill = |c: StoreConfig| {
        let s = KvStore::open(c).unwrap();
        put_chain(&s, &keys, LEN);
    };
    fill(shm_config(&g.0, 4));
    // Another model/layout.
    let mut c = shm_config(&g.0, 4);
    c.namespace = Namespace::new("some other model fp8");
    let s = KvStore::open(c).unwrap();
    match s.info().unwrap().attach {
        Attach::Reformatted(r) => assert!(r.contains("identity differs"), "{r}"),
        a => panic!("{a:?}"),
    }
    assert_eq!(s.lookup(&keys), 0);
    drop(s);
    // Another geometry (slot count).
    fill(shm_config(&g.0, 4));
    let s = KvStore::open(shm_config(&g.0, 5)).unwrap();
    match s.info().unwrap().attach {
        Attach::Reformatted(r) => assert!(r.contains("geometry differs"), "{r}"),
        a => panic!("{a:?}"),
    }
    assert_eq!(s.lookup(&keys), 0);
    drop(s);
    // A damaged header (the magic).
    fill(shm_config(&g.0, 4));
    let mut bytes = std::fs::read(g.path()).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(g.path(), &bytes).unwrap();
    // Whoever wrote the bad contents may still hold the file: it is replaced (a new inode),
    // never formatted in place (issue 24, item 8).
    let writer = std::fs::File::open(g.path()).unwrap();
    let old_ino = std::os::unix::fs::MetadataExt::ino(&writer.metadata().unwrap());
    let s = KvStore::open(shm_config(&g.0, 4)).unwrap();
    match s.info().unwrap().attach {
        Attach::Reformatted(r) => {
            assert!(r.contains("no valid header"), "{r}");
            assert!(r.contains("created anew"), "{r}");
        }
        a => panic!("{a:?}"),
    }
    let new_ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(g.path()).unwrap());
    assert_ne!(
        old_ino, new_ino,
        "the segment with a bad header was formatted in place"
    );
    let fresh = chain(2, 78);
    put_chain(&s, &fresh, LEN);
    let mut seen = Vec::new();
    std::io::Read::read_to_end(&mut &writer, &mut seen).unwrap();
    assert!(
        seen == bytes,
        "the old file changed after the store moved on"
    );
    drop((s, writer));
    // A truncated file.
    fill(shm_config(&g.0, 4));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(g.path())
        .unwrap();
    f.set_len(8192).unwrap();
    drop(f);
    let s = KvStore::open(shm_config(&g.0, 4)).unwrap();
    match s.info().unwrap().attach {
        Attach::Reformatted(r) => assert!(r.contains("truncated"), "{r}"),
        a => panic!("{a:?}"),
    }
    drop(s);
    // Readable by others: not trusted, and replaced by a new private file (a new inode, so
    // whoever opened the loose one while it was loose does not see the new contents).
    fill(shm_config(&g.0, 4));
    std::fs::set_permissions(g.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let early = std::fs::File::open(g.path()).unwrap();
    let old_ino = std::os::unix::fs::MetadataExt::ino(&early.metadata().unwrap());
    let s = KvStore::open(shm_config(&g.0, 4)).unwrap();
    match s.info().unwrap().attach {
        Attach::Reformatted(r) => {
            assert!(r.contains("mode was 0644"), "{r}");
            assert!(r.contains("created anew"), "{r}");
        }
        a => panic!("{a:?}"),
    }
    let new_ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(g.path()).unwrap());
    assert_ne!(old_ino, new_ino, "the loose file was replaced, not re-used");
    // Blocks stored now (keys the old file never held) are not in the old file.
    let fresh = chain(2, 77);
    put_chain(&s, &fresh, LEN);
    let (r, bufs) = get_chain(&s, &fresh, LEN);
    assert_eq!(r.delivered, 2);
    assert_exact(&fresh, &bufs, 2);
    let mut seen = Vec::new();
    std::io::Read::read_to_end(&mut &early, &mut seen).unwrap();
    assert!(!seen.is_empty());
    for b in &bufs {
        let probe = &b[..b.len().min(256)];
        assert!(
            !seen.windows(probe.len()).any(|w| w == probe),
            "a block stored after the reformat is visible through the old file"
        );
    }
    drop(early);
    assert_eq!(s.lookup(&keys), 0);
    let mode = std::fs::metadata(g.path()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    drop(s);
    // And a matching header attaches again.
    fill(shm_config(&g.0, 4));
    let s = KvStore::open(shm_config(&g.0, 4)).unwrap();
    assert_eq!(s.info().unwrap().attach, Attach::Attached);
    assert_eq!(s.lookup(&keys), 2);
}

#[test]
fn a_segment_has_one_user_and_one_owner() {
    let g = ShmGuard::new("owner");
    let s = KvStore::open(shm_config(&g.0, 4)).unwrap();
    let e = KvStore::open(shm_config(&g.0, 4)).unwrap_err();
    assert!(e.to_string().contains("in use by another process"), "{e}");
    drop(s);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // A segment owned by someone else is refused, untouched.
        let p = std::ffi::CString::new(g.path().to_str().unwrap()).unwrap();
        // SAFETY: chown of a file we created, to `nobody`.
        assert_eq!(unsafe { libc::chown(p.as_ptr(), 65534, 65534) }, 0);
        let before = std::fs::read(g.path()).unwrap();
        let e = KvStore::open(shm_config(&g.0, 4)).unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        assert_eq!(std::fs::read(g.path()).unwrap(), before);
        // Removing it needs --force.
        assert!(store::remove_segment(Path::new("/dev/shm"), &g.0, false).is_err());
        store::remove_segment(Path::new("/dev/shm"), &g.0, true).unwrap();
    }
    // A symlink in place of a segment is refused (O_NOFOLLOW).
    let link = ShmGuard::new("link");
    std::os::unix::fs::symlink("/etc/hostname", link.path()).unwrap();
    let e = KvStore::open(shm_config(&link.0, 4)).unwrap_err();
    assert!(e.to_string().contains("open shared-memory segment"), "{e}");
}

/// `segments_are_listed_and_removed`'s checks, in a process of their own (does nothing unless
/// started by that test): the segment of an open store is listed in use with its geometry and
/// namespace and cannot be removed; once the store is dropped it is listed free and removed.
#[test]
fn segments_child() {
    let Ok(name) = std::env::var(SEGMENTS_ENV) else {
        return;
    };
    let s = KvStore::open(shm_config(&name, 4)).unwrap();
    put_chain(&s, &chain(3, 4), LEN);
    let dir = Path::new("/dev/shm");
    let l = store::list_segments(dir).unwrap();
    let me = l.iter().find(|i| i.name == name).expect("listed");
    assert!(me.in_use);
    assert_eq!(me.blocks, Some((LEN as u64, 4, 3)));
    assert_eq!(me.namespace.as_deref(), Some(ns().description()));
    assert_eq!(me.mode, 0o600);
    let e = store::remove_segment(dir, &name, false).unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    drop(s);
    let l = store::list_segments(dir).unwrap();
    assert!(!l.iter().find(|i| i.name == name).unwrap().in_use);
    store::remove_segment(dir, &name, false).unwrap();
    assert!(!store::list_segments(dir)
        .unwrap()
        .iter()
        .any(|i| i.name == name));
    assert!(store::remove_segment(dir, &name, false).is_err());
    assert!(store::remove_segment(dir, "../x", true).is_err());
    println!("SEGMENTS OK");
}

/// A segment is "in use" while any open file description holding its `flock` lives. A process
/// that another test thread of this binary forks shares every descriptor of this one until it
/// execs, so right after `drop` the segment can be held, truly, for that instant. The checks
/// therefore run in a child process of their own, where nothing else forks. (This test failed
/// once in 5 rounds of `make stress` on 2026-12-07 with the segment still in use after `drop`;
/// the other way to get there, a metrics sample holding the tier, is closed in the library.)
#[test]
fn segments_are_listed_and_removed() {
    let g = ShmGuard::new("list");
    let out = crate::child_test(module_path!(), "segments_child")
        .env(SEGMENTS_ENV, &g.0)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("SEGMENTS OK"),
        "the child failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The keys the crash child stores: independent one-block chains.
fn crash_keys() -> Vec<store::BlockKey> {
    (0..10).map(|i| chain(1, 700 + i)[0]).collect()
}

/// Slots of the crash child's store: fewer than its blocks, so later puts evict earlier blocks
/// and the killed put is overwriting a slot that held a committed block.
const CRASH_SLOTS: u64 = 4;
const KILL_AT: usize = 6;

/// The child side of the SIGKILL test (does nothing unless started by it): stores blocks one put
/// at a time, printing `COMMITTED i`; block `KILL_AT` announces `MIDPUT` from the middle of its
/// copy and waits to be killed.
#[test]
fn crash_child() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let keys = crash_keys();
    let kill_key = keys[KILL_AT];
    let mut c = shm_config(&name, CRASH_SLOTS);
    c.hooks = Hooks {
        mid_write: Some(Arc::new(move |k| {
            if k == kill_key {
                println!("MIDPUT");
                std::thread::sleep(Duration::from_secs(60));
            }
        })),
        ..Hooks::default()
    };
    let s = KvStore::open(c).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let r = put_chain(&s, &[*k], LEN);
        assert_eq!(r.stored, 1);
        println!("COMMITTED {i}");
    }
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn sigkill_mid_put_serves_only_whole_blocks_after_restart() {
    let g = ShmGuard::new("crash");
    let mut child = crate::child_test(module_path!(), "crash_child")
        .env(CHILD_ENV, &g.0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut committed = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains("COMMITTED ") => committed += 1,
            Ok(l) if l.contains("MIDPUT") => break,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                panic!("child never reached the middle of put {KILL_AT}");
            }
        }
    }
    assert_eq!(committed, KILL_AT);
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );

    let keys = crash_keys();
    let s = KvStore::open(shm_config(&g.0, CRASH_SLOTS)).unwrap();
    let info = s.info().unwrap();
    assert_eq!(info.attach, Attach::Attached);
    // Blocks 3, 4, 5 were committed last; 0..2 were evicted (2's slot was being overwritten by
    // block 6 when the process died), 6 was half written.
    let whole = KILL_AT - CRASH_SLOTS as usize + 1..KILL_AT;
    assert_eq!(info.restored_dram_blocks, whole.len() as u64);
    for (i, k) in keys.iter().enumerate() {
        let want = usize::from(whole.contains(&i));
        assert_eq!(s.lookup(&[*k]), want, "block {i} after the restart");
    }
    for i in whole.clone() {
        let (r, bufs) = get_chain(&s, &keys[i..i + 1], LEN);
        assert_eq!(r.delivered, 1);
        assert_exact(&keys[i..i + 1], &bufs, 1);
    }
    // The half-written slot is free again and the store keeps working.
    let rep = put_chain(&s, &keys[KILL_AT..KILL_AT + 1], LEN);
    assert_eq!(rep.stored, 1);
    let (r, bufs) = get_chain(&s, &keys[KILL_AT..KILL_AT + 1], LEN);
    assert_eq!(r.delivered, 1);
    assert_exact(&keys[KILL_AT..KILL_AT + 1], &bufs, 1);
    assert_eq!(s.stats().dram_blocks, CRASH_SLOTS);
    s.debug_check().unwrap();
}
