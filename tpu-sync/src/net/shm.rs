//! Same-host transport: Unix-domain-socket lanes on which the receiver copies each data chunk
//! straight out of the sender's staging with cross-memory attach (`process_vm_readv(2)`), so
//! every payload byte is copied once (sender staging -> receiver staging), with no kernel socket
//! buffer in between. Peers on other hosts are reached over plain TCP, so `shm` can be
//! configured on every endpoint of a deployment.
//!
//! # Addressing and selection
//!
//! An endpoint listening on `ip:port` listens on plain TCP at that address and on the abstract
//! Unix socket `@tpu-sync-shm/<port>` (abstract names live in the network namespace, so only
//! processes on the same host and namespace can reach it). A client opening a lane to `ip:port`
//! uses the Unix socket when `ip` is an address of this host (loopback, unspecified, or an
//! address a UDP socket can bind to here) and the listener answers the shm hello with that same
//! port and address; otherwise (another host, a TCP-only peer, a foreign listener on the name) it
//! falls back to plain TCP. A listener whose Unix name is taken serves TCP only.
//!
//! # The shm hello and the probe
//!
//! Right after a Unix lane connects, each side writes a 48-byte hello ([`HELLO_LEN`]): magic
//! `TSYNCSHM`, its pid, its listen port and address, and the address of a 32-byte probe pattern
//! in its memory. Each side then tries `process_vm_readv` of the peer's probe (pid from
//! `SO_PEERCRED`, never from the wire; the pid in the hello must match it, which fails across
//! PID namespaces) and answers one byte: whether it could read the pattern. Where the kernel
//! refuses (Yama `ptrace_scope` >= 2, a seccomp filter, different users, no `CAP_SYS_PTRACE`
//! where required), that direction falls back to inline payloads on the Unix socket (two kernel
//! copies, as on TCP loopback, but no TCP stack).
//!
//! # Data by reference
//!
//! A sender whose peer can read it writes [`FrameKind::DataRef`](crate::wire::FrameKind)
//! frames: the data header (stream offset, xxh3-64 of the payload) and a table of `(address,
//! length)` pieces of its staging. The receiver copies the pieces into its own staging, then
//! verifies the checksum exactly as on the other transports. The sender's memory stays valid
//! for the copy: a pull's source stays registered (leased) until the consumer released it, and
//! a push's sender waits for the receiver's per-stripe acknowledgement. A table that points
//! outside the sender's mappings, or memory that changed under the copy, is a checksum failure
//! of that request (the lane stays in sync); a sender that exited is [`Error::PeerClosed`].
//!
//! Security: no encryption; the peer's credentials are checked both ways with `SO_PEERCRED`
//! before a byte is written: a listener speaks only to processes of its own uid, and a client
//! whose name `@tpu-sync-shm/<port>` is held by another user's process (abstract names have no
//! permissions, so whoever binds first owns them) never speaks to it and reaches the port over
//! TCP instead; memory is read by reference only from the socket's peer pid (`SO_PEERCRED`), and
//! only when the hello's pid is that pid (not across PID namespaces). The kernel only lets a process
//! read the memory of processes it could ptrace (same user). The receiver only ever writes into
//! its own resolved staging ranges; a table can make it read nothing but the sender's memory.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::linux::net::SocketAddrExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;

use super::tcp::TcpTransport;
use super::transport::{
    Acceptor, BoxFut, Connection, Lane, PeerInfo, QueuedAcceptor, ShmPeer, Transport,
    TransportKind, TransportTimeouts,
};
use crate::error::{Error, Result};

/// Bytes of the shm hello each side writes first on a Unix lane.
pub const HELLO_LEN: usize = 48;
const MAGIC: [u8; 8] = *b"TSYNCSHM";
const VERSION: u16 = 1;
/// The pattern each process exposes for its peer's `process_vm_readv` probe.
static PROBE: [u8; 32] = *b"tpu-sync shm probe: cma works ok";

/// Most iovecs one `process_vm_readv` call takes (`IOV_MAX` on Linux, `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// The abstract Unix socket name of the endpoint listening on `port`.
pub fn socket_name(port: u16) -> String {
    format!("tpu-sync-shm/{port}")
}

