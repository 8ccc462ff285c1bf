//! A fault-injecting decorator over `tpu_sync::net::transport::Transport`, for tests only (this
//! file is compiled into test binaries and fuzz targets, never into the library).
//!
//! [`FaultTransport`] wraps a real transport (plain TCP, TLS or QUIC). Every lane it opens or
//! accepts is a [`FaultLane`] that parses the frames passing through it, in both directions, and
//! applies the first matching [`Rule`] of its [`Faults`]:
//!
//! | action | effect |
//! |---|---|
//! | [`Action::Fail`] | the operation fails with an I/O error: a write (a failed submit), a lane open, a connect, an accept |
//! | [`Action::Corrupt`] | one byte of the frame's payload (data) or body (control) is flipped |
//! | [`Action::Truncate`] | half of the frame is delivered, then the lane closes |
//! | [`Action::DropLane`] | the lane closes before the frame |
//! | [`Action::DropConnection`] | every lane of the connection closes (client side: the [`Connection`]; server side: every accepted lane) |
//! | [`Action::Delay`] | the frame is held back for the duration |
//! | [`Action::Stall`] | the frame and everything after it on that lane never arrive; the lane stays open |
//! | [`Action::ReplaceWithFailed`] | a control frame becomes `Failed` for its request (a completed exchange turned into a failed one) |
//! | [`Action::Kill`] | an endpoint dies: every lane of its transport closes at once, its listener drops new lanes, its connects fail |
//! | [`Action::Call`] | a callback runs (e.g. to drop an endpoint at this point), the frame passes |
//!
//! Rules are deterministic: a rule matches a [`Point`] (frame kind, control message type, request
//! id), lets `skip` matches pass, then fires `times` times. [`Faults::fired`] says what fired, so a
//! test can assert its fault really happened.
//!
//! Frames are forwarded whole (store and forward), so a lane's bytes are delayed by at most one
//! frame; the vectored-read flag of the wrapped lane is kept, so plain TCP still takes the
//! `readv`-into-staging path of the endpoint.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tpu_sync::net::transport::{
    Acceptor, BoxFut, Connection, Lane, PeerInfo, ShmPeer, Transport, TransportKind,
    TransportTimeouts,
};
use tpu_sync::net::{Endpoint, EndpointOptions, Security};
use tpu_sync::wire::{Control, FrameHeader, FrameKind, DATA_HEADER_LEN, HEADER_LEN};
use tpu_sync::{Error, Result};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which frames a rule applies to. `None` fields match anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrameSel {
    /// `Some(true)`: data frames only; `Some(false)`: control frames only.
    pub data: Option<bool>,
    /// Control message type as on the wire (`hello`, `hello_ack`, `pull`, `push`, `ready`,
    /// `stream_done`, `stream_ack`, `push_finish`, `finished`, `describe`, `release`, `ping`, ...).
    pub msg: Option<&'static str>,
    /// The frame header's request id.
    pub request_id: Option<u64>,
}

impl FrameSel {
    /// Data frames of `request_id`.
    pub fn data(request_id: u64) -> FrameSel {
        FrameSel {
            data: Some(true),
            msg: None,
            request_id: Some(request_id),
        }
    }

    /// Control messages of type `msg` (any request).
    pub fn msg(msg: &'static str) -> FrameSel {
        FrameSel {
            data: Some(false),
            msg: Some(msg),
            request_id: None,
        }
    }

    /// Control messages of type `msg` for `request_id`.
    pub fn msg_of(msg: &'static str, request_id: u64) -> FrameSel {
        FrameSel {
            data: Some(false),
            msg: Some(msg),
            request_id: Some(request_id),
        }
    }

    fn matches(&self, f: &FrameInfo) -> bool {
        self.data.is_none_or(|d| d == f.data)
            && self.request_id.is_none_or(|r| r == f.request_id)
            && self.msg.is_none_or(|m| f.msg.as_deref() == Some(m))
    }
}

/// Where a rule applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Point {
    /// A frame arriving at this endpoint.
    Recv(FrameSel),
    /// A frame this endpoint sends.
    Send(FrameSel),
    /// `Connection::open_lane` (client side, before any byte of the lane).
    OpenLane,
    /// `Transport::connect`.
    Connect,
    /// A lane handed out by the listener (before its hello).
    Accept,
}

