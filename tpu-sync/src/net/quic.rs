//! QUIC transport (quinn): a few QUIC connections per peer
//! ([`crate::net::EndpointOptions::quic_connections_per_peer`], default
//! [`DEFAULT_CONNECTIONS_PER_PEER`]), one bidirectional stream per lane, each lane on the
//! connection with the fewest open lanes.
//!
//! Why more than one connection: quinn drives each connection (packetisation, acknowledgements,
//! AES-GCM of every datagram) on one task, so all lanes of one connection share one core; the
//! profile of `bench net --transports quic` put 30% of the runtime threads' time in that task
//! (docs/performance.md). Each extra connection of the connecting side also gets its own UDP
//! socket and quinn endpoint, so receiving is spread too. The accepting side needs nothing:
//! it queues the lanes of every authenticated connection alike.
//!
//! TLS 1.3 is part of QUIC: both sides present certificates and check each other with the
//! [`super::tls::Security`] in force (CA-signed certificates or a PSK-derived pinned key); there
//! is no unauthenticated QUIC. Flow-control windows are sized for bulk transfer (32 MiB per
//! stream, 256 MiB per connection) so one stream can keep a fast link busy. Lanes are cheap
//! (a stream open costs no round trip), and an endpoint uses one UDP socket for listening and
//! connecting.
//!
//! Datagram size and socket buffers, for throughput: path MTU discovery's upper bound is
//! [`MAX_UDP_PAYLOAD`], but what a peer accepts caps it: quinn's endpoint default of 1472 bytes
//! (the Ethernet payload), which this transport keeps, so QUIC datagrams are at most 1472 bytes
//! even on loopback. Raising the accepted size was measured and rejected (docs/performance.md,
//! QUIC): on loopback the large datagrams were dropped by the receiving socket, quinn's
//! black-hole detection then fell back to 1200 bytes, and throughput did not rise. The UDP
//! socket asks for [`UDP_BUFFER_BYTES`] of send and receive buffer (the 208 KiB default drops
//! datagrams of a fast sender before the receiver runs; the kernel caps the request at
//! `net.core.{r,w}mem_max`). Each connection's stats (packets sent and lost, congestion events,
//! MTU, window, RTT) are logged at debug level when it closes.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::VarInt;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::tcp::Wrapped;
use super::tls::{cert_identity, Security};
use super::transport::{
    Acceptor, BoxFut, Connection, Lane, PeerInfo, QueuedAcceptor, Transport, TransportKind,
    TransportTimeouts,
};
use crate::error::{Error, Result};

/// One bidirectional QUIC stream as a byte stream. Dropping it resets both directions, so a lane
/// abandoned mid-transfer stops the peer at once.
pub(crate) struct QuicStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    /// Open-lane count of the connection it was opened on (connecting side only).
    load: Option<Arc<AtomicUsize>>,
}

impl Drop for QuicStream {
    fn drop(&mut self) {
        let _ = self.send.reset(VarInt::from_u32(0));
        let _ = self.recv.stop(VarInt::from_u32(0));
        if let Some(l) = &self.load {
            l.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl AsyncRead for QuicStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        AsyncRead::poll_read(Pin::new(&mut self.get_mut().recv), cx, buf)
    }
}

impl AsyncWrite for QuicStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.get_mut().send), cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.get_mut().send), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.get_mut().send), cx)
    }
}

/// QUIC transport. `Send + Sync`.
pub struct QuicTransport {
    security: Security,
    timeouts: TransportTimeouts,
    client: quinn::ClientConfig,
    server: quinn::ServerConfig,
    /// Connections opened to each peer (>= 1).
    connections: usize,
    /// The listening endpoint, or the first client endpoint: connection 0 of every peer.
    endpoint: std::sync::Mutex<Option<Ep>>,
    /// Client-only endpoints (own UDP sockets) of connections 1.. of every peer.
    extra: std::sync::Mutex<Vec<Ep>>,
}

/// Default QUIC connections per peer ([`super::DEFAULT_QUIC_CONNECTIONS_PER_PEER`]).
pub const DEFAULT_CONNECTIONS_PER_PEER: u32 = super::DEFAULT_QUIC_CONNECTIONS_PER_PEER;

/// Upper bound of path MTU discovery (the largest IPv4 UDP payload). The peer's accepted
/// payload size (quinn's default, 1472 bytes) caps it first; see the module docs.
pub const MAX_UDP_PAYLOAD: u16 = 65507;

