//! The network data plane: prefill -> decode KV transfer between endpoints, pulled or pushed,
//! resharded in transit, over plain TCP, TLS 1.3 over TCP, QUIC, or (between processes on one
//! host) shared memory: Unix sockets with the payload copied once, by the receiver, out of the
//! sender's staging ([`shm`]).
//!
//! # Objects
//!
//! An [`Endpoint`] is one process's presence on the network: an optional listener (the server
//! side: it serves registered requests to pullers and accepts pushes) and a client side (it
//! pulls from and pushes to other endpoints). One endpoint can play both roles. Endpoints are
//! driven by a tokio runtime; every method is callable from any thread inside that runtime's
//! context, and [`Endpoint`] is `Send + Sync`.
//!
//! * **Pull** (decode-initiated; the flow of vLLM's NIXL connector and tpu-inference): the
//!   prefill side [`Endpoint::register_source`]s a request's staged blocks; the decode side calls
//!   [`Endpoint::pull`] with the two placements and a [`PeerMap`] saying which endpoint hosts
//!   each source rank, waits on the returned [`Transfer`], then [`Endpoint::release`]s.
//! * **Push** (prefill-initiated; the flow of SGLang's Mooncake and NIXL backends): the decode side
//!   [`Endpoint::expect_push`]es (registers its destination staging for a request); the prefill
//!   side calls [`Endpoint::push`] with the destination placement and a [`PeerMap`] of destination
//!   ranks. The receiver checks every stripe against its own registration and plan.
//!
//! Each `(source rank, destination rank)` pair with bytes is one byte stream: the concatenation in
//! plan order of the pair's spans ([`crate::plan`]), layer-major. Only the ranks that hold bytes
//! for a destination rank are contacted, and nothing is gathered into a per-request buffer on
//! either side. A pair's stream is split into chunks of [`EndpointOptions::chunk_bytes`] that are
//! dealt round-robin over up to [`EndpointOptions::streams_per_pair`] lanes ([`crate::wire::Stripe`]).
//!
//! # Lanes, connections, liveness
//!
//! Per peer, the client side holds one connection (QUIC) or a set of sockets (TCP/TLS), opened on
//! first use and reused: a **control lane** carrying heartbeats and cancellations, and a pool of at
//! most [`EndpointOptions::max_lanes_per_peer`] **data lanes**, each carrying one exchange at a
//! time. Transfers wait for a free lane instead of opening sockets, so any number of transfers uses
//! a bounded number of sockets. The client pings every [`EndpointOptions::heartbeat_interval`];
//! either side declares the other dead when the control lane closes or stays silent for
//! [`EndpointOptions::heartbeat_timeout`]. On death, every transfer with that peer fails with an
//! explicit error, its lanes are closed, and everything held for it is released at once: source
//! registrations it leased, push registrations it was filling, and their staging references. A
//! peer that restarts (same name, new incarnation, possibly a new address: [`Endpoint::add_peer`])
//! is reconnected on next use; the old incarnation's state is dropped when the new one says hello.
//!
//! # Leases
//!
//! A source registration is kept until [`SourceRegistration::expected_releases`] consumers
//! released it. A consumer that describes or pulls it takes a lease, held for as long as its
//! session is alive (heartbeats renew it). With no live holder, the registration expires
//! [`EndpointOptions::lease_ttl`] after registration or after the last holder's release; when a
//! holder dies, it is released at once. [`SourceHandle::wait`] reports which of these happened.
//!
//! # Integrity and validation
//!
//! Every data frame on plain TCP and `shm` lanes carries the xxh3-64 of its payload, which the
//! receiver checks as the bytes arrive straight into the staging (`readv`). TLS and QUIC lanes
//! read straight into the staging too, out of the plaintext their session authenticated (AEAD);
//! their frames carry and check the xxh3 only for a receiver that asks
//! ([`EndpointOptions::hash_encrypted_frames`], off by default; a lane's hello says which).
//! Either way a mismatch fails that request only (the lane stays in frame sync and is reused) and a request is reported done only
//! after every chunk of every pair verified, so unverified bytes are never committed (drained to a
//! device) by a caller that waits for completion. A receiver takes nothing but a stream offset from
//! the wire: it refuses a chunk at an unexpected offset, a frame larger than the planned chunk
//! (over-delivery), data past the end of a stripe, a stripe whose declared stream count or chunk
//! size differs from the pair's first stripe, a duplicate stripe, a plan digest that differs from
//! its own, and any span outside its staged ranges or layout ([`crate::staging::Staging::resolve`]).
//!
//! # Security
//!
//! [`tls::Security`] configures mutual authentication (CA-signed certificates or a pre-shared
//! key) for [`TransportKind::Tls`] and [`TransportKind::Quic`]; an unauthenticated peer is refused
//! in the handshake and never reaches the frame layer. [`TransportKind::Tcp`] is plain TCP with no
//! authentication or encryption: use it only on trusted networks.
//!
//! # Failure semantics
//!
//! A remote failure arrives with the [`ErrorKind`](crate::ErrorKind) the peer raised (an
//! "unknown request" stays [`Error::UnknownRequest`](crate::Error::UnknownRequest)). A pull that
//! fails before any byte arrived consumes nothing: a retry to the right address succeeds. A
//! release counts as a delivery only when the consumer got everything
//! ([`Endpoint::release_with`]) and the producer served it every stripe it asked for; a consumer
//! that will not pull a request [`Endpoint::reject`]s it, which frees the producer's staging at
//! once ([`SourceOutcome::Rejected`]). [`PullRequest::wait_for_registration`] lets a pull wait
//! for a registration that has not happened yet.
//!
//! # Structure
//!
//! The protocol rules (registrations, leases, heartbeats, stripe acceptance, release counting,
//! timers) are a state machine without I/O (`proto`); `endpoint` is the tokio driver around it
//! (sockets, lanes, staging, waiters); `stream`, `framed` and the transports move the bytes.
//!
//! See `docs/network.md` for the design rationale and measurements.

