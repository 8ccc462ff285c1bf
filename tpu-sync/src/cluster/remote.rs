//! The remote tier, host path: one instance serves its host tier's blocks to others, which fetch
//! the present prefix of a key chain straight into their own (pinned) host memory.
//!
//! [`RemoteServer::serve`] listens on a TCP address (the `addr` of the instance's
//! [`super::HostRecord`]); [`fetch`] asks it for a chain. The server pins the chain's leading
//! present blocks ([`KvStore::pin`], a [`crate::store::Lease`] held until they are sent, so
//! eviction cannot take them mid-read), copies them out of its store (checksums verified there)
//! and streams them; the consumer checks each block's length and xxh3-64 on arrival and delivers
//! only the leading blocks that passed. A block evicted between the directory lookup and the
//! fetch is simply not among them: a miss, never wrong bytes. [`offer`] is the other direction
//! (offload to a peer with free capacity): the peer stores what it has room for. The device
//! path, into device blocks of another layout, is [`super::load_to_device`] (`cluster::load`).
//!
//! # Wire format (this module only; little endian)
//!
//! One request per connection (the server closes it after its reply); with credentials the
//! connection is TLS 1.3, mutually authenticated, ALPN [`ALPN`].
//!
//! Request: magic `TSRT` (4 bytes), version `u16` = 1, op `u16` (1 fetch, 2 offer), namespace id
//! `u128`, block count `u32` (at most [`MAX_CHAIN`]), then for a fetch the keys (`u128` each),
//! for an offer per block: key `u128`, length `u64`, xxh3-64 `u64`, the bytes.
//! Fetch reply: magic, status `u16` (0 ok, 1 wrong namespace, 2 bad request), count `u32` (the
//! leading blocks pinned), then per block: length `u64`, xxh3-64 `u64`, the bytes; a length of
//! `u64::MAX` ends the reply early (a block could not be read after all: the rest is a miss). The
//! server holds one block in memory at a time. An offer may carry at most as many blocks as the
//! peer's store has slots, each at most its block size. Offer reply: magic, status, stored `u32`.
//! Every item read or written (a header, the key list, one block) has a deadline of
//! [`RemoteOptions::io_timeout`] from its start, and the TLS handshake one of the same length; a
//! peer that dies, stalls or trickles fails the call with [`Error::PeerClosed`] or
//! [`Error::Timeout`], never a hang.
//!
//! # Who may connect (`docs/security.md`)
//!
//! * **Credentials** ([`RemoteOptions::security`], the endpoints' [`Security`]: mutual TLS
//!   against a CA, or a pre-shared key): the server completes a TLS 1.3 handshake before it reads
//!   a request byte and serves only a client that proved the same credentials; a client fetches
//!   and offers only to a server that proved them (a record in the directory naming any other
//!   address is a failed fetch, never a source of bytes).
//! * **Plain TCP** ([`Security::None`]): no authentication or encryption, for trusted networks
//!   only. [`RemoteServer::serve`] refuses to listen on a non-loopback address without
//!   credentials unless [`RemoteOptions::insecure`] says so.
//!
//! # Resources
//!
//! A fixed pool of [`RemoteOptions::workers`] threads serves the connections, one at a time each
//! (handshakes included: at most that many handshakes are in progress); accepted connections
//! wait in a queue of at most [`RemoteOptions::max_queued`], and a connection that finds the
//! queue full is closed at once ([`RemoteStats::refused`]). An offer is streamed into the store
//! in batches of at most [`OFFER_BATCH_BYTES`], so a server holds one batch of an offer in
//! memory, whatever its length; a fetch holds one block.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::net::Security;
use crate::store::{checksum, BlockKey, KvStore, Namespace};

