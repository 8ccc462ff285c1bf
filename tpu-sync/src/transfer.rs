//! Prefill/decode transfer over TCP: a sender serves registered requests, a receiver pulls the
//! spans of its plan straight into its pinned staging arena.
//!
//! Flow (decode-initiated pull, as vLLM's and tpu-inference's connectors do it):
//! 1. the prefill side stages a request's blocks ([`crate::staging::Staging`]) and
//!    [`Server::register`]s it under a request id;
//! 2. the decode side learns the request's source [`Placement`] (from the serving engine's
//!    transfer parameters, or with [`describe`]), chooses its own placement and calls [`pull`]:
//!    it plans, then opens one connection per `(source rank, destination rank)` pair with bytes
//!    and sends a `Pull` naming its placement and the digest of the pair's spans;
//! 3. the sender recomputes the same plan, checks the digest, and streams the pair's bytes
//!    (frames of at most [`TransferOptions::frame_bytes`]) with vectored writes straight from its
//!    arena; the receiver reads each payload with vectored reads straight into the staging regions
//!    its own plan assigns, and verifies the frame checksum;
//! 4. the receiver sends `Release`; the sender drops the registration.
//!
//! Trust: the receiver never takes an address from the wire: a data frame names only an offset in
//! the pair's byte stream, which must be the next expected one, inside the expected total. The
//! sender only reads bytes that lie inside the registered request's staged blocks. Plain TCP is
//! unauthenticated: use it on trusted networks only.
//!
//! Errors are values: a peer that is not there ([`Error::Timeout`] / [`Error::Io`]), closes
//! mid-transfer ([`Error::PeerClosed`]), sends a malformed or unexpected frame
//! ([`Error::Protocol`]) or a corrupt payload ([`Error::Checksum`]) fails the call within the
//! configured timeouts.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::error::{Error, Result};
use crate::plan::{spans_digest, Placement, Plan, Span};
use crate::staging::Staging;
use crate::wire::{self, Control, DataHeader, FrameHeader, FrameKind, DATA_HEADER_LEN, HEADER_LEN};

/// Timeouts and sizes of the transfer protocol.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Endpoint name sent in `Hello` (for the peer's logs).
    pub name: String,
    /// Limit for establishing a TCP connection and the `Hello` exchange.
    pub connect_timeout: Duration,
    /// Limit for any single read or write to make progress; a silent peer fails after this.
    pub io_timeout: Duration,
    /// Largest data frame payload (bytes), at most [`wire::MAX_DATA_PAYLOAD`].
    pub frame_bytes: u32,
    /// Test hook: the sender closes the connection after this many payload bytes of a pull.
    #[doc(hidden)]
    pub fault_close_after: Option<u64>,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            name: format!("tpu-sync-{}", std::process::id()),
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            frame_bytes: 4 << 20,
            fault_close_after: None,
        }
    }
}

/// A request registered with a [`Server`] for pulling.
#[derive(Debug)]
pub struct Registration {
    /// Request id (below 2^53 so it survives JSON).
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// Where the request's blocks are on this side.
    pub placement: Placement,
    /// The staged blocks (must contain every block of `placement`).
    pub staging: Arc<Staging>,
}

/// Largest request id accepted (ids must survive a JSON round trip as a double).
pub const MAX_REQUEST_ID: u64 = (1 << 53) - 1;

struct ServerState {
    requests: HashMap<u64, Arc<Registration>>,
    released: HashMap<u64, bool>,
}

/// The sending side: serves registered requests to pulling receivers. `Send + Sync`; share it in
/// an `Arc`.
pub struct Server {
    state: Mutex<ServerState>,
    changed: tokio::sync::Notify,
    opts: TransferOptions,
}

