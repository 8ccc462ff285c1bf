//! `tpu-sync demo --preset NAME` for every hybrid preset (KV cache groups) as a user runs it:
//! prefill and decode as two OS processes with their own PJRT clients, P/D resharded (TP over
//! heads, PCP over tokens, DP, different block sizes and orders), byte-exact with every other
//! byte unchanged (the attention groups also in the TPU engines' RPA v3 caches); and decode
//! sides whose groups differ from the prefill's (a group missing,
//! another window, another state shape) refused by the prefill at the handshake.

use crate::common;

use std::time::Duration;

use common::{text, tpu_sync};
use tpu_sync::layout::{HybridLayout, HybridModel, ParallelSpec, HYBRID_PRESETS};
use tpu_sync::plan::HybridPlacement;

const LIMIT: Duration = Duration::from_secs(180);

/// `(preset, tokens, prefill spec, decode spec)`: small token counts so the runs stay fast;
/// gpt-oss runs past its 128-token window so only the window's blocks move.
const CASES: &[(&str, u32, &str, &str)] = &[
    (
        "qwen3-next-80b",
        40,
        "tp=2,pcp=2,block=16",
        "tp=4,dp=2,block=32",
    ),
    (
        "qwen3.5-9b",
        70,
        "tp=1,block=64",
        "tp=2,pcp=2,block=16,order=hnd",
    ),
    (
        "gpt-oss-120b",
        200,
        "tp=2,block=16",
        "tp=8,block=32,order=hnd",
    ),
    (
        "gemma-3-27b",
        40,
        "tp=2,pcp=2,block=16",
        "tp=4,dp=2,block=32",
    ),
    (
        "deepseek-v3.2",
        50,
        "tp=1,pcp=2,block=64",
        "tp=4,dp=2,block=32",
    ),
    // The TPU engines' RPA v3 caches for the attention groups (docs/tpu.md): gpt-oss (head_dim
    // 64) in the head_dim-64 kernel's cache, vLLM-TorchTPU TP=2 -> tpu-inference TP=1, and a
    // GPU-style NHD prefill into a TPU decode.
    (
        "gpt-oss-120b",
        200,
        "tp=2,block=64,order=rpa3hd64",
        "tp=1,block=32,order=rpa3hd64",
    ),
    (
        "gemma-3-27b",
        40,
        "tp=2,block=16,order=nhd",
        "tp=4,block=32,order=rpa3",
    ),
    // vLLM-TorchTPU's sparse MLA caches (nope, rope, indexer) in the TPU MLA cache, TP=2 ->
    // TP=4 (every decode rank a replica) with another block size.
    (
        "deepseek-v3.2-tpu",
        50,
        "tp=2,block=64,order=rpamla",
        "tp=4,block=32,order=rpamla",
    ),
];

/// The bytes the decode layout needs per group, from the geometry alone (block counts and ids
/// do not change them).
fn needed(preset: &str, tokens: u32, decode: &str) -> Vec<(String, u64)> {
    let m = HybridModel::preset(preset).unwrap();
    let spec = ParallelSpec::parse(decode).unwrap();
    let layout = HybridLayout::uniform_blocks(m.clone(), spec, 1).unwrap();
    let p = HybridPlacement {
        layout,
        dp_rank: 0,
        block_ids: vec![],
        first_token: 0,
        next_token: None,
    };
    let n = p.needed_bytes(tokens).unwrap();
    m.groups.iter().map(|g| g.name.clone()).zip(n).collect()
}

#[test]
fn every_hybrid_preset_moves_byte_exact_resharded() {
    let covered: Vec<&str> = CASES.iter().map(|c| c.0).collect();
    for p in HYBRID_PRESETS {
        assert!(covered.contains(p), "preset {p} has no demo case");
    }
    for &(preset, tokens, prefill, decode) in CASES {
        let t = tokens.to_string();
        let o = tpu_sync(
            &[
                "demo",
                "--preset",
                preset,
                "--tokens",
                &t,
                "--prefill",
                prefill,
                "--decode",
                decode,
            ],
            LIMIT,
        );
        let out = text(&o);
        assert!(o.status.success(), "{preset}:\n{out}");
        assert!(!out.contains("panicked"), "{out}");
        assert!(out.contains("verified:"), "{preset}:\n{out}");
        let want = needed(preset, tokens, decode);
        let mut total = 0;
        let mut blocks = Vec::new();
        for (name, bytes) in &want {
            let row: Vec<&str> = out
                .lines()
                .map(str::trim)
                .find(|l| l.split_whitespace().next() == Some(name))
                .unwrap_or_else(|| panic!("{preset}: no row for group {name}:\n{out}"))
                .split_whitespace()
                .collect();
            // group kind layers blocks moved needed verified moved/needed
            assert_eq!(row.len(), 8, "{row:?}");
            let num = |i: usize| row[i].parse::<u64>().unwrap();
            assert_eq!(num(4), *bytes, "{preset} {name}: moved");
            assert_eq!(num(5), *bytes, "{preset} {name}: needed");
            assert_eq!(num(6), *bytes, "{preset} {name}: verified");
            assert_eq!(row[7], "1.00", "{preset} {name}");
            assert!(*bytes > 0);
            blocks.push(num(3));
            total += bytes;
        }
        blocks.dedup();
        assert!(
            blocks.len() > 1,
            "{preset}: groups' buffers hold different numbers of blocks"
        );
        let verified = out.lines().find(|l| l.starts_with("verified:")).unwrap();
        assert!(
            verified.starts_with(&format!("verified: {total} bytes")),
            "{preset}: {verified}"
        );
    }
}

#[test]
fn mismatched_groups_are_refused_at_the_handshake() {
    for (preset, fault, why) in [
        ("deepseek-v3.2", "missing", "groups differ"),
        ("gpt-oss-120b", "window", "sliding window"),
        ("qwen3.5-9b", "state", "state shapes differ"),
    ] {
        let o = tpu_sync(
            &[
                "demo",
                "--preset",
                preset,
                "--tokens",
                "20",
                "--prefill",
                "tp=2,block=16",
                "--decode",
                "tp=1,block=32",
                "--fault-groups",
                fault,
            ],
            LIMIT,
        );
        let out = text(&o);
        assert!(!o.status.success(), "{preset} {fault}:\n{out}");
        assert!(!out.contains("verified:"), "{out}");
        assert!(!out.contains("panicked"), "{out}");
        // The decode's own plan passed (it believes the prefill has its groups): the refusal is
        // the prefill's ("peer:"), a mismatch naming what differs.
        assert!(
            out.contains("error: mismatch: peer:"),
            "{preset} {fault}:\n{out}"
        );
        assert!(out.contains(why), "{preset} {fault}:\n{out}");
        // The decode rejected the request, so the prefill freed it at once.
        assert!(
            out.contains("rejected the request"),
            "{preset} {fault}:\n{out}"
        );
    }
}