/// QUIC's idle timeout: a connection that hears nothing from its peer this long is dropped
/// (keep-alives go out every 5 s, so a live peer never reaches it; the endpoint's own
/// heartbeat declares a silent peer dead much sooner). It is also the bound on a connection
/// whose peer vanished without a close that reached this side, e.g. a pusher killed while its
/// connections were being set up, while this side's endpoint is alive. Dropping the listener
/// (or the endpoint) closes every connection at once instead, and its UDP socket once they
/// drained, at most [`SOCKET_CLOSE_GRACE`] later, also when one of them would not drain
/// (`EndpointSocket`;
/// `tests/net_chaos.rs::quic_peer_vanishing_mid_setup_releases_the_listener`).
pub const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Send and receive buffer requested for the QUIC UDP socket (capped by the kernel).
pub const UDP_BUFFER_BYTES: usize = 8 << 20;

/// A UDP socket bound to `addr` with [`UDP_BUFFER_BYTES`] buffers requested (best effort).
fn udp_socket(addr: SocketAddr) -> Result<std::net::UdpSocket> {
    let sock = std::net::UdpSocket::bind(addr)
        .map_err(|e| Error::io(format!("QUIC UDP socket on {addr}"), e))?;
    use std::os::fd::AsRawFd;
    let v = UDP_BUFFER_BYTES as libc::c_int;
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: a valid socket descriptor we own and a pointer to an int of the size given.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            log::debug!(
                "QUIC socket buffer option {opt}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(sock)
}

/// How long a closed quinn endpoint keeps its UDP socket for its connections to drain (send
/// their CONNECTION_CLOSE and absorb late packets) before `EndpointSocket::close` closes it:
/// QUIC's drain period of a connection that has no RTT sample yet, 3 x PTO with quinn's initial
/// RTT of 333 ms (RFC 9002 section 6.2.1: PTO = RTT + 4 x RTT/2 = 999 ms). A connection that
/// does have an RTT sample drains sooner (on loopback within milliseconds), and the socket then
/// closes as soon as every connection drained.
pub const SOCKET_CLOSE_GRACE: Duration = Duration::from_secs(3);

/// The UDP socket under one quinn endpoint, which this side can close while quinn still holds
/// it. quinn keeps an endpoint's socket until every connection on it has drained, and a
/// connection need not drain soon: quinn-proto 0.11 leaves a server-side connection whose first
/// Initial packet carries only a CONNECTION_CLOSE (a client that gave up before sending its
/// ClientHello, e.g. a dropped connect) in the draining state without a close timer, so it lives
/// until [`IDLE_TIMEOUT`], and its UDP socket with it. Closing the socket ends that: RFC 9000
/// section 10.2 lets an endpoint leave the closing and draining states early when it closed the
/// socket. After [`EndpointSocket::close`] the descriptor is closed, receiving waits forever
/// (quinn's tasks then end as their timers run out) and sent datagrams are dropped like losses.
///
/// Thread-safety: `Send + Sync`; quinn's endpoint and connection tasks call it concurrently
/// (each call holds a read lock for one non-blocking system call; `close` takes the write lock).
#[derive(Debug)]
pub(crate) struct EndpointSocket {
    state: quinn::udp::UdpSocketState,
    io: std::sync::RwLock<Option<tokio::net::UdpSocket>>,
}

impl EndpointSocket {
    /// Wraps `sock` (non-blocking from here on). Must run inside a Tokio runtime.
    fn new(sock: std::net::UdpSocket) -> io::Result<EndpointSocket> {
        let state = quinn::udp::UdpSocketState::new((&sock).into())?;
        sock.set_nonblocking(true)?;
        let io = tokio::net::UdpSocket::from_std(sock)?;
        Ok(EndpointSocket {
            state,
            io: std::sync::RwLock::new(Some(io)),
        })
    }

    /// Closes the descriptor now (idempotent).
    pub(crate) fn close(&self) {
        let io = self.io.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(io);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<tokio::net::UdpSocket>> {
        self.io.read().unwrap_or_else(|p| p.into_inner())
    }
}

impl quinn::AsyncUdpSocket for EndpointSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn quinn::UdpPoller>> {
        Box::pin(Writable(self))
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> io::Result<()> {
        let g = self.read();
        let Some(io) = g.as_ref() else {
            return Ok(());
        };
        io.try_io(tokio::io::Interest::WRITABLE, || {
            self.state.send(io.into(), transmit)
        })
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let g = self.read();
        let Some(io) = g.as_ref() else {
            return Poll::Pending;
        };
        loop {
            std::task::ready!(io.poll_recv_ready(cx))?;
            if let Ok(n) = io.try_io(tokio::io::Interest::READABLE, || {
                self.state.recv(io.into(), bufs, meta)
            }) {
                return Poll::Ready(Ok(n));
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        match self.read().as_ref() {
            Some(io) => io.local_addr(),
            None => Err(io::Error::new(io::ErrorKind::NotConnected, "socket closed")),
        }
    }

    fn may_fragment(&self) -> bool {
        self.state.may_fragment()
    }

    fn max_transmit_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.state.gro_segments()
    }
}

/// quinn's wait for an [`EndpointSocket`] to become writable (at once once it is closed).
#[derive(Debug)]
struct Writable(Arc<EndpointSocket>);

impl quinn::UdpPoller for Writable {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
        match self.0.read().as_ref() {
            Some(io) => io.poll_send_ready(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

/// A quinn endpoint with its closable socket.
#[derive(Clone)]
struct Ep {
    quinn: quinn::Endpoint,
    socket: Arc<EndpointSocket>,
}

impl Ep {
    /// Closes every connection on the endpoint at once (each sends its CONNECTION_CLOSE), then
    /// its UDP socket when they all drained or [`SOCKET_CLOSE_GRACE`] passed, whichever comes
    /// first (at once outside a Tokio runtime).
    fn close(&self, reason: &'static [u8]) {
        self.quinn.close(VarInt::from_u32(0), reason);
        let (ep, socket) = (self.quinn.clone(), self.socket.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let _ = tokio::time::timeout(SOCKET_CLOSE_GRACE, ep.wait_idle()).await;
                    socket.close();
                });
            }
            Err(_) => socket.close(),
        }
    }
}

/// A quinn endpoint on our own UDP socket ([`udp_socket`], [`EndpointSocket`]).
fn quinn_endpoint(addr: SocketAddr, server: Option<quinn::ServerConfig>) -> Result<Ep> {
    let what = || format!("QUIC endpoint on {addr}");
    let socket =
        Arc::new(EndpointSocket::new(udp_socket(addr)?).map_err(|e| Error::io(what(), e))?);
    let quinn = quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        server,
        socket.clone(),
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|e| Error::io(what(), e))?;
    Ok(Ep { quinn, socket })
}

fn transport_config() -> quinn::TransportConfig {
    let mut tc = quinn::TransportConfig::default();
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_UDP_PAYLOAD);
    tc.mtu_discovery_config(Some(mtu));
    tc.max_concurrent_bidi_streams(VarInt::from_u32(4096));
    tc.max_concurrent_uni_streams(VarInt::from_u32(0));
    tc.stream_receive_window(VarInt::from_u32(32 << 20));
    tc.receive_window(VarInt::from_u32(256 << 20));
    tc.send_window(256 << 20);
    // Liveness is the endpoint's own heartbeat; QUIC keep-alives only hold NAT state.
    tc.keep_alive_interval(Some(Duration::from_secs(5)));
    if let Ok(t) = quinn::IdleTimeout::try_from(IDLE_TIMEOUT) {
        tc.max_idle_timeout(Some(t));
    }
    tc
}

impl QuicTransport {
    /// A QUIC transport authenticated by `security` (CA or PSK; [`Security::None`] is refused)
    /// that opens `connections` QUIC connections to each peer it connects to.
    ///
    /// Errors: [`Error::InvalidArgument`] for `connections == 0` or credentials rustls refuses.
    pub fn new(
        security: Security,
        timeouts: TransportTimeouts,
        connections: u32,
    ) -> Result<QuicTransport> {
        if connections == 0 {
            return Err(Error::InvalidArgument(
                "quic_connections_per_peer must be >= 1".into(),
            ));
        }
        let tc = Arc::new(transport_config());
        let cc = QuicClientConfig::try_from(security.client_config()?)
            .map_err(|e| Error::InvalidArgument(format!("QUIC client config: {e}")))?;
        let mut client = quinn::ClientConfig::new(Arc::new(cc));
        client.transport_config(tc.clone());
        let sc = QuicServerConfig::try_from(security.server_config()?)
            .map_err(|e| Error::InvalidArgument(format!("QUIC server config: {e}")))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(sc));
        server.transport_config(tc);
        Ok(QuicTransport {
            security,
            timeouts,
            client,
            server,
            connections: connections as usize,
            endpoint: std::sync::Mutex::new(None),
            extra: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The quinn endpoint of connection `index` to `remote`: the shared one (listening, or the
    /// first client endpoint) for 0, a client-only endpoint of its own for each other index,
    /// made on first use and kept for every peer.
    fn endpoint_for(&self, remote: SocketAddr, index: usize) -> Result<quinn::Endpoint> {
        let bind: SocketAddr = if remote.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        if index == 0 {
            let mut g = self.endpoint.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = g.as_ref() {
                return Ok(e.quinn.clone());
            }
            let e = quinn_endpoint(bind, None)?;
            let q = e.quinn.clone();
            *g = Some(e);
            return Ok(q);
        }
        let mut g = self.extra.lock().unwrap_or_else(|p| p.into_inner());
        while g.len() < index {
            g.push(quinn_endpoint(bind, None)?);
        }
        Ok(g[index - 1].quinn.clone())
    }

    /// One authenticated QUIC connection to `addr` on the endpoint of connection `index`,
    /// within the connect and handshake timeouts.
    async fn connect_one(&self, addr: SocketAddr, index: usize) -> Result<quinn::Connection> {
        let ep = self.endpoint_for(addr, index)?;
        let name = self.security.server_name();
        let connecting = ep
            .connect_with(self.client.clone(), addr, &name.to_str())
            .map_err(|e| Error::InvalidArgument(format!("QUIC connect to {addr}: {e}")))?;
        let limit = self.timeouts.connect + self.timeouts.handshake;
        match tokio::time::timeout(limit, connecting).await {
            Err(_) => Err(Error::Timeout(format!(
                "QUIC connect/handshake with {addr} took longer than {limit:?}"
            ))),
            Ok(Err(e)) => Err(Error::PeerClosed(format!(
                "QUIC connection to {addr} failed (peer not authenticated, refused us, or not \
                 listening): {e}"
            ))),
            Ok(Ok(c)) => Ok(c),
        }
    }

    fn psk(&self) -> bool {
        matches!(self.security, Security::Psk { .. })
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        if let Some(e) = self
            .endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            e.close(b"endpoint closed");
        }
        for e in self
            .extra
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            e.close(b"endpoint closed");
        }
    }
}

fn identity_of(c: &quinn::Connection, psk: bool) -> Option<String> {
    let any = c.peer_identity()?;
    let certs = any.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    cert_identity(Some(&certs), psk)
}

/// Closes a QUIC connection when dropped (a listener's per-connection task holds one).
struct CloseOnDrop(quinn::Connection);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close(VarInt::from_u32(0), b"closed");
    }
}

