//! The client side of the driver: peers (one connection each, a control lane with heartbeats,
//! a pool of data lanes), the request/answer exchanges (describe, release, reject), and the
//! stripe fan-out shared by pulls and pushes.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use super::handles::TransferShared;
use super::lanes::{read_ctl, resolve_addr, write_ctl, CountedLane, LaneCount, LaneGuard};
use super::{lock, Inner};
use crate::error::{Error, ErrorKind, Result};
use crate::net::framed::Framed;
use crate::net::proto::{Backoff, PeerId, StripeJoin, TransferStats};
use crate::net::request::{PullRequest, PushRequest};
use crate::net::signal::Signal;
use crate::net::stream::{recv_stripe, send_stripe, Progress, SpanCursor};
use crate::net::transport::Connection;
use crate::plan::{spans_digest, Placement};
use crate::staging::Staging;
use crate::wire::{self, remote_error, Control, LaneRole, Stripe};

/// A peer this endpoint connected to: its connection, idle data lanes, lane permits and control
/// channel.
pub(super) struct Peer {
    pub(super) id: PeerId,
    pub(super) addr: SocketAddr,
    pub(super) conn: Arc<dyn Connection>,
    /// Idle data lanes, each with when it was given back (one idle past
    /// half of [`crate::net::EndpointOptions::lane_idle_timeout`] is closed instead of reused).
    pub(super) idle: Mutex<Vec<(std::time::Instant, CountedLane)>>,
    pub(super) permits: Arc<Semaphore>,
    pub(super) dead: Signal,
    /// Messages for the control lane's writer (heartbeats, cancellations).
    pub(super) ctl: mpsc::UnboundedSender<Control>,
}

fn stripes_for(total: u64, chunk: u64, max: u32) -> u32 {
    (total.div_ceil(chunk.max(1)).max(1)).min(max as u64) as u32
}

/// Why a stripe failed, and whether its lane stayed in frame sync (see [`StripeJoin`]).
struct StripeError {
    error: Error,
    soft: bool,
}

impl From<Error> for StripeError {
    fn from(error: Error) -> Self {
        StripeError { error, soft: false }
    }
}

type StripeResult = std::result::Result<u64, StripeError>;

/// Joins a transfer's stripe tasks: the first hard failure aborts the rest (see [`StripeJoin`]).
async fn join_stripes(set: &mut JoinSet<StripeResult>) -> Result<u64> {
    let mut join = StripeJoin::default();
    while let Some(r) = set.join_next().await {
        let r = match r {
            Ok(r) => r.map_err(|e| (e.error, e.soft)),
            Err(e) => Err((Error::Cancelled(format!("transfer task ended: {e}")), false)),
        };
        if let Some(e) = join.add(r) {
            set.abort_all();
            return Err(e);
        }
    }
    join.finish()
}

/// Runs the only stripe of a transfer on the driver's own task instead of a task of its own (a
/// spawn and a join cost two thread wake-ups, about 30-40 us on a 2-core VM, of a 16 KiB pull's
/// 200 us): the same outcome as [`join_stripes`] of one task, a panic included.
async fn run_single_stripe(fut: impl std::future::Future<Output = StripeResult>) -> Result<u64> {
    let r = CatchPanic(std::pin::pin!(fut)).await;
    let r = match r {
        Ok(r) => r.map_err(|e| (e.error, e.soft)),
        Err(why) => Err((
            Error::Cancelled(format!("transfer task ended: panicked: {why}")),
            false,
        )),
    };
    let mut join = StripeJoin::default();
    if let Some(e) = join.add(r) {
        return Err(e);
    }
    join.finish()
}

/// A future whose panic becomes `Err(message)`, as a task's panic becomes a `JoinError`.
struct CatchPanic<F>(F);

impl<F: std::future::Future + Unpin> std::future::Future for CatchPanic<F> {
    type Output = std::result::Result<F::Output, String>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            std::pin::Pin::new(inner).poll(cx)
        })) {
            Ok(p) => p.map(Ok),
            Err(e) => std::task::Poll::Ready(Err(e
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| e.downcast_ref::<String>().cloned())
                .unwrap_or_default())),
        }
    }
}

