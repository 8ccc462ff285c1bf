//! TCP transport: plain TCP (trusted networks only: no authentication, no encryption) or TLS 1.3
//! over TCP (rustls via tokio-rustls) with the mutual peer check of [`super::tls`].
//!
//! Every lane is its own socket (`TCP_NODELAY` set, so small control frames are never held back
//! by Nagle's algorithm). The endpoint keeps a bounded pool of lanes per peer and reuses them, so
//! a long run of small transfers never opens one socket per transfer (no ephemeral-port
//! exhaustion). Plain TCP lanes receive with `readv` straight into the destination staging.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use super::tls::{cert_identity, Security};
use super::transport::{
    Acceptor, BoxFut, Connection, Lane, PeerInfo, QueuedAcceptor, Transport, TransportKind,
    TransportTimeouts,
};
use crate::error::{Error, Result};

impl Lane for TcpStream {
    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        loop {
            match me.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
            match me.try_read_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    fn is_read_vectored(&self) -> bool {
        true
    }

    fn peer(&self) -> PeerInfo {
        PeerInfo {
            addr: self
                .peer_addr()
                .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0))),
            identity: None,
        }
    }
}

/// Bytes of TLS records a lane's session may hold in user space while its socket is full, and
/// so the most plaintext one write encrypts before writing to the socket (rustls' default:
/// 64 KiB). Larger, a 1 MiB data frame takes 4 `writev` calls instead of 16: TLS pulls at 16-64
/// MiB ran 12-16% faster (docs/performance.md, "encrypted lanes"). A lane holds at most this
/// much beyond what the kernel's socket buffer holds.
const TLS_BUFFER_LIMIT: usize = 256 << 10;

/// A byte stream with the peer information fixed at handshake time (TLS and QUIC lanes).
pub(crate) struct Wrapped<S> {
    pub(crate) inner: S,
    pub(crate) peer: PeerInfo,
}

impl<S: AsyncRead + Unpin> AsyncRead for Wrapped<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Wrapped<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Lane for Wrapped<S> {
    /// Fills the buffers in order from the session's decrypted plaintext, as far as it goes
    /// without waiting: one call places many small pieces (256-byte head rows of a resharded
    /// transfer) where the default would place one. Pending only when nothing was read.
    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let mut total = 0;
        for b in bufs.iter_mut().filter(|b| !b.is_empty()) {
            let mut rb = ReadBuf::new(b);
            match Pin::new(&mut me.inner).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    total += n;
                    if n < rb.capacity() {
                        // End of stream (0) or the session has nothing more decrypted now.
                        break;
                    }
                }
                Poll::Ready(Err(e)) if total == 0 => return Poll::Ready(Err(e)),
                Poll::Pending if total == 0 => return Poll::Pending,
                // What was read is returned; the error or wake-up comes again on the next call.
                Poll::Ready(Err(_)) | Poll::Pending => break,
            }
        }
        Poll::Ready(Ok(total))
    }

    fn authenticates_bytes(&self) -> bool {
        true
    }

    fn peer(&self) -> PeerInfo {
        self.peer.clone()
    }
}

/// Plain TCP or TLS-over-TCP transport. `Send + Sync`.
pub struct TcpTransport {
    kind: TransportKind,
    security: Security,
    timeouts: TransportTimeouts,
    client: Option<tokio_rustls::TlsConnector>,
    server: Option<tokio_rustls::TlsAcceptor>,
}

impl TcpTransport {
    /// Plain TCP. Unauthenticated and unencrypted: for trusted networks only.
    pub fn plain(timeouts: TransportTimeouts) -> TcpTransport {
        TcpTransport {
            kind: TransportKind::Tcp,
            security: Security::None,
            timeouts,
            client: None,
            server: None,
        }
    }

    /// TLS 1.3 over TCP with mutual authentication by `security` (CA or PSK).
    ///
    /// Errors: [`Error::InvalidArgument`] for [`Security::None`] or unusable credentials.
    pub fn tls(security: Security, timeouts: TransportTimeouts) -> Result<TcpTransport> {
        let client = tokio_rustls::TlsConnector::from(security.client_config()?);
        let server = tokio_rustls::TlsAcceptor::from(security.server_config()?);
        Ok(TcpTransport {
            kind: TransportKind::Tls,
            security,
            timeouts,
            client: Some(client),
            server: Some(server),
        })
    }
}

