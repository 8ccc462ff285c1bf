//! Small helpers: byte formatting, leaving a Tokio worker for a long synchronous call.

/// Formats a byte count with binary units (`512 B`, `4.0 KiB`, `1.50 GiB`).
pub fn fmt_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else if v >= 100.0 {
        format!("{v:.0} {}", UNITS[u])
    } else if v >= 10.0 {
        format!("{v:.1} {}", UNITS[u])
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Runs `f`, a synchronous call that may take long (a plan build, a large copy): on a worker
/// of a multi-threaded Tokio runtime through `block_in_place`, which first hands the worker's
/// queued tasks (heartbeats, other lanes) to another thread of the runtime's bounded blocking
/// pool; on any other thread (no runtime, a current-thread runtime, a blocking-pool thread)
/// right here. Not for calls inside a `LocalSet` or `block_on` of a current-thread runtime
/// that needs to keep polling.
pub fn off_worker<T>(f: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes() {
        assert_eq!(super::fmt_bytes(512), "512 B");
        assert_eq!(super::fmt_bytes(4096), "4.00 KiB");
        assert_eq!(super::fmt_bytes(256 << 20), "256 MiB");
    }
}
