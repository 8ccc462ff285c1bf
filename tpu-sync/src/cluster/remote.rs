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
//! Request: magic `TSRT` (4 bytes), version `u16` = 1, op `u16` (1 fetch, 2 offer), namespace id
//! `u128`, block count `u32` (at most [`MAX_CHAIN`]), then for a fetch the keys (`u128` each),
//! for an offer per block: key `u128`, length `u64`, xxh3-64 `u64`, the bytes.
//! Fetch reply: magic, status `u16` (0 ok, 1 wrong namespace, 2 bad request), count `u32` (the
//! leading blocks pinned), then per block: length `u64`, xxh3-64 `u64`, the bytes; a length of
//! `u64::MAX` ends the reply early (a block could not be read after all: the rest is a miss). The
//! server holds one block in memory at a time. An offer may carry at most as many blocks as the
//! peer's store has slots, each at most its block size. Offer reply: magic, status, stored `u32`.
//! Every read and write has a deadline ([`RemoteOptions::io_timeout`]); a peer that dies or stalls
//! fails the call with [`Error::PeerClosed`] or [`Error::Timeout`], never a hang.
//!
//! Plain TCP: no authentication or encryption; for trusted networks only, like the network
//! layer's plain TCP transport (`docs/security.md`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
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

/// Timeouts of the remote tier.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Deadline of connecting (default 3 s).
    pub connect_timeout: Duration,
    /// Deadline of every read and write (default 10 s).
    pub io_timeout: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            connect_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(10),
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
    /// Requests refused or failed.
    pub errors: u64,
}

#[derive(Default)]
struct Counters {
    fetches: AtomicU64,
    blocks_sent: AtomicU64,
    bytes_sent: AtomicU64,
    blocks_offered: AtomicU64,
    errors: AtomicU64,
}

/// Serves one store's blocks (see the module docs). Stops when dropped (connections in
/// progress finish their current request).
pub struct RemoteServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    c: Arc<Counters>,
    thread: Option<std::thread::JoinHandle<()>>,
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

fn rd<const N: usize>(s: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}

