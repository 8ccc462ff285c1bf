//! DMA pacing of the copy engine against the real XLA CPU plugin: the in-flight bound under 16
//! concurrent batches, chunking, FIFO order across callers, cancellation, pause/resume.

use crate::common;

use std::time::Duration;

use tpu_sync::device::{CopyBatch, Pacer, PacingConfig};
use tpu_sync::pjrt::{Capabilities, DeviceBuffer, ElementType};
use tpu_sync::Error;

const LIMIT: Duration = Duration::from_secs(60);

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .map(|i| (tpu_sync::pattern::mix64(i ^ (seed << 40)) as u8) | 1)
        .collect()
}

const CHUNK: u64 = 64 * 1024;
const MAX_INFLIGHT: u64 = 256 * 1024;

#[test]
fn sixteen_concurrent_batches_stay_within_the_inflight_bound_and_arrive_intact() {
    let c = common::client(2);
    let caps = Capabilities::probe(&c).unwrap();
    let n = 1 << 20;
    let contents: Vec<Vec<u8>> = (0..4).map(|i| pattern(n, 100 + i)).collect();
    let bufs: Vec<DeviceBuffer> = contents
        .iter()
        .enumerate()
        .map(|(i, d)| {
            c.buffer_from_host(d, ElementType::U8, &[n as i64], &c.device(i % 2).unwrap())
                .unwrap()
        })
        .collect();
    // Destinations of the H2D batches (separate buffers, so the D2H reads stay checkable).
    let h2d_bufs: Vec<DeviceBuffer> = (0..4)
        .map(|i| {
            c.uninitialized_buffer(ElementType::U8, &[n as i64], &c.device(i % 2).unwrap())
                .unwrap()
        })
        .collect();
    let pacer = Pacer::new(PacingConfig {
        chunk_bytes: CHUNK,
        max_inflight_bytes: MAX_INFLIGHT,
    })
    .unwrap();
    // Per D2H thread: 3 copies of 300 KiB, 100 KiB and 7 KiB + 1 (5 + 2 + 1 chunks).
    let sizes = [300 * 1024u64, 100 * 1024, 7 * 1024 + 1];
    let chunks_per = |len: u64| len.div_ceil(CHUNK);
    let d2h_bytes: u64 = sizes.iter().sum();
    let h2d_src: Vec<Vec<u8>> = (0..4).map(|i| pattern(n, 200 + i)).collect();
    std::thread::scope(|s| {
        let mut joins = Vec::new();
        for t in 0..12u64 {
            let bufs = &bufs;
            let contents = &contents;
            let pacer = &pacer;
            joins.push(s.spawn(move || {
                let b = (t % 4) as usize;
                let mut out = vec![0u8; d2h_bytes as usize];
                let mut batch = CopyBatch::d2h();
                let mut at = 0usize;
                let mut expect = Vec::new();
                for (k, &len) in sizes.iter().enumerate() {
                    let off = (t * 4099 + k as u64 * 333_333) % (n as u64 - len);
                    batch
                        .push(&bufs[b], off, len, out[at..].as_mut_ptr())
                        .unwrap();
                    expect.extend_from_slice(&contents[b][off as usize..(off + len) as usize]);
                    at += len as usize;
                }
                // SAFETY: `out` outlives the wait and is private to this thread.
                let h = unsafe { batch.submit(pacer) }.unwrap();
                assert!(h.wait_timeout(LIMIT), "batch {t} hung");
                let st = h.wait().unwrap();
                assert_eq!(st.bytes, d2h_bytes);
                assert!(out == expect, "batch {t}: bytes differ");
            }));
        }
        for t in 0..4usize {
            let h2d_bufs = &h2d_bufs;
            let src = &h2d_src[t];
            let pacer = &pacer;
            let caps = &caps;
            joins.push(s.spawn(move || {
                let mut batch = CopyBatch::h2d(caps).unwrap();
                // The whole buffer in two copies (512 KiB each).
                batch
                    .push(&h2d_bufs[t], 0, (n / 2) as u64, src.as_ptr() as *mut u8)
                    .unwrap();
                batch
                    .push(
                        &h2d_bufs[t],
                        (n / 2) as u64,
                        (n / 2) as u64,
                        src[n / 2..].as_ptr() as *mut u8,
                    )
                    .unwrap();
                // SAFETY: `src` outlives the wait and is not modified.
                let h = unsafe { batch.submit(pacer) }.unwrap();
                assert!(h.wait_timeout(LIMIT), "H2D batch {t} hung");
                assert_eq!(h.wait().unwrap().bytes, n as u64);
            }));
        }
        for j in joins {
            j.join().unwrap();
        }
    });
    for (t, b) in h2d_bufs.iter().enumerate() {
        let mut all = vec![0u8; n];
        b.to_host(&mut all).unwrap();
        assert!(all == h2d_src[t], "H2D destination {t} differs");
    }
    let st = pacer.stats();
    assert!(
        st.peak_inflight_bytes <= MAX_INFLIGHT,
        "peak in flight {} above the limit {MAX_INFLIGHT}",
        st.peak_inflight_bytes
    );
    assert!(st.peak_inflight_bytes >= CHUNK, "{st:?}");
    let d2h_chunks: u64 = sizes.iter().map(|&l| chunks_per(l)).sum::<u64>() * 12;
    let h2d_chunks = 2 * chunks_per((n / 2) as u64) * 4;
    assert_eq!(st.bytes, d2h_bytes * 12 + 4 * n as u64, "{st:?}");
    assert_eq!(st.chunks, d2h_chunks + h2d_chunks, "{st:?}");
    assert_eq!(
        (st.batches, st.failed_batches, st.inflight_bytes),
        (16, 0, 0)
    );
}