fn unix_addr(port: u16) -> io::Result<std::os::unix::net::SocketAddr> {
    std::os::unix::net::SocketAddr::from_abstract_name(socket_name(port).as_bytes())
}

/// A non-blocking `connect(2)` to the abstract Unix socket `name` (no leading NUL). A full
/// listen backlog is `EAGAIN`; no listener is `ECONNREFUSED`.
fn connect_abstract_nonblocking(name: &[u8]) -> io::Result<std::os::unix::net::UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > sa.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "abstract socket name too long",
        ));
    }
    for (d, s) in sa.sun_path[1..].iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new socket this function owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `sa` is a valid sockaddr_un of `len` bytes (family, NUL, name).
    let r = unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::os::unix::net::UnixStream::from(owned))
}

/// Whether `ip` names this host (in this network namespace): loopback, unspecified, or an
/// address a socket can be bound to here.
pub fn is_local_ip(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// This process's effective uid.
fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Whether process `pid` still exists (`kill(pid, 0)`; `EPERM` means it exists under another
/// user). Used before a failed copy out of a peer is reported as corruption.
pub(crate) fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled; nothing is
    // sent.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Copies the sender's pieces `src` (`(address, length)` in process `pid`) into `dst` with
/// `process_vm_readv`. Both lists must cover the same number of bytes.
///
/// Errors: `ESRCH` (the process is gone), `EFAULT` (a piece outside its mappings), `EPERM`, or
/// a short copy (`UnexpectedEof`).
pub(crate) fn copy_from_peer(
    pid: i32,
    dst: &mut [&mut [u8]],
    src: &[(u64, u64)],
) -> io::Result<()> {
    let mut local: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX);
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX);
    let (mut di, mut doff) = (0usize, 0usize);
    let (mut si, mut soff) = (0usize, 0u64);
    loop {
        // One batch of segments contiguous on both sides.
        local.clear();
        remote.clear();
        let (bdi, bdoff, bsi, bsoff) = (di, doff, si, soff);
        let mut want = 0usize;
        while local.len() < IOV_MAX && di < dst.len() && si < src.len() {
            let d = &mut dst[di];
            let (sa, sl) = src[si];
            let take = (d.len() - doff).min((sl - soff) as usize);
            if take > 0 {
                local.push(libc::iovec {
                    iov_base: d[doff..].as_mut_ptr().cast(),
                    iov_len: take,
                });
                remote.push(libc::iovec {
                    iov_base: (sa.wrapping_add(soff)) as usize as *mut libc::c_void,
                    iov_len: take,
                });
                want += take;
            }
            doff += take;
            soff += take as u64;
            if doff == d.len() {
                di += 1;
                doff = 0;
            }
            if soff == sl {
                si += 1;
                soff = 0;
            }
        }
        if local.is_empty() {
            let left_d = dst[di.min(dst.len())..].iter().any(|d| !d.is_empty());
            let left_s = src[si.min(src.len())..].iter().any(|s| s.1 > 0);
            return if left_d || left_s {
                Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the piece table and the destination cover different byte counts",
                ))
            } else {
                Ok(())
            };
        }
        // SAFETY: every local iovec is a live, exclusively borrowed slice of `dst`; the remote
        // ones name memory of another process, which the kernel checks (EFAULT) and never
        // dereferences in ours.
        let n = unsafe {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if n < want {
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "process_vm_readv copied nothing",
                ));
            }
            // A partial copy: resume after the bytes that arrived (the next call reports the
            // failing piece's error).
            (di, doff, si, soff) = (bdi, bdoff, bsi, bsoff);
            let mut skip = n;
            while skip > 0 {
                let take = (dst[di].len() - doff)
                    .min((src[si].1 - soff) as usize)
                    .min(skip);
                skip -= take;
                doff += take;
                soff += take as u64;
                if doff == dst[di].len() {
                    di += 1;
                    doff = 0;
                }
                if soff == src[si].1 {
                    si += 1;
                    soff = 0;
                }
            }
        }
    }
}

