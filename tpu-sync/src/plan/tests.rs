//! Property tests of the planner: simulate both sides' buffers in memory, apply the plan, and
//! check every destination byte.

use super::*;
use crate::layout::{BlockOrder, DType, KvLayout, ModelKv, ParallelSpec};
use crate::pattern::RankContents;
use proptest::prelude::*;

/// Scattered, distinct block ids: a deterministic shuffle of 0..num_blocks.
fn scattered(num_blocks: u32, n: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        let j = (crate::pattern::mix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(n);
    ids
}

fn placement(layout: ParallelLayout, dp_rank: u32, num_tokens: u32, seed: u64) -> Placement {
    placement_from(layout, dp_rank, num_tokens, seed, 0)
}

/// A placement of the request's tokens `first_token..num_tokens`.
fn placement_from(
    layout: ParallelLayout,
    dp_rank: u32,
    num_tokens: u32,
    seed: u64,
    first_token: u32,
) -> Placement {
    let mut p = Placement {
        first_token,
        layout,
        dp_rank,
        block_ids: vec![],
        groups: None,
    };
    let s = p.layout.spec;
    p.block_ids = (0..s.ranks_per_replica())
        .map(|local| {
            let n = p.held_chunk(num_tokens, local / s.tp).unwrap().len();
            scattered(p.layout.num_blocks, n, seed ^ local as u64)
        })
        .collect();
    p
}

/// Applies `plan` to simulated buffers and checks the destination byte by byte, including that
/// each destination byte is written exactly once and nothing outside the request is touched.
fn simulate(src: &Placement, dst: &Placement, num_tokens: u32, plan: &Plan) {
    let skv = src.layout.rank_kv().unwrap();
    let dkv = dst.layout.rank_kv().unwrap();
    let layers = skv.num_layers;
    let src_bufs: Vec<Vec<Vec<u8>>> = (0..src.layout.num_ranks())
        .map(|r| {
            let c = RankContents::new(src, r, num_tokens, 1).unwrap();
            (0..layers)
                .map(|l| {
                    let mut b = vec![0u8; skv.buffer_bytes() as usize];
                    c.fill_layer(l, &mut b).unwrap();
                    b
                })
                .collect()
        })
        .collect();
    // Destination starts with a background of its own (request blocks included).
    let empty = Placement {
        first_token: 0,
        block_ids: vec![],
        dp_rank: u32::MAX,
        ..dst.clone()
    };
    let mut dst_bufs: Vec<Vec<Vec<u8>>> = (0..dst.layout.num_ranks())
        .map(|r| {
            let c = RankContents::new(&empty, r, num_tokens, 2).unwrap();
            (0..layers)
                .map(|l| {
                    let mut b = vec![0u8; dkv.buffer_bytes() as usize];
                    c.fill_layer(l, &mut b).unwrap();
                    b
                })
                .collect()
        })
        .collect();
    let mut writes: Vec<Vec<Vec<u8>>> = (0..dst.layout.num_ranks())
        .map(|_| {
            (0..layers)
                .map(|_| vec![0u8; dkv.buffer_bytes() as usize])
                .collect()
        })
        .collect();
    for s in &plan.spans {
        assert!(s.count >= 1);
        for (so, d) in s.runs() {
            let (so, d, n) = (so as usize, d as usize, s.len as usize);
            let from = &src_bufs[s.src_rank as usize][s.src_buffer as usize][so..so + n];
            dst_bufs[s.dst_rank as usize][s.dst_buffer as usize][d..d + n].copy_from_slice(from);
            for w in &mut writes[s.dst_rank as usize][s.dst_buffer as usize][d..d + n] {
                *w += 1;
            }
        }
    }
    let mut total = 0;
    for r in 0..dst.layout.num_ranks() {
        // Expected: request elements where the placement says, background of salt 2 elsewhere.
        let c = RankContents::new(dst, r, num_tokens, 2).unwrap();
        for l in 0..layers {
            let chk = c
                .verify_layer(l, &dst_bufs[r as usize][l as usize])
                .unwrap();
            assert_eq!(chk.mismatches, 0, "first: {:?}", chk.first_mismatch);
            total += chk.request_bytes;
            let written: u64 = writes[r as usize][l as usize]
                .iter()
                .map(|&w| w as u64)
                .sum();
            assert!(
                writes[r as usize][l as usize].iter().all(|&w| w <= 1),
                "a byte was written twice"
            );
            assert_eq!(written, chk.request_bytes, "written bytes != request bytes");
        }
    }
    let model = &src.layout.model;
    let expect = (dst.layout.covered_tokens(num_tokens).unwrap() - dst.first_token) as u64
        * model.bytes_per_token();
    assert_eq!(total, expect * dst.layout.head_replicas().unwrap() as u64);
    assert_eq!(plan.total_bytes(), total);
}

fn model(heads: u32, planes: u32, dtype: DType) -> ModelKv {
    ModelKv {
        name: "test".into(),
        num_layers: 2,
        num_kv_heads: heads,
        head_dim: 4,
        kv_planes: planes,
        dtype,
    }
}

fn layout(
    m: &ModelKv,
    tp: u32,
    pcp: u32,
    dp: u32,
    bs: u32,
    order: BlockOrder,
    tokens: u32,
) -> ParallelLayout {
    let spec = ParallelSpec {
        tp,
        pcp,
        dp,
        block_size: bs,
        order,
    };
    let mut l = ParallelLayout {
        model: m.clone(),
        spec,
        num_blocks: 1,
        physical_layout: None,
        block_format: None,
    };
    // Room for the request plus spare blocks so ids are scattered.
    l.num_blocks = l.pcp_chunk(tokens, 0).unwrap().len() as u32 * 2 + 3;
    l
}

#[test]
#[cfg_attr(miri, ignore = "simulates megabytes byte by byte: hours under Miri")]
fn demo_default_pair() {
    let m = ModelKv::preset("llama-3.1-8b").unwrap();
    let m = ModelKv { num_layers: 2, ..m };
    let t = 300;
    let src = placement(layout(&m, 2, 2, 1, 64, BlockOrder::Nhd, t), 0, t, 11);
    let dst = placement(layout(&m, 1, 1, 2, 16, BlockOrder::Hnd, t), 1, t, 12);
    let plan = Plan::build(&src, &dst, t).unwrap();
    simulate(&src, &dst, t, &plan);
    // Only DP rank 1 (global rank 1) receives; all four prefill ranks send.
    assert_eq!(plan.pairs(), vec![(0, 1), (1, 1), (2, 1), (3, 1)]);
    // Strided compression: far fewer spans than rows.
    let rows = 2 * t as usize * 8 * 2;
    assert!(
        plan.spans.len() * 4 < rows,
        "{} spans for {rows} rows",
        plan.spans.len()
    );
}

#[test]
fn identical_layouts_coalesce_to_blocks() {
    let m = model(4, 2, DType::Bf16);
    let t = 64;
    let l = layout(&m, 1, 1, 1, 16, BlockOrder::Nhd, t);
    let src = placement(l.clone(), 0, t, 1);
    let dst = placement(l, 0, t, 2);
    let plan = Plan::build(&src, &dst, t).unwrap();
    simulate(&src, &dst, t, &plan);
    for s in &plan.spans {
        assert_eq!(s.len, 16 * 4 * 8, "whole blocks expected: {s:?}");
    }
}

#[test]
fn physical_layouts_must_agree_when_both_are_known() {
    let m = ModelKv::preset("llama-3.1-8b").unwrap();
    let m = ModelKv { num_layers: 1, ..m };
    let t = 100;
    let src = placement(layout(&m, 1, 1, 1, 16, BlockOrder::Nhd, t), 0, t, 1);
    let dst = placement(layout(&m, 1, 1, 1, 16, BlockOrder::Nhd, t), 0, t, 2);
    let dense = "{4,3,2,1,0}";
    let tiled = "{4,3,2,1,0:T(8,128)(2,1)}";
    let with = |p: &Placement, l: Option<&str>| Placement {
        first_token: 0,
        layout: ParallelLayout {
            physical_layout: l.map(str::to_string),
            ..p.layout.clone()
        },
        ..p.clone()
    };
    // Equal, or unknown on either side (an older peer): planned.
    assert!(Plan::build(&with(&src, Some(dense)), &with(&dst, Some(dense)), t).is_ok());
    assert!(Plan::build(&with(&src, None), &with(&dst, Some(dense)), t).is_ok());
    // A known layout that is not dense, on an order planned at dense offsets: refused naming
    // it, even against an unknown side.
    let e = Plan::build(&with(&src, None), &with(&dst, Some(tiled)), t).unwrap_err();
    assert!(
        matches!(e, Error::Mismatch(_)) && e.to_string().contains(tiled),
        "{e}"
    );
    // Different: refused, naming both.
    let e = Plan::build(&with(&src, Some(dense)), &with(&dst, Some(tiled)), t).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Mismatch(_)), "{msg}");
    assert!(msg.contains(dense) && msg.contains(tiled), "{msg}");
    // JSON without the field (an older peer) still parses, and None is not serialized.
    let json = serde_json::to_string(&src).unwrap();
    assert!(!json.contains("physical_layout"), "{json}");
    let back: Placement = serde_json::from_str(&json).unwrap();
    assert_eq!(back, src);
    let json = serde_json::to_string(&with(&src, Some(tiled))).unwrap();
    let back: Placement = serde_json::from_str(&json).unwrap();
    assert_eq!(back.layout.physical_layout.as_deref(), Some(tiled));
}

