//! Property tests of the group planner: simulate both sides' buffers of every cache layer in
//! memory, apply the plan, and check every destination byte, group by group.

use super::*;
use crate::layout::{
    BlockOrder, DType, GroupKind, GroupLayout, HybridModel, KvGroup, ModelKv, ParallelLayout,
    ParallelSpec, StateComponent,
};
use crate::pattern::GroupedContents;
use crate::plan::spans_digest;
use proptest::prelude::*;

/// Scattered, distinct ids: a deterministic shuffle of 0..n, truncated to `take`.
fn scattered(n: u32, take: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..n).collect();
    for i in (1..ids.len()).rev() {
        let j = (crate::pattern::mix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(take);
    ids
}

/// `ParallelLayout::pcp_chunk` through the one-group layout (whose geometry functions return
/// `Result` whichever form the uniform layout's have).
fn uniform_chunk(l: &ParallelLayout, tokens: u32, pcp: u32) -> std::ops::Range<u32> {
    HybridLayout::from_uniform(l)
        .pcp_chunk(0, tokens, pcp)
        .unwrap()
}

/// A placement of a `tokens`-token request at scattered block ids on DP replica `dp_rank`.
pub(crate) fn hybrid_placement(
    layout: HybridLayout,
    dp_rank: u32,
    tokens: u32,
    seed: u64,
) -> HybridPlacement {
    placement_from(layout, dp_rank, tokens, seed, 0)
}

/// A placement of tokens `first_token..tokens` of a request (a destination with a prefix hit of
/// `first_token` tokens) at scattered block ids on DP replica `dp_rank`.
fn placement_from(
    layout: HybridLayout,
    dp_rank: u32,
    tokens: u32,
    seed: u64,
    first_token: u32,
) -> HybridPlacement {
    placement_next(layout, dp_rank, tokens, seed, first_token, None)
}

/// [`placement_from`] of a side that computes from token `next_token` after the transfer.
fn placement_next(
    layout: HybridLayout,
    dp_rank: u32,
    tokens: u32,
    seed: u64,
    first_token: u32,
    next_token: Option<u32>,
) -> HybridPlacement {
    let s = layout.spec;
    let mut p = HybridPlacement {
        layout,
        dp_rank,
        block_ids: vec![],
        first_token,
        next_token,
    };
    p.block_ids = (0..p.layout.groups.len())
        .map(|g| {
            (0..s.ranks_per_replica())
                .map(|local| {
                    let n = p.listed_blocks(g, tokens, local / s.tp).unwrap().len();
                    let salt = seed ^ ((g as u64) << 40) ^ local as u64;
                    scattered(p.layout.groups[g].num_blocks, n, salt)
                })
                .collect()
        })
        .collect();
    p
}

/// The least common multiple of the block sizes of `l`'s paged groups (1 without any): the
/// alignment of a grouped placement's `first_token`.
fn paged_block_lcm(l: &HybridLayout) -> u32 {
    let gcd = |mut a: u32, mut b: u32| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (0..l.groups.len())
        .filter(|&g| !l.model.groups[g].kind.is_state())
        .map(|g| l.block_size(g).unwrap())
        .fold(1, |a, b| a / gcd(a, b) * b)
}

/// Applies `plan` to simulated buffers of every layer and checks each destination byte: request
/// elements arrive, each destination byte is written at most once, nothing outside the request
/// changes, and per group the plan's bytes equal the bytes verified and
/// [`HybridPlacement::needed_bytes`] (moved / needed = 1.00).
fn simulate(src: &HybridPlacement, dst: &HybridPlacement, tokens: u32, plan: &Plan) {
    let layers = src.layout.num_layers();
    let src_bufs: Vec<Vec<Vec<u8>>> = (0..src.layout.num_ranks())
        .map(|r| {
            let c = GroupedContents::new(src, r, tokens, 1)
                .unwrap()
                .whole_blocks();
            (0..layers)
                .map(|l| {
                    let mut b = vec![0u8; c.layer_bytes(l).unwrap() as usize];
                    c.fill_layer(l, &mut b).unwrap();
                    b
                })
                .collect()
        })
        .collect();
    let empty = HybridPlacement {
        block_ids: vec![],
        first_token: 0,
        next_token: None,
        dp_rank: u32::MAX,
        ..dst.clone()
    };
    let mut dst_bufs: Vec<Vec<Vec<u8>>> = (0..dst.layout.num_ranks())
        .map(|r| {
            let c = GroupedContents::new(&empty, r, tokens, 2).unwrap();
            (0..layers)
                .map(|l| {
                    let mut b = vec![0u8; c.layer_bytes(l).unwrap() as usize];
                    c.fill_layer(l, &mut b).unwrap();
                    b
                })
                .collect()
        })
        .collect();
    let mut writes: Vec<Vec<Vec<u8>>> = dst_bufs
        .iter()
        .map(|r| r.iter().map(|b| vec![0u8; b.len()]).collect())
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
    let map = dst.layout.model.layer_map();
    let mut verified = vec![0u64; dst.layout.groups.len()];
    for r in 0..dst.layout.num_ranks() {
        let c = GroupedContents::new(dst, r, tokens, 2).unwrap();
        for l in 0..layers {
            let chk = c
                .verify_layer(l, &dst_bufs[r as usize][l as usize])
                .unwrap();
            assert_eq!(chk.mismatches, 0, "first: {:?}", chk.first_mismatch);
            verified[map[l as usize].0 as usize] += chk.request_bytes;
            let w = &writes[r as usize][l as usize];
            assert!(w.iter().all(|&x| x <= 1), "a byte was written twice");
            let written: u64 = w.iter().map(|&x| x as u64).sum();
            assert_eq!(
                written, chk.request_bytes,
                "rank {r} layer {l}: written != request"
            );
        }
    }
    let moved = plan.group_bytes(&dst.layout);
    let needed = dst.needed_bytes(tokens).unwrap();
    assert_eq!(moved, needed, "bytes moved per group != bytes needed");
    assert_eq!(verified, needed, "bytes verified per group != bytes needed");
    assert_eq!(plan.total_bytes(), needed.iter().sum::<u64>());
}

fn attn(heads: u32, dim: u32, planes: u32, dtype: DType, window: Option<u32>) -> GroupKind {
    GroupKind::Attention {
        num_kv_heads: heads,
        head_dim: dim,
        kv_planes: planes,
        dtype,
        sliding_window: window,
    }
}

/// A small linear-attention state: a conv component of 3 rows split over q/k/v-like segments and
/// a recurrent component.
fn small_state(heads: u32, replicated: bool) -> GroupKind {
    GroupKind::State {
        components: vec![
            StateComponent::new(
                "conv",
                DType::Bf16,
                3,
                &[(heads, 2), (heads, 2), (heads * 2, 2)],
            ),
            StateComponent::new("ssm", DType::F32, 1, &[(heads * 2, 3)]),
        ],
        replicated,
    }
}

/// A small model in the shape of a hybrid preset, with few layers and tiny heads.
fn small_model(name: &str) -> HybridModel {
    let groups = match name {
        // Gated DeltaNet-style: 3 linear : 1 full.
        "qwen3-next" => vec![
            KvGroup::new("full", [3, 7], attn(2, 4, 2, DType::Bf16, None)),
            KvGroup::new("linear", [0, 1, 2, 4, 5, 6], small_state(2, false)),
        ],
        // Alternating sliding window.
        "gpt-oss" => vec![
            KvGroup::new("full", [1, 3], attn(8, 2, 2, DType::Bf16, None)),
            KvGroup::new("sliding", [0, 2], attn(8, 2, 2, DType::Bf16, Some(12))),
        ],
        // 5 local : 1 global.
        "gemma-3" => vec![
            KvGroup::new("global", [5], attn(4, 4, 2, DType::Bf16, None)),
            KvGroup::new("local", 0..5, attn(4, 4, 2, DType::Bf16, Some(20))),
        ],
        // MLA + indexer.
        "deepseek-v3.2" => vec![
            KvGroup::new(
                "mla",
                0..3,
                GroupKind::Mla {
                    head_dim: 9,
                    dtype: DType::Bf16,
                },
            ),
            KvGroup::new(
                "indexer",
                3..6,
                GroupKind::Indexer {
                    head_dim: 8,
                    dtype: DType::Fp8,
                    scale_bytes: 4,
                },
            ),
        ],
        other => panic!("no small model {other}"),
    };
    let m = HybridModel {
        name: name.into(),
        groups,
    };
    m.validate().unwrap();
    m
}

/// A layout with per-group block counts: room for the request plus spares, and a different
/// count per group so that layers of different groups have differently sized buffers.
fn hlayout(m: &HybridModel, spec: ParallelSpec, block_sizes: &[u32], tokens: u32) -> HybridLayout {
    let groups = m
        .groups
        .iter()
        .enumerate()
        .map(|(g, grp)| {
            let bs = block_sizes[g % block_sizes.len()];
            let n = if grp.kind.is_state() {
                1
            } else {
                tokens.div_ceil(bs)
            };
            let mut gl = GroupLayout::new(n * 2 + 3 + g as u32);
            if !grp.kind.is_state() {
                gl = gl.with_block_size(bs);
            }
            gl
        })
        .collect();
    HybridLayout::new(m.clone(), spec, groups).unwrap()
}

fn spec(tp: u32, pcp: u32, dp: u32, order: BlockOrder) -> ParallelSpec {
    ParallelSpec {
        tp,
        pcp,
        dp,
        block_size: 16,
        order,
    }
}

#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn each_small_preset_reshards_byte_exact() {
    let t = 57;
    for name in ["qwen3-next", "gpt-oss", "gemma-3", "deepseek-v3.2"] {
        let m = small_model(name);
        // Prefill TP=2 x PCP=2, NHD, 8-token blocks; decode TP=1 x DP=2 on replica 1, HND,
        // 4- and 16-token blocks.
        let src = hybrid_placement(
            hlayout(&m, spec(2, 2, 1, BlockOrder::Nhd), &[8], t),
            0,
            t,
            11,
        );
        let dst = hybrid_placement(
            hlayout(&m, spec(1, 1, 2, BlockOrder::Hnd), &[4, 16], t),
            1,
            t,
            12,
        );
        let plan = Plan::build_groups(&src, &dst, t).unwrap();
        simulate(&src, &dst, t, &plan);
        // And back, with the roles of the layouts swapped (TP 1 -> 2 splits heads and states).
        let back = Plan::build_groups(&dst, &src, t).unwrap();
        simulate(&dst, &src, t, &back);
    }
}

