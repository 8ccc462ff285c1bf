//! Placements from untrusted JSON (they arrive from peers): parsing, validation and planning
//! never panic; a plan that builds stays inside both sides' buffers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tsync::plan::{Placement, Plan};

fuzz_target!(|data: &[u8]| {
    let Ok(p) = serde_json::from_slice::<Placement>(data) else { return };
    for tokens in [1u32, 17, 100] {
        if p.validate(tokens).is_err() {
            continue;
        }
        // Bound the work: the fuzzer must not spend seconds on huge but valid layouts.
        let kv = p.layout.rank_kv().unwrap();
        if kv.num_layers > 8 || p.layout.num_ranks() > 16 || kv.buffer_bytes() > 1 << 24 {
            continue;
        }
        if let Ok(plan) = Plan::build(&p, &p, tokens) {
            for s in &plan.spans {
                let end = s.dst_offset + (s.count as u64 - 1) * s.dst_stride + s.len;
                assert!(end <= kv.buffer_bytes());
            }
        }
    }
});
