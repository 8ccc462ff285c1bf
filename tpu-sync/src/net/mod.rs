//! The network data plane: prefill -> decode KV transfer between endpoints, pulled or pushed,
//! resharded in transit, over plain TCP, TLS 1.3 over TCP, or QUIC.
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
//! Every data frame carries the xxh3-64 of its payload. Encrypted lanes read a chunk into a
//! per-lane bounce buffer and verify it before copying it into place; plain TCP lanes read straight
//! into the staging with `readv` and verify right after. In both cases a mismatch fails that
//! request only (the lane stays in frame sync and is reused) and a request is reported done only
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
//! See `docs/network.md` for the design rationale and measurements.

pub mod quic;
pub mod tcp;
pub mod tls;
pub mod transport;

mod endpoint;
mod framed;
mod stream;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

pub use endpoint::{
    Endpoint, PullRequest, PushRequest, SinkRegistration, SourceHandle, SourceOutcome,
    SourceRegistration, Transfer, TransferKind, TransferStats,
};
pub use tls::Security;
pub use transport::TransportKind;

use crate::error::{Error, Result};

/// Largest request id accepted: ids must survive a JSON round trip as an IEEE double (2^53 - 1).
pub const MAX_REQUEST_ID: u64 = (1 << 53) - 1;

/// Checks a request id: `1..=MAX_REQUEST_ID`.
pub fn check_request_id(request_id: u64) -> Result<()> {
    if request_id == 0 || request_id > MAX_REQUEST_ID {
        return Err(Error::InvalidArgument(format!(
            "request id {request_id} must be in 1..=2^53-1 (it must survive JSON)"
        )));
    }
    Ok(())
}

/// Configuration of an [`Endpoint`].
#[derive(Debug, Clone)]
pub struct EndpointOptions {
    /// Endpoint name, unique per live process (peers use it to recognise a restart). Default:
    /// `tpu-sync-<pid>`.
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
    /// How long a source registration without a live lease holder is kept, and how long a push
    /// registration waits without any push activity before it fails.
    pub lease_ttl: Duration,
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
    /// `peers x (max_lanes_per_peer + 1)` of the peers expected to connect.
    pub max_inbound_lanes: u32,
    /// Test-only faults injected by this endpoint when it sends.
    #[doc(hidden)]
    pub faults: FaultHooks,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            name: format!("tpu-sync-{}", std::process::id()),
            transport: TransportKind::Tcp,
            security: Security::None,
            listen: None,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            lease_ttl: Duration::from_secs(120),
            chunk_bytes: 1 << 20,
            streams_per_pair: 2,
            max_lanes_per_peer: 16,
            max_inbound_lanes: 4096,
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
}

/// Which endpoint hosts each rank of the other side: a default address plus per-rank overrides.
/// Addresses are `host:port` or a name given to [`Endpoint::add_peer`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerMap {
    /// Address for ranks without an override.
    pub default: Option<String>,
    /// Per-rank addresses.
    pub by_rank: BTreeMap<u32, String>,
}

impl PeerMap {
    /// Every rank at one endpoint.
    pub fn single(addr: impl Into<String>) -> PeerMap {
        PeerMap {
            default: Some(addr.into()),
            by_rank: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) the endpoint of `rank`.
    pub fn with(mut self, rank: u32, addr: impl Into<String>) -> PeerMap {
        self.by_rank.insert(rank, addr.into());
        self
    }

    /// The distinct endpoints of `ranks`.
    pub fn addresses(&self, ranks: impl IntoIterator<Item = u32>) -> Result<Vec<String>> {
        let mut v: Vec<String> = Vec::new();
        for r in ranks {
            let a = self.get(r)?.to_string();
            if !v.contains(&a) {
                v.push(a);
            }
        }
        Ok(v)
    }

    /// Parses `ADDR` or `RANK=ADDR,RANK=ADDR,...` (a bare `ADDR` entry sets the default).
    pub fn parse(s: &str) -> Result<PeerMap> {
        let mut m = PeerMap::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((r, a)) => {
                    let r: u32 = r.trim().parse().map_err(|_| {
                        Error::InvalidArgument(format!("`{part}`: rank is not a number"))
                    })?;
                    m.by_rank.insert(r, a.trim().to_string());
                }
                None => m.default = Some(part.to_string()),
            }
        }
        if m.default.is_none() && m.by_rank.is_empty() {
            return Err(Error::InvalidArgument("empty peer map".into()));
        }
        Ok(m)
    }

    /// The endpoint of `rank`.
    ///
    /// Errors: [`Error::InvalidArgument`] when neither an override nor a default exists.
    pub fn get(&self, rank: u32) -> Result<&str> {
        self.by_rank
            .get(&rank)
            .or(self.default.as_ref())
            .map(String::as_str)
            .ok_or_else(|| Error::InvalidArgument(format!("no endpoint given for rank {rank}")))
    }
}