#[test]
fn sliding_window_moves_only_the_window() {
    let m = small_model("gpt-oss");
    let t = 40; // window 12: tokens 29..40 are needed; at block 4: blocks 7..10
    let l = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[4], t);
    assert_eq!(l.needed_tokens(1, t).unwrap(), 29..40);
    assert_eq!(l.window_blocks(1, t).unwrap(), 7..10);
    assert_eq!(l.window_blocks(0, t).unwrap(), 0..10);
    let src = hybrid_placement(l.clone(), 0, t, 1);
    assert_eq!(src.block_ids[1][0].len(), 3);
    assert_eq!(src.block_ids[0][0].len(), 10);
    let dst = hybrid_placement(l, 0, t, 2);
    let plan = Plan::build_groups(&src, &dst, t).unwrap();
    let per = plan.group_bytes(&dst.layout);
    // Full group: 40 tokens x 8 heads x 2 dims x bf16 x 2 planes x 2 layers; sliding: 11 tokens.
    assert_eq!(per, vec![40 * 8 * 2 * 2 * 2 * 2, 11 * 8 * 2 * 2 * 2 * 2]);
    simulate(&src, &dst, t, &plan);
    // A prompt shorter than the window keeps every token.
    let short = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[4], 5);
    assert_eq!(short.needed_tokens(1, 5).unwrap(), 0..5);
}