/// Bytes the receiver copies out of the sender per `process_vm_readv` before it hashes them,
/// while they are still in cache (`copy_and_hash_from_peer`): `TPU_SYNC_SHM_VERIFY_STEP_BYTES`
/// when set to a number, else 0 (copy the whole chunk, then hash it). 0 stays the default
/// because 128 KiB steps (in the per-core L2 of current server cores; L1-sized steps would cost
/// a system call per 32-48 KiB) measured no faster, and at 64 MiB possibly slower, on the
/// loaded 2-core machine of docs/performance.md; set it to try on other hosts.
pub fn verify_step() -> usize {
    static STEP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *STEP.get_or_init(|| {
        std::env::var("TPU_SYNC_SHM_VERIFY_STEP_BYTES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0)
    })
}

/// [`copy_from_peer`] in steps of `step` bytes (0: one step), each hashed into one xxh3-64
/// right after it arrived; returns the xxh3-64 of everything written to `dst` (the same value
/// as `checksum_parts(dst)` after a plain copy, so a corrupted byte is still detected).
///
/// Errors: as [`copy_from_peer`]; a table covering fewer bytes than `dst` is `UnexpectedEof`.
pub(crate) fn copy_and_hash_from_peer(
    pid: i32,
    dst: &mut [&mut [u8]],
    src: &[(u64, u64)],
    step: usize,
) -> io::Result<u64> {
    let short = || {
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the piece table and the destination cover different byte counts",
        )
    };
    let mut h = crate::store::checksum::Xxh3::new();
    if step == 0 {
        copy_from_peer(pid, dst, src)?;
        for d in dst.iter() {
            h.update(d);
        }
        return Ok(h.digest());
    }
    let (mut si, mut soff) = (0usize, 0u64);
    let mut sub: Vec<(u64, u64)> = Vec::new();
    for d in dst.iter_mut() {
        let mut off = 0usize;
        while off < d.len() {
            let n = step.min(d.len() - off);
            // The source pieces of the next `n` bytes.
            sub.clear();
            let mut need = n as u64;
            while need > 0 {
                let &(a, l) = src.get(si).ok_or_else(short)?;
                let take = (l - soff).min(need);
                if take > 0 {
                    sub.push((a.wrapping_add(soff), take));
                }
                soff += take;
                need -= take;
                if soff == l {
                    si += 1;
                    soff = 0;
                }
            }
            let part = &mut d[off..off + n];
            copy_from_peer(pid, &mut [&mut *part], &sub)?;
            h.update(part);
            off += n;
        }
    }
    if src[si.min(src.len())..].iter().any(|s| s.1 > soff) {
        return Err(short());
    }
    Ok(h.digest())
}

fn ip_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

fn ip_from(b: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(b);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

struct Hello {
    pid: u32,
    listen: SocketAddr,
    probe: u64,
    probe_len: u64,
}

fn encode_hello(listen: SocketAddr) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    b[12..14].copy_from_slice(&listen.port().to_le_bytes());
    b[14..16].copy_from_slice(&VERSION.to_le_bytes());
    b[16..24].copy_from_slice(&(PROBE.as_ptr() as u64).to_le_bytes());
    b[24..32].copy_from_slice(&(PROBE.len() as u64).to_le_bytes());
    b[32..48].copy_from_slice(&ip_bytes(listen.ip()));
    b
}

fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<Hello> {
    if b[0..8] != MAGIC {
        return Err(Error::Protocol(
            "not a tpu-sync shm peer (bad hello magic)".into(),
        ));
    }
    let version = u16::from_le_bytes([b[14], b[15]]);
    if version != VERSION {
        return Err(Error::Protocol(format!(
            "shm hello version {version}, this side speaks {VERSION}"
        )));
    }
    let port = u16::from_le_bytes([b[12], b[13]]);
    let ip = ip_from(b[32..48].try_into().expect("16 bytes"));
    Ok(Hello {
        pid: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
        listen: SocketAddr::new(ip, port),
        probe: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        probe_len: u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")),
    })
}

