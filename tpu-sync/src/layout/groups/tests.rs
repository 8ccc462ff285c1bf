//! Tests of the group types: presets against their published configs, per-kind geometry, TP
//! splits, windows, JSON forms.

use super::*;

fn spec(tp: u32, pcp: u32) -> ParallelSpec {
    ParallelSpec {
        tp,
        pcp,
        ..ParallelSpec::default()
    }
}

#[test]
fn presets_match_their_configs() {
    for name in HYBRID_PRESETS.iter().chain(super::super::PRESETS) {
        let m = HybridModel::preset(name).unwrap();
        m.validate().unwrap();
        assert_eq!(&m.name, name);
    }
    let q = HybridModel::preset("qwen3-next-80b").unwrap();
    assert_eq!(q.num_layers(), 48);
    assert_eq!(
        q.groups[0].layers,
        (0..12).map(|i| 4 * i + 3).collect::<Vec<_>>()
    );
    assert_eq!(q.groups[1].layers.len(), 36);
    assert_eq!(
        q.groups[1].kind.state_bytes(),
        3 * 8192 * 2 + 32 * 128 * 128 * 2
    );
    let q5 = HybridModel::preset("qwen3.5-9b").unwrap();
    assert_eq!((q5.num_layers(), q5.groups[0].layers.len()), (32, 8));
    assert_eq!(
        q5.groups[1].kind.state_bytes(),
        3 * 8192 * 2 + 32 * 128 * 128 * 4
    );
    let g = HybridModel::preset("gpt-oss-120b").unwrap();
    assert_eq!(
        g.groups[0].layers,
        (0..18).map(|i| 2 * i + 1).collect::<Vec<_>>()
    );
    assert_eq!(g.groups[1].kind.sliding_window(), Some(128));
    let gm = HybridModel::preset("gemma-3-27b").unwrap();
    assert_eq!(
        (gm.groups[0].layers.len(), gm.groups[1].layers.len()),
        (10, 52)
    );
    assert_eq!(gm.groups[0].layers[0], 5);
    assert_eq!(gm.groups[1].kind.sliding_window(), Some(1024));
    let ds = HybridModel::preset("deepseek-v3.2").unwrap();
    assert_eq!(ds.num_layers(), 122);
    assert_eq!(ds.groups[0].kind.bytes_per_token_layer(), 576 * 2);
    assert_eq!(ds.groups[1].kind.bytes_per_token_layer(), 132);
    // A uniform preset is one group of every layer.
    let l = HybridModel::preset("llama-3.1-8b").unwrap();
    assert_eq!(l.groups.len(), 1);
    assert_eq!(l.groups[0].layers, (0..32).collect::<Vec<_>>());
    let e = HybridModel::preset("nope").unwrap_err();
    assert!(e.to_string().contains("gpt-oss-120b"), "{e}");
}

#[test]
fn state_splits_over_tp_by_heads() {
    let m = HybridModel::preset("qwen3-next-80b").unwrap();
    let dense = |tp| {
        let l = HybridLayout::uniform_blocks(m.clone(), spec(tp, 1), 4).unwrap();
        match l.rank_kv(1).unwrap() {
            GroupRankKv::State(s) => s,
            other => panic!("{other:?}"),
        }
    };
    let s1 = dense(1);
    let s2 = dense(2);
    assert_eq!(s1.slot_bytes, 3 * 8192 * 2 + 32 * 128 * 128 * 2);
    assert_eq!(s2.slot_bytes * 2, s1.slot_bytes);
    // The conv row of TP rank r holds its q, k and v shares, in that order.
    assert_eq!(s2.components[0].row_bytes, 4096 * 2);
    let segs: Vec<(u64, u32)> = s2.components[0]
        .segments
        .iter()
        .map(|s| (s.offset, s.heads))
        .collect();
    assert_eq!(segs, vec![(0, 8), (8 * 128 * 2, 8), (16 * 128 * 2, 16)]);
    assert_eq!(s2.components[1].offset, 3 * 4096 * 2);
    // 2 KV heads over TP=4: replicated attention; 16 linear heads over 32 ranks: replicated too.
    assert!(HybridLayout::uniform_blocks(m.clone(), spec(4, 1), 4).is_ok());
    let e = HybridLayout::uniform_blocks(m.clone(), spec(3, 1), 4).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Layout);
    // Buffer shapes: the state buffer is bf16 [slots, slot / 2]; a padded stride is honoured.
    let mut l = HybridLayout::uniform_blocks(m, spec(2, 1), 4).unwrap();
    let shape = l.layer_shape(0).unwrap();
    assert_eq!(shape.element_type, ElementType::BF16);
    assert_eq!(shape.dims, vec![4, (s2.slot_bytes / 2) as i64]);
    l.groups[1].slot_bytes = Some(s2.slot_bytes + 4096);
    l.validate().unwrap();
    assert_eq!(l.layer_shape(0).unwrap().bytes, 4 * (s2.slot_bytes + 4096));
    l.groups[1].slot_bytes = Some(s2.slot_bytes - 1);
    assert!(l.validate().is_err());
    // Full attention layer 3: [2, blocks, 16, 1 head, 256] bf16 at TP=2.
    l.groups[1].slot_bytes = None;
    assert_eq!(l.layer_shape(3).unwrap().dims, vec![2, 4, 16, 1, 256]);
    assert!(l.layer_shape(48).is_err());
}

