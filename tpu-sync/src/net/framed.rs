//! Frames on a lane: control messages and data chunks, every read and write bounded by a
//! timeout. Used by both sides of every exchange.
//!
//! On plain TCP lanes (the ones read with `readv`), reads of frame headers and control bodies
//! go through a small read buffer ([`READ_BUF`]):
//! one `recv` then typically returns a frame header, its data header and the next control frame
//! together, instead of one system call (and one readiness wake-up) each. Payload bytes that
//! arrive in the buffer are copied out of it; the rest of a payload is read straight into its
//! destination. The hello of a lane is read without the buffer, so a lane taken out of its
//! `Framed` after the hello (the control lanes) carries no buffered bytes.

use std::io::{IoSlice, IoSliceMut};
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::transport::{Lane, ShmPeer};
use crate::error::{Error, Result};
use crate::wire::{
    self, Control, DataHeader, FrameHeader, FrameKind, DATA_HEADER_LEN, DATA_REF_PREFIX_LEN,
    HEADER_LEN, MAX_DATA_PAYLOAD, MAX_DATA_REF_PIECES,
};

/// Pieces shorter than this are copied into one contiguous buffer before a vectored write
/// (the kernel's per-iovec cost dominates for tiny pieces such as 256-byte head rows).
const SMALL_PIECE: usize = 2048;

/// Bytes of the read buffer: a few frame headers and small control frames, and a small
/// request's whole answer. A 16 KiB pull's data frame and the `StreamDone` after it arrive in
/// one `recv` (three system calls with an 8 KiB buffer: header and the payload's start, the
/// payload's rest, `StreamDone`); larger payloads are still read straight into their
/// destination past the first buffer-full. Allocated per lane on its first buffered read.
pub(crate) const READ_BUF: usize = 64 << 10;

/// A lane with its reusable buffers.
///
/// `lane` may be taken out only before anything but the hello was read (`rlen == rpos`).
pub(crate) struct Framed {
    pub(crate) lane: Box<dyn Lane>,
    pub(crate) io_timeout: Duration,
    gather: Vec<u8>,
    /// Data frames sent carry the xxh3-64 of their payload (false: 0, on a lane that
    /// authenticates every byte to a peer that does not verify there; [`Framed::agree_hashing`]).
    hash_sent: bool,
    /// Data frames received are verified against their checksum.
    verify_received: bool,
    rbuf: Box<[u8]>,
    rpos: usize,
    rlen: usize,
    /// Same-host lane: what each side may read of the other ([`super::shm`]).
    shm: Option<ShmPeer>,
    /// The data header and piece table of the [`FrameKind::DataRef`] frame being received
    /// (read by [`Framed::data_len`], used by [`Framed::recv_data`]).
    pending_ref: Option<(DataHeader, Vec<(u64, u64)>)>,
    /// The memory that [`FrameKind::DataRef`] frames sent on this lane point into, kept alive
    /// until the peer is known to be done reading it ([`Framed::hold_refs`]).
    hold: Option<RefHold>,
}

/// Something that keeps the sender's staging mapped (an `Arc` of it).
pub(crate) type RefHold = std::sync::Arc<dyn std::any::Any + Send + Sync>;