/// What a rule does when it fires.
#[derive(Clone)]
pub enum Action {
    /// The operation fails with an I/O error (and a write failure breaks the lane).
    Fail,
    /// One byte of the payload (data frames) or body (control frames) is flipped.
    Corrupt,
    /// Half of the frame is delivered, then the lane closes.
    Truncate,
    /// The lane closes before the frame.
    DropLane,
    /// Every lane of the connection closes (client side: the connection the lane belongs to;
    /// server side: every accepted lane of this transport).
    DropConnection,
    /// The frame is held back this long.
    Delay(Duration),
    /// The frame and everything after it on this lane never arrive; the lane stays open.
    Stall,
    /// A control frame is replaced by `Failed` for its request.
    ReplaceWithFailed,
    /// The endpoint owning these faults dies (see [`Faults::kill`]).
    Kill(Weak<Faults>),
    /// Runs the callback, then the frame passes.
    Call(Arc<dyn Fn() + Send + Sync>),
}

impl Action {
    /// Kills the endpoint whose transport carries `f`.
    pub fn kill(f: &Arc<Faults>) -> Action {
        Action::Kill(Arc::downgrade(f))
    }

    fn name(&self) -> &'static str {
        match self {
            Action::Fail => "fail",
            Action::Corrupt => "corrupt",
            Action::Truncate => "truncate",
            Action::DropLane => "drop-lane",
            Action::DropConnection => "drop-connection",
            Action::Delay(_) => "delay",
            Action::Stall => "stall",
            Action::ReplaceWithFailed => "replace-with-failed",
            Action::Kill(_) => "kill",
            Action::Call(_) => "call",
        }
    }
}

/// One deterministic fault: at `point`, after `skip` matches, `times` times (`None`: always).
#[derive(Clone)]
pub struct Rule {
    /// Where.
    pub point: Point,
    /// Matches let through before the rule fires.
    pub skip: u64,
    /// How often it fires (`None`: every match after `skip`).
    pub times: Option<u64>,
    /// What it does.
    pub action: Action,
}

impl Rule {
    /// Fires once, at the first match.
    pub fn once(point: Point, action: Action) -> Rule {
        Rule {
            point,
            skip: 0,
            times: Some(1),
            action,
        }
    }

    /// Fires once, at match number `skip + 1`.
    pub fn nth(point: Point, skip: u64, action: Action) -> Rule {
        Rule {
            point,
            skip,
            times: Some(1),
            action,
        }
    }
}

struct RuleState {
    rule: Rule,
    seen: u64,
    fired: u64,
}

/// What one frame is, for matching.
#[derive(Debug, Clone)]
pub struct FrameInfo {
    /// Data frame (else control).
    pub data: bool,
    /// Header request id.
    pub request_id: u64,
    /// Control message type.
    pub msg: Option<String>,
}

/// The shared controller of a [`FaultTransport`]: its rules, what fired, and every lane it made
/// (so a kill can close them all, and a test can count the ones still alive).
#[derive(Default)]
pub struct Faults {
    rules: Mutex<Vec<RuleState>>,
    fired: Mutex<Vec<String>>,
    killed: AtomicBool,
    lanes: Mutex<Vec<Weak<LaneShared>>>,
    conns: Mutex<Vec<Weak<ConnShared>>>,
    opened: AtomicU64,
    frames_seen: AtomicU64,
}

impl Faults {
    /// A controller without rules.
    pub fn new() -> Arc<Faults> {
        Arc::new(Faults::default())
    }

    /// Adds a rule (after the existing ones; the first matching rule wins).
    pub fn add(&self, rule: Rule) -> &Self {
        lock(&self.rules).push(RuleState {
            rule,
            seen: 0,
            fired: 0,
        });
        self
    }

    /// Removes every rule.
    pub fn clear(&self) {
        lock(&self.rules).clear();
    }

    /// Descriptions of the faults that fired so far (`action at point`).
    pub fn fired(&self) -> Vec<String> {
        lock(&self.fired).clone()
    }

    /// Whether the endpoint was killed.
    pub fn is_killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    /// Lanes of this transport that still hold an open inner lane (0 after every endpoint
    /// using the transport is gone: no lane leaked).
    pub fn live_lanes(&self) -> usize {
        let mut v = lock(&self.lanes);
        v.retain(|w| w.strong_count() > 0);
        v.iter()
            .filter_map(Weak::upgrade)
            .filter(|l| lock(&l.inner).is_some())
            .count()
    }