impl Server {
    /// A server with no registrations.
    pub fn new(opts: TransferOptions) -> Arc<Server> {
        Arc::new(Server {
            state: Mutex::new(ServerState {
                requests: HashMap::new(),
                released: HashMap::new(),
            }),
            changed: tokio::sync::Notify::new(),
            opts,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ServerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a request for pulling.
    ///
    /// Errors: [`Error::InvalidArgument`] for an id of 0, above [`MAX_REQUEST_ID`], or already
    /// registered; the placement's validation errors; [`Error::BlockRange`] when a block of the
    /// placement is not staged.
    pub fn register(&self, reg: Registration) -> Result<()> {
        if reg.request_id == 0 || reg.request_id > MAX_REQUEST_ID {
            return Err(Error::InvalidArgument(format!(
                "request id {} must be in 1..=2^53-1",
                reg.request_id
            )));
        }
        reg.placement.validate(reg.num_tokens)?;
        for local in 0..reg.placement.layout.spec.ranks_per_replica() {
            let rank = reg.placement.global_rank(local);
            for r in reg.placement.block_ranges(local) {
                reg.staging.resolve(rank, r.buffer, r.offset, r.len)?;
            }
        }
        let mut st = self.lock();
        if st.requests.contains_key(&reg.request_id) {
            return Err(Error::InvalidArgument(format!(
                "request {} is already registered",
                reg.request_id
            )));
        }
        st.released.insert(reg.request_id, false);
        st.requests.insert(reg.request_id, Arc::new(reg));
        Ok(())
    }

    /// Drops a registration (the staged blocks are freed when the last pull using them ends).
    pub fn unregister(&self, request_id: u64) -> bool {
        let removed = self.lock().requests.remove(&request_id).is_some();
        self.changed.notify_waiters();
        removed
    }

    /// Number of registered requests.
    pub fn registered(&self) -> usize {
        self.lock().requests.len()
    }

    fn get(&self, request_id: u64) -> Result<Arc<Registration>> {
        self.lock()
            .requests
            .get(&request_id)
            .cloned()
            .ok_or_else(|| {
                Error::UnknownRequest(format!("request {request_id} is not registered here"))
            })
    }

    fn mark_released(&self, request_id: u64) {
        let mut st = self.lock();
        st.requests.remove(&request_id);
        st.released.insert(request_id, true);
        drop(st);
        self.changed.notify_waiters();
    }

    /// Waits until a receiver released `request_id`, or `timeout` passes ([`Error::Timeout`]).
    pub async fn wait_released(&self, request_id: u64, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self
                .lock()
                .released
                .get(&request_id)
                .copied()
                .unwrap_or(false)
            {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::Timeout(format!(
                    "request {request_id} was not released within {timeout:?}"
                )));
            }
        }
    }

    /// Accepts connections on `listener` and serves them until the task is dropped.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            match listener.accept().await {
                Ok((sock, peer)) => {
                    let me = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = me.handle(sock, peer).await {
                            log::info!("connection from {peer} ended: {e}");
                        }
                    });
                }
                Err(e) => {
                    log::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn handle(&self, mut sock: TcpStream, peer: SocketAddr) -> Result<()> {
        sock.set_nodelay(true).ok();
        let o = &self.opts;
        match tokio::time::timeout(o.connect_timeout, read_control(&mut sock, o.io_timeout)).await {
            Ok(Ok((_, Control::Hello { name, protocol })))
                if protocol == wire::PROTOCOL_VERSION =>
            {
                log::debug!("hello from {name} at {peer}");
            }
            Ok(Ok((_, m))) => return Err(Error::Protocol(format!("expected hello, got {m:?}"))),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Error::Timeout(format!("no hello from {peer}"))),
        }
        write_control(&mut sock, &hello(o), 0, o.io_timeout).await?;
        loop {
            let (rid, msg) = match read_control(&mut sock, Duration::from_secs(24 * 3600)).await {
                Ok(m) => m,
                Err(Error::PeerClosed(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            let reply = match msg {
                Control::Describe { request_id } => match self.get(request_id) {
                    Ok(reg) => Control::Description {
                        request_id,
                        num_tokens: reg.num_tokens,
                        placement: reg.placement.clone(),
                    },
                    Err(e) => failed(request_id, &e),
                },
                Control::Pull {
                    request_id,
                    src_rank,
                    dst_rank,
                    dst,
                    digest,
                    total_bytes,
                } => match self.prepare_pull(
                    request_id,
                    src_rank,
                    dst_rank,
                    &dst,
                    digest,
                    total_bytes,
                ) {
                    Ok((reg, spans)) => {
                        self.send_pair(&mut sock, &reg, src_rank, &spans, request_id)
                            .await?;
                        Control::PullDone {
                            request_id,
                            bytes: total_bytes,
                        }
                    }
                    Err(e) => failed(request_id, &e),
                },
                Control::Release { request_id } => {
                    self.mark_released(request_id);
                    Control::Released { request_id }
                }
                other => {
                    let e = Error::Protocol(format!("unexpected message {other:?}"));
                    let _ = write_control(&mut sock, &failed(rid, &e), rid, o.io_timeout).await;
                    return Err(e);
                }
            };
            write_control(&mut sock, &reply, rid, o.io_timeout).await?;
        }
    }

    fn prepare_pull(
        &self,
        request_id: u64,
        src_rank: u32,
        dst_rank: u32,
        dst: &Placement,
        digest: u64,
        total_bytes: u64,
    ) -> Result<(Arc<Registration>, Vec<Span>)> {
        let reg = self.get(request_id)?;
        let plan = Plan::build(&reg.placement, dst, reg.num_tokens)?;
        let spans = plan.pair_spans(src_rank, dst_rank);
        let mine = spans_digest(&spans);
        let bytes: u64 = spans.iter().map(Span::bytes).sum();
        if mine != digest || bytes != total_bytes {
            return Err(Error::Mismatch(format!(
                "plan for ranks {src_rank}->{dst_rank} of request {request_id} differs: sender has \
                 {bytes} bytes (digest {mine:016x}), receiver expects {total_bytes} (digest {digest:016x})"
            )));
        }
        Ok((reg, spans))
    }

    async fn send_pair(
        &self,
        sock: &mut TcpStream,
        reg: &Registration,
        src_rank: u32,
        spans: &[Span],
        request_id: u64,
    ) -> Result<()> {
        let cursor = SpanCursor::new(spans);
        let total = cursor.total();
        let frame = self.opts.frame_bytes.clamp(4096, wire::MAX_DATA_PAYLOAD) as u64;
        let mut pos = 0;
        while pos < total {
            let n = frame.min(total - pos);
            if let Some(limit) = self.opts.fault_close_after {
                if pos + n > limit {
                    return Err(Error::Cancelled("test fault: closing mid-transfer".into()));
                }
            }
            let mut parts: Vec<&[u8]> = Vec::new();
            for (buf, off, len) in cursor.pieces(pos, n, Side::Src) {
                let p = reg.staging.resolve(src_rank, buf, off, len)?;
                // SAFETY: `resolve` checked the range lies inside the sender's staged blocks; the
                // staging is never written after registration and outlives this call (`reg`
                // holds it).
                let s = unsafe { std::slice::from_raw_parts(p as *const u8, len as usize) };
                push_merged(&mut parts, s);
            }
            let dh = DataHeader {
                stream_offset: pos,
                checksum: wire::checksum(parts.iter().copied()),
            };
            let fh = FrameHeader {
                kind: FrameKind::Data,
                body_len: (DATA_HEADER_LEN as u64 + n) as u32,
                request_id,
            };
            let (h1, h2) = (fh.encode(), dh.encode());
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() + 2);
            iov.push(IoSlice::new(&h1));
            iov.push(IoSlice::new(&h2));
            iov.extend(parts.iter().map(|p| IoSlice::new(p)));
            write_all_vectored(sock, &mut iov, self.opts.io_timeout).await?;
            pos += n;
        }
        Ok(())
    }
}

fn hello(o: &TransferOptions) -> Control {
    Control::Hello {
        name: o.name.clone(),
        protocol: wire::PROTOCOL_VERSION,
    }
}

fn failed(request_id: u64, e: &Error) -> Control {
    Control::Failed {
        request_id,
        message: e.to_string(),
    }
}

/// Appends `s` to `parts`, merging it into the previous slice when adjacent in memory.
fn push_merged<'a>(parts: &mut Vec<&'a [u8]>, s: &'a [u8]) {
    if let Some(last) = parts.last_mut() {
        // SAFETY-free pointer comparison: merge only when `s` starts exactly where `last` ends,
        // in which case both lie in the same arena allocation.
        if last.as_ptr().wrapping_add(last.len()) == s.as_ptr() {
            // SAFETY: the two slices are adjacent parts of the same arena mapping, so the merged
            // range is one valid allocation range.
            *last = unsafe { std::slice::from_raw_parts(last.as_ptr(), last.len() + s.len()) };
            return;
        }
    }
    parts.push(s);
}

