//! Lanes as the driver holds them: open-lane counting, pooled and checked-out lanes, and
//! control-lane frame I/O on split halves.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::net::framed::Framed;
use crate::net::stats::Counters;
use crate::wire::{Control, FrameHeader, FrameKind, HEADER_LEN};

/// A very long wait (a control lane waits for its next message indefinitely; liveness is the
/// heartbeat's business).
pub(super) const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Default of [`crate::net::EndpointOptions::lane_idle_timeout`]: a server's data lane that
/// carries no request for this long is closed (issue 24: an idle pooled lane holds a socket and
/// a task, so a peer that opens lanes and leaves them must not keep them forever). A client
/// closes a pooled lane idle for half of it instead of reusing it.
pub const DEFAULT_LANE_IDLE: Duration = Duration::from_secs(120);

/// Counts an open lane for [`crate::net::Stats::lanes_open`].
pub(super) struct LaneCount(Arc<Counters>);

impl LaneCount {
    pub(super) fn new(c: &Arc<Counters>) -> LaneCount {
        c.lanes_open.fetch_add(1, Ordering::Relaxed);
        c.lanes_opened.fetch_add(1, Ordering::Relaxed);
        LaneCount(c.clone())
    }
}

impl Drop for LaneCount {
    fn drop(&mut self) {
        self.0.lanes_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A framed lane plus its open-lane count.
pub(super) struct CountedLane {
    pub(super) f: Framed,
    pub(super) _count: LaneCount,
}

/// A data lane checked out of a peer's pool (its permit bounds the lanes per peer).
pub(super) struct LaneGuard {
    pub(super) f: Framed,
    pub(super) _count: LaneCount,
    pub(super) _permit: tokio::sync::OwnedSemaphorePermit,
}

/// Reads one control frame (the caller bounds the wait).
pub(super) async fn read_ctl<R: AsyncRead + Unpin>(r: &mut R) -> Result<Control> {
    let mut hb = [0u8; HEADER_LEN];
    r.read_exact(&mut hb)
        .await
        .map_err(|e| Error::PeerClosed(format!("control lane closed: {e}")))?;
    let h = FrameHeader::decode(&hb)?;
    if h.kind != FrameKind::Control {
        return Err(Error::Protocol("data frame on the control lane".into()));
    }
    let body = crate::net::framed::read_body(r, h.body_len, FOREVER)
        .await
        .map_err(|e| Error::PeerClosed(format!("control lane closed: {e}")))?;
    Control::decode(&body)
}

/// Writes one control frame within `t`.
pub(super) async fn write_ctl<W: AsyncWrite + Unpin>(
    w: &mut W,
    m: &Control,
    t: Duration,
) -> Result<()> {
    let f = m.to_frame(0)?;
    match tokio::time::timeout(t, async {
        w.write_all(&f).await?;
        w.flush().await
    })
    .await
    {
        Err(_) => Err(Error::Timeout(format!("control lane blocked for {t:?}"))),
        Ok(Err(e)) => Err(Error::PeerClosed(format!("control lane closed: {e}"))),
        Ok(Ok(())) => Ok(()),
    }
}

/// `host:port` (or an IP address and port) to a socket address.
pub(super) async fn resolve_addr(addr: &str) -> Result<SocketAddr> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    let mut it = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Error::io(format!("resolve {addr}"), e))?;
    it.next()
        .ok_or_else(|| Error::InvalidArgument(format!("{addr} resolves to no address")))
}