    /// Lanes opened or accepted so far.
    pub fn lanes_made(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Frames that passed through the lanes of this transport so far (both directions).
    pub fn frames_seen(&self) -> u64 {
        self.frames_seen.load(Ordering::Relaxed)
    }

    /// The endpoint dies as a crashed process would look from the network: every lane closes at
    /// once (sockets closed, QUIC streams reset, connections closed), the listener drops every
    /// new lane, connects fail. The `Endpoint` object itself stays (drop it too for a full kill).
    pub fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        let lanes: Vec<_> = lock(&self.lanes).iter().filter_map(Weak::upgrade).collect();
        for l in lanes {
            l.close();
        }
        let conns: Vec<_> = lock(&self.conns).iter().filter_map(Weak::upgrade).collect();
        for c in conns {
            c.inner.close();
        }
    }

    fn record(&self, what: String) {
        lock(&self.fired).push(what);
    }

    /// The action of the first rule whose point matches and that is due, if any.
    fn decide(&self, p: &Point, frame: Option<&FrameInfo>) -> Option<Action> {
        let mut rules = lock(&self.rules);
        for r in rules.iter_mut() {
            let hit = match (&r.rule.point, p, frame) {
                (Point::Recv(sel), Point::Recv(_), Some(f)) => sel.matches(f),
                (Point::Send(sel), Point::Send(_), Some(f)) => sel.matches(f),
                (a, b, None) => a == b,
                _ => false,
            };
            if !hit {
                continue;
            }
            r.seen += 1;
            if r.seen <= r.rule.skip || r.rule.times.is_some_and(|t| r.fired >= t) {
                continue;
            }
            r.fired += 1;
            let a = r.rule.action.clone();
            drop(rules);
            let at = match (p, frame) {
                (Point::Recv(_), Some(f)) => format!("recv {f:?}"),
                (Point::Send(_), Some(f)) => format!("send {f:?}"),
                (p, _) => format!("{p:?}"),
            };
            self.record(format!("{} at {at}", a.name()));
            return Some(a);
        }
        None
    }

    fn register(&self, l: &Arc<LaneShared>) {
        self.opened.fetch_add(1, Ordering::Relaxed);
        let mut v = lock(&self.lanes);
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(l));
    }

    fn close_accepted(&self) {
        let lanes: Vec<_> = lock(&self.lanes).iter().filter_map(Weak::upgrade).collect();
        for l in lanes.into_iter().filter(|l| l.accepted) {
            l.close();
        }
    }
}

fn injected(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        format!("injected fault: {what}"),
    )
}

// ---------------------------------------------------------------------------------------------
// Transport, connection, acceptor
// ---------------------------------------------------------------------------------------------

/// A transport whose lanes inject the faults of a [`Faults`] controller.
pub struct FaultTransport {
    inner: Arc<dyn Transport>,
    faults: Arc<Faults>,
}

impl FaultTransport {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Transport>, faults: Arc<Faults>) -> FaultTransport {
        FaultTransport { inner, faults }
    }
}

/// The built-in transport `opts` asks for, as `Endpoint::bind` would make it.
pub fn real_transport(opts: &EndpointOptions) -> Arc<dyn Transport> {
    let t = TransportTimeouts {
        connect: opts.connect_timeout,
        handshake: opts.handshake_timeout,
    };
    match opts.transport {
        TransportKind::Tcp => Arc::new(tpu_sync::net::tcp::TcpTransport::plain(t)),
        TransportKind::Tls => {
            Arc::new(tpu_sync::net::tcp::TcpTransport::tls(opts.security.clone(), t).unwrap())
        }
        TransportKind::Quic => Arc::new(
            tpu_sync::net::quic::QuicTransport::new(
                opts.security.clone(),
                t,
                opts.quic_connections_per_peer,
            )
            .unwrap(),
        ),
        TransportKind::Shm => Arc::new(tpu_sync::net::shm::ShmTransport::new(t)),
    }
}

/// An endpoint on a fault-injecting wrapper of the transport `opts` asks for.
pub async fn fault_endpoint(opts: EndpointOptions) -> (Endpoint, Arc<Faults>) {
    let faults = Faults::new();
    let t = Arc::new(FaultTransport::new(real_transport(&opts), faults.clone()));
    let ep = Endpoint::with_transport(opts, t).await.unwrap();
    (ep, faults)
}