/// A destination with a prefix-cache hit (`first_token`) lists only its blocks from the hit on
/// and receives exactly the tokens after it: the full-attention group all of them, the
/// sliding-window group those of its window after the hit, the state group its whole slot; the
/// blocks of the hit are never written (the simulation checks every byte outside the listed
/// blocks unchanged).
#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn a_prefix_hit_receives_only_the_tokens_after_it() {
    let m = small_model("gpt-oss");
    let t = 40; // window 12: tokens 29..40 needed, blocks 7..10 at block size 4
    let l = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[4], t);
    let src = hybrid_placement(l.clone(), 0, t, 1);
    let per_token = 8 * 2 * 2 * 2 * 2; // 8 heads x 2 dims x bf16 x 2 planes x 2 layers
    for (first, full, sliding, listed) in [
        (0, 40, 11, [10, 3]),
        (8, 32, 11, [8, 3]), // a hit before the window: the whole window still arrives
        (32, 8, 8, [2, 2]),  // a hit inside the window: tokens 32..40 of both groups
        (36, 4, 4, [1, 1]),  // the last block only
    ] {
        let dst = placement_from(l.clone(), 0, t, 2, first);
        assert_eq!(
            [dst.block_ids[0][0].len(), dst.block_ids[1][0].len()],
            listed
        );
        let plan = Plan::build_groups(&src, &dst, t).unwrap();
        assert_eq!(
            plan.group_bytes(&dst.layout),
            vec![full * per_token, sliding * per_token],
            "first_token {first}"
        );
        simulate(&src, &dst, t, &plan);
        // Through the carrier form too, as the pipeline and the C ABI see it, and its JSON.
        let (ps, pd) = (
            Placement::from_groups(src.clone()).unwrap(),
            Placement::from_groups(dst.clone()).unwrap(),
        );
        assert_eq!(pd.first_token, first);
        assert_eq!(Plan::build(&ps, &pd, t).unwrap(), plan);
        let json = serde_json::to_value(&pd).unwrap();
        assert_eq!(json["groups"].get("first_token").is_some(), first != 0);
        let back = Placement::try_from(json).unwrap();
        assert_eq!(back, pd);
        let grouped_form = serde_json::to_value(&dst).unwrap();
        assert_eq!(Placement::try_from(grouped_form).unwrap(), pd);
    }
    // A state group moves its whole slot whatever the hit.
    let q = small_model("qwen3-next");
    let ql = hlayout(&q, spec(2, 1, 1, BlockOrder::Nhd), &[4], t);
    let qs = hybrid_placement(ql.clone(), 0, t, 3);
    let whole = Plan::build_groups(&qs, &hybrid_placement(ql.clone(), 0, t, 4), t).unwrap();
    let qd = placement_from(ql, 0, t, 4, 24);
    let plan = Plan::build_groups(&qs, &qd, t).unwrap();
    let (a, b) = (plan.group_bytes(&qd.layout), whole.group_bytes(&qd.layout));
    assert_eq!(a[1], b[1], "the state slot moves whole");
    assert_eq!(a[0] * 40, b[0] * 16, "16 of 40 tokens of the full group");
    simulate(&qs, &qd, t, &plan);
}

/// A destination that recomputes the last token (`next_token = num_tokens - 1`, vLLM after a
/// whole-prompt load) needs the token its window reads besides the next token's: moved when the
/// source's blocks hold it (it shares a block with the next token's first window token),
/// refused by name when the source freed it (the block before them); a layer-wise consumer
/// computing from an earlier token needs that token's whole window.
#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn a_recomputed_tokens_window_is_moved_or_refused() {
    let m = small_model("gpt-oss"); // sliding window 12 on layers 0 and 2
    let per_token = 8 * 2 * 2 * 2 * 2;
    // 40 tokens at block 4: the next token's window [29, 40) and token 39's [28, 40) are both
    // in blocks 7..10.
    let l = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[4], 40);
    let src = hybrid_placement(l.clone(), 0, 40, 1);
    let dst = placement_next(l.clone(), 0, 40, 2, 0, Some(39));
    assert_eq!(dst.needed_tokens(1, 40).unwrap(), 28..40);
    assert_eq!(dst.block_ids[1][0].len(), 3);
    let plan = Plan::build_groups(&src, &dst, 40).unwrap();
    assert_eq!(
        plan.group_bytes(&dst.layout),
        vec![40 * per_token, 12 * per_token]
    );
    simulate(&src, &dst, 40, &plan);
    // 43 tokens: the next token's window starts at 32 (block 8), token 42's at 31, in the block
    // before, which the source does not hold.
    let l = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[4], 43);
    let src = hybrid_placement(l.clone(), 0, 43, 1);
    let dst = placement_next(l.clone(), 0, 43, 2, 0, Some(42));
    assert_eq!(dst.block_ids[1][0].len(), 4);
    let e = Plan::build_groups(&src, &dst, 43).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
    assert!(
        e.to_string().contains("reads tokens from 31") && e.to_string().contains("from 32"),
        "{e}"
    );
    // A layer-wise consumer computing from token 36 of 43 (after a prefix hit of 8) reads
    // [25, 43): the source's blocks hold them from 32 only.
    let dst = placement_next(l.clone(), 0, 43, 2, 8, Some(36));
    assert!(Plan::build_groups(&src, &dst, 43).is_err());
    // ... from a source that itself computed only up to token 36 and holds its window.
    let wide = placement_next(l.clone(), 0, 43, 1, 0, Some(36));
    let plan = Plan::build_groups(&wide, &dst, 43).unwrap();
    simulate(&wide, &dst, 43, &plan);
    // A window of one token: the source of 2 tokens needs and holds none, a destination
    // recomputing token 1 reads token 1: refused, not planned from blocks the source lacks.
    let one = HybridModel {
        name: "w1".into(),
        groups: vec![KvGroup::new("g0", [0], attn(1, 1, 1, DType::Bf16, Some(1)))],
    };
    let src1 = hybrid_placement(
        hlayout(&one, spec(1, 1, 1, BlockOrder::Nhd), &[3], 2),
        0,
        2,
        0,
    );
    assert!(src1.block_ids[0][0].is_empty());
    let dst1 = placement_next(
        hlayout(&one, spec(1, 1, 1, BlockOrder::Nhd), &[1], 2),
        0,
        2,
        1,
        0,
        Some(1),
    );
    let e = Plan::build_groups(&src1, &dst1, 2).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch, "{e}");
    let mut past = dst.clone();
    past.next_token = Some(44);
    assert!(past
        .validate(43)
        .unwrap_err()
        .to_string()
        .contains("next_token 44"));
}