impl RemoteServer {
    /// Listens on `listen` (e.g. `0.0.0.0:7800`; port 0 picks one, see
    /// [`RemoteServer::local_addr`]) and serves `store` from a thread per connection.
    ///
    /// Errors: [`Error::Io`] when the address cannot be bound.
    pub fn serve(store: KvStore, listen: &str, opts: RemoteOptions) -> Result<RemoteServer> {
        let l = TcpListener::bind(listen).map_err(|e| Error::io(format!("bind {listen}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("remote tier local address", e))?;
        l.set_nonblocking(true)
            .map_err(|e| Error::io("remote tier listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let c = Arc::new(Counters::default());
        let (st, cc) = (stop.clone(), c.clone());
        let thread = std::thread::Builder::new()
            .name("tpu-sync-remote".into())
            .spawn(move || {
                while !st.load(Ordering::Acquire) {
                    match l.accept() {
                        Ok((s, _)) => {
                            let (store, opts, cc) = (store.clone(), opts.clone(), cc.clone());
                            let _ = std::thread::Builder::new()
                                .name("tpu-sync-remote-conn".into())
                                .spawn(move || {
                                    if let Err(e) = serve_conn(s, &store, &opts, &cc) {
                                        log::debug!("remote tier connection: {e}");
                                    }
                                });
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
        Ok(RemoteServer {
            addr,
            stop,
            c,
            thread: Some(thread),
        })
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
        }
    }
}

impl Drop for RemoteServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve_conn(mut s: TcpStream, store: &KvStore, o: &RemoteOptions, c: &Counters) -> Result<()> {
    s.set_nonblocking(false).map_err(|e| io("socket", e))?;
    s.set_read_timeout(Some(o.io_timeout))
        .map_err(|e| io("socket", e))?;
    s.set_write_timeout(Some(o.io_timeout))
        .map_err(|e| io("socket", e))?;
    let _ = s.set_nodelay(true);
    loop {
        let mut hdr = [0u8; 28];
        match s.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io("read a request", e)),
        }
        let ver = u16::from_le_bytes([hdr[4], hdr[5]]);
        let op = u16::from_le_bytes([hdr[6], hdr[7]]);
        let ns = u128::from_le_bytes(hdr[8..24].try_into().expect("16"));
        let n = u32::from_le_bytes(hdr[24..28].try_into().expect("4"));
        let bad = hdr[0..4] != MAGIC || ver != VERSION || n > MAX_CHAIN;
        let wrong_ns = store.namespace().map(|x| x.id()) != Some(ns);
        if bad {
            c.errors.fetch_add(1, Ordering::Relaxed);
            reply_status(&mut s, 2, 0)?;
            return Err(Error::Protocol("remote tier: bad request header".into()));
        }
        match op {
            OP_FETCH => {
                let mut keys = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    keys.push(BlockKey(u128::from_le_bytes(
                        rd::<16>(&mut s).map_err(|e| io("read keys", e))?,
                    )));
                }
                if wrong_ns {
                    c.errors.fetch_add(1, Ordering::Relaxed);
                    reply_status(&mut s, 1, 0)?;
                    continue;
                }
                c.fetches.fetch_add(1, Ordering::Relaxed);
                // Pin the present prefix while it is copied and sent, one block at a time (memory
                // stays one block, whatever the chain's length).
                let mut lease = Some(store.pin(&keys));
                let held = lease.as_ref().map_or(0, |l| l.len());
                let block = store.info().map(|i| i.geometry.block_bytes).unwrap_or(0);
                let mut w = Vec::with_capacity(10);
                w.extend_from_slice(&MAGIC);
                w.extend_from_slice(&0u16.to_le_bytes());
                w.extend_from_slice(&(held as u32).to_le_bytes());
                s.write_all(&w).map_err(|e| io("send a reply", e))?;
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
                        s.write_all(&h).map_err(|e| io("send a block", e))?;
                        break;
                    }
                    let sum = checksum::checksum(&buf);
                    let mut h = [0u8; 16];
                    h[..8].copy_from_slice(&(buf.len() as u64).to_le_bytes());
                    h[8..].copy_from_slice(&sum.to_le_bytes());
                    s.write_all(&h).map_err(|e| io("send a block", e))?;
                    s.write_all(&buf).map_err(|e| io("send a block", e))?;
                    c.blocks_sent.fetch_add(1, Ordering::Relaxed);
                    c.bytes_sent.fetch_add(buf.len() as u64, Ordering::Relaxed);
                }
                drop(lease);
            }
            OP_OFFER => {
                let mut keys = Vec::new();
                let mut blocks: Vec<Vec<u8>> = Vec::new();
                let mut ok = true;
                // What the store can take: no more blocks than its slots, none over its block size.
                let (block, slots) = store
                    .info()
                    .map(|i| (i.geometry.block_bytes, i.geometry.num_slots))
                    .unwrap_or((0, 0));
                if n as u64 > slots {
                    c.errors.fetch_add(1, Ordering::Relaxed);
                    reply_status(&mut s, 2, 0)?;
                    return Err(Error::Protocol(format!(
                        "remote tier: offer of {n} blocks to a store of {slots} slots"
                    )));
                }
                for _ in 0..n {
                    let k = u128::from_le_bytes(rd::<16>(&mut s).map_err(|e| io("read", e))?);
                    let len = u64::from_le_bytes(rd::<8>(&mut s).map_err(|e| io("read", e))?);
                    let sum = u64::from_le_bytes(rd::<8>(&mut s).map_err(|e| io("read", e))?);
                    if len > block.min(MAX_BLOCK) {
                        c.errors.fetch_add(1, Ordering::Relaxed);
                        reply_status(&mut s, 2, 0)?;
                        return Err(Error::Protocol("remote tier: offered block too big".into()));
                    }
                    let mut b = vec![0u8; len as usize];
                    s.read_exact(&mut b).map_err(|e| io("read a block", e))?;
                    if checksum::checksum(&b) != sum {
                        ok = false;
                    }
                    if ok {
                        keys.push(BlockKey(k));
                        blocks.push(b);
                    }
                }
                if wrong_ns {
                    reply_status(&mut s, 1, 0)?;
                    continue;
                }
                let refs: Vec<&[u8]> = blocks.iter().map(|b| b.as_slice()).collect();
                let stored = match store.put_from_host(None, &keys, &refs) {
                    Ok(r) => r.stored + r.present,
                    Err(e) => {
                        log::debug!("remote tier offer: {e}");
                        0
                    }
                };
                c.blocks_offered.fetch_add(stored as u64, Ordering::Relaxed);
                reply_status(&mut s, 0, stored as u32)?;
            }
            _ => {
                c.errors.fetch_add(1, Ordering::Relaxed);
                reply_status(&mut s, 2, 0)?;
                return Err(Error::Protocol(format!("remote tier: unknown op {op}")));
            }
        }
    }
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

fn reply_status(s: &mut TcpStream, status: u16, n: u32) -> Result<()> {
    let mut w = Vec::with_capacity(10);
    w.extend_from_slice(&MAGIC);
    w.extend_from_slice(&status.to_le_bytes());
    w.extend_from_slice(&n.to_le_bytes());
    s.write_all(&w).map_err(|e| io("send a reply", e))
}

fn connect(addr: &str, o: &RemoteOptions) -> Result<TcpStream> {
    let sa: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("remote tier address {addr:?}: {e}")))?
        .collect();
    let mut last = None;
    for a in sa {
        match TcpStream::connect_timeout(&a, o.connect_timeout) {
            Ok(s) => {
                s.set_read_timeout(Some(o.io_timeout))
                    .map_err(|e| io("socket", e))?;
                s.set_write_timeout(Some(o.io_timeout))
                    .map_err(|e| io("socket", e))?;
                let _ = s.set_nodelay(true);
                return Ok(s);
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

fn read_reply(s: &mut TcpStream, addr: &str) -> Result<u32> {
    let h = rd::<10>(s).map_err(|e| io(&format!("reply from {addr}"), e))?;
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
    let mut s = connect(addr, o)?;
    let mut w = header(OP_FETCH, ns, chain.len());
    for k in chain {
        w.extend_from_slice(&k.0.to_le_bytes());
    }
    s.write_all(&w)
        .map_err(|e| io(&format!("send to {addr}"), e))?;
    let n = read_reply(&mut s, addr)? as usize;
    if n > chain.len() {
        return Err(Error::Protocol(format!(
            "remote tier {addr}: {n} blocks for a chain of {}",
            chain.len()
        )));
    }
    for (i, d) in dst.iter_mut().enumerate().take(n) {
        let h = rd::<16>(&mut s).map_err(|e| io(&format!("block from {addr}"), e))?;
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
        s.read_exact(d)
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
    let mut s = connect(addr, o)?;
    s.write_all(&header(OP_OFFER, ns, chain.len()))
        .map_err(|e| io(&format!("send to {addr}"), e))?;
    for (k, b) in chain.iter().zip(blocks) {
        let mut h = Vec::with_capacity(32);
        h.extend_from_slice(&k.0.to_le_bytes());
        h.extend_from_slice(&(b.len() as u64).to_le_bytes());
        h.extend_from_slice(&checksum::checksum(b).to_le_bytes());
        s.write_all(&h)
            .map_err(|e| io(&format!("send to {addr}"), e))?;
        s.write_all(b)
            .map_err(|e| io(&format!("send to {addr}"), e))?;
    }
    Ok(read_reply(&mut s, addr)? as usize)
}