impl Transport for FaultTransport {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn listen(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Acceptor>>> {
        Box::pin(async move {
            let inner = self.inner.listen(addr).await?;
            Ok(Arc::new(FaultAcceptor {
                inner,
                faults: self.faults.clone(),
            }) as Arc<dyn Acceptor>)
        })
    }

    fn connect(&self, addr: SocketAddr) -> BoxFut<'_, Result<Arc<dyn Connection>>> {
        Box::pin(async move {
            if self.faults.is_killed() {
                return Err(Error::PeerClosed("injected fault: endpoint killed".into()));
            }
            match self.faults.decide(&Point::Connect, None) {
                Some(Action::Fail) => {
                    return Err(Error::io(format!("connect to {addr}"), injected("connect")))
                }
                Some(Action::Delay(d)) => tokio::time::sleep(d).await,
                Some(Action::Kill(f)) => {
                    if let Some(f) = f.upgrade() {
                        f.kill();
                    }
                }
                Some(Action::Call(c)) => c(),
                _ => {}
            }
            let inner = self.inner.connect(addr).await?;
            let c = Arc::new(ConnShared {
                inner,
                lanes: Mutex::new(Vec::new()),
            });
            lock(&self.faults.conns).push(Arc::downgrade(&c));
            Ok(Arc::new(FaultConnection {
                c,
                faults: self.faults.clone(),
            }) as Arc<dyn Connection>)
        })
    }
}

struct ConnShared {
    inner: Arc<dyn Connection>,
    lanes: Mutex<Vec<Weak<LaneShared>>>,
}

impl ConnShared {
    fn drop_all(&self) {
        let lanes: Vec<_> = lock(&self.lanes).iter().filter_map(Weak::upgrade).collect();
        for l in lanes {
            l.close();
        }
        self.inner.close();
    }
}

struct FaultConnection {
    c: Arc<ConnShared>,
    faults: Arc<Faults>,
}

impl Connection for FaultConnection {
    fn open_lane(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(async move {
            if self.faults.is_killed() {
                return Err(Error::PeerClosed("injected fault: endpoint killed".into()));
            }
            match self.faults.decide(&Point::OpenLane, None) {
                Some(Action::Fail) => {
                    return Err(Error::io("open a lane", injected("open lane")));
                }
                Some(Action::Delay(d)) => tokio::time::sleep(d).await,
                Some(Action::DropConnection) => {
                    self.c.drop_all();
                    return Err(Error::PeerClosed(
                        "injected fault: connection dropped".into(),
                    ));
                }
                Some(Action::Kill(f)) => {
                    if let Some(f) = f.upgrade() {
                        f.kill();
                    }
                }
                Some(Action::Call(c)) => c(),
                _ => {}
            }
            let lane = self.c.inner.open_lane().await?;
            let l = FaultLane::new(lane, &self.faults, Some(Arc::downgrade(&self.c)), false);
            lock(&self.c.lanes).push(Arc::downgrade(&l.sh));
            Ok(Box::new(l) as Box<dyn Lane>)
        })
    }

    fn remote_addr(&self) -> SocketAddr {
        self.c.inner.remote_addr()
    }

    fn close(&self) {
        self.c.inner.close();
    }
}

struct FaultAcceptor {
    inner: Arc<dyn Acceptor>,
    faults: Arc<Faults>,
}

impl Acceptor for FaultAcceptor {
    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    fn accept(&self) -> BoxFut<'_, Result<Box<dyn Lane>>> {
        Box::pin(async move {
            loop {
                let lane = self.inner.accept().await?;
                if self.faults.is_killed() {
                    drop(lane);
                    continue;
                }
                match self.faults.decide(&Point::Accept, None) {
                    Some(Action::Fail) | Some(Action::DropLane) => {
                        drop(lane);
                        continue;
                    }
                    Some(Action::Kill(f)) => {
                        if let Some(f) = f.upgrade() {
                            f.kill();
                        }
                        drop(lane);
                        continue;
                    }
                    Some(Action::Call(c)) => c(),
                    _ => {}
                }
                let l = FaultLane::new(lane, &self.faults, None, true);
                return Ok(Box::new(l) as Box<dyn Lane>);
            }
        })
    }

    fn handshake_failures(&self) -> u64 {
        self.inner.handshake_failures()
    }
}

