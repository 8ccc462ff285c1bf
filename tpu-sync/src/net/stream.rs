//! A pair's byte stream: mapping stream offsets to span runs, sending and receiving one stripe,
//! and per-layer progress.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::framed::{DataOutcome, Framed};
use super::Counters;
use crate::error::{Error, Result};
use crate::plan::Span;
use crate::staging::Staging;
use crate::wire::{Control, FrameKind, Stripe};

/// Which side of a span.
#[derive(Clone, Copy)]
pub(crate) enum Side {
    Src,
    Dst,
}

/// Walks the byte stream of a list of spans: stream offset `x` maps to one run of one span.
pub(crate) struct SpanCursor {
    spans: Vec<Span>,
    starts: Vec<u64>,
    total: u64,
    /// Stream offset at which each layer's bytes end (index = layer; layer-major streams).
    layer_ends: Vec<u64>,
}

impl SpanCursor {
    pub(crate) fn new(spans: Vec<Span>, num_layers: u32) -> Self {
        let mut starts = Vec::with_capacity(spans.len());
        let mut t = 0;
        let mut layer_ends = vec![0u64; num_layers as usize];
        let mut last_layer = 0usize;
        for s in &spans {
            starts.push(t);
            t += s.bytes();
            let l = (s.src_buffer as usize).min(layer_ends.len().saturating_sub(1));
            last_layer = last_layer.max(l);
            if let Some(e) = layer_ends.get_mut(l) {
                *e = t;
            }
        }
        // Layers without bytes end where the previous one ended (monotone).
        let mut prev = 0;
        for e in layer_ends.iter_mut() {
            if *e < prev {
                *e = prev;
            }
            prev = *e;
        }
        let _ = last_layer;
        SpanCursor {
            spans,
            starts,
            total: t,
            layer_ends,
        }
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Segment (layer) end offsets for [`Stripe::chunks_in`].
    pub(crate) fn bounds(&self) -> Vec<u64> {
        let mut v = self.layer_ends.clone();
        v.push(self.total);
        v
    }

    /// Layers whose bytes all lie below stream offset `prefix`.
    pub(crate) fn layers_below(&self, prefix: u64) -> u32 {
        self.layer_ends.partition_point(|&e| e <= prefix) as u32
    }

    /// The layer holding stream byte `x` (for gating a sender on published layers).
    pub(crate) fn layer_of(&self, x: u64) -> u32 {
        self.layer_ends.partition_point(|&e| e <= x) as u32
    }

    /// `(buffer, device offset, len)` pieces of `side` covering stream bytes `pos..pos+n`.
    pub(crate) fn pieces(&self, pos: u64, n: u64, side: Side) -> Vec<(u32, u64, u64)> {
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

    /// Checks that every byte of `side` lies in `staging` for `rank` (before any I/O).
    pub(crate) fn check_staged(&self, staging: &Staging, rank: u32, side: Side) -> Result<()> {
        for s in &self.spans {
            for (so, d) in s.runs() {
                let (buf, off) = match side {
                    Side::Src => (s.src_buffer, so),
                    Side::Dst => (s.dst_buffer, d),
                };
                staging.resolve(rank, buf, off, s.len)?;
            }
        }
        Ok(())
    }
}

/// Received-prefix tracking of a transfer: per pair, per stripe, the next expected offset; the
/// number of leading layers complete on every pair is published on a watch channel.
pub(crate) struct Progress {
    pairs: Vec<PairProgress>,
    layers: tokio::sync::watch::Sender<u32>,
    num_layers: u32,
}

struct PairProgress {
    cursor: Arc<SpanCursor>,
    stripes: std::sync::Mutex<Vec<u64>>,
    layers: AtomicU32,
}

impl Progress {
    pub(crate) fn new(cursors: &[Arc<SpanCursor>], num_layers: u32) -> Progress {
        let (tx, _) = tokio::sync::watch::channel(if cursors.is_empty() { num_layers } else { 0 });
        Progress {
            pairs: cursors
                .iter()
                .map(|c| PairProgress {
                    cursor: c.clone(),
                    stripes: std::sync::Mutex::new(Vec::new()),
                    layers: AtomicU32::new(if c.total() == 0 { num_layers } else { 0 }),
                })
                .collect(),
            layers: tx,
            num_layers,
        }
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u32> {
        self.layers.subscribe()
    }

    pub(crate) fn layers_complete(&self) -> u32 {
        *self.layers.borrow()
    }

    /// Declares the stripe count of pair `i` (first stripe to start); stripes not yet started
    /// count as having nothing.
    pub(crate) fn start(&self, i: usize, stripe: &Stripe) {
        let p = &self.pairs[i];
        let mut g = p.stripes.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_empty() {
            *g = vec![0; stripe.count as usize];
        }
    }

    /// Stripe `k` of pair `i` has every chunk that starts below `next` (the start of its next
    /// chunk, or the stream end when finished). The minimum over a pair's stripes is a prefix
    /// of the stream that has fully arrived.
    pub(crate) fn advance(&self, i: usize, k: u32, next: u64) {
        let p = &self.pairs[i];
        let prefix = {
            let mut g = p.stripes.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(s) = g.get_mut(k as usize) {
                *s = next;
            }
            g.iter().copied().min().unwrap_or(0)
        };
        let l = p.cursor.layers_below(prefix).min(self.num_layers);
        p.layers.fetch_max(l, Ordering::Relaxed);
        let global = self
            .pairs
            .iter()
            .map(|p| p.layers.load(Ordering::Relaxed))
            .min()
            .unwrap_or(self.num_layers);
        self.layers.send_if_modified(|v| {
            if global > *v {
                *v = global;
                true
            } else {
                false
            }
        });
    }
}

/// Sends stripe `stripe` of a pair's stream from `staging` (rank `src_rank`), waiting on
/// `gate` (layers published so far) before sending bytes of a layer not yet published.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn send_stripe(
    f: &mut Framed,
    request_id: u64,
    staging: &Staging,
    src_rank: u32,
    cursor: &SpanCursor,
    stripe: Stripe,
    mut gate: Option<tokio::sync::watch::Receiver<u32>>,
    counters: &Counters,
    faults: &super::FaultHooks,
) -> Result<u64> {
    let mut sent = 0u64;
    // The stripe's end (StreamDone) goes out in the same write as its last data frame.
    let planned: u64 = stripe.chunks_in(cursor.bounds()).map(|(a, b)| b - a).sum();
    let done = Control::StreamDone {
        request_id,
        bytes: planned,
    }
    .to_frame(request_id)?;
    let mut done_sent = false;
    for (a, b) in stripe.chunks_in(cursor.bounds()) {
        if let Some(g) = gate.as_mut() {
            let need = cursor.layer_of(a) + 1;
            if *g.borrow() < need {
                g.wait_for(|&v| v >= need).await.map_err(|_| {
                    Error::Cancelled(format!(
                        "request {request_id} was withdrawn while waiting for layer {}",
                        need - 1
                    ))
                })?;
            }
        }
        if let Some(limit) = faults.close_after_bytes {
            if counters.bytes_sent.load(Ordering::Relaxed) + (b - a) > limit {
                return Err(Error::Cancelled("test fault: closing mid-transfer".into()));
            }
        }
        if let Some(limit) = faults.stall_after_bytes {
            if counters.bytes_sent.load(Ordering::Relaxed) + (b - a) > limit {
                // Test fault: a peer that stops sending without closing (a hung process).
                std::future::pending::<()>().await;
            }
        }
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut prev_end: *const u8 = std::ptr::null();
        for (buf, off, len) in cursor.pieces(a, b - a, Side::Src) {
            let p = staging.resolve(src_rank, buf, off, len)? as *const u8;
            if p == prev_end {
                if let Some(last) = parts.pop() {
                    // SAFETY: `p` starts where `last` ends inside the same arena, so the merged
                    // range is one valid, registered range of the mapping.
                    parts.push(unsafe {
                        std::slice::from_raw_parts(last.as_ptr(), last.len() + len as usize)
                    });
                    prev_end = p.wrapping_add(len as usize);
                    continue;
                }
            }
            // SAFETY: `resolve` checked that the range lies inside the sender's staged blocks;
            // the staging is not written while registered for sending, and it outlives this
            // call (the caller holds an `Arc` to it).
            parts.push(unsafe { std::slice::from_raw_parts(p, len as usize) });
            prev_end = p.wrapping_add(len as usize);
        }
        let corrupt = faults
            .corrupt_at_offset
            .map(|o| (a..b).contains(&o))
            .unwrap_or(false)
            && !counters.corrupted.swap(true, Ordering::Relaxed);
        if corrupt {
            // Test fault: flip one byte of a copy (never the staging) so the checksum fails.
            let mut copy: Vec<u8> = parts.concat();
            copy[0] ^= 0xff;
            let sum_ok = crate::wire::checksum(parts.iter().copied());
            f.send_data_with_checksum(request_id, a, &copy, sum_ok)
                .await?;
        } else {
            let last = sent + (b - a) == planned;
            f.send_data_then(request_id, a, &parts, last.then_some(&done[..]))
                .await?;
            done_sent = last;
        }
        counters.sent(b - a);
        sent += b - a;
    }
    if !done_sent {
        f.send(
            &Control::StreamDone {
                request_id,
                bytes: sent,
            },
            request_id,
        )
        .await?;
    }
    Ok(sent)
}

/// How receiving a stripe ended when it did not end well.
pub(crate) struct RecvFailure {
    pub(crate) error: Error,
    /// Whether the lane is still in sync (frame boundaries intact) and may be reused.
    pub(crate) lane_ok: bool,
}

/// Receives stripe `stripe` of pair `pair` into `staging` (rank `dst_rank`), through the
/// receiver's own cursor. Ends after the sender's `StreamDone`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn recv_stripe(
    f: &mut Framed,
    request_id: u64,
    staging: &Staging,
    dst_rank: u32,
    cursor: &SpanCursor,
    stripe: Stripe,
    progress: &Progress,
    pair: usize,
    counters: &Counters,
) -> std::result::Result<u64, RecvFailure> {
    let total = cursor.total();
    let fail = |error: Error, lane_ok: bool| RecvFailure { error, lane_ok };
    let mut got = 0u64;
    let mut bad: Option<Error> = None;
    progress.start(pair, &stripe);
    let wait = f.io_timeout;
    // Lazy: the stripe geometry may come from the peer (pushes), so nothing proportional to its
    // chunk count is allocated. `planned` is only needed for error messages.
    let mut chunks = stripe.chunks_in(cursor.bounds()).peekable();
    let planned = || -> u64 { stripe.chunks_in(cursor.bounds()).map(|(a, b)| b - a).sum() };
    progress.advance(
        pair,
        stripe.index,
        chunks.peek().map(|c| c.0).unwrap_or(total),
    );
    while let Some((a, b)) = chunks.next() {
        let h = f.recv_header(wait).await.map_err(|e| fail(e, false))?;
        if h.request_id != request_id {
            return Err(fail(
                Error::Protocol(format!(
                    "frame for request {} on a stream of request {request_id}",
                    h.request_id
                )),
                false,
            ));
        }
        if h.kind == FrameKind::Control {
            let m = f.recv_control_body(&h).await.map_err(|e| fail(e, false))?;
            return Err(match m {
                Control::Failed { message, kind, .. } => {
                    fail(crate::wire::remote_error(kind, &message), true)
                }
                Control::StreamDone { bytes, .. } => fail(
                    Error::Protocol(format!(
                        "sender ended stripe {}/{} after {got} of {} bytes (claims {bytes})",
                        stripe.index,
                        stripe.count,
                        planned()
                    )),
                    true,
                ),
                m => fail(
                    Error::Protocol(format!("unexpected message in a data stream: {m:?}")),
                    false,
                ),
            });
        }
        let n = f.data_len(&h).await.map_err(|e| fail(e, false))?;
        if n != b - a {
            return Err(fail(
                Error::Protocol(format!(
                    "data frame of {n} bytes where chunk {a}..{b} ({} bytes) was expected{}",
                    b - a,
                    if n > b - a { " (over-delivery)" } else { "" }
                )),
                false,
            ));
        }
        let mut parts: Vec<&mut [u8]> = Vec::new();
        let mut prev_end: *mut u8 = std::ptr::null_mut();
        for (buf, off, len) in cursor.pieces(a, n, Side::Dst) {
            let p = staging
                .resolve(dst_rank, buf, off, len)
                .map_err(|e| fail(e, false))?;
            if p == prev_end {
                if let Some(last) = parts.pop() {
                    let l = last.len();
                    // SAFETY: `p` starts where `last` ends inside the same arena, so the merged
                    // range is one valid range of the mapping.
                    parts.push(unsafe {
                        std::slice::from_raw_parts_mut(last.as_mut_ptr(), l + len as usize)
                    });
                    prev_end = p.wrapping_add(len as usize);
                    continue;
                }
            }
            // SAFETY: `resolve` checked the range lies inside this rank's staged ranges; the
            // plan writes every destination byte exactly once (one pair, one stripe, one
            // chunk), so nothing else touches it concurrently; the staging outlives this call.
            parts.push(unsafe { std::slice::from_raw_parts_mut(p, len as usize) });
            prev_end = p.wrapping_add(len as usize);
        }
        let (d, outcome) = f
            .recv_data(&h, &mut parts)
            .await
            .map_err(|e| fail(e, false))?;
        if d.stream_offset != a {
            return Err(fail(
                Error::Protocol(format!(
                    "data at stream offset {} where {a} was expected",
                    d.stream_offset
                )),
                false,
            ));
        }
        counters.received(n);
        match outcome {
            DataOutcome::Ok => {
                got += n;
                if h.kind == FrameKind::DataRef {
                    counters.bytes_by_reference.fetch_add(n, Ordering::Relaxed);
                } else if !f.verifies_received() {
                    counters.bytes_unhashed.fetch_add(n, Ordering::Relaxed);
                }
                if bad.is_none() {
                    let next = chunks.peek().map(|c| c.0).unwrap_or(total);
                    progress.advance(pair, stripe.index, next);
                }
            }
            DataOutcome::BadChecksum => {
                // Counted (and reported) only once the stripe ended well otherwise: a sender
                // that failed, cancelled or went away in the meantime is the real cause.
                bad.get_or_insert(Error::Checksum(format!(
                    "request {request_id}: {n} bytes at stream offset {a} (stripe {}/{}, dst rank \
                     {dst_rank})",
                    stripe.index, stripe.count
                )));
            }
        }
    }
    // The sender's end of stripe.
    let h = f.recv_header(wait).await.map_err(|e| fail(e, false))?;
    if h.kind != FrameKind::Control {
        return Err(fail(
            Error::Protocol(format!(
                "over-delivery: data beyond the {} bytes of stripe {}/{}",
                planned(),
                stripe.index,
                stripe.count
            )),
            false,
        ));
    }
    let m = f.recv_control_body(&h).await.map_err(|e| fail(e, false))?;
    match m {
        Control::StreamDone { bytes, .. } if bytes == got || bad.is_some() => {}
        Control::StreamDone { bytes, .. } => {
            return Err(fail(
                Error::Protocol(format!("sender claims {bytes} bytes, {got} arrived")),
                true,
            ))
        }
        Control::Failed { message, kind, .. } => {
            return Err(fail(crate::wire::remote_error(kind, &message), true))
        }
        m => {
            return Err(fail(
                Error::Protocol(format!("expected the end of the stream, got {m:?}")),
                false,
            ))
        }
    }
    if let Some(e) = bad {
        counters.checksum_failed();
        return Err(fail(e, true));
    }
    Ok(got)
}
