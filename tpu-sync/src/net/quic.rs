//! QUIC transport (quinn): one QUIC connection per peer, one bidirectional stream per lane.
//!
//! TLS 1.3 is part of QUIC: both sides present certificates and check each other with the
//! [`super::tls::Security`] in force (CA-signed certificates or a PSK-derived pinned key); there
//! is no unauthenticated QUIC. Flow-control windows are sized for bulk transfer (32 MiB per
//! stream, 256 MiB per connection) so one stream can keep a fast link busy. Lanes are cheap
//! (a stream open costs no round trip), and an endpoint uses one UDP socket for listening and
//! connecting.
//!
//! Datagram size and socket buffers, for throughput: path MTU discovery probes up to
//! [`MAX_UDP_PAYLOAD`] (quinn's default stops at 1452 bytes; loopback and jumbo-frame networks
//! carry far larger datagrams, and per-datagram costs, crypto and system calls, dominate QUIC's
//! CPU time), and the UDP socket asks for [`UDP_BUFFER_BYTES`] of send and receive buffer (the
//! 208 KiB default drops datagrams of a fast sender before the receiver runs; the kernel caps the
//! request at `net.core.{r,w}mem_max`).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
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
}

impl Drop for QuicStream {
    fn drop(&mut self) {
        let _ = self.send.reset(VarInt::from_u32(0));
        let _ = self.recv.stop(VarInt::from_u32(0));
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
    endpoint: std::sync::Mutex<Option<quinn::Endpoint>>,
}

/// Largest UDP payload path MTU discovery probes for (QUIC's limit; the largest IPv4 UDP payload
/// is 65507). Discovery settles on what the path carries.
pub const MAX_UDP_PAYLOAD: u16 = 65507;

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

/// A quinn endpoint on our own UDP socket ([`udp_socket`]).
fn quinn_endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint> {
    let sock = udp_socket(addr)?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        sock,
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|e| Error::io(format!("QUIC endpoint on {addr}"), e))
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
    if let Ok(t) = quinn::IdleTimeout::try_from(Duration::from_secs(120)) {
        tc.max_idle_timeout(Some(t));
    }
    tc
}

impl QuicTransport {
    /// A QUIC transport authenticated by `security` (CA or PSK; [`Security::None`] is refused).
    pub fn new(security: Security, timeouts: TransportTimeouts) -> Result<QuicTransport> {
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
            endpoint: std::sync::Mutex::new(None),
        })
    }

    fn endpoint_for(&self, remote: SocketAddr) -> Result<quinn::Endpoint> {
        let mut g = self.endpoint.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = g.as_ref() {
            return Ok(e.clone());
        }
        let bind: SocketAddr = if remote.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let e = quinn_endpoint(bind, None)?;
        *g = Some(e.clone());
        Ok(e)
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
            e.close(VarInt::from_u32(0), b"endpoint closed");
        }
    }
}

fn identity_of(c: &quinn::Connection, psk: bool) -> Option<String> {
    let any = c.peer_identity()?;
    let certs = any.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    cert_identity(Some(&certs), psk)
}

struct QuicConn {
    conn: quinn::Connection,
    peer: PeerInfo,
}

impl Connection for QuicConn {
    fn open_lane(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(async move {
            let (send, recv) = self.conn.open_bi().await.map_err(|e| {
                Error::PeerClosed(format!("QUIC stream to {}: {e}", self.peer.addr))
            })?;
            Ok(Box::new(Wrapped {
                inner: QuicStream { send, recv },
                peer: self.peer.clone(),
            }) as Box<dyn Lane>)
        })
    }

    fn remote_addr(&self) -> SocketAddr {
        self.peer.addr
    }

    fn close(&self) {
        self.conn.close(VarInt::from_u32(0), b"closed");
    }
}

impl Drop for QuicConn {
    fn drop(&mut self) {
        self.conn.close(VarInt::from_u32(0), b"closed");
    }
}

impl Transport for QuicTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Quic
    }

    fn listen(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Acceptor>>> {
        Box::pin(async move {
            let ep = quinn_endpoint(addr, Some(self.server.clone()))
                .map_err(|e| e.context(format!("QUIC listen on {addr}")))?;
            let local = ep.local_addr().map_err(|e| Error::io("local_addr", e))?;
            {
                let mut g = self.endpoint.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(old) = g.replace(ep.clone()) {
                    old.close(VarInt::from_u32(0), b"replaced");
                }
            }
            let (sink, rx) = QueuedAcceptor::queue();
            let hs = self.timeouts.handshake;
            let psk = self.psk();
            let queue = sink.clone();
            let task = tokio::spawn(async move {
                let mut conns = tokio::task::JoinSet::new();
                while let Some(incoming) = ep.accept().await {
                    let queue = queue.clone();
                    conns.spawn(async move {
                        let remote = incoming.remote_address();
                        let what = format!("QUIC peer {remote}");
                        let Some(conn) = queue.handshake(hs, incoming, what).await else {
                            return;
                        };
                        let peer = PeerInfo {
                            addr: remote,
                            identity: identity_of(&conn, psk),
                        };
                        while let Ok((send, recv)) = conn.accept_bi().await {
                            let lane = Wrapped {
                                inner: QuicStream { send, recv },
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
            Ok(QueuedAcceptor::start(local, &sink, rx, vec![task], None))
        })
    }

    fn connect(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Connection>>> {
        Box::pin(async move {
            let ep = self.endpoint_for(addr)?;
            let name = self.security.server_name();
            let connecting = ep
                .connect_with(self.client.clone(), addr, &name.to_str())
                .map_err(|e| Error::InvalidArgument(format!("QUIC connect to {addr}: {e}")))?;
            let limit = self.timeouts.connect + self.timeouts.handshake;
            let conn = match tokio::time::timeout(limit, connecting).await {
                Err(_) => {
                    return Err(Error::Timeout(format!(
                        "QUIC connect/handshake with {addr} took longer than {limit:?}"
                    )))
                }
                Ok(Err(e)) => {
                    return Err(Error::PeerClosed(format!(
                        "QUIC connection to {addr} failed (peer not authenticated, refused us, or \
                         not listening): {e}"
                    )))
                }
                Ok(Ok(c)) => c,
            };
            let peer = PeerInfo {
                addr,
                identity: identity_of(&conn, self.psk()),
            };
            Ok(Arc::new(QuicConn { conn, peer }) as Arc<dyn Connection>)
        })
    }
}
