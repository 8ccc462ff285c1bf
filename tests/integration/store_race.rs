//! Reads never return the wrong bytes: a get that is paused in the middle of copying a block while
//! another thread evicts it and writes another key's bytes into the same slot must retry or report
//! the block missing, never deliver the other key's bytes (with and without checksum
//! verification, so the generation check alone is shown to catch it); a lease prevents the race.

use crate::store_util;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use store_util::*;
use tpu_sync::store::{BlockKey, Hooks, KvStore, StopReason};

const LEN: usize = 300_000; // several checksum chunks: the hook fires after the first

/// A store of one slot whose mid-read hook, the first time block `a` is read, lets the test
/// thread run `during` (which evicts and overwrites) before the copy continues.
fn racing_store(verify: bool, a: BlockKey) -> (KvStore, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (reading_tx, reading_rx) = mpsc::channel::<()>();
    let (resume_tx, resume_rx) = mpsc::channel::<()>();
    let reading_tx = Mutex::new(reading_tx);
    let resume_rx = Mutex::new(resume_rx);
    let fired = AtomicBool::new(false);
    let mut c = config(LEN as u64, 1);
    c.verify_checksums = verify;
    c.hooks = Hooks {
        mid_read: Some(Arc::new(move |k| {
            if k == a && !fired.swap(true, Ordering::SeqCst) {
                reading_tx.lock().unwrap().send(()).unwrap();
                resume_rx
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(30))
                    .expect("test thread resumes the read");
            }
        })),
        ..Hooks::default()
    };
    (KvStore::open(c).unwrap(), reading_rx, resume_tx)
}

fn overwrite_during_read(verify: bool) {
    let a = chain(1, 1)[0];
    let b = chain(1, 2)[0];
    let (s, reading, resume) = racing_store(verify, a);
    put_chain(&s, &[a], LEN);
    let reader = {
        let s = s.clone();
        std::thread::spawn(move || get_chain(&s, &[a], LEN))
    };
    reading
        .recv_timeout(Duration::from_secs(30))
        .expect("reader reached the middle of its copy");
    // The reader holds no lease: b's put evicts a and writes b's bytes into the same slot.
    let r = put_chain(&s, &[b], LEN);
    assert_eq!(r.stored, 1);
    assert_eq!(s.lookup(&[a]), 0);
    resume.send(()).unwrap();
    let (g, bufs) = reader.join().unwrap();
    let b_bytes = bytes_of(b, LEN);
    let a_bytes = bytes_of(a, LEN);
    // The copy holds a's first half and b's second half: it must not be delivered.
    assert_ne!(bufs[0], a_bytes, "the test did not tear the copy");
    assert_ne!(bufs[0][LEN - 100..], a_bytes[LEN - 100..]);
    assert_eq!(bufs[0][LEN - 100..], b_bytes[LEN - 100..]);
    assert_eq!(g.delivered, 0, "a torn block was delivered: {g:?}");
    assert_eq!(g.stop, Some(StopReason::Missing));
    assert_eq!(g.retries, 1);
    assert_eq!(s.stats().races, 1);
    assert_eq!(s.stats().corrupt_blocks, 0, "a race is not corruption");
    // b is intact and served.
    let (g, bufs) = get_chain(&s, &[b], LEN);
    assert_eq!(g.delivered, 1);
    assert_exact(&[b], &bufs, 1);
    s.debug_check().unwrap();
}

#[test]
fn overwrite_during_read_is_never_delivered_with_checksums() {
    overwrite_during_read(true);
}

#[test]
fn overwrite_during_read_is_never_delivered_by_generation_alone() {
    overwrite_during_read(false);
}

#[test]
fn a_read_that_loses_the_race_retries_and_finds_the_block_again() {
    let a = chain(1, 3)[0];
    let b = chain(1, 4)[0];
    let (s, reading, resume) = racing_store(true, a);
    put_chain(&s, &[a], LEN);
    let reader = {
        let s = s.clone();
        std::thread::spawn(move || get_chain(&s, &[a], LEN))
    };
    reading.recv_timeout(Duration::from_secs(30)).unwrap();
    // Evict a (b takes the slot), then put a back (evicting b): a is back, in a new generation.
    put_chain(&s, &[b], LEN);
    put_chain(&s, &[a], LEN);
    resume.send(()).unwrap();
    let (g, bufs) = reader.join().unwrap();
    assert_eq!(g.delivered, 1);
    assert_eq!(g.retries, 1);
    assert_exact(&[a], &bufs, 1);
}

#[test]
fn a_lease_keeps_the_block_so_the_read_completes() {
    let a = chain(1, 5)[0];
    let b = chain(1, 6)[0];
    let (s, reading, resume) = racing_store(true, a);
    put_chain(&s, &[a], LEN);
    let lease = s.pin(&[a]);
    assert_eq!(lease.len(), 1);
    let reader = {
        let s = s.clone();
        std::thread::spawn(move || get_chain(&s, &[a], LEN))
    };
    reading.recv_timeout(Duration::from_secs(30)).unwrap();
    let r = put_chain(&s, &[b], LEN);
    assert_eq!(r.full_at, Some(0), "the only slot is leased");
    resume.send(()).unwrap();
    let (g, bufs) = reader.join().unwrap();
    assert_eq!((g.delivered, g.retries), (1, 0));
    assert_exact(&[a], &bufs, 1);
    drop(lease);
    assert_eq!(put_chain(&s, &[b], LEN).stored, 1);
}
