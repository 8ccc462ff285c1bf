//! KV-block copies through a PJRT plugin with the tpu-sync copy engine, for the GPU check
//! (`benches/gpu/run.sh` runs it against the CUDA plugin and compares with `cudaMemcpy`).
//!
//! Shape (as `benches/device_copy.rs`): 32 layers, each a `[2, 128, 16, 8, 128]` bf16 buffer
//! (8 MiB, vLLM NHD, llama-3.1-8b heads); the request is 64 scattered blocks per layer and plane
//! (every other block id, reversed), so one batch moves 32 x 64 x 2 x 32 KiB = 128 MiB in 4096
//! copies of 32 KiB into a pinned, DMA-mapped host arena.
//!
//! Measured: D2H (`PJRT_Buffer_CopyRawToHost` per block, one batch, global pacer defaults; and
//! with pacing off), in-place H2D by the probed path (or the reason it is unsupported), and a
//! check of a view (`PJRT_Client_CreateViewOfDeviceBuffer`) over a real device pointer.
//! Bytes are verified, not assumed. The last line is `RESULT {json}` for `run.sh`.
//!
//! Usage: `gpu_copy --plugin PATH [--iters N] [--cpu-devices N]`. Built by `benches/gpu/build.sh`
//! (a `[[bench]]` with `harness = false`, so `cargo bench --bench gpu_copy -- --plugin ...` works
//! too). Runs against the CPU plugin as well, which is how it is tested without a GPU.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tpu_sync::arena::{ArenaOptions, DmaRegistration, PinnedArena};
use tpu_sync::device::{CopyBatch, Pacer, PacingConfig};
use tpu_sync::layout::{BlockOrder, DType, KvLayout};
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, ElementType, Plugin};

const LAYERS: u32 = 32;
const REQUEST_BLOCKS: u32 = 64;

struct Args {
    plugin: Option<PathBuf>,
    iters: usize,
    cpu_devices: Option<i64>,
}

fn args() -> Args {
    let mut a = Args {
        plugin: None,
        iters: 10,
        cpu_devices: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--plugin" => a.plugin = it.next().map(PathBuf::from),
            "--iters" => a.iters = it.next().and_then(|v| v.parse().ok()).unwrap_or(10).max(1),
            "--cpu-devices" => a.cpu_devices = it.next().and_then(|v| v.parse().ok()),
            "--bench" => {} // passed by `cargo bench`
            other => eprintln!("gpu_copy: ignoring argument {other}"),
        }
    }
    a
}