/// Token ranges that cannot be planned are refused with the reason: a first token not aligned
/// to every paged group's block size or not below the request, ids listed for the blocks of
/// the hit, a source that starts after its destination, a carrier that disagrees.
#[test]
fn bad_grouped_token_ranges_are_refused() {
    let m = small_model("gpt-oss");
    let t = 40;
    let l = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[4, 8], t);
    assert_eq!(paged_block_lcm(&l), 8);
    let good = placement_from(l.clone(), 0, t, 1, 16);
    good.validate(t).unwrap();
    let msg = |p: &HybridPlacement| p.validate(t).unwrap_err().to_string();
    let mut unaligned = good.clone();
    unaligned.first_token = 12; // a multiple of 4 (group full), not of 8 (group sliding)
    assert!(
        msg(&unaligned).contains("block size 8") && msg(&unaligned).contains("sliding"),
        "{}",
        msg(&unaligned)
    );
    let mut past = good.clone();
    past.first_token = 40;
    assert!(
        msg(&past).contains("below the request's 40 tokens"),
        "{}",
        msg(&past)
    );
    // The ids of the whole request with a first_token: too many for the full group.
    let mut whole = hybrid_placement(l.clone(), 0, t, 1);
    whole.first_token = 16;
    assert!(
        msg(&whole).contains("from token 16 need 6"),
        "{}",
        msg(&whole)
    );
    // A source holding less than the destination wants.
    let src = placement_from(l.clone(), 0, t, 2, 24);
    let e = Plan::build_groups(&src, &good, t).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
    assert!(
        e.to_string()
            .contains("from 16, the source holds them from 24"),
        "{e}"
    );
    // A carrier whose first_token disagrees with its groups'.
    let mut carrier = Placement::from_groups(good.clone()).unwrap();
    carrier.first_token = 0;
    let e = carrier.validate(t).unwrap_err().to_string();
    assert!(e.contains("first token 16"), "{e}");
}

#[test]
fn uniform_placement_is_one_group_with_the_same_plan() {
    let m = ModelKv::preset("llama-3.1-8b").unwrap();
    let m = ModelKv { num_layers: 3, ..m };
    let t = 100;
    let mk = |tp, pcp, dp, bs, order| {
        let spec = ParallelSpec {
            tp,
            pcp,
            dp,
            block_size: bs,
            order,
        };
        let mut l = ParallelLayout::new(m.clone(), spec, 1).unwrap();
        l.num_blocks = uniform_chunk(&l, t, 0).len() as u32 * 2 + 3;
        l
    };
    let place = |l: ParallelLayout, dp_rank: u32, seed: u64| {
        let block_ids = (0..l.spec.ranks_per_replica())
            .map(|local| {
                let n = uniform_chunk(&l, t, local / l.spec.tp).len();
                scattered(l.num_blocks, n, seed ^ local as u64)
            })
            .collect();
        crate::plan::Placement {
            first_token: 0,
            layout: l,
            dp_rank,
            block_ids,
            groups: None,
        }
    };
    let src = place(mk(2, 2, 1, 16, BlockOrder::Nhd), 0, 3);
    let dst = place(mk(1, 1, 2, 4, BlockOrder::Hnd), 1, 4);
    let a = Plan::build(&src, &dst, t).unwrap();
    let (hs, hd) = (
        HybridPlacement::from_uniform(&src),
        HybridPlacement::from_uniform(&dst),
    );
    let b = Plan::build_groups(&hs, &hd, t).unwrap();
    assert_eq!(a, b);
    assert_eq!(hs.block_ranges(1).unwrap(), src.block_ranges(1));
    assert_eq!(hd.needed_bytes(t).unwrap(), vec![a.total_bytes()]);
}

#[test]
fn mismatched_groups_are_refused_before_planning() {
    let t = 30;
    let base = small_model("qwen3-next");
    let sp = spec(1, 1, 1, BlockOrder::Nhd);
    let src = hybrid_placement(hlayout(&base, sp, &[4], t), 0, t, 1);
    let refuse = |m: HybridModel| {
        let dst = hybrid_placement(hlayout(&m, sp, &[4], t), 0, t, 2);
        let e = Plan::build_groups(&src, &dst, t).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Mismatch, "{e}");
        let e2 = Plan::build_groups(&dst, &src, t).unwrap_err();
        assert_eq!(e2.kind(), crate::ErrorKind::Mismatch, "{e2}");
        e.to_string()
    };
    // A group missing: the state group's layers folded into attention.
    let mut missing = base.clone();
    missing.groups.truncate(1);
    missing.groups[0].layers = (0..8).collect();
    let msg = refuse(missing);
    assert!(msg.contains("2 groups") && msg.contains("has 1 ("), "{msg}");
    // A different state shape.
    let mut shape = base.clone();
    if let GroupKind::State { components, .. } = &mut shape.groups[1].kind {
        components[1].segments[0].head_elems = 4;
    }
    let msg = refuse(shape);
    assert!(
        msg.contains("state shapes differ") && msg.contains("linear"),
        "{msg}"
    );
    // A state replicated on one side and split on the other.
    let mut repl = base.clone();
    repl.groups[1].kind = small_state(2, true);
    refuse(repl);
    // A different window.
    let g = small_model("gpt-oss");
    let src = hybrid_placement(hlayout(&g, sp, &[4], t), 0, t, 1);
    let mut w = g.clone();
    w.groups[1].kind = attn(8, 2, 2, DType::Bf16, Some(16));
    let dst = hybrid_placement(hlayout(&w, sp, &[4], t), 0, t, 2);
    let e = Plan::build_groups(&src, &dst, t).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
    let msg = e.to_string();
    assert!(
        msg.contains("sliding window") && msg.contains("12") && msg.contains("16"),
        "{msg}"
    );
    // Other layers in a group.
    let mut moved = g.clone();
    moved.groups[0].layers = vec![0, 3];
    moved.groups[1].layers = vec![1, 2];
    let dst = hybrid_placement(hlayout(&moved, sp, &[4], t), 0, t, 2);
    let e = Plan::build_groups(&src, &dst, t).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
    // Another physical layout for one group's buffers.
    let mut phys = hybrid_placement(hlayout(&g, sp, &[4], t), 0, t, 2);
    phys.layout.groups[1].physical_layout = Some("{4,3,2,1,0:T(8,128)}".into());
    let mut src2 = src.clone();
    src2.layout.groups[1].physical_layout = Some("{4,3,2,1,0}".into());
    let e = Plan::build_groups(&src2, &phys, t).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
    assert!(e.to_string().contains("group 1"), "{e}");
}