/// The QUIC connections to one peer, each with its count of open lanes.
struct QuicConn {
    conns: Vec<(quinn::Connection, Arc<AtomicUsize>)>,
    peer: PeerInfo,
}

impl QuicConn {
    /// The live connection with the fewest open lanes (the first on a tie); a closed one only
    /// when all are closed (its `open_bi` then reports why).
    fn least_loaded(&self) -> &(quinn::Connection, Arc<AtomicUsize>) {
        let live = self
            .conns
            .iter()
            .filter(|(c, _)| c.close_reason().is_none())
            .min_by_key(|(_, n)| n.load(Ordering::Relaxed));
        live.unwrap_or(&self.conns[0])
    }
}

impl Connection for QuicConn {
    fn open_lane(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(async move {
            let (conn, load) = self.least_loaded();
            load.fetch_add(1, Ordering::Relaxed);
            let (send, recv) = match conn.open_bi().await {
                Ok(s) => s,
                Err(e) => {
                    load.fetch_sub(1, Ordering::Relaxed);
                    return Err(Error::PeerClosed(format!(
                        "QUIC stream to {}: {e}",
                        self.peer.addr
                    )));
                }
            };
            Ok(Box::new(Wrapped {
                inner: QuicStream {
                    send,
                    recv,
                    load: Some(load.clone()),
                },
                peer: self.peer.clone(),
            }) as Box<dyn Lane>)
        })
    }

