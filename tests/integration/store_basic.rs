//! The host KV tier's API on host memory: puts, lookups and gets byte-exact, the prefix-eviction
//! rule, pins and "full", recency, corruption, bad arguments, background preparation and
//! concurrent use.

use crate::store_util;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use store_util::*;
use tpu_sync::store::{BlockKey, Hooks, KvStore, StopReason, TierState};
use tpu_sync::Error;

const LEN: usize = 10_000; // not a multiple of 4096 on purpose

#[test]
fn put_lookup_get_are_byte_exact() {
    let s = KvStore::open(config(LEN as u64, 16)).unwrap();
    assert_eq!(s.state(), TierState::Ready);
    let keys = chain(8, 1);
    let r = put_chain(&s, &keys, LEN);
    assert_eq!((r.stored, r.present, r.full_at), (8, 0, None));
    assert_eq!(r.bytes, 8 * LEN as u64);
    assert_eq!(s.lookup(&keys), 8);
    // A chain that shares 3 blocks, then differs.
    let mut other = keys[..3].to_vec();
    other.extend(chain(2, 99));
    assert_eq!(s.lookup(&other), 3);
    // Putting again stores nothing new.
    let r = put_chain(&s, &keys, LEN);
    assert_eq!((r.stored, r.present), (0, 8));
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!((g.delivered, g.from_dram, g.stop.clone()), (8, 8, None));
    assert_eq!(g.bytes, 8 * LEN as u64);
    assert_exact(&keys, &bufs, 8);
    // A get past the end of what is stored delivers the prefix and says why it stopped.
    let (g, bufs) = get_chain(&s, &other, LEN);
    assert_eq!(g.delivered, 3);
    assert_eq!(g.stop, Some(StopReason::Missing));
    assert_exact(&other, &bufs, 3);
    let st = s.stats();
    assert_eq!(st.dram_blocks, 8);
    assert_eq!(st.put_blocks, 8);
    assert_eq!(st.get_dram, 11);
    s.debug_check().unwrap();
}

#[test]
fn eviction_takes_chain_tails_never_prefixes() {
    let s = KvStore::open(config(LEN as u64, 6)).unwrap();
    let a = chain(4, 10);
    let b = chain(4, 20);
    put_chain(&s, &a, LEN);
    // Make `a` the least recently used chain as a whole, but its root the most recent block.
    put_chain(&s, &b[..2], LEN);
    assert_eq!(s.lookup(&a[..1]), 1);
    // Two more blocks of `b` need two slots: they must come from a's tail, not a's root.
    let r = put_chain(&s, &b, LEN);
    assert_eq!((r.stored, r.present), (2, 2));
    assert_eq!(s.lookup(&b), 4);
    assert_eq!(s.lookup(&a), 2);
    // Every block still resident has its whole prefix resident.
    for (i, k) in a.iter().enumerate() {
        let alone = s.lookup(std::slice::from_ref(k));
        assert_eq!(alone, usize::from(i < 2), "block {i} of a");
    }
    let (g, bufs) = get_chain(&s, &a, LEN);
    assert_eq!(g.delivered, 2);
    assert_exact(&a, &bufs, 2);
    assert_eq!(s.stats().evictions, 2);
    s.debug_check().unwrap();
}