#[cfg(feature = "quic")]
pub mod quic;
pub mod shm;
pub mod tcp;
pub mod tls;
pub mod transport;

pub(crate) mod endpoint;
mod framed;
mod options;
mod peer_map;
pub(crate) mod proto;
mod request;
mod signal;
mod stats;
mod stream;

pub use endpoint::{Endpoint, SourceHandle, Transfer, DEFAULT_LANE_IDLE};
pub use options::{
    default_endpoint_name, EndpointOptions, FaultHooks, DEFAULT_QUIC_CONNECTIONS_PER_PEER,
};
pub use peer_map::PeerMap;
pub use proto::{SourceOutcome, TransferKind, TransferStats};
pub use request::{
    check_request_id, plan_staging, PullRequest, PushRequest, SinkRegistration, SourceRegistration,
    MAX_REQUEST_ID,
};
pub use stats::Stats;
pub use tls::Security;
pub use transport::{ShmPeer, TransportKind};

pub(crate) use stats::Counters;

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit (once per process; where the
/// kernel allows it, which it does for an unprivileged process up to the hard limit) and returns
/// the soft limit in effect: the usual 1024 soft limit is below the default
/// [`EndpointOptions::max_inbound_lanes`] (4096). Thread-safe.
pub fn raise_nofile_limit() -> u64 {
    static SOFT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SOFT.get_or_init(|| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `r` is a valid rlimit for getrlimit to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            // SAFETY: a valid rlimit; raising the soft limit up to the hard one is allowed.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
                log::debug!(
                    "RLIMIT_NOFILE soft limit raised from {} to {}",
                    r.rlim_cur,
                    r.rlim_max
                );
                r.rlim_cur = r.rlim_max;
            }
        }
        r.rlim_cur
    })
}

/// Inbound lanes an endpoint serves: `configured`, at most half of the open-file limit `nofile`
/// less 64 (the other half for its own outbound lanes, staging, the plugin and the engine).
pub fn inbound_lanes_for(configured: u32, nofile: u64) -> usize {
    let room = (nofile.saturating_sub(64) / 2).max(16);
    (configured as u64).min(room) as usize
}

#[cfg(test)]
mod limit_tests {
    #[test]
    fn inbound_lanes_fit_the_open_file_limit() {
        assert_eq!(super::inbound_lanes_for(4096, 1024), 480);
        assert_eq!(super::inbound_lanes_for(4096, 1 << 20), 4096);
        assert_eq!(super::inbound_lanes_for(100, 1024), 100);
        assert_eq!(super::inbound_lanes_for(4096, 10), 16);
        let soft = super::raise_nofile_limit();
        assert!(soft >= 16);
        assert_eq!(super::raise_nofile_limit(), soft, "once per process");
    }
}
