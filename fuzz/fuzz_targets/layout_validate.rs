//! The layout and placement validators on structured input (model geometry, TP/PCP/DP, block
//! size and order, block count, DP rank, block ids, token count), as a peer may send them in a
//! placement, plus the `--prefill`/`--decode` spec parser on arbitrary text. Validation never
//! panics (numbers near `u32::MAX` included); whatever validates has consistent geometry: every
//! staged block range lies inside the per-layer buffer, the ranks of a replica map to
//! coordinates and back, PCP chunks partition the request's blocks, and the rank's staged bytes
//! are exactly its blocks.
#![no_main]
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tsync::layout::{BlockOrder, DType, ModelKv, ParallelLayout, ParallelSpec};
use tsync::plan::Placement;

#[derive(Debug, Arbitrary)]
struct Input {
    layers: u32,
    heads: u32,
    head_dim: u32,
    planes: u32,
    dtype: u8,
    tp: u32,
    pcp: u32,
    dp: u32,
    block: u32,
    hnd: bool,
    num_blocks: u32,
    dp_rank: u32,
    ids: Vec<Vec<u32>>,
    tokens: u32,
    spec: String,
}

fn small(v: u32, flag: bool) -> u32 {
    // Mostly small values (deep coverage), sometimes the raw number (edge cases).
    if flag { v } else { v % 9 }
}

fuzz_target!(|inp: Input| {
    let _ = ParallelSpec::parse(&inp.spec);
    let raw = inp.dtype & 0x80 != 0;
    let m = ModelKv {
        name: "fuzz".into(),
        num_layers: small(inp.layers, raw),
        num_kv_heads: small(inp.heads, raw),
        head_dim: small(inp.head_dim, raw),
        kv_planes: small(inp.planes, raw) % 4,
        dtype: [DType::Bf16, DType::F16, DType::F32, DType::Fp8][inp.dtype as usize % 4],
    };
    let spec = ParallelSpec {
        tp: small(inp.tp, raw),
        pcp: small(inp.pcp, raw),
        dp: small(inp.dp, raw),
        block_size: small(inp.block, raw),
        order: if inp.hnd { BlockOrder::Hnd } else { BlockOrder::Nhd },
    };
    let num_blocks = if raw { inp.num_blocks } else { inp.num_blocks % 64 };
    let Ok(layout) = ParallelLayout::new(m, spec, num_blocks) else { return };
    layout.validate().expect("new() returned a layout that does not validate");
    let s = layout.spec;
    let rpr = s.ranks_per_replica();
    assert!(rpr >= 1 && layout.num_ranks() >= rpr);
    for r in 0..layout.num_ranks().min(64) {
        assert_eq!(layout.rank(layout.coord(r).unwrap()), r);
    }
    let tokens = if raw { inp.tokens } else { inp.tokens % 512 };
    let p = Placement { first_token: 0,
        layout: layout.clone(),
        dp_rank: if raw { inp.dp_rank } else { inp.dp_rank % 3 },
        block_ids: inp.ids.iter().take(64).map(|v| v.iter().take(64).map(|&b| if raw { b } else { b % 64 }).collect()).collect(),
        groups: None,
    };
    if p.validate(tokens).is_err() {
        return;
    }
    let kv = layout.rank_kv().unwrap();
    let mut covered = 0u64;
    for pcp in 0..s.pcp {
        covered += layout.pcp_chunk(tokens, pcp).unwrap().len() as u64;
    }
    assert_eq!(covered, layout.request_blocks(tokens).unwrap() as u64, "PCP chunks partition the blocks");
    for local in 0..rpr.min(64) {
        let g = p.global_rank(local);
        assert_eq!(p.local_rank(g), Some(local));
        let mut bytes = 0;
        for r in p.block_ranges(local) {
            assert!(r.buffer < kv.num_layers && r.offset + r.len <= kv.buffer_bytes(), "{r:?} outside the buffer");
            bytes += r.len;
        }
        let n = p.block_ids[local as usize].len() as u64;
        assert_eq!(bytes, n * kv.block_bytes() * kv.kv_planes as u64 * kv.num_layers as u64);
    }
});