#[test]
fn bad_group_placements_are_refused() {
    let t = 30;
    let m = small_model("qwen3-next");
    let l = hlayout(&m, spec(2, 1, 1, BlockOrder::Nhd), &[4], t);
    let good = hybrid_placement(l.clone(), 0, t, 1);
    good.validate(t).unwrap();
    let kind = |p: &HybridPlacement| p.validate(t).unwrap_err().kind();
    let mut two_slots = good.clone();
    two_slots.block_ids[1][0].push(0);
    assert_eq!(kind(&two_slots), crate::ErrorKind::BlockRange);
    let msg = two_slots.validate(t).unwrap_err().to_string();
    assert!(
        msg.contains("exactly one") && msg.contains("linear"),
        "{msg}"
    );
    let mut slot_range = good.clone();
    slot_range.block_ids[1][1][0] = l.groups[1].num_blocks;
    assert_eq!(kind(&slot_range), crate::ErrorKind::BlockRange);
    let mut missing_group = good.clone();
    missing_group.block_ids.pop();
    assert_eq!(kind(&missing_group), crate::ErrorKind::BlockRange);
    let mut dup = good.clone();
    dup.block_ids[0][0][1] = dup.block_ids[0][0][0];
    assert_eq!(kind(&dup), crate::ErrorKind::BlockRange);
    // A sliding-window group lists only its window.
    let g = small_model("gpt-oss");
    let gl = hlayout(&g, spec(1, 1, 1, BlockOrder::Nhd), &[4], 60);
    let mut all = hybrid_placement(gl.clone(), 0, 60, 1);
    all.block_ids[1][0] = scattered(gl.groups[1].num_blocks, 15, 3);
    let msg = all.validate(60).unwrap_err().to_string();
    assert!(msg.contains("need 3"), "{msg}");
    assert!(good.validate(0).is_err());
}

#[test]
fn json_round_trips_and_refuses_unknown_keys() {
    let t = 20;
    let m = small_model("deepseek-v3.2");
    let p = hybrid_placement(
        hlayout(&m, spec(2, 1, 1, BlockOrder::Nhd), &[8], t),
        0,
        t,
        5,
    );
    let json = serde_json::to_string(&p).unwrap();
    let back: HybridPlacement = serde_json::from_str(&json).unwrap();
    assert_eq!(back, p);
    let bad = json.replacen("\"dp_rank\"", "\"dp_rnk\"", 1);
    assert!(serde_json::from_str::<HybridPlacement>(&bad).is_err());
    let bad = json.replacen("\"scale_bytes\"", "\"scale_bytes\":4,\"extra\"", 1);
    assert!(
        serde_json::from_str::<HybridPlacement>(&bad).is_err(),
        "{bad}"
    );
}

#[test]
fn presets_plan_exactly_their_needed_bytes() {
    // Real preset geometry (no byte simulation): moved == needed for each group, resharded.
    let t = 300;
    for name in crate::layout::HYBRID_PRESETS {
        let m = HybridModel::preset(name).unwrap();
        let src = hybrid_placement(
            hlayout(&m, spec(2, 2, 1, BlockOrder::Nhd), &[64], t),
            0,
            t,
            1,
        );
        let dst = hybrid_placement(
            hlayout(&m, spec(1, 1, 2, BlockOrder::Hnd), &[16], t),
            1,
            t,
            2,
        );
        let plan = Plan::build_groups(&src, &dst, t).unwrap();
        let moved = plan.group_bytes(&dst.layout);
        assert_eq!(moved, dst.needed_bytes(t).unwrap(), "{name}");
        assert!(moved.iter().all(|&b| b > 0), "{name}: {moved:?}");
        // Both sides compute the same plan (the digest the handshake compares).
        let again = Plan::build_groups(&src, &dst, t).unwrap();
        assert_eq!(spans_digest(&plan.spans), spans_digest(&again.spans));
    }
    // Qwen3-Next's state per layer and rank: conv 3 x 8192 + ssm 32 x 128 x 128, bf16.
    let m = HybridModel::preset("qwen3-next-80b").unwrap();
    let l = hlayout(&m, spec(1, 1, 1, BlockOrder::Nhd), &[16], t);
    let p = hybrid_placement(l, 0, t, 1);
    assert_eq!(
        p.needed_bytes(t).unwrap()[1],
        36 * (3 * 8192 * 2 + 32 * 128 * 128 * 2)
    );
}

/// One random group: kind, heads and sizes kept small.
fn arb_kind() -> impl Strategy<Value = GroupKind> {
    let heads = proptest::sample::select(vec![1u32, 2, 4, 8]);
    let dtype = prop_oneof![Just(DType::Bf16), Just(DType::F32), Just(DType::Fp8)];
    prop_oneof![
        (
            heads.clone(),
            1u32..4,
            1u32..=2,
            dtype.clone(),
            proptest::option::of(1u32..40)
        )
            .prop_map(|(h, d, p, t, w)| attn(h, d, p, t, w)),
        (1u32..6, dtype.clone()).prop_map(|(d, t)| GroupKind::Mla {
            head_dim: d,
            dtype: t
        }),
        (1u32..6, dtype.clone(), 0u32..5).prop_map(|(d, t, s)| GroupKind::Indexer {
            head_dim: d,
            dtype: t,
            scale_bytes: s,
        }),
        (
            proptest::collection::vec(
                (
                    dtype,
                    1u32..3,
                    proptest::collection::vec((heads.clone(), 1u32..4), 1..3)
                ),
                1..3
            ),
            any::<bool>()
        )
            .prop_map(|(comps, replicated)| GroupKind::State {
                components: comps
                    .into_iter()
                    .map(|(t, rows, segs)| StateComponent::new("c", t, rows, &segs))
                    .collect(),
                replicated,
            }),
    ]
}

