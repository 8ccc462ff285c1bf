//! The server side of the driver: the listener, one task per inbound lane (hello, then either
//! the session's control lane or a data lane serving one exchange at a time), and the data-lane
//! handlers. Every decision is the state machine's; the handlers plan, move bytes and answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::lanes::{read_ctl, write_ctl, LaneCount};
use super::{lock, DriverSinkPlan, Inner, SessionIo, SinkIo};
use crate::error::{Error, Result};
use crate::net::framed::Framed;
use crate::net::proto::{PullAsk, PushAsk, ReleaseStep, SinkPlan};
use crate::net::signal::Signal;
use crate::net::stream::{recv_stripe, send_stripe, SpanCursor};
use crate::net::transport::{Acceptor, Lane};
use crate::plan::Placement;
use crate::wire::{self, Control, LaneRole, Stripe};

/// What a handler step means for its lane.
enum Next {
    /// Keep serving this lane.
    Continue,
    /// Close the lane (frame sync lost, or the session ended).
    Close,
}

async fn reply(f: &mut Framed, m: Control, rid: u64) -> Next {
    match f.send(&m, rid).await {
        Ok(()) => Next::Continue,
        Err(_) => Next::Close,
    }
}

fn failed(request_id: u64, e: &Error) -> Control {
    Control::failed(request_id, e)
}

