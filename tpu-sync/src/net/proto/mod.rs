//! The endpoint's protocol rules as a state machine without I/O.
//!
//! [`Proto`] holds everything an [`Endpoint`](super::Endpoint) decides: source registrations and
//! their leases, releases and rejects; push registrations and the acceptance of every stripe
//! pushed into them (stream count and chunk size consistency, digests, duplicate and late
//! stripes, push-finish completion); peer sessions and their liveness (heartbeats, restarts);
//! the client side's peer liveness (when to ping, when a silent peer is dead); transfers and
//! their single result; and the housekeeping timers. It does no networking, spawns nothing, reads
//! no clock and touches no memory it was not given: every input is a `handle_*` call carrying the
//! current time, every output is a returned [`Action`] list, and [`Proto::poll_timeout`] says
//! when [`Proto::handle_timeout`] must be called next (the model is `quinn-proto`).
//!
//! The tokio driver (`net/endpoint/`) owns the sockets, lane pools, staging memory and waiters:
//! it calls into `Proto` under one lock and carries out the actions it returns. Plans are built by
//! the driver (outside the lock, they can take tens of milliseconds) and passed in.
//!
//! Handles are small copyable ids ([`SessionId`], [`TransferId`], [`StripeId`], [`PeerId`],
//! [`ReleaseToken`]); nothing here holds a reference into the driver.

mod client;
mod session;
pub use session::MAX_SESSIONS;
mod sink;
mod source;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::time::{Duration, Instant};

pub(crate) use client::{Backoff, StripeJoin};
pub(crate) use sink::{PlannedPair, PushAsk, PushGrant, SinkPlan, SinkSpec};
pub(crate) use source::{PullAsk, PullGrant, SourceSpec};

use crate::error::{Error, Result};
use crate::plan::Placement;

/// How a source registration ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceOutcome {
    /// Every expected consumer released it after a complete pull (a release that does not
    /// confirm delivery is not counted: see [`Endpoint::release_with`](super::Endpoint::release_with)).
    Released,
    /// Every expected consumer is accounted for and at least one of them rejected the request
    /// ([`Endpoint::reject`](super::Endpoint::reject): it will not pull it). The message is the
    /// first consumer's reason, with its name.
    Rejected(String),
    /// No live consumer held a lease for [`EndpointOptions::lease_ttl`](super::EndpointOptions::lease_ttl).
    Expired,
    /// A consumer holding a lease died (the message names it).
    PeerLost(String),
    /// [`Endpoint::unregister_source`](super::Endpoint::unregister_source) was called.
    Unregistered,
    /// The endpoint shut down.
    Shutdown,
}

/// What a transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// This endpoint pulls.
    Pull,
    /// This endpoint pushes.
    Push,
    /// This endpoint receives pushes ([`Endpoint::expect_push`](super::Endpoint::expect_push)).
    PushReceive,
}

impl TransferKind {
    /// The `direction` label of this kind's metrics: a push sends, a pull or a push reception
    /// receives.
    pub fn metrics_direction(self) -> crate::metrics::NetDirection {
        match self {
            TransferKind::Push => crate::metrics::NetDirection::Send,
            TransferKind::Pull | TransferKind::PushReceive => crate::metrics::NetDirection::Receive,
        }
    }
}

/// What a finished transfer moved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Payload bytes moved by this endpoint (received for pulls and push receptions, sent for
    /// pushes).
    pub bytes: u64,
    /// Spans in the plan part handled here.
    pub spans: u64,
    /// `(source rank, destination rank)` pairs handled here.
    pub pairs: u64,
    /// Stripes (lane exchanges) used.
    pub stripes: u64,
    /// Wall time from submission to completion.
    pub elapsed: Duration,
}

/// A peer session on the server side (one `(name, incarnation)` of a connected endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct SessionId(pub(crate) u64);

/// A transfer of this endpoint (pull, push or push reception).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct TransferId(pub(crate) u64);

/// One stripe being served (pull) or received (push) by the server side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct StripeId(pub(crate) u64);

/// A peer this endpoint connected to (client side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PeerId(pub(crate) u64);