#[test]
fn batches_are_issued_fifo_across_callers() {
    let c = common::client(1);
    let n = 256 * 1024;
    let data = pattern(n, 300);
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[n as i64], &c.device(0).unwrap())
        .unwrap();
    // One chunk in flight at a time: a batch's chunks must all complete before the next
    // batch's first chunk is issued, so completion order is submission order.
    let pacer = Pacer::new(PacingConfig {
        chunk_bytes: 4096,
        max_inflight_bytes: 4096,
    })
    .unwrap();
    pacer.pause();
    let mut a_out = vec![0u8; n];
    let mut b_out = vec![0u8; 16];
    let mut a = CopyBatch::d2h();
    a.push(&buf, 0, n as u64, a_out.as_mut_ptr()).unwrap();
    let mut b = CopyBatch::d2h();
    b.push(&buf, 100, 16, b_out.as_mut_ptr()).unwrap();
    // SAFETY: both outputs outlive the waits below.
    let ha = unsafe { a.submit(&pacer) }.unwrap();
    // SAFETY: as above.
    let hb = unsafe { b.submit(&pacer) }.unwrap();
    pacer.resume();
    assert!(hb.wait_timeout(LIMIT));
    assert!(
        ha.is_done(),
        "the later batch completed before the earlier one"
    );
    assert_eq!(hb.wait().unwrap().chunks, 1);
    assert_eq!(ha.wait().unwrap().chunks, 64);
    assert_eq!(a_out, data);
    assert_eq!(b_out, data[100..116]);
    assert_eq!(pacer.stats().peak_inflight_bytes, 4096);
}

#[test]
fn cancelled_and_dropped_batches_stop_without_writing() {
    let c = common::client(1);
    let n = 64 * 1024;
    let buf = c
        .buffer_from_host(
            &pattern(n, 400),
            ElementType::U8,
            &[n as i64],
            &c.device(0).unwrap(),
        )
        .unwrap();
    let pacer = Pacer::new(PacingConfig {
        chunk_bytes: 4096,
        max_inflight_bytes: 4096,
    })
    .unwrap();
    pacer.pause();
    let mut out = vec![0u8; n];
    let mut batch = CopyBatch::d2h();
    batch.push(&buf, 0, n as u64, out.as_mut_ptr()).unwrap();
    // SAFETY: `out` outlives the wait.
    let h = unsafe { batch.submit(&pacer) }.unwrap();
    h.cancel();
    // A cancelled batch finishes even while the pacer is paused.
    assert!(h.wait_timeout(LIMIT), "cancelled batch hung");
    let e = h.wait().unwrap_err();
    assert!(matches!(e.error, Error::Cancelled(_)), "{e}");
    assert_eq!(e.op, 0);
    assert!(out.iter().all(|&x| x == 0), "a cancelled batch wrote");
    // Dropping an unfinished handle cancels it and returns (does not hang while paused).
    let mut batch = CopyBatch::d2h();
    batch.push(&buf, 0, n as u64, out.as_mut_ptr()).unwrap();
    // SAFETY: `out` outlives the drop, which waits.
    let h = unsafe { batch.submit(&pacer) }.unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(h);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(LIMIT)
        .expect("dropping a queued handle hung");
    assert!(out.iter().all(|&x| x == 0));
    pacer.resume();
    let st = pacer.stats();
    assert_eq!((st.batches, st.failed_batches, st.chunks), (2, 2, 0));
}

#[test]
fn config_changes_apply_to_later_chunks() {
    let c = common::client(1);
    let n = 100_000;
    let data = pattern(n, 500);
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[n as i64], &c.device(0).unwrap())
        .unwrap();
    let pacer = Pacer::new(PacingConfig::default()).unwrap();
    assert_eq!(pacer.config().chunk_bytes, 16 << 20);
    assert_eq!(pacer.config().max_inflight_bytes, 64 << 20);
    let run = |pacer: &Pacer| {
        let mut out = vec![0u8; n];
        let mut b = CopyBatch::d2h();
        b.push(&buf, 0, n as u64, out.as_mut_ptr()).unwrap();
        // SAFETY: `out` outlives the wait.
        let h = unsafe { b.submit(pacer) }.unwrap();
        assert!(h.wait_timeout(LIMIT));
        let st = h.wait().unwrap();
        assert_eq!(out, data);
        st.chunks
    };
    assert_eq!(run(&pacer), 1);
    pacer.set_config(PacingConfig {
        chunk_bytes: 10_000,
        max_inflight_bytes: 0,
    });
    assert_eq!(run(&pacer), 10);
    // A limit below the chunk size caps the chunk size: the bound holds.
    pacer.set_config(PacingConfig {
        chunk_bytes: 0,
        max_inflight_bytes: 30_000,
    });
    pacer.reset_peak();
    assert_eq!(run(&pacer), 4);
    assert!(pacer.stats().peak_inflight_bytes <= 30_000);
}

