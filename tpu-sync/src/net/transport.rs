//! The transport seam: how bytes get between two endpoints, independent of the protocol above.
//!
//! A [`Transport`] opens [`Connection`]s to peers and listens with an [`Acceptor`]. A connection
//! yields [`Lane`]s: ordered, reliable, full-duplex byte streams (a TCP socket, a TLS session over
//! one, or a QUIC bidirectional stream). Everything above (framing, sessions, pull/push, leases)
//! lives in [`super::Endpoint`] and only sees these traits, so a test can wrap a transport in a
//! decorator that delays, drops, truncates or corrupts lanes (the seam the fault-injection suite
//! uses).
//!
//! Implementations: [`super::tcp::TcpTransport`] (plain TCP or TLS 1.3 over TCP; one socket per
//! lane) and [`super::quic::QuicTransport`] (one QUIC connection per peer, one stream per lane).
//!
//! Thread-safety: every trait object here is `Send`; transports, connections and acceptors are
//! `Sync` and shared in `Arc`s.

use std::future::Future;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::Result;

/// A boxed, sendable future (the return type of the object-safe async trait methods here).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Which transport an endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Plain TCP: no authentication, no encryption. Trusted networks only.
    Tcp,
    /// TLS 1.3 over TCP (rustls), peers authenticated by CA or pre-shared key.
    Tls,
    /// QUIC (quinn, TLS 1.3 built in), peers authenticated by CA or pre-shared key.
    Quic,
}

impl TransportKind {
    /// Parses `tcp`, `tls` or `quic`.
    pub fn parse(s: &str) -> Result<TransportKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(TransportKind::Tcp),
            "tls" => Ok(TransportKind::Tls),
            "quic" => Ok(TransportKind::Quic),
            o => Err(crate::Error::InvalidArgument(format!(
                "transport `{o}` is not available (available: tcp, tls, quic)"
            ))),
        }
    }

    /// `tcp`, `tls` or `quic`.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Tls => "tls",
            TransportKind::Quic => "quic",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Limits every transport applies while establishing connections and lanes.
#[derive(Debug, Clone, Copy)]
pub struct TransportTimeouts {
    /// Limit for the TCP connect or the QUIC connection attempt.
    pub connect: Duration,
    /// Limit for the TLS / QUIC handshake (after connect).
    pub handshake: Duration,
}

/// What is known about the other end of a lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's socket address.
    pub addr: SocketAddr,
    /// The authenticated identity: the subject of the peer's certificate chain's end entity
    /// (hex SHA-256 of its DER) for CA-verified peers, `psk` for pre-shared-key peers, `None` on
    /// plain TCP.
    pub identity: Option<String>,
}

/// One ordered, reliable, full-duplex byte stream to a peer.
///
/// Plain TCP lanes read with `readv` straight into the destination ([`Lane::is_read_vectored`]);
/// encrypted lanes decrypt into their own buffer and are read through a per-lane bounce buffer,
/// which lets the receiver verify a chunk's checksum before copying it into place.
pub trait Lane: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Reads into several buffers at once. The default reads into the first non-empty buffer.
    fn poll_read_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let Some(first) = bufs.iter_mut().find(|b| !b.is_empty()) else {
            return Poll::Ready(Ok(0));
        };
        let mut rb = ReadBuf::new(first);
        match self.as_mut().poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(rb.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Whether [`Lane::poll_read_vectored`] is a real scatter read (one system call for many
    /// buffers). When false, payloads are read into a bounce buffer and copied.
    fn is_read_vectored(&self) -> bool {
        false
    }

    /// Who is at the other end.
    fn peer(&self) -> PeerInfo;
}

impl Lane for Box<dyn Lane> {
    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let inner: &mut dyn Lane = &mut **self.get_mut();
        Pin::new(inner).poll_read_vectored(cx, bufs)
    }

    fn is_read_vectored(&self) -> bool {
        (**self).is_read_vectored()
    }

    fn peer(&self) -> PeerInfo {
        (**self).peer()
    }
}

/// An established connection to one peer, from which lanes are opened.
pub trait Connection: Send + Sync + 'static {
    /// Opens a new lane (a new TCP/TLS socket, or a new QUIC stream on the shared connection).
    fn open_lane(&self) -> BoxFut<'_, Result<Box<dyn Lane>>>;
    /// The peer's address.
    fn remote_addr(&self) -> SocketAddr;
    /// Closes the connection and every lane of it (QUIC); a no-op for TCP, whose lanes close
    /// when dropped.
    fn close(&self);
}

/// A listening socket yielding authenticated incoming lanes of any peer.
pub trait Acceptor: Send + Sync + 'static {
    /// The bound address.
    fn local_addr(&self) -> SocketAddr;
    /// The next incoming lane whose handshake succeeded. Failed handshakes (wrong certificate,
    /// plain TCP to a TLS listener, timeouts) are logged, counted in
    /// [`Acceptor::handshake_failures`] and never surface here.
    fn accept(&self) -> BoxFut<'_, Result<Box<dyn Lane>>>;
    /// Incoming connections refused during the handshake so far.
    fn handshake_failures(&self) -> u64;
}

/// A way to reach peers: connect and listen.
pub trait Transport: Send + Sync + 'static {
    /// The kind (for reports and the demo table).
    fn kind(&self) -> TransportKind;
    /// Listens on `addr` (port 0 picks a free port).
    fn listen(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Acceptor>>>;
    /// Connects to the endpoint listening at `addr`, within the transport's timeouts.
    fn connect(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Connection>>>;
}