/// A snapshot of an endpoint's counters ([`Endpoint::stats`]). Gauges (current values) and
/// totals (since creation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Gauge: peers this endpoint is connected to (client side).
    pub peers: u64,
    /// Gauge: peer sessions connected to this endpoint (server side).
    pub sessions: u64,
    /// Gauge: open lanes, both sides, control lanes included.
    pub lanes_open: u64,
    /// Total: lanes ever opened or accepted.
    pub lanes_opened: u64,
    /// Gauge: registered pull sources.
    pub source_registrations: u64,
    /// Gauge: registered push destinations.
    pub sink_registrations: u64,
    /// Gauge: leases held on source registrations by live consumers.
    pub leases: u64,
    /// Gauge: staged bytes referenced by registrations and in-flight transfers.
    pub staged_bytes: u64,
    /// Gauge: transfers (pulls, pushes, push receptions) not finished.
    pub transfers_in_flight: u64,
    /// Total: payload bytes sent.
    pub bytes_sent: u64,
    /// Total: payload bytes received.
    pub bytes_received: u64,
    /// Total: transfers completed successfully.
    pub transfers_completed: u64,
    /// Total: transfers failed or cancelled.
    pub transfers_failed: u64,
    /// Total: chunks whose checksum did not match.
    pub checksum_failures: u64,
    /// Total: peers or sessions declared dead.
    pub peers_lost: u64,
    /// Total: incoming handshakes refused (authentication failures, timeouts).
    pub handshake_failures: u64,
    /// Total: inbound lanes closed unserved because
    /// [`EndpointOptions::max_inbound_lanes`] were already being served.
    pub lanes_refused: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) lanes_open: AtomicU64,
    pub(crate) lanes_opened: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) transfers_completed: AtomicU64,
    pub(crate) transfers_failed: AtomicU64,
    pub(crate) checksum_failures: AtomicU64,
    pub(crate) peers_lost: AtomicU64,
    pub(crate) lanes_refused: AtomicU64,
    pub(crate) corrupted: AtomicBool,
    /// The endpoint's transport, the `transport` label of its Prometheus metrics.
    pub(crate) transport: Option<TransportKind>,
}

/// The counter sites of the data plane: each updates the endpoint's own counter ([`Stats`]) and
/// the process's Prometheus metrics ([`crate::metrics`]).
impl Counters {
    pub(crate) fn for_transport(t: TransportKind) -> Counters {
        Counters {
            transport: Some(t),
            ..Counters::default()
        }
    }

    pub(crate) fn transport(&self) -> TransportKind {
        self.transport.unwrap_or(TransportKind::Tcp)
    }

    pub(crate) fn sent(&self, n: u64) {
        self.bytes_sent.fetch_add(n, Ordering::Relaxed);
        crate::metrics::net_bytes(self.transport(), crate::metrics::NetDirection::Send, n);
    }

    pub(crate) fn received(&self, n: u64) {
        self.bytes_received.fetch_add(n, Ordering::Relaxed);
        crate::metrics::net_bytes(self.transport(), crate::metrics::NetDirection::Receive, n);
    }

    pub(crate) fn checksum_failed(&self) {
        self.checksum_failures.fetch_add(1, Ordering::Relaxed);
        crate::metrics::checksum_failure(crate::metrics::ChecksumSource::Network);
    }

    pub(crate) fn peer_lost(&self) {
        self.peers_lost.fetch_add(1, Ordering::Relaxed);
        crate::metrics::peer_lost();
    }
}

/// A one-shot broadcast flag with a reason.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    set: AtomicBool,
    why: std::sync::Mutex<Option<String>>,
    n: tokio::sync::Notify,
}

impl Signal {
    pub(crate) fn fire(&self, why: impl Into<String>) {
        {
            let mut g = self.why.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                *g = Some(why.into());
            }
        }
        self.set.store(true, Ordering::SeqCst);
        self.n.notify_waiters();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    pub(crate) fn reason(&self) -> String {
        self.why
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_default()
    }

    pub(crate) async fn wait(&self) {
        loop {
            let f = self.n.notified();
            tokio::pin!(f);
            f.as_mut().enable();
            if self.is_set() {
                return;
            }
            f.await;
        }
    }
}

/// The device ranges a receiver must stage for `plan`: per destination rank of `dst`, the merged
/// bytes the plan writes ([`crate::plan::Plan::dst_ranges`]).
pub fn plan_staging(
    plan: &crate::plan::Plan,
    dst: &crate::plan::Placement,
) -> BTreeMap<u32, Vec<crate::plan::ByteRange>> {
    (0..dst.layout.spec.ranks_per_replica())
        .map(|l| {
            let r = dst.global_rank(l);
            (r, plan.dst_ranges(r))
        })
        .collect()
}