/// A random model: 1..=4 groups over a shuffled set of layers.
fn arb_model() -> impl Strategy<Value = HybridModel> {
    (
        proptest::collection::vec((arb_kind(), 1usize..3), 1..=4),
        any::<u64>(),
    )
        .prop_map(|(groups, seed)| {
            let n: usize = groups.iter().map(|g| g.1).sum();
            let order = scattered(n as u32, n, seed);
            let mut at = 0;
            let groups = groups
                .into_iter()
                .enumerate()
                .map(|(i, (kind, k))| {
                    let mut layers = order[at..at + k].to_vec();
                    layers.sort_unstable();
                    at += k;
                    KvGroup::new(&format!("g{i}"), layers, kind)
                })
                .collect();
            HybridModel {
                name: "random".into(),
                groups,
            }
        })
}

/// One side: TP, PCP, DP, default order, per-group block sizes.
fn arb_side() -> impl Strategy<Value = (u32, u32, u32, BlockOrder, Vec<u32>)> {
    (
        proptest::sample::select(vec![1u32, 2, 4]),
        1u32..=3,
        1u32..=2,
        prop_oneof![Just(BlockOrder::Nhd), Just(BlockOrder::Hnd)],
        proptest::collection::vec(proptest::sample::select(vec![1u32, 3, 4, 16]), 1..=4),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 2 } else { 128 }, .. ProptestConfig::default() })]

    /// Random group mixes (kinds, sizes, windows, state shapes, TP/PCP/DP, block sizes and
    /// orders per group, block counts per group): every destination byte of every group
    /// arrives exactly once, nothing else changes, and moved / needed = 1.00 per group.
    #[test]
    fn random_group_mixes_move_exactly_what_is_needed(
        m in arb_model(),
        tokens in 1u32..70,
        seed in any::<u64>(),
        s in arb_side(),
        d in arb_side(),
    ) {
        prop_assume!(m.validate().is_ok());
        let sl = hlayout(&m, spec(s.0, s.1, s.2, s.3), &s.4, tokens);
        let dl = hlayout(&m, spec(d.0, d.1, d.2, d.3), &d.4, tokens);
        let src = hybrid_placement(sl, seed as u32 % s.2, tokens, seed);
        let dst = hybrid_placement(dl, (seed >> 8) as u32 % d.2, tokens, !seed);
        let plan = Plan::build_groups(&src, &dst, tokens).unwrap();
        simulate(&src, &dst, tokens, &plan);
        let again = Plan::build_groups(&src, &dst, tokens).unwrap();
        for (a, b) in plan.pairs() {
            prop_assert_eq!(spans_digest(&plan.pair_spans(a, b)), spans_digest(&again.pair_spans(a, b)));
        }
    }

    /// The same mixes into a destination with a prefix hit (a `first_token` aligned to every
    /// paged group's block size) from a source holding the request from 0 or from an earlier
    /// aligned token: only the tokens after the hit arrive, into the blocks listed after it,
    /// exactly once; nothing else changes; moved / needed = 1.00 per group.
    #[test]
    fn random_group_mixes_after_a_prefix_hit_move_exactly_the_rest(
        m in arb_model(),
        tokens in 2u32..90,
        seed in any::<u64>(),
        s in arb_side(),
        d in arb_side(),
        hit in any::<u32>(),
        src_hit in any::<bool>(),
    ) {
        prop_assume!(m.validate().is_ok());
        let sl = hlayout(&m, spec(s.0, s.1, s.2, s.3), &s.4, tokens);
        let dl = hlayout(&m, spec(d.0, d.1, d.2, d.3), &d.4, tokens);
        let dlcm = paged_block_lcm(&dl);
        let first = dlcm * (hit % tokens.div_ceil(dlcm));
        prop_assume!(first > 0);
        let slcm = paged_block_lcm(&sl);
        let sfirst = if src_hit { first / slcm * slcm } else { 0 };
        let src = placement_from(sl, seed as u32 % s.2, tokens, seed, sfirst);
        let dst = placement_from(dl, (seed >> 8) as u32 % d.2, tokens, !seed, first);
        let plan = Plan::build_groups(&src, &dst, tokens).unwrap();
        simulate(&src, &dst, tokens, &plan);
    }

    /// The same mixes into a destination that computes from an earlier token than the next
    /// one (`next_token`: a recomputed last token, a layer-wise consumer), after a prefix hit
    /// or not: planned exactly (every window token that token reads arrives, nothing else)
    /// where the source's blocks hold those tokens, else refused as a mismatch and nothing
    /// planned.
    #[test]
    fn random_group_mixes_into_a_recomputing_destination(
        m in arb_model(),
        tokens in 2u32..90,
        seed in any::<u64>(),
        s in arb_side(),
        d in arb_side(),
        back in 1u32..20,
        hit in any::<u32>(),
    ) {
        prop_assume!(m.validate().is_ok());
        let sl = hlayout(&m, spec(s.0, s.1, s.2, s.3), &s.4, tokens);
        let dl = hlayout(&m, spec(d.0, d.1, d.2, d.3), &d.4, tokens);
        let dlcm = paged_block_lcm(&dl);
        let first = dlcm * (hit % tokens.div_ceil(dlcm)) * (hit % 2);
        let next = tokens.saturating_sub(back).max(first);
        let src = placement_from(sl, seed as u32 % s.2, tokens, seed, 0);
        let dst = placement_next(dl, (seed >> 8) as u32 % d.2, tokens, !seed, first, Some(next));
        match Plan::build_groups(&src, &dst, tokens) {
            Ok(plan) => simulate(&src, &dst, tokens, &plan),
            Err(e) => prop_assert_eq!(e.kind(), crate::ErrorKind::Mismatch, "{}", e),
        }
    }

    /// Uniform models: the one-group plan is Plan::build's plan, span for span.
    #[test]
    fn uniform_group_plan_equals_the_uniform_plan(
        heads in proptest::sample::select(vec![1u32, 2, 4, 8]),
        mla in any::<bool>(),
        tokens in 1u32..80,
        seed in any::<u64>(),
        s in arb_side(),
        d in arb_side(),
        lbhnc in any::<bool>(),
    ) {
        let (heads, planes) = if mla { (1, 1) } else { (heads, 2) };
        let m = ModelKv { name: "t".into(), num_layers: 2, num_kv_heads: heads, head_dim: 4, kv_planes: planes, dtype: DType::Bf16 };
        let mk = |side: &(u32, u32, u32, BlockOrder, Vec<u32>), bs: u32| {
            let order = if lbhnc { BlockOrder::Lbhnc } else { side.3 };
            let spec = ParallelSpec { tp: side.0, pcp: side.1, dp: side.2, block_size: bs, order };
            let mut l = ParallelLayout::new(m.clone(), spec, 1).unwrap().with_block_format("f");
            l.num_blocks = uniform_chunk(&l, tokens, 0).len() as u32 * 2 + 3;
            l
        };
        let (sbs, dbs) = if lbhnc { (s.4[0], s.4[0]) } else { (s.4[0], d.4[0]) };
        let sl = mk(&s, sbs);
        let dl = mk(&d, dbs);
        let place = |l: ParallelLayout, dp: u32, seed: u64| {
            let ids = (0..l.spec.ranks_per_replica())
                .map(|local| scattered(l.num_blocks, uniform_chunk(&l, tokens, local / l.spec.tp).len(), seed ^ local as u64))
                .collect();
            crate::plan::Placement { first_token: 0, layout: l, dp_rank: dp, block_ids: ids, groups: None }
        };
        let src = place(sl, seed as u32 % s.2, seed);
        let dst = place(dl, (seed >> 8) as u32 % d.2, !seed);
        let a = Plan::build(&src, &dst, tokens).unwrap();
        let b = Plan::build_groups(&HybridPlacement::from_uniform(&src), &HybridPlacement::from_uniform(&dst), tokens).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(HybridPlacement::from_uniform(&dst).needed_bytes(tokens).unwrap(), vec![a.total_bytes()]);
    }

    /// Sliding-window and full attention groups in the opaque LBHNC order (equal block sizes):
    /// whole regions of the window's blocks (after a destination's prefix hit, if any: `hit`
    /// blocks, or none when `hit` is past the request's blocks).
    #[test]
    fn lbhnc_groups_move_whole_window_blocks(
        heads in proptest::sample::select(vec![1u32, 2, 4]),
        window in 1u32..40,
        tokens in 1u32..70,
        bs in proptest::sample::select(vec![1u32, 4, 16]),
        seed in any::<u64>(),
        s in arb_side(),
        d in arb_side(),
        hit in 0u32..20,
    ) {
        let m = HybridModel {
            name: "lb".into(),
            groups: vec![
                KvGroup::new("full", [0], attn(heads, 2, 2, DType::F32, None)),
                KvGroup::new("sliding", [1, 2], attn(heads, 2, 2, DType::F32, Some(window))),
            ],
        };
        let mk = |side: &(u32, u32, u32, BlockOrder, Vec<u32>)| {
            let mut l = hlayout(&m, spec(side.0, side.1, side.2, BlockOrder::Lbhnc), &[bs], tokens);
            for gl in &mut l.groups { gl.block_format = Some("test/f32".into()); }
            l
        };
        let src = hybrid_placement(mk(&s), seed as u32 % s.2, tokens, seed);
        let first = if hit * bs < tokens { hit * bs } else { 0 };
        let dst = placement_from(mk(&d), (seed >> 8) as u32 % d.2, tokens, !seed, first);
        let plan = Plan::build_groups(&src, &dst, tokens).unwrap();
        simulate(&src, &dst, tokens, &plan);
    }
}

