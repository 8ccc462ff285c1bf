//! The host KV tier with hybrid models (KV cache groups): a stored prefix is a hit only when
//! every group's part is present (full attention every block, sliding window the window's
//! blocks, state the part of the last block); a missing state part or group block gives the
//! shorter hit and never another prefix's bytes; incomplete parts go whole; a warm restart
//! (also after SIGKILL mid-put) serves the same hits; real PJRT device buffers whose layers have
//! different block counts round-trip byte-exact.

use crate::common;
use crate::store_util;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use store_util::*;
use tpu_sync::layout::{
    DType, GroupKind, GroupLayout, HybridLayout, HybridModel, KvGroup, ParallelSpec, StateComponent,
};
use tpu_sync::pattern::{mix64, GroupedContents};
use tpu_sync::pjrt::{Capabilities, DeviceBuffer};
use tpu_sync::plan::HybridPlacement;
use tpu_sync::store::{
    part_key, BlockKey, DeviceBlock, GroupPart, Hooks, KvStore, PartRole, StoreConfig, StoreGroup,
    StoreGroups,
};
use tpu_sync::ErrorKind;

/// Store block (slot payload) size; the state part takes 3 of them.
const CHUNK: u64 = 4096;
const FULL: u64 = 3000;
const WINDOW: u64 = 2000;
const STATE: u64 = 9000;
/// Window of 40 tokens at 16 tokens per block: a prefix of n blocks needs the window parts of
/// its last 3 blocks.
const W: u32 = 40;

fn groups() -> StoreGroups {
    StoreGroups::new(
        vec![
            StoreGroup {
                role: PartRole::Full,
                part_bytes: FULL,
            },
            StoreGroup {
                role: PartRole::Window { tokens: W },
                part_bytes: WINDOW,
            },
            StoreGroup {
                role: PartRole::State,
                part_bytes: STATE,
            },
        ],
        16,
        CHUNK,
    )
    .unwrap()
}

/// The bytes of group `g`'s part of the block keyed `k`.
fn part_bytes(k: BlockKey, g: usize, len: u64) -> Vec<u8> {
    bytes_of(part_key(k, g as u32, 1000), len as usize)
}

fn len_of(g: usize) -> u64 {
    [FULL, WINDOW, STATE][g]
}

/// Puts every block's full and window parts of `keys`, and state parts at `state_at`.
fn put_prefix(s: &KvStore, gs: &StoreGroups, keys: &[BlockKey], state_at: &[usize]) {
    let mut want: Vec<(usize, usize)> = (0..keys.len()).flat_map(|b| [(b, 0), (b, 1)]).collect();
    want.extend(state_at.iter().map(|&b| (b, 2)));
    let data: Vec<Vec<u8>> = want
        .iter()
        .map(|&(b, g)| part_bytes(keys[b], g, len_of(g)))
        .collect();
    let parts: Vec<GroupPart<&[u8]>> = want
        .iter()
        .zip(&data)
        .map(|(&(block, group), d)| GroupPart {
            block,
            group,
            data: d.as_slice(),
        })
        .collect();
    let r = s.put_groups_from_host(gs, None, keys, &parts).unwrap();
    assert!(r.complete(), "{r:?}");
}

/// Gets the parts of a hit of `n` blocks and checks each against what was stored for its key.
fn get_exact(s: &KvStore, gs: &StoreGroups, keys: &[BlockKey], n: usize) {
    let lease = s
        .pin_groups(gs, keys, n)
        .expect("every part of the hit is present");
    let want = gs.required_parts(n);
    let mut bufs: Vec<Vec<u8>> = want
        .iter()
        .map(|&(_, g)| vec![0u8; len_of(g) as usize])
        .collect();
    let mut parts: Vec<GroupPart<&mut [u8]>> = want
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(block, group), d)| GroupPart {
            block,
            group,
            data: d.as_mut_slice(),
        })
        .collect();
    let r = s.get_groups_to_host(gs, keys, &mut parts).unwrap();
    assert!(r.complete(want.len()), "{r:?}");
    drop(parts);
    for (&(b, g), got) in want.iter().zip(&bufs) {
        assert!(
            *got == part_bytes(keys[b], g, len_of(g)),
            "part (block {b}, group {g}) is not byte-exact"
        );
    }
    drop(lease);
}

fn store(slots: u64) -> KvStore {
    KvStore::open(config(CHUNK, slots)).unwrap()
}

