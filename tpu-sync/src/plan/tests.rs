//! Property tests of the planner: simulate both sides' buffers in memory, apply the plan, and
//! check every destination byte.

use super::*;
use crate::layout::{BlockOrder, DType, ModelKv, ParallelSpec};
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
    let s = layout.spec;
    let block_ids = (0..s.ranks_per_replica())
        .map(|local| {
            let pcp = local / s.tp;
            let n = layout.pcp_chunk(num_tokens, pcp).unwrap().len();
            scattered(layout.num_blocks, n, seed ^ local as u64)
        })
        .collect();
    Placement {
        layout,
        dp_rank,
        block_ids,
        groups: None,
    }
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
    let expect = dst.layout.covered_tokens(num_tokens).unwrap() as u64 * model.bytes_per_token();
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
        layout: ParallelLayout {
            physical_layout: l.map(str::to_string),
            ..p.layout.clone()
        },
        ..p.clone()
    };
    // Equal, or unknown on either side (an older peer): planned.
    assert!(Plan::build(&with(&src, Some(dense)), &with(&dst, Some(dense)), t).is_ok());
    assert!(Plan::build(&with(&src, None), &with(&dst, Some(tiled)), t).is_ok());
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