/// A release whose answer waits for stripes still being served to its consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ReleaseToken(pub(crate) u64);

/// The timing rules of a [`Proto`].
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Unheld source registrations expire, and idle push registrations fail, after this.
    pub(crate) lease_ttl: Duration,
    /// The client pings each peer this often.
    pub(crate) heartbeat_interval: Duration,
    /// A session or peer silent this long is dead.
    pub(crate) heartbeat_timeout: Duration,
    /// How long a delivered release waits for stripes still being served to its consumer.
    pub(crate) release_wait: Duration,
    /// `expected_releases` counts consumer ranks ([`crate::net::EndpointOptions::count_releases_by_rank`]).
    pub(crate) count_releases_by_rank: bool,
}

/// What the driver must do. Actions returned by one call are carried out in order.
#[derive(Debug, Clone)]
pub(crate) enum Action {
    /// A source registration ended: drop its staging, tell its handle.
    SourceEnded {
        /// The request.
        request_id: u64,
        /// How.
        outcome: SourceOutcome,
    },
    /// A transfer has its (only) result: record it, wake its waiters, release what it held. For
    /// a push reception the registration is gone.
    TransferDone {
        /// The transfer.
        transfer: TransferId,
        /// Its result (`elapsed` is filled in by the driver).
        result: Result<TransferStats>,
    },
    /// A peer session died: its lanes stop.
    SessionDead {
        /// The session.
        session: SessionId,
        /// Why.
        why: String,
    },
    /// Send a heartbeat to a peer (client side).
    Ping {
        /// The peer.
        peer: PeerId,
        /// Sequence number.
        seq: u64,
    },
    /// A peer stayed silent too long (client side): fail its transfers, close its lanes.
    PeerDead {
        /// The peer.
        peer: PeerId,
        /// Why.
        why: String,
    },
    /// A deferred release is decided: answer it, then end the registration if `ended`.
    ReleaseDecided {
        /// The release.
        token: ReleaseToken,
        /// The request.
        request_id: u64,
        /// The registration's outcome when the release ended it.
        ended: Option<SourceOutcome>,
    },
}

/// The counters and gauges the state machine knows (the driver adds lanes and bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ProtoStats {
    pub(crate) sessions: u64,
    pub(crate) source_registrations: u64,
    pub(crate) sink_registrations: u64,
    pub(crate) leases: u64,
    pub(crate) staged_bytes: u64,
    pub(crate) transfers_in_flight: u64,
    pub(crate) transfers_completed: u64,
    pub(crate) transfers_failed: u64,
    pub(crate) sessions_lost: u64,
}

struct TransferRec {
    kind: TransferKind,
    request_id: u64,
    staged_bytes: u64,
}

/// The whole protocol state of one endpoint. See the [module docs](self).
pub(crate) struct Proto {
    cfg: Config,
    sessions: session::Sessions,
    sources: source::Sources,
    sinks: sink::Sinks,
    peers: client::Peers,
    transfers: HashMap<TransferId, TransferRec>,
    next_id: u64,
    completed: u64,
    failed: u64,
    /// Requests whose last pull failed (for the `delivered` flag of a release).
    failed_pulls: client::Recent,
    shut_down: bool,
    /// Late-timer guard: liveness verdicts (silent sessions, unanswering peers) deferred until
    /// this instant because the timer fired late ([`Proto::handle_timeout`]).
    liveness_deferred: Option<Instant>,
    /// When the current deferral began (a deferral never lasts past `heartbeat_timeout`).
    deferring_since: Option<Instant>,
}

/// A timer that fires later than this after its deadline means this process did not run (it
/// was descheduled, or its runtime's threads were busy): the messages that arrived meanwhile
/// have not been read, so no peer is declared dead on that tick.
pub(crate) const LATE_TIMER: Duration = Duration::from_millis(200);

/// How long liveness verdicts wait after a late tick: long enough for the lanes' reader tasks,
/// ready since their bytes arrived, to run first.
pub(crate) const LATE_TIMER_RECHECK: Duration = Duration::from_millis(50);