#[test]
fn a_prefix_hits_only_when_every_group_is_whole() {
    let s = store(128);
    let gs = groups();
    let keys = chain(8, 1);
    put_prefix(&s, &gs, &keys, &[3, 7]);
    let h = s.lookup_groups(&gs, &keys);
    assert_eq!((h.blocks, h.spine_blocks), (8, 8));
    get_exact(&s, &gs, &keys, 8);
    // The required parts: 8 full, the window's 3 blocks (tokens 89..128 -> blocks 5..8), the state
    // of block 7.
    let req = gs.required_parts(8);
    assert_eq!(req.len(), 8 + 3 + 1);
    assert!(req.contains(&(5, 1)) && !req.contains(&(4, 1)) && req.contains(&(7, 2)));
    // A shorter chain: the state at block 3 makes 4 blocks usable, not 6.
    assert_eq!(s.lookup_groups(&gs, &keys[..6]).blocks, 4);
    get_exact(&s, &gs, &keys, 4);
    // The state of the last block goes: the shorter hit.
    assert_eq!(s.remove(&[part_key(keys[7], 2, 0)]), 3);
    let h = s.lookup_groups(&gs, &keys);
    assert_eq!((h.blocks, h.spine_blocks), (4, 8));
    get_exact(&s, &gs, &keys, 4);
    // A window block of that hit goes (block 2 is in the window of 4 blocks: tokens 25..64).
    assert_eq!(s.remove(&[part_key(keys[2], 1, 0)]), 1);
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 0);
    assert!(s.pin_groups(&gs, &keys, 4).is_none());
    s.debug_check().unwrap();
}

#[test]
fn a_missing_full_block_cuts_the_prefix() {
    let s = store(128);
    let gs = groups();
    let keys = chain(8, 2);
    put_prefix(&s, &gs, &keys, &[1, 3, 5, 7]);
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 8);
    // Removing block 5's full part removes everything chained below it: later blocks and the
    // window and state parts of blocks 5..8.
    let removed = s.remove(&[keys[5]]);
    assert_eq!(removed, 3 * (1 + 1) + 2 * 3);
    let h = s.lookup_groups(&gs, &keys);
    assert_eq!((h.blocks, h.spine_blocks), (4, 5));
    get_exact(&s, &gs, &keys, 4);
}

#[test]
fn an_evicted_chunk_drops_its_whole_part() {
    let s = store(128);
    let gs = groups();
    assert_eq!(gs.chunks(2), 3);
    let keys = chain(8, 3);
    put_prefix(&s, &gs, &keys, &[3, 7]);
    // The state of block 7 loses its last chunk (as LRU takes a chain's tail first).
    assert_eq!(s.remove(&[part_key(keys[7], 2, 2)]), 1);
    let h = s.lookup_groups(&gs, &keys);
    assert_eq!((h.blocks, h.removed_parts), (4, 1));
    // The rest of the part went with it.
    for c in 0..3 {
        assert_eq!(s.lookup(&[part_key(keys[7], 2, c)]), 0, "chunk {c}");
    }
    assert_eq!(s.lookup_groups(&gs, &keys).removed_parts, 0);
    get_exact(&s, &gs, &keys, 4);
    s.debug_check().unwrap();
}

/// Token ids of a prompt whose first `shared` blocks are common to every `seed`.
fn tokens(blocks: usize, shared: usize, seed: u64) -> Vec<u32> {
    (0..blocks * 16)
        .map(|i| {
            let s = if i < shared * 16 { 0 } else { seed };
            (mix64(s ^ ((i as u64) << 8)) % 50_000) as u32
        })
        .collect()
}

#[test]
fn shared_prefixes_never_return_another_prompts_bytes() {
    let s = store(256);
    let gs = groups();
    let a = ns().chain_keys(&tokens(8, 4, 1), 16);
    let b = ns().chain_keys(&tokens(8, 4, 2), 16);
    assert_eq!(a[..4], b[..4]);
    assert_ne!(a[4], b[4]);
    put_prefix(&s, &gs, &a, &[3, 7]);
    put_prefix(&s, &gs, &b, &[7]);
    assert_eq!(s.lookup_groups(&gs, &b).blocks, 8);
    // B's last state goes: B's hit falls back to the shared 4 blocks, whose state A stored (the
    // same tokens, so the same keys and bytes).
    s.remove(&[part_key(b[7], 2, 0)]);
    assert_eq!(s.lookup_groups(&gs, &b).blocks, 4);
    get_exact(&s, &gs, &b, 4);
    // Without A's state at block 3, nothing of B is usable; A still hits in full.
    s.remove(&[part_key(a[3], 2, 0)]);
    assert_eq!(s.lookup_groups(&gs, &b).blocks, 0);
    assert_eq!(s.lookup_groups(&gs, &a).blocks, 8);
    get_exact(&s, &gs, &a, 8);
}