impl Drop for Framed {
    /// A lane dropped while its peer may still be copying data by reference out of this
    /// process's staging (a failed or abandoned exchange) lingers: its write side is shut (the
    /// peer reads what was sent, then end of stream, and reports the exchange as ended by this
    /// side, not as corrupt), and the staging stays mapped until the peer closed the lane or
    /// `io_timeout` passed. Runs on the Tokio runtime of the dropping thread; without one the
    /// staging is released at once.
    fn drop(&mut self) {
        let Some(keep) = self.hold.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut lane = std::mem::replace(&mut self.lane, Box::new(ClosedLane));
        let t = self.io_timeout;
        rt.spawn(async move {
            let _ = tokio::time::timeout(t, async {
                let _ = lane.shutdown().await;
                let mut sink = [0u8; 512];
                while let Ok(n) = lane.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
            drop(lane);
            drop(keep);
        });
    }
}

/// The lane left in a [`Framed`] whose lane was taken out: reads end, writes fail.
struct ClosedLane;

impl tokio::io::AsyncRead for ClosedLane {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for ClosedLane {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Ready(Err(std::io::ErrorKind::NotConnected.into()))
    }
    fn poll_flush(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

impl Lane for ClosedLane {
    fn peer(&self) -> super::transport::PeerInfo {
        super::transport::PeerInfo {
            addr: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
            identity: None,
        }
    }
}

/// What a data frame turned out to be after [`Framed::recv_data`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataOutcome {
    /// The payload was placed and its checksum matched.
    Ok,
    /// The payload was consumed (the lane stays in sync) but its checksum did not match.
    BadChecksum,
}

fn timeout_err(t: Duration, what: &str) -> Error {
    Error::Timeout(format!("no progress from peer for {t:?} ({what})"))
}

fn read_err(e: std::io::Error, what: &str) -> Error {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe
        // quinn: the QUIC connection was lost or closed under the stream.
        | std::io::ErrorKind::NotConnected => {
            Error::PeerClosed(format!("connection closed ({what}): {e}"))
        }
        _ => Error::io(what.to_string(), e),
    }
}

impl Framed {
    pub(crate) fn new(lane: Box<dyn Lane>, io_timeout: Duration) -> Framed {
        Framed {
            shm: lane.shm_peer(),
            pending_ref: None,
            hold: None,
            lane,
            io_timeout,
            gather: Vec::new(),
            hash_sent: true,
            verify_received: true,
            rbuf: Box::default(),
            rpos: 0,
            rlen: 0,
        }
    }

    /// Settles the data frames' checksums after the hello exchange: on a lane whose transport
    /// authenticates every byte ([`Lane::authenticates_bytes`]: TLS, QUIC), this side verifies
    /// only if `hash_here` (its `EndpointOptions::hash_encrypted_frames`) and hashes what it
    /// sends unless `peer_unhashed` (the peer's hello said it does not verify there). Other lanes
    /// hash and verify every frame whatever either side said.
    pub(crate) fn agree_hashing(&mut self, hash_here: bool, peer_unhashed: bool) {
        if self.lane.authenticates_bytes() {
            self.verify_received = hash_here;
            self.hash_sent = !peer_unhashed;
        }
    }

    /// Whether data frames received on this lane are checked against their xxh3-64 (false: an
    /// encrypted lane whose AEAD authenticates them; [`Framed::agree_hashing`]).
    pub(crate) fn verifies_received(&self) -> bool {
        self.verify_received
    }

    /// The lane itself, for a caller that serves it without frames (the control lanes; only
    /// right after the hello, see [`Framed`]). Nothing is held on such a lane.
    pub(crate) fn into_lane(mut self) -> Box<dyn Lane> {
        self.hold = None;
        std::mem::replace(&mut self.lane, Box::new(ClosedLane))
    }

    /// Keeps `keep` (the staging that data frames about to be sent point into) alive until the
    /// peer is done with this lane's data by reference: until [`Framed::release_refs`] (the
    /// peer answered the exchange, so it read every frame before it), or, when this `Framed` is
    /// dropped first (the exchange failed or was abandoned), until the peer closed the lane or
    /// [`Framed::io_timeout`] passed (see [`Drop`]). Only same-host lanes on which the peer
    /// reads this process's memory hold anything; on others the bytes are in the socket once
    /// written.
    pub(crate) fn hold_refs(&mut self, keep: RefHold) {
        if self.shm.is_some_and(|p| p.peer_can_read_me) {
            self.hold = Some(keep);
        }
    }

    /// The peer read every data frame sent so far (it answered after them): nothing is held.
    pub(crate) fn release_refs(&mut self) {
        self.hold = None;
    }

    /// Copies buffered bytes into `dst`; returns how many.
    fn take_buffered(&mut self, dst: &mut [u8]) -> usize {
        let n = (self.rlen - self.rpos).min(dst.len());
        dst[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
        self.rpos += n;
        n
    }

    /// Fills `buf` from the read buffer and the lane (no timeout; the callers bound it). Small
    /// remainders refill the buffer with whatever the lane has; large ones are read directly.
    async fn fill_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        if !self.lane.is_read_vectored() {
            // Encrypted lanes decrypt into their own buffer already.
            self.lane.read_exact(buf).await?;
            return Ok(());
        }
        let mut got = self.take_buffered(buf);
        while got < buf.len() {
            if buf.len() - got < READ_BUF / 2 {
                if self.rbuf.is_empty() {
                    self.rbuf = vec![0u8; READ_BUF].into_boxed_slice();
                }
                let n = self.lane.read(&mut self.rbuf).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                self.rpos = 0;
                self.rlen = n;
                got += self.take_buffered(&mut buf[got..]);
            } else {
                let n = self.lane.read(&mut buf[got..]).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                got += n;
            }
        }
        Ok(())
    }

    /// Reads a `len`-byte control body within `t` through the read buffer. The body grows with
    /// the bytes that arrive (64 KiB steps), so a header that announces a large body costs
    /// nothing until the peer sends it.
    async fn read_body_buffered(&mut self, len: u32, t: Duration) -> Result<Vec<u8>> {
        if !self.lane.is_read_vectored() {
            return read_body(&mut self.lane, len, t).await;
        }
        let len = len as usize;
        let r = tokio::time::timeout(t, async {
            let mut body = Vec::with_capacity(len.min(64 << 10));
            while body.len() < len {
                let at = body.len();
                let step = (len - at).min(64 << 10);
                body.resize(at + step, 0);
                if let Err(e) = self.fill_exact(&mut body[at..]).await {
                    return Err((e, at));
                }
            }
            Ok(body)
        })
        .await;
        match r {
            Err(_) => Err(timeout_err(t, "control message")),
            Ok(Err((e, at))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(Error::PeerClosed(format!(
                    "connection closed in the middle of a control message (about {at} of {len} \
                     bytes)"
                )))
            }
            Ok(Err((e, _))) => Err(read_err(e, "control message")),
            Ok(Ok(b)) => Ok(b),
        }
    }

    /// Writes one control frame.
    pub(crate) async fn send(&mut self, msg: &Control, request_id: u64) -> Result<()> {
        let frame = msg.to_frame(request_id)?;
        self.write_all(&frame).await
    }

    async fn write_all(&mut self, b: &[u8]) -> Result<()> {
        let t = self.io_timeout;
        match tokio::time::timeout(t, async {
            self.lane.write_all(b).await?;
            self.lane.flush().await
        })
        .await
        {
            Err(_) => Err(timeout_err(t, "peer accepts no data")),
            Ok(Err(e)) => Err(read_err(e, "write")),
            Ok(Ok(())) => Ok(()),
        }
    }

    async fn read_exact(&mut self, buf: &mut [u8], wait: Duration, what: &str) -> Result<()> {
        match tokio::time::timeout(wait, self.fill_exact(buf)).await {
            Err(_) => Err(timeout_err(wait, what)),
            Ok(Err(e)) => Err(read_err(e, what)),
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// Reads the next frame header, waiting at most `wait`.
    pub(crate) async fn recv_header(&mut self, wait: Duration) -> Result<FrameHeader> {
        let mut hb = [0u8; HEADER_LEN];
        self.read_exact(&mut hb, wait, "frame header").await?;
        FrameHeader::decode(&hb)
    }

    /// Reads the body of a control frame whose header was read.
    pub(crate) async fn recv_control_body(&mut self, h: &FrameHeader) -> Result<Control> {
        if h.kind != FrameKind::Control {
            return Err(Error::Protocol("expected a control frame, got data".into()));
        }
        let t = self.io_timeout;
        let body = self.read_body_buffered(h.body_len, t).await?;
        Control::decode(&body)
    }

    /// Reads the first frame of a lane, which must be a control frame of at most
    /// [`wire::MAX_HELLO_BODY`] bytes, all within `wait` (a peer that has not identified itself
    /// gets neither megabytes of buffer nor more than the handshake time).
    pub(crate) async fn recv_hello(&mut self, wait: Duration) -> Result<(u64, Control)> {
        let r = tokio::time::timeout(wait, async {
            let mut hb = [0u8; HEADER_LEN];
            self.lane
                .read_exact(&mut hb)
                .await
                .map_err(|e| read_err(e, "hello"))?;
            let h = FrameHeader::decode(&hb)?;
            if h.kind != FrameKind::Control || h.body_len > wire::MAX_HELLO_BODY {
                return Err(Error::Protocol(format!(
                    "first frame of a lane is a {:?} frame of {} bytes, expected a hello of at \
                     most {}",
                    h.kind,
                    h.body_len,
                    wire::MAX_HELLO_BODY
                )));
            }
            let body = read_body(&mut self.lane, h.body_len, wait).await?;
            Ok((h.request_id, Control::decode(&body)?))
        })
        .await;
        match r {
            Err(_) => Err(timeout_err(wait, "hello")),
            Ok(r) => r,
        }
    }

    /// Reads the next frame, which must be a control frame, waiting at most `wait` for it.
    pub(crate) async fn recv(&mut self, wait: Duration) -> Result<(u64, Control)> {
        let h = self.recv_header(wait).await?;
        let m = self.recv_control_body(&h).await?;
        Ok((h.request_id, m))
    }

    /// Writes one data frame whose payload is the concatenation of `parts`, followed in the
    /// same write by `then` (the encoded control frame that ends the stripe, if any), so the
    /// receiver gets both with one wake-up.
    pub(crate) async fn send_data_then(
        &mut self,
        request_id: u64,
        stream_offset: u64,
        parts: &[&[u8]],
        then: Option<&[u8]>,
    ) -> Result<()> {
        let n: usize = parts.iter().map(|p| p.len()).sum();
        let dh = DataHeader {
            stream_offset,
            checksum: if self.hash_sent {
                crate::store::checksum::checksum_parts(parts.iter().copied())
            } else {
                0
            },
        };
        if self.shm.is_some_and(|p| p.peer_can_read_me)
            && parts.len() <= MAX_DATA_REF_PIECES as usize
        {
            // Same host: the receiver copies the payload out of this process itself.
            let mut g = std::mem::take(&mut self.gather);
            g.clear();
            let body = DATA_HEADER_LEN + DATA_REF_PREFIX_LEN + 16 * parts.len();
            let fh = FrameHeader {
                kind: FrameKind::DataRef,
                body_len: body as u32,
                request_id,
            };
            g.extend_from_slice(&fh.encode());
            g.extend_from_slice(&dh.encode());
            g.extend_from_slice(&(n as u64).to_le_bytes());
            g.extend_from_slice(&(parts.len() as u32).to_le_bytes());
            g.extend_from_slice(&0u32.to_le_bytes());
            for p in parts {
                g.extend_from_slice(&(p.as_ptr() as u64).to_le_bytes());
                g.extend_from_slice(&(p.len() as u64).to_le_bytes());
            }
            if let Some(t) = then {
                g.extend_from_slice(t);
            }
            let r = self.write_all(&g).await;
            self.gather = g;
            return r;
        }
        let fh = FrameHeader {
            kind: FrameKind::Data,
            body_len: (DATA_HEADER_LEN + n) as u32,
            request_id,
        };
        let (h1, h2) = (fh.encode(), dh.encode());
        if !self.lane.is_write_vectored() {
            // Encrypted lanes copy into records/packets anyway: one gather, one write.
            let mut g = std::mem::take(&mut self.gather);
            g.clear();
            g.reserve(HEADER_LEN + DATA_HEADER_LEN + n);
            g.extend_from_slice(&h1);
            g.extend_from_slice(&h2);
            for p in parts {
                g.extend_from_slice(p);
            }
            if let Some(t) = then {
                g.extend_from_slice(t);
            }
            let r = self.write_all(&g).await;
            self.gather = g;
            return r;
        }
        // Plain TCP: writev straight from the staging; runs of tiny pieces are gathered first.
        let small: usize = parts
            .iter()
            .filter(|p| p.len() < SMALL_PIECE)
            .map(|p| p.len())
            .sum();
        let mut g = std::mem::take(&mut self.gather);
        g.clear();
        g.reserve(small);
        enum Piece<'a> {
            Direct(&'a [u8]),
            Gathered(usize, usize),
        }
        let mut pieces: Vec<Piece<'_>> = Vec::with_capacity(parts.len().min(4096) + 2);
        for p in parts {
            if p.len() < SMALL_PIECE {
                let start = g.len();
                g.extend_from_slice(p);
                match pieces.last_mut() {
                    Some(Piece::Gathered(_, end)) if *end == start => *end = g.len(),
                    _ => pieces.push(Piece::Gathered(start, g.len())),
                }
            } else {
                pieces.push(Piece::Direct(p));
            }
        }
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(pieces.len() + 3);
        iov.push(IoSlice::new(&h1));
        iov.push(IoSlice::new(&h2));
        for p in &pieces {
            iov.push(IoSlice::new(match *p {
                Piece::Direct(s) => s,
                Piece::Gathered(a, b) => &g[a..b],
            }));
        }
        if let Some(t) = then {
            iov.push(IoSlice::new(t));
        }
        let r = write_all_vectored(&mut self.lane, &mut iov, self.io_timeout).await;
        drop(iov);
        drop(pieces);
        self.gather = g;
        r
    }

    /// Writes one data frame with a given checksum (test faults: a corrupt payload).
    pub(crate) async fn send_data_with_checksum(
        &mut self,
        request_id: u64,
        stream_offset: u64,
        payload: &[u8],
        checksum: u64,
    ) -> Result<()> {
        let dh = DataHeader {
            stream_offset,
            checksum,
        };
        let fh = FrameHeader {
            kind: FrameKind::Data,
            body_len: (DATA_HEADER_LEN + payload.len()) as u32,
            request_id,
        };
        let mut g = Vec::with_capacity(HEADER_LEN + DATA_HEADER_LEN + payload.len());
        g.extend_from_slice(&fh.encode());
        g.extend_from_slice(&dh.encode());
        g.extend_from_slice(payload);
        self.write_all(&g).await
    }

    /// The payload length of the data frame whose header `h` was read. For a
    /// [`FrameKind::DataRef`] frame this reads its data header and piece table (checked: count,
    /// lengths, the payload limit); call [`Framed::recv_data`] next.
    pub(crate) async fn data_len(&mut self, h: &FrameHeader) -> Result<u64> {
        if h.kind != FrameKind::DataRef {
            return Ok(h.body_len as u64 - DATA_HEADER_LEN as u64);
        }
        if !self.shm.is_some_and(|p| p.can_read_peer) {
            return Err(Error::Protocol(
                "peer sent data by reference on a lane where this side cannot read its memory"
                    .into(),
            ));
        }
        let t = self.io_timeout;
        let body = self.read_body_buffered(h.body_len, t).await?;
        let d = DataHeader::decode(&body[..DATA_HEADER_LEN])?;
        let p = &body[DATA_HEADER_LEN..];
        let len = u64::from_le_bytes(p[0..8].try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(p[8..12].try_into().expect("4 bytes")) as usize;
        let table = &p[DATA_REF_PREFIX_LEN..];
        if count * 16 != table.len() || len > MAX_DATA_PAYLOAD as u64 {
            return Err(Error::Protocol(format!(
                "data-by-reference frame: {count} pieces in a table of {} bytes, payload {len}",
                table.len()
            )));
        }
        let pieces: Vec<(u64, u64)> = table
            .chunks_exact(16)
            .map(|c| {
                (
                    u64::from_le_bytes(c[0..8].try_into().expect("8 bytes")),
                    u64::from_le_bytes(c[8..16].try_into().expect("8 bytes")),
                )
            })
            .collect();
        self.pending_ref = Some((d, pieces));
        Ok(len)
    }

    /// Copies the payload of the [`FrameKind::DataRef`] frame read by [`Framed::data_len`] out
    /// of the peer process into `dst`, then verifies it. A table that does not cover `dst`
    /// exactly, or points outside the peer's memory, is a checksum failure (the frame was
    /// consumed, the lane is in sync); a peer that exited is [`Error::PeerClosed`].
    fn recv_data_ref(&mut self, dst: &mut [&mut [u8]]) -> Result<(DataHeader, DataOutcome)> {
        let Some((d, pieces)) = self.pending_ref.take() else {
            return Err(Error::Protocol(
                "data-by-reference payload without its table".into(),
            ));
        };
        let pid = self.shm.map(|p| p.pid).unwrap_or(0);
        let covered: u64 = pieces.iter().fold(0u64, |a, p| a.saturating_add(p.1));
        let want: u64 = dst.iter().map(|p| p.len() as u64).sum();
        if covered != want {
            return Ok((d, DataOutcome::BadChecksum));
        }
        // Copied and hashed (in cache-sized steps when `verify_step` is set); a large copy
        // hands this runtime worker's other tasks (heartbeats among them) to another thread
        // first.
        let copy =
            || super::shm::copy_and_hash_from_peer(pid, dst, &pieces, super::shm::verify_step());
        let sum = match off_worker_if_large(want, copy) {
            Ok(sum) => sum,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(exited(pid)),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                return Err(Error::io(
                    format!("copy out of process {pid} (process_vm_readv)"),
                    e,
                ))
            }
            // EFAULT, a short copy: the region is not (all) there.
            Err(e) => {
                if !super::shm::process_alive(pid) {
                    return Err(exited(pid));
                }
                log::warn!("shm: copy out of process {pid} failed: {e}");
                return Ok((d, DataOutcome::BadChecksum));
            }
        };
        let ok = sum == d.checksum;
        if !ok && !super::shm::process_alive(pid) {
            // The sender exited during the copy: its memory went away, nothing was corrupted.
            return Err(exited(pid));
        }
        Ok((
            d,
            if ok {
                DataOutcome::Ok
            } else {
                DataOutcome::BadChecksum
            },
        ))
    }

    /// Reads the payload of a data frame (header `h`, already read, and for a
    /// [`FrameKind::DataRef`] frame its table by [`Framed::data_len`]) into `dst` pieces, which
    /// must add up to the payload length. Every lane reads straight into `dst` (plain TCP with
    /// `readv`, encrypted lanes out of their session's authenticated plaintext) and verifies as
    /// the bytes arrive; a frame that fails is reported, and its request fails before anything
    /// drains the staging to the device (docs/network.md, "Integrity and validation").
    pub(crate) async fn recv_data(
        &mut self,
        h: &FrameHeader,
        dst: &mut [&mut [u8]],
    ) -> Result<(DataHeader, DataOutcome)> {
        if h.kind == FrameKind::DataRef {
            return self.recv_data_ref(dst);
        }
        let mut db = [0u8; DATA_HEADER_LEN];
        let t = self.io_timeout;
        self.read_exact(&mut db, t, "data header").await?;
        let d = DataHeader::decode(&db)?;
        let n = h.body_len as usize - DATA_HEADER_LEN;
        let want: usize = dst.iter().map(|p| p.len()).sum();
        if want != n {
            return Err(Error::Protocol(format!(
                "data frame of {n} bytes where {want} were expected"
            )));
        }
        // Payload bytes already in the read buffer first (plain TCP lanes only), then the rest
        // straight into the destination pieces.
        let mut skip = (0usize, 0usize);
        for (i, p) in dst.iter_mut().enumerate() {
            if self.rpos == self.rlen {
                break;
            }
            let n = self.take_buffered(p);
            skip = (i, n);
            if n < p.len() {
                break;
            }
            skip = (i + 1, 0);
        }
        let (first, off) = skip;
        // The checksum is computed as the bytes arrive, each read's bytes right after the read
        // (still in cache, while the sender is still sending the rest), not in a second pass
        // over the whole payload once it is complete. Same value: xxh3 streamed over the
        // payload in order.
        let mut hash = self.verify_received.then(crate::store::checksum::Xxh3::new);
        if let Some(h) = hash.as_mut() {
            for p in &dst[..first.min(dst.len())] {
                h.update(p);
            }
            if off > 0 {
                h.update(&dst[first][..off]);
            }
        }
        let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(dst.len() - first.min(dst.len()));
        for (i, p) in dst.iter_mut().enumerate().skip(first) {
            let p: &mut [u8] = p;
            iov.push(IoSliceMut::new(if i == first { &mut p[off..] } else { p }));
        }
        read_exact_vectored(&mut self.lane, &mut iov, t, hash.as_mut()).await?;
        drop(iov);
        let ok = hash.is_none_or(|h| h.digest() == d.checksum);
        Ok((
            d,
            if ok {
                DataOutcome::Ok
            } else {
                DataOutcome::BadChecksum
            },
        ))
    }
}

/// Copies of more bytes than this, done synchronously inside a lane's future, leave the
/// runtime worker first ([`off_worker_if_large`]).
pub(crate) const BLOCKING_COPY_BYTES: u64 = 256 << 10;

/// Runs `f`, a synchronous copy of `bytes`: above [`BLOCKING_COPY_BYTES`] on a multi-threaded
/// Tokio runtime through `block_in_place`, so the worker's queued tasks (heartbeats, other
/// lanes) move to another thread while it runs; otherwise (small, or a current-thread runtime
/// where that is not possible) right here.
pub(crate) fn off_worker_if_large<T>(bytes: u64, f: impl FnOnce() -> T) -> T {
    if bytes > BLOCKING_COPY_BYTES {
        crate::util::off_worker(f)
    } else {
        f()
    }
}

fn exited(pid: i32) -> Error {
    Error::PeerClosed(format!(
        "the sending process {pid} exited in the middle of a data frame"
    ))
}

/// Reads a `len`-byte body from `r` within `t`. The buffer grows with the bytes that actually
/// arrive, so a header that announces a large body costs nothing until the peer sends it.
pub(crate) async fn read_body<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    len: u32,
    t: Duration,
) -> Result<Vec<u8>> {
    let mut body = Vec::with_capacity((len as usize).min(64 << 10));
    match tokio::time::timeout(t, (&mut *r).take(len as u64).read_to_end(&mut body)).await {
        Err(_) => Err(timeout_err(t, "control message")),
        Ok(Err(e)) => Err(read_err(e, "control message")),
        Ok(Ok(n)) if n < len as usize => Err(Error::PeerClosed(format!(
            "connection closed in the middle of a control message ({n} of {len} bytes)"
        ))),
        Ok(Ok(_)) => Ok(body),
    }
}

/// Writes every byte of `bufs` and flushes. The flush matters: a TLS lane (tokio-rustls reports
/// vectored writes) may keep the last record's bytes until flushed, and a frame that ends an
/// exchange (a stripe's last data frame carrying its StreamDone) is followed by no other write.
async fn write_all_vectored(
    s: &mut Box<dyn Lane>,
    mut bufs: &mut [IoSlice<'_>],
    t: Duration,
) -> Result<()> {
    while !bufs.is_empty() {
        match tokio::time::timeout(t, s.write_vectored(bufs)).await {
            Err(_) => return Err(timeout_err(t, "peer accepts no data")),
            Ok(Err(e)) => return Err(read_err(e, "write")),
            Ok(Ok(0)) => return Err(Error::PeerClosed("peer stopped accepting data".into())),
            Ok(Ok(n)) => IoSlice::advance_slices(&mut bufs, n),
        }
    }
    match tokio::time::timeout(t, s.flush()).await {
        Err(_) => Err(timeout_err(t, "peer accepts no data")),
        Ok(Err(e)) => Err(read_err(e, "write")),
        Ok(Ok(())) => Ok(()),
    }
}

/// Fills `bufs` from the lane (each read within `t`), feeding `hash` every byte read, in order,
/// right after the read that brought it.
async fn read_exact_vectored(
    s: &mut Box<dyn Lane>,
    mut bufs: &mut [IoSliceMut<'_>],
    t: Duration,
    mut hash: Option<&mut crate::store::checksum::Xxh3>,
) -> Result<()> {
    while !bufs.is_empty() {
        let r = tokio::time::timeout(
            t,
            std::future::poll_fn(|cx| Pin::new(&mut *s).poll_read_vectored(cx, bufs)),
        )
        .await;
        match r {
            Err(_) => return Err(timeout_err(t, "data payload")),
            Ok(Err(e)) => return Err(read_err(e, "read")),
            Ok(Ok(0)) => {
                return Err(Error::PeerClosed(
                    "connection closed in the middle of a data frame".into(),
                ))
            }
            Ok(Ok(n)) => {
                if let Some(hash) = hash.as_deref_mut() {
                    let mut left = n;
                    for b in bufs.iter() {
                        if left == 0 {
                            break;
                        }
                        let k = left.min(b.len());
                        hash.update(&b[..k]);
                        left -= k;
                    }
                }
                IoSliceMut::advance_slices(&mut bufs, n)
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::tcp::Wrapped;
    use crate::net::transport::PeerInfo;

    /// Two ends of an in-memory byte stream that, like a TLS or QUIC lane, declares that it
    /// authenticates every byte. `buffer`: bytes in flight at most, so reads come in pieces.
    fn encrypted_pair(buffer: usize) -> (Framed, Framed) {
        let (a, b) = tokio::io::duplex(buffer);
        let lane = |s| -> Box<dyn Lane> {
            Box::new(Wrapped {
                inner: s,
                peer: PeerInfo {
                    addr: "127.0.0.1:1".parse().unwrap(),
                    identity: Some("psk".into()),
                },
            })
        };
        let t = Duration::from_secs(5);
        (Framed::new(lane(a), t), Framed::new(lane(b), t))
    }

    /// Non-zero pseudo-random bytes (xorshift64 from `seed`): no two seeds or offsets repeat.
    fn payload(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8 | 1
            })
            .collect()
    }

    /// Sends `data` as one frame of 256-byte pieces from `tx`, receives it into as many
    /// pieces at `rx`; returns the checksum field on the wire, the outcome and what arrived.
    async fn one_frame(
        tx: &mut Framed,
        rx: &mut Framed,
        data: &[u8],
    ) -> (u64, DataOutcome, Vec<u8>) {
        let parts: Vec<&[u8]> = data.chunks(256).collect();
        let mut got = vec![0u8; data.len()];
        let (sent, received) = tokio::join!(tx.send_data_then(7, 0, &parts, None), async {
            let h = rx.recv_header(Duration::from_secs(5)).await.unwrap();
            assert_eq!(h.kind, FrameKind::Data);
            let mut dst: Vec<&mut [u8]> = got.chunks_mut(256).collect();
            rx.recv_data(&h, &mut dst).await.unwrap()
        });
        sent.unwrap();
        let (d, outcome) = received;
        assert_eq!(d.stream_offset, 0);
        (d.checksum, outcome, got)
    }

    #[tokio::test]
    async fn encrypted_lanes_skip_the_hash_only_as_agreed() {
        // 1,000 bytes in flight at most: the 64 KiB frame arrives in many partial reads that
        // end inside pieces, and each read fills as many 256-byte pieces as it can.
        let (mut tx, mut rx) = encrypted_pair(1000);
        let data = payload(64 << 10, 0x5eed);
        let sum = crate::store::checksum::checksum(&data);

        // The receiver said it does not verify (its hello's `unhashed_aead`): no hash is sent
        // and none is checked; every byte is in place.
        tx.agree_hashing(false, true);
        rx.agree_hashing(false, false);
        assert!(!rx.verifies_received());
        let (field, outcome, got) = one_frame(&mut tx, &mut rx, &data).await;
        assert_eq!((field, outcome), (0, DataOutcome::Ok));
        assert!(got == data, "payload differs");

        // A receiver that asks for checksums gets the payload's xxh3-64 and checks it.
        tx.agree_hashing(false, false);
        rx.agree_hashing(true, true);
        assert!(rx.verifies_received());
        let data = payload(64 << 10, 0xfeed);
        let (field, outcome, got) = one_frame(&mut tx, &mut rx, &data).await;
        assert_eq!(field, crate::store::checksum::checksum(&data));
        assert_ne!(field, sum);
        assert_eq!(outcome, DataOutcome::Ok);
        assert!(got == data, "payload differs");

        // A verifying receiver refuses a frame sent without one (the lane stays in sync).
        tx.agree_hashing(false, true);
        let (field, outcome, _) = one_frame(&mut tx, &mut rx, &data).await;
        assert_eq!((field, outcome), (0, DataOutcome::BadChecksum));
        let (_, outcome, got) = {
            tx.agree_hashing(false, false);
            one_frame(&mut tx, &mut rx, &data).await
        };
        assert_eq!(outcome, DataOutcome::Ok);
        assert!(got == data, "payload differs after a refused frame");
    }
}