#[test]
fn rejects_bad_placements() {
    let m = model(4, 2, DType::Bf16);
    let t = 40;
    let l = layout(&m, 2, 1, 1, 16, BlockOrder::Nhd, t);
    let good = placement(l.clone(), 0, t, 1);
    let mut bad = good.clone();
    bad.block_ids[0][0] = l.num_blocks;
    assert!(matches!(
        Plan::build(&good, &bad, t),
        Err(Error::BlockRange(_))
    ));
    let mut dup = good.clone();
    dup.block_ids[1][1] = dup.block_ids[1][0];
    assert!(matches!(
        Plan::build(&good, &dup, t),
        Err(Error::BlockRange(_))
    ));
    let mut short = good.clone();
    short.block_ids[0].pop();
    assert!(matches!(
        Plan::build(&good, &short, t),
        Err(Error::BlockRange(_))
    ));
    let mut dp = good.clone();
    dp.dp_rank = 1;
    assert!(matches!(Plan::build(&good, &dp, t), Err(Error::Layout(_))));
    let other = placement(
        layout(&model(2, 2, DType::Bf16), 1, 1, 1, 16, BlockOrder::Nhd, t),
        0,
        t,
        3,
    );
    assert!(matches!(
        Plan::build(&good, &other, t),
        Err(Error::Mismatch(_))
    ));
    assert!(Plan::build(&good, &good, 0).is_err());
}

fn arb_side(heads: u32) -> impl Strategy<Value = (u32, u32, u32, u32, BlockOrder)> {
    let tps: Vec<u32> = [1u32, 2, 4, 8]
        .into_iter()
        .filter(|&tp| heads % tp == 0 || tp % heads == 0)
        .collect();
    (
        proptest::sample::select(tps),
        1u32..=4,
        1u32..=2,
        proptest::sample::select(vec![1u32, 3, 4, 16]),
        prop_oneof![Just(BlockOrder::Nhd), Just(BlockOrder::Hnd)],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 2 } else { 96 }, .. ProptestConfig::default() })]

    #[test]
    fn every_destination_byte_exactly_once(
        heads in proptest::sample::select(vec![1u32, 2, 4, 8]),
        mla in any::<bool>(),
        wide in any::<bool>(),
        tokens in 1u32..80,
        seed in any::<u64>(),
        s in arb_side(8),
        d in arb_side(8),
    ) {
        let (heads, planes) = if mla { (1, 1) } else { (heads, 2) };
        let dtype = if wide { DType::F32 } else { DType::Bf16 };
        let m = model(heads, planes, dtype);
        let ok = |tp: u32| heads % tp == 0 || tp % heads == 0;
        prop_assume!(ok(s.0) && ok(d.0));
        let sl = layout(&m, s.0, s.1, s.2, s.3, s.4, tokens);
        let dl = layout(&m, d.0, d.1, d.2, d.3, d.4, tokens);
        let src = placement(sl, seed as u32 % s.2, tokens, seed);
        let dst = placement(dl, (seed >> 8) as u32 % d.2, tokens, !seed);
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        simulate(&src, &dst, tokens, &plan);
        // Every pair's spans digest identically when recomputed.
        for (a, b) in plan.pairs() {
            let again = Plan::build(&src, &dst, tokens).unwrap();
            prop_assert_eq!(spans_digest(&plan.pair_spans(a, b)), spans_digest(&again.pair_spans(a, b)));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 2 } else { 64 }, .. ProptestConfig::default() })]

    /// A destination that already holds the first `k` blocks of the request (a prefix-cache
    /// hit) receives exactly tokens `k * block_size..`: every byte of them once, nothing of the
    /// blocks it did not list, and the plan is the full plan's spans of those tokens.
    #[test]
    fn token_ranges_deliver_exactly_the_wanted_tokens(
        heads in proptest::sample::select(vec![1u32, 2, 4, 8]),
        tokens in 2u32..80,
        seed in any::<u64>(),
        s in arb_side(8),
        d in arb_side(8),
        src_from in any::<bool>(),
        pick in any::<u32>(),
    ) {
        let m = model(heads, 2, DType::Bf16);
        let ok = |tp: u32| heads % tp == 0 || tp % heads == 0;
        prop_assume!(ok(s.0) && ok(d.0));
        let sl = layout(&m, s.0, s.1, s.2, s.3, s.4, tokens);
        let dl = layout(&m, d.0, d.1, d.2, d.3, d.4, tokens);
        let dbs = dl.spec.block_size;
        let first = (pick % tokens.div_ceil(dbs)) * dbs;
        prop_assume!(first < tokens);
        // The source holds every token, or only those from a block boundary at or before `first`.
        let src_first = if src_from { (first / sl.spec.block_size) * sl.spec.block_size } else { 0 };
        let src = placement_from(sl, seed as u32 % s.2, tokens, seed, src_first);
        let dst = placement_from(dl, (seed >> 8) as u32 % d.2, tokens, !seed, first);
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        simulate(&src, &dst, tokens, &plan);
        // A source that lacks wanted tokens is refused, not planned short.
        let sbs = src.layout.spec.block_size;
        if sbs < tokens {
            let late = placement_from(src.layout.clone(), src.dp_rank, tokens, seed, sbs);
            let whole = placement_from(dst.layout.clone(), dst.dp_rank, tokens, !seed, 0);
            let e = Plan::build(&late, &whole, tokens).unwrap_err();
            prop_assert!(matches!(e, Error::Mismatch(_)), "{e}");
        }
    }
}

#[test]
fn token_ranges_refuse_unaligned_starts_and_wrong_id_counts() {
    let m = model(4, 2, DType::Bf16);
    let l = layout(&m, 2, 1, 1, 16, BlockOrder::Nhd, 100);
    let src = placement(l.clone(), 0, 100, 1);
    let dst = placement_from(l.clone(), 0, 100, 2, 32);
    assert_eq!(
        dst.block_ids[0].len(),
        5,
        "blocks 2..7 of a 100-token request"
    );
    Plan::build(&src, &dst, 100).unwrap();
    for bad in [8u32, 100, 112] {
        let mut d = dst.clone();
        d.first_token = bad;
        let e = Plan::build(&src, &d, 100).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
    }
    // The ids of the whole request with a first_token: the count is wrong, refused.
    let mut d = placement(l, 0, 100, 2);
    d.first_token = 32;
    let e = Plan::build(&src, &d, 100).unwrap_err();
    assert!(matches!(e, Error::BlockRange(_)), "{e}");
    // JSON: absent when 0, read back when set; an old reader's field list is unchanged.
    let j = serde_json::to_value(&src).unwrap();
    assert!(j.get("first_token").is_none());
    let j = serde_json::to_value(&dst).unwrap();
    assert_eq!(j["first_token"], 32);
    let back: Placement = serde_json::from_value(j).unwrap();
    assert_eq!(back, dst);
}