#[test]
fn mixed_dtype_state_is_a_byte_buffer() {
    let m = HybridModel::preset("qwen3.5-9b").unwrap();
    let l = HybridLayout::uniform_blocks(m, spec(1, 1), 3).unwrap();
    let shape = l.layer_shape(0).unwrap();
    assert_eq!(shape.element_type, ElementType::U8);
    assert_eq!(shape.dims, vec![3, 3 * 8192 * 2 + 32 * 128 * 128 * 4]);
}

#[test]
fn windows_and_pcp_chunks() {
    let m = HybridModel::preset("gpt-oss-120b").unwrap();
    let l = HybridLayout::uniform_blocks(m, spec(1, 2), 64).unwrap();
    // 300 tokens, window 128: tokens 173..300 (vLLM skips 300 - 128 + 1 = 173), blocks 10..19.
    assert_eq!(l.needed_tokens(1, 300).unwrap(), 173..300);
    assert_eq!(l.window_blocks(1, 300).unwrap(), 10..19);
    assert_eq!(l.needed_tokens(0, 300).unwrap(), 0..300);
    // PCP=2: 19 blocks in chunks of 10: the window lives on both ranks.
    assert_eq!(l.held_blocks(1, 300, 0).unwrap(), 10..10);
    assert_eq!(l.held_blocks(1, 300, 1).unwrap(), 10..19);
    assert_eq!(l.held_blocks(0, 300, 0).unwrap(), 0..10);
    // A window of exactly one token needs nothing besides the next token itself.
    let one = HybridModel {
        name: "w1".into(),
        groups: vec![KvGroup::new(
            "w",
            [0],
            GroupKind::Attention {
                num_kv_heads: 1,
                head_dim: 1,
                kv_planes: 2,
                dtype: DType::Bf16,
                sliding_window: Some(1),
            },
        )],
    };
    let l1 = HybridLayout::uniform_blocks(one, spec(1, 1), 4).unwrap();
    assert!(l1.needed_tokens(0, 10).unwrap().is_empty());
    assert!(l1.window_blocks(0, 10).unwrap().is_empty());
}

#[test]
fn invalid_models_are_refused() {
    let ok = HybridModel::preset("gpt-oss-120b").unwrap();
    let mut gap = ok.clone();
    gap.groups[0].layers.remove(0);
    assert!(gap.validate().is_err());
    let mut twice = ok.clone();
    twice.groups[0].layers[0] = 0;
    assert!(twice.validate().is_err());
    let mut unsorted = ok.clone();
    unsorted.groups[0].layers.swap(0, 1);
    assert!(unsorted.validate().is_err());
    let mut zero_window = ok.clone();
    if let GroupKind::Attention { sliding_window, .. } = &mut zero_window.groups[1].kind {
        *sliding_window = Some(0);
    }
    assert!(zero_window.validate().is_err());
    let empty = HybridModel {
        name: "e".into(),
        groups: vec![],
    };
    assert!(empty.validate().is_err());
    let no_state = HybridModel {
        name: "s".into(),
        groups: vec![KvGroup::new(
            "s",
            [0],
            GroupKind::State {
                components: vec![],
                replicated: false,
            },
        )],
    };
    assert!(no_state.validate().is_err());
    // Zero blocks, a zero block size, a layout count that does not match the groups, an order
    // on a state group.
    let m = HybridModel::preset("qwen3-next-80b").unwrap();
    assert!(HybridLayout::uniform_blocks(m.clone(), spec(1, 1), 0).is_err());
    let mut l = HybridLayout::uniform_blocks(m.clone(), spec(1, 1), 4).unwrap();
    l.groups[0].block_size = Some(0);
    assert!(l.validate().is_err());
    l.groups[0].block_size = None;
    l.groups.pop();
    assert!(l.validate().is_err());
    let mut l = HybridLayout::uniform_blocks(m, spec(1, 1), 4).unwrap();
    l.groups[1].order = Some(BlockOrder::Lbhnc);
    assert!(l.validate().is_err());
    // Sizes that would wrap u64 are refused, not wrapped.
    let huge = HybridModel {
        name: "h".into(),
        groups: vec![KvGroup::new(
            "s",
            [0],
            GroupKind::State {
                components: vec![StateComponent::new(
                    "x",
                    DType::F32,
                    u32::MAX,
                    &[(1, u32::MAX)],
                )],
                replicated: true,
            },
        )],
    };
    let e = HybridLayout::uniform_blocks(huge, spec(1, 1), u32::MAX).unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
}

