//! Stripe geometry as a peer declares it (`Pull`/`Push` carry index, count and chunk size): the
//! validation a receiver applies against its own stream, and the chunking both sides derive from
//! it. Whatever is declared, validation never panics and iteration costs memory independent of
//! the declared sizes; whenever a geometry validates, the stripes of a pair partition the stream
//! exactly, in increasing order, without a chunk longer than `chunk_bytes` or one crossing a
//! layer boundary.
#![no_main]
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tsync::wire::Stripe;

#[derive(Debug, Arbitrary)]
struct Input {
    index: u32,
    count: u32,
    chunk_bytes: u64,
    /// Layer lengths of the stream.
    layers: Vec<u16>,
    /// A declared total that may differ from the stream.
    total_delta: i16,
}

fuzz_target!(|inp: Input| {
    let mut bounds = Vec::new();
    let mut t = 0u64;
    for &l in inp.layers.iter().take(16) {
        t += l as u64;
        bounds.push(t);
    }
    bounds.push(t);
    let declared = Stripe { index: inp.index, count: inp.count, chunk_bytes: inp.chunk_bytes };
    let total = (t as i64 + inp.total_delta as i64).max(0) as u64;
    // Validation never panics, for any numbers; the first chunks of any geometry are cheap.
    let _ = declared.validate();
    let _ = declared.validate_for(total);
    for (a, b) in declared.chunks_in(bounds.clone()).take(64) {
        assert!(a < b && b <= t);
    }
    if declared.validate_for(t).is_err() {
        return;
    }
    // Valid: the pair's stripes partition the stream (bounded work: at most 2^16 chunks).
    let chunks = t.div_ceil(declared.chunk_bytes) + bounds.len() as u64;
    if chunks > 1 << 16 {
        return;
    }
    let mut all: Vec<(u64, u64, u32)> = Vec::new();
    for index in 0..declared.count {
        let s = Stripe { index, ..declared };
        s.validate_for(t).unwrap();
        let mut prev = 0;
        for (a, b) in s.chunks_in(bounds.clone()) {
            assert!(a >= prev && a < b && b - a <= s.chunk_bytes, "{s:?}: chunk {a}..{b}");
            assert!(!bounds.iter().any(|&e| a < e && e < b), "chunk {a}..{b} crosses a layer end");
            prev = b;
            all.push((a, b, index));
        }
    }
    all.sort_unstable();
    let mut at = 0;
    for (a, b, _) in &all {
        assert_eq!(*a, at, "gap or overlap at {at}");
        at = *b;
    }
    assert_eq!(at, t, "stripes cover the stream");
});