    fn remote_addr(&self) -> SocketAddr {
        self.peer.addr
    }

    fn close(&self) {
        for (i, (c, _)) in self.conns.iter().enumerate() {
            let st = c.stats();
            log::debug!(
                "QUIC connection {i} to {} closed: {} packets sent, {} lost ({} bytes) in {} \
                 congestion events, MTU {}, cwnd {} bytes, RTT {:?} (min {:?})",
                self.peer.addr,
                st.path.sent_packets,
                st.path.lost_packets,
                st.path.lost_bytes,
                st.path.congestion_events,
                st.path.current_mtu,
                st.path.cwnd,
                st.path.rtt,
                st.path.min_rtt
            );
            c.close(VarInt::from_u32(0), b"closed");
        }
    }
}

impl Drop for QuicConn {
    fn drop(&mut self) {
        self.close();
    }
}

impl Transport for QuicTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Quic
    }

    fn listen(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Acceptor>>> {
        Box::pin(async move {
            let listener = quinn_endpoint(addr, Some(self.server.clone()))
                .map_err(|e| e.context(format!("QUIC listen on {addr}")))?;
            let ep = listener.quinn.clone();
            let local = ep.local_addr().map_err(|e| Error::io("local_addr", e))?;
            {
                let mut g = self.endpoint.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(old) = g.replace(listener.clone()) {
                    old.close(b"replaced");
                }
            }
            let (sink, rx) = QueuedAcceptor::queue();
            let hs = self.timeouts.handshake;
            let psk = self.psk();
            let queue = sink.clone();
            let task = tokio::spawn(async move {
                let mut conns = tokio::task::JoinSet::new();
                while let Some(incoming) = ep.accept().await {
                    // Address validation first (a stateless Retry, one extra round trip per
                    // connection): no connection state exists for a peer until it proved it
                    // receives at its source address, so spoofed Initial packets cost nothing,
                    // and a client that gave up before its ClientHello (an Initial carrying only
                    // a CONNECTION_CLOSE, see `EndpointSocket`) leaves no connection behind.
                    if !incoming.remote_address_validated() && incoming.may_retry() {
                        let _ = incoming.retry();
                        continue;
                    }
                    let queue = queue.clone();
                    conns.spawn(async move {
                        let remote = incoming.remote_address();
                        let what = format!("QUIC peer {remote}");
                        let Some(conn) = queue.handshake(hs, incoming, what).await else {
                            return;
                        };
                        // However this task ends (the peer closed, the listener was dropped and
                        // aborted it), the connection is closed then, not when its last stream
                        // handle goes or its idle timeout passes.
                        let _close = CloseOnDrop(conn.clone());
                        let peer = PeerInfo {
                            addr: remote,
                            identity: identity_of(&conn, psk),
                        };
                        while let Ok((send, recv)) = conn.accept_bi().await {
                            let lane = Wrapped {
                                inner: QuicStream {
                                    send,
                                    recv,
                                    load: None,
                                },
                                peer: peer.clone(),
                            };
                            if !queue.send(Box::new(lane)).await {
                                break;
                            }
                        }
                    });
                    while conns.try_join_next().is_some() {}
                }
            });
            // Dropping the acceptor closes the listening endpoint first: every connection
            // that came in on it closes at once (a peer that died mid-setup never answers, and
            // its connection would otherwise hold the UDP socket until IDLE_TIMEOUT), and the
            // UDP socket closes once they drained, within SOCKET_CLOSE_GRACE (`Ep::close`).
            Ok(QueuedAcceptor::start_with_close(
                local,
                &sink,
                rx,
                vec![task],
                Box::new(move || listener.close(b"listener closed")),
            ))
        })
    }

    fn connect(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Connection>>> {
        Box::pin(async move {
            // All connections handshake at once; any failure fails the connect (the ones that
            // were made close when dropped).
            let attempts = (0..self.connections).map(|i| self.connect_one(addr, i));
            let mut conns = Vec::with_capacity(self.connections);
            for r in futures_util::future::join_all(attempts).await {
                conns.push((r?, Arc::new(AtomicUsize::new(0))));
            }
            let peer = PeerInfo {
                addr,
                identity: identity_of(&conns[0].0, self.psk()),
            };
            Ok(Arc::new(QuicConn { conns, peer }) as Arc<dyn Connection>)
        })
    }
}