/// An LBHNC layout with a block format tag.
fn lbhnc(
    m: &ModelKv,
    tp: u32,
    pcp: u32,
    dp: u32,
    bs: u32,
    tokens: u32,
    tag: &str,
) -> ParallelLayout {
    layout(m, tp, pcp, dp, bs, BlockOrder::Lbhnc, tokens).with_block_format(tag)
}

#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn lbhnc_same_tp_moves_whole_blocks() {
    let m = model(4, 2, DType::F32);
    let t = 70; // 3 blocks of 32, the last one partial: moved whole
    let l = lbhnc(&m, 1, 1, 1, 32, t, "vllm-cpu/vec/float32");
    let src = placement(l.clone(), 0, t, 5);
    let dst = placement(l, 0, t, 6);
    let plan = Plan::build(&src, &dst, t).unwrap();
    simulate(&src, &dst, t, &plan);
    let kv = src.layout.rank_kv().unwrap();
    let block = kv.region_bytes() * kv.num_heads as u64;
    assert_eq!(block, 2 * 32 * 4 * 4 * 4);
    for s in &plan.spans {
        assert_eq!(s.len % block, 0, "whole blocks expected: {s:?}");
        for (so, d) in s.runs() {
            assert_eq!((so % block, d % block), (0, 0), "block-aligned: {s:?}");
        }
    }
    assert_eq!(plan.total_bytes(), 3 * block * 2);
}

#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn lbhnc_tp_reshard_moves_head_slices() {
    let m = model(4, 2, DType::Bf16);
    let t = 100;
    let tag = "vllm-cpu/amx/bfloat16";
    // Prefill TP=1 (4 heads per block), decode TP=2 (2 heads per block): each decode rank takes a
    // contiguous half of every prefill block.
    let src = placement(lbhnc(&m, 1, 1, 1, 16, t, tag), 0, t, 7);
    let dst = placement(lbhnc(&m, 2, 1, 1, 16, t, tag), 0, t, 8);
    let plan = Plan::build(&src, &dst, t).unwrap();
    simulate(&src, &dst, t, &plan);
    let skv = src.layout.rank_kv().unwrap();
    let dkv = dst.layout.rank_kv().unwrap();
    for s in &plan.spans {
        assert_eq!(s.len % skv.region_bytes(), 0, "whole regions: {s:?}");
        for (so, d) in s.runs() {
            assert_eq!(so % skv.region_bytes(), 0, "{s:?}");
            assert_eq!(d % (dkv.region_bytes() * 2), 0, "decode block start: {s:?}");
        }
    }
    assert_eq!(plan.pairs(), vec![(0, 0), (0, 1)]);
    // And back: decode TP=2 -> TP=1 gathers the halves.
    let back = Plan::build(&dst, &src, t).unwrap();
    simulate(&dst, &src, t, &back);
}

#[test]
fn lbhnc_fails_closed_on_format_mismatch() {
    let m = model(2, 2, DType::F32);
    let t = 40;
    let tag = "vllm-cpu/vec/float32";
    let a = placement(lbhnc(&m, 1, 1, 1, 32, t, tag), 0, t, 1);
    let mismatch = |dst: ParallelLayout| {
        let d = placement(dst, 0, t, 2);
        let e = Plan::build(&a, &d, t).unwrap_err();
        assert!(matches!(e, Error::Mismatch(_)), "{e}");
        let e2 = Plan::build(&d, &a, t).unwrap_err();
        assert!(matches!(e2, Error::Mismatch(_)), "{e2}");
        e.to_string()
    };
    // Another kernel or dtype packs the block differently.
    let msg = mismatch(lbhnc(&m, 1, 1, 1, 32, t, "vllm-cpu/amx/bfloat16"));
    assert!(
        msg.contains("vllm-cpu/amx/bfloat16") && msg.contains(tag),
        "{msg}"
    );
    // Unknown format on one side: refused, not guessed.
    mismatch(layout(&m, 1, 1, 1, 32, BlockOrder::Lbhnc, t));
    // Another block size: tokens cannot be re-blocked inside opaque blocks.
    let msg = mismatch(lbhnc(&m, 1, 1, 1, 16, t, tag));
    assert!(msg.contains("block size"), "{msg}");
    // Another order: an opaque block cannot become NHD or HND rows.
    for order in [BlockOrder::Nhd, BlockOrder::Hnd] {
        let msg = mismatch(layout(&m, 1, 1, 1, 32, order, t).with_block_format(tag));
        assert!(msg.contains("opaque"), "{msg}");
    }
    // NHD/HND: two known, different formats are refused; an unknown one is not checked.
    let nhd = |tag: Option<&str>| {
        let l = layout(&m, 1, 1, 1, 16, BlockOrder::Nhd, t);
        placement(
            match tag {
                Some(x) => l.with_block_format(x),
                None => l,
            },
            0,
            t,
            3,
        )
    };
    assert!(matches!(
        Plan::build(&nhd(Some("a")), &nhd(Some("b")), t),
        Err(Error::Mismatch(_))
    ));
    assert!(Plan::build(&nhd(Some("a")), &nhd(None), t).is_ok());
    // JSON: the order and the tag round-trip; peers without the tag still parse.
    let json = serde_json::to_string(&a).unwrap();
    assert!(json.contains("\"lbhnc\"") && json.contains(tag), "{json}");
    let back: Placement = serde_json::from_str(&json).unwrap();
    assert_eq!(back, a);
    let plain = serde_json::to_string(&nhd(None)).unwrap();
    assert!(!plain.contains("block_format"), "{plain}");
}

fn arb_lbhnc_side() -> impl Strategy<Value = (u32, u32, u32)> {
    (
        proptest::sample::select(vec![1u32, 2, 4, 8]),
        1u32..=3,
        1u32..=2,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 1 } else { 64 }, .. ProptestConfig::default() })]

    /// LBHNC on both sides (any TP, PCP, DP; equal block size and format): every destination
    /// byte of the request's whole blocks arrives exactly once, nothing else is touched, and
    /// every span is made of whole `(block, head)` regions.
    #[test]
    fn lbhnc_every_destination_byte_exactly_once(
        heads in proptest::sample::select(vec![1u32, 2, 4, 8]),
        wide in any::<bool>(),
        tokens in 1u32..120,
        bs in proptest::sample::select(vec![1u32, 4, 16, 32]),
        seed in any::<u64>(),
        s in arb_lbhnc_side(),
        d in arb_lbhnc_side(),
    ) {
        let dtype = if wide { DType::F32 } else { DType::Bf16 };
        let m = model(heads, 2, dtype);
        let ok = |tp: u32| heads % tp == 0 || tp % heads == 0;
        prop_assume!(ok(s.0) && ok(d.0));
        let tag = format!("test/{}", dtype.name());
        let sl = lbhnc(&m, s.0, s.1, s.2, bs, tokens, &tag);
        let dl = lbhnc(&m, d.0, d.1, d.2, bs, tokens, &tag);
        let src = placement(sl, seed as u32 % s.2, tokens, seed);
        let dst = placement(dl, (seed >> 8) as u32 % d.2, tokens, !seed);
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        simulate(&src, &dst, tokens, &plan);
        let region = src.layout.rank_kv().unwrap().region_bytes();
        for sp in &plan.spans {
            prop_assert_eq!(sp.len % region, 0);
            for (so, dd) in sp.runs() {
                prop_assert_eq!((so % region, dd % region), (0, 0));
            }
        }
    }
}

