//! The host KV tier with real PJRT device blocks (XLA CPU plugin), and `tpu-sync store-demo` /
//! `tpu-sync shm` as a user runs them: put from device blocks, restart as a new process, load
//! into other device blocks, verify every byte.

use crate::common;
use crate::store_util;

use std::time::Duration;

use store_util::*;
use tpu_sync::layout::{BlockOrder, DType, KvLayout, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::pattern::{LayerCheck, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::Placement;
use tpu_sync::store::{DeviceBlock, DiskOptions, DmaStatus, KvStore};
use tpu_sync::Error;

const LIMIT: Duration = Duration::from_secs(180);

struct Dev {
    client: Client,
    caps: Capabilities,
    layout: ParallelLayout,
    kv: KvLayout,
}

fn dev() -> Dev {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = 3;
    let spec = ParallelSpec::parse("block=16,order=hnd").unwrap();
    let layout = ParallelLayout::new(m, spec, 24).unwrap();
    let kv = layout.rank_kv().unwrap();
    assert_eq!(kv.order, BlockOrder::Hnd);
    assert_eq!(kv.dtype, DType::Bf16);
    Dev {
        client,
        caps,
        layout,
        kv,
    }
}

impl Dev {
    fn placement(&self, ids: Vec<u32>) -> Placement {
        Placement {
            first_token: 0,
            layout: self.layout.clone(),
            dp_rank: 0,
            block_ids: vec![ids],
            groups: None,
        }
    }
    fn buffers(&self, c: &RankContents) -> Vec<DeviceBuffer> {
        let d = self.client.device(0).unwrap();
        let mut host = vec![0u8; self.kv.buffer_bytes() as usize];
        (0..self.kv.num_layers)
            .map(|l| {
                c.fill_layer(l, &mut host).unwrap();
                self.client
                    .buffer_from_host(&host, self.kv.dtype.element_type(), &self.kv.dims(), &d)
                    .unwrap()
            })
            .collect()
    }
    fn block_bytes(&self) -> u64 {
        self.kv.num_layers as u64 * 2 * self.kv.block_bytes()
    }
}

fn verify(d: &Dev, place: &Placement, tokens: u32, salt: u64, bufs: &[DeviceBuffer]) -> LayerCheck {
    let c = RankContents::new(place, 0, tokens, salt).unwrap();
    let mut host = vec![0u8; d.kv.buffer_bytes() as usize];
    let mut total = LayerCheck::default();
    for (l, b) in bufs.iter().enumerate() {
        b.to_host(&mut host).unwrap();
        total.merge(c.verify_layer(l as u32, &host).unwrap());
    }
    total
}

#[test]
fn device_blocks_round_trip_through_the_tier_into_other_blocks() {
    let d = dev();
    let tokens = 6 * 16;
    let src_ids = vec![17, 3, 9, 22, 0, 11];
    let dst_ids = vec![5, 20, 1, 14, 8, 19];
    let src = d.placement(src_ids.clone());
    let src_bufs = d.buffers(&RankContents::new(&src, 0, tokens, 1).unwrap());
    let empty = d.placement(vec![]);
    let dst_bufs = d.buffers(&RankContents::new(&empty, 0, tokens, 2).unwrap());

    let mut c = config(d.block_bytes(), 4);
    c.dma_client = Some(d.client.clone());
    let dir = TempDir::new("dev");
    c.disk = Some(DiskOptions::new(&dir.0, 64 << 20));
    let s = KvStore::open(c).unwrap();
    match s.info().unwrap().dma {
        DmaStatus::Unavailable(m) => assert!(m.contains("UNIMPLEMENTED"), "{m}"),
        other => panic!("the CPU plugin has no DmaMap: {other:?}"),
    }
    let keys = chain(6, 11);
    let blocks: Vec<DeviceBlock> = src_ids
        .iter()
        .map(|&id| DeviceBlock::kv_block(&d.kv, &src_bufs, id).unwrap())
        .collect();
    assert_eq!(blocks[0].len(), d.block_bytes());
    assert_eq!(blocks[0].pieces().len(), 6);
    let r = s.put_from_device(None, &keys, &blocks).unwrap();
    assert_eq!((r.stored, r.bytes), (6, 6 * d.block_bytes()));
    // 4 DRAM slots: 2 blocks went to disk.
    let l = s.lookup_detail(&keys);
    assert_eq!((l.hits, l.in_dram, l.disk_only), (6, 4, 2));
    // The device copy goes away; the tier still has it.
    for b in &src_bufs {
        b.delete().unwrap();
    }
    let dst: Vec<DeviceBlock> = dst_ids
        .iter()
        .map(|&id| DeviceBlock::kv_block(&d.kv, &dst_bufs, id).unwrap())
        .collect();
    let g = s.get_to_device(&d.caps, &keys, &dst).unwrap();
    assert_eq!((g.delivered, g.from_dram, g.from_disk), (6, 4, 2), "{g:?}");
    let check = verify(&d, &d.placement(dst_ids), tokens, 2, &dst_bufs);
    assert_eq!(check.mismatches, 0, "{:?}", check.first_mismatch);
    assert_eq!(check.request_bytes, 6 * d.block_bytes());
    assert!(check.background_bytes > 0);
}

#[test]
fn device_errors_store_nothing_and_bad_destinations_are_refused() {
    let d = dev();
    let src = d.placement(vec![1, 2]);
    let bufs = d.buffers(&RankContents::new(&src, 0, 32, 1).unwrap());
    let s = KvStore::open(config(d.block_bytes(), 4)).unwrap();
    let keys = chain(2, 12);
    // A block id outside the layout.
    assert!(matches!(
        DeviceBlock::kv_block(&d.kv, &bufs, 24),
        Err(Error::BlockRange(_))
    ));
    assert!(DeviceBlock::kv_block(&d.kv, &bufs[..2], 0).is_err());
    // A deleted buffer: the put fails and stores nothing.
    let other = d.buffers(&RankContents::new(&src, 0, 32, 1).unwrap());
    other[1].delete().unwrap();
    let blocks = vec![
        DeviceBlock::kv_block(&d.kv, &bufs, 1).unwrap(),
        DeviceBlock::kv_block(&d.kv, &other, 2).unwrap(),
    ];
    let e = s.put_from_device(None, &keys, &blocks).unwrap_err();
    assert!(e.to_string().contains("deleted"), "{e}");
    assert_eq!(s.lookup(&keys), 0);
    assert_eq!(s.stats().free_slots, 4, "aborted slots are free again");
    // The store still works, and a destination of the wrong size is refused.
    let good = vec![
        DeviceBlock::kv_block(&d.kv, &bufs, 1).unwrap(),
        DeviceBlock::kv_block(&d.kv, &bufs, 2).unwrap(),
    ];
    assert_eq!(s.put_from_device(None, &keys, &good).unwrap().stored, 2);
    let mut short = DeviceBlock::kv_block(&d.kv, &bufs, 5)
        .unwrap()
        .pieces()
        .to_vec();
    short.pop();
    let e = s
        .get_to_device(&d.caps, &keys[..1], &[DeviceBlock::new(short)])
        .unwrap_err();
    assert!(e.to_string().contains("destination 0"), "{e}");
    s.debug_check().unwrap();
}

// ------------------------------------------------------------------ the CLI

fn store_demo(extra: &[&str]) -> String {
    let mut args = vec!["store-demo", "--layers", "2", "--tokens", "256"];
    args.extend_from_slice(extra);
    let o = common::tpu_sync(&args, LIMIT);
    let t = common::text(&o);
    assert!(o.status.success(), "store-demo {extra:?} failed:\n{t}");
    let v = t
        .lines()
        .find(|l| l.starts_with("verified:"))
        .unwrap_or_else(|| panic!("no verified line:\n{t}"));
    // 256 tokens x 2 layers x 2 planes x 8 heads x 128 dims x 2 bytes.
    assert!(
        v.starts_with("verified: 2097152 bytes, 16 blocks, 2 layers"),
        "{v}"
    );
    assert!(!t.contains("panicked"), "{t}");
    t
}

#[test]
fn store_demo_restarts_from_a_per_run_segment() {
    let t = store_demo(&[]);
    assert!(t.contains("killed (signal: 9 (SIGKILL))"), "{t}");
    assert!(t.contains("tier re-attached"), "{t}");
    assert!(t.contains("lookup: 16/16 blocks hit (100.0%)"), "{t}");
    assert!(t.contains("(16 from DRAM, 0 from disk)"), "{t}");
    let name = t
        .split("per-run shm segment ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap()
        .to_string();
    assert!(
        !tpu_sync::store::shm::segment_path(std::path::Path::new("/dev/shm"), &name).exists(),
        "the per-run segment {name} is removed"
    );
}

#[test]
fn store_demo_restarts_from_disk_and_from_both_tiers() {
    let d = TempDir::new("cli-disk");
    let t = store_demo(&["--disk", d.0.to_str().unwrap()]);
    assert!(t.contains("16 flushed to disk"), "{t}");
    assert!(t.contains("(0 from DRAM, 16 from disk)"), "{t}");
    let shm = ShmGuard::new("cli");
    let d2 = TempDir::new("cli-both");
    let t = store_demo(&["--disk", d2.0.to_str().unwrap(), "--shm", &shm.0]);
    assert!(t.contains("8 spilled to disk"), "{t}");
    assert!(t.contains("(8 from DRAM, 8 from disk)"), "{t}");
    // The named segment is kept, listed, and removed by `shm rm`.
    let o = common::tpu_sync(&["shm", "list"], LIMIT);
    let l = common::text(&o);
    assert!(o.status.success(), "{l}");
    let line = l
        .lines()
        .find(|x| x.starts_with(&shm.0))
        .unwrap_or_else(|| panic!("{l}"));
    assert!(line.contains(" no ") && line.contains("8/8"), "{line}");
    let o = common::tpu_sync(&["shm", "rm", &shm.0], LIMIT);
    assert!(o.status.success(), "{}", common::text(&o));
    assert!(!shm.path().exists());
    let o = common::tpu_sync(&["shm", "rm", &shm.0], LIMIT);
    assert!(!o.status.success());
}

#[test]
fn store_demo_runs_on_the_io_fallback_and_refuses_bad_flags() {
    let d = TempDir::new("cli-fallback");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tpu-sync"));
    cmd.args(["store-demo", "--layers", "2", "--tokens", "128", "--disk"])
        .arg(&d.0)
        .env("TPU_SYNC_PJRT_PLUGIN", common::plugin_path())
        .env("TPU_SYNC_STORE_IO_URING", "0");
    let o = common::run_with_limit(cmd, LIMIT);
    let t = common::text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("pwritev/preadv (io_uring turned off by TPU_SYNC_STORE_IO_URING)"),
        "{t}"
    );
    assert!(t.lines().any(|l| l.starts_with("verified:")), "{t}");
    // A prompt that does not fill its last block: the full blocks are stored, as an engine does,
    // and the demo says so.
    let o = common::tpu_sync(&["store-demo", "--layers", "2", "--tokens", "100"], LIMIT);
    let t = common::text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("--tokens 100 is not a multiple of the block size 16: storing the 6 full blocks (96 tokens)"),
        "{t}"
    );
    assert!(
        t.lines()
            .any(|l| l.starts_with("verified:") && l.contains("6 blocks")),
        "{t}"
    );
    for (args, msg) in [
        (
            &["store-demo", "--tokens", "10"][..],
            "fewer than one full block",
        ),
        (&["store-demo", "--layout", "tp=2"][..], "one rank"),
        (
            &["store-demo", "--capacity-blocks", "0"][..],
            "--capacity-blocks 0",
        ),
        (&["store-demo", "--shm", "a/b"][..], "segment name"),
        (
            &["store-demo", "--preset", "gpt-9"][..],
            "unknown model preset",
        ),
    ] {
        let o = common::tpu_sync(args, LIMIT);
        let t = common::text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains(msg), "{args:?}: {t}");
    }
}