#[test]
fn eviction_under_pressure_keeps_every_hit_whole_and_exact() {
    // 60 slots; each 8-block prefix with states at 3 and 7 takes 8 + 8 + 6 = 22.
    let s = store(60);
    let gs = groups();
    let mut stored: Vec<Vec<BlockKey>> = Vec::new();
    for seed in 0..12u64 {
        let keys = chain(8, 100 + seed);
        let mut want: Vec<(usize, usize)> = (0..8).flat_map(|b| [(b, 0), (b, 1)]).collect();
        want.extend([(3, 2), (7, 2)]);
        let data: Vec<Vec<u8>> = want
            .iter()
            .map(|&(b, g)| part_bytes(keys[b], g, len_of(g)))
            .collect();
        let parts: Vec<GroupPart<&[u8]>> = want
            .iter()
            .zip(&data)
            .map(|(&(block, group), d)| GroupPart {
                block,
                group,
                data: d.as_slice(),
            })
            .collect();
        s.put_groups_from_host(&gs, None, &keys, &parts).unwrap();
        stored.push(keys);
        for keys in &stored {
            let h = s.lookup_groups(&gs, keys);
            assert!(h.blocks == 0 || h.blocks == 4 || h.blocks == 8, "{h:?}");
            if h.blocks > 0 {
                get_exact(&s, &gs, keys, h.blocks);
            }
        }
        s.debug_check().unwrap();
    }
    // The newest prefix is whole.
    assert_eq!(s.lookup_groups(&gs, stored.last().unwrap()).blocks, 8);
}

#[test]
fn a_uniform_model_is_one_group_with_the_plain_keys() {
    let s = store(32);
    let gs = StoreGroups::uniform(3000, 16, CHUNK).unwrap();
    let keys = chain(5, 4);
    assert_eq!(gs.part_keys(keys[2], 0), vec![keys[2]]);
    assert_eq!(gs.spine_keys(&keys), keys);
    put_chain(&s, &keys, 3000);
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 5);
    assert_eq!(s.lookup(&keys), 5);
    s.remove(&[keys[3]]);
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 3);
}

#[test]
fn bad_parts_are_refused() {
    let s = store(32);
    let gs = groups();
    let keys = chain(2, 5);
    let full = vec![1u8; FULL as usize];
    let short = vec![1u8; 10];
    fn part(block: usize, group: usize, data: &[u8]) -> GroupPart<&[u8]> {
        GroupPart { block, group, data }
    }
    let check = |parts: &[GroupPart<&[u8]>]| {
        let e = s.put_groups_from_host(&gs, None, &keys, parts).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    };
    check(&[part(0, 0, &full), part(1, 0, &short)]);
    check(&[part(0, 0, &full), part(0, 0, &full), part(1, 0, &full)]);
    check(&[part(0, 0, &full)]); // block 1 has no full part
    check(&[part(0, 0, &full), part(1, 0, &full), part(2, 1, &full)]);
    check(&[part(0, 0, &full), part(1, 0, &full), part(0, 9, &full)]);
    assert!(StoreGroups::new(vec![], 16, CHUNK).is_err());
    assert_eq!(s.lookup(&keys), 0, "nothing was stored");
}

const CHILD_ENV: &str = "TPU_SYNC_STORE_GROUPS_CRASH_CHILD";

fn shm_config(name: &str) -> StoreConfig {
    let mut c = config(CHUNK, 128);
    c.shm_name = Some(name.to_string());
    c
}

#[test]
fn warm_restart_serves_the_same_hits() {
    let g = ShmGuard::new("groups");
    let gs = groups();
    let keys = chain(8, 6);
    {
        let s = KvStore::open(shm_config(&g.0)).unwrap();
        put_prefix(&s, &gs, &keys, &[3, 7]);
        assert_eq!(s.lookup_groups(&gs, &keys).blocks, 8);
    }
    let s = KvStore::open(shm_config(&g.0)).unwrap();
    assert_eq!(s.info().unwrap().restored_dram_blocks, 8 + 8 + 6);
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 8);
    get_exact(&s, &gs, &keys, 8);
    // The chains survived too: a state part still protects its block from eviction.
    s.remove(&[part_key(keys[7], 2, 0)]);
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 4);
    s.debug_check().unwrap();
}