impl Inner {
    /// A peer is gone (its control lane closed, it stayed silent, it moved, or the endpoint
    /// ends): every transfer with it fails (their lanes see `dead`), its lanes close.
    pub(super) fn peer_died(&self, p: &Arc<Peer>, why: String, count: bool) {
        {
            let mut m = lock(&self.peers);
            if let Some(x) = m.get(&p.addr) {
                if Arc::ptr_eq(x, p) {
                    m.remove(&p.addr);
                }
            }
        }
        lock(&self.peer_ids).remove(&p.id);
        lock(&self.proto).peer_gone(p.id);
        if p.dead.is_set() {
            return;
        }
        if count && !self.shutdown.is_set() {
            self.counters.peer_lost();
            // A warning only when a transfer is unfinished on this endpoint (its stripes may have
            // used the peer; endpoint-wide, so conservative). A peer that closes after serving
            // everything (a prefill exiting after the release) is routine: info. Requests on
            // lanes still checked out (a describe or release awaiting its answer) fail with their
            // own error to their caller.
            let lanes_busy = (self.opts.max_lanes_per_peer as usize)
                .saturating_sub(p.permits.available_permits());
            let transfers = lock(&self.transfers).len();
            if transfers == 0 {
                log::info!(
                    "peer {} lost (no transfer in flight, {lanes_busy} lanes in use): {why}",
                    p.addr
                );
            } else {
                log::warn!(
                    "peer {} lost with {transfers} transfers unfinished and {lanes_busy} lanes \
                     in use: {why}",
                    p.addr
                );
            }
        }
        if count {
            let mut lost = lock(&self.lost);
            if lost.len() >= 1024 {
                lost.clear();
            }
            lost.insert(p.addr, why.clone());
        }
        p.dead.fire(why);
        lock(&p.idle).clear();
        p.conn.close();
    }

    /// A failed connection to `sa`: when a peer this endpoint was connected to there died, the
    /// failure says so ([`Error::PeerClosed`] with the death's reason), since that is the cause.
    fn after_loss(&self, sa: SocketAddr, e: Error) -> Error {
        match lock(&self.lost).get(&sa) {
            Some(why) => Error::PeerClosed(format!(
                "peer {sa} was lost ({why}) and cannot be reached again: {e}"
            )),
            None => e,
        }
    }

    /// Tells every connected peer to stop work on `request_id` (`push`: we were pushing it, so
    /// its receivers fail their registrations).
    pub(super) fn send_cancel(&self, request_id: u64, push: bool) {
        for p in lock(&self.peers).values() {
            let _ = p.ctl.send(Control::Cancel { request_id, push });
        }
    }

    fn hello(&self, role: LaneRole) -> Control {
        Control::Hello {
            name: self.opts.name.clone(),
            protocol: wire::PROTOCOL_VERSION,
            incarnation: self.incarnation,
            role,
            unhashed_aead: !self.opts.hash_encrypted_frames,
        }
    }

