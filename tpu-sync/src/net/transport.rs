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
//! lane), [`super::quic::QuicTransport`] (a few QUIC connections per peer, one stream per lane) and
//! [`super::shm::ShmTransport`] (same host: Unix-domain sockets, data copied by the receiver
//! straight out of the sender's memory; plain TCP to other hosts).
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
    /// Same host: lanes are Unix-domain sockets and the receiver copies each chunk straight out
    /// of the sender's staging with cross-memory attach (`process_vm_readv`), one copy per
    /// byte; peers on other hosts (or where that is refused) are reached over plain TCP
    /// ([`super::shm`]). No authentication or encryption: trusted hosts only.
    Shm,
}

impl TransportKind {
    /// Parses `tcp`, `tls`, `quic` or `shm`.
    pub fn parse(s: &str) -> Result<TransportKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(TransportKind::Tcp),
            "tls" => Ok(TransportKind::Tls),
            "quic" => Ok(TransportKind::Quic),
            "shm" => Ok(TransportKind::Shm),
            o => Err(crate::Error::InvalidArgument(format!(
                "transport `{o}` is not available (available: tcp, tls, quic, shm)"
            ))),
        }
    }

    /// Whether the transport authenticates peers and so needs credentials ([`super::Security`]
    /// other than `None`): `tls` and `quic`. `tcp` and `shm` trust the network / host.
    pub fn authenticates(self) -> bool {
        matches!(self, TransportKind::Tls | TransportKind::Quic)
    }

    /// `tcp`, `tls`, `quic` or `shm`.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Tls => "tls",
            TransportKind::Quic => "quic",
            TransportKind::Shm => "shm",
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
/// Every lane's data frames are read straight into the destination staging: plain TCP lanes
/// with `readv` ([`Lane::is_read_vectored`]), encrypted lanes out of the plaintext their TLS or
/// QUIC session decrypted and authenticated.
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
    /// buffers). When false, frame headers and control bodies are read from the lane directly
    /// rather than through the framing's read buffer (the lane buffers already).
    fn is_read_vectored(&self) -> bool {
        false
    }

    /// Whether the transport authenticates every byte of the stream itself: TLS 1.3 records and
    /// QUIC packets are AEAD-sealed (AES-GCM or ChaCha20-Poly1305, RFC 8446 section 5.2, RFC
    /// 9001 section 5), so a byte changed, dropped or reordered between the two sessions fails
    /// the connection before the receiver reads it. On such lanes data frames may go without
    /// their xxh3-64 ([`crate::net::EndpointOptions::hash_encrypted_frames`]). Default false.
    fn authenticates_bytes(&self) -> bool {
        false
    }

    /// Who is at the other end.
    fn peer(&self) -> PeerInfo;

    /// For a lane to a process on the same host ([`super::shm`]): whether data frames may
    /// travel by reference in either direction. `None` (the default): every payload travels
    /// inline on the lane.
    fn shm_peer(&self) -> Option<ShmPeer> {
        None
    }
}