/// Small batches of host-addressable copies on an idle engine run on the submitting thread
/// (counted in `inline_batches` and, while they copy, in the in-flight bytes and their peak),
/// byte-exact both ways and at the right offsets; a paused
/// engine, a batch over `INLINE_COPY_BYTES` and a batch over one chunk go through the issuer.
#[test]
fn small_batches_on_an_idle_engine_copy_inline() {
    let c = common::client(1);
    let caps = Capabilities::probe(&c).unwrap();
    let dev = c.device(0).unwrap();
    let n = 400_000usize;
    let data = pattern(n, 900);
    let src = c
        .buffer_from_host(&data, ElementType::U8, &[n as i64], &dev)
        .unwrap();
    let orig = pattern(n, 901);
    let dst = c
        .buffer_from_host(&orig, ElementType::U8, &[n as i64], &dev)
        .unwrap();
    for b in [&src, &dst] {
        b.ready_event().unwrap().wait().unwrap();
    }
    let pacer = Pacer::new(PacingConfig::default()).unwrap();
    let d2h = |buf: &DeviceBuffer, pieces: &[(u64, u64)]| {
        let total: u64 = pieces.iter().map(|p| p.1).sum();
        let mut out = vec![0u8; total as usize];
        let mut b = CopyBatch::d2h();
        let mut at = 0usize;
        for &(off, len) in pieces {
            b.push(buf, off, len, out[at..].as_mut_ptr()).unwrap();
            at += len as usize;
        }
        // SAFETY: `out` outlives the wait.
        let h = unsafe { b.submit(&pacer) }.unwrap();
        assert!(h.wait_timeout(LIMIT));
        assert_eq!(h.wait().unwrap().bytes, total);
        out
    };
    // D2H of two pieces, inline.
    let out = d2h(&src, &[(1000, 40_960), (100_000, 61_440)]);
    assert_eq!(&out[..40_960], &data[1000..41_960]);
    assert_eq!(&out[40_960..], &data[100_000..161_440]);
    assert_eq!(
        (pacer.stats().batches, pacer.stats().inline_batches),
        (1, 1)
    );
    // The inline copy was in flight while it ran: in the peak, released after.
    let st = pacer.stats();
    assert_eq!((st.peak_inflight_bytes, st.inflight_bytes), (102_400, 0));
    // H2D of 50,000 bytes at offset 12,345, inline; the rest of the buffer untouched.
    let up = pattern(50_000, 902);
    let mut b = CopyBatch::h2d(&caps).unwrap();
    b.push(&dst, 12_345, up.len() as u64, up.as_ptr() as *mut u8)
        .unwrap();
    // SAFETY: `up` outlives the wait.
    let h = unsafe { b.submit(&pacer) }.unwrap();
    assert_eq!(h.wait().unwrap().bytes, 50_000);
    assert_eq!(pacer.stats().inline_batches, 2);
    // A batch over INLINE_COPY_BYTES goes through the issuer (and reads the H2D's bytes).
    let all = d2h(&dst, &[(0, n as u64)]);
    let mut want = orig.clone();
    want[12_345..62_345].copy_from_slice(&up);
    assert_eq!(all, want);
    assert!(n as u64 > tpu_sync::device::INLINE_COPY_BYTES);
    let st = pacer.stats();
    assert_eq!(
        (st.batches, st.inline_batches, st.failed_batches),
        (3, 2, 0)
    );
    // Paused: a small batch waits in the queue until resume.
    pacer.pause();
    let mut out = vec![0u8; 4096];
    let mut b = CopyBatch::d2h();
    b.push(&src, 7, 4096, out.as_mut_ptr()).unwrap();
    // SAFETY: `out` outlives the wait.
    let h = unsafe { b.submit(&pacer) }.unwrap();
    assert!(
        !h.wait_timeout(Duration::from_millis(200)),
        "ran while paused"
    );
    pacer.resume();
    assert_eq!(h.wait().unwrap().bytes, 4096);
    assert_eq!(&out[..], &data[7..4103]);
    // A chunk size below the batch: issued in chunks by the issuer.
    pacer.set_config(PacingConfig {
        chunk_bytes: 1000,
        max_inflight_bytes: 0,
    });
    assert_eq!(d2h(&src, &[(0, 4000)]), &data[..4000]);
    let st = pacer.stats();
    assert_eq!((st.batches, st.inline_batches), (5, 2));
}