impl Inner {
    pub(super) async fn accept_loop(self: Arc<Self>, acc: Arc<dyn Acceptor>) {
        loop {
            let lane = tokio::select! {
                l = acc.accept() => l,
                _ = self.shutdown.wait() => return,
            };
            match lane {
                Ok(lane) => {
                    let Ok(permit) = self.inbound.clone().try_acquire_owned() else {
                        let n = self.counters.lanes_refused.fetch_add(1, Ordering::Relaxed);
                        if n.is_power_of_two() || n == 0 {
                            log::warn!(
                                "refused an inbound lane from {}: {} lanes already served \
                                 (max_inbound_lanes; {} refused so far)",
                                lane.peer().addr,
                                self.opts.max_inbound_lanes,
                                n + 1
                            );
                        }
                        drop(lane);
                        continue;
                    };
                    let me = self.clone();
                    self.spawn(async move {
                        me.serve_lane(lane).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    log::info!("listener ended: {e}");
                    return;
                }
            }
        }
    }

    async fn serve_lane(self: Arc<Self>, lane: Box<dyn Lane>) {
        let count = LaneCount::new(&self.counters);
        let peer = lane.peer();
        let mut f = Framed::new(lane, self.opts.io_timeout);
        let (name, incarnation, role) = match f.recv_hello(self.opts.handshake_timeout).await {
            Ok((
                _,
                Control::Hello {
                    name,
                    protocol,
                    incarnation,
                    role,
                    unhashed_aead,
                },
            )) if protocol == wire::PROTOCOL_VERSION => {
                f.agree_hashing(self.opts.hash_encrypted_frames, unhashed_aead);
                (name, incarnation, role)
            }
            Ok((_, Control::Hello { protocol, .. })) => {
                let e = Error::Protocol(format!(
                    "peer speaks protocol {protocol}, this endpoint {}",
                    wire::PROTOCOL_VERSION
                ));
                let _ = f.send(&failed(0, &e), 0).await;
                return;
            }
            Ok((_, m)) => {
                log::warn!("lane from {}: expected hello, got {m:?}", peer.addr);
                return;
            }
            Err(e) => {
                log::info!("lane from {} ended before hello: {e}", peer.addr);
                return;
            }
        };
        let Some(session) = self.session(&name, incarnation) else {
            return;
        };
        let ack = Control::HelloAck {
            name: self.opts.name.clone(),
            protocol: wire::PROTOCOL_VERSION,
            incarnation: self.incarnation,
            unhashed_aead: !self.opts.hash_encrypted_frames,
        };
        if f.send(&ack, 0).await.is_err() {
            return;
        }
        match role {
            LaneRole::Control => self.server_control(session, f, count).await,
            LaneRole::Data => loop {
                let idle = self.opts.lane_idle_timeout;
                let r = tokio::select! {
                    r = f.recv(idle) => r,
                    _ = session.dead.wait() => return,
                    _ = self.shutdown.wait() => return,
                };
                let (rid, msg) = match r {
                    Ok(m) => m,
                    Err(Error::PeerClosed(_)) => return,
                    Err(Error::Timeout(_)) => {
                        log::debug!("idle data lane from {name} closed after {idle:?}");
                        return;
                    }
                    Err(e) => {
                        log::info!("data lane from {name}: {e}");
                        return;
                    }
                };
                lock(&self.proto).handle_heard(Instant::now(), session.id);
                match self.handle(&session, &mut f, rid, msg).await {
                    Next::Continue => {}
                    Next::Close => return,
                }
            },
        }
    }

    /// The session of `(name, incarnation)` (another live incarnation of the same name keeps
    /// its own). `None` once the endpoint shut down, or when it has
    /// [`crate::net::proto::MAX_SESSIONS`] sessions (the lane is closed).
    fn session(&self, name: &str, incarnation: u64) -> Option<Arc<SessionIo>> {
        let mut p = lock(&self.proto);
        if p.is_shut_down() {
            return None;
        }
        let id = match p.handle_hello(Instant::now(), name, incarnation) {
            Ok(id) => id,
            Err(e) => {
                log::warn!("{e}");
                return None;
            }
        };
        let s = lock(&self.sessions)
            .entry(id)
            .or_insert_with(|| {
                crate::metrics::peer_connected();
                Arc::new(SessionIo {
                    id,
                    name: name.to_string(),
                    dead: Signal::default(),
                })
            })
            .clone();
        Some(s)
    }

    /// The server side of a session's control lane: heartbeats answered, cancellations applied;
    /// every message tells the state machine the session is alive. The session dies when the
    /// lane closes or the state machine declares it silent.
    async fn server_control(self: Arc<Self>, s: Arc<SessionIo>, f: Framed, _count: LaneCount) {
        let (mut r, mut w) = tokio::io::split(f.into_lane());
        let (tx, mut rx) = mpsc::unbounded_channel::<Control>();
        let o = &self.opts;
        let mute = o.faults.mute_heartbeats;
        let reader = async {
            loop {
                let m = match read_ctl(&mut r).await {
                    Err(e) => return format!("{e}"),
                    Ok(m) => m,
                };
                lock(&self.proto).handle_heard(Instant::now(), s.id);
                match m {
                    Control::Ping { seq } => {
                        if !mute {
                            let _ = tx.send(Control::Pong { seq });
                        }
                    }
                    Control::Cancel { request_id, push } => {
                        let a = lock(&self.proto).handle_remote_cancel(s.id, request_id, push);
                        self.apply(a);
                    }
                    m => log::debug!("control message from {}: {m:?}", s.name),
                }
            }
        };
        let writer = async {
            while let Some(m) = rx.recv().await {
                if let Err(e) = write_ctl(&mut w, &m, o.io_timeout).await {
                    return format!("{e}");
                }
            }
            "closed".to_string()
        };
        let why = tokio::select! {
            w = reader => w,
            w = writer => w,
            _ = s.dead.wait() => return,
            _ = self.shutdown.wait() => return,
        };
        let a = lock(&self.proto).handle_session_lost(Instant::now(), s.id, why);
        self.apply(a);
    }

    async fn handle(&self, s: &Arc<SessionIo>, f: &mut Framed, rid: u64, msg: Control) -> Next {
        let now = Instant::now();
        match msg {
            Control::Describe { request_id, sink } => {
                let r = if sink {
                    lock(&self.proto).describe_sink(request_id)
                } else {
                    lock(&self.proto).handle_describe_source(now, s.id, request_id)
                };
                let m = match r {
                    Ok((placement, num_tokens)) => Control::Description {
                        request_id,
                        num_tokens,
                        placement,
                    },
                    Err(e) => failed(request_id, &e),
                };
                reply(f, m, rid).await
            }
            Control::Release {
                request_id,
                delivered,
                attempt,
            } => {
                let waiting = {
                    let mut p = lock(&self.proto);
                    match p.handle_release(now, s.id, request_id, delivered, attempt) {
                        ReleaseStep::Refused(e) => Err(Err(e)),
                        ReleaseStep::Now(ended) => Err(Ok(ended)),
                        ReleaseStep::Wait(token) => {
                            // Registered under the state machine's lock, so the decision cannot
                            // come before its waiter.
                            let (tx, rx) = oneshot::channel();
                            lock(&self.releases).insert(token, tx);
                            Ok(rx)
                        }
                    }
                };
                let ended = match waiting {
                    Err(Err(e)) => return reply(f, failed(request_id, &e), rid).await,
                    Err(Ok(ended)) => ended,
                    Ok(rx) => tokio::select! {
                        r = rx => r.ok().flatten(),
                        _ = s.dead.wait() => return Next::Close,
                    },
                };
                // Answer before ending the registration: its owner may shut the endpoint down as
                // soon as it learns the request was released, and the answer must already be on
                // its way by then.
                let r = reply(f, Control::Released { request_id }, rid).await;
                if let Some(o) = ended {
                    self.source_ended(request_id, o);
                }
                r
            }
            Control::Reject { request_id, reason } => {
                // The staging is dropped before the answer: a consumer that sees the answer sees
                // the producer's memory freed.
                let (known, a) = lock(&self.proto).handle_reject(now, s.id, request_id, &reason);
                self.apply(a);
                reply(f, Control::Rejected { request_id, known }, rid).await
            }
            Control::Pull {
                request_id,
                src_rank,
                dst_rank,
                dst,
                digest,
                total_bytes,
                stripe,
                attempt,
            } => {
                let ask = PullAsk {
                    request_id,
                    src_rank,
                    dst_rank,
                    digest,
                    total_bytes,
                    stripe,
                    generation: 0,
                    attempt,
                };
                tracing::Instrument::instrument(
                    self.serve_pull(s, f, ask, &dst),
                    tracing::info_span!("serve_pull", request_id, src_rank, dst_rank),
                )
                .await
            }
            Control::Push {
                request_id,
                src_rank,
                dst_rank,
                src,
                num_tokens,
                digest,
                total_bytes,
                stripe,
            } => {
                let ask = PushAsk {
                    request_id,
                    src_rank,
                    dst_rank,
                    src,
                    num_tokens,
                    digest,
                    total_bytes,
                    stripe,
                };
                self.receive_push(s, f, ask).await
            }
            Control::PushFinish {
                request_id,
                src_ranks,
                src,
                num_tokens,
            } => {
                let (sink, plan) = self.plan_sink(request_id, &src, num_tokens);
                let (r, a) = {
                    let mut p = lock(&self.proto);
                    let (core_plan, cursors) = split(plan);
                    let r = p.handle_push_finish(
                        now, s.id, request_id, &src_ranks, &src, num_tokens, core_plan,
                    );
                    install(&p, &sink, request_id, cursors);
                    r
                };
                self.apply(a);
                let m = match r {
                    Ok(complete) => Control::Finished {
                        request_id,
                        complete,
                    },
                    Err(e) => failed(request_id, &e),
                };
                reply(f, m, rid).await
            }
            other => {
                let e = Error::Protocol(format!("unexpected message on a data lane: {other:?}"));
                let _ = f.send(&failed(rid, &e), rid).await;
                Next::Close
            }
        }
    }

    /// Serves one pull stripe: planned here from the registration's placement (outside the
    /// state machine's lock, cached per puller), accepted or refused by the state machine, then
    /// sent from the staging.
    async fn serve_pull(
        &self,
        s: &Arc<SessionIo>,
        f: &mut Framed,
        mut ask: PullAsk,
        dst: &Placement,
    ) -> Next {
        let rid = ask.request_id;
        let io = lock(&self.sources).get(&rid).cloned();
        let plan = match &io {
            Some(io) => {
                ask.generation = io.generation;
                io.plan_for(dst)
            }
            None => Err(Error::UnknownRequest(format!(
                "request {rid} is not registered here"
            ))),
        };
        let granted = lock(&self.proto).handle_pull(Instant::now(), s.id, &ask, plan);
        let (grant, io) = match (granted, io) {
            (Ok(g), Some(io)) => (g, io),
            (Err(e), _) => {
                return match f.send(&failed(rid, &e), rid).await {
                    Ok(()) => Next::Continue,
                    Err(_) => Next::Close,
                }
            }
            (Ok(g), None) => {
                // Cannot happen (a grant names a registration the driver holds); end cleanly.
                let a = lock(&self.proto).handle_pull_stripe_end(Instant::now(), g.stripe, false);
                self.apply(a);
                return Next::Close;
            }
        };
        let cursor = SpanCursor::new(grant.spans, grant.num_layers);
        let reg = &io.shared;
        let gate = (*reg.layers.borrow() < reg.num_layers).then(|| reg.layers.subscribe());
        let stripe: Stripe = ask.stripe;
        let r = tokio::select! {
            r = send_stripe(f, rid, &io.staging, ask.src_rank, &cursor, stripe, gate, &self.counters, &self.opts.faults) => r,
            _ = reg.done.wait() => Err(Error::Cancelled(format!("request {rid} was withdrawn"))),
            _ = s.dead.wait() => Err(Error::PeerClosed("session ended".into())),
        };
        let a = lock(&self.proto).handle_pull_stripe_end(Instant::now(), grant.stripe, r.is_ok());
        self.apply(a);
        match r {
            Ok(_) => Next::Continue,
            Err(e) => {
                log::info!("pull of request {rid} by {} ended: {e}", s.name);
                // The consumer may still be copying frames already sent out of this staging
                // (same host): it stays mapped until the consumer has seen the lane close.
                f.hold_refs(io.staging.clone());
                Next::Close
            }
        }
    }

    /// The plan of push registration `rid` from a sender's placement, when the state machine
    /// says it has none yet (built outside its lock).
    fn plan_sink(
        &self,
        rid: u64,
        src: &Placement,
        num_tokens: u32,
    ) -> (Option<Arc<SinkIo>>, Option<Result<DriverSinkPlan>>) {
        let needs = lock(&self.proto).sink_needs_plan(rid);
        let sink = lock(&self.sinks).get(&rid).cloned();
        match (needs, &sink) {
            (Ok(Some(_)), Some(k)) => {
                let plan = k.plan_from(src, num_tokens);
                (sink, Some(plan))
            }
            _ => (sink, None),
        }
    }

    /// Receives one pushed stripe into the registration's staging after the state machine
    /// accepted it; its end (verified bytes or the failure) goes back to the state machine
    /// before the answer.
    async fn receive_push(&self, s: &Arc<SessionIo>, f: &mut Framed, ask: PushAsk) -> Next {
        let rid = ask.request_id;
        let (sink, plan) = self.plan_sink(rid, &ask.src, ask.num_tokens);
        let (granted, a) = {
            let mut p = lock(&self.proto);
            let (core_plan, cursors) = split(plan);
            let r = p.handle_push(Instant::now(), s.id, &ask, core_plan);
            install(&p, &sink, rid, cursors);
            r
        };
        self.apply(a);
        let grant = match granted {
            Ok(g) => g,
            Err(e) => {
                return match f.send(&failed(rid, &e), rid).await {
                    Ok(()) => Next::Continue,
                    Err(_) => Next::Close,
                }
            }
        };
        let cursors = sink.as_ref().and_then(|k| {
            lock(&k.cursors)
                .as_ref()
                .map(|(c, p)| (c.clone(), p.clone()))
        });
        let (Some(sink), Some((cursors, progress))) = (sink, cursors) else {
            // Cannot happen (a grant names a planned registration the driver holds).
            let e = Error::Protocol(format!("request {rid}: push accepted without a plan"));
            let a = lock(&self.proto).handle_push_stripe_end(Instant::now(), grant.stripe, Err(e));
            self.apply(a);
            return Next::Close;
        };
        let cursor = cursors[grant.pair].clone();
        if f.send(&Control::Ready { request_id: rid }, rid)
            .await
            .is_err()
        {
            let e = Error::PeerClosed(format!("request {rid}: the sender's lane closed"));
            let a = lock(&self.proto).handle_push_stripe_end(Instant::now(), grant.stripe, Err(e));
            self.apply(a);
            return Next::Close;
        }
        // A request failed by a corrupt chunk on another stripe keeps this stripe draining (its
        // lane stays in sync and reusable); a cancelled one stops at once.
        let t = &sink.transfer;
        let r = {
            let recv = recv_stripe(
                f,
                rid,
                &sink.staging,
                ask.dst_rank,
                &cursor,
                ask.stripe,
                &progress,
                grant.pair,
                &self.counters,
            );
            tokio::pin!(recv);
            let mut draining = false;
            loop {
                tokio::select! {
                    r = &mut recv => break Some(r),
                    _ = t.cancel.wait(), if !draining => {
                        let soft = matches!(lock(&t.result).as_ref(), Some(Err(Error::Checksum(_))));
                        if soft {
                            draining = true;
                        } else {
                            break None;
                        }
                    }
                    _ = s.dead.wait() => break None,
                }
            }
        };
        let now = Instant::now();
        match r {
            None => {
                let e = Error::Cancelled(format!("request {rid}: reception stopped"));
                let a = lock(&self.proto).handle_push_stripe_end(now, grant.stripe, Err(e));
                self.apply(a);
                Next::Close
            }
            Some(Ok(n)) => {
                t.bytes.fetch_add(n, Ordering::Relaxed);
                let a = lock(&self.proto).handle_push_stripe_end(now, grant.stripe, Ok(n));
                self.apply(a);
                let m = Control::StreamAck {
                    request_id: rid,
                    bytes: n,
                };
                reply(f, m, rid).await
            }
            Some(Err(fail)) => {
                let a = lock(&self.proto).handle_push_stripe_end(
                    now,
                    grant.stripe,
                    Err(fail.error.clone()),
                );
                self.apply(a);
                if fail.lane_ok && f.send(&failed(rid, &fail.error), rid).await.is_ok() {
                    Next::Continue
                } else {
                    Next::Close
                }
            }
        }
    }
}

/// The state machine's part of a driver plan, and the driver's cursors.
fn split(
    plan: Option<Result<DriverSinkPlan>>,
) -> (Option<Result<SinkPlan>>, Option<Vec<Arc<SpanCursor>>>) {
    match plan {
        Some(Ok((sp, c))) => (Some(Ok(sp)), Some(c)),
        Some(Err(e)) => (Some(Err(e)), None),
        None => (None, None),
    }
}

/// Installs a driver plan's cursors when the state machine took that plan (called under its
/// lock, so only the first planner installs).
fn install(
    p: &crate::net::proto::Proto,
    sink: &Option<Arc<SinkIo>>,
    rid: u64,
    cursors: Option<Vec<Arc<SpanCursor>>>,
) {
    if let (Some(k), Some(c)) = (sink, cursors) {
        if matches!(p.sink_needs_plan(rid), Ok(None)) {
            k.install(c, k.dst.layout.model.num_layers);
        }
    }
}