/// Applies only the pulled ranks' spans of `plan`, then the fan-out's local copies, and checks
/// that every destination rank ends exactly as the whole plan leaves it.
fn simulate_fan_out(src: &Placement, dst: &Placement, tokens: u32, plan: &Plan, fan: &FanOut) {
    let skv = src.layout.rank_kv().unwrap();
    let dkv = dst.layout.rank_kv().unwrap();
    let src_bufs: Vec<Vec<Vec<u8>>> = (0..src.layout.num_ranks())
        .map(|r| {
            let c = RankContents::new(src, r, tokens, 1).unwrap();
            (0..skv.num_layers)
                .map(|l| {
                    let mut b = vec![0u8; skv.buffer_bytes() as usize];
                    c.fill_layer(l, &mut b).unwrap();
                    b
                })
                .collect()
        })
        .collect();
    let fresh = || -> Vec<Vec<Vec<u8>>> {
        (0..dst.layout.num_ranks())
            .map(|_| {
                (0..dkv.num_layers)
                    .map(|_| vec![0u8; dkv.buffer_bytes() as usize])
                    .collect()
            })
            .collect()
    };
    let (mut full, mut fanned) = (fresh(), fresh());
    for s in &plan.spans {
        for (so, d) in s.runs() {
            let (so, d, n) = (so as usize, d as usize, s.len as usize);
            let from = &src_bufs[s.src_rank as usize][s.src_buffer as usize][so..so + n];
            full[s.dst_rank as usize][s.dst_buffer as usize][d..d + n].copy_from_slice(from);
            if fan.pulled.contains(&s.dst_rank) {
                fanned[s.dst_rank as usize][s.dst_buffer as usize][d..d + n].copy_from_slice(from);
            }
        }
    }
    for c in &fan.copies {
        assert!(fan.pulled.contains(&c.from_rank) && !fan.pulled.contains(&c.to_rank));
        let (f, t, n) = (c.from_offset as usize, c.to_offset as usize, c.len as usize);
        let bytes = fanned[c.from_rank as usize][c.buffer as usize][f..f + n].to_vec();
        fanned[c.to_rank as usize][c.buffer as usize][t..t + n].copy_from_slice(&bytes);
    }
    assert!(full == fanned, "fan-out differs from the full plan");
    assert_eq!(fan.wire_bytes + fan.copy_bytes(), plan.total_bytes());
}

#[test]
fn mla_to_tp4_crosses_the_network_once_per_host() {
    let m = ModelKv::preset("deepseek-v3").unwrap();
    let m = ModelKv { num_layers: 2, ..m };
    let t = 70;
    let src = placement(layout(&m, 1, 1, 1, 64, BlockOrder::Nhd, t), 0, t, 3);
    let dst = placement(layout(&m, 4, 1, 1, 16, BlockOrder::Nhd, t), 0, t, 4);
    let plan = Plan::build(&src, &dst, t).unwrap();
    let request = t as u64 * m.bytes_per_token();
    assert_eq!(plan.total_bytes(), 4 * request, "TP=4 receives 4 copies");
    // One host: one rank pulled, three filled locally.
    let one = FanOut::build(&plan, &dst, |_| 0).unwrap();
    assert_eq!(one.pulled, vec![0]);
    assert_eq!(one.wire_bytes, request);
    simulate_fan_out(&src, &dst, t, &plan, &one);
    // Two hosts of two ranks each: one copy per host.
    let two = FanOut::build(&plan, &dst, |r| r / 2).unwrap();
    assert_eq!(two.pulled, vec![0, 2]);
    assert_eq!(two.wire_bytes, 2 * request);
    simulate_fan_out(&src, &dst, t, &plan, &two);
    // One host per rank: nothing to fan out.
    let each = FanOut::build(&plan, &dst, |r| r).unwrap();
    assert_eq!(each.pulled, vec![0, 1, 2, 3]);
    assert!(each.copies.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 1 } else { 48 }, .. ProptestConfig::default() })]

    /// Any head count, TP, PCP, block size and order on the destination, ranks spread over one
    /// or two hosts: pulling only `FanOut::pulled` and running its copies leaves every
    /// destination byte as the whole plan does.
    #[test]
    fn fan_out_equals_the_whole_plan(
        heads in proptest::sample::select(vec![1u32, 2, 4]),
        tokens in 1u32..90,
        seed in any::<u64>(),
        d in arb_side(1),
        s_tp in proptest::sample::select(vec![1u32, 2]),
        hosts in 1u32..=2,
        lbhnc_dst in any::<bool>(),
    ) {
        let m = model(heads, if heads == 1 { 1 } else { 2 }, DType::Bf16);
        let (tp, pcp, _dp, bs, order) = d;
        prop_assume!(heads % tp == 0 || tp % heads == 0);
        prop_assume!(heads % s_tp == 0 || s_tp % heads == 0);
        let (src, dst) = if lbhnc_dst {
            let tag = "test/bfloat16";
            (
                placement(lbhnc(&m, s_tp, 1, 1, bs, tokens, tag), 0, tokens, seed),
                placement(lbhnc(&m, tp, pcp, 1, bs, tokens, tag), 0, tokens, !seed),
            )
        } else {
            (
                placement(layout(&m, s_tp, 1, 1, 16, BlockOrder::Nhd, tokens), 0, tokens, seed),
                placement(layout(&m, tp, pcp, 1, bs, order, tokens), 0, tokens, !seed),
            )
        };
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        let fan = FanOut::build(&plan, &dst, |r| r % hosts).unwrap();
        let groups = dst.layout.spec.ranks_per_replica() / dst.layout.head_replicas().unwrap();
        prop_assert!(fan.pulled.len() as u32 <= (groups * hosts).min(dst.layout.spec.ranks_per_replica()));
        simulate_fan_out(&src, &dst, tokens, &plan, &fan);
    }
}

// ---------------------------------------------------------------- the TPU engines' RPA v3 caches

/// A non-zero, non-repeating value of `size` bytes for one logical KV element.
/// Copies the spans of layer `layer` of `plan` from `from[src_rank]` into `got[dst_rank]` (each
/// span of that layer must also write that layer).
fn apply_layer(plan: &Plan, layer: u32, from: &[Vec<u8>], got: &mut [Vec<u8>]) {
    for s in plan.spans.iter().filter(|s| s.src_buffer == layer) {
        assert_eq!(s.dst_buffer, layer);
        for (so, dof) in s.runs() {
            let (so, dof, n) = (so as usize, dof as usize, s.len as usize);
            got[s.dst_rank as usize][dof..dof + n]
                .copy_from_slice(&from[s.src_rank as usize][so..so + n]);
        }
    }
}

/// A TPU order against a GPU order (`s.4` / `d.4`), one way or the other (`to_tpu`), checked by
/// the pattern simulation: every destination byte exactly once, nothing else touched, a TPU
/// destination's padding still zero. `s`, `d`: `(tp, pcp, dp, block_size, order)` of
/// [`arb_side`].
fn convert_and_simulate(
    m: &ModelKv,
    s: (u32, u32, u32, u32, BlockOrder),
    d: (u32, u32, u32, u32, BlockOrder),
    to_tpu: bool,
    tpu: BlockOrder,
    tokens: u32,
    seed: u64,
) {
    let (so, dord) = if to_tpu { (s.4, tpu) } else { (tpu, d.4) };
    let sl = layout(m, s.0, s.1, s.2, s.3, so, tokens);
    let dl = layout(m, d.0, d.1, d.2, d.3, dord, tokens);
    let src = placement(sl, seed as u32 % s.2, tokens, seed);
    let dst = placement(dl, (seed >> 8) as u32 % d.2, tokens, !seed);
    let plan = Plan::build(&src, &dst, tokens).unwrap();
    simulate(&src, &dst, tokens, &plan);
}

fn rpa3_value(layer: u32, token: u32, head: u32, plane: u32, d: u32, size: usize) -> Vec<u8> {
    let key = ((layer as u64) << 56)
        ^ ((token as u64) << 36)
        ^ ((head as u64) << 24)
        ^ ((plane as u64) << 20)
        ^ d as u64;
    let v = crate::pattern::mix64(key ^ 0x7470_755f_7270_6133);
    let mut b = v.to_le_bytes()[..size].to_vec();
    b[0] |= 1;
    b
}

