//! The device layer against the real XLA CPU PJRT plugin: plugin loading, clients, devices,
//! memory kinds, raw D2H windows, in-place H2D, and the inputs that must be refused.

use crate::common;

use tpu_sync::device::{d2h_batch, h2d_batch, RawCopy};
use tpu_sync::pjrt::{Capabilities, ElementType, H2dPath, Plugin};
use tpu_sync::Error;

/// Non-repeating, non-zero test bytes.
fn pattern(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .map(|i| (tpu_sync::pattern::mix64(i ^ (seed << 40)) as u8) | 1)
        .collect()
}

#[test]
fn loads_plugin_and_lists_devices_and_memories() {
    let p = common::plugin();
    let (major, minor) = p.api_version();
    assert_eq!(major, 0);
    assert!(minor >= 81, "API 0.{minor}");
    assert!(p.api_struct_size() >= 984);
    // Loading twice returns the same plugin.
    assert!(std::sync::Arc::ptr_eq(&p, &common::plugin()));
    let c = common::client(3);
    assert_eq!(c.platform_name(), "cpu");
    let devs = c.addressable_devices();
    assert_eq!(devs.len(), 3);
    let mut ids: Vec<i32> = devs.iter().map(|d| d.id().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 2]);
    let kinds: Vec<String> = devs[0]
        .memories()
        .unwrap()
        .iter()
        .map(|m| m.kind().to_string())
        .collect();
    for k in ["device", "pinned_host", "unpinned_host"] {
        assert!(
            kinds.iter().any(|x| x == k),
            "memory kind {k} missing from {kinds:?}"
        );
    }
    assert_eq!(devs[0].default_memory().unwrap().kind(), "device");
    assert!(c.device(3).is_err());
    let caps = Capabilities::probe(&c).unwrap();
    assert_eq!(caps.h2d, H2dPath::HostAddressable);
    assert!(
        matches!(caps.dma_map, tpu_sync::pjrt::DmaMapSupport::Unavailable(ref m) if m.contains("UNIMPLEMENTED"))
    );
}

#[test]
fn unloadable_plugins_are_clear_errors() {
    let e = Plugin::load(std::path::Path::new("/nonexistent/plugin.so")).unwrap_err();
    assert!(matches!(e, Error::PluginLoad { .. }), "{e}");
    // A real shared library that is not a PJRT plugin.
    let libc = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("libm");
    let e = Plugin::load(std::path::Path::new(libc)).unwrap_err();
    assert!(e.to_string().contains("GetPjrtApi"), "{e}");
    // A file that is not a shared library at all.
    let f = std::env::temp_dir().join(format!("not-a-plugin-{}.so", std::process::id()));
    std::fs::write(&f, b"hello").unwrap();
    let e = Plugin::load(&f).unwrap_err();
    std::fs::remove_file(&f).ok();
    assert!(matches!(e, Error::PluginLoad { .. }), "{e}");
}

#[test]
fn raw_d2h_windows_and_in_place_h2d_are_byte_exact() {
    let c = common::client(2);
    let caps = Capabilities::probe(&c).unwrap();
    let dev = c.device(1).unwrap();
    let n = 1 << 20;
    let data = pattern(n, 1);
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[n as i64], &dev)
        .unwrap();
    assert_eq!(buf.on_device_size(), n as u64);
    assert!(buf.is_on(&dev));
    // Windows: whole, aligned, unaligned, last bytes.
    for (off, len) in [(0usize, n), (4096, 65536), (12345, 77777), (n - 10, 10)] {
        let mut out = vec![0u8; len];
        buf.copy_raw_to_host(off as u64, &mut out).unwrap();
        assert_eq!(out, &data[off..off + len], "window {off}+{len}");
    }
    // Out of range is refused before reaching the plugin.
    let mut out = vec![0u8; 16];
    assert!(matches!(
        buf.copy_raw_to_host(n as u64 - 8, &mut out),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        buf.copy_raw_to_host(u64::MAX - 4, &mut out),
        Err(Error::InvalidArgument(_))
    ));

    // In-place H2D of scattered pieces, then read back everything.
    let patch = pattern(3 * 4096, 2);
    let ops = [
        RawCopy {
            buffer: &buf,
            offset: 100,
            len: 4096,
            host: patch[..4096].as_ptr() as *mut u8,
        },
        RawCopy {
            buffer: &buf,
            offset: 700_001,
            len: 8192,
            host: patch[4096..].as_ptr() as *mut u8,
        },
    ];
    // SAFETY: `patch` outlives the call and is not modified.
    let st = unsafe { h2d_batch(&caps, &ops) }.unwrap();
    assert_eq!(st.bytes, 12288);
    let mut expect = data.clone();
    expect[100..4196].copy_from_slice(&patch[..4096]);
    expect[700_001..708_193].copy_from_slice(&patch[4096..]);
    let mut all = vec![0u8; n];
    buf.to_host(&mut all).unwrap();
    assert!(all == expect, "device contents after in-place H2D differ");

    // Batched D2H of the same pieces.
    let mut back = vec![0u8; 12288];
    let ops = [
        RawCopy {
            buffer: &buf,
            offset: 100,
            len: 4096,
            host: back.as_mut_ptr(),
        },
        RawCopy {
            buffer: &buf,
            offset: 700_001,
            len: 8192,
            host: back[4096..].as_mut_ptr(),
        },
    ];
    // SAFETY: `back` outlives the call and nobody else touches it.
    unsafe { d2h_batch(&ops, 1) }.unwrap();
    assert_eq!(back, patch);
    // A batch with one bad op copies nothing and fails.
    let bad = [
        RawCopy {
            buffer: &buf,
            offset: 0,
            len: 16,
            host: back.as_mut_ptr(),
        },
        RawCopy {
            buffer: &buf,
            offset: n as u64,
            len: 1,
            host: back.as_mut_ptr(),
        },
    ];
    // SAFETY: as above.
    let r = unsafe { d2h_batch(&bad, 0) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))));
    assert_eq!(back, patch, "a refused batch wrote nothing");
}