/// Which side of a span a stream position is resolved to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Src,
    Dst,
}

/// Walks the byte stream of a list of spans: stream offset `x` maps to one run of one span.
struct SpanCursor<'a> {
    spans: &'a [Span],
    starts: Vec<u64>,
    total: u64,
}

impl<'a> SpanCursor<'a> {
    fn new(spans: &'a [Span]) -> Self {
        let mut starts = Vec::with_capacity(spans.len());
        let mut t = 0;
        for s in spans {
            starts.push(t);
            t += s.bytes();
        }
        SpanCursor {
            spans,
            starts,
            total: t,
        }
    }

    fn total(&self) -> u64 {
        self.total
    }

    /// `(buffer, device offset, len)` pieces of `side` covering stream bytes `pos..pos+n`.
    fn pieces(&self, pos: u64, n: u64, side: Side) -> Vec<(u32, u64, u64)> {
        let mut out = Vec::new();
        let end = pos.saturating_add(n).min(self.total);
        let mut x = pos;
        let mut i = self.starts.partition_point(|&s| s <= x).saturating_sub(1);
        while x < end && i < self.spans.len() {
            let s = &self.spans[i];
            let rel = x - self.starts[i];
            let mut k = rel / s.len;
            let mut within = rel % s.len;
            while k < s.count as u64 && x < end {
                let take = (s.len - within).min(end - x);
                let (buf, base, stride) = match side {
                    Side::Src => (s.src_buffer, s.src_offset, s.src_stride),
                    Side::Dst => (s.dst_buffer, s.dst_offset, s.dst_stride),
                };
                out.push((buf, base + k * stride + within, take));
                x += take;
                within = 0;
                k += 1;
            }
            i += 1;
        }
        out
    }
}