/// Whether this process can read the peer's probe pattern.
fn probe(pid: i32, h: &Hello) -> bool {
    if h.probe_len != PROBE.len() as u64 || h.pid as i32 != pid {
        return false;
    }
    let mut got = [0u8; 32];
    let ok = copy_from_peer(pid, &mut [&mut got[..]], &[(h.probe, h.probe_len)]);
    match ok {
        Ok(()) if got == PROBE => true,
        Ok(()) => false,
        Err(e) => {
            log::info!(
                "shm: cannot read peer process {pid} ({e}); that direction sends inline on the \
                 Unix socket (check /proc/sys/kernel/yama/ptrace_scope)"
            );
            false
        }
    }
}

/// Runs the shm hello and probe on a fresh Unix lane. Returns the peer's hello and what each
/// side may read.
async fn handshake(
    s: &mut UnixStream,
    me: SocketAddr,
    by_reference: bool,
) -> Result<(Hello, ShmPeer)> {
    let cred = s
        .peer_cred()
        .map_err(|e| Error::io("SO_PEERCRED on a Unix lane", e))?;
    // Abstract socket names have no permissions: whoever binds a name first owns it, and anyone
    // on the host (in this network namespace) can connect. Only a peer running as this
    // process's own user is spoken to, and before anything is written (no pid or address is
    // handed to a stranger).
    let me_uid = own_uid();
    if cred.uid() != me_uid {
        return Err(Error::io(
            "shm hello",
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "the peer process runs as uid {}, this one as uid {me_uid}: refused",
                    cred.uid()
                ),
            ),
        ));
    }
    let pid = cred
        .pid()
        .ok_or_else(|| Error::Protocol("Unix peer without a pid".into()))?;
    let io = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset => Error::PeerClosed(format!("shm hello: {e}")),
        _ => Error::io("shm hello", e),
    };
    s.write_all(&encode_hello(me)).await.map_err(io)?;
    let mut hb = [0u8; HELLO_LEN];
    s.read_exact(&mut hb).await.map_err(io)?;
    let h = decode_hello(&hb)?;
    let can = by_reference && probe(pid, &h);
    s.write_all(&[can as u8]).await.map_err(io)?;
    let mut v = [0u8; 1];
    s.read_exact(&mut v).await.map_err(io)?;
    Ok((
        h,
        ShmPeer {
            pid,
            can_read_peer: can,
            peer_can_read_me: by_reference && v[0] == 1,
        },
    ))
}

/// A Unix-socket lane to a process on this host.
pub(crate) struct ShmLane {
    s: UnixStream,
    peer: PeerInfo,
    shm: ShmPeer,
}

impl AsyncRead for ShmLane {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().s).poll_read(cx, buf)
    }
}

impl AsyncWrite for ShmLane {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().s).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().s).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().s).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().s).poll_shutdown(cx)
    }
}

impl Lane for ShmLane {
    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        loop {
            match me.s.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
            match me.s.try_read_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    fn is_read_vectored(&self) -> bool {
        true
    }

    fn peer(&self) -> PeerInfo {
        self.peer.clone()
    }

    fn shm_peer(&self) -> Option<ShmPeer> {
        Some(self.shm)
    }
}

/// The same-host transport (see the module docs). `Send + Sync`.
pub struct ShmTransport {
    timeouts: TransportTimeouts,
    tcp: Arc<TcpTransport>,
    by_reference: bool,
}

impl ShmTransport {
    /// Unix lanes with data by reference where the kernel allows it; plain TCP to peers on
    /// other hosts.
    pub fn new(timeouts: TransportTimeouts) -> ShmTransport {
        ShmTransport {
            timeouts,
            tcp: Arc::new(TcpTransport::plain(timeouts)),
            by_reference: true,
        }
    }