/// An independent reference of one rank's layer buffer in the TPU engines' RPA v3 layouts,
/// built as the kernels' `merge_kv` builds each token (vllm-torchtpu-core 0.29.0 and
/// tpu-inference 0.32.0, `kernels/ragged_paged_attention/v3/kernel.py` and `kernel_hd64.py`):
/// K and V of each head concatenated along the last axis; reshaped to `2H` rows of `D` (v3) or
/// kept as `H` rows of `2D = 128` lanes (head_dim 64); rows padded with zeros to a multiple of
/// `P = 32 / bits`, lanes to a multiple of 128; reshaped to `[R, P, D']`; token `k` of block
/// `b` at `[b, k]` of `[num_blocks, block_size, R, P, D']`. Everything else is zero.
/// `heads`: the rank's global heads; `blocks`: (request block index, block id).
#[allow(clippy::too_many_arguments)]
fn rpa3_reference(
    hd64: bool,
    layer: u32,
    heads: std::ops::Range<u32>,
    head_dim: u32,
    dtype: DType,
    block_size: u32,
    num_blocks: u32,
    blocks: &[(u32, u32)],
    num_tokens: u32,
) -> Vec<u8> {
    let size = dtype.size() as usize;
    let p = 4 / size;
    let h = heads.len();
    let lanes = if hd64 {
        128
    } else {
        (head_dim as usize).div_ceil(128) * 128
    };
    let rows = if hd64 { h } else { 2 * h };
    let padded_rows = rows.div_ceil(p) * p;
    let token_bytes = padded_rows * lanes * size;
    let mut out = vec![0u8; num_blocks as usize * block_size as usize * token_bytes];
    for &(i, id) in blocks {
        for k in 0..block_size {
            let t = i * block_size + k;
            if t >= num_tokens {
                break;
            }
            // One token: `rows` rows of the concatenation, then zero rows and lanes.
            let mut merged: Vec<Vec<u8>> = Vec::new();
            for g in heads.clone() {
                let plane_row = |plane: u32| -> Vec<u8> {
                    (0..head_dim)
                        .flat_map(|d| rpa3_value(layer, t, g, plane, d, size))
                        .collect()
                };
                let (k_row, v_row) = (plane_row(0), plane_row(1));
                if hd64 {
                    merged.push([k_row, v_row].concat());
                } else {
                    merged.push(k_row);
                    merged.push(v_row);
                }
            }
            let base = (id as usize * block_size as usize + k as usize) * token_bytes;
            for (j, row) in merged.iter().enumerate() {
                let at = base + j * lanes * size;
                out[at..at + row.len()].copy_from_slice(row);
            }
        }
    }
    out
}

/// Builds every rank's reference buffers of `pl` for layer `layer`.
fn rpa3_rank_buffers(pl: &Placement, layer: u32, num_tokens: u32) -> Vec<Vec<u8>> {
    let l = &pl.layout;
    let hd64 = l.spec.order == BlockOrder::Rpa3Hd64;
    (0..l.num_ranks())
        .map(|r| {
            let c = l.coord(r).unwrap();
            let first = l.first_head(c.tp).unwrap();
            let heads = first..first + l.heads_per_rank().unwrap();
            let blocks: Vec<(u32, u32)> = match pl.local_rank(r) {
                Some(local) => {
                    let chunk = l.pcp_chunk(num_tokens, c.pcp).unwrap();
                    chunk
                        .zip(pl.block_ids[local as usize].iter().copied())
                        .collect()
                }
                None => Vec::new(),
            };
            rpa3_reference(
                hd64,
                layer,
                heads,
                l.model.head_dim,
                l.model.dtype,
                l.spec.block_size,
                l.num_blocks,
                &blocks,
                num_tokens,
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 1 } else { 64 }, .. ProptestConfig::default() })]

    /// RPA v3 to RPA v3 (v3 or head_dim 64, fp32, bf16 and fp8, any TP on either side, odd
    /// local head counts that leave padded slots, other block sizes, PCP on the source):
    /// applying the plan to source buffers built by the independent `merge_kv` reference gives
    /// exactly the destination's reference buffers, padding still zero, and the plan moves
    /// exactly the real bytes of the request (moved / needed = 1).
    #[test]
    fn rpa3_reshards_byte_exact_against_a_merge_kv_reference(
        heads in proptest::sample::select(vec![1u32, 2, 3, 4, 6, 8]),
        dim in proptest::sample::select(vec![32u32, 64, 80, 128, 192]),
        dtype in prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::Fp8)],
        hd64 in any::<bool>(),
        tokens in 1u32..70,
        seed in any::<u64>(),
        s_tp in proptest::sample::select(vec![1u32, 2, 4, 8]),
        d_tp in proptest::sample::select(vec![1u32, 2, 4, 8]),
        s_pcp in 1u32..=2,
        s_bs in proptest::sample::select(vec![1u32, 4, 16]),
        d_bs in proptest::sample::select(vec![3u32, 8, 16]),
    ) {
        let ok = |tp: u32| heads % tp == 0 || tp % heads == 0;
        prop_assume!(ok(s_tp) && ok(d_tp));
        let order = if hd64 { BlockOrder::Rpa3Hd64 } else { BlockOrder::Rpa3 };
        let m = ModelKv {
            name: "tpu".into(),
            num_layers: 2,
            num_kv_heads: heads,
            head_dim: if hd64 { 64 } else { dim },
            kv_planes: 2,
            dtype,
        };
        let src = placement(layout(&m, s_tp, s_pcp, 1, s_bs, order, tokens), 0, tokens, seed);
        let dst = placement(layout(&m, d_tp, 1, 1, d_bs, order, tokens), 0, tokens, !seed);
        src.layout.validate().unwrap();
        dst.layout.validate().unwrap();
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        for layer in 0..m.num_layers {
            let from = rpa3_rank_buffers(&src, layer, tokens);
            let want = rpa3_rank_buffers(&dst, layer, tokens);
            let mut got: Vec<Vec<u8>> = want.iter().map(|b| vec![0u8; b.len()]).collect();
            apply_layer(&plan, layer, &from, &mut got);
            for r in 0..got.len() {
                prop_assert!(got[r] == want[r], "layer {} rank {} differs from the reference", layer, r);
            }
        }
        let needed = tokens as u64 * m.bytes_per_token() * dst.layout.head_replicas().unwrap() as u64;
        prop_assert_eq!(plan.total_bytes(), needed);
    }

    /// RPA v3 against every other order (NHD, HND; TP, PCP, DP and block sizes differing) with
    /// the pattern simulation: every destination byte exactly once, nothing else touched, and
    /// the padding of an RPA v3 destination still zero.
    #[test]
    fn rpa3_and_the_gpu_orders_convert_both_ways(
        heads in proptest::sample::select(vec![1u32, 2, 4, 6]),
        dtype in prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::Fp8)],
        tokens in 1u32..60,
        seed in any::<u64>(),
        s in arb_side(8),
        d in arb_side(8),
        to_tpu in any::<bool>(),
        hd64 in any::<bool>(),
    ) {
        let ok = |tp: u32| heads % tp == 0 || tp % heads == 0;
        prop_assume!(ok(s.0) && ok(d.0));
        let m = ModelKv {
            head_dim: if hd64 { 64 } else { 96 },
            ..model(heads, 2, dtype)
        };
        let tpu = if hd64 { BlockOrder::Rpa3Hd64 } else { BlockOrder::Rpa3 };
        convert_and_simulate(&m, s, d, to_tpu, tpu, tokens, seed);
    }
}