/// What a [`pull`] moved.
#[derive(Debug, Clone, Default)]
pub struct PullStats {
    /// Payload bytes received.
    pub bytes: u64,
    /// Spans in the plan (for this receiver).
    pub spans: u64,
    /// `(src_rank, dst_rank)` pairs pulled, each over its own connection.
    pub pairs: u64,
    /// Wall time of the whole pull (connect to last byte).
    pub elapsed: Duration,
}

async fn connect(addr: &str, o: &TransferOptions) -> Result<TcpStream> {
    let fut = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| Error::io(format!("connect to {addr}"), e))?;
        s.set_nodelay(true).ok();
        write_control(&mut s, &hello(o), 0, o.io_timeout).await?;
        match read_control(&mut s, o.io_timeout).await? {
            (_, Control::Hello { protocol, .. }) if protocol == wire::PROTOCOL_VERSION => Ok(s),
            (_, m) => Err(Error::Protocol(format!(
                "expected hello from {addr}, got {m:?}"
            ))),
        }
    };
    tokio::time::timeout(o.connect_timeout, fut)
        .await
        .map_err(|_| {
            Error::Timeout(format!(
                "connecting to {addr} took longer than {:?}",
                o.connect_timeout
            ))
        })?
}

async fn request(
    s: &mut TcpStream,
    msg: &Control,
    request_id: u64,
    o: &TransferOptions,
) -> Result<Control> {
    write_control(s, msg, request_id, o.io_timeout).await?;
    match read_control(s, o.io_timeout).await? {
        (_, Control::Failed { message, .. }) => Err(Error::Remote(message)),
        (_, m) => Ok(m),
    }
}