    /// Like [`ShmTransport::new`] but never copying across processes: every payload travels
    /// inline on the Unix socket (the fallback path where `process_vm_readv` is refused; tests
    /// and measurements use it to exercise that path).
    pub fn inline_only(timeouts: TransportTimeouts) -> ShmTransport {
        ShmTransport {
            by_reference: false,
            ..ShmTransport::new(timeouts)
        }
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn listen(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Acceptor>>> {
        Box::pin(async move {
            let tcp = self.tcp.listen(addr).await?;
            let local = tcp.local_addr();
            let (sink, rx) = QueuedAcceptor::queue();
            let mut tasks = Vec::new();
            {
                let (tcp, queue) = (tcp.clone(), sink.clone());
                tasks.push(tokio::spawn(async move {
                    while let Ok(l) = tcp.accept().await {
                        if !queue.send(l).await {
                            return;
                        }
                    }
                }));
            }
            let bound = unix_addr(local.port())
                .and_then(|a| std::os::unix::net::UnixListener::bind_addr(&a))
                .and_then(|l| {
                    l.set_nonblocking(true)?;
                    tokio::net::UnixListener::from_std(l)
                });
            match bound {
                Err(e) => log::warn!(
                    "shm: cannot listen on @{} ({e}); serving {local} over TCP only",
                    socket_name(local.port())
                ),
                Ok(l) => {
                    let (queue, hs, by_ref) =
                        (sink.clone(), self.timeouts.handshake, self.by_reference);
                    tasks.push(tokio::spawn(async move {
                        loop {
                            let mut s = match l.accept().await {
                                Ok((s, _)) => s,
                                Err(e) => {
                                    log::warn!(
                                        "accept on @{} failed: {e}",
                                        socket_name(local.port())
                                    );
                                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                                    continue;
                                }
                            };
                            let queue = queue.clone();
                            tokio::spawn(async move {
                                let hello = handshake(&mut s, local, by_ref);
                                let Some((_, shm)) = queue.handshake(hs, hello, "shm peer").await
                                else {
                                    return;
                                };
                                let lane = ShmLane {
                                    s,
                                    peer: PeerInfo {
                                        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                                        identity: None,
                                    },
                                    shm,
                                };
                                queue.send(Box::new(lane)).await;
                            });
                        }
                    }));
                }
            }
            Ok(QueuedAcceptor::start(local, &sink, rx, tasks, Some(tcp)))
        })
    }

    fn connect(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Connection>>> {
        Box::pin(async move {
            let tcp = self.tcp.connect(addr).await?;
            Ok(Arc::new(ShmConn {
                addr,
                local: is_local_ip(addr.ip()),
                timeouts: self.timeouts,
                by_reference: self.by_reference,
                tcp,
            }) as Arc<dyn Connection>)
        })
    }
}

struct ShmConn {
    addr: SocketAddr,
    local: bool,
    timeouts: TransportTimeouts,
    by_reference: bool,
    tcp: Arc<dyn Connection>,
}

impl ShmConn {
    /// A Unix lane to the listener of `addr`, or `None` when there is none (use TCP).
    async fn open_unix(&self) -> Result<Option<Box<dyn Lane>>> {
        let t = self.timeouts;
        let name = socket_name(self.addr.port());
        // Non-blocking connect: a listener whose backlog is full answers EAGAIN, tried again
        // within the connect timeout (a blocking connect would stall this runtime worker).
        let deadline = tokio::time::Instant::now() + t.connect;
        let connected = loop {
            match connect_abstract_nonblocking(name.as_bytes()) {
                Err(e)
                    if e.raw_os_error() == Some(libc::EAGAIN)
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    return Err(Error::Timeout(format!(
                        "connect to @{name}: the listener accepted nothing for {:?}",
                        t.connect
                    )))
                }
                r => break r,
            }
        };
        let std = match connected {
            Ok(s) => s,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
                ) =>
            {
                return Ok(None)
            }
            Err(e) => {
                return Err(Error::io(
                    format!("connect to @{}", socket_name(self.addr.port())),
                    e,
                ))
            }
        };
        let mut s = UnixStream::from_std(std).map_err(|e| Error::io("register Unix lane", e))?;
        // The name is held by a process of another user (it bound it first): never speak to
        // it; this peer is reached over TCP instead (authenticated or not, as configured).
        match s.peer_cred() {
            Ok(c) if c.uid() == own_uid() && c.pid().is_some() => {}
            Ok(c) => {
                log::warn!(
                    "shm: @{name} is held by uid {} (pid {:?}), not by this user: reaching {} \
                     over TCP",
                    c.uid(),
                    c.pid(),
                    self.addr
                );
                return Ok(None);
            }
            Err(e) => return Err(Error::io("SO_PEERCRED on a Unix lane", e)),
        }
        let me = SocketAddr::from(([0, 0, 0, 0], 0));
        let (h, shm) =
            match tokio::time::timeout(t.handshake, handshake(&mut s, me, self.by_reference)).await
            {
                Err(_) => {
                    return Err(Error::Timeout(format!(
                        "shm hello with {} took longer than {:?}",
                        self.addr, t.handshake
                    )))
                }
                Ok(r) => r?,
            };
        if h.listen.port() != self.addr.port()
            || !(h.listen.ip().is_unspecified() || h.listen.ip() == self.addr.ip())
        {
            // Another endpoint on this host owns the name (same port, other address).
            return Ok(None);
        }
        Ok(Some(Box::new(ShmLane {
            s,
            peer: PeerInfo {
                addr: self.addr,
                identity: None,
            },
            shm,
        })))
    }
}

impl Connection for ShmConn {
    fn open_lane(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(async move {
            if self.local {
                if let Some(l) = self.open_unix().await? {
                    return Ok(l);
                }
            }
            self.tcp.open_lane().await
        })
    }