#[test]
fn the_documented_json_placement_is_valid() {
    let doc = include_str!("../../../../docs/hybrid.md");
    let start = doc.find("```json\n").unwrap() + 8;
    let end = start + doc[start..].find("```").unwrap();
    let p: HybridPlacement = serde_json::from_str(&doc[start..end]).unwrap();
    p.validate(18).unwrap();
    let plan = Plan::build_groups(&p, &p, 18).unwrap();
    assert_eq!(plan.group_bytes(&p.layout), p.needed_bytes(18).unwrap());
}

/// vLLM-TorchTPU's sliding-window + full-attention groups in the TPU engines' RPA v3 caches
/// (each layer its own `[num_blocks, block_size, R, P, D']` tensor, `docs/tpu.md`): resharded
/// between TP sizes, block sizes and to and from the GPU orders, only real heads and tokens
/// moved (never the slot or lane padding, which the simulation's verify checks unchanged),
/// including fp8 with 3 local heads (a packed row of 4 slots cut between ranks) and the
/// head_dim-64 kernel's cache.
#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn rpa3_attention_groups_reshard_byte_exact() {
    let t = 45;
    for (heads, dim, dtype, order) in [
        (4, 128, DType::Bf16, BlockOrder::Rpa3),
        (6, 80, DType::Fp8, BlockOrder::Rpa3),
        (2, 64, DType::Bf16, BlockOrder::Rpa3Hd64),
    ] {
        let m = HybridModel {
            name: "tpu-sliding".into(),
            groups: vec![
                KvGroup::new("sliding", [0, 2], attn(heads, dim, 2, dtype, Some(20))),
                KvGroup::new("full", [1, 3], attn(heads, dim, 2, dtype, None)),
            ],
        };
        m.validate().unwrap();
        for ((stp, sorder, sbs), (dtp, dorder, dbs)) in [
            ((2, order, 8), (1, order, 8)),
            ((1, order, 16), (2, order, 8)),
            ((2, order, 8), (1, BlockOrder::Nhd, 4)),
            ((1, BlockOrder::Hnd, 16), (2, order, 16)),
        ] {
            let src = hybrid_placement(hlayout(&m, spec(stp, 1, 1, sorder), &[sbs], t), 0, t, 31);
            let dst = hybrid_placement(hlayout(&m, spec(dtp, 1, 1, dorder), &[dbs], t), 0, t, 32);
            let plan = Plan::build_groups(&src, &dst, t).unwrap();
            simulate(&src, &dst, t, &plan);
        }
    }
}