/// The shapes of the engines' caches, from their formulas (`get_kv_cache_shape` in
/// `vllm_torchtpu/layers/adapter/attention.py` and `kernels/ragged_paged_attention/v3/
/// kernel.py` / `kernel_hd64.py`): `(N, BS, align(2H, P) / P, P, align(D, 128))` and `(N, BS,
/// align(H, P) / P, P, 128)` with `P = 32 / bits`.
#[test]
fn rpa3_shapes_follow_the_engines_formulas() {
    let kv = |heads, head_dim, dtype, order| KvLayout {
        num_layers: 1,
        kv_planes: 2,
        num_blocks: 10,
        block_size: 16,
        num_heads: heads,
        head_dim,
        dtype,
        order,
    };
    // Llama-3.1-8B per TP=1 rank, bf16: 8 heads -> 16 rows of K/V, P = 2 -> R = 8.
    assert_eq!(
        kv(8, 128, DType::Bf16, BlockOrder::Rpa3).dims(),
        [10, 16, 8, 2, 128]
    );
    // fp8: P = 4; 3 heads -> 6 rows -> padded to 8 -> R = 2.
    let k = kv(3, 128, DType::Fp8, BlockOrder::Rpa3);
    assert_eq!(k.dims(), [10, 16, 2, 4, 128]);
    assert_eq!(k.buffer_bytes(), 10 * 16 * 2 * 4 * 128);
    assert_eq!(k.token_padding(), vec![(6 * 128, 2 * 128)]);
    // fp32: P = 1; head_dim 80 -> 128 lanes.
    let k = kv(2, 80, DType::F32, BlockOrder::Rpa3);
    assert_eq!(k.dims(), [10, 16, 4, 1, 128]);
    assert_eq!(
        k.token_padding(),
        (0..4).map(|j| (j * 512 + 320, 192)).collect::<Vec<_>>()
    );
    // Row j = 2h + plane: head 1's V is slot 3.
    assert_eq!(k.row_offset(1, 2, 5, 1), (2 * 16 + 5) * 4 * 512 + 3 * 512);
    // head_dim 64: K and V side by side; bf16 P = 2, 3 heads -> R = 2, one padded slot.
    let k = kv(3, 64, DType::Bf16, BlockOrder::Rpa3Hd64);
    assert_eq!(k.dims(), [10, 16, 2, 2, 128]);
    assert_eq!(k.row_offset(1, 0, 0, 2), 2 * 256 + 128);
    assert_eq!(k.token_padding(), vec![(3 * 256, 256)]);
    // A block is contiguous; its planes name its halves.
    assert_eq!(
        k.block_offset(1, 3),
        3 * 2 * k.block_bytes() + k.block_bytes()
    );
    assert_eq!(2 * k.block_bytes(), 16 * 4 * 256);
    // Spec names.
    let s = ParallelSpec::parse("tp=2,order=rpa3hd64").unwrap();
    assert_eq!(s.order, BlockOrder::Rpa3Hd64);
    assert_eq!(BlockOrder::parse("RPA3").unwrap(), BlockOrder::Rpa3);
    assert!(ParallelSpec::parse("order=rpa4")
        .unwrap_err()
        .to_string()
        .contains("rpa3hd64"));
    // Refused: MLA in an RPA v3 order, rpa3hd64 with another head_dim.
    let mla = ModelKv::preset("deepseek-v3").unwrap();
    let e = ParallelLayout::new(mla, ParallelSpec::parse("order=rpa3").unwrap(), 4).unwrap_err();
    assert!(e.to_string().contains("MLA"), "{e}");
    let llama = ModelKv::preset("llama-3.1-8b").unwrap();
    let e =
        ParallelLayout::new(llama, ParallelSpec::parse("order=rpa3hd64").unwrap(), 4).unwrap_err();
    assert!(e.to_string().contains("head_dim"), "{e}");
}

/// An independent reference of one rank's layer buffer in tpu-inference's MLA cache
/// ([`BlockOrder::RpaMla`]), built as its kernel's `prepare_kv_inputs` builds the new tokens
/// (`kernels/mla/v2/kernel.py`, tpu-inference 0.32.0): each token's `head_dim` latent + rope
/// elements, lanes padded with zeros to a multiple of 128, tokens reshaped to `[-1, K, D']`, so
/// token `k` of block `b` is row `b * block_size + k` of `D'` lanes. Every other byte (other
/// blocks, the request's padding lanes and unused token slots) is a non-zero filler of seed
/// `fill`, so that a plan which moved padding or wrote outside the request shows. Every TP rank
/// holds the same latent (MLA is replicated over TP). `blocks`: (request block index, block id).
#[allow(clippy::too_many_arguments)]
fn mla_reference(
    layer: u32,
    head_dim: u32,
    dtype: DType,
    block_size: u32,
    num_blocks: u32,
    blocks: &[(u32, u32)],
    num_tokens: u32,
    fill: u64,
) -> Vec<u8> {
    let size = dtype.size() as usize;
    let lanes = (head_dim as usize).div_ceil(128) * 128;
    let mut out: Vec<u8> = (0..num_blocks as usize * block_size as usize * lanes * size)
        .map(|i| (crate::pattern::mix64(fill ^ ((i as u64) << 8)) as u8) | 1)
        .collect();
    for &(i, id) in blocks {
        for k in 0..block_size {
            let t = i * block_size + k;
            if t >= num_tokens {
                break;
            }
            let row: Vec<u8> = (0..head_dim)
                .flat_map(|d| rpa3_value(layer, t, 0, 0, d, size))
                .collect();
            let at = (id as usize * block_size as usize + k as usize) * lanes * size;
            out[at..at + row.len()].copy_from_slice(&row);
        }
    }
    out
}

fn mla_rank_buffers(pl: &Placement, layer: u32, num_tokens: u32, fill: u64) -> Vec<Vec<u8>> {
    let l = &pl.layout;
    (0..l.num_ranks())
        .map(|r| {
            let c = l.coord(r).unwrap();
            let blocks: Vec<(u32, u32)> = match pl.local_rank(r) {
                Some(local) => l
                    .pcp_chunk(num_tokens, c.pcp)
                    .unwrap()
                    .zip(pl.block_ids[local as usize].iter().copied())
                    .collect(),
                None => Vec::new(),
            };
            mla_reference(
                layer,
                l.model.head_dim,
                l.model.dtype,
                l.spec.block_size,
                l.num_blocks,
                &blocks,
                num_tokens,
                fill ^ r as u64,
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 1 } else { 48 }, .. ProptestConfig::default() })]

    /// tpu-inference's MLA cache to itself (any TP on either side: every destination TP rank
    /// gets the latent; PCP on the source; other block sizes; head_dim 576 padded to 640 or an
    /// aligned one): the plan applied to buffers of the independent `prepare_kv_inputs`
    /// reference gives exactly the destination's reference, every byte outside the request's
    /// real lanes (padding lanes included, non-zero on both sides) unchanged, and it moves
    /// exactly the real bytes (one latent per token per destination TP rank).
    #[test]
    fn rpamla_reshards_byte_exact_against_the_kernels_reference(
        dim in proptest::sample::select(vec![576u32, 512, 192]),
        dtype in prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::Fp8)],
        tokens in 1u32..90,
        seed in any::<u64>(),
        s_tp in proptest::sample::select(vec![1u32, 2, 4, 8]),
        d_tp in proptest::sample::select(vec![1u32, 2, 4, 8]),
        s_pcp in 1u32..=2,
        s_bs in proptest::sample::select(vec![8u32, 16, 32]),
        d_bs in proptest::sample::select(vec![8u32, 32, 64]),
    ) {
        let m = ModelKv { head_dim: dim, ..model(1, 1, dtype) };
        let src = placement(layout(&m, s_tp, s_pcp, 1, s_bs, BlockOrder::RpaMla, tokens), 0, tokens, seed);
        let dst = placement(layout(&m, d_tp, 1, 1, d_bs, BlockOrder::RpaMla, tokens), 0, tokens, !seed);
        src.layout.validate().unwrap();
        dst.layout.validate().unwrap();
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        for layer in 0..m.num_layers {
            let from = mla_rank_buffers(&src, layer, tokens, seed);
            let want = mla_rank_buffers(&dst, layer, tokens, !seed);
            // The destination before the pull: its filler everywhere (the same filler as `want`).
            let mut got = mla_rank_buffers(&dst, layer, 0, !seed);
            apply_layer(&plan, layer, &from, &mut got);
            for r in 0..got.len() {
                prop_assert!(got[r] == want[r], "layer {} rank {} differs from the reference", layer, r);
            }
        }
        prop_assert_eq!(plan.total_bytes(), tokens as u64 * m.bytes_per_token() * d_tp as u64);
    }

    /// tpu-inference's MLA cache against the GPU orders' MLA buffers (NHD, HND; TP, PCP, DP and
    /// block sizes differing), both ways, with the pattern simulation: every destination byte
    /// exactly once, nothing else touched, an `rpamla` destination's lane padding still zero.
    #[test]
    fn rpamla_and_the_gpu_mla_orders_convert_both_ways(
        dtype in prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::Fp8)],
        tokens in 1u32..60,
        seed in any::<u64>(),
        s in arb_side(1),
        d in arb_side(1),
        to_tpu in any::<bool>(),
    ) {
        let m = ModelKv { head_dim: 144, ..model(1, 1, dtype) };
        convert_and_simulate(&m, s, d, to_tpu, BlockOrder::RpaMla, tokens, seed);
    }
}