// ---------------------------------------------------------------------------------------------
// Lanes
// ---------------------------------------------------------------------------------------------

/// The part of a lane the controller can reach: the inner lane (taken and dropped to close it)
/// and the wakers of its pending reads and writes.
pub struct LaneShared {
    inner: Mutex<Option<Box<dyn Lane>>>,
    wakers: Mutex<[Option<Waker>; 2]>,
    accepted: bool,
}

impl LaneShared {
    fn close(&self) {
        let l = lock(&self.inner).take();
        drop(l);
        let w = std::mem::take(&mut *lock(&self.wakers));
        for w in w.into_iter().flatten() {
            w.wake();
        }
    }

    fn park(&self, which: usize, cx: &Context<'_>) {
        lock(&self.wakers)[which] = Some(cx.waker().clone());
    }
}

/// One complete frame (or unparseable bytes) passing through a lane.
enum Piece {
    Frame(Vec<u8>, FrameInfo),
    Raw(Vec<u8>),
}

/// Cuts the next piece off `buf`: a whole frame once all its bytes are there, or everything when
/// the bytes are not a frame header (garbage passes unchanged).
fn next_piece(buf: &mut Vec<u8>, eof: bool) -> Option<Piece> {
    if buf.len() < HEADER_LEN {
        return (eof && !buf.is_empty()).then(|| Piece::Raw(std::mem::take(buf)));
    }
    let h = match FrameHeader::decode(&buf[..HEADER_LEN]) {
        Ok(h) => h,
        Err(_) => return Some(Piece::Raw(std::mem::take(buf))),
    };
    let total = HEADER_LEN + h.body_len as usize;
    if buf.len() < total {
        return (eof).then(|| Piece::Raw(std::mem::take(buf)));
    }
    let rest = buf.split_off(total);
    let frame = std::mem::replace(buf, rest);
    let data = h.kind != FrameKind::Control;
    let msg = (!data)
        .then(|| {
            serde_json::from_slice::<serde_json::Value>(&frame[HEADER_LEN..])
                .ok()
                .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_string))
        })
        .flatten();
    Some(Piece::Frame(
        frame,
        FrameInfo {
            data,
            request_id: h.request_id,
            msg,
        },
    ))
}

fn corrupt(frame: &mut [u8], info: &FrameInfo) {
    let at = if info.data && frame.len() > HEADER_LEN + DATA_HEADER_LEN {
        HEADER_LEN + DATA_HEADER_LEN + (frame.len() - HEADER_LEN - DATA_HEADER_LEN) / 2
    } else {
        HEADER_LEN + (frame.len() - HEADER_LEN) / 2
    };
    if let Some(b) = frame.get_mut(at) {
        *b ^= 0x5a;
    }
}

fn failed_frame(info: &FrameInfo) -> Vec<u8> {
    Control::Failed {
        request_id: info.request_id,
        message: "injected fault: the exchange was turned into a failure".into(),
        kind: None,
    }
    .to_frame(info.request_id)
    .unwrap()
}

/// What the transformation of one frame asks of its lane.
#[derive(Default)]
struct Outcome {
    bytes: Vec<u8>,
    close_after: bool,
    stall: bool,
    delay: Option<Duration>,
    fail: bool,
}

fn apply(faults: &Faults, conn: &Option<Weak<ConnShared>>, p: Point, piece: Piece) -> Outcome {
    let (mut frame, info) = match piece {
        Piece::Raw(b) => {
            return Outcome {
                bytes: b,
                ..Default::default()
            }
        }
        Piece::Frame(f, i) => (f, i),
    };
    faults.frames_seen.fetch_add(1, Ordering::Relaxed);
    let mut o = Outcome::default();
    match faults.decide(&p, Some(&info)) {
        None => {}
        Some(Action::Corrupt) => corrupt(&mut frame, &info),
        Some(Action::Truncate) => {
            frame.truncate(frame.len() / 2);
            o.close_after = true;
        }
        Some(Action::DropLane) => {
            frame.clear();
            o.close_after = true;
        }
        Some(Action::DropConnection) => {
            frame.clear();
            o.close_after = true;
            match conn.as_ref().and_then(Weak::upgrade) {
                Some(c) => c.drop_all(),
                None => faults.close_accepted(),
            }
        }
        Some(Action::Delay(d)) => o.delay = Some(d),
        Some(Action::Stall) => {
            frame.clear();
            o.stall = true;
        }
        Some(Action::ReplaceWithFailed) if !info.data => frame = failed_frame(&info),
        // Data frames pass unchanged (a data frame is not an exchange's answer).
        Some(Action::ReplaceWithFailed) => {}
        Some(Action::Fail) => {
            frame.clear();
            o.fail = true;
        }
        Some(Action::Kill(f)) => {
            if let Some(f) = f.upgrade() {
                f.kill();
            }
        }
        Some(Action::Call(c)) => c(),
    }
    o.bytes = frame;
    o
}