/// Asks the sender at `addr` for the placement and token count of `request_id`.
pub async fn describe(
    addr: &str,
    request_id: u64,
    o: &TransferOptions,
) -> Result<(Placement, u32)> {
    let mut s = connect(addr, o).await?;
    match request(&mut s, &Control::Describe { request_id }, request_id, o).await? {
        Control::Description {
            num_tokens,
            placement,
            ..
        } => Ok((placement, num_tokens)),
        m => Err(Error::Protocol(format!(
            "expected a description, got {m:?}"
        ))),
    }
}

/// Tells the sender at `addr` that this receiver is done with `request_id`.
pub async fn release(addr: &str, request_id: u64, o: &TransferOptions) -> Result<()> {
    let mut s = connect(addr, o).await?;
    match request(&mut s, &Control::Release { request_id }, request_id, o).await? {
        Control::Released { .. } => Ok(()),
        m => Err(Error::Protocol(format!("expected released, got {m:?}"))),
    }
}

/// Pulls request `request_id` from the sender at `addr` into `staging`.
///
/// `src` is the sender's placement, `dst` this side's. Plans the transfer, then pulls every
/// `(src_rank, dst_rank)` pair whose destination is in `dst` concurrently, each over its own
/// connection. `staging` must stage exactly [`Plan::dst_ranges`] of each destination rank (see
/// [`plan_staging`]).
///
/// Errors: any pair failing fails the pull (the other pairs are cancelled); staged bytes of a
/// failed pull must not be used.
pub async fn pull(
    addr: &str,
    request_id: u64,
    src: &Placement,
    dst: &Placement,
    num_tokens: u32,
    staging: Arc<Staging>,
    o: &TransferOptions,
) -> Result<PullStats> {
    let start = Instant::now();
    let plan = Plan::build(src, dst, num_tokens)?;
    let pairs = plan.pairs();
    let mut set = tokio::task::JoinSet::new();
    for &(s_rank, d_rank) in &pairs {
        let spans = plan.pair_spans(s_rank, d_rank);
        let (addr, dst, staging, o) = (addr.to_string(), dst.clone(), staging.clone(), o.clone());
        set.spawn(async move {
            let mut sock = connect(&addr, &o).await?;
            let total: u64 = spans.iter().map(Span::bytes).sum();
            let msg = Control::Pull {
                request_id,
                src_rank: s_rank,
                dst_rank: d_rank,
                dst,
                digest: spans_digest(&spans),
                total_bytes: total,
            };
            write_control(&mut sock, &msg, request_id, o.io_timeout).await?;
            recv_pair(&mut sock, &staging, d_rank, &spans, request_id, &o).await
        });
    }
    let mut bytes = 0;
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(n)) => bytes += n,
            Ok(Err(e)) => {
                set.abort_all();
                return Err(e);
            }
            Err(e) => {
                set.abort_all();
                return Err(Error::Cancelled(format!("pull task failed: {e}")));
            }
        }
    }
    Ok(PullStats {
        bytes,
        spans: plan.spans.len() as u64,
        pairs: pairs.len() as u64,
        elapsed: start.elapsed(),
    })
}