const MAGIC: [u8; 4] = *b"TSRT";
const VERSION: u16 = 1;
const OP_FETCH: u16 = 1;
const OP_OFFER: u16 = 2;
/// Most blocks one request may name.
pub const MAX_CHAIN: u32 = 65_536;
/// Block length that marks the end of a fetch reply (the rest of the chain is a miss).
const END: u64 = u64::MAX;
/// Largest block accepted (bytes).
pub const MAX_BLOCK: u64 = 1 << 30;
/// Most bytes of an offer the server holds before it stores them (one batch; a single block
/// larger than this is a batch of its own).
pub const OFFER_BATCH_BYTES: u64 = 16 << 20;
/// ALPN protocol id of the remote tier's TLS connections (distinct from the endpoints' so that
/// neither side mistakes the other's port for its own).
pub const ALPN: &[u8] = b"tpu-sync-remote/1";

/// Options of the remote tier: timeouts, credentials and the server's resource caps.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Deadline of connecting (default 3 s).
    pub connect_timeout: Duration,
    /// Deadline of each item read or written and of the TLS handshake (default 10 s).
    pub io_timeout: Duration,
    /// Peer authentication, both ways (default [`Security::None`]: plain TCP). Server and
    /// clients of one fleet use the same credentials.
    pub security: Security,
    /// Lets [`RemoteServer::serve`] listen on a non-loopback address without credentials
    /// (anyone who reaches the port can then read blocks by key and offer blocks). Default false.
    pub insecure: bool,
    /// Server: threads serving connections, one connection each at a time (default 8, at least 1).
    pub workers: usize,
    /// Server: accepted connections waiting for a worker; more are closed at once (default 64).
    pub max_queued: usize,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            connect_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(10),
            security: Security::None,
            insecure: false,
            workers: 8,
            max_queued: 64,
        }
    }
}

/// Counters of a [`RemoteServer`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// Fetch requests answered.
    pub fetches: u64,
    /// Blocks sent.
    pub blocks_sent: u64,
    /// Bytes of blocks sent.
    pub bytes_sent: u64,
    /// Blocks stored from offers.
    pub blocks_offered: u64,
    /// Requests refused or failed (handshakes included).
    pub errors: u64,
    /// TLS handshakes that failed (no or wrong credentials, a stall, a non-TLS client).
    pub handshake_failures: u64,
    /// Connections closed unserved because the queue was full.
    pub refused: u64,
    /// Connections being served now (at most [`RemoteOptions::workers`]; a gauge).
    pub serving: u64,
}

#[derive(Default)]
struct Counters {
    fetches: AtomicU64,
    blocks_sent: AtomicU64,
    bytes_sent: AtomicU64,
    blocks_offered: AtomicU64,
    errors: AtomicU64,
    handshake_failures: AtomicU64,
    refused: AtomicU64,
    serving: AtomicU64,
}

/// Serves one store's blocks (see the module docs). Stops when dropped: the listener closes, and
/// connections in progress finish their current item (each is bounded by its deadline).
pub struct RemoteServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    c: Arc<Counters>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for RemoteServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteServer")
            .field("addr", &self.addr)
            .finish()
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(format!("remote tier: {what}: {e}"))
        }
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::ConnectionRefused
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::HostUnreachable
        | std::io::ErrorKind::NetworkUnreachable => {
            Error::PeerClosed(format!("remote tier: {what}: {e}"))
        }
        _ => Error::io(format!("remote tier: {what}"), e),
    }
}

fn timed_out() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed")
}

/// Time left until `deadline`, or a `TimedOut` error when none is.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        Err(timed_out())
    } else {
        Ok(d)
    }
}

/// One connection, plain or TLS. Every call completes within its deadline or fails: socket
/// reads and writes are given the time left, and rustls is driven here record by record (its
/// own `complete_io` would loop on a trickling peer with a fresh timeout per read).
enum Conn {
    Plain(TcpStream),
    Tls(Box<rustls::Connection>, TcpStream),
}

impl Conn {
    /// Sends what rustls has queued.
    fn flush_tls(
        c: &mut rustls::Connection,
        s: &mut TcpStream,
        end: Instant,
    ) -> std::io::Result<()> {
        while c.wants_write() {
            s.set_write_timeout(Some(left(end)?))?;
            c.write_tls(s)?;
        }
        Ok(())
    }