/// A lane of a [`FaultTransport`].
pub struct FaultLane {
    sh: Arc<LaneShared>,
    faults: Arc<Faults>,
    conn: Option<Weak<ConnShared>>,
    peer: PeerInfo,
    vectored_read: bool,
    vectored_write: bool,
    shm: Option<ShmPeer>,
    // Read side: raw bytes from the peer, bytes ready for the endpoint.
    rraw: Vec<u8>,
    rout: VecDeque<u8>,
    rdelay: Option<(Pin<Box<tokio::time::Sleep>>, Vec<u8>, bool)>,
    r_eof_after: bool,
    r_stall: bool,
    r_eof: bool,
    // Write side: bytes from the endpoint not yet parsed, bytes to forward.
    wraw: Vec<u8>,
    wout: VecDeque<u8>,
    wdelay: Option<Pin<Box<tokio::time::Sleep>>>,
    w_close_after: bool,
    w_stall: bool,
    w_broken: bool,
}

impl FaultLane {
    fn new(
        inner: Box<dyn Lane>,
        faults: &Arc<Faults>,
        conn: Option<Weak<ConnShared>>,
        accepted: bool,
    ) -> FaultLane {
        let peer = inner.peer();
        let vectored_read = inner.is_read_vectored();
        let shm = inner.shm_peer();
        let vectored_write = inner.is_write_vectored();
        let sh = Arc::new(LaneShared {
            inner: Mutex::new(Some(inner)),
            wakers: Mutex::new([None, None]),
            accepted,
        });
        faults.register(&sh);
        FaultLane {
            sh,
            faults: faults.clone(),
            conn,
            peer,
            vectored_read,
            vectored_write,
            shm,
            rraw: Vec::new(),
            rout: VecDeque::new(),
            rdelay: None,
            r_eof_after: false,
            r_stall: false,
            r_eof: false,
            wraw: Vec::new(),
            wout: VecDeque::new(),
            wdelay: None,
            w_close_after: false,
            w_stall: false,
            w_broken: false,
        }
    }

    fn closed(&self) -> bool {
        lock(&self.sh.inner).is_none()
    }