async fn tcp_connect(addr: SocketAddr, t: &TransportTimeouts) -> Result<TcpStream> {
    let s = match tokio::time::timeout(t.connect, TcpStream::connect(addr)).await {
        Err(_) => {
            return Err(Error::Timeout(format!(
                "connect to {addr} took longer than {:?}",
                t.connect
            )))
        }
        Ok(Err(e)) => return Err(Error::io(format!("connect to {addr}"), e)),
        Ok(Ok(s)) => s,
    };
    s.set_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
    Ok(s)
}

struct TcpConn {
    addr: SocketAddr,
    t: Arc<TcpTransportShared>,
}

struct TcpTransportShared {
    timeouts: TransportTimeouts,
    client: Option<tokio_rustls::TlsConnector>,
    security: Security,
}

impl TcpTransportShared {
    async fn open(&self, addr: SocketAddr) -> Result<Box<dyn Lane>> {
        let s = tcp_connect(addr, &self.timeouts).await?;
        let Some(c) = &self.client else {
            return Ok(Box::new(s));
        };
        let name = self.security.server_name();
        match tokio::time::timeout(self.timeouts.handshake, c.connect(name, s)).await {
            Err(_) => Err(Error::Timeout(format!(
                "TLS handshake with {addr} took longer than {:?}",
                self.timeouts.handshake
            ))),
            Ok(Err(e)) => Err(Error::PeerClosed(format!(
                "TLS handshake with {addr} failed (peer not authenticated or refused us): {e}"
            ))),
            Ok(Ok(mut tls)) => {
                tls.get_mut().1.set_buffer_limit(Some(TLS_BUFFER_LIMIT));
                let identity = cert_identity(
                    tls.get_ref().1.peer_certificates(),
                    matches!(self.security, Security::Psk { .. }),
                );
                Ok(Box::new(Wrapped {
                    inner: tls,
                    peer: PeerInfo { addr, identity },
                }))
            }
        }
    }
}

impl Connection for TcpConn {
    fn open_lane(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(self.t.open(self.addr))
    }

    fn remote_addr(&self) -> SocketAddr {
        self.addr
    }

    fn close(&self) {}
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn listen(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Acceptor>>> {
        Box::pin(async move {
            let l = TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("listen on {addr}"), e))?;
            let local = l.local_addr().map_err(|e| Error::io("local_addr", e))?;
            let (sink, rx) = QueuedAcceptor::queue();
            let tls = self.server.clone();
            let hs = self.timeouts.handshake;
            let psk = matches!(self.security, Security::Psk { .. });
            let queue = sink.clone();
            let task = tokio::spawn(async move {
                loop {
                    let (sock, peer) = match l.accept().await {
                        Ok(x) => x,
                        Err(e) => {
                            // EMFILE and friends: back off briefly instead of spinning.
                            log::warn!("accept on {local} failed: {e}");
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                            continue;
                        }
                    };
                    let _ = sock.set_nodelay(true);
                    let Some(acc) = tls.clone() else {
                        if !queue.send(Box::new(sock)).await {
                            return;
                        }
                        continue;
                    };
                    let queue = queue.clone();
                    tokio::spawn(async move {
                        let what = format!("TLS peer {peer}");
                        if let Some(mut s) = queue.handshake(hs, acc.accept(sock), what).await {
                            s.get_mut().1.set_buffer_limit(Some(TLS_BUFFER_LIMIT));
                            let identity = cert_identity(s.get_ref().1.peer_certificates(), psk);
                            let lane = Wrapped {
                                inner: s,
                                peer: PeerInfo {
                                    addr: peer,
                                    identity,
                                },
                            };
                            queue.send(Box::new(lane)).await;
                        }
                    });
                }
            });
            Ok(QueuedAcceptor::start(local, &sink, rx, vec![task], None))
        })
    }

    fn connect(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Connection>>> {
        let shared = Arc::new(TcpTransportShared {
            timeouts: self.timeouts,
            client: self.client.clone(),
            security: self.security.clone(),
        });
        Box::pin(async move { Ok(Arc::new(TcpConn { addr, t: shared }) as Arc<dyn Connection>) })
    }
}