    fn remote_addr(&self) -> SocketAddr {
        self.addr
    }

    fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_from_self_across_piece_boundaries() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 255) as u8).collect();
        let pieces = [
            (src.as_ptr() as u64, 3000u64),
            (src.as_ptr() as u64 + 3000, 1),
            (src.as_ptr() as u64 + 3001, 6999),
        ];
        let mut a = vec![0u8; 5000];
        let mut b = vec![0u8; 5000];
        copy_from_peer(
            std::process::id() as i32,
            &mut [&mut a[..], &mut b[..]],
            &pieces,
        )
        .unwrap();
        assert_eq!(&a[..], &src[..5000]);
        assert_eq!(&b[..], &src[5000..]);
    }

    #[test]
    fn stepped_copy_hashes_what_a_plain_copy_hashes() {
        let src: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let base = src.as_ptr() as u64;
        // Pieces of odd lengths (one empty) into destination pieces of other odd lengths.
        let table = [
            (base, 70_001),
            (base + 70_001, 0),
            (base + 70_001, 129_999),
            (base + 200_000, 100_000),
        ];
        let pid = std::process::id() as i32;
        for step in [0usize, 1 << 10, 4099, 128 << 10, 1 << 20] {
            let mut a = vec![0u8; 123_457];
            let mut b = vec![0u8; 300_000 - 123_457];
            let mut dst = [a.as_mut_slice(), b.as_mut_slice()];
            let sum = copy_and_hash_from_peer(pid, &mut dst, &table, step).unwrap();
            let got = [a.as_slice(), b.as_slice()].concat();
            assert_eq!(got, src, "step {step}");
            assert_eq!(sum, crate::store::checksum::checksum(&src), "step {step}");
        }
        // A table that covers fewer bytes than the destination is an error.
        let mut c = vec![0u8; 1000];
        let e = copy_and_hash_from_peer(pid, &mut [c.as_mut_slice()], &[(base, 999)], 256);
        assert!(e.is_err());
    }

    #[test]
    fn bad_tables_are_errors() {
        let src = [1u8; 64];
        let mut a = [0u8; 64];
        let pid = std::process::id() as i32;
        // Fewer source bytes than destination bytes.
        let e = copy_from_peer(pid, &mut [&mut a[..]], &[(src.as_ptr() as u64, 32)]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        // An address outside the mappings.
        let e = copy_from_peer(pid, &mut [&mut a[..]], &[(8, 64)]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT));
    }

    #[test]
    fn hello_round_trips() {
        let a: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let h = decode_hello(&encode_hello(a)).unwrap();
        assert_eq!(h.listen, a);
        assert_eq!(h.pid, std::process::id());
        let mut bad = encode_hello(a);
        bad[0] ^= 1;
        assert!(decode_hello(&bad).is_err());
    }
}
