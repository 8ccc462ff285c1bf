//! Loopback TCP ports for servers that a test starts in *another* process (etcd, the CLI's
//! `prefill --port`), which must be told a port before they bind it.
//!
//! Why not "bind port 0, read the port, close, pass it on": between the close and the child's
//! bind, anything on the machine may take that port, and the CI runs the Rust, Python, vLLM and
//! SGLang suites side by side. Port 0 hands out ports from the kernel's ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), the same range every
//! outgoing connection takes its source port from. A CI run failed exactly so: etcd was told a
//! port that some other socket held by the time etcd bound it (`bind: address already in use`).
//!
//! So ports come from 61000-65535 instead: above the default ephemeral range, and above the
//! ranges that vLLM and SGLang draw random ports from (SGLang 0.5.23: 22000-29999 for ports a
//! child binds later, `get_free_port_below_ephemeral`; vLLM: port 0). Test
//! processes share them through lock files: a [`Port`] holds an exclusive `flock` on
//! `$TMPDIR/tpu-sync-test-ports/<port>.lock` for its lifetime, so no other test (Rust or Python:
//! `tests/cluster_util/ports.py` uses the same files) takes the same port, even across a server
//! restart on the same port. The kernel drops the lock when the process dies.
#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// First port handed out; above Linux's default ephemeral range (32768-60999).
pub const FIRST: u16 = 61000;
/// Last port handed out.
pub const LAST: u16 = 65535;

/// A loopback port reserved for this test until dropped. Nothing listens on it until the test
/// starts a server there, so it also serves as "a port where nothing listens".
pub struct Port {
    /// The port number.
    pub port: u16,
    _lock: File,
}

impl Port {
    /// `127.0.0.1:port`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

fn lock_dir() -> PathBuf {
    std::env::temp_dir().join("tpu-sync-test-ports")
}

/// Reserves a port in [`FIRST`]..=[`LAST`] that no other test process holds and that
/// 127.0.0.1 can bind now. Panics (a test-setup failure) when every port is taken.
pub fn reserve() -> Port {
    let dir = lock_dir();
    std::fs::create_dir_all(&dir).expect("port lock dir");
    let span = u32::from(LAST - FIRST) + 1;
    // Spread processes over the range so they rarely probe the same ports.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let start = (std::process::id().wrapping_mul(7919) ^ nanos) % span;
    for i in 0..span {
        let port = FIRST + ((start + i) % span) as u16;
        let Ok(f) = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(format!("{port}.lock")))
        else {
            continue;
        };
        // SAFETY: `f` is an open file; flock only takes its descriptor and flags.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Port { port, _lock: f };
        }
    }
    panic!("no free loopback port in {FIRST}-{LAST}");
}
