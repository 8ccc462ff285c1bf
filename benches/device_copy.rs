//! Device <-> host copies of KV blocks through the PJRT plugin, against `memcpy` of the same bytes
//! in the same run.
//!
//! Shape: 32 layers, each a `[2, 128, 16, 8, 128]` bf16 buffer (vLLM NHD, llama-3.1-8b heads); the
//! request is 64 scattered blocks per layer, so one batch moves 32 x 64 x 2 x 32 KiB = 128 MiB in
//! 4096 block copies. Baseline: `memcpy` of the same 4096 block-sized pieces between two host
//! buffers. Measured, all through the copy engine (`tpu_sync::device`):
//! * `d2h_copy_raw_to_host`: the blocking helper `d2h_batch` (global pacer, defaults 16 MiB
//!   chunks / 64 MiB in flight, at most 256 chunks of the batch outstanding);
//! * `d2h_batch_await`: one `CopyBatch` submitted to the global pacer and `.await`ed (tokio
//!   current-thread runtime), no per-batch window: only the pacer's 64 MiB budget;
//! * `d2h_unpaced`: the same batch on a pacer with pacing disabled (0 / 0), the cost of pacing;
//! * `h2d_in_place`: the blocking helper `h2d_batch` by the probed in-place path.
//!
//! At the end the ratio (time / memcpy time) of each is printed from criterion's own estimates
//! of this run, with the global pacer's counters.
//!
//! Run: `make bench` (needs the plugin: `make plugin`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, Criterion, Throughput};
use tpu_sync::arena::{ArenaOptions, PinnedArena};
use tpu_sync::device::{d2h_batch, h2d_batch, CopyBatch, Pacer, PacingConfig, RawCopy};
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
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let batch = |ops: &[RawCopy<'_>]| {
        let mut b = CopyBatch::d2h();
        for o in ops {
            b.push(o.buffer, o.offset, o.len, o.host).expect("push");
        }
        b
    };
    g.bench_function("d2h_batch_await", |b| {
        b.iter(|| {
            let batch = batch(&ops);
            rt.block_on(async {
                // SAFETY: the arena outlives the awaited handle and nothing else touches it.
                let h = unsafe { batch.submit(Pacer::global()) }.expect("submit");
                h.await.expect("d2h")
            })
        })
    });
    let unpaced = Pacer::new(PacingConfig {
        chunk_bytes: 0,
        max_inflight_bytes: 0,
    })
    .expect("pacer");
    g.bench_function("d2h_unpaced", |b| {
        b.iter(|| {
            let batch = batch(&ops);
            // SAFETY: as above; waited before the next iteration.
            let h = unsafe { batch.submit(&unpaced) }.expect("submit");
            h.wait().expect("d2h")
        })
    });
    g.bench_function("h2d_in_place", |b| {
        // SAFETY: the arena outlives the batch and is not written meanwhile.
        b.iter(|| unsafe { h2d_batch(&s.caps, &ops) }.expect("h2d"))
    });
    g.finish();
    // The copies must have moved the device bytes: every arena slot holds its block of the
    // pattern the buffers were created with (H2D wrote the same bytes back).
    let bb = s.kv.block_bytes() as usize;
    for (slot, op) in ops.iter().enumerate().step_by(97) {
        let expect: Vec<u8> = (0..bb)
            .map(|j| ((op.offset as usize + j) * 31 + 7) as u8)
            .collect();
        // SAFETY: no batch runs now.
        let got = unsafe { s.arena.slice((slot * bb) as u64, bb as u64) }.expect("arena");
        assert_eq!(
            got,
            &expect[..],
            "benchmark copies produced wrong bytes (slot {slot})"
        );
    }
}

fn estimate(id: &str) -> Option<f64> {
    let dir = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| format!("{}/target", env!("CARGO_MANIFEST_DIR")));
    let p = format!("{dir}/criterion/kv_blocks/{id}/new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v["mean"]["point_estimate"].as_f64()
}

fn report() {
    let Some(m) = estimate("memcpy") else {
        return;
    };
    let gb = (LAYERS * REQUEST_BLOCKS * 2 * 16 * 8 * 128 * 2) as f64 / 1e9;
    println!("\nratios against memcpy of the same bytes in this run (time / memcpy time; 1.00 = memcpy speed):");
    println!(
        "  memcpy                         {:.2} GB/s",
        gb / (m * 1e-9)
    );
    for (id, name) in [
        ("d2h_copy_raw_to_host", "D2H CopyRawToHost (d2h_batch)"),
        ("d2h_batch_await", "D2H one batch, .await"),
        ("d2h_unpaced", "D2H one batch, unpaced"),
        ("h2d_in_place", "H2D in place (h2d_batch)"),
    ] {
        if let Some(t) = estimate(id) {
            println!(
                "  {name:<31}{:.2} GB/s  ratio {:.2}",
                gb / (t * 1e-9),
                t / m
            );
        }
    }
    let st = Pacer::global().stats();
    println!(
        "  global pacer: {} chunks, {:.1} GB, peak in flight {:.1} MiB (limit {:.1} MiB)",
        st.chunks,
        st.bytes as f64 / 1e9,
        st.peak_inflight_bytes as f64 / (1 << 20) as f64,
        st.config.max_inflight_bytes as f64 / (1 << 20) as f64
    );
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    report();
}