    /// Opens a lane on `conn` and says hello.
    async fn open_lane(&self, conn: &Arc<dyn Connection>, role: LaneRole) -> Result<CountedLane> {
        let t = self.opts.handshake_timeout;
        let fut = async {
            let lane = conn.open_lane().await?;
            let mut f = Framed::new(lane, self.opts.io_timeout);
            let count = LaneCount::new(&self.counters);
            f.send(&self.hello(role), 0).await?;
            match f.recv_hello(t).await? {
                (
                    _,
                    Control::HelloAck {
                        protocol,
                        unhashed_aead,
                        ..
                    },
                ) if protocol == wire::PROTOCOL_VERSION => {
                    f.agree_hashing(self.opts.hash_encrypted_frames, unhashed_aead);
                    Ok(CountedLane { f, _count: count })
                }
                (_, Control::Failed { message, kind, .. }) => Err(remote_error(kind, &message)),
                (_, m) => Err(Error::Protocol(format!("expected hello-ack, got {m:?}"))),
            }
        };
        match tokio::time::timeout(t + self.opts.connect_timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "opening a lane to {} took longer than {t:?}",
                conn.remote_addr()
            ))),
        }
    }

    /// The live peer at `addr` (a name or `host:port`), connecting if needed.
    pub(super) async fn peer(self: &Arc<Self>, addr: &str) -> Result<Arc<Peer>> {
        if self.shutdown.is_set() {
            return Err(Error::Cancelled("endpoint shut down".into()));
        }
        let named = lock(&self.names).get(addr).copied();
        let sa = match named {
            Some(a) => a,
            None => resolve_addr(addr).await?,
        };
        if let Some(p) = lock(&self.peers).get(&sa) {
            if !p.dead.is_set() {
                return Ok(p.clone());
            }
        }
        let gate = lock(&self.connecting).entry(sa).or_default().clone();
        let r = self.connect_peer(sa, &gate).await;
        // Forget the gate unless another caller is waiting on it (clones are made under the
        // map's lock), so addresses of peers that came and went do not accumulate.
        let mut m = lock(&self.connecting);
        if m.get(&sa).is_some_and(|g| Arc::ptr_eq(g, &gate)) && Arc::strong_count(&gate) == 2 {
            m.remove(&sa);
        }
        r
    }

    /// Connects to `sa` (one caller per address at a time: `gate`) unless a live peer is there.
    async fn connect_peer(
        self: &Arc<Self>,
        sa: SocketAddr,
        gate: &tokio::sync::Mutex<()>,
    ) -> Result<Arc<Peer>> {
        let _g = gate.lock().await;
        if let Some(p) = lock(&self.peers).get(&sa) {
            if !p.dead.is_set() {
                return Ok(p.clone());
            }
        }
        let conn = match self.transport.connect(sa).await {
            Ok(c) => c,
            Err(e) => return Err(self.after_loss(sa, e)),
        };
        let ctl = match self.open_lane(&conn, LaneRole::Control).await {
            Ok(l) => l,
            Err(e) => {
                conn.close();
                return Err(self.after_loss(sa, e));
            }
        };
        lock(&self.lost).remove(&sa);
        let (tx, rx) = mpsc::unbounded_channel();
        let id = lock(&self.proto).peer_connected(Instant::now());
        let peer = Arc::new(Peer {
            id,
            addr: sa,
            conn,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(self.opts.max_lanes_per_peer as usize)),
            dead: Signal::default(),
            ctl: tx,
        });
        lock(&self.peers).insert(sa, peer.clone());
        crate::metrics::peer_connected();
        lock(&self.peer_ids).insert(id, peer.clone());
        let me = self.clone();
        let p = peer.clone();
        self.spawn(async move { me.client_control(p, ctl, rx).await });
        Ok(peer)
    }

    /// Client side of a control lane: heartbeats (scheduled by the state machine) and
    /// cancellations out, answers in (each one tells the state machine the peer is alive);
    /// death on close, or when the state machine declares the silent peer dead.
    async fn client_control(
        self: Arc<Self>,
        peer: Arc<Peer>,
        lane: CountedLane,
        mut rx: mpsc::UnboundedReceiver<Control>,
    ) {
        let CountedLane { f, _count } = lane;
        let (mut r, mut w) = tokio::io::split(f.into_lane());
        let o = &self.opts;
        let mute = o.faults.mute_heartbeats;
        let reader = async {
            loop {
                let m = match read_ctl(&mut r).await {
                    Err(e) => return format!("{e}"),
                    Ok(m) => m,
                };
                lock(&self.proto).handle_peer_heard(Instant::now(), peer.id);
                match m {
                    Control::Pong { seq } => log::trace!("pong {seq} from {}", peer.addr),
                    m => log::debug!("control message from {}: {m:?}", peer.addr),
                }
            }
        };
        let writer = async {
            loop {
                let msg = match rx.recv().await {
                    Some(m) => m,
                    None => return "closed".to_string(),
                };
                if mute && matches!(msg, Control::Ping { .. }) {
                    continue;
                }
                if let Err(e) = write_ctl(&mut w, &msg, o.io_timeout).await {
                    return format!("{e}");
                }
            }
        };
        let why = tokio::select! {
            w = reader => w,
            w = writer => w,
            _ = peer.dead.wait() => peer.dead.reason(),
            _ = self.shutdown.wait() => "endpoint shut down".to_string(),
        };
        self.peer_died(&peer, why, true);
    }

    pub(super) async fn checkout(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<LaneGuard> {
        let permit = tokio::select! {
            p = peer.permits.clone().acquire_owned() => p.map_err(|_| Error::PeerClosed("peer closed".into()))?,
            _ = peer.dead.wait() => return Err(Error::PeerClosed(format!("peer {}: {}", peer.addr, peer.dead.reason()))),
        };
        let pooled = {
            let mut idle = lock(&peer.idle);
            // The server closes lanes idle for its lane_idle_timeout; ours go after half of it
            // (the same option), so a pooled lane is never one the server is closing.
            let keep = self.opts.lane_idle_timeout / 2;
            idle.retain(|(since, _)| since.elapsed() < keep);
            idle.pop().map(|(_, l)| l)
        };
        if let Some(f) = pooled {
            return Ok(LaneGuard {
                f: f.f,
                _count: f._count,
                _permit: permit,
            });
        }
        let l = tokio::select! {
            l = self.open_lane(&peer.conn, LaneRole::Data) => l?,
            _ = peer.dead.wait() => return Err(Error::PeerClosed(format!("peer {}: {}", peer.addr, peer.dead.reason()))),
        };
        Ok(LaneGuard {
            f: l.f,
            _count: l._count,
            _permit: permit,
        })
    }

    pub(super) fn give_back(&self, peer: &Arc<Peer>, g: LaneGuard) {
        if peer.dead.is_set() || self.shutdown.is_set() {
            return;
        }
        lock(&peer.idle).push((
            std::time::Instant::now(),
            CountedLane {
                f: g.f,
                _count: g._count,
            },
        ));
    }

    /// One request/answer exchange on a data lane to `addr`; a [`Control::Failed`] answer is the
    /// peer's error with its kind.
    pub(super) async fn exchange(
        self: &Arc<Self>,
        addr: &str,
        m: &Control,
        request_id: u64,
    ) -> Result<Control> {
        let peer = self.peer(addr).await?;
        let mut lane = self.checkout(&peer).await?;
        lane.f.send(m, request_id).await?;
        let (_, answer) = lane.f.recv(self.opts.io_timeout).await?;
        self.give_back(&peer, lane);
        match answer {
            Control::Failed { message, kind, .. } => Err(remote_error(kind, &message)),
            a => Ok(a),
        }
    }

    pub(super) async fn describe(
        self: &Arc<Self>,
        addr: &str,
        request_id: u64,
        sink: bool,
    ) -> Result<(Placement, u32)> {
        let m = Control::Describe { request_id, sink };
        match self.exchange(addr, &m, request_id).await? {
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

    /// Runs `fut` unless the transfer is cancelled or the peer dies first.
    async fn guarded<T>(
        t: &TransferShared,
        peer: &Peer,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let died = || Error::PeerClosed(format!("peer {} died: {}", peer.addr, peer.dead.reason()));
        tokio::select! {
            r = fut => match r {
                // Closing the connection of a dead peer also fails its lanes: report the cause.
                Err(e) if peer.dead.is_set() && !matches!(e, Error::Checksum(_)) => {
                    log::debug!("{e} (peer dead)");
                    Err(died())
                }
                r => r,
            },
            _ = t.cancel.wait() => Err(Error::Cancelled(format!("request {} cancelled", t.request_id))),
            _ = peer.dead.wait() => Err(died()),
        }
    }

    /// The stripe fan-out shared by pulls and pushes: spawns every stripe of every pair (each
    /// on a lane checked out of its peer's pool, guarded by the transfer's cancellation and the
    /// peer's death) and joins them. `addr_of(src, dst)` names the peer of a pair; `exchange`
    /// runs the per-stripe protocol (pull: ask, receive; push: offer, send, acknowledge) on the
    /// lane and gives the lane back when it stays in sync. Returns the bytes moved.
    async fn fan_out<F, Fut>(
        self: &Arc<Self>,
        t: &Arc<TransferShared>,
        pairs: &[(u32, u32, Arc<SpanCursor>)],
        addr_of: impl Fn(u32, u32) -> Result<String>,
        exchange: F,
    ) -> Result<FanOut>
    where
        F: Fn(StripeCtx) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = StripeResult> + Send + 'static,
    {
        let exchange = Arc::new(exchange);
        let mut runs = Vec::new();
        let mut stripes = 0u64;
        let spans: u64 = pairs.iter().map(|p| p.2.spans().len() as u64).sum();
        for (pair, (s, d, cursor)) in pairs.iter().enumerate() {
            let total = cursor.total();
            let count = stripes_for(total, self.opts.chunk_bytes, self.opts.streams_per_pair);
            let digest = spans_digest(cursor.spans());
            let addr = addr_of(*s, *d)?;
            for index in 0..count {
                stripes += 1;
                let job = StripeJob {
                    pair,
                    src: *s,
                    dst: *d,
                    cursor: cursor.clone(),
                    digest,
                    total,
                    stripe: Stripe {
                        index,
                        count,
                        chunk_bytes: self.opts.chunk_bytes,
                    },
                };
                let (me, t, addr, exchange) =
                    (self.clone(), t.clone(), addr.clone(), exchange.clone());
                let span = tracing::info_span!(
                    "network",
                    request_id = t.request_id,
                    src_rank = *s,
                    dst_rank = *d,
                    stripe = index
                );
                runs.push(tracing::Instrument::instrument(
                    async move {
                        let peer = me.peer(&addr).await?;
                        let lane = Self::guarded(&t, &peer, me.checkout(&peer)).await?;
                        exchange(StripeCtx {
                            me,
                            t,
                            peer,
                            lane,
                            job,
                        })
                        .await
                    },
                    span,
                ));
            }
        }
        let bytes = if runs.len() == 1 {
            run_single_stripe(runs.remove(0)).await?
        } else {
            let mut set: JoinSet<StripeResult> = JoinSet::new();
            for r in runs {
                set.spawn(r);
            }
            join_stripes(&mut set).await?
        };
        Ok(FanOut {
            bytes,
            spans,
            stripes,
        })
    }

    pub(super) async fn drive_pull(
        self: &Arc<Self>,
        t: &Arc<TransferShared>,
        req: PullRequest,
        pairs: Vec<(u32, u32, Arc<SpanCursor>)>,
        progress: Arc<Progress>,
    ) -> Result<TransferStats> {
        let wait_until = req.wait_for_registration.map(|w| t.started + w);
        let (rid, dst, staging) = (req.request_id, req.dst.clone(), req.staging.clone());
        let sources = req.sources.clone();
        let r = self
            .fan_out(
                t,
                &pairs,
                |s, _| Ok(sources.get(s)?.to_string()),
                move |c| {
                    pull_stripe(
                        c,
                        rid,
                        dst.clone(),
                        staging.clone(),
                        progress.clone(),
                        wait_until,
                    )
                },
            )
            .await?;
        Ok(r.stats(pairs.len(), t))
    }

    pub(super) async fn drive_push(
        self: &Arc<Self>,
        t: &Arc<TransferShared>,
        req: PushRequest,
        src_ranks: Vec<u32>,
        pairs: Vec<(u32, u32, Arc<SpanCursor>)>,
        targets: Vec<String>,
    ) -> Result<TransferStats> {
        let (rid, n_tok, src, staging) = (
            req.request_id,
            req.num_tokens,
            req.src.clone(),
            req.staging.clone(),
        );
        let dests = req.targets.clone();
        let r = self
            .fan_out(
                t,
                &pairs,
                |_, d| Ok(dests.get(d)?.to_string()),
                move |c| push_stripe(c, rid, n_tok, src.clone(), staging.clone()),
            )
            .await?;
        // Every destination endpoint learns that our ranks are finished (also those that got
        // no bytes from us), all at once: one round trip, not one per destination.
        let msg = Control::PushFinish {
            request_id: req.request_id,
            src_ranks,
            src: req.src.clone(),
            num_tokens: req.num_tokens,
        };
        let finish = |addr: String| {
            let msg = &msg;
            async move {
                let peer = self.peer(&addr).await?;
                let mut lane = Self::guarded(t, &peer, self.checkout(&peer)).await?;
                Self::guarded(t, &peer, lane.f.send(msg, req.request_id)).await?;
                match Self::guarded(t, &peer, lane.f.recv(self.opts.io_timeout)).await? {
                    (_, Control::Finished { .. }) => {
                        self.give_back(&peer, lane);
                        Ok(())
                    }
                    (_, Control::Failed { message, kind, .. }) => {
                        self.give_back(&peer, lane);
                        Err(remote_error(kind, &message))
                    }
                    (_, m) => Err(Error::Protocol(format!("expected finished, got {m:?}"))),
                }
            }
        };
        for finished in futures_util::future::join_all(targets.into_iter().map(finish)).await {
            finished?;
        }
        Ok(r.stats(pairs.len(), t))
    }
}

/// One stripe of one pair, as [`Inner::fan_out`] hands it to an exchange.
struct StripeJob {
    /// Index of the pair in the transfer (for [`Progress`]).
    pair: usize,
    src: u32,
    dst: u32,
    cursor: Arc<SpanCursor>,
    /// [`spans_digest`] of the pair's spans.
    digest: u64,
    /// Bytes of the pair's stream.
    total: u64,
    stripe: Stripe,
}

/// What a stripe exchange runs with: the endpoint, the transfer, the peer and a lane of its pool.
struct StripeCtx {
    me: Arc<Inner>,
    t: Arc<TransferShared>,
    peer: Arc<Peer>,
    lane: LaneGuard,
    job: StripeJob,
}

/// What a fan-out moved.
struct FanOut {
    bytes: u64,
    spans: u64,
    stripes: u64,
}

impl FanOut {
    fn stats(&self, pairs: usize, t: &TransferShared) -> TransferStats {
        TransferStats {
            bytes: self.bytes,
            spans: self.spans,
            pairs: pairs as u64,
            stripes: self.stripes,
            elapsed: t.started.elapsed(),
        }
    }
}

/// The pull exchange of one stripe: `Pull` -> data frames -> `StreamDone` (or `Failed`; an
/// "unknown request" is asked again until `wait_until`).
async fn pull_stripe(
    c: StripeCtx,
    rid: u64,
    dst: Placement,
    staging: Arc<Staging>,
    progress: Arc<Progress>,
    wait_until: Option<Instant>,
) -> StripeResult {
    let StripeCtx {
        me,
        t,
        peer,
        mut lane,
        job,
    } = c;
    let msg = Control::Pull {
        request_id: rid,
        src_rank: job.src,
        dst_rank: job.dst,
        dst,
        digest: job.digest,
        total_bytes: job.total,
        stripe: job.stripe,
        attempt: t.id.0,
    };
    let mut backoff = Backoff::new(wait_until);
    loop {
        Inner::guarded(&t, &peer, lane.f.send(&msg, rid)).await?;
        let r = Inner::guarded(&t, &peer, async {
            Ok(recv_stripe(
                &mut lane.f,
                rid,
                &staging,
                job.dst,
                &job.cursor,
                job.stripe,
                &progress,
                job.pair,
                &me.counters,
            )
            .await)
        })
        .await?;
        let f = match r {
            Ok(n) => {
                t.bytes.fetch_add(n, Ordering::Relaxed);
                me.give_back(&peer, lane);
                return Ok(n);
            }
            Err(f) => f,
        };
        // Not registered there yet: ask again on the same lane (it is in sync).
        if f.lane_ok && f.error.kind() == ErrorKind::UnknownRequest {
            if let Some(d) = backoff.retry(Instant::now()) {
                Inner::guarded(&t, &peer, async {
                    tokio::time::sleep(d).await;
                    Ok(())
                })
                .await?;
                continue;
            }
        }
        if f.lane_ok {
            me.give_back(&peer, lane);
        }
        if peer.dead.is_set() && f.error.kind() != ErrorKind::Checksum {
            return Err(Error::PeerClosed(format!(
                "peer {} died: {}",
                peer.addr,
                peer.dead.reason()
            ))
            .into());
        }
        return Err(StripeError {
            error: f.error,
            soft: f.lane_ok,
        });
    }
}

/// The push exchange of one stripe: `Push` -> `Ready` (or `Failed`) -> data frames ->
/// `StreamDone` -> `StreamAck` (or `Failed`).
async fn push_stripe(
    c: StripeCtx,
    rid: u64,
    num_tokens: u32,
    src: Placement,
    staging: Arc<Staging>,
) -> StripeResult {
    let StripeCtx {
        me,
        t,
        peer,
        mut lane,
        job,
    } = c;
    let msg = Control::Push {
        request_id: rid,
        src_rank: job.src,
        dst_rank: job.dst,
        src,
        num_tokens,
        digest: job.digest,
        total_bytes: job.total,
        stripe: job.stripe,
    };
    let io = me.opts.io_timeout;
    Inner::guarded(&t, &peer, lane.f.send(&msg, rid)).await?;
    match Inner::guarded(&t, &peer, lane.f.recv(io)).await? {
        (_, Control::Ready { .. }) => {}
        (_, Control::Failed { message, kind, .. }) => {
            me.give_back(&peer, lane);
            return Err(StripeError {
                error: remote_error(kind, &message),
                soft: true,
            });
        }
        (_, m) => return Err(Error::Protocol(format!("expected ready, got {m:?}")).into()),
    }
    let gate = t.gate.as_ref().map(|g| g.subscribe());
    // Same host: the receiver copies out of this staging after our writes; it stays mapped
    // until the receiver answered (or, if this exchange is abandoned, saw the lane close).
    lane.f.hold_refs(staging.clone());
    let n = Inner::guarded(
        &t,
        &peer,
        send_stripe(
            &mut lane.f,
            rid,
            &staging,
            job.src,
            &job.cursor,
            job.stripe,
            gate,
            &me.counters,
            &me.opts.faults,
        ),
    )
    .await?;
    match Inner::guarded(&t, &peer, lane.f.recv(io)).await? {
        (_, Control::StreamAck { bytes, .. }) if bytes == n => {
            lane.f.release_refs();
            t.bytes.fetch_add(n, Ordering::Relaxed);
            me.give_back(&peer, lane);
            Ok(n)
        }
        (_, Control::Failed { message, kind, .. }) => {
            lane.f.release_refs();
            me.give_back(&peer, lane);
            Err(StripeError {
                error: remote_error(kind, &message),
                soft: true,
            })
        }
        (_, m) => Err(Error::Protocol(format!("expected stream-ack, got {m:?}")).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-stripe transfer's stripe runs inline: its bytes, its error and its panic come out
    /// as they would from a stripe task joined by `join_stripes`.
    #[test]
    fn a_single_stripe_run_inline_reports_bytes_errors_and_panics() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            assert_eq!(
                run_single_stripe(async { Ok(12_345) }).await.unwrap(),
                12_345
            );
            let e = run_single_stripe(async {
                Err(StripeError {
                    error: Error::Checksum("stripe 0".into()),
                    soft: true,
                })
            })
            .await
            .unwrap_err();
            assert!(
                matches!(e, Error::Checksum(ref m) if m == "stripe 0"),
                "{e}"
            );
            let e = run_single_stripe(async {
                if std::hint::black_box(true) {
                    panic!("stripe exploded");
                }
                Ok(1)
            })
            .await
            .unwrap_err();
            assert!(
                matches!(e, Error::Cancelled(ref m) if m.contains("panicked: stripe exploded")),
                "{e}"
            );
        });
    }
}
