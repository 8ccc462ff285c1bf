//! [`Stats`] (the snapshot callers see) and the data path's shared atomic [`Counters`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::TransportKind;

#[cfg(doc)]
use super::{Endpoint, EndpointOptions};

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
    /// Of those, payload bytes copied straight out of a same-host sender's memory (the `shm`
    /// transport's data by reference; 0 on the other transports and on the inline fallback).
    pub bytes_received_by_reference: u64,
    /// Of those, payload bytes received on TLS or QUIC lanes without an xxh3-64 check: their
    /// AEAD authenticated them ([`EndpointOptions::hash_encrypted_frames`] off, the default;
    /// 0 on plain TCP and `shm`, whose frames are always verified).
    pub bytes_received_unhashed: u64,
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
    pub(crate) bytes_by_reference: AtomicU64,
    pub(crate) bytes_unhashed: AtomicU64,
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