    /// Reads one TLS flight from the socket and processes it.
    fn pump_tls(
        c: &mut rustls::Connection,
        s: &mut TcpStream,
        end: Instant,
    ) -> std::io::Result<()> {
        s.set_read_timeout(Some(left(end)?))?;
        if c.read_tls(s)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if let Err(e) = c.process_new_packets() {
            // Tell the peer why (an alert) before failing; best effort.
            let _ = Self::flush_tls(c, s, end);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
        }
        Ok(())
    }

    /// Completes the TLS handshake within `within` (no-op for plain TCP).
    fn handshake(&mut self, within: Duration) -> std::io::Result<()> {
        let end = Instant::now() + within;
        if let Conn::Tls(c, s) = self {
            while c.is_handshaking() {
                Self::flush_tls(c, s, end)?;
                if !c.is_handshaking() {
                    break;
                }
                Self::pump_tls(c, s, end)?;
            }
            Self::flush_tls(c, s, end)?;
        }
        Ok(())
    }

    /// Fills `buf` within `within`; a clean close before it is full is `UnexpectedEof`.
    fn read_full(&mut self, buf: &mut [u8], within: Duration) -> std::io::Result<()> {
        let end = Instant::now() + within;
        let mut off = 0;
        while off < buf.len() {
            match self {
                Conn::Plain(s) => {
                    s.set_read_timeout(Some(left(end)?))?;
                    match s.read(&mut buf[off..]) {
                        Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                        Ok(n) => off += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Conn::Tls(c, s) => match c.reader().read(&mut buf[off..]) {
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => off += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        Self::flush_tls(c, s, end)?;
                        Self::pump_tls(c, s, end)?;
                    }
                    Err(e) => return Err(e),
                },
            }
        }
        Ok(())
    }

    /// Writes all of `data` within `within`.
    fn write_full(&mut self, data: &[u8], within: Duration) -> std::io::Result<()> {
        let end = Instant::now() + within;
        let mut off = 0;
        while off < data.len() {
            match self {
                Conn::Plain(s) => {
                    s.set_write_timeout(Some(left(end)?))?;
                    match s.write(&data[off..]) {
                        Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                        Ok(n) => off += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Conn::Tls(c, s) => {
                    // rustls buffers a bounded amount of plaintext; send it before queueing more.
                    let n = c.writer().write(&data[off..])?;
                    off += n;
                    Self::flush_tls(c, s, end)?;
                    if n == 0 && !c.wants_write() {
                        return Err(std::io::ErrorKind::WriteZero.into());
                    }
                }
            }
        }
        if let Conn::Tls(c, s) = self {
            Self::flush_tls(c, s, end)?;
        }
        Ok(())
    }

    /// Sends a TLS close_notify (best effort) so the peer sees a clean end.
    fn close(&mut self, within: Duration) {
        if let Conn::Tls(c, s) = self {
            c.send_close_notify();
            let _ = Self::flush_tls(c, s, Instant::now() + within);
        }
    }
}

/// The server-side TLS configuration of `sec` with the remote tier's ALPN (`None`: plain).
fn server_tls(sec: &Security) -> Result<Option<Arc<rustls::ServerConfig>>> {
    if !sec.is_authenticated() {
        return Ok(None);
    }
    let mut cfg = (*sec.server_config()?).clone();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Some(Arc::new(cfg)))
}

/// The client-side TLS configuration of `sec` with the remote tier's ALPN (`None`: plain).
fn client_tls(sec: &Security) -> Result<Option<Arc<rustls::ClientConfig>>> {
    if !sec.is_authenticated() {
        return Ok(None);
    }
    let mut cfg = (*sec.client_config()?).clone();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Some(Arc::new(cfg)))
}

struct Shared {
    store: KvStore,
    opts: RemoteOptions,
    tls: Option<Arc<rustls::ServerConfig>>,
    c: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

impl RemoteServer {
    /// Listens on `listen` (e.g. `0.0.0.0:7800`; port 0 picks one, see
    /// [`RemoteServer::local_addr`]) and serves `store` from a pool of
    /// [`RemoteOptions::workers`] threads (see the module docs).
    ///
    /// Errors: [`Error::InvalidArgument`] for a non-loopback address without credentials unless
    /// [`RemoteOptions::insecure`], or unusable credentials; [`Error::Io`] when the address
    /// cannot be bound or a thread cannot be started.
    pub fn serve(store: KvStore, listen: &str, opts: RemoteOptions) -> Result<RemoteServer> {
        let tls = server_tls(&opts.security)?;
        let l = TcpListener::bind(listen).map_err(|e| Error::io(format!("bind {listen}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("remote tier local address", e))?;
        if tls.is_none() && !addr.ip().is_loopback() && !opts.insecure {
            return Err(Error::InvalidArgument(format!(
                "remote tier: refusing to serve {addr} without credentials: anyone who reaches a \
                 non-loopback port could read blocks by key and plant blocks. Give mutual TLS or a \
                 pre-shared key (the same as the fleet's other members), or set insecure to serve \
                 plain TCP on a trusted network"
            )));
        }
        if tls.is_none() && !addr.ip().is_loopback() {
            log::warn!(
                "remote tier: serving {addr} over plain TCP without authentication (insecure)"
            );
        }
        l.set_nonblocking(true)
            .map_err(|e| Error::io("remote tier listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let c = Arc::new(Counters::default());
        let (tx, rx) = crossbeam_channel::bounded::<TcpStream>(opts.max_queued);
        let workers = opts.workers.max(1);
        let sh = Arc::new(Shared {
            store,
            opts,
            tls,
            c: c.clone(),
            stop: stop.clone(),
        });
        let mut server = RemoteServer {
            addr,
            stop: stop.clone(),
            c: c.clone(),
            threads: Vec::with_capacity(workers + 1),
        };
        for i in 0..workers {
            let (sh, rx) = (sh.clone(), rx.clone());
            let t = std::thread::Builder::new()
                .name(format!("tpu-sync-remote-{i}"))
                .spawn(move || {
                    while !sh.stop.load(Ordering::Acquire) {
                        match rx.recv_timeout(Duration::from_millis(50)) {
                            Ok(s) => {
                                sh.c.serving.fetch_add(1, Ordering::Relaxed);
                                if let Err(e) = serve_conn(s, &sh) {
                                    sh.c.errors.fetch_add(1, Ordering::Relaxed);
                                    log::debug!("remote tier connection: {e}");
                                }
                                sh.c.serving.fetch_sub(1, Ordering::Relaxed);
                            }
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                        }
                    }
                })
                .map_err(|e| Error::io("spawn a remote tier worker", e))?;
            server.threads.push(t);
        }
        drop(rx);
        let t = std::thread::Builder::new()
            .name("tpu-sync-remote".into())
            .spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    match l.accept() {
                        Ok((s, peer)) => {
                            if let Err(crossbeam_channel::TrySendError::Full(s)) = tx.try_send(s) {
                                c.refused.fetch_add(1, Ordering::Relaxed);
                                log::debug!("remote tier: queue full, closing {peer}");
                                drop(s);
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => {
                            log::warn!("remote tier accept: {e}");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })
            .map_err(|e| Error::io("spawn the remote tier thread", e))?;
        server.threads.push(t);
        Ok(server)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> RemoteStats {
        RemoteStats {
            fetches: self.c.fetches.load(Ordering::Relaxed),
            blocks_sent: self.c.blocks_sent.load(Ordering::Relaxed),
            bytes_sent: self.c.bytes_sent.load(Ordering::Relaxed),
            blocks_offered: self.c.blocks_offered.load(Ordering::Relaxed),
            errors: self.c.errors.load(Ordering::Relaxed),
            handshake_failures: self.c.handshake_failures.load(Ordering::Relaxed),
            refused: self.c.refused.load(Ordering::Relaxed),
            serving: self.c.serving.load(Ordering::Relaxed),
        }
    }
}

impl Drop for RemoteServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Serves the one request of connection `s`.
fn serve_conn(s: TcpStream, sh: &Shared) -> Result<()> {
    let o = &sh.opts;
    let t = o.io_timeout;
    s.set_nonblocking(false).map_err(|e| io("socket", e))?;
    let _ = s.set_nodelay(true);
    let mut s = match &sh.tls {
        None => Conn::Plain(s),
        Some(cfg) => {
            let c = rustls::ServerConnection::new(cfg.clone())
                .map_err(|e| Error::Protocol(format!("remote tier: TLS: {e}")))?;
            let mut conn = Conn::Tls(Box::new(c.into()), s);
            if let Err(e) = conn.handshake(t) {
                sh.c.handshake_failures.fetch_add(1, Ordering::Relaxed);
                return Err(io("TLS handshake", e));
            }
            conn
        }
    };
    let r = serve_request(&mut s, sh);
    s.close(Duration::from_millis(200));
    r
}

fn serve_request(s: &mut Conn, sh: &Shared) -> Result<()> {
    let (store, c, t) = (&sh.store, &*sh.c, sh.opts.io_timeout);
    let mut hdr = [0u8; 28];
    match s.read_full(&mut hdr, t) {
        Ok(()) => {}
        // A connection closed before a request (e.g. a port probe) is no error.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
        Err(e) => return Err(io("read a request", e)),
    }
    let ver = u16::from_le_bytes([hdr[4], hdr[5]]);
    let op = u16::from_le_bytes([hdr[6], hdr[7]]);
    let ns = u128::from_le_bytes(hdr[8..24].try_into().expect("16"));
    let n = u32::from_le_bytes(hdr[24..28].try_into().expect("4"));
    if hdr[0..4] != MAGIC || ver != VERSION || n > MAX_CHAIN {
        reply_status(s, t, 2, 0)?;
        return Err(Error::Protocol("remote tier: bad request header".into()));
    }
    let wrong_ns = store.namespace().map(|x| x.id()) != Some(ns);
    match op {
        OP_FETCH => {
            let mut raw = vec![0u8; n as usize * 16];
            s.read_full(&mut raw, t).map_err(|e| io("read keys", e))?;
            let keys: Vec<BlockKey> = raw
                .chunks_exact(16)
                .map(|k| BlockKey(u128::from_le_bytes(k.try_into().expect("16"))))
                .collect();
            if wrong_ns {
                reply_status(s, t, 1, 0)?;
                return Err(Error::Mismatch(
                    "remote tier: fetch for another namespace".into(),
                ));
            }
            c.fetches.fetch_add(1, Ordering::Relaxed);
            // Pin the present prefix while it is copied and sent, one block at a time (memory
            // stays one block, whatever the chain's length).
            let mut lease = Some(store.pin(&keys));
            let held = lease.as_ref().map_or(0, |l| l.len());
            let block = store.info().map(|i| i.geometry.block_bytes).unwrap_or(0);
            reply_status(s, t, 0, held as u32)?;
            let mut buf = vec![0u8; block as usize];
            for (i, &k) in keys[..held].iter().enumerate() {
                let ok = read_block(store, k, &mut buf);
                if !ok || i + 1 == held {
                    // Nothing more to read: unpin before the last write, so that a consumer
                    // who has its reply never finds the blocks still pinned.
                    lease.take();
                }
                if !ok {
                    // The rest is a miss: an end marker instead of a block.
                    let mut h = [0u8; 16];
                    h[..8].copy_from_slice(&END.to_le_bytes());
                    s.write_full(&h, t).map_err(|e| io("send a block", e))?;
                    break;
                }
                let sum = checksum::checksum(&buf);
                let mut h = [0u8; 16];
                h[..8].copy_from_slice(&(buf.len() as u64).to_le_bytes());
                h[8..].copy_from_slice(&sum.to_le_bytes());
                s.write_full(&h, t).map_err(|e| io("send a block", e))?;
                s.write_full(&buf, t).map_err(|e| io("send a block", e))?;
                c.blocks_sent.fetch_add(1, Ordering::Relaxed);
                c.bytes_sent.fetch_add(buf.len() as u64, Ordering::Relaxed);
            }
            drop(lease);
            Ok(())
        }
        OP_OFFER => serve_offer(s, sh, n, wrong_ns),
        _ => {
            reply_status(s, t, 2, 0)?;
            Err(Error::Protocol(format!("remote tier: unknown op {op}")))
        }
    }
}

/// Reads an offer of `n` blocks and stores its leading valid blocks as one chain, batch by batch
/// (at most [`OFFER_BATCH_BYTES`] held at a time). Once a block fails its checksum, the store
/// refuses a batch or has no room, the rest is read and dropped.
fn serve_offer(s: &mut Conn, sh: &Shared, n: u32, wrong_ns: bool) -> Result<()> {
    let (store, c, t) = (&sh.store, &*sh.c, sh.opts.io_timeout);
    // What the store can take: no more blocks than its slots, none over its block size.
    let (block, slots) = store
        .info()
        .map(|i| (i.geometry.block_bytes, i.geometry.num_slots))
        .unwrap_or((0, 0));
    if n as u64 > slots {
        reply_status(s, t, 2, 0)?;
        return Err(Error::Protocol(format!(
            "remote tier: offer of {n} blocks to a store of {slots} slots"
        )));
    }
    let mut storing = !wrong_ns;
    let mut stored = 0u64;
    let mut parent: Option<BlockKey> = None;
    let mut keys: Vec<BlockKey> = Vec::new();
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut held = 0u64;
    let mut flush = |keys: &mut Vec<BlockKey>,
                     bufs: &mut Vec<Vec<u8>>,
                     held: &mut u64,
                     storing: &mut bool,
                     parent: &mut Option<BlockKey>| {
        if *storing && !keys.is_empty() {
            let refs: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
            let got = match store.put_from_host(*parent, keys, &refs) {
                Ok(r) => (r.stored + r.present) as u64,
                Err(e) => {
                    log::debug!("remote tier offer: {e}");
                    0
                }
            };
            stored += got;
            if got < keys.len() as u64 {
                // The chain stops here: later blocks would have no parent in the store.
                *storing = false;
            }
            *parent = keys.last().copied();
        }
        keys.clear();
        bufs.clear();
        *held = 0;
    };
    for _ in 0..n {
        let mut h = [0u8; 32];
        s.read_full(&mut h, t).map_err(|e| io("read an offer", e))?;
        let k = u128::from_le_bytes(h[..16].try_into().expect("16"));
        let len = u64::from_le_bytes(h[16..24].try_into().expect("8"));
        let sum = u64::from_le_bytes(h[24..].try_into().expect("8"));
        if len > block.min(MAX_BLOCK) {
            reply_status(s, t, 2, 0)?;
            return Err(Error::Protocol(format!(
                "remote tier: offered block of {len} B exceeds the store's {block} B"
            )));
        }
        if held > 0 && held + len > OFFER_BATCH_BYTES {
            flush(&mut keys, &mut bufs, &mut held, &mut storing, &mut parent);
        }
        let mut b = vec![0u8; len as usize];
        s.read_full(&mut b, t).map_err(|e| io("read a block", e))?;
        if !storing {
            continue;
        }
        if checksum::checksum(&b) != sum {
            log::debug!(
                "remote tier offer: block {} arrived corrupt; the chain ends",
                keys.len()
            );
            flush(&mut keys, &mut bufs, &mut held, &mut storing, &mut parent);
            storing = false;
            continue;
        }
        held += len;
        keys.push(BlockKey(k));
        bufs.push(b);
    }
    flush(&mut keys, &mut bufs, &mut held, &mut storing, &mut parent);
    if wrong_ns {
        reply_status(s, t, 1, 0)?;
        return Err(Error::Mismatch(
            "remote tier: offer for another namespace".into(),
        ));
    }
    c.blocks_offered.fetch_add(stored, Ordering::Relaxed);
    reply_status(s, t, 0, stored as u32)
}

/// Copies one block out of the store. Stores served by the remote tier hold blocks of exactly
/// their `block_bytes` (an engine block of one rank); a block of another length ends the
/// prefix (a miss).
fn read_block(store: &KvStore, k: BlockKey, buf: &mut [u8]) -> bool {
    let mut d: Vec<&mut [u8]> = vec![buf];
    match store.get_to_host(&[k], &mut d) {
        Ok(g) => g.delivered == 1,
        // A block of another length or a corrupt block ends the prefix (a miss).
        Err(e) => {
            log::debug!("remote tier: block {k}: {e}");
            false
        }
    }
}

fn reply_status(s: &mut Conn, t: Duration, status: u16, n: u32) -> Result<()> {
    let mut w = Vec::with_capacity(10);
    w.extend_from_slice(&MAGIC);
    w.extend_from_slice(&status.to_le_bytes());
    w.extend_from_slice(&n.to_le_bytes());
    s.write_full(&w, t).map_err(|e| io("send a reply", e))
}

/// Connects to `addr` and, with credentials, completes the TLS handshake (the server must
/// prove the same credentials).
fn connect(addr: &str, o: &RemoteOptions) -> Result<Conn> {
    let tls = client_tls(&o.security)?;
    let sa: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("remote tier address {addr:?}: {e}")))?
        .collect();
    let mut last = None;
    for a in sa {
        match TcpStream::connect_timeout(&a, o.connect_timeout) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                let Some(cfg) = tls else {
                    return Ok(Conn::Plain(s));
                };
                let c = rustls::ClientConnection::new(cfg, o.security.server_name())
                    .map_err(|e| Error::Protocol(format!("remote tier: TLS: {e}")))?;
                let mut conn = Conn::Tls(Box::new(c.into()), s);
                conn.handshake(o.io_timeout).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        Error::Protocol(format!(
                            "remote tier {addr}: TLS handshake refused (the peer does not hold \
                             this fleet's credentials): {e}"
                        ))
                    } else {
                        io(&format!("TLS handshake with {addr}"), e)
                    }
                })?;
                return Ok(conn);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(e) => io(&format!("connect to {addr}"), e),
        None => Error::InvalidArgument(format!("remote tier address {addr:?} resolves to nothing")),
    })
}

fn header(op: u16, ns: &Namespace, n: usize) -> Vec<u8> {
    let mut w = Vec::with_capacity(28);
    w.extend_from_slice(&MAGIC);
    w.extend_from_slice(&VERSION.to_le_bytes());
    w.extend_from_slice(&op.to_le_bytes());
    w.extend_from_slice(&ns.id().to_le_bytes());
    w.extend_from_slice(&(n as u32).to_le_bytes());
    w
}

fn read_reply(s: &mut Conn, addr: &str, t: Duration) -> Result<u32> {
    let mut h = [0u8; 10];
    s.read_full(&mut h, t)
        .map_err(|e| io(&format!("reply from {addr}"), e))?;
    if h[0..4] != MAGIC {
        return Err(Error::Protocol(format!(
            "remote tier {addr}: bad reply magic"
        )));
    }
    let status = u16::from_le_bytes([h[4], h[5]]);
    let n = u32::from_le_bytes(h[6..10].try_into().expect("4"));
    match status {
        0 => Ok(n),
        1 => Err(Error::Mismatch(format!(
            "remote tier {addr}: the peer's store holds another namespace"
        ))),
        _ => Err(Error::Protocol(format!(
            "remote tier {addr}: request refused (status {status})"
        ))),
    }
}

/// Fetches the leading present blocks of `chain` (namespace `ns`) from the server at `addr` into
/// `dst` (`dst[i]` receives block `chain[i]` and must be exactly its length). Returns the number
/// of leading blocks delivered, byte-exact (each one's length and xxh3-64 checked on arrival);
/// destinations from there on hold unspecified bytes. Blocks the server no longer holds are a
/// miss (a smaller count), not an error.
///
/// Errors: [`Error::InvalidArgument`] for mismatched counts, more than [`MAX_CHAIN`] keys or a
/// bad address; [`Error::Mismatch`] when the server's store holds another namespace;
/// [`Error::PeerClosed`] / [`Error::Timeout`] when the server is unreachable, dies or stalls;
/// [`Error::Protocol`] for a malformed reply; [`Error::Checksum`] when a block arrives corrupt
/// (the blocks before it are delivered: the count is in the message, and `dst` before it is
/// valid).
pub fn fetch(
    addr: &str,
    ns: &Namespace,
    chain: &[BlockKey],
    dst: &mut [&mut [u8]],
    o: &RemoteOptions,
) -> Result<usize> {
    if chain.len() != dst.len() {
        return Err(Error::InvalidArgument(format!(
            "{} keys but {} destinations",
            chain.len(),
            dst.len()
        )));
    }
    if chain.len() > MAX_CHAIN as usize {
        return Err(Error::InvalidArgument(format!(
            "{} keys exceed the remote tier's {MAX_CHAIN}",
            chain.len()
        )));
    }
    if chain.is_empty() {
        return Ok(0);
    }
    let t = o.io_timeout;
    let mut s = connect(addr, o)?;
    let mut w = header(OP_FETCH, ns, chain.len());
    for k in chain {
        w.extend_from_slice(&k.0.to_le_bytes());
    }
    s.write_full(&w, t)
        .map_err(|e| io(&format!("send to {addr}"), e))?;
    let n = read_reply(&mut s, addr, t)? as usize;
    if n > chain.len() {
        return Err(Error::Protocol(format!(
            "remote tier {addr}: {n} blocks for a chain of {}",
            chain.len()
        )));
    }
    for (i, d) in dst.iter_mut().enumerate().take(n) {
        let mut h = [0u8; 16];
        s.read_full(&mut h, t)
            .map_err(|e| io(&format!("block from {addr}"), e))?;
        let len = u64::from_le_bytes(h[..8].try_into().expect("8"));
        let sum = u64::from_le_bytes(h[8..].try_into().expect("8"));
        if len == END {
            // The server lost the block while sending (a miss from here on).
            return Ok(i);
        }
        if len != d.len() as u64 {
            return Err(Error::Protocol(format!(
                "remote tier {addr}: block {i} is {len} B, destination {} B",
                d.len()
            )));
        }
        s.read_full(d, t)
            .map_err(|e| io(&format!("block from {addr}"), e))?;
        if checksum::checksum(d) != sum {
            return Err(Error::Checksum(format!(
                "remote tier {addr}: block {i} of the chain arrived corrupt; {i} leading blocks \
                 were delivered"
            )));
        }
    }
    Ok(n)
}

/// Offers blocks to the server at `addr` (offload to a peer with free capacity): the peer stores
/// the leading blocks it has room for as one chain. Returns how many it now holds.
///
/// Errors: as [`fetch`].
pub fn offer(
    addr: &str,
    ns: &Namespace,
    chain: &[BlockKey],
    blocks: &[&[u8]],
    o: &RemoteOptions,
) -> Result<usize> {
    if chain.len() != blocks.len() || chain.len() > MAX_CHAIN as usize {
        return Err(Error::InvalidArgument(format!(
            "offer: {} keys, {} blocks (at most {MAX_CHAIN})",
            chain.len(),
            blocks.len()
        )));
    }
    let t = o.io_timeout;
    let mut s = connect(addr, o)?;
    s.write_full(&header(OP_OFFER, ns, chain.len()), t)
        .map_err(|e| io(&format!("send to {addr}"), e))?;
    for (k, b) in chain.iter().zip(blocks) {
        let mut h = Vec::with_capacity(32);
        h.extend_from_slice(&k.0.to_le_bytes());
        h.extend_from_slice(&(b.len() as u64).to_le_bytes());
        h.extend_from_slice(&checksum::checksum(b).to_le_bytes());
        s.write_full(&h, t)
            .map_err(|e| io(&format!("send to {addr}"), e))?;
        s.write_full(b, t)
            .map_err(|e| io(&format!("send to {addr}"), e))?;
    }
    let n = read_reply(&mut s, addr, t)? as usize;
    s.close(Duration::from_millis(200));
    Ok(n)
}