    /// Fills `rout` with the next bytes for the endpoint (Ready(Ok(false)) at EOF).
    fn fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            if !self.rout.is_empty() {
                return Poll::Ready(Ok(true));
            }
            if self.r_eof_after || self.r_eof {
                if self.r_eof_after {
                    self.sh.close();
                }
                return Poll::Ready(Ok(false));
            }
            if self.r_stall {
                self.sh.park(0, cx);
                if self.closed() {
                    return Poll::Ready(Err(injected("lane closed")));
                }
                return Poll::Pending;
            }
            if let Some((sleep, _, _)) = self.rdelay.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    self.sh.park(0, cx);
                    return Poll::Pending;
                }
                let (_, bytes, close) = self.rdelay.take().unwrap();
                self.rout.extend(bytes);
                self.r_eof_after |= close;
                continue;
            }
            if let Some(piece) = next_piece(&mut self.rraw, false) {
                let o = apply(
                    &self.faults,
                    &self.conn,
                    Point::Recv(FrameSel::default()),
                    piece,
                );
                if o.fail {
                    self.sh.close();
                    return Poll::Ready(Err(injected("read")));
                }
                self.r_stall = o.stall;
                match o.delay {
                    Some(d) => {
                        self.rdelay =
                            Some((Box::pin(tokio::time::sleep(d)), o.bytes, o.close_after))
                    }
                    None => {
                        self.rout.extend(o.bytes);
                        self.r_eof_after |= o.close_after;
                    }
                }
                continue;
            }
            // Need more bytes from the peer.
            let mut tmp = [0u8; 64 << 10];
            let mut rb = ReadBuf::new(&mut tmp);
            let r = {
                let mut g = lock(&self.sh.inner);
                let Some(inner) = g.as_mut() else {
                    return Poll::Ready(Err(injected("lane closed")));
                };
                Pin::new(inner).poll_read(cx, &mut rb)
            };
            match r {
                Poll::Pending => {
                    self.sh.park(0, cx);
                    if self.closed() {
                        return Poll::Ready(Err(injected("lane closed")));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    if let Some(p) = next_piece(&mut self.rraw, true) {
                        let o = apply(
                            &self.faults,
                            &self.conn,
                            Point::Recv(FrameSel::default()),
                            p,
                        );
                        self.rout.extend(o.bytes);
                    }
                    self.r_eof = true;
                }
                Poll::Ready(Ok(())) => self.rraw.extend_from_slice(rb.filled()),
            }
        }
    }

    /// Forwards `wout` to the inner lane; Ready once it is empty.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(s) = self.wdelay.as_mut() {
            if s.as_mut().poll(cx).is_pending() {
                self.sh.park(1, cx);
                return Poll::Pending;
            }
            self.wdelay = None;
        }
        while !self.wout.is_empty() {
            let (a, _) = self.wout.as_slices();
            let r = {
                let mut g = lock(&self.sh.inner);
                let Some(inner) = g.as_mut() else {
                    return Poll::Ready(Err(injected("lane closed")));
                };
                Pin::new(inner).poll_write(cx, a)
            };
            match r {
                Poll::Pending => {
                    self.sh.park(1, cx);
                    if self.closed() {
                        return Poll::Ready(Err(injected("lane closed")));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(injected("write returned 0"))),
                Poll::Ready(Ok(n)) => {
                    self.wout.drain(..n);
                }
            }
        }
        if self.w_close_after {
            self.sh.close();
            self.w_broken = true;
        }
        Poll::Ready(Ok(()))
    }

    fn accept_bytes(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.w_broken || self.closed() {
            return Poll::Ready(Err(injected("lane closed")));
        }
        // Backpressure: no new bytes while a delay runs or much is queued.
        if self.wdelay.is_some() || self.wout.len() > (8 << 20) {
            match self.drain(cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if self.wdelay.is_some() || self.wout.len() > (8 << 20) => {
                    return Poll::Pending
                }
                _ => {}
            }
        }
        let n: usize = bufs.iter().map(|b| b.len()).sum();
        if self.w_stall {
            return Poll::Ready(Ok(n));
        }
        for b in bufs {
            self.wraw.extend_from_slice(b);
        }
        while let Some(piece) = next_piece(&mut self.wraw, false) {
            let o = apply(
                &self.faults,
                &self.conn,
                Point::Send(FrameSel::default()),
                piece,
            );
            if o.fail {
                // A failed submit: this write errors and the lane is broken (the peer sees it
                // close), as after EPIPE or EIO.
                self.w_broken = true;
                self.sh.close();
                return Poll::Ready(Err(injected("write")));
            }
            self.wout.extend(o.bytes);
            if let Some(d) = o.delay {
                self.wdelay = Some(Box::pin(tokio::time::sleep(d)));
            }
            if o.stall {
                self.w_stall = true;
                self.wraw.clear();
                break;
            }
            if o.close_after {
                self.w_close_after = true;
                self.wraw.clear();
                break;
            }
        }
        if let Poll::Ready(Err(e)) = self.drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }
}

impl Drop for FaultLane {
    fn drop(&mut self) {
        // The inner lane closes with us (the controller only holds a weak reference).
        lock(&self.sh.inner).take();
    }
}