/// What the two ends of a same-host lane may read of each other's memory, found by probing
/// when the lane was opened ([`super::shm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmPeer {
    /// The peer's process id (from `SO_PEERCRED`, never from the wire).
    pub pid: i32,
    /// This process may copy out of the peer's memory (`process_vm_readv` succeeded on the
    /// peer's probe): the peer sends data by reference.
    pub can_read_peer: bool,
    /// The peer may copy out of this process: this side sends data by reference.
    pub peer_can_read_me: bool,
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

    fn authenticates_bytes(&self) -> bool {
        (**self).authenticates_bytes()
    }

    fn peer(&self) -> PeerInfo {
        (**self).peer()
    }

    fn shm_peer(&self) -> Option<ShmPeer> {
        (**self).shm_peer()
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

/// Lanes a transport's listener tasks have accepted and authenticated, waiting for
/// [`Acceptor::accept`] (at most this many; a full queue back-pressures the listener tasks).
const ACCEPT_QUEUE_LANES: usize = 1024;

/// The sending side of a [`QueuedAcceptor`]: where listener tasks put the lanes whose handshake
/// passed, and the counter of those that failed. Cloned into every per-connection task.
#[derive(Clone)]
pub(crate) struct LaneSink {
    pub(crate) tx: tokio::sync::mpsc::Sender<Box<dyn Lane>>,
    pub(crate) failures: Arc<std::sync::atomic::AtomicU64>,
    /// Handshakes in progress on this listener ([`MAX_HANDSHAKES_IN_PROGRESS`] permits).
    handshakes: Arc<tokio::sync::Semaphore>,
}

/// Most transport handshakes (TLS, QUIC, the shm hello) one listener runs at once, before any
/// peer is authenticated or counted in `max_inbound_lanes`: a connection that arrives while
/// this many are in progress is closed at once and counted in
/// [`Acceptor::handshake_failures`], so unauthenticated peers that open connections and never
/// finish them cannot make the listener hold more than this many sockets and handshake states
/// (each for at most `handshake_timeout`).
pub const MAX_HANDSHAKES_IN_PROGRESS: usize = 256;

impl LaneSink {
    /// Runs one incoming connection's handshake `fut` under `limit`. A failure or a timeout is
    /// counted in [`Acceptor::handshake_failures`], logged with `peer` (e.g. "TLS peer
    /// 10.0.0.2:5000"), and gives `None`; the caller then drops the connection.
    pub(crate) async fn handshake<T, E: std::fmt::Display>(
        &self,
        limit: Duration,
        fut: impl std::future::IntoFuture<Output = std::result::Result<T, E>>,
        peer: impl std::fmt::Display,
    ) -> Option<T> {
        let Ok(_permit) = self.handshakes.clone().try_acquire_owned() else {
            self.failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            log::warn!(
                "refused {peer}: {MAX_HANDSHAKES_IN_PROGRESS} handshakes already in progress"
            );
            return None;
        };
        let failed = match tokio::time::timeout(limit, fut).await {
            Ok(Ok(v)) => return Some(v),
            Ok(Err(e)) => format!("refused {peer}: {e}"),
            Err(_) => format!("handshake of {peer} timed out after {limit:?}"),
        };
        self.failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        log::warn!("{failed}");
        None
    }

    /// Queues an accepted lane; `false` once the acceptor is gone (the task should end).
    pub(crate) async fn send(&self, lane: Box<dyn Lane>) -> bool {
        self.tx.send(lane).await.is_ok()
    }
}

/// The [`Acceptor`] of every transport here: listener tasks accept connections, run their
/// handshakes and queue the lanes that passed ([`LaneSink`]); `accept` hands them out in
/// arrival order. Dropping it aborts the listener tasks (closing the listening sockets).
///
/// Thread-safety: `Send + Sync`; concurrent `accept` calls take lanes one at a time.
pub(crate) struct QueuedAcceptor {
    local: SocketAddr,
    rx: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Box<dyn Lane>>>,
    failures: Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// An acceptor whose lanes a task of this one forwards (the shm transport's TCP side for
    /// peers on other hosts): kept alive with this one, its handshake failures added to ours.
    inner: Option<Arc<dyn Acceptor>>,
    /// Runs when the acceptor is dropped, before the tasks are aborted (the QUIC listener closes
    /// its endpoint there: every connection that came in on it, whoever still holds a stream).
    on_drop: Option<Box<dyn Fn() + Send + Sync>>,
}

impl QueuedAcceptor {
    /// A new queue: the sink for the listener tasks and the receiving half for [`Self::start`].
    pub(crate) fn queue() -> (LaneSink, tokio::sync::mpsc::Receiver<Box<dyn Lane>>) {
        let (tx, rx) = tokio::sync::mpsc::channel(ACCEPT_QUEUE_LANES);
        let failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES_IN_PROGRESS));
        (
            LaneSink {
                tx,
                failures,
                handshakes,
            },
            rx,
        )
    }

    /// The acceptor bound at `local`, taking from `rx` the lanes `sink`'s tasks (`tasks`, aborted
    /// on drop) queue. `inner`: see the field.
    pub(crate) fn start(
        local: SocketAddr,
        sink: &LaneSink,
        rx: tokio::sync::mpsc::Receiver<Box<dyn Lane>>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
        inner: Option<Arc<dyn Acceptor>>,
    ) -> Arc<dyn Acceptor> {
        Self::make((local, sink, rx), tasks, inner, None)
    }

    /// [`Self::start`] (no inner acceptor) with `on_drop` run when the acceptor is dropped
    /// (see the field).
    #[cfg(feature = "quic")]
    pub(crate) fn start_with_close(
        local: SocketAddr,
        sink: &LaneSink,
        rx: tokio::sync::mpsc::Receiver<Box<dyn Lane>>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
        on_drop: Box<dyn Fn() + Send + Sync>,
    ) -> Arc<dyn Acceptor> {
        Self::make((local, sink, rx), tasks, None, Some(on_drop))
    }

    fn make(
        (local, sink, rx): (
            SocketAddr,
            &LaneSink,
            tokio::sync::mpsc::Receiver<Box<dyn Lane>>,
        ),
        tasks: Vec<tokio::task::JoinHandle<()>>,
        inner: Option<Arc<dyn Acceptor>>,
        on_drop: Option<Box<dyn Fn() + Send + Sync>>,
    ) -> Arc<dyn Acceptor> {
        Arc::new(QueuedAcceptor {
            local,
            rx: tokio::sync::Mutex::new(rx),
            failures: sink.failures.clone(),
            tasks,
            inner,
            on_drop,
        })
    }
}

impl Drop for QueuedAcceptor {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Acceptor for QueuedAcceptor {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(async move {
            self.rx
                .lock()
                .await
                .recv()
                .await
                .ok_or_else(|| crate::error::Error::Cancelled("listener closed".into()))
        })
    }

    fn handshake_failures(&self) -> u64 {
        self.failures.load(std::sync::atomic::Ordering::Relaxed)
            + self.inner.as_ref().map_or(0, |a| a.handshake_failures())
    }
}