/// RPA v3 attention groups in a TPU's tiled layout (fp8 `T(4,128)(4,1)`, named by both sides'
/// groups): planned when every run is whole packed rows (TP 2 -> 1, 8 heads of 128), refused
/// naming the group and the layout when a run would cut a row (head_dim 80 in 128 lanes) or the
/// other side names no layout.
#[test]
fn tiled_rpa3_groups_move_whole_rows_or_are_refused() {
    let fp8 = "{4,3,2,1,0:T(4,128)(4,1)}";
    let t = 45;
    let build = |dim: u32, named: bool| {
        let m = HybridModel {
            name: "tpu-sliding".into(),
            groups: vec![
                KvGroup::new("sliding", [0, 2], attn(8, dim, 2, DType::Fp8, Some(20))),
                KvGroup::new("full", [1, 3], attn(8, dim, 2, DType::Fp8, None)),
            ],
        };
        let tiled = |mut p: HybridPlacement, on: bool| {
            for g in &mut p.layout.groups {
                g.physical_layout = on.then(|| fp8.to_string());
            }
            p
        };
        let o = BlockOrder::Rpa3;
        let src = tiled(
            hybrid_placement(hlayout(&m, spec(2, 1, 1, o), &[8], t), 0, t, 31),
            true,
        );
        let dst = tiled(
            hybrid_placement(hlayout(&m, spec(1, 1, 1, o), &[16], t), 0, t, 32),
            named,
        );
        Plan::build_groups(&src, &dst, t).map(|p| (src, dst, p))
    };
    let (src, dst, plan) = build(128, true).unwrap();
    simulate(&src, &dst, t, &plan);
    let e = build(80, true).unwrap_err().to_string();
    assert!(
        e.contains("KV cache group") && e.contains(fp8) && e.contains("cuts"),
        "{e}"
    );
    let e = build(128, false).unwrap_err().to_string();
    assert!(e.contains(fp8) && e.contains("unknown"), "{e}");
}

fn mla(head_dim: u32) -> GroupKind {
    GroupKind::Mla {
        head_dim,
        dtype: DType::Fp8,
    }
}

/// vLLM-TorchTPU's sparse MLA caches (DeepSeek-V3.2; vllm-torchtpu 0.29.0
/// `PallasMLAttentionBackend.get_sparse_kv_cache_specs` and `VllmTPUDeepseekV32IndexerBackend`,
/// docs/tpu.md section 3) as three MLA groups in the TPU MLA order over one block table: the
/// `nope` latent (512 fp8 bytes a token), the `rope` key (128 bytes) and the indexer key (256
/// bytes), plus a group of 64 real bytes in 128 lanes (lane padding never moved). Resharded
/// between TP sizes (every decode rank gets the replicated caches) and block sizes, and
/// converted to and from a GPU order: byte-exact, moved = needed.
#[test]
#[cfg_attr(miri, ignore = "byte-level simulation: too slow under Miri")]
fn sparse_mla_groups_in_the_tpu_mla_cache_reshard_byte_exact() {
    let t = 45;
    let m = HybridModel {
        name: "tpu-sparse-mla".into(),
        groups: vec![
            KvGroup::new("nope", [1, 4], mla(512)),
            KvGroup::new("rope", [2, 5], mla(128)),
            KvGroup::new("indexer", [0, 3], mla(256)),
            KvGroup::new("padded", [6], mla(64)),
        ],
    };
    m.validate().unwrap();
    let o = BlockOrder::RpaMla;
    for ((stp, sorder, sbs), (dtp, dorder, dbs)) in [
        ((2, o, 16), (4, o, 16)),
        ((4, o, 16), (1, o, 32)),
        ((1, o, 8), (2, BlockOrder::Nhd, 16)),
        ((2, BlockOrder::Hnd, 16), (1, o, 8)),
    ] {
        let src = hybrid_placement(hlayout(&m, spec(stp, 1, 1, sorder), &[sbs], t), 0, t, 41);
        let dst = hybrid_placement(hlayout(&m, spec(dtp, 1, 1, dorder), &[dbs], t), 0, t, 42);
        let plan = Plan::build_groups(&src, &dst, t).unwrap();
        simulate(&src, &dst, t, &plan);
        // One token row per token, layer and decode rank: 64 bytes of the padded group, never
        // its 128 lanes.
        let per_token = [512u64, 128, 256, 64];
        let layers = [2u64, 2, 2, 1];
        let want: Vec<u64> = (0..4)
            .map(|g| per_token[g] * layers[g] * t as u64 * dtp as u64)
            .collect();
        assert_eq!(plan.group_bytes(&dst.layout), want);
    }
}

/// What the TPU caches do not hold in a hybrid layout is refused by name: an MLA group in an RPA
/// v3 cache, an attention group in the TPU MLA cache, the head_dim-64 cache for another
/// head_dim.
#[test]
fn tpu_orders_in_groups_they_do_not_hold_are_refused() {
    // The error of a layout of `groups` (one kind each, 4 blocks) in `order`.
    let refusal = |name: &str, kinds: &[(&str, GroupKind)], order: BlockOrder| {
        let groups = kinds
            .iter()
            .enumerate()
            .map(|(i, (n, k))| KvGroup::new(n, [i as u32], k.clone()))
            .collect();
        let m = HybridModel {
            name: name.into(),
            groups,
        };
        let gl = vec![GroupLayout::new(4); kinds.len()];
        HybridLayout::new(m, spec(1, 1, 1, order), gl)
            .unwrap_err()
            .to_string()
    };
    let e = refusal("tpu-mla", &[("mla", mla(576))], BlockOrder::Rpa3);
    assert!(
        e.contains("holds attention groups only here; mla groups in it"),
        "{e}"
    );
    let full = attn(2, 128, 2, DType::Bf16, None);
    let e = refusal("tpu-attn", &[("full", full.clone())], BlockOrder::RpaMla);
    assert!(
        e.contains("block order rpamla (a TPU engine's cache) holds mla groups only here"),
        "{e}"
    );
    let sliding = attn(2, 128, 2, DType::Bf16, Some(8));
    let e = refusal(
        "tpu-sliding",
        &[("sliding", sliding), ("full", full)],
        BlockOrder::Rpa3Hd64,
    );
    assert!(
        e.contains("group 0 (`sliding`): model `tpu-sliding`: block order rpa3hd64"),
        "{e}"
    );
}