#[test]
fn pinned_blocks_stay_and_a_full_store_says_so() {
    let s = KvStore::open(config(LEN as u64, 3)).unwrap();
    let a = chain(3, 30);
    put_chain(&s, &a, LEN);
    let lease = s.pin(&a);
    assert_eq!(lease.len(), 3);
    assert_eq!(lease.keys(), &a[..]);
    let b = chain(2, 31);
    let r = put_chain(&s, &b, LEN);
    assert_eq!(r.stored, 0);
    assert_eq!(r.full_at, Some(0));
    assert!(!r.complete());
    assert_eq!(s.lookup(&a), 3);
    assert_eq!(s.lookup(&b), 0);
    assert_eq!(s.stats().put_full, 2);
    // A lease on a prefix only: the tail may go.
    s.unpin(lease);
    let lease = s.pin(&a[..2]);
    let r = put_chain(&s, &b[..1], LEN);
    assert_eq!(r.stored, 1);
    assert_eq!(s.lookup(&a), 2);
    // Now every slot is pinned or protects a pinned block's chain: full again.
    let _lease_b = s.pin(&b[..1]);
    let r = put_chain(&s, &chain(1, 32), LEN);
    assert_eq!(r.full_at, Some(0));
    drop(lease);
    // Removing a pinned block is refused; unpinned blocks go with their chain below them.
    assert_eq!(s.remove(&b[..1]), 0);
    assert_eq!(s.remove(&a[..1]), 2);
    assert_eq!(s.lookup(&a), 0);
    s.debug_check().unwrap();
}

#[test]
fn recency_is_updated_by_lookup_and_get() {
    let s = KvStore::open(config(LEN as u64, 2)).unwrap();
    let x = chain(1, 40);
    let y = chain(1, 41);
    let z = chain(1, 42);
    put_chain(&s, &x, LEN);
    put_chain(&s, &y, LEN);
    assert_eq!(s.lookup(&x), 1); // x is now newer than y
    put_chain(&s, &z, LEN);
    assert_eq!((s.lookup(&x), s.lookup(&y), s.lookup(&z)), (1, 0, 1));
    // A get refreshes too: get z... then x, so z is older.
    get_chain(&s, &z, LEN);
    get_chain(&s, &x, LEN);
    put_chain(&s, &y, LEN);
    assert_eq!((s.lookup(&x), s.lookup(&z), s.lookup(&y)), (1, 0, 1));
}

#[test]
fn a_corrupted_block_is_an_error_and_is_dropped() {
    let s = KvStore::open(config(LEN as u64, 8)).unwrap();
    let keys = chain(4, 50);
    put_chain(&s, &keys, LEN);
    let p = s.debug_slot_ptr(keys[1]).unwrap();
    // SAFETY: the block's slot inside the store's mapping; no copy is running.
    unsafe { *p.add(1234) ^= 0x40 };
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; LEN]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|v| v.as_mut_slice()).collect();
    let e = s.get_to_host(&keys, &mut refs).unwrap_err();
    assert!(matches!(e, Error::Checksum(_)), "{e}");
    assert!(e.to_string().contains("chain position 1"), "{e}");
    assert_exact(&keys, &bufs, 1);
    // The block and its chain below it are gone; the prefix stays.
    assert_eq!(s.lookup(&keys), 1);
    assert_eq!(s.stats().corrupt_blocks, 1);
    assert_eq!(s.stats().dram_blocks, 1);
    // Stored again, it is served again.
    put_chain(&s, &keys, LEN);
    let (g, bufs) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 4);
    assert_exact(&keys, &bufs, 4);
    s.debug_check().unwrap();
}

#[test]
fn bad_arguments_are_clear_errors() {
    let s = KvStore::open(config(LEN as u64, 4)).unwrap();
    let keys = chain(2, 60);
    let one = vec![1u8; LEN];
    let e = s.put_from_host(None, &keys, &[&one]).unwrap_err();
    assert!(e.to_string().contains("2 keys but 1 blocks"), "{e}");
    let e = s.put_from_host(None, &keys[..1], &[&[]]).unwrap_err();
    assert!(e.to_string().contains("1..=10000"), "{e}");
    let big = vec![1u8; LEN + 1];
    assert!(s.put_from_host(None, &keys[..1], &[&big]).is_err());
    put_chain(&s, &keys, LEN);
    let mut short = vec![0u8; LEN - 1];
    let e = s.get_to_host(&keys[..1], &mut [&mut short]).unwrap_err();
    assert!(e.to_string().contains("destination 0 is 9999 bytes"), "{e}");
    let e = s.get_to_host(&keys, &mut []).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Bad configurations fail at open.
    let mut c = config(LEN as u64, 4);
    c.capacity_bytes = 100;
    assert!(KvStore::open(c).is_err());
    let mut c = config(0, 4);
    c.block_bytes = 0;
    assert!(KvStore::open(c).is_err());
    let mut c = config(LEN as u64, 4);
    c.shm_name = Some("../etc/passwd".into());
    let e = KvStore::open(c).unwrap_err();
    assert!(e.to_string().contains("segment name"), "{e}");
    // The store still works after all that.
    let (g, _) = get_chain(&s, &keys, LEN);
    assert_eq!(g.delivered, 2);
}