#[test]
fn json_forms() {
    let json = r#"{
        "name": "tiny-hybrid",
        "groups": [
            {"name": "full", "layers": [1], "kind": {"type": "attention", "num_kv_heads": 2, "head_dim": 4, "dtype": "bf16"}},
            {"name": "sliding", "layers": [0, 2], "kind": {"type": "attention", "num_kv_heads": 2, "head_dim": 4, "dtype": "bf16", "sliding_window": 8}},
            {"layers": [3], "kind": {"type": "state", "components": [
                {"name": "conv", "dtype": "bf16", "rows": 3, "segments": [{"heads": 2, "head_elems": 4}]},
                {"dtype": "f32", "segments": [{"heads": 2, "head_elems": 16}]}
            ]}},
            {"layers": [4], "kind": {"type": "mla", "head_dim": 576, "dtype": "bf16"}},
            {"layers": [5], "kind": {"type": "indexer", "head_dim": 128, "dtype": "fp8", "scale_bytes": 4}}
        ]
    }"#;
    let m: HybridModel = serde_json::from_str(json).unwrap();
    m.validate().unwrap();
    assert!(matches!(
        m.groups[0].kind,
        GroupKind::Attention {
            kv_planes: 2,
            sliding_window: None,
            ..
        }
    ));
    let GroupKind::State {
        components,
        replicated,
    } = &m.groups[2].kind
    else {
        panic!()
    };
    assert_eq!((components[1].rows, *replicated), (1, false));
    let back: HybridModel = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
    assert_eq!(back, m);
    // Unknown keys are refused at every level.
    for (from, to) in [
        ("\"name\": \"tiny-hybrid\"", "\"name\": \"t\", \"x\": 1"),
        ("\"layers\": [1],", "\"layers\": [1], \"x\": 1,"),
        ("\"head_dim\": 576,", "\"head_dim\": 576, \"x\": 1,"),
        ("\"rows\": 3,", "\"rows\": 3, \"x\": 1,"),
        ("\"head_elems\": 16}", "\"head_elems\": 16, \"x\": 1}"),
        ("\"type\": \"mla\"", "\"type\": \"mlb\""),
    ] {
        let bad = json.replacen(from, to, 1);
        assert_ne!(bad, json);
        assert!(serde_json::from_str::<HybridModel>(&bad).is_err(), "{bad}");
    }
    // A layout: per-group overrides, defaults elsewhere.
    let lj = format!(
        r#"{{"model": {json}, "spec": {{"tp": 2, "pcp": 1, "dp": 1, "block_size": 16, "order": "nhd"}},
           "groups": [{{"num_blocks": 8}}, {{"num_blocks": 3, "block_size": 4}}, {{"num_blocks": 2}},
                      {{"num_blocks": 8, "order": "hnd"}}, {{"num_blocks": 8}}]}}"#
    );
    let l: HybridLayout = serde_json::from_str(&lj).unwrap();
    l.validate().unwrap();
    assert_eq!(
        (l.block_size(0).unwrap(), l.block_size(1).unwrap()),
        (16, 4)
    );
    assert_eq!(
        (l.order(0).unwrap(), l.order(3).unwrap()),
        (BlockOrder::Nhd, BlockOrder::Hnd)
    );
    let bad = lj.replacen("\"num_blocks\": 2}", "\"num_blocks\": 2, \"slots\": 1}", 1);
    assert!(serde_json::from_str::<HybridLayout>(&bad).is_err());
}