/// The device ranges a receiver must stage for `plan`: per destination rank of `dst`, the merged
/// bytes the plan writes.
pub fn plan_staging(
    plan: &Plan,
    dst: &Placement,
) -> std::collections::BTreeMap<u32, Vec<crate::plan::ByteRange>> {
    (0..dst.layout.spec.ranks_per_replica())
        .map(|l| {
            let r = dst.global_rank(l);
            (r, plan.dst_ranges(r))
        })
        .collect()
}

async fn recv_pair(
    sock: &mut TcpStream,
    staging: &Staging,
    dst_rank: u32,
    spans: &[Span],
    request_id: u64,
    o: &TransferOptions,
) -> Result<u64> {
    let cursor = SpanCursor::new(spans);
    let total = cursor.total();
    let mut pos = 0u64;
    loop {
        let mut hb = [0u8; HEADER_LEN];
        read_exact(sock, &mut hb, o.io_timeout, pos, total).await?;
        let h = FrameHeader::decode(&hb)?;
        if h.request_id != request_id {
            return Err(Error::Protocol(format!(
                "frame for request {} on the stream of request {request_id}",
                h.request_id
            )));
        }
        match h.kind {
            FrameKind::Control => {
                let mut body = vec![0u8; h.body_len as usize];
                read_exact(sock, &mut body, o.io_timeout, pos, total).await?;
                match Control::decode(&body)? {
                    Control::PullDone { bytes, .. } => {
                        if pos != total || bytes != total {
                            return Err(Error::Protocol(format!(
                                "sender finished after {pos} of {total} bytes (claims {bytes})"
                            )));
                        }
                        return Ok(total);
                    }
                    Control::Failed { message, .. } => return Err(Error::Remote(message)),
                    m => {
                        return Err(Error::Protocol(format!(
                            "unexpected message during a pull: {m:?}"
                        )))
                    }
                }
            }
            FrameKind::Data => {
                let mut db = [0u8; DATA_HEADER_LEN];
                read_exact(sock, &mut db, o.io_timeout, pos, total).await?;
                let d = DataHeader::decode(&db)?;
                let n = h.body_len as u64 - DATA_HEADER_LEN as u64;
                if d.stream_offset != pos {
                    return Err(Error::Protocol(format!(
                        "data at stream offset {} but {pos} was expected",
                        d.stream_offset
                    )));
                }
                if pos + n > total {
                    return Err(Error::Protocol(format!(
                        "over-delivery: {n} bytes at {pos} exceed the {total} bytes planned"
                    )));
                }
                let mut parts: Vec<&mut [u8]> = Vec::new();
                let mut prev_end: *mut u8 = std::ptr::null_mut();
                for (buf, off, len) in cursor.pieces(pos, n, Side::Dst) {
                    let p = staging.resolve(dst_rank, buf, off, len)?;
                    if p == prev_end {
                        if let Some(last) = parts.pop() {
                            let l = last.len();
                            // SAFETY: `p` starts where `last` ends inside the same arena, so the
                            // merged range is one valid range of the mapping.
                            parts.push(unsafe {
                                std::slice::from_raw_parts_mut(last.as_mut_ptr(), l + len as usize)
                            });
                            prev_end = p.wrapping_add(len as usize);
                            continue;
                        }
                    }
                    // SAFETY: `resolve` checked the range lies inside this rank's staged ranges;
                    // the plan writes every destination byte once, so no other pair or frame
                    // touches it concurrently; the staging outlives this call.
                    parts.push(unsafe { std::slice::from_raw_parts_mut(p, len as usize) });
                    prev_end = p.wrapping_add(len as usize);
                }
                let mut iov: Vec<IoSliceMut<'_>> =
                    parts.iter_mut().map(|p| IoSliceMut::new(p)).collect();
                read_exact_vectored(sock, &mut iov, o.io_timeout, pos, total).await?;
                drop(iov);
                let sum = wire::checksum(parts.iter().map(|p| &**p));
                if sum != d.checksum {
                    return Err(Error::Checksum(format!(
                        "request {request_id}: {n} bytes at stream offset {pos} (dst rank {dst_rank})"
                    )));
                }
                pos += n;
            }
        }
    }
}