#[test]
fn deleted_buffers_and_foreign_devices_are_refused() {
    let c = common::client(1);
    let other = common::client(1);
    let caps = Capabilities::probe(&c).unwrap();
    let data = pattern(4096, 3);
    let dev = c.device(0).unwrap();
    // A device of another client is refused.
    let e = c
        .buffer_from_host(&data, ElementType::U8, &[4096], &other.device(0).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("another PJRT client"), "{e}");
    // Wrong host size for the shape.
    assert!(c
        .buffer_from_host(&data, ElementType::BF16, &[4096], &dev)
        .is_err());
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[4096], &dev)
        .unwrap();
    buf.delete().unwrap();
    assert!(buf.is_deleted().unwrap());
    let mut out = vec![0u8; 16];
    let ops = [RawCopy {
        buffer: &buf,
        offset: 0,
        len: 16,
        host: out.as_mut_ptr(),
    }];
    // SAFETY: `out` outlives the calls.
    let e = unsafe { d2h_batch(&ops, 0) }.unwrap_err();
    assert!(e.to_string().contains("deleted"), "{e}");
    // SAFETY: as above.
    let e = unsafe { h2d_batch(&caps, &ops) }.unwrap_err();
    assert!(e.to_string().contains("deleted"), "{e}");
}

/// External references from many threads on one buffer, through the owning handle and through
/// adopted handles of the same `PJRT_Buffer*`, stay balanced: the buffer is destroyed at the end
/// and the plugin aborts the process if any reference leaked ("Non-zero type 1 hold on
/// destruction"), which unserialised calls into the plugin's reference list made happen. The
/// memory stays readable through a held reference while the other threads churn.
#[test]
fn external_references_from_many_threads_stay_balanced() {
    let c = common::client(1);
    let dev = c.device(0).unwrap();
    let data = pattern(4096, 77);
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[4096], &dev)
        .unwrap();
    let held = buf.external_ref().unwrap();
    let ptr = held.opaque_device_ptr().unwrap();
    let addr = ptr as usize;
    std::thread::scope(|s| {
        for t in 0..6 {
            let owned = buf.clone();
            let c = &c;
            s.spawn(move || {
                // SAFETY: `owned` keeps the buffer alive for the adopted handle's lifetime.
                let adopted =
                    unsafe { tpu_sync::pjrt::DeviceBuffer::adopt(c, owned.raw()) }.unwrap();
                let b = if t % 2 == 0 { &owned } else { &adopted };
                for _ in 0..20_000 {
                    let r = b.external_ref().unwrap();
                    assert_eq!(r.opaque_device_ptr().unwrap() as usize, addr);
                }
            });
        }
    });
    // SAFETY: `held` keeps the memory alive and in place; nothing writes the buffer.
    let seen = unsafe { std::slice::from_raw_parts(ptr, data.len()) };
    assert_eq!(seen, &data[..]);
    drop(held);
    let mut back = vec![0u8; data.len()];
    buf.copy_raw_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
    drop(buf); // PJRT_Buffer_Destroy: aborts here if a reference leaked.
}
