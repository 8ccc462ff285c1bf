//! A failing request never loses what the host KV tier already stored: gets and puts that fail
//! (bad destinations, oversized blocks, a copy that panics half-way, a corrupt block of another
//! chain) leave every stored block present and byte-exact, leak no slot or pin, and the keys of
//! the failed request can be stored and read afterwards.

use crate::store_util;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use store_util::*;
use tpu_sync::store::{BlockKey, Hooks, KvStore};
use tpu_sync::Error;

const LEN: usize = 8192;
const SLOTS: u64 = 16;

/// Panics in the middle of copying block `key` (put or get), once per arming.
fn panicking_store(armed: Arc<AtomicU64>) -> KvStore {
    let (w, r) = (armed.clone(), armed);
    let mut c = config(LEN as u64, SLOTS);
    c.hooks = Hooks {
        mid_write: Some(Arc::new(move |k: BlockKey| {
            if w.load(Ordering::SeqCst) == k.0 as u64 {
                w.store(0, Ordering::SeqCst);
                panic!("injected fault: the copy into the slot of {k} crashed");
            }
        })),
        mid_read: Some(Arc::new(move |k: BlockKey| {
            if r.load(Ordering::SeqCst) == k.0 as u64 {
                r.store(0, Ordering::SeqCst);
                panic!("injected fault: the copy out of the slot of {k} crashed");
            }
        })),
        ..Hooks::default()
    };
    KvStore::open(c).unwrap()
}

/// Every block of `keys` is present and byte-exact.
fn intact(s: &KvStore, keys: &[BlockKey], what: &str) {
    assert_eq!(
        s.lookup(keys),
        keys.len(),
        "{what}: a stored block was lost"
    );
    let (r, bufs) = get_chain(s, keys, LEN);
    assert_eq!(r.delivered, keys.len(), "{what}: {r:?}");
    assert_exact(keys, &bufs, keys.len());
    s.debug_check().unwrap();
}

#[test]
fn a_failing_request_never_loses_stored_blocks() {
    let armed = Arc::new(AtomicU64::new(0));
    let s = panicking_store(armed.clone());
    let x = chain(6, 1);
    assert_eq!(put_chain(&s, &x, LEN).stored, 6);
    intact(&s, &x, "after the put");
    let free = s.stats().free_slots;

    // A get with a wrong-sized destination in the middle: refused, nothing lost.
    let mut bufs: Vec<Vec<u8>> = (0..6)
        .map(|i| vec![0u8; if i == 3 { LEN - 1 } else { LEN }])
        .collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let e = s.get_to_host(&x, &mut refs).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    intact(&s, &x, "after a refused get");

    // A put with an oversized block: refused before anything is written.
    let y = chain(4, 2);
    let big = vec![7u8; LEN + 1];
    let ok = bytes_of(y[0], LEN);
    let e = s
        .put_from_host(Some(x[5]), &y[..2], &[&ok, &big])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(s.lookup(&y), 0);
    intact(&s, &x, "after a refused put");

    // A put whose copy crashes half-way through its third block.
    let z = chain(5, 3);
    armed.store(z[2].0 as u64, Ordering::SeqCst);
    let r = catch_unwind(AssertUnwindSafe(|| put_chain(&s, &z, LEN)));
    assert!(r.is_err(), "the injected panic fired");
    intact(&s, &x, "after a crashed put");
    assert_eq!(
        s.lookup(&z),
        0,
        "a crashed put stores nothing of its window"
    );
    assert_eq!(
        s.stats().free_slots,
        free,
        "the crashed put's slots are free again"
    );
    // Its keys are not stuck half-stored: they can be stored and read now.
    assert_eq!(put_chain(&s, &z, LEN).stored, 5);
    intact(&s, &z, "the crashed put's keys, stored again");

    // A get whose copy crashes half-way: the blocks stay, nothing stays pinned.
    armed.store(x[4].0 as u64, Ordering::SeqCst);
    let r = catch_unwind(AssertUnwindSafe(|| get_chain(&s, &x, LEN)));
    assert!(r.is_err(), "the injected panic fired");
    intact(&s, &x, "after a crashed get");
    assert_eq!(s.remove(&x), 6, "no block of the chain is pinned");
    intact(&s, &z, "the other chain");

    // A corrupt block of one chain fails that get only.
    let w = chain(3, 4);
    put_chain(&s, &w, LEN);
    let off = s.debug_slot_ptr(w[1]).unwrap();
    // SAFETY: the slot of a committed block, inside the store's mapping; no get runs now.
    unsafe { *off.add(100) ^= 0xff };
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; LEN]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let e = s.get_to_host(&w, &mut refs).unwrap_err();
    assert!(matches!(e, Error::Checksum(_)), "{e}");
    intact(&s, &z, "a chain next to a corrupt one");
}