impl Proto {
    pub(crate) fn new(cfg: Config) -> Proto {
        Proto {
            sessions: session::Sessions::default(),
            sources: source::Sources::default(),
            sinks: sink::Sinks::default(),
            peers: client::Peers::default(),
            transfers: HashMap::new(),
            next_id: 1,
            completed: 0,
            failed: 0,
            failed_pulls: client::Recent::new(1 << 16),
            shut_down: false,
            liveness_deferred: None,
            deferring_since: None,
            cfg,
        }
    }

    fn id(&mut self) -> u64 {
        let i = self.next_id;
        self.next_id += 1;
        i
    }

    /// Whether [`Proto::shutdown`] ran.
    pub(crate) fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    // -----------------------------------------------------------------------------------------
    // Transfers
    // -----------------------------------------------------------------------------------------

    /// Starts tracking a transfer holding `staged_bytes` of staging.
    pub(crate) fn start_transfer(
        &mut self,
        kind: TransferKind,
        request_id: u64,
        staged_bytes: u64,
    ) -> TransferId {
        let id = TransferId(self.id());
        self.transfers.insert(
            id,
            TransferRec {
                kind,
                request_id,
                staged_bytes,
            },
        );
        id
    }

    /// Gives a transfer its result; only the first result of a transfer counts (a cancel racing
    /// a completion yields one of them). Returns the actions (empty if it already had one).
    #[must_use]
    pub(crate) fn finish_transfer(
        &mut self,
        t: TransferId,
        result: Result<TransferStats>,
    ) -> Vec<Action> {
        let Some(rec) = self.transfers.remove(&t) else {
            return Vec::new();
        };
        match &result {
            Ok(_) => self.completed += 1,
            Err(_) => self.failed += 1,
        }
        match rec.kind {
            TransferKind::Pull => self.failed_pulls.note(rec.request_id, result.is_ok()),
            TransferKind::PushReceive => self.sinks.remove_transfer(rec.request_id, t),
            TransferKind::Push => {}
        }
        vec![Action::TransferDone {
            transfer: t,
            result,
        }]
    }

    /// Whether a release of `request_id` by this endpoint is a delivery: false when this
    /// endpoint's last pull of it failed or was cancelled.
    pub(crate) fn delivered(&self, request_id: u64) -> bool {
        !self.failed_pulls.contains(request_id)
    }

    // -----------------------------------------------------------------------------------------
    // Sessions (server side)
    // -----------------------------------------------------------------------------------------