#[test]
fn uniform_layout_is_one_group() {
    let m = ModelKv::preset("deepseek-v3").unwrap();
    let pl = ParallelLayout::new(m, spec(4, 2), 10)
        .unwrap()
        .with_physical_layout("{4,3,2,1,0}");
    let h = HybridLayout::from_uniform(&pl);
    h.validate().unwrap();
    assert_eq!(h.num_layers(), 61);
    // The uniform layout's own per-rank buffer: 61 layers of [1, 10, 16, 1, 576] bf16, MLA
    // replicated over TP=4; 100 tokens at block 16 are 7 blocks in PCP chunks of 4.
    let want = KvLayout {
        num_layers: 61,
        kv_planes: 1,
        num_blocks: 10,
        block_size: 16,
        num_heads: 1,
        head_dim: 576,
        dtype: DType::Bf16,
        order: BlockOrder::Nhd,
    };
    match h.rank_kv(0).unwrap() {
        GroupRankKv::Paged(kv) => assert_eq!(kv, want),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.pcp_chunk(0, 100, 1).unwrap(), 4..7);
    assert_eq!(h.layer_shape(7).unwrap().dims, want.dims().to_vec());
    assert_eq!(h.groups[0].physical_layout.as_deref(), Some("{4,3,2,1,0}"));
    // Compatible with itself; a model with another group count is not.
    h.model.check_compatible(&h.model).unwrap();
    let other = HybridModel::preset("deepseek-v3.2").unwrap();
    assert_eq!(
        h.model.check_compatible(&other).unwrap_err().kind(),
        crate::ErrorKind::Mismatch
    );
}

/// A layout that was never validated, with a zero field or a missing group layout, gets an
/// error from every geometry function, never a division by zero or an index panic.
#[test]
fn zero_fields_are_errors_not_panics() {
    let m = HybridModel::preset("gpt-oss-120b").unwrap();
    let ok = HybridLayout::uniform_blocks(m, spec(2, 1), 8).unwrap();
    let mut bad = vec![];
    for f in [
        |l: &mut HybridLayout| l.spec.tp = 0,
        |l: &mut HybridLayout| l.spec.pcp = 0,
        |l: &mut HybridLayout| l.spec.dp = 0,
        |l: &mut HybridLayout| l.spec.block_size = 0,
        |l: &mut HybridLayout| l.groups[1].block_size = Some(0),
        |l: &mut HybridLayout| {
            l.groups.pop();
        },
    ] {
        let mut l = ok.clone();
        f(&mut l);
        bad.push(l);
    }
    for l in &bad {
        assert_eq!(
            l.check_nonzero().unwrap_err().kind(),
            crate::ErrorKind::Layout
        );
        assert!(l.validate().is_err());
        assert!(l.coord(3).is_err());
        for g in 0..2 {
            assert!(l.block_size(g).is_err());
            assert!(l.rank_kv(g).is_err());
            assert!(l.request_blocks(g, 100).is_err());
            assert!(l.pcp_chunk(g, 100, 0).is_err());
            assert!(l.pcp_of_block(g, 100, 3).is_err());
            assert!(l.window_blocks(g, 100).is_err());
            assert!(l.held_blocks(g, 100, 0).is_err());
        }
        assert!(l.layer_shape(0).is_err());
        let p = crate::plan::HybridPlacement {
            layout: l.clone(),
            dp_rank: 0,
            block_ids: vec![vec![vec![]; 2]; 2],
            first_token: 0,
            next_token: None,
        };
        assert!(p.validate(10).is_err());
        assert!(p.block_ranges(0).is_err());
        assert!(p.needed_bytes(10).is_err());
        assert!(crate::pattern::GroupedContents::new(&p, 0, 10, 1).is_err());
        assert!(crate::plan::Plan::build_groups(&p, &p, 10).is_err());
    }
    // A group index outside the model is an error too.
    assert_eq!(
        ok.block_size(2).unwrap_err().kind(),
        crate::ErrorKind::InvalidArgument
    );
    assert!(ok.held_blocks(9, 10, 0).is_err());
}