#[test]
fn background_preparation_serves_nothing_until_ready() {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Arc::new(Mutex::new(go_rx));
    let mut c = config(LEN as u64, 64);
    c.background = true;
    c.hooks = Hooks {
        before_prepare: Some(Arc::new(move |_| {
            let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(30));
        })),
        ..Hooks::default()
    };
    let s = KvStore::open(c).unwrap();
    assert_eq!(s.state(), TierState::Preparing);
    let keys = chain(2, 70);
    assert_eq!(s.lookup(&keys), 0);
    let r = put_chain(&s, &keys, LEN);
    assert!(r.not_ready && r.stored == 0);
    let (g, _) = get_chain(&s, &keys, LEN);
    assert_eq!(g.stop, Some(StopReason::NotReady));
    assert!(matches!(
        s.wait_ready(Duration::from_millis(50)),
        Err(Error::Timeout(_))
    ));
    assert!(s.info().is_none());
    go_tx.send(()).unwrap();
    s.wait_ready(Duration::from_secs(30)).unwrap();
    assert_eq!(s.state(), TierState::Ready);
    assert_eq!(put_chain(&s, &keys, LEN).stored, 2);
    assert_eq!(s.lookup(&keys), 2);
    assert!(s.info().unwrap().prepare_secs >= 0.0);
}

#[test]
fn a_failed_background_preparation_is_reported() {
    let mut c = config(LEN as u64, 4);
    c.background = true;
    c.shm_name = Some(unique("bgfail"));
    c.shm_dir = "/nonexistent-dir-for-tpu-sync".into();
    let s = KvStore::open(c).unwrap();
    let e = s.wait_ready(Duration::from_secs(30)).unwrap_err();
    assert!(e.to_string().contains("failed to prepare"), "{e}");
    assert!(matches!(s.state(), TierState::Failed(_)));
    assert_eq!(s.lookup(&chain(1, 1)), 0);
}

#[test]
fn concurrent_puts_and_gets_deliver_only_exact_bytes() {
    // 8 slots for 4 threads x 4-block chains: constant eviction under concurrent reads.
    let s = KvStore::open(config(LEN as u64, 8)).unwrap();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut delivered = 0;
                for round in 0..40u64 {
                    let keys = chain(4, t * 1000 + round % 5);
                    put_chain(&s, &keys, LEN);
                    let (g, bufs) = get_chain(&s, &keys, LEN);
                    assert_exact(&keys, &bufs, g.delivered);
                    delivered += g.delivered;
                }
                delivered
            })
        })
        .collect();
    let total: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(total > 0);
    s.debug_check().unwrap();
    let st = s.stats();
    assert!(st.evictions > 0, "{st:?}");
    assert_eq!(st.corrupt_blocks, 0);
}

#[test]
fn keys_from_engine_hashes_work_like_token_chains() {
    let s = KvStore::open(config(64, 4)).unwrap();
    let n = ns();
    // SGLang passes page hashes as strings; vLLM passes bytes (+ group index).
    let keys: Vec<BlockKey> = ["aa01", "aa02", "aa03"]
        .iter()
        .map(|h| n.engine_key_str(h))
        .collect();
    put_chain(&s, &keys, 64);
    assert_eq!(s.lookup(&keys), 3);
    let vllm = n.engine_key(&[&[7u8; 32][..], &0u32.to_be_bytes()].concat());
    assert_eq!(s.lookup(&[vllm]), 0);
    assert_eq!(s.clear(), 3);
    assert_eq!(s.lookup(&keys), 0);
}