async fn read_exact(
    s: &mut TcpStream,
    buf: &mut [u8],
    t: Duration,
    pos: u64,
    total: u64,
) -> Result<()> {
    match tokio::time::timeout(t, s.read_exact(buf)).await {
        Err(_) => Err(Error::Timeout(format!(
            "no data from peer for {t:?} ({pos} of {total} bytes received)"
        ))),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(Error::PeerClosed(
            format!("connection closed after {pos} of {total} bytes"),
        )),
        Ok(Err(e)) => Err(Error::io("read", e)),
        Ok(Ok(_)) => Ok(()),
    }
}

async fn read_exact_vectored(
    s: &mut TcpStream,
    mut bufs: &mut [IoSliceMut<'_>],
    t: Duration,
    pos: u64,
    total: u64,
) -> Result<()> {
    while !bufs.is_empty() {
        match tokio::time::timeout(t, s.readable()).await {
            Err(_) => {
                return Err(Error::Timeout(format!(
                    "no data from peer for {t:?} ({pos} of {total} bytes received)"
                )))
            }
            Ok(Err(e)) => return Err(Error::io("read", e)),
            Ok(Ok(())) => {}
        }
        match s.try_read_vectored(bufs) {
            Ok(0) => {
                return Err(Error::PeerClosed(format!(
                    "connection closed after {pos} of {total} bytes (mid-frame)"
                )))
            }
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(Error::io("read", e)),
        }
    }
    Ok(())
}

async fn write_all_vectored(
    s: &mut TcpStream,
    mut bufs: &mut [IoSlice<'_>],
    t: Duration,
) -> Result<()> {
    while !bufs.is_empty() {
        match tokio::time::timeout(t, s.write_vectored(bufs)).await {
            Err(_) => return Err(Error::Timeout(format!("peer accepted no data for {t:?}"))),
            Ok(Err(e)) => return Err(Error::io("write", e)),
            Ok(Ok(0)) => return Err(Error::PeerClosed("peer stopped accepting data".into())),
            Ok(Ok(n)) => IoSlice::advance_slices(&mut bufs, n),
        }
    }
    Ok(())
}

async fn write_control(
    s: &mut TcpStream,
    msg: &Control,
    request_id: u64,
    t: Duration,
) -> Result<()> {
    let frame = msg.to_frame(request_id)?;
    match tokio::time::timeout(t, s.write_all(&frame)).await {
        Err(_) => Err(Error::Timeout(format!("peer accepted no data for {t:?}"))),
        Ok(Err(e)) => Err(Error::io("write", e)),
        Ok(Ok(())) => Ok(()),
    }
}

async fn read_control(s: &mut TcpStream, t: Duration) -> Result<(u64, Control)> {
    let mut hb = [0u8; HEADER_LEN];
    match tokio::time::timeout(t, s.read_exact(&mut hb)).await {
        Err(_) => return Err(Error::Timeout(format!("no message from peer for {t:?}"))),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(Error::PeerClosed("connection closed".into()))
        }
        Ok(Err(e)) => return Err(Error::io("read", e)),
        Ok(Ok(_)) => {}
    }
    let h = FrameHeader::decode(&hb)?;
    if h.kind != FrameKind::Control {
        return Err(Error::Protocol("expected a control frame".into()));
    }
    let mut body = vec![0u8; h.body_len as usize];
    match tokio::time::timeout(t, s.read_exact(&mut body)).await {
        Err(_) => Err(Error::Timeout(format!("no message from peer for {t:?}"))),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(Error::PeerClosed("connection closed mid-message".into()))
        }
        Ok(Err(e)) => Err(Error::io("read", e)),
        Ok(Ok(_)) => Ok((h.request_id, Control::decode(&body)?)),
    }
}