/// Byte `i` of layer `l`'s initial contents: non-zero, differs per layer and position.
fn byte(l: u32, i: u64) -> u8 {
    (tpu_sync::pattern::mix64(i ^ ((l as u64) << 40)) as u8) | 1
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

struct Ops {
    /// (layer, device offset, arena offset) per 32 KiB block copy.
    list: Vec<(usize, u64, u64)>,
    block: u64,
}

fn ops(kv: &KvLayout) -> Ops {
    let ids: Vec<u32> = (0..REQUEST_BLOCKS).rev().map(|i| i * 2).collect();
    let bb = kv.block_bytes();
    let mut list = Vec::new();
    let mut slot = 0u64;
    for l in 0..LAYERS as usize {
        for plane in 0..kv.kv_planes {
            for &id in &ids {
                list.push((l, kv.block_offset(plane, id), slot * bb));
                slot += 1;
            }
        }
    }
    Ops { list, block: bb }
}

fn d2h_batch(bufs: &[DeviceBuffer], ops: &Ops, arena: &PinnedArena) -> CopyBatch {
    let mut b = CopyBatch::d2h();
    for &(l, off, at) in &ops.list {
        b.push(
            &bufs[l],
            off,
            ops.block,
            arena.ptr_at(at, ops.block).expect("arena"),
        )
        .expect("push");
    }
    b
}

fn verify_arena(arena: &PinnedArena, ops: &Ops) -> Result<(), String> {
    for (k, &(l, off, at)) in ops.list.iter().enumerate() {
        // SAFETY: no copy runs while verifying.
        let got = unsafe { arena.slice(at, ops.block) }.map_err(|e| e.to_string())?;
        for (j, &g) in got.iter().enumerate().step_by(61) {
            let want = byte(l as u32, off + j as u64);
            if g != want {
                return Err(format!(
                    "copy {k} (layer {l}, device offset {}): byte {j} is {g:#x}, expected {want:#x}",
                    off
                ));
            }
        }
    }
    Ok(())
}

fn time_d2h(
    bufs: &[DeviceBuffer],
    ops: &Ops,
    arena: &PinnedArena,
    pacer: &Pacer,
    iters: usize,
) -> Result<Vec<f64>, String> {
    let mut out = Vec::new();
    for i in 0..iters + 2 {
        // SAFETY: no copy runs now; zero the arena so the check below sees this run's bytes.
        unsafe { std::ptr::write_bytes(arena.base(), 0, arena.len()) };
        let batch = d2h_batch(bufs, ops, arena);
        let t = Instant::now();
        // SAFETY: the arena outlives the wait and nothing else touches it.
        let h = unsafe { batch.submit(pacer) }.map_err(|e| e.to_string())?;
        let st = h.wait().map_err(|e| e.to_string())?;
        let s = t.elapsed().as_secs_f64();
        if st.bytes != ops.list.len() as u64 * ops.block {
            return Err(format!("D2H moved {} bytes", st.bytes));
        }
        if i == 0 || i == iters + 1 {
            verify_arena(arena, ops)?;
        }
        if i >= 2 {
            out.push(s); // the first two are warm-up
        }
    }
    Ok(out)
}

/// The same D2H copies issued straight to the plugin (`copy_raw_to_host_async`, no pacer) by
/// `threads` threads, each issuing its share and then waiting its events; `piece` bytes of each
/// block (a smaller piece shows the fixed cost per call). Returns (median wall time, median
/// longest issue time of one thread), in seconds; the arena is checked after the first run when
/// whole blocks are copied.
fn raw_issue(
    bufs: &[DeviceBuffer],
    ops: &Ops,
    arena: &PinnedArena,
    threads: usize,
    piece: u64,
    iters: usize,
) -> Result<(f64, f64), String> {
    let mut wall = Vec::new();
    let mut issue = Vec::new();
    for i in 0..iters + 1 {
        // SAFETY: no copy runs now.
        unsafe { std::ptr::write_bytes(arena.base(), 0, arena.len()) };
        let per = ops.list.len().div_ceil(threads);
        let t = Instant::now();
        let r: Vec<Result<f64, String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = ops
                .list
                .chunks(per)
                .map(|share| {
                    sc.spawn(move || {
                        let t0 = Instant::now();
                        let mut evs = Vec::with_capacity(share.len());
                        for &(l, off, at) in share {
                            let dst = arena.ptr_at(at, piece).map_err(|e| e.to_string())?;
                            // SAFETY: each copy has its own arena range, not touched until
                            // every event below completed.
                            let ev = unsafe { bufs[l].copy_raw_to_host_async(off, dst, piece) }
                                .map_err(|e| e.to_string())?;
                            evs.push(ev);
                        }
                        let issued = t0.elapsed().as_secs_f64();
                        for ev in evs {
                            ev.wait().map_err(|e| e.to_string())?;
                        }
                        Ok(issued)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let w = t.elapsed().as_secs_f64();
        let mut longest: f64 = 0.0;
        for x in r {
            longest = longest.max(x?);
        }
        if i == 0 && piece == ops.block {
            verify_arena(arena, ops)?;
        }
        if i >= 1 {
            wall.push(w);
            issue.push(longest);
        }
    }
    Ok((median(&mut wall), median(&mut issue)))
}

fn main() {
    let a = args();
    let plugin = match &a.plugin {
        Some(p) => Plugin::load(p),
        None => Plugin::load_default(),
    }
    .unwrap_or_else(|e| fail(&format!("load plugin: {e}")));
    let client = Client::create(
        &plugin,
        &ClientOptions {
            cpu_device_count: a.cpu_devices,
        },
    )
    .unwrap_or_else(|e| fail(&format!("create client: {e}")));
    let caps = Capabilities::probe(&client).unwrap_or_else(|e| fail(&format!("probe: {e}")));
    let dev = client.device(0).unwrap_or_else(|e| fail(&e.to_string()));
    eprintln!(
        "gpu_copy: plugin {} (API {}.{}), platform {} ({}), device {}",
        plugin.path().display(),
        caps.api_version.0,
        caps.api_version.1,
        client.platform_name(),
        client.platform_version(),
        dev.kind().unwrap_or_default()
    );
    eprintln!("  extensions:   {}", caps.extensions.join(", "));
    eprintln!("  D2H path:     {}", caps.d2h);
    eprintln!("  in-place H2D: {}", caps.h2d);
    eprintln!("  DMA map:      {}", caps.dma_map);
    eprintln!("  layouts:      {}", caps.layouts);

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
    let t = Instant::now();
    let bufs: Vec<DeviceBuffer> = (0..LAYERS)
        .map(|l| {
            let host: Vec<u8> = (0..kv.buffer_bytes()).map(|i| byte(l, i)).collect();
            client
                .buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &dev)
                .unwrap_or_else(|e| fail(&format!("buffer_from_host: {e}")))
        })
        .collect();
    let layout = bufs[0].physical_layout().unwrap_or("unknown").to_string();
    eprintln!(
        "  KV buffers:   {LAYERS} x {:?} bf16, on-device {} bytes each, layout {layout} ({:.1} s)",
        kv.dims(),
        bufs[0].on_device_size(),
        t.elapsed().as_secs_f64()
    );
    let ops = ops(&kv);
    let bytes = ops.list.len() as u64 * ops.block;
    let arena = PinnedArena::new(bytes as usize, &ArenaOptions::default())
        .unwrap_or_else(|e| fail(&format!("arena: {e}")));
    let dma = match arena.register_dma(&client) {
        Ok(DmaRegistration::Mapped) => "mapped".to_string(),
        Ok(DmaRegistration::Skipped(w)) => format!("skipped: {w}"),
        Err(e) => format!("failed: {e}"),
    };
    eprintln!(
        "  host arena:   {} MiB, {:?}, DMA {dma}",
        bytes >> 20,
        arena.lock_status()
    );

    // D2H through the global pacer (TPU Sync defaults), then with pacing off.
    let mut d2h = time_d2h(&bufs, &ops, &arena, Pacer::global(), a.iters)
        .unwrap_or_else(|e| fail(&format!("D2H: {e}")));
    let unpaced = Pacer::new(PacingConfig {
        chunk_bytes: 0,
        max_inflight_bytes: 0,
    })
    .unwrap_or_else(|e| fail(&e.to_string()));
    let mut d2h_unpaced = time_d2h(&bufs, &ops, &arena, &unpaced, a.iters)
        .unwrap_or_else(|e| fail(&format!("D2H unpaced: {e}")));
    let d2h_med = median(&mut d2h);
    let d2h_unpaced_med = median(&mut d2h_unpaced);
    eprintln!(
        "  D2H:          {} copies of {} KiB, median {:.3} ms ({:.2} GB/s); unpaced {:.3} ms",
        ops.list.len(),
        ops.block >> 10,
        d2h_med * 1e3,
        bytes as f64 / d2h_med / 1e9,
        d2h_unpaced_med * 1e3
    );

    // Where the time of a per-block D2H goes on this plugin: the same copies issued straight
    // to it by 1..8 threads, and 4 KiB of each block (the fixed cost of one call).
    let mut raw = serde_json::Map::new();
    for (threads, piece) in [
        (1, ops.block),
        (2, ops.block),
        (4, ops.block),
        (8, ops.block),
        (1, 4096),
        (8, 4096),
    ] {
        match raw_issue(&bufs, &ops, &arena, threads, piece, a.iters) {
            Ok((w, i)) => {
                eprintln!(
                    "  raw D2H:      {threads} thread(s), {} x {} KiB: {:.3} ms ({:.2} GB/s, {:.1} us per call; issuing {:.3} ms)",
                    ops.list.len(),
                    piece >> 10,
                    w * 1e3,
                    (ops.list.len() as u64 * piece) as f64 / w / 1e9,
                    w * 1e6 / ops.list.len() as f64,
                    i * 1e3
                );
                raw.insert(
                    format!("t{threads}_{}k", piece >> 10),
                    serde_json::json!({"wall_s": w, "issue_s": i}),
                );
            }
            Err(e) => {
                eprintln!("  raw D2H:      {threads} thread(s): FAILED: {e}");
                raw.insert(
                    format!("t{threads}_{}k", piece >> 10),
                    serde_json::json!({"error": e}),
                );
            }
        }
    }

    // Large calls: whole 8 MiB layer buffers (16 of them, 128 MiB), one call each, all issued
    // then awaited: what one contiguous copy through the plugin costs (the bound a device-side
    // gather followed by one copy would reach).
    let whole = {
        let n = (bytes / bufs[0].on_device_size()).min(bufs.len() as u64) as usize;
        let sz = bufs[0].on_device_size();
        let mut times = Vec::new();
        let mut err = None;
        for i in 0..a.iters + 1 {
            let t = Instant::now();
            let mut evs = Vec::new();
            for (l, b) in bufs.iter().take(n).enumerate() {
                let dst = arena.ptr_at(l as u64 * sz, sz).expect("arena");
                // SAFETY: each buffer has its own arena range, untouched until the events
                // below completed.
                match unsafe { b.copy_raw_to_host_async(0, dst, sz) } {
                    Ok(ev) => evs.push(ev),
                    Err(e) => err = Some(e.to_string()),
                }
            }
            for ev in evs {
                if let Err(e) = ev.wait() {
                    err = Some(e.to_string());
                }
            }
            if i >= 1 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        match err {
            Some(e) => {
                eprintln!("  raw D2H:      whole buffers: FAILED: {e}");
                serde_json::json!({ "error": e })
            }
            None => {
                let m = median(&mut times);
                eprintln!(
                    "  raw D2H:      {n} whole buffers of {} MiB, all issued then awaited: {:.3} ms ({:.2} GB/s)",
                    sz >> 20,
                    m * 1e3,
                    (n as u64 * sz) as f64 / m / 1e9
                );
                serde_json::json!({ "calls": n, "bytes_each": sz, "wall_s": m })
            }
        }
    };
    raw.insert("whole_buffers".into(), whole);

    // In-place H2D by the probed path, verified by reading back.
    let (h2d_med, h2d_unsupported) = match CopyBatch::h2d(&caps) {
        Err(e) => {
            eprintln!("  H2D:          UNSUPPORTED: {e}");
            (None, Some(e.to_string()))
        }
        Ok(_) => {
            let mut times = Vec::new();
            for i in 0..a.iters + 2 {
                let mut b = CopyBatch::h2d(&caps).unwrap_or_else(|e| fail(&e.to_string()));
                for &(l, off, at) in &ops.list {
                    b.push(
                        &bufs[l],
                        off,
                        ops.block,
                        arena.ptr_at(at, ops.block).expect("arena"),
                    )
                    .expect("push");
                }
                let t = Instant::now();
                // SAFETY: the arena outlives the wait and is not written meanwhile.
                let h = unsafe { b.submit(Pacer::global()) }
                    .unwrap_or_else(|e| fail(&format!("H2D submit: {e}")));
                h.wait().unwrap_or_else(|e| fail(&format!("H2D: {e}")));
                if i >= 2 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            // The arena holds the device's own bytes, so the device must be unchanged.
            time_d2h(&bufs, &ops, &arena, Pacer::global(), 1)
                .unwrap_or_else(|e| fail(&format!("read-back after H2D: {e}")));
            let m = median(&mut times);
            eprintln!(
                "  H2D:          median {:.3} ms ({:.2} GB/s)",
                m * 1e3,
                bytes as f64 / m / 1e9
            );
            (Some(m), None)
        }
    };

    let view = view_check(&client, &bufs[0], &kv);
    eprintln!("  view check:   {view}");
    let st = Pacer::global().stats();
    let json = serde_json::json!({
        "platform": client.platform_name(),
        "platform_version": client.platform_version(),
        "plugin": plugin.path().display().to_string(),
        "api_version": format!("{}.{}", caps.api_version.0, caps.api_version.1),
        "d2h_path": caps.d2h.to_string(),
        "h2d_path": caps.h2d.to_string(),
        "dma": dma,
        "layout": layout,
        "bytes": bytes,
        "pieces": ops.list.len(),
        "piece_bytes": ops.block,
        "iters": a.iters,
        "d2h_median_s": d2h_med,
        "d2h_unpaced_median_s": d2h_unpaced_med,
        "h2d_median_s": h2d_med,
        "h2d_unsupported": h2d_unsupported,
        "view_check": view,
        "pacer_peak_inflight_bytes": st.peak_inflight_bytes,
        "pacer_chunks": st.chunks,
        "raw_d2h": raw,
    });
    println!("RESULT {json}");
}

/// A view over the device memory of `buf` (its opaque device pointer), read through the engine
/// and compared with `buf` itself; then the release signal after the view is dropped.
fn view_check(client: &Client, buf: &DeviceBuffer, kv: &KvLayout) -> String {
    let r = (|| -> Result<String, String> {
        let xref = buf.external_ref().map_err(|e| e.to_string())?;
        let ptr = xref.opaque_device_ptr().map_err(|e| e.to_string())?;
        let dev = client.device(0).map_err(|e| e.to_string())?;
        // SAFETY: `ptr` is `buf`'s device memory, kept alive by `xref` (and `buf`) until the
        // view's release is observed below.
        let view =
            unsafe { client.view_of_device_memory(ptr, ElementType::BF16, &kv.dims(), &dev, None) }
                .map_err(|e| e.to_string())?;
        let n = 1 << 20;
        let mut a = vec![0u8; n];
        let mut b = vec![0u8; n];
        view.buffer
            .copy_raw_to_host(4096, &mut a)
            .map_err(|e| e.to_string())?;
        buf.copy_raw_to_host(4096, &mut b)
            .map_err(|e| e.to_string())?;
        if a != b {
            return Err("bytes read through the view differ from the buffer's".into());
        }
        let released = view.released.clone();
        drop(view);
        if !released.wait(Duration::from_secs(10)) {
            return Err("the view's memory was not released within 10 s".into());
        }
        drop(xref);
        Ok(format!(
            "OK (view of {ptr:p}: 1 MiB identical, released after drop)"
        ))
    })();
    match r {
        Ok(s) => s,
        Err(e) => format!("FAILED: {e}"),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("gpu_copy: {msg}");
    println!("RESULT {}", serde_json::json!({ "error": msg }));
    std::process::exit(1);
}
