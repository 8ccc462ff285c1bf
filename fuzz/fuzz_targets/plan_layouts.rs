//! Structured fuzzing of the planner: arbitrary small layouts on both sides (TP/PCP/DP, block
//! sizes, orders, MLA) and arbitrary block ids. Invalid input must be an error; valid input must
//! give a plan that moves exactly tokens x bytes-per-token (x destination head replicas) and
//! writes every destination byte at most once inside the destination's buffers.
#![no_main]
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tsync::layout::{BlockOrder, DType, ModelKv, ParallelLayout, ParallelSpec};
use tsync::plan::{Placement, Plan};

#[derive(Debug, Arbitrary)]
struct Side {
    tp: u8,
    pcp: u8,
    dp: u8,
    block: u8,
    hnd: bool,
    num_blocks: u8,
    dp_rank: u8,
    ids: Vec<Vec<u8>>,
}

#[derive(Debug, Arbitrary)]
struct Input {
    heads: u8,
    mla: bool,
    tokens: u8,
    src: Side,
    dst: Side,
}

fn side(m: &ModelKv, s: &Side) -> Option<Placement> {
    let spec = ParallelSpec {
        tp: (s.tp % 9) as u32,
        pcp: (s.pcp % 5) as u32,
        dp: (s.dp % 3) as u32,
        block_size: (s.block % 33) as u32,
        order: if s.hnd { BlockOrder::Hnd } else { BlockOrder::Nhd },
    };
    let layout = ParallelLayout { model: m.clone(), spec, num_blocks: (s.num_blocks % 40) as u32, physical_layout: None, block_format: None };
    Some(Placement { first_token: 0,
        layout,
        dp_rank: (s.dp_rank % 3) as u32,
        block_ids: s.ids.iter().take(40).map(|v| v.iter().take(40).map(|&b| b as u32).collect()).collect(),
        groups: None,
    })
}

fuzz_target!(|inp: Input| {
    let (heads, planes) = if inp.mla { (1, 1) } else { ((inp.heads % 9) as u32, 2) };
    let m = ModelKv { name: "fuzz".into(), num_layers: 2, num_kv_heads: heads, head_dim: 2, kv_planes: planes, dtype: DType::Bf16 };
    let (Some(src), Some(dst)) = (side(&m, &inp.src), side(&m, &inp.dst)) else { return };
    let tokens = inp.tokens as u32;
    let Ok(plan) = Plan::build(&src, &dst, tokens) else { return };
    let expect = tokens as u64 * m.bytes_per_token() * dst.layout.head_replicas().unwrap() as u64;
    assert_eq!(plan.total_bytes(), expect);
    let dkv = dst.layout.rank_kv().unwrap();
    let mut written = std::collections::HashMap::<(u32, u32, u64), u8>::new();
    for s in &plan.spans {
        for (_, d) in s.runs() {
            assert!(d + s.len <= dkv.buffer_bytes());
            for b in d..d + s.len {
                let w = written.entry((s.dst_rank, s.dst_buffer, b)).or_insert(0);
                *w += 1;
                assert_eq!(*w, 1, "destination byte written twice");
            }
        }
    }
});