impl AsyncRead for FaultLane {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        match me.fill(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(false)) => Poll::Ready(Ok(())),
            Poll::Ready(Ok(true)) => {
                let n = buf.remaining().min(me.rout.len());
                let (a, b) = me.rout.as_slices();
                let na = n.min(a.len());
                buf.put_slice(&a[..na]);
                buf.put_slice(&b[..n - na]);
                me.rout.drain(..n);
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl AsyncWrite for FaultLane {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().accept_bytes(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().accept_bytes(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.vectored_write
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.w_broken {
            return Poll::Ready(Err(injected("lane closed")));
        }
        match me.drain(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let mut g = lock(&me.sh.inner);
        match g.as_mut() {
            Some(inner) => Pin::new(inner).poll_flush(cx),
            None if me.w_close_after => Poll::Ready(Ok(())),
            None => Poll::Ready(Err(injected("lane closed"))),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        match me.drain(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let mut g = lock(&me.sh.inner);
        match g.as_mut() {
            Some(inner) => Pin::new(inner).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl Lane for FaultLane {
    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        match me.fill(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(false)) => Poll::Ready(Ok(0)),
            Poll::Ready(Ok(true)) => {
                let mut n = 0;
                for b in bufs.iter_mut() {
                    if me.rout.is_empty() {
                        break;
                    }
                    let k = b.len().min(me.rout.len());
                    for (d, s) in b[..k].iter_mut().zip(me.rout.drain(..k)) {
                        *d = s;
                    }
                    n += k;
                }
                Poll::Ready(Ok(n))
            }
        }
    }

    fn is_read_vectored(&self) -> bool {
        self.vectored_read
    }

    fn peer(&self) -> PeerInfo {
        self.peer.clone()
    }

    fn shm_peer(&self) -> Option<ShmPeer> {
        self.shm
    }
}

/// A plain security value for TCP (kept here so test files need not import it).
pub fn no_security() -> Security {
    Security::None
}

// ---------------------------------------------------------------------------------------------
// Process resources, read from /proc
// ---------------------------------------------------------------------------------------------

/// What this process holds, from `/proc/self`: open fds (and how many are sockets), threads,
/// resident and locked (pinned) memory, and memory mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Resources {
    /// Open file descriptors (`/proc/self/fd`).
    pub fds: usize,
    /// Of those, sockets.
    pub sockets: usize,
    /// Threads (`/proc/self/task`).
    pub threads: usize,
    /// Resident set size in KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Locked memory in KiB (`VmLck`: pinned staging and store segments).
    pub locked_kib: u64,
    /// Memory mappings (`/proc/self/maps` lines: every arena is one).
    pub maps: usize,
}

impl Resources {
    /// A sample now.
    pub fn sample() -> Resources {
        let mut r = Resources::default();
        for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            r.fds += 1;
            if let Ok(t) = std::fs::read_link(e.path()) {
                if t.to_string_lossy().starts_with("socket:") {
                    r.sockets += 1;
                }
            }
        }
        r.threads = std::fs::read_dir("/proc/self/task").unwrap().count();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        r.rss_kib = field("VmRSS:");
        r.locked_kib = field("VmLck:");
        r.maps = std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .count();
        r
    }

    /// Whether every count is at most `base`'s (RSS is not compared: the allocator keeps freed
    /// memory). Under a sanitizer ([`sanitized`]) locked memory and mappings are not compared:
    /// AddressSanitizer turns `mlock` into a no-op and maps its own shadow and allocator regions.
    pub fn within(&self, base: &Resources) -> bool {
        self.fds <= base.fds
            && self.sockets <= base.sockets
            && self.threads <= base.threads
            && (sanitized() || (self.locked_kib <= base.locked_kib && self.maps <= base.maps))
    }
}

/// Whether the tests run under a sanitizer (`TPU_SYNC_SANITIZER` set, as `make sanitize` does).
pub fn sanitized() -> bool {
    std::env::var_os("TPU_SYNC_SANITIZER").is_some()
}

/// Waits (bounded) until the process is back to `base` (fds, sockets, threads, locked memory,
/// mappings); panics with both samples otherwise.
pub async fn assert_back_to(base: &Resources, limit: Duration, what: &str) {
    let t0 = std::time::Instant::now();
    loop {
        let now = Resources::sample();
        if now.within(base) {
            return;
        }
        if t0.elapsed() >= limit {
            // What is still open, to name the leak: the descriptors' targets and the sockets
            // of this network namespace (a socket's inode is in both).
            let fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter_map(|e| std::fs::read_link(e.path()).ok())
                        .map(|p| p.display().to_string())
                        .collect()
                })
                .unwrap_or_default();
            eprintln!("{what}: open descriptors {fds:?}");
            for f in ["/proc/net/tcp", "/proc/net/udp"] {
                let t = std::fs::read_to_string(f).unwrap_or_default();
                eprintln!("{what}: {f}:\n{t}");
            }
        }
        assert!(
            t0.elapsed() < limit,
            "{what}: resources leaked: now {now:?}, baseline {base:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
