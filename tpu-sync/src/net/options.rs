//! [`EndpointOptions`] (timeouts, heartbeats, leases, chunking, lane limits) and the test-only
//! [`FaultHooks`].

use std::time::Duration;

#[cfg(doc)]
use super::{Endpoint, Stats};
use super::{Security, TransportKind};

/// Default QUIC connections per peer ([`EndpointOptions::quic_connections_per_peer`]): 2, one
/// per core of the 2-core machines the figures of docs/performance.md come from; more pays where
/// more cores run the runtime.
pub const DEFAULT_QUIC_CONNECTIONS_PER_PEER: u32 = 2;

/// Configuration of an [`Endpoint`].
#[derive(Debug, Clone)]
pub struct EndpointOptions {
    /// Endpoint name, shown in peers' logs and outcomes; a peer keys its session by (name,
    /// incarnation), so two live endpoints of one name never end each other's sessions.
    /// Default: [`default_endpoint_name`] (`tpu-sync-<host>-<pid>-<random>`, unique across
    /// hosts and containers that share pids).
    pub name: String,
    /// Transport.
    pub transport: TransportKind,
    /// Peer authentication (required for TLS and QUIC; must be [`Security::None`] for TCP).
    pub security: Security,
    /// Address to listen on (`None`: client only). Port 0 picks a free port.
    pub listen: Option<std::net::SocketAddr>,
    /// Limit for a TCP connect / QUIC connection attempt.
    pub connect_timeout: Duration,
    /// Limit for the TLS/QUIC handshake plus the protocol hello.
    pub handshake_timeout: Duration,
    /// Limit for any single read or write of a transfer to make progress.
    pub io_timeout: Duration,
    /// Interval between heartbeats on each peer's control lane.
    pub heartbeat_interval: Duration,
    /// A peer silent for this long (no heartbeat or answer) is declared dead.
    pub heartbeat_timeout: Duration,
    /// A data lane this endpoint serves that carries no request for this long is closed (an
    /// idle pooled lane holds a socket and a task; a peer that opens lanes and leaves them must
    /// not keep them forever). As a client, this endpoint stops reusing a pooled lane after half
    /// of it, so a lane it takes is never one the server is closing: give both sides the same
    /// value. Default 120 s; must be at least 2 ms.
    pub lane_idle_timeout: Duration,
    /// How long a source registration without a live lease holder is kept, and how long a push
    /// registration waits without any push activity before it fails.
    pub lease_ttl: Duration,
    /// What a source registration's `expected_releases` counts on this (producer) endpoint.
    /// `false` (default): consumer endpoints; each delivered release counts one.
    /// `true`: consumer TP ranks; a delivered release counts the distinct destination ranks
    /// this endpoint served that consumer completely, and a reject ends the registration
    /// (`Rejected`), since every rank of one consumer instance gives the request up together.
    /// For producers whose consumers may hold one endpoint per rank (vLLM-TorchTPU's workers)
    /// or one endpoint for all ranks (a JAX runner): `expected_releases` is then the number of
    /// consumer ranks that pull from this endpoint's ranks, whatever their endpoints.
    pub count_releases_by_rank: bool,
    /// Payload bytes per data frame (chunk), at most [`crate::wire::MAX_DATA_PAYLOAD`].
    pub chunk_bytes: u64,
    /// Lanes a single `(source rank, destination rank)` stream is spread over (>= 1).
    pub streams_per_pair: u32,
    /// Most data lanes (sockets or QUIC streams) open to one peer at once (>= 1).
    pub max_lanes_per_peer: u32,
    /// Most inbound lanes (accepted sockets or QUIC streams, from all peers together, including
    /// ones still in their hello) this endpoint serves at once (>= 1). A lane beyond it is closed
    /// as soon as it is accepted and counted in [`Stats::lanes_refused`], so a flood of
    /// connections cannot exhaust tasks or file descriptors. Size it to at least
    /// `peers x (max_lanes_per_peer + 1)` of the peers expected to connect. Binding raises the
    /// process's soft open-file limit to its hard one ([`super::raise_nofile_limit`]) and serves
    /// at most half of that limit less 64 ([`super::inbound_lanes_for`], with a warning), so
    /// the default never exceeds what the process can open.
    pub max_inbound_lanes: u32,
    /// QUIC connections this endpoint opens to each peer it connects to (>= 1; QUIC only: TCP and
    /// TLS already give every lane its own socket). Lanes go to the connection with the fewest
    /// open lanes; each connection is driven on its own task, so the per-datagram work (AES-GCM,
    /// packetisation, acknowledgements) of different lanes runs on different runtime threads.
    /// Default [`DEFAULT_QUIC_CONNECTIONS_PER_PEER`].
    pub quic_connections_per_peer: u32,
    /// Whether data frames on TLS and QUIC lanes carry and verify the xxh3-64 checksum that plain
    /// TCP and `shm` lanes always do. Default `false`: TLS 1.3 records and QUIC packets are
    /// AEAD-sealed (RFC 8446 section 5.2, RFC 9001 section 5), which already authenticates every
    /// byte from the sender's staging (the session encrypts straight out of it) to the
    /// receiver's plaintext, so the hash would check the same bytes twice; it was about a fifth
    /// of a TLS pull's CPU on the runtime threads (docs/performance.md, "Encrypted lanes"). Off,
    /// this endpoint tells each peer in its lanes' hello that it does not verify there, and skips
    /// the hash when sending to a peer that said the same; a peer that still sends checksums
    /// (or is older than this option) is read without checking them. On, this endpoint asks its
    /// peers to hash and verifies every frame, as on plain TCP.
    pub hash_encrypted_frames: bool,
    /// Test-only faults injected by this endpoint when it sends.
    #[doc(hidden)]
    pub faults: FaultHooks,
}