/// tpu-inference's MLA cache shape (`get_kv_cache_shape` of `kernels/mla/v2/kernel.py`:
/// `(N, align(BS, K) / K, K, align(kv_dim, 128))`, here with `block_size` a multiple of `K`, so
/// `[N, BS, D']` up to the split of the token axis), offsets and padding; refused for models
/// that are not one-plane, one-head MLA.
#[test]
fn rpamla_shape_offsets_and_refusals() {
    let k = KvLayout {
        num_layers: 1,
        kv_planes: 1,
        num_blocks: 10,
        block_size: 64,
        num_heads: 1,
        head_dim: 576,
        dtype: DType::Bf16,
        order: BlockOrder::RpaMla,
    };
    assert_eq!(k.dims(), [1, 1, 10, 64, 640]);
    assert_eq!(k.padded_head_dim(), 640);
    assert_eq!(k.block_bytes(), 64 * 640 * 2);
    assert_eq!(k.buffer_bytes(), 10 * 64 * 640 * 2);
    assert_eq!(k.buffer_bytes_wide(), k.buffer_bytes() as u128);
    assert_eq!(k.row_bytes(), 576 * 2);
    assert_eq!(k.row_offset(0, 3, 5, 0), (3 * 64 + 5) * 640 * 2);
    assert_eq!(k.token_padding(), vec![(576 * 2, 64 * 2)]);
    assert_eq!(
        KvLayout { head_dim: 512, ..k }.token_padding(),
        Vec::<(u64, u64)>::new()
    );
    assert_eq!(BlockOrder::parse("RpaMla").unwrap(), BlockOrder::RpaMla);
    let mla = ModelKv::preset("deepseek-v3").unwrap();
    let l = ParallelLayout::new(mla, ParallelSpec::parse("tp=4,order=rpamla").unwrap(), 8).unwrap();
    assert_eq!(l.rank_kv().unwrap().dims(), [1, 1, 8, 16, 640]);
    // Physical layouts: tpu-inference's dense 4-D array, its 3-D view and tpu-sync's own 5-D
    // shape of it are row-major; a tiled one is refused by name, as is a 3-D layout for a 5-D
    // RPA v3 buffer.
    let with = |l: &ParallelLayout, p: &str| l.clone().with_physical_layout(p);
    for ok in ["{4,3,2,1,0}", "{3,2,1,0}", "{2,1,0}"] {
        with(&l, ok).check_physical_layout(&l).unwrap();
    }
    let e = with(&l, "{3,2,1,0:T(8,128)(2,1)}")
        .check_physical_layout(&l)
        .unwrap_err();
    assert!(e.to_string().contains("T(8,128)"), "{e}");
    let llama = ModelKv::preset("llama-3.1-8b").unwrap();
    let v3 =
        ParallelLayout::new(llama.clone(), ParallelSpec::parse("order=rpa3").unwrap(), 4).unwrap();
    with(&v3, "{4,3,2,1,0}").check_physical_layout(&v3).unwrap();
    assert!(with(&v3, "{2,1,0}").check_physical_layout(&v3).is_err());
    let e =
        ParallelLayout::new(llama, ParallelSpec::parse("order=rpamla").unwrap(), 4).unwrap_err();
    assert!(e.to_string().contains("MLA"), "{e}");
}

// ---------------------------------------------------------------- tiled TPU physical layouts

/// XLA's tiling, restated independently of the code under test: the physical element index of
/// logical index `idx` in a row-major array of `dims` tiled by `tiles` (each tile applied to the
/// minor-most dimensions of the shape the previous one left: the tiled dimensions become the
/// tile counts, followed by the tile's own dimensions; `xla::Layout` tiling semantics).
fn xla_tiled_index(dims: &[u64], idx: &[u64], tiles: &[Vec<u64>]) -> u64 {
    let (mut shape, mut ix) = (dims.to_vec(), idx.to_vec());
    for t in tiles {
        let (n, k) = (shape.len(), t.len());
        let mut s2 = shape[..n - k].to_vec();
        let mut i2 = ix[..n - k].to_vec();
        for i in 0..k {
            s2.push(shape[n - k + i].div_ceil(t[i]));
            i2.push(ix[n - k + i] / t[i]);
        }
        for i in 0..k {
            s2.push(t[i]);
            i2.push(ix[n - k + i] % t[i]);
        }
        (shape, ix) = (s2, i2);
    }
    shape.iter().zip(&ix).fold(0, |acc, (s, i)| acc * s + i)
}

/// A dense row-major buffer of `dims` (elements of `size` bytes) as the tiled layout lays it
/// out in memory (same size: the tiles divide the dims).
fn tile_bytes(
    dense: &[u8],
    dims: &[u64],
    size: usize,
    tiles: &[Vec<u64>],
    untile: bool,
) -> Vec<u8> {
    let mut out = vec![0u8; dense.len()];
    let n: u64 = dims.iter().product();
    let mut idx = vec![0u64; dims.len()];
    for lin in 0..n {
        let mut rem = lin;
        for d in (0..dims.len()).rev() {
            idx[d] = rem % dims[d];
            rem /= dims[d];
        }
        let (a, b) = (
            lin as usize * size,
            xla_tiled_index(dims, &idx, tiles) as usize * size,
        );
        let (from, to) = if untile { (b, a) } else { (a, b) };
        out[to..to + size].copy_from_slice(&dense[from..from + size]);
    }
    out
}