/// Not a test on its own: the process `sigkill_mid_state_put_serves_the_last_whole_state`
/// starts, which stores a hybrid prefix and stops in the middle of the last state's second
/// chunk.
#[test]
fn groups_crash_child() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let keys = chain(8, 7);
    let kill = part_key(keys[7], 2, 1);
    let mut c = shm_config(&name);
    c.hooks = Hooks {
        mid_write: Some(Arc::new(move |k| {
            if k == kill {
                println!("MIDPUT");
                std::thread::sleep(Duration::from_secs(60));
            }
        })),
        ..Hooks::default()
    };
    let s = KvStore::open(c).unwrap();
    put_prefix(&s, &groups(), &keys, &[3, 7]);
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn sigkill_mid_state_put_serves_the_last_whole_state() {
    let g = ShmGuard::new("groups-crash");
    let mut child = crate::child_test(module_path!(), "groups_crash_child")
        .env(CHILD_ENV, &g.0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(l) if l.contains("MIDPUT") => break,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                panic!("child never reached the middle of the state put");
            }
        }
    }
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    child.wait().unwrap();
    let gs = groups();
    let keys = chain(8, 7);
    let s = KvStore::open(shm_config(&g.0)).unwrap();
    // Block 7's state was half-written: incomplete, so the hit is the 4 blocks of the state at
    // block 3, and no chunk of the half-written state is left (any committed one is removed).
    let h = s.lookup_groups(&gs, &keys);
    assert_eq!((h.blocks, h.spine_blocks), (4, 8));
    for c in 0..3 {
        assert_eq!(s.lookup(&[part_key(keys[7], 2, c)]), 0, "chunk {c}");
    }
    get_exact(&s, &gs, &keys, 4);
    s.debug_check().unwrap();
}

/// A small hybrid: full attention (2 layers), sliding window (2 layers), a TP-split state (2
/// layers), 16-token blocks; every group with its own block count, so layers of different
/// groups have buffers of different sizes. The window of 49 tokens after 96 tokens needs tokens
/// 48..96, whole blocks 3..6 (a stored window part is a whole block).
fn device_layout() -> HybridLayout {
    let attn = |w| GroupKind::Attention {
        num_kv_heads: 2,
        head_dim: 8,
        kv_planes: 2,
        dtype: DType::Bf16,
        sliding_window: w,
    };
    let model = HybridModel {
        name: "tiny-hybrid".into(),
        groups: vec![
            KvGroup::new("full", [1, 4], attn(None)),
            KvGroup::new("sliding", [0, 3], attn(Some(49))),
            KvGroup::new(
                "linear",
                [2, 5],
                GroupKind::State {
                    components: vec![
                        StateComponent::new("conv", DType::Bf16, 3, &[(2, 8), (2, 8), (4, 8)]),
                        StateComponent::new("ssm", DType::F32, 1, &[(4, 64)]),
                    ],
                    replicated: false,
                },
            ),
        ],
    };
    let spec = ParallelSpec::parse("block=16,order=hnd").unwrap();
    HybridLayout::new(
        model,
        spec,
        vec![
            GroupLayout::new(24),
            GroupLayout::new(9),
            GroupLayout::new(5),
        ],
    )
    .unwrap()
}