/// A name unique across hosts and containers: `tpu-sync-<host>-<pid>-<8 hex digits>` (the
/// host name from `gethostname(2)`, cut to 64 bytes; `localhost` when it has none; the digits
/// from the system's CSPRNG, so containers with the same host name and pid still differ).
pub fn default_endpoint_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let host = if r == 0 {
        let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..n.min(64)]).into_owned()
    } else {
        String::new()
    };
    let host = if host.is_empty() {
        "localhost".to_string()
    } else {
        host
    };
    let mut r = [0u8; 4];
    let id = match ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut r) {
        Ok(()) => u32::from_le_bytes(r),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            t ^ std::process::id().rotate_left(16)
        }
    };
    format!("tpu-sync-{host}-{}-{id:08x}", std::process::id())
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            name: default_endpoint_name(),
            transport: TransportKind::Tcp,
            security: Security::None,
            listen: None,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            lane_idle_timeout: super::endpoint::DEFAULT_LANE_IDLE,
            lease_ttl: Duration::from_secs(120),
            count_releases_by_rank: false,
            chunk_bytes: 1 << 20,
            streams_per_pair: 2,
            max_lanes_per_peer: 16,
            max_inbound_lanes: 4096,
            quic_connections_per_peer: DEFAULT_QUIC_CONNECTIONS_PER_PEER,
            hash_encrypted_frames: false,
            faults: FaultHooks::default(),
        }
    }
}

/// Faults a sending endpoint injects (tests only; the fault-injection suite wraps the
/// [`transport::Transport`] instead).
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct FaultHooks {
    /// Abort a stripe (closing its lane) once this many payload bytes were sent in total.
    pub close_after_bytes: Option<u64>,
    /// Stop sending (without closing) once this many payload bytes were sent in total.
    pub stall_after_bytes: Option<u64>,
    /// Corrupt the first chunk sent (once per endpoint) that contains this stream offset: the
    /// receiver sees a checksum mismatch.
    pub corrupt_at_offset: Option<u64>,
    /// Stop answering heartbeats (a peer that hangs without closing its sockets).
    pub mute_heartbeats: bool,
    /// Hold every release this endpoint sends this long before sending it (a slow control
    /// path: a release that reaches the producer late).
    pub delay_releases: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 24: default names carry the host name, the pid and a random part, so two
    /// processes of one host and pid (containers) still get different names.
    #[test]
    fn default_endpoint_names_name_the_host_and_differ_per_call() {
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is writable for its whole length, which is what we pass.
        let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
        assert_eq!(r, 0);
        let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let host = String::from_utf8_lossy(&buf[..n.min(64)]).into_owned();
        let prefix = format!("tpu-sync-{host}-{}-", std::process::id());
        let names: std::collections::HashSet<String> =
            (0..64).map(|_| default_endpoint_name()).collect();
        assert_eq!(names.len(), 64, "64 calls, 64 different names");
        for name in &names {
            let id = name
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{name}"));
            assert_eq!(id.len(), 8, "{name}");
            assert!(id.chars().all(|c| c.is_ascii_hexdigit()), "{name}");
        }
        assert_eq!(
            EndpointOptions::default().name.len(),
            names.iter().next().unwrap().len()
        );
    }
}