/// RPA v3 caches in a TPU's tiled layout (fp8 `T(4,128)(4,1)`, bf16 `T(2,128)(2,1)`), the same
/// on both sides: plans whose every run is whole packed rows are built, and applying them as
/// raw copies between the tiled images of the `merge_kv` reference buffers gives exactly the
/// tiled image of the destination's reference (TP 2 -> 1, 1 -> 4, 4 -> 2, other block sizes);
/// plans that would cut a packed row (lane padding, an odd head count split inside a row), a
/// tiled side against an unknown or another layout, and tilings that do not keep rows
/// contiguous are refused naming the layout.
#[test]
#[cfg_attr(miri, ignore = "tiles megabytes element by element")]
fn tiled_rpa3_layouts_move_whole_rows_exactly() {
    let tiled = |l: ParallelLayout, p: &str| ParallelLayout {
        physical_layout: Some(p.to_string()),
        ..l
    };
    let cases = [
        (
            DType::Fp8,
            8u32,
            128u32,
            "{4,3,2,1,0:T(4,128)(4,1)}",
            (2, 16),
            (1, 8),
        ),
        (
            DType::Fp8,
            8,
            256,
            "{4,3,2,1,0:T(4,128)(4,1)}",
            (1, 16),
            (4, 32),
        ),
        (
            DType::Bf16,
            4,
            128,
            "{4,3,2,1,0:T(2,128)(2,1)}",
            (4, 8),
            (2, 16),
        ),
    ];
    for (dtype, heads, dim, text, (s_tp, s_bs), (d_tp, d_bs)) in cases {
        let tiles = crate::transfer::XlaLayout::parse(text).unwrap().tiles;
        let m = ModelKv {
            name: "tpu".into(),
            num_layers: 2,
            num_kv_heads: heads,
            head_dim: dim,
            kv_planes: 2,
            dtype,
        };
        let t = 45;
        let o = BlockOrder::Rpa3;
        let src = placement(tiled(layout(&m, s_tp, 1, 1, s_bs, o, t), text), 0, t, 3);
        let dst = placement(tiled(layout(&m, d_tp, 1, 1, d_bs, o, t), text), 0, t, 4);
        let plan = Plan::build(&src, &dst, t).unwrap_or_else(|e| panic!("{text}: {e}"));
        let dims_of = |p: &Placement| -> Vec<u64> {
            let d = p.layout.rank_kv().unwrap().dims();
            d.iter().map(|&x| x as u64).collect()
        };
        let (sdims, ddims) = (dims_of(&src), dims_of(&dst));
        let size = dtype.size() as usize;
        for layer in 0..m.num_layers {
            let from: Vec<Vec<u8>> = rpa3_rank_buffers(&src, layer, t)
                .iter()
                .map(|b| tile_bytes(b, &sdims, size, &tiles, false))
                .collect();
            let want = rpa3_rank_buffers(&dst, layer, t);
            assert!(
                tile_bytes(&want[0], &ddims, size, &tiles, false) != want[0],
                "{text}: the tiling must permute the bytes"
            );
            let mut got: Vec<Vec<u8>> = want.iter().map(|b| vec![0u8; b.len()]).collect();
            apply_layer(&plan, layer, &from, &mut got);
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                let dense = tile_bytes(g, &ddims, size, &tiles, true);
                assert!(
                    &dense == w,
                    "{text} {dtype:?}: layer {layer} rank {r} differs"
                );
            }
        }
        // The same destination with no tiling named: refused (whole rows of a tiled source
        // into a buffer of unknown layout).
        let plain = Placement {
            layout: ParallelLayout {
                physical_layout: None,
                ..dst.layout.clone()
            },
            ..dst.clone()
        };
        let e = Plan::build(&src, &plain, t).unwrap_err().to_string();
        assert!(e.contains(text) && e.contains("unknown"), "{e}");
    }
    let fp8 = "{4,3,2,1,0:T(4,128)(4,1)}";
    let refused = |heads: u32, dim: u32, s_tp: u32, d_tp: u32, text: &str, dtype: DType| {
        let m = ModelKv {
            name: "tpu".into(),
            num_layers: 1,
            num_kv_heads: heads,
            head_dim: dim,
            kv_planes: 2,
            dtype,
        };
        let o = BlockOrder::Rpa3;
        let src = placement(tiled(layout(&m, s_tp, 1, 1, 16, o, 40), text), 0, 40, 5);
        let dst = placement(tiled(layout(&m, d_tp, 1, 1, 16, o, 40), text), 0, 40, 6);
        let e = Plan::build(&src, &dst, 40).unwrap_err();
        assert!(matches!(e, Error::Mismatch(_)), "{e}");
        e.to_string()
    };
    // Lane padding: head_dim 80 in 128 lanes (each row's real lanes are a part of it).
    let e = refused(8, 80, 2, 1, fp8, DType::Fp8);
    assert!(
        e.contains(fp8) && e.contains("cuts") && e.contains("head_dim 80"),
        "{e}"
    );
    // 6 heads over TP=2: 3 per rank, 6 slots in rows of 4: the second row half real.
    let e = refused(6, 128, 2, 1, fp8, DType::Fp8);
    assert!(e.contains("cuts") && e.contains("3 heads per rank"), "{e}");
    // A tile taller than the packing (bf16 P = 2 under T(8,128)): rows padded, not mapped.
    let e = refused(4, 128, 1, 1, "{4,3,2,1,0:T(8,128)(2,1)}", DType::Bf16);
    assert!(e.contains("T(8,128)") && e.contains("neither"), "{e}");
    // A tile over three dimensions spans several rows.
    let e = refused(8, 128, 1, 1, "{4,3,2,1,0:T(2,4,128)}", DType::Fp8);
    assert!(e.contains("T(2,4,128)"), "{e}");
    // Another order naming the same tiling (its runs are planned at NHD offsets): refused.
    let m = ModelKv {
        name: "tpu".into(),
        num_layers: 1,
        num_kv_heads: 8,
        head_dim: 128,
        kv_planes: 2,
        dtype: DType::Fp8,
    };
    let src = placement(
        tiled(layout(&m, 1, 1, 1, 16, BlockOrder::Nhd, 40), fp8),
        0,
        40,
        7,
    );
    let dst = placement(
        tiled(layout(&m, 1, 1, 1, 16, BlockOrder::Rpa3, 40), fp8),
        0,
        40,
        8,
    );
    let e = Plan::build(&src, &dst, 40).unwrap_err().to_string();
    assert!(e.contains(fp8) && e.contains("nhd"), "{e}");
}

/// [`crate::transfer::rows_stay_contiguous`] against the restated XLA tiling: for every layout
/// it accepts, each row of the last two dimensions maps onto one contiguous run of the tiled
/// buffer (and the tiled buffer is the dense size); the tilings that pad or mix rows are
/// refused.
#[test]
fn rows_stay_contiguous_agrees_with_xla_tiling() {
    let dims_list: [[u64; 5]; 3] = [[2, 2, 2, 4, 256], [2, 3, 1, 2, 128], [1, 2, 2, 1, 384]];
    let tilings = [
        "{4,3,2,1,0}",
        "{4,3,2,1,0:T(4,128)(4,1)}",
        "{4,3,2,1,0:T(2,128)(2,1)}",
        "{4,3,2,1,0:T(1,128)}",
        "{4,3,2,1,0:T(128)}",
        "{4,3,2,1,0:T(128)(4,1)}",
        "{4,3,2,1,0:T(256)(4,1)}",
        "{4,3,2,1,0:T(4,128)(64)(4,1)}",
        "{4,3,2,1,0:T(4,128)(128)(4,1)}",
        "{4,3,2,1,0:T(2,64)(2,1)}",
        "{4,3,2,1,0:T(8,128)(2,1)}",
        "{4,3,2,1,0:T(2,4,128)}",
    ];
    let mut accepted = 0;
    for dims in &dims_list {
        let idims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        for text in tilings {
            if !crate::transfer::rows_stay_contiguous(text, &idims) {
                continue;
            }
            accepted += 1;
            let tiles = crate::transfer::XlaLayout::parse(text).unwrap().tiles;
            let row = dims[3] * dims[4];
            let total: u64 = dims.iter().product();
            for r in 0..total / row {
                let (mut lo, mut hi) = (u64::MAX, 0);
                for e in 0..row {
                    let lin = r * row + e;
                    let idx = [
                        lin / (dims[1] * dims[2] * row),
                        lin / (dims[2] * row) % dims[1],
                        lin / row % dims[2],
                        e / dims[4],
                        e % dims[4],
                    ];
                    let at = xla_tiled_index(dims, &idx, &tiles);
                    assert!(at < total, "{text} {dims:?}: padded");
                    (lo, hi) = (lo.min(at), hi.max(at));
                }
                assert_eq!(
                    (lo, hi),
                    (r * row, r * row + row - 1),
                    "{text} {dims:?}: row {r}"
                );
            }
        }
    }
    assert!(accepted >= 8, "{accepted}");
    for text in ["{4,3,2,1,0:T(128)(4,1)}", "{4,3,2,1,0:T(4,128)(64)(4,1)}"] {
        assert!(
            !crate::transfer::rows_stay_contiguous(text, &[2, 2, 2, 4, 256]),
            "{text}"
        );
    }
}