#[test]
fn device_parts_round_trip_into_other_blocks() {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let dev = client.device(0).unwrap();
    let layout = device_layout();
    let tokens = 6 * 16;
    // Source and destination placements: the window group holds its last blocks only, the
    // state group one slot.
    let place = |ids: [Vec<u32>; 3]| HybridPlacement {
        layout: layout.clone(),
        dp_rank: 0,
        block_ids: ids.into_iter().map(|v| vec![v]).collect(),
        first_token: 0,
        next_token: None,
    };
    assert_eq!(layout.window_blocks(1, tokens).unwrap(), 3..6);
    let src = place([vec![17, 3, 9, 22, 0, 11], vec![4, 8, 1], vec![2]]);
    let dst = place([vec![5, 20, 1, 14, 8, 19], vec![0, 6, 3], vec![4]]);
    src.validate(tokens).unwrap();
    dst.validate(tokens).unwrap();
    let buffers = |p: &HybridPlacement, salt| -> Vec<DeviceBuffer> {
        let c = GroupedContents::new(p, 0, tokens, salt).unwrap();
        (0..layout.num_layers())
            .map(|l| {
                let shape = layout.layer_shape(l).unwrap();
                let mut host = vec![0u8; shape.bytes as usize];
                c.fill_layer(l, &mut host).unwrap();
                client
                    .buffer_from_host(&host, shape.element_type, &shape.dims, &dev)
                    .unwrap()
            })
            .collect()
    };
    let src_bufs = buffers(&src, 1);
    let empty = HybridPlacement {
        dp_rank: u32::MAX,
        block_ids: vec![],
        first_token: 0,
        next_token: None,
        ..dst.clone()
    };
    let dst_bufs = buffers(&empty, 2);
    assert_ne!(
        src_bufs[0].on_device_size(),
        src_bufs[1].on_device_size(),
        "layers of different groups have differently sized buffers"
    );

    let gs = StoreGroups::from_layout(&layout, 16, 8192).unwrap();
    assert_eq!(gs.groups()[1].role, PartRole::Window { tokens: 49 });
    let s = KvStore::open(config(8192, 64)).unwrap();
    let keys = chain(6, 8);
    // Full parts of every block, window parts of the 3 window blocks, the state at block 5.
    let mut want: Vec<(usize, usize, u32)> =
        (0..6).map(|b| (b, 0, src.block_ids[0][0][b])).collect();
    want.extend((3..6).map(|b| (b, 1, src.block_ids[1][0][b - 3])));
    want.push((5, 2, src.block_ids[2][0][0]));
    let parts: Vec<GroupPart<DeviceBlock>> = want
        .iter()
        .map(|&(block, group, id)| GroupPart {
            block,
            group,
            data: DeviceBlock::group_part(&layout, group, &src_bufs, id).unwrap(),
        })
        .collect();
    let r = s.put_groups_from_device(&gs, None, &keys, &parts).unwrap();
    assert!(r.complete(), "{r:?}");
    assert_eq!(s.lookup_groups(&gs, &keys).blocks, 6);
    for b in &src_bufs {
        b.delete().unwrap();
    }
    // Load the hit into the destination's blocks.
    let req = gs.required_parts(6);
    assert_eq!(req.len(), 6 + 3 + 1);
    let dparts: Vec<GroupPart<DeviceBlock>> = req
        .iter()
        .map(|&(block, group)| {
            let id = match group {
                0 => dst.block_ids[0][0][block],
                1 => dst.block_ids[1][0][block - 3],
                _ => dst.block_ids[2][0][0],
            };
            GroupPart {
                block,
                group,
                data: DeviceBlock::group_part(&layout, group, &dst_bufs, id).unwrap(),
            }
        })
        .collect();
    let lease = s.pin_groups(&gs, &keys, 6).unwrap();
    let r = s.get_groups_to_device(&caps, &gs, &keys, &dparts).unwrap();
    assert!(r.complete(dparts.len()), "{r:?}");
    drop(lease);
    // Every destination byte: the request where the placement says, untouched elsewhere.
    let c = GroupedContents::new(&dst, 0, tokens, 2).unwrap();
    let mut request = 0;
    for (l, b) in dst_bufs.iter().enumerate() {
        let mut host = vec![0u8; c.layer_bytes(l as u32).unwrap() as usize];
        b.to_host(&mut host).unwrap();
        let chk = c.verify_layer(l as u32, &host).unwrap();
        assert_eq!(chk.mismatches, 0, "layer {l}: {:?}", chk.first_mismatch);
        request += chk.request_bytes;
    }
    assert_eq!(
        request,
        dst.needed_bytes(tokens).unwrap().iter().sum::<u64>()
    );
}

#[test]
fn store_windows_are_the_layouts_windows() {
    // The host tier's window rule and the planner's agree for every prefix length and window.
    for w in [1u32, 2, 15, 16, 17, 40, 49, 128] {
        let mut layout = device_layout();
        if let GroupKind::Attention { sliding_window, .. } = &mut layout.model.groups[1].kind {
            *sliding_window = Some(w);
        }
        let gs = StoreGroups::from_layout(&layout, 16, 8192).unwrap();
        for n in 0..12usize {
            let l = layout.window_blocks(1, n as u32 * 16).unwrap();
            let want = if n == 0 {
                0..0
            } else {
                l.start as usize..l.end as usize
            };
            let got = gs.window_blocks(1, n);
            assert!(
                got == want || (got.is_empty() && want.is_empty()),
                "window {w}, {n} blocks: store {got:?}, layout {want:?}"
            );
        }
    }
}
