//! Device <-> host copies of KV blocks through the PJRT plugin, against `memcpy` of the same bytes
//! in the same run.
//!
//! Shape: 32 layers, each a `[2, 128, 16, 8, 128]` bf16 buffer (vLLM NHD, llama-3.1-8b heads); the
//! request is 64 scattered blocks per layer, so one batch moves 32 x 64 x 2 x 32 KiB = 128 MiB in
//! 4096 block copies. Baseline: `memcpy` of the same 4096 block-sized pieces between two host
//! buffers. At the end the ratio (PJRT time / memcpy time) is printed for D2H and H2D, from
//! criterion's own estimates of this run.
//!
//! Run: `make bench` (needs the plugin: `make plugin`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, Criterion, Throughput};
use tpu_sync::arena::{ArenaOptions, PinnedArena};
use tpu_sync::device::{d2h_batch, h2d_batch, RawCopy};
use tpu_sync::layout::{BlockOrder, DType, KvLayout};
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, Plugin};

const LAYERS: u32 = 32;
const REQUEST_BLOCKS: u32 = 64;

struct Setup {
    caps: Capabilities,
    buffers: Vec<DeviceBuffer>,
    kv: KvLayout,
    ids: Vec<u32>,
    arena: PinnedArena,
    src_host: PinnedArena,
}

fn setup() -> Setup {
    let plugin = Plugin::load_default().expect("PJRT plugin (run `make plugin`)");
    let client = Client::create(
        &plugin,
        &ClientOptions {
            cpu_device_count: Some(1),
        },
    )
    .expect("client");
    let caps = Capabilities::probe(&client).expect("caps");
    let kv = KvLayout {
        num_layers: LAYERS,
        kv_planes: 2,
        num_blocks: 128,
        block_size: 16,
        num_heads: 8,
        head_dim: 128,
        dtype: DType::Bf16,
        order: BlockOrder::Nhd,
    };
    let dev = client.device(0).expect("device 0");
    let host: Vec<u8> = (0..kv.buffer_bytes()).map(|i| (i * 31 + 7) as u8).collect();
    let buffers = (0..LAYERS)
        .map(|_| {
            client
                .buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &dev)
                .expect("buffer")
        })
        .collect();
    // Every other block, reversed: scattered like a real request.
    let ids: Vec<u32> = (0..REQUEST_BLOCKS).rev().map(|i| i * 2).collect();
    let bytes = (LAYERS * REQUEST_BLOCKS * 2) as usize * kv.block_bytes() as usize;
    let arena = PinnedArena::new(bytes, &ArenaOptions::default()).expect("arena");
    let src_host = PinnedArena::new(bytes, &ArenaOptions::default()).expect("arena");
    Setup {
        caps,
        buffers,
        kv,
        ids,
        arena,
        src_host,
    }
}

impl Setup {
    fn ops(&self) -> Vec<RawCopy<'_>> {
        let bb = self.kv.block_bytes();
        let mut ops = Vec::new();
        let mut slot = 0u64;
        for b in &self.buffers {
            for plane in 0..2 {
                for &id in &self.ids {
                    ops.push(RawCopy {
                        buffer: b,
                        offset: self.kv.block_offset(plane, id),
                        len: bb,
                        host: self.arena.ptr_at(slot * bb, bb).expect("in arena"),
                    });
                    slot += 1;
                }
            }
        }
        ops
    }

    fn memcpy_pieces(&self) {
        let bb = self.kv.block_bytes() as usize;
        let n = self.arena.len() / bb;
        for i in 0..n {
            // Same scattered source pattern as the device copies (reversed blocks).
            let src = (n - 1 - i) * bb;
            // SAFETY: both ranges are inside their arenas (n * bb <= len); distinct mappings.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.src_host.base().add(src),
                    self.arena.base().add(i * bb),
                    bb,
                );
            }
        }
        black_box(self.arena.base());
    }
}

fn bench(c: &mut Criterion) {
    let s = setup();
    let ops = s.ops();
    let bytes: u64 = ops.iter().map(|o| o.len).sum();
    let mut g = c.benchmark_group("kv_blocks");
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(4));
    g.warm_up_time(Duration::from_secs(1));
    g.bench_function("memcpy", |b| b.iter(|| s.memcpy_pieces()));
    g.bench_function("d2h_copy_raw_to_host", |b| {
        // SAFETY: the arena outlives the batch and nothing else touches it.
        b.iter(|| unsafe { d2h_batch(&ops, 256) }.expect("d2h"))
    });
    g.bench_function("h2d_in_place", |b| {
        // SAFETY: the arena outlives the batch and is not written meanwhile.
        b.iter(|| unsafe { h2d_batch(&s.caps, &ops) }.expect("h2d"))
    });
    g.finish();
}

fn estimate(id: &str) -> Option<f64> {
    let dir = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| format!("{}/target", env!("CARGO_MANIFEST_DIR")));
    let p = format!("{dir}/criterion/kv_blocks/{id}/new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v["mean"]["point_estimate"].as_f64()
}

fn report() {
    let (Some(m), Some(d), Some(h)) = (
        estimate("memcpy"),
        estimate("d2h_copy_raw_to_host"),
        estimate("h2d_in_place"),
    ) else {
        return;
    };
    let gb = (LAYERS * REQUEST_BLOCKS * 2 * 16 * 8 * 128 * 2) as f64 / 1e9;
    println!("\nratios against memcpy of the same bytes in this run (time / memcpy time; 1.00 = memcpy speed):");
    println!("  memcpy               {:.2} GB/s", gb / (m * 1e-9));
    println!(
        "  D2H CopyRawToHost    {:.2} GB/s  ratio {:.2}",
        gb / (d * 1e-9),
        d / m
    );
    println!(
        "  H2D in place         {:.2} GB/s  ratio {:.2}",
        gb / (h * 1e-9),
        h / m
    );
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    report();
}