    /// A peer endpoint said hello as `(name, incarnation)`: its session (the same one for
    /// every lane of that incarnation). Errors: [`Error::InvalidArgument`] when
    /// [`MAX_SESSIONS`] sessions exist. Another live incarnation of the same name keeps its
    /// own session: an old incarnation ends only when it is dead.
    pub(crate) fn handle_hello(
        &mut self,
        now: Instant,
        name: &str,
        incarnation: u64,
    ) -> Result<SessionId> {
        self.sessions
            .hello(now, name, incarnation, &mut self.next_id)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "hello from {name} refused: this endpoint already has {} peer sessions",
                    MAX_SESSIONS
                ))
            })
    }

    /// A session sent something (a heartbeat, a request): it is alive.
    pub(crate) fn handle_heard(&mut self, now: Instant, s: SessionId) {
        self.sessions.heard(now, s);
    }

    /// A session's control lane closed or failed: the session is dead.
    #[must_use]
    pub(crate) fn handle_session_lost(
        &mut self,
        now: Instant,
        s: SessionId,
        why: String,
    ) -> Vec<Action> {
        self.session_died(now, s, why)
    }

    /// Whether `s` is a live session.
    #[cfg(test)]
    pub(crate) fn session_alive(&self, s: SessionId) -> bool {
        self.sessions.alive(s)
    }

    fn session_died(&mut self, now: Instant, s: SessionId, why: String) -> Vec<Action> {
        let Some(dead) = self.sessions.remove(s) else {
            return Vec::new();
        };
        let pushing = self.sinks.sender_died(s);
        if !self.shut_down {
            self.sessions.lost += 1;
            let leased = self.sources.held_by(s);
            if leased == 0 && pushing.is_empty() {
                log::info!("peer session {} lost (nothing in flight): {why}", dead.name);
            } else {
                log::warn!(
                    "peer session {} lost with {leased} leased and {} pushed requests: {why}",
                    dead.name,
                    pushing.len()
                );
            }
        }
        let mut out = vec![Action::SessionDead {
            session: s,
            why: why.clone(),
        }];
        out.extend(self.sources.session_died(now, &self.cfg, s, &why));
        for (rid, t) in pushing {
            out.extend(self.finish_transfer(
                t,
                Err(Error::PeerClosed(format!(
                    "request {rid}: sender {} died before finishing: {why}",
                    dead.name
                ))),
            ));
        }
        out
    }

    // -----------------------------------------------------------------------------------------
    // Source registrations (server side)
    // -----------------------------------------------------------------------------------------

    /// Registers a pull source; returns its generation (pass it in [`PullAsk::generation`]) and
    /// the actions. Errors: [`Error::InvalidArgument`] when the id is registered. Rejects that
    /// arrived before it are counted at once (it may end right away).
    pub(crate) fn register_source(
        &mut self,
        now: Instant,
        spec: SourceSpec,
    ) -> Result<(u64, Vec<Action>)> {
        self.sources.register(now, &self.cfg, spec)
    }

    /// Withdraws a source registration; `None` if it was not registered.
    #[must_use]
    pub(crate) fn unregister_source(&mut self, request_id: u64) -> Option<Vec<Action>> {
        let a = self.sources.end(request_id, SourceOutcome::Unregistered);
        (!a.is_empty()).then_some(a)
    }

    /// This producer refuses request `request_id`: a registration of it ends (`Unregistered`)
    /// and, for [`Config::lease_ttl`] or until it is registered again, pulls and describes of
    /// it fail at once with [`Error::Cancelled`] carrying `reason` instead of "unknown request"
    /// (which consumers ask again until their timeout). Returns whether a registration ended.
    #[must_use]
    pub(crate) fn refuse_source(
        &mut self,
        now: Instant,
        request_id: u64,
        reason: &str,
    ) -> (bool, Vec<Action>) {
        self.sources.refuse(now, &self.cfg, request_id, reason)
    }

    /// The placement, token count and generation of a source registration (for planning a pull
    /// outside the lock; the driver keeps its own copy). Errors: [`Error::UnknownRequest`].
    #[cfg(test)]
    pub(crate) fn source_placement(&self, request_id: u64) -> Result<(Placement, u32, u64)> {
        self.sources.placement(request_id)
    }

    /// A consumer describes a source registration: it takes a lease (held while its session
    /// lives; the session's death drops it and ends nothing, unlike a pull's).
    pub(crate) fn handle_describe_source(
        &mut self,
        now: Instant,
        s: SessionId,
        request_id: u64,
    ) -> Result<(Placement, u32)> {
        self.sources.describe(now, s, request_id)
    }

    /// A consumer asks for one stripe of a pair (`plan`: the driver's plan between the
    /// registration's placement and the consumer's, or why it could not be built). Refused
    /// before any byte when the request is unknown, the rank not hosted, the plan or stripe
    /// geometry differ; a refusal of a registered request takes no lease and is remembered as
    /// not served (a release from that consumer is no delivery). A grant takes a lease and counts
    /// the stripe as being served until [`Proto::handle_pull_stripe_end`].
    pub(crate) fn handle_pull(
        &mut self,
        now: Instant,
        s: SessionId,
        ask: &PullAsk,
        plan: Result<std::sync::Arc<crate::plan::Plan>>,
    ) -> Result<PullGrant> {
        let id = StripeId(self.id());
        self.sources.pull(now, s, ask, plan, id)
    }

    /// A served stripe ended (`ok`: every chunk and the end of stream were sent).
    #[must_use]
    pub(crate) fn handle_pull_stripe_end(
        &mut self,
        now: Instant,
        stripe: StripeId,
        ok: bool,
    ) -> Vec<Action> {
        self.sources.stripe_end(now, &self.cfg, stripe, ok)
    }

    /// A consumer releases a request, saying whether it got everything (`delivered`). Counted
    /// as a delivery only when `delivered` and the consumer was served every stripe it asked for;
    /// decided at once unless stripes are still being served to it (then
    /// [`Action::ReleaseDecided`] comes later, at the latest [`Config::release_wait`] from now).
    /// `attempt` (non-zero): the pull it speaks for; a release of an earlier pull than the
    /// latest one this consumer began is stale and changes nothing (answered as released).
    pub(crate) fn handle_release(
        &mut self,
        now: Instant,
        s: SessionId,
        request_id: u64,
        delivered: bool,
        attempt: u64,
    ) -> ReleaseStep {
        let token = ReleaseToken(self.id());
        let name = self.sessions.name(s);
        self.sources.release(
            now,
            &self.cfg,
            (s, &name),
            request_id,
            (delivered, attempt),
            token,
        )
    }

    /// A consumer rejects a request (it will not pull it). Returns whether it was registered
    /// (an unknown one is remembered for [`Config::lease_ttl`]) and the actions.
    #[must_use]
    pub(crate) fn handle_reject(
        &mut self,
        now: Instant,
        s: SessionId,
        request_id: u64,
        reason: &str,
    ) -> (bool, Vec<Action>) {
        let name = self.sessions.name(s);
        self.sources
            .reject(now, &self.cfg, s, &name, request_id, reason)
    }

    // -----------------------------------------------------------------------------------------
    // Push registrations (server side)
    // -----------------------------------------------------------------------------------------

    /// Registers destination staging for pushes, tracked as transfer `t` (from
    /// [`Proto::start_transfer`] with [`TransferKind::PushReceive`]). `plan`: the senders'
    /// placement and the plan from it when known now. Errors: [`Error::InvalidArgument`] for a
    /// duplicate; the plan's errors. On an error the transfer has failed (its actions returned).
    pub(crate) fn expect_push(
        &mut self,
        now: Instant,
        spec: SinkSpec,
        t: TransferId,
        plan: Option<(Placement, Result<SinkPlan>)>,
    ) -> std::result::Result<(), (Error, Vec<Action>)> {
        self.sinks.expect(now, spec, t, plan).map_err(|e| {
            let a = self.finish_transfer(t, Err(e.clone()));
            (e, a)
        })
    }

    /// The destination placement and token count of a push registration.
    pub(crate) fn describe_sink(&self, request_id: u64) -> Result<(Placement, u32)> {
        self.sinks.describe(request_id)
    }

    /// `Some((dst placement, dst ranks))` when a push registration still needs its plan (the
    /// driver builds it from the sender's placement and passes it to [`Proto::handle_push`]).
    /// Errors: [`Error::UnknownRequest`].
    pub(crate) fn sink_needs_plan(
        &self,
        request_id: u64,
    ) -> Result<Option<(Placement, std::collections::BTreeSet<u32>)>> {
        self.sinks.needs_plan(request_id)
    }

    /// A sender offers one stripe (`plan`: the driver's plan when [`Proto::sink_needs_plan`]
    /// said so). Refused when the request expects no push, the sender's placement, token count,
    /// digest, stream count or chunk size disagree with what the registration already has, the
    /// pair is not planned here, the source rank belongs to another sender or already declared
    /// itself finished, or the stripe was already delivered (over-delivery). A protocol
    /// violation or mismatch fails the registration too.
    pub(crate) fn handle_push(
        &mut self,
        now: Instant,
        s: SessionId,
        ask: &PushAsk,
        plan: Option<Result<SinkPlan>>,
    ) -> (Result<PushGrant>, Vec<Action>) {
        let id = StripeId(self.id());
        match self.sinks.push(now, s, ask, plan, id) {
            Ok(g) => (Ok(g), Vec::new()),
            Err((e, fail)) => {
                let a = match fail {
                    Some(t) => self.finish_transfer(t, Err(e.clone())),
                    None => Vec::new(),
                };
                (Err(e), a)
            }
        }
    }

    /// A received stripe ended: `Ok(bytes)` verified, or why it failed (the registration then
    /// fails with that error).
    #[must_use]
    pub(crate) fn handle_push_stripe_end(
        &mut self,
        now: Instant,
        stripe: StripeId,
        r: std::result::Result<u64, Error>,
    ) -> Vec<Action> {
        match self.sinks.stripe_end(now, stripe, r) {
            Some((t, e)) => self.finish_transfer(t, Err(e)),
            None => Vec::new(),
        }
    }

    /// A sender declares its source ranks finished. Returns whether the registration is now
    /// complete (then it is done with its stats) and the actions.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn handle_push_finish(
        &mut self,
        now: Instant,
        s: SessionId,
        request_id: u64,
        src_ranks: &[u32],
        src: &Placement,
        num_tokens: u32,
        plan: Option<Result<SinkPlan>>,
    ) -> (Result<bool>, Vec<Action>) {
        let r = self
            .sinks
            .finish(now, s, request_id, src_ranks, src, num_tokens, plan);
        match r {
            Ok(sink::Finish::Incomplete) => (Ok(false), Vec::new()),
            Ok(sink::Finish::Complete(t, stats)) => (Ok(true), self.finish_transfer(t, Ok(stats))),
            Err((e, fail)) => {
                let a = match fail {
                    Some(t) => self.finish_transfer(t, Err(e.clone())),
                    None => Vec::new(),
                };
                (Err(e), a)
            }
        }
    }

    /// A peer cancelled a request: a push it was making into us fails here too (`push`: also
    /// when none of its stripes reached us yet).
    #[must_use]
    pub(crate) fn handle_remote_cancel(
        &mut self,
        s: SessionId,
        request_id: u64,
        push: bool,
    ) -> Vec<Action> {
        // Only a sender of the push (a session that offered it a stripe or finished ranks of
        // it) can end it; `push` is what such a sender says, not a permission, and a cancel
        // from any other session is ignored (a sender that failed before its first stripe
        // reached this side leaves the registration to its no-activity timeout or lease).
        if !self.sinks.is_pushing(request_id, s) {
            if push {
                log::info!(
                    "cancel of push {request_id} from {} ignored: it is not a sender of it",
                    self.sessions.name(s)
                );
            }
            return Vec::new();
        }
        let name = self.sessions.name(s);
        match self.sinks.transfer_of(request_id) {
            Some(t) => self.finish_transfer(
                t,
                Err(Error::Cancelled(format!(
                    "request {request_id}: sender {name} cancelled its push"
                ))),
            ),
            None => Vec::new(),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Peers (client side)
    // -----------------------------------------------------------------------------------------

    /// A connection to a peer is up (its control lane said hello): start its heartbeats.
    pub(crate) fn peer_connected(&mut self, now: Instant) -> PeerId {
        let id = PeerId(self.id());
        self.peers.connect(now, &self.cfg, id);
        id
    }

    /// Something arrived from a peer on its control lane.
    pub(crate) fn handle_peer_heard(&mut self, now: Instant, p: PeerId) {
        self.peers.heard(now, p);
    }

    /// A peer is gone (closed, replaced, or declared dead): forget its timers.
    pub(crate) fn peer_gone(&mut self, p: PeerId) {
        self.peers.remove(p);
    }

    // -----------------------------------------------------------------------------------------
    // Timers
    // -----------------------------------------------------------------------------------------

    /// When [`Proto::handle_timeout`] must be called next (`None`: nothing is scheduled). Changes
    /// after every `handle_*` call that creates a session, registration, peer or release wait.
    #[must_use]
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        // Liveness deadlines wait for a deferral of the late-timer guard; the others do not.
        let liveness = [
            self.sessions.next_timeout(&self.cfg),
            self.peers.next_timeout(&self.cfg),
        ]
        .into_iter()
        .flatten()
        .min()
        .map(|t| self.liveness_deferred.map_or(t, |d| t.max(d)));
        [
            liveness,
            self.sources.next_timeout(),
            self.sinks.next_timeout(&self.cfg),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The late-timer guard of [`Proto::handle_timeout`]: whether liveness may be judged at
    /// `now`. A tick more than [`LATE_TIMER`] after the earliest liveness deadline that was due
    /// defers the verdicts by [`LATE_TIMER_RECHECK`] (the readers run first and record what
    /// arrived); a deferral never lasts past `heartbeat_timeout`, so a process that is always
    /// late still judges.
    fn may_judge_liveness(&mut self, now: Instant) -> bool {
        if self.liveness_deferred.is_some_and(|d| now < d) {
            return false;
        }
        let due = [
            self.sessions.next_timeout(&self.cfg),
            self.peers.next_timeout(&self.cfg),
        ]
        .into_iter()
        .flatten()
        .min();
        let late = due.is_some_and(|d| now.saturating_duration_since(d) > LATE_TIMER);
        let capped = self
            .deferring_since
            .is_some_and(|s| now.saturating_duration_since(s) >= self.cfg.heartbeat_timeout);
        if late && !capped && self.liveness_deferred.is_none() {
            self.deferring_since.get_or_insert(now);
            self.liveness_deferred = Some(now + LATE_TIMER_RECHECK);
            return false;
        }
        self.liveness_deferred = None;
        self.deferring_since = None;
        true
    }

    /// Runs the timers due at `now`: silent sessions die (their leases end `PeerLost`), unheld
    /// source registrations expire, idle push registrations fail, deferred releases past their
    /// wait are decided, early rejects are forgotten, peers are pinged or declared dead.
    #[must_use]
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        let judge = self.may_judge_liveness(now);
        if judge {
            for (s, why) in self.sessions.silent(now, &self.cfg) {
                out.extend(self.session_died(now, s, why));
            }
        }
        out.extend(self.sources.timeout(now, &self.cfg));
        for (t, e) in self.sinks.idle(now, &self.cfg) {
            out.extend(self.finish_transfer(t, Err(e)));
        }
        out.extend(self.peers.timeout(now, &self.cfg, judge));
        out
    }

    /// Ends everything: transfers fail with `why` (cancelled), registrations end
    /// [`SourceOutcome::Shutdown`], sessions die. Losses are not counted from now on.
    #[must_use]
    pub(crate) fn shutdown(&mut self, now: Instant, why: &str) -> Vec<Action> {
        self.shut_down = true;
        let mut out = Vec::new();
        let mut ts: Vec<TransferId> = self.transfers.keys().copied().collect();
        ts.sort();
        for t in ts {
            out.extend(self.finish_transfer(t, Err(Error::Cancelled(why.to_string()))));
        }
        out.extend(self.sources.end_all(SourceOutcome::Shutdown));
        for s in self.sessions.ids() {
            out.extend(self.session_died(now, s, why.to_string()));
        }
        self.peers = client::Peers::default();
        out
    }

    // -----------------------------------------------------------------------------------------
    // Stats
    // -----------------------------------------------------------------------------------------

    /// Gauges and totals of the protocol state.
    pub(crate) fn stats(&self) -> ProtoStats {
        ProtoStats {
            sessions: self.sessions.len() as u64,
            source_registrations: self.sources.len() as u64,
            sink_registrations: self.sinks.len() as u64,
            leases: self.sources.leases(),
            staged_bytes: self.sources.staged_bytes()
                + self.transfers.values().map(|t| t.staged_bytes).sum::<u64>(),
            transfers_in_flight: self.transfers.len() as u64,
            transfers_completed: self.completed,
            transfers_failed: self.failed,
            sessions_lost: self.sessions.lost,
        }
    }
}

/// How a release is answered ([`Proto::handle_release`]).
#[derive(Debug, Clone)]
pub(crate) enum ReleaseStep {
    /// Answer now; then end the registration with this outcome if `Some`.
    Now(Option<SourceOutcome>),
    /// Wait for [`Action::ReleaseDecided`] with this token.
    Wait(ReleaseToken),
    /// Refused (the session never pulled nor described the request): answer with this error;
    /// nothing changed.
    Refused(Error),
}
