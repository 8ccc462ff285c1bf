//! [`Endpoint`]: the tokio driver around the protocol state machine ([`crate::net::proto`]).
//!
//! The driver owns what the state machine must not: sockets and lane pools (`client`), the
//! listener and the per-lane tasks (`server`), staging memory, plans, and the waiters of
//! transfers and registrations (`handles`). It feeds every protocol event into one
//! [`Proto`] under a lock, carries out the [`Action`]s it returns ([`Inner::apply`]), and runs
//! one timer task that calls [`Proto::handle_timeout`] when [`Proto::poll_timeout`] says so.
//!
//! Lock order: the `proto` lock before any of the driver's maps; actions are carried out after
//! the `proto` lock is released.

mod client;
mod handles;
mod lanes;
mod server;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::JoinSet;

pub use handles::{SourceHandle, Transfer};
pub use lanes::DEFAULT_LANE_IDLE;

use self::client::Peer;
use self::handles::{SourceShared, TransferShared};
use super::proto::{
    Action, Config, PeerId, PlannedPair, Proto, ReleaseToken, SessionId, SinkPlan, SinkSpec,
    SourceOutcome, SourceSpec, TransferId, TransferKind, TransferStats,
};
#[cfg(feature = "quic")]
use super::quic::QuicTransport;
use super::request::{
    check_request_id, PullRequest, PushRequest, SinkRegistration, SourceRegistration,
};
use super::signal::Signal;
use super::stats::{Counters, Stats};
use super::stream::{Progress, Side, SpanCursor};
use super::tcp::TcpTransport;
use super::transport::{Acceptor, Transport, TransportKind, TransportTimeouts};
use super::EndpointOptions;
use crate::error::{Error, Result};
use crate::plan::{spans_digest, Placement, Plan, PlanCache, DEFAULT_PLAN_CACHE_ENTRIES};
use crate::staging::Staging;
use crate::wire;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A source registration as the driver holds it: the staging and the plan cache.
struct SourceIo {
    shared: Arc<SourceShared>,
    staging: Arc<Staging>,
    placement: Placement,
    num_tokens: u32,
    /// The state machine's generation of this registration.
    generation: u64,
    /// The last plan built for a puller's placement: every stripe of every pair of one pull uses
    /// the same plan, so it is built once per puller, not once per stripe.
    plans: Mutex<Option<(Placement, Arc<Plan>)>>,
    /// The endpoint's plans (a later registration of the same placements reuses its plan).
    cache: Arc<PlanCache>,
}

impl SourceIo {
    fn plan_for(&self, dst: &Placement) -> Result<Arc<Plan>> {
        if let Some((p, plan)) = lock(&self.plans).as_ref() {
            if p == dst {
                return Ok(plan.clone());
            }
        }
        // Called on the lane's task: a new plan is built off the runtime worker.
        let plan = self
            .cache
            .get_or_build_off_worker(&self.placement, dst, self.num_tokens)?;
        *lock(&self.plans) = Some((dst.clone(), plan.clone()));
        Ok(plan)
    }
}

/// A push registration's pairs as the driver receives them (index = the state machine's pair
/// index) and the transfer's layer progress.
type SinkCursors = (Vec<Arc<SpanCursor>>, Arc<Progress>);

/// A driver plan of a push registration: the state machine's part and the pairs' cursors.
pub(super) type DriverSinkPlan = (SinkPlan, Vec<Arc<SpanCursor>>);

/// A push registration as the driver holds it: the staging and, once planned, the pairs'
/// cursors.
struct SinkIo {
    transfer: Arc<TransferShared>,
    staging: Arc<Staging>,
    dst: Placement,
    dst_ranks: BTreeSet<u32>,
    cursors: Mutex<Option<SinkCursors>>,
    cache: Arc<PlanCache>,
}

/// A peer session's driver side: its lanes stop when `dead` fires.
pub(crate) struct SessionIo {
    id: SessionId,
    name: String,
    dead: Signal,
}

pub(crate) struct Inner {
    /// One permit per inbound lane being served ([`EndpointOptions::max_inbound_lanes`]).
    inbound: Arc<Semaphore>,
    opts: EndpointOptions,
    transport: Arc<dyn Transport>,
    incarnation: u64,
    counters: Arc<Counters>,
    acceptor: Mutex<Option<Arc<dyn Acceptor>>>,
    local_addr: Option<SocketAddr>,
    /// The protocol state machine.
    proto: Mutex<Proto>,
    sources: Mutex<HashMap<u64, Arc<SourceIo>>>,
    sinks: Mutex<HashMap<u64, Arc<SinkIo>>>,
    transfers: Mutex<HashMap<TransferId, Arc<TransferShared>>>,
    sessions: Mutex<HashMap<SessionId, Arc<SessionIo>>>,
    releases: Mutex<HashMap<ReleaseToken, oneshot::Sender<Option<SourceOutcome>>>>,
    peers: Mutex<HashMap<SocketAddr, Arc<Peer>>>,
    peer_ids: Mutex<HashMap<PeerId, Arc<Peer>>>,
    connecting: Mutex<HashMap<SocketAddr, Arc<tokio::sync::Mutex<()>>>>,
    names: Mutex<HashMap<String, SocketAddr>>,
    /// Why the last peer at an address died (until a connection there succeeds again).
    lost: Mutex<HashMap<SocketAddr, String>>,
    tasks: Mutex<JoinSet<()>>,
    shutdown: Signal,
    handshake_failures_seen: AtomicU64,
    /// Plans built here, by (placements, tokens) ([`Endpoint::plan_cache`]).
    plans: Arc<PlanCache>,
}

/// One process's network endpoint: listener (optional) + client side. See the [module
/// docs](crate::net). `Send + Sync`; share it in an `Arc`. Dropping it aborts everything at once
/// (like a crash: peers see the connections close); [`Endpoint::shutdown`] ends it in order.
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("name", &self.inner.opts.name)
            .field("transport", &self.inner.transport.kind())
            .field("local_addr", &self.inner.local_addr)
            .finish()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.inner.abort_all("endpoint dropped");
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return crate::pattern::mix64(t ^ std::process::id() as u64);
    }
    u64::from_le_bytes(b) | 1
}

/// Builds the transport an [`EndpointOptions`] asks for.
pub(crate) fn make_transport(o: &EndpointOptions) -> Result<Arc<dyn Transport>> {
    let t = TransportTimeouts {
        connect: o.connect_timeout,
        handshake: o.handshake_timeout,
    };
    Ok(match o.transport {
        TransportKind::Tcp => {
            if o.security.is_authenticated() {
                return Err(Error::InvalidArgument(
                    "plain TCP cannot authenticate peers: use the tls or quic transport with \
                     credentials"
                        .into(),
                ));
            }
            Arc::new(TcpTransport::plain(t))
        }
        TransportKind::Tls => Arc::new(TcpTransport::tls(o.security.clone(), t)?),
        #[cfg(feature = "quic")]
        TransportKind::Quic => Arc::new(QuicTransport::new(
            o.security.clone(),
            t,
            o.quic_connections_per_peer,
        )?),
        #[cfg(not(feature = "quic"))]
        TransportKind::Quic => return Err(Error::feature_missing("transport quic", "quic")),
        TransportKind::Shm => {
            if o.security.is_authenticated() {
                return Err(Error::InvalidArgument(
                    "the shm transport cannot authenticate peers (it trusts the host): use tls \
                     or quic with credentials"
                        .into(),
                ));
            }
            Arc::new(crate::net::shm::ShmTransport::new(t))
        }
    })
}

/// A caller-supplied plan (checked for the obvious) or one of `cache` (built if new).
fn given_plan(
    plan: Option<&Arc<Plan>>,
    src: &Placement,
    dst: &Placement,
    num_tokens: u32,
    cache: &PlanCache,
) -> Result<Arc<Plan>> {
    match plan {
        Some(p) => {
            src.validate(num_tokens)?;
            dst.validate(num_tokens)?;
            if p.num_tokens != num_tokens {
                return Err(Error::Mismatch(format!(
                    "the given plan is for {} tokens, the request has {num_tokens}",
                    p.num_tokens
                )));
            }
            Ok(p.clone())
        }
        None => cache.get_or_build(src, dst, num_tokens),
    }
}

/// The ranks of `p`'s replica that `staging` holds.
fn staged_ranks(p: &Placement, staging: &Staging) -> Vec<u32> {
    (0..p.layout.spec.ranks_per_replica())
        .map(|l| p.global_rank(l))
        .filter(|r| !staging.ranges(*r).is_empty())
        .collect()
}

/// The source ranks a push of `staging` declares finished: its staged ranks, plus (for a
/// placement without block groups) the ranks that hold no block of the request.
fn pushed_ranks(p: &Placement, staging: &Staging) -> Vec<u32> {
    (0..p.layout.spec.ranks_per_replica())
        .filter(|l| {
            !staging.ranges(p.global_rank(*l)).is_empty()
                || (p.groups.is_none() && holds_no_block(p, *l))
        })
        .map(|l| p.global_rank(l))
        .collect()
}

/// Whether local rank `l` of `p` holds no block of the request (a PCP rank past a prompt too
/// short to reach it): it has nothing to stage, and a push of the whole replica declares it
/// finished with the others, or its receivers would wait for it.
fn holds_no_block(p: &Placement, l: u32) -> bool {
    p.block_ids.get(l as usize).is_none_or(|b| b.is_empty())
}

impl Endpoint {
    /// Creates an endpoint and starts listening if `opts.listen` is set. Must be called inside a
    /// tokio runtime (multi-threaded recommended).
    ///
    /// Errors: [`Error::InvalidArgument`] for inconsistent options (TLS/QUIC without credentials,
    /// credentials with plain TCP, zero sizes), [`Error::Io`] when the address cannot be bound.
    pub async fn bind(opts: EndpointOptions) -> Result<Endpoint> {
        let transport = make_transport(&opts)?;
        Endpoint::with_transport(opts, transport).await
    }

    /// Like [`Endpoint::bind`] with a caller-provided transport (e.g. a fault-injecting
    /// decorator around one of the built-in transports).
    pub async fn with_transport(
        opts: EndpointOptions,
        transport: Arc<dyn Transport>,
    ) -> Result<Endpoint> {
        if opts.chunk_bytes == 0 || opts.chunk_bytes > wire::MAX_DATA_PAYLOAD as u64 {
            return Err(Error::InvalidArgument(format!(
                "chunk_bytes {} outside 1..={}",
                opts.chunk_bytes,
                wire::MAX_DATA_PAYLOAD
            )));
        }
        if opts.streams_per_pair == 0 || opts.max_lanes_per_peer == 0 || opts.max_inbound_lanes == 0
        {
            return Err(Error::InvalidArgument(
                "streams_per_pair, max_lanes_per_peer and max_inbound_lanes must be >= 1".into(),
            ));
        }
        if opts.streams_per_pair > wire::MAX_STRIPES {
            return Err(Error::InvalidArgument(format!(
                "streams_per_pair {} exceeds {}",
                opts.streams_per_pair,
                wire::MAX_STRIPES
            )));
        }
        if opts.lane_idle_timeout < Duration::from_millis(2) {
            return Err(Error::InvalidArgument(format!(
                "lane_idle_timeout must be at least 2 ms (got {:?})",
                opts.lane_idle_timeout
            )));
        }
        if opts.heartbeat_interval.is_zero() || opts.heartbeat_timeout <= opts.heartbeat_interval {
            return Err(Error::InvalidArgument(
                "heartbeat_timeout must exceed a non-zero heartbeat_interval".into(),
            ));
        }
        let acceptor = match opts.listen {
            Some(a) => Some(transport.listen(a).await?),
            None => None,
        };
        let local_addr = acceptor.as_ref().map(|a| a.local_addr());
        let nofile = crate::net::raise_nofile_limit();
        let lanes = crate::net::inbound_lanes_for(opts.max_inbound_lanes, nofile);
        if (lanes as u32) < opts.max_inbound_lanes {
            log::warn!(
                "max_inbound_lanes {} exceeds what the open-file limit ({nofile}) leaves room \
                 for: serving at most {lanes} inbound lanes",
                opts.max_inbound_lanes
            );
        }
        let inbound = Arc::new(Semaphore::new(lanes));
        let proto = Proto::new(Config {
            lease_ttl: opts.lease_ttl,
            heartbeat_interval: opts.heartbeat_interval,
            heartbeat_timeout: opts.heartbeat_timeout,
            release_wait: opts.io_timeout / 2,
            count_releases_by_rank: opts.count_releases_by_rank,
        });
        let counters = Arc::new(Counters::for_transport(transport.kind()));
        let inner = Arc::new(Inner {
            inbound,
            opts,
            transport,
            incarnation: random_u64() & super::MAX_REQUEST_ID,
            counters,
            acceptor: Mutex::new(acceptor.clone()),
            local_addr,
            proto: Mutex::new(proto),
            sources: Mutex::new(HashMap::new()),
            sinks: Mutex::new(HashMap::new()),
            transfers: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            releases: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            peer_ids: Mutex::new(HashMap::new()),
            connecting: Mutex::new(HashMap::new()),
            names: Mutex::new(HashMap::new()),
            lost: Mutex::new(HashMap::new()),
            plans: Arc::new(PlanCache::new(DEFAULT_PLAN_CACHE_ENTRIES)),
            tasks: Mutex::new(JoinSet::new()),
            shutdown: Signal::default(),
            handshake_failures_seen: AtomicU64::new(0),
        });
        if let Some(acc) = acceptor {
            let me = inner.clone();
            inner.spawn(async move { me.accept_loop(acc).await });
        }
        let me = inner.clone();
        inner.spawn(async move { me.timers().await });
        let weak: std::sync::Weak<dyn crate::metrics::Source> = Arc::downgrade(&inner) as _;
        crate::metrics::register_source(weak);
        Ok(Endpoint { inner })
    }

    /// The listening address (`None` for a client-only endpoint).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.local_addr
    }

    /// The endpoint's name.
    pub fn name(&self) -> &str {
        &self.inner.opts.name
    }

    /// The transport in use.
    pub fn transport_kind(&self) -> TransportKind {
        self.inner.transport.kind()
    }

    /// Gives `name` the address `addr` (`host:port`). Transfers may then name the peer instead of
    /// an address. Re-adding a name with a new address (a restarted peer) drops the connection to
    /// the old address; the next transfer connects to the new one.
    pub async fn add_peer(&self, name: &str, addr: &str) -> Result<()> {
        let a = lanes::resolve_addr(addr).await?;
        let old = lock(&self.inner.names).insert(name.to_string(), a);
        if let Some(old) = old.filter(|o| *o != a) {
            let p = lock(&self.inner.peers).remove(&old);
            if let Some(p) = p {
                self.inner
                    .peer_died(&p, format!("peer {name} moved from {old} to {a}"), false);
            }
        }
        Ok(())
    }

    /// Counters and gauges.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// The endpoint's plan cache ([`DEFAULT_PLAN_CACHE_ENTRIES`] plans): the producer side of
    /// a pull, a push registration without a given plan and the transfer pipeline on this
    /// endpoint plan through it, so repeated requests of the same placements and tokens plan
    /// once.
    pub fn plan_cache(&self) -> &Arc<PlanCache> {
        &self.inner.plans
    }

    /// Registers a request's staged blocks for pulling.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad id, an id already registered, or
    /// `expected_releases == 0`; the placement's validation errors; [`Error::BlockRange`] when a
    /// block of a rank present in `staging` is not staged.
    pub fn register_source(&self, reg: SourceRegistration) -> Result<SourceHandle> {
        check_request_id(reg.request_id)?;
        if reg.expected_releases == 0 {
            return Err(Error::InvalidArgument(
                "expected_releases must be >= 1".into(),
            ));
        }
        reg.placement.validate(reg.num_tokens)?;
        let hosted = staged_ranks(&reg.placement, &reg.staging);
        for &rank in &hosted {
            let local = reg
                .placement
                .local_rank(rank)
                .expect("a rank of the replica");
            for r in reg.placement.block_ranges(local) {
                reg.staging.resolve(rank, r.buffer, r.offset, r.len)?;
            }
        }
        if hosted.is_empty() {
            return Err(Error::BlockRange(format!(
                "request {}: the staging holds no rank of the placement's replica",
                reg.request_id
            )));
        }
        let num_layers = reg.placement.layout.model.num_layers;
        let ready = reg.layers_ready.unwrap_or(num_layers).min(num_layers);
        let shared = Arc::new(SourceShared {
            request_id: reg.request_id,
            num_layers,
            layers: watch::channel(ready).0,
            outcome: Mutex::new(None),
            done: Signal::default(),
        });
        let spec = SourceSpec {
            request_id: reg.request_id,
            num_tokens: reg.num_tokens,
            placement: reg.placement.clone(),
            hosted: hosted.into_iter().collect(),
            staged_bytes: reg.staging.total_bytes(),
            expected_releases: reg.expected_releases,
        };
        let inner = &self.inner;
        let actions = {
            let mut p = lock(&inner.proto);
            let (generation, actions) = p.register_source(Instant::now(), spec)?;
            lock(&inner.sources).insert(
                reg.request_id,
                Arc::new(SourceIo {
                    shared: shared.clone(),
                    staging: reg.staging,
                    placement: reg.placement,
                    num_tokens: reg.num_tokens,
                    generation,
                    plans: Mutex::new(None),
                    cache: inner.plans.clone(),
                }),
            );
            actions
        };
        inner.apply(actions);
        Ok(SourceHandle { reg: shared })
    }

    /// Withdraws a source registration (pulls in progress fail). Returns whether it existed.
    pub fn unregister_source(&self, request_id: u64) -> bool {
        let a = lock(&self.inner.proto).unregister_source(request_id);
        match a {
            Some(a) => {
                self.inner.apply(a);
                true
            }
            None => false,
        }
    }

    /// Refuses request `request_id` as its producer: it will not be served from here (its
    /// registration failed, or the producer gave it up). A registration of it ends (pulls in
    /// progress fail, its staging is freed, its outcome is [`SourceOutcome::Unregistered`]);
    /// then, for [`EndpointOptions::lease_ttl`] or until the id is registered again, a pull or
    /// describe of it is answered at once with [`Error::Cancelled`] carrying `reason` (at most
    /// 1 KiB of it is kept; an empty one reads "no reason given"), where a consumer would
    /// otherwise be told "unknown request" and ask again until its pull's registration wait
    /// runs out. At most 4,096 refusals are kept (past that the one expiring first is
    /// forgotten). Returns whether a registration ended.
    ///
    /// Errors: [`Error::InvalidArgument`] for an invalid request id. Thread-safe; does not
    /// block on the network.
    pub fn refuse_source(&self, request_id: u64, reason: &str) -> Result<bool> {
        check_request_id(request_id)?;
        let (existed, a) =
            lock(&self.inner.proto).refuse_source(Instant::now(), request_id, reason);
        self.inner.apply(a);
        Ok(existed)
    }

    /// Registers destination staging for pushes of a request. The returned transfer completes
    /// when every source rank of the senders' replica has declared itself finished and every
    /// planned pair for the destination ranks hosted here arrived and verified. It fails with
    /// [`Error::Timeout`] when no stripe is being received and nothing happened (registration,
    /// a stripe starting or ending, a sender declaring itself finished) for
    /// [`EndpointOptions::lease_ttl`]: a sender that never comes, or dies before its first
    /// stripe reaches this endpoint, does not keep the registration forever.
    ///
    /// Errors: as [`Endpoint::register_source`]; plan errors when `src` is given.
    pub fn expect_push(&self, reg: SinkRegistration) -> Result<Transfer> {
        check_request_id(reg.request_id)?;
        reg.placement.validate(reg.num_tokens)?;
        let dst_ranks: BTreeSet<u32> = match &reg.dst_ranks {
            Some(v) => v.iter().copied().collect(),
            None => staged_ranks(&reg.placement, &reg.staging)
                .into_iter()
                .collect(),
        };
        for r in &dst_ranks {
            if reg.placement.local_rank(*r).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "destination rank {r} is not in the placement's DP replica"
                )));
            }
        }
        let inner = &self.inner;
        // Planned here (outside the state machine's lock) when the senders are known.
        let planned = reg.src.as_ref().map(|src| {
            let plan = match &reg.plan {
                Some(p) => given_plan(Some(p), src, &reg.placement, reg.num_tokens, &inner.plans),
                None => inner
                    .plans
                    .get_or_build(src, &reg.placement, reg.num_tokens),
            };
            let r = plan.and_then(|plan| {
                sink_plan(
                    &plan,
                    src,
                    reg.num_tokens,
                    &reg.placement,
                    &dst_ranks,
                    &reg.staging,
                )
            });
            (src.clone(), r)
        });
        let num_layers = reg.placement.layout.model.num_layers;
        let spec = SinkSpec {
            request_id: reg.request_id,
            num_tokens: reg.num_tokens,
            placement: reg.placement.clone(),
            dst_ranks: dst_ranks.clone(),
        };
        let (shared, r) = {
            let mut p = lock(&inner.proto);
            let shared = inner.new_transfer_locked(
                &mut p,
                reg.request_id,
                TransferKind::PushReceive,
                reg.staging.total_bytes(),
                num_layers,
                None,
            );
            let (core_plan, cursors) = match planned {
                Some((src, Ok((sp, cursors)))) => (Some((src, Ok(sp))), Some(cursors)),
                Some((src, Err(e))) => (Some((src, Err(e))), None),
                None => (None, None),
            };
            let r = p.expect_push(Instant::now(), spec, shared.id, core_plan);
            if r.is_ok() {
                let sink = Arc::new(SinkIo {
                    transfer: shared.clone(),
                    staging: reg.staging.clone(),
                    dst: reg.placement.clone(),
                    dst_ranks,
                    cursors: Mutex::new(None),
                    cache: inner.plans.clone(),
                });
                if let Some(c) = cursors {
                    sink.install(c, num_layers);
                }
                lock(&inner.sinks).insert(reg.request_id, sink);
            }
            (shared, r)
        };
        match r {
            Ok(()) => Ok(Transfer {
                shared,
                inner: Arc::downgrade(inner),
            }),
            Err((e, actions)) => {
                inner.apply(actions);
                Err(e)
            }
        }
    }

    /// Asks the endpoint at `addr` for a source registration's placement and token count (and
    /// takes a lease on it).
    pub async fn describe(&self, addr: &str, request_id: u64) -> Result<(Placement, u32)> {
        self.inner.describe(addr, request_id, false).await
    }

    /// Asks the endpoint at `addr` for a push registration's (destination) placement.
    pub async fn describe_sink(&self, addr: &str, request_id: u64) -> Result<(Placement, u32)> {
        self.inner.describe(addr, request_id, true).await
    }

    /// Tells the endpoint at `addr` that this consumer is done with `request_id` (its lease ends;
    /// the registration is dropped after its expected number of releases). The release says
    /// whether this consumer got the request: it is a delivery unless the last pull of
    /// `request_id` on this endpoint failed or was cancelled (then it is
    /// [`Endpoint::release_with`]`(addr, request_id, false)`).
    pub async fn release(&self, addr: &str, request_id: u64) -> Result<()> {
        let delivered = lock(&self.inner.proto).delivered(request_id);
        self.release_with(addr, request_id, delivered).await
    }

    /// Ends this consumer's lease on `request_id` at `addr`, saying whether it got everything it
    /// pulled from there (`delivered`). Only a delivered release counts toward the
    /// registration's [`SourceRegistration::expected_releases`] (and ends it as
    /// [`SourceOutcome::Released`]); the producer also refuses to count one from a consumer that
    /// it did not serve every stripe it asked for, and counts it only after the stripes it is
    /// still serving to that consumer ended (at most half its I/O timeout later). A release that
    /// is not a delivery leaves the registration pullable (a retry, to the right address,
    /// succeeds); without a live lease holder it expires [`EndpointOptions::lease_ttl`] later
    /// ([`SourceOutcome::Expired`]). A consumer that gives up on the request should
    /// [`Endpoint::reject`] it instead, which frees the producer's staging at once.
    ///
    /// Errors: connection errors; the producer's errors with their kind.
    pub async fn release_with(&self, addr: &str, request_id: u64, delivered: bool) -> Result<()> {
        self.release_pull(addr, request_id, delivered, 0).await
    }

    /// [`Endpoint::release_with`] for one pull: `pull` is the [`Transfer::id`] of the pull of
    /// `request_id` this release speaks for (0: whichever pull came last). The producer ignores
    /// it (answers it, changes nothing) once a later pull of the request from this endpoint
    /// asked it for a stripe, so the release of a failed pull, sent while a retry already
    /// runs, cannot end the retry's lease: control messages and the retry's stripes travel on
    /// different lanes, in no fixed order.
    ///
    /// Errors: as [`Endpoint::release_with`].
    pub async fn release_pull(
        &self,
        addr: &str,
        request_id: u64,
        delivered: bool,
        pull: u64,
    ) -> Result<()> {
        if let Some(d) = self.inner.opts.faults.delay_releases {
            tokio::time::sleep(d).await;
        }
        let m = wire::Control::Release {
            request_id,
            delivered,
            attempt: pull,
        };
        let span = tracing::info_span!("release", request_id, delivered);
        let answer =
            tracing::Instrument::instrument(self.inner.exchange(addr, &m, request_id), span);
        match answer.await? {
            wire::Control::Released { .. } => Ok(()),
            m => Err(Error::Protocol(format!("expected released, got {m:?}"))),
        }
    }

    /// Tells the endpoint at `addr` that this consumer will not pull `request_id` (the decode
    /// side refused or aborted the request before admission, or gave up after a failed pull).
    /// The producer ends this consumer's part at once: it counts toward
    /// [`SourceRegistration::expected_releases`], and when no consumer remains the registration
    /// ends with [`SourceOutcome::Rejected`] (carrying `reason`, at most 4 KiB of it, and this
    /// endpoint's name) and its staging is dropped before the producer answers. Rejecting again
    /// from the same endpoint counts once. A reject that
    /// reaches the producer before the registration is remembered for
    /// [`EndpointOptions::lease_ttl`] and counted when the request is registered. Pulls of the
    /// request in flight from this consumer should be cancelled first; stripes still being
    /// served are cut off when the registration ends.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad id; connection errors; the producer's errors
    /// with their kind.
    pub async fn reject(&self, addr: &str, request_id: u64, reason: &str) -> Result<()> {
        check_request_id(request_id)?;
        let mut reason = reason.to_string();
        if reason.len() > 4096 {
            let mut cut = 4096;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        let m = wire::Control::Reject { request_id, reason };
        match self.inner.exchange(addr, &m, request_id).await? {
            wire::Control::Rejected { .. } => Ok(()),
            m => Err(Error::Protocol(format!("expected rejected, got {m:?}"))),
        }
    }

    /// The `transfer` span of a new pull or push (`kind`) and, inside it, under a `plan` span,
    /// its plan ([`given_plan`]).
    fn transfer_plan(
        &self,
        kind: &'static str,
        request_id: u64,
        plan: Option<&Arc<Plan>>,
        (src, dst): (&Placement, &Placement),
        num_tokens: u32,
    ) -> Result<(tracing::Span, Arc<Plan>)> {
        let span = tracing::info_span!(
            "transfer",
            request_id,
            kind,
            transport = self.inner.transport.kind().name()
        );
        let plan = span.in_scope(|| {
            tracing::info_span!("plan")
                .in_scope(|| given_plan(plan, src, dst, num_tokens, &self.inner.plans))
        })?;
        Ok((span, plan))
    }

    /// Starts pulling a request. Validation (plan, staging coverage, peer map) happens before
    /// this returns; network errors surface through the returned [`Transfer`].
    ///
    /// The request leaves from this thread: the transfer's driver is polled once here (sending
    /// the pull request), then runs wherever it is woken (a runtime task) unless
    /// [`Transfer::wait`] takes it over first; so no runtime thread is woken before the
    /// producer answers. Inside a current-thread runtime (or with `TPU_SYNC_DRIVE_HERE=0`) a
    /// runtime task starts it instead. Must be called within the endpoint's runtime context.
    pub fn pull(&self, req: PullRequest) -> Result<Transfer> {
        self.pull_with(req, Start::Inline)
    }

    /// [`Endpoint::pull`] whose driver waits until [`Transfer::wait`] (or
    /// [`Transfer::start`]) runs it: for a caller that waits for the transfer at once, e.g. the
    /// task of a [`crate::transfer::Pipeline`] operation. Nothing is sent before then.
    pub(crate) fn pull_unstarted(&self, req: PullRequest) -> Result<Transfer> {
        self.pull_with(req, Start::OnWait)
    }

    fn pull_with(&self, req: PullRequest, start: Start) -> Result<Transfer> {
        check_request_id(req.request_id)?;
        let (span, plan) = self.transfer_plan(
            "pull",
            req.request_id,
            req.plan.as_ref(),
            (&req.src, &req.dst),
            req.num_tokens,
        )?;
        let dst_ranks: BTreeSet<u32> = match &req.dst_ranks {
            Some(v) => v.iter().copied().collect(),
            None => staged_ranks(&req.dst, &req.staging).into_iter().collect(),
        };
        let num_layers = req.dst.layout.model.num_layers;
        let mut pairs = Vec::new();
        for (s, d) in plan.pairs() {
            if !dst_ranks.contains(&d) {
                continue;
            }
            let cursor = Arc::new(SpanCursor::new(plan.pair_spans(s, d), num_layers));
            cursor.check_staged(&req.staging, d, Side::Dst)?;
            req.sources.get(s)?;
            pairs.push((s, d, cursor));
        }
        let shared = self.inner.new_transfer(
            req.request_id,
            TransferKind::Pull,
            req.staging.total_bytes(),
            num_layers,
            None,
        );
        let cursors: Vec<_> = pairs.iter().map(|p| p.2.clone()).collect();
        let progress = Arc::new(Progress::new(&cursors, num_layers));
        *lock(&shared.progress) = Some(progress.clone());
        shared.planned.fire("planned");
        let inner = self.inner.clone();
        let sh = shared.clone();
        self.inner.start_driver(
            &shared,
            tracing::Instrument::instrument(
                async move {
                    let r = inner.drive_pull(&sh, req, pairs, progress).await;
                    inner.finish(&sh, r);
                },
                span,
            ),
            start,
        );
        Ok(Transfer {
            shared,
            inner: Arc::downgrade(&self.inner),
        })
    }

    /// Starts pushing a request to the endpoints hosting the destination ranks.
    pub fn push(&self, req: PushRequest) -> Result<Transfer> {
        self.push_with(req, Start::Now)
    }

    /// [`Endpoint::push`] whose driver waits until [`Transfer::wait`] (or
    /// [`Transfer::start`]) runs it, as [`Endpoint::pull_unstarted`].
    pub(crate) fn push_unstarted(&self, req: PushRequest) -> Result<Transfer> {
        self.push_with(req, Start::OnWait)
    }

    fn push_with(&self, req: PushRequest, start: Start) -> Result<Transfer> {
        check_request_id(req.request_id)?;
        let (span, plan) = self.transfer_plan(
            "push",
            req.request_id,
            req.plan.as_ref(),
            (&req.src, &req.dst),
            req.num_tokens,
        )?;
        let src_ranks: Vec<u32> = match &req.src_ranks {
            Some(v) => v.clone(),
            None => pushed_ranks(&req.src, &req.staging),
        };
        if src_ranks.is_empty() {
            return Err(Error::InvalidArgument(
                "the push hosts no source rank of the placement".into(),
            ));
        }
        for r in &src_ranks {
            if req.src.local_rank(*r).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "source rank {r} is not in the placement's DP replica"
                )));
            }
        }
        let num_layers = req.src.layout.model.num_layers;
        let mut pairs = Vec::new();
        for (s, d) in plan.pairs() {
            if !src_ranks.contains(&s) {
                continue;
            }
            let cursor = Arc::new(SpanCursor::new(plan.pair_spans(s, d), num_layers));
            cursor.check_staged(&req.staging, s, Side::Src)?;
            req.targets.get(d)?;
            pairs.push((s, d, cursor));
        }
        let all_dst: Vec<u32> = (0..req.dst.layout.spec.ranks_per_replica())
            .map(|l| req.dst.global_rank(l))
            .collect();
        let targets = req.targets.addresses(all_dst)?;
        let ready = req.layers_ready.unwrap_or(num_layers).min(num_layers);
        let gate = (ready < num_layers).then(|| watch::channel(ready).0);
        let shared = self.inner.new_transfer(
            req.request_id,
            TransferKind::Push,
            req.staging.total_bytes(),
            num_layers,
            gate,
        );
        let inner = self.inner.clone();
        let sh = shared.clone();
        self.inner.start_driver(
            &shared,
            tracing::Instrument::instrument(
                async move {
                    let r = inner.drive_push(&sh, req, src_ranks, pairs, targets).await;
                    let failed = r.is_err();
                    inner.finish(&sh, r);
                    if failed {
                        // The receivers' registrations would otherwise wait for a `PushFinish`
                        // that never comes: tell them the push is over.
                        inner.send_cancel(sh.request_id, true);
                    }
                },
                span,
            ),
            start,
        );
        Ok(Transfer {
            shared,
            inner: Arc::downgrade(&self.inner),
        })
    }

    /// Stops accepting, waits up to `drain` for in-flight transfers to finish (`None`: no wait),
    /// then cancels what is left, ends every registration ([`SourceOutcome::Shutdown`]) and
    /// closes every connection.
    pub async fn shutdown(&self, drain: Option<Duration>) {
        self.stop_accepting();
        if let Some(d) = drain {
            self.drain_until(tokio::time::Instant::now() + d).await;
        }
        self.inner.abort_all("endpoint shut down");
    }

    /// The first step of [`Endpoint::shutdown`]: no new connection is accepted.
    pub(crate) fn stop_accepting(&self) {
        lock(&self.inner.acceptor).take();
    }

    /// The drain of [`Endpoint::shutdown`]: waits until no transfer is in flight or `deadline`
    /// passed.
    pub(crate) async fn drain_until(&self, deadline: tokio::time::Instant) {
        loop {
            let pending: Vec<_> = lock(&self.inner.transfers).values().cloned().collect();
            let Some(t) = pending.first() else { break };
            if tokio::time::timeout_at(deadline, t.done.wait())
                .await
                .is_err()
            {
                break;
            }
        }
    }
}

/// The state machine's plan of a push registration and the driver's cursors of its pairs, from
/// `plan` (the destination ranks `dst_ranks` only; each pair's bytes checked against `staging`).
fn sink_plan(
    plan: &Plan,
    src: &Placement,
    num_tokens: u32,
    dst: &Placement,
    dst_ranks: &BTreeSet<u32>,
    staging: &Staging,
) -> Result<DriverSinkPlan> {
    let num_layers = dst.layout.model.num_layers;
    let mut pairs = Vec::new();
    let mut cursors = Vec::new();
    for (s, d) in plan.pairs() {
        if !dst_ranks.contains(&d) {
            continue;
        }
        let spans = plan.pair_spans(s, d);
        let digest = spans_digest(&spans);
        let n = spans.len() as u64;
        let cursor = Arc::new(SpanCursor::new(spans, num_layers));
        cursor.check_staged(staging, d, Side::Dst)?;
        pairs.push(PlannedPair {
            src_rank: s,
            dst_rank: d,
            digest,
            total: cursor.total(),
            spans: n,
        });
        cursors.push(cursor);
    }
    Ok((
        SinkPlan {
            src: src.clone(),
            num_tokens,
            pairs,
        },
        cursors,
    ))
}

impl SinkIo {
    /// Installs the pairs' cursors and the transfer's layer progress (the first plan only).
    fn install(&self, cursors: Vec<Arc<SpanCursor>>, num_layers: u32) {
        let mut g = lock(&self.cursors);
        if g.is_some() {
            return;
        }
        let progress = Arc::new(Progress::new(&cursors, num_layers));
        *lock(&self.transfer.progress) = Some(progress.clone());
        *g = Some((cursors, progress));
        drop(g);
        self.transfer.planned.fire("planned");
    }

    /// Plans from a sender's placement when the state machine says the registration needs it.
    ///
    /// Called on a lane's task (once per registration): a large plan's build and its pairs'
    /// digests and coverage checks, which grow with the tokens and heads, run off the runtime
    /// worker ([`crate::plan::plan_is_large`]).
    fn plan_from(&self, src: &Placement, num_tokens: u32) -> Result<DriverSinkPlan> {
        let build = || {
            let plan = self.cache.get_or_build(src, &self.dst, num_tokens)?;
            sink_plan(
                &plan,
                src,
                num_tokens,
                &self.dst,
                &self.dst_ranks,
                &self.staging,
            )
        };
        if crate::plan::plan_is_large(src, &self.dst, num_tokens) {
            crate::util::off_worker(build)
        } else {
            build()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Inner: bookkeeping and the action executor
// ---------------------------------------------------------------------------------------------

impl crate::metrics::Source for Inner {
    fn sample(&self, s: &mut crate::metrics::Sample) {
        let st = self.stats();
        s.peers += st.peers + st.sessions;
        s.transfers_in_flight += st.transfers_in_flight;
        s.leases += st.leases;
        s.staged_bytes += st.staged_bytes;
    }
}

impl Inner {
    /// Starts transfer `t`'s driver `fut`: whichever comes first runs it, a task on the
    /// endpoint's runtime or a caller of [`Transfer::wait`] (see there). Must run inside the
    /// endpoint's runtime. Once the endpoint shuts down the driver is dropped unstarted (the
    /// shutdown failed the transfer), here or by [`Inner::abort_all`]: a driver left in its
    /// slot would keep the endpoint alive (it holds the `Inner` that holds the transfer).
    ///
    /// Spawning a task from outside the runtime wakes a parked worker, which on waking wakes
    /// another (Tokio's searching hand-off): two thread wake-ups that a 16 KiB pull whose caller
    /// waits at once does not need (docs/performance.md, "16 KiB"). So with [`Start::OnWait`]
    /// no starter task is spawned: the driver stays in its slot until [`Transfer::wait`] takes
    /// it or [`Transfer::start`] spawns the starter; with [`Start::Inline`] it is polled once
    /// here and then spawned by its own waker (`crate::drive::DriverSlot::poll_first`).
    fn start_driver<F>(self: &Arc<Self>, t: &Arc<TransferShared>, fut: F, start: Start)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let rt = tokio::runtime::Handle::current();
        t.driver.put(fut, rt.clone());
        // A driver its waker spawns is one of the endpoint's tasks too: aborted by a shutdown,
        // refused after it (dropped, as a starter would be).
        let me = Arc::downgrade(self);
        t.driver.set_spawner(Arc::new(move |fut| {
            if let Some(inner) = me.upgrade() {
                inner.spawn_on(fut, &rt);
            }
        }));
        if self.shutdown.is_set() {
            let unstarted = t.driver.take();
            drop(unstarted);
            return;
        }
        match start {
            Start::Inline if crate::drive::may_poll_first() => {
                t.driver.poll_first();
                if self.shutdown.is_set() {
                    // A shutdown during that poll missed the driver (it was out of the slot).
                    let unstarted = t.driver.take();
                    drop(unstarted);
                }
            }
            Start::Now | Start::Inline => self.spawn_starter(t),
            Start::OnWait => {}
        }
    }

    /// Spawns the task that runs `t`'s driver unless a waiter took it first, on the driver's
    /// runtime (from any thread, also one outside every runtime). Nothing when the slot is
    /// empty.
    pub(crate) fn spawn_starter(&self, t: &Arc<TransferShared>) {
        if let Some(rt) = t.driver.runtime() {
            self.spawn_on(crate::drive::start(t.clone(), |t| &t.driver), &rt);
        }
    }

    fn spawn<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.spawn_on(fut, &tokio::runtime::Handle::current());
    }

    /// [`Inner::spawn`] on `rt`, which need not be the current runtime.
    fn spawn_on<F>(&self, fut: F, rt: &tokio::runtime::Handle)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut t = lock(&self.tasks);
        while t.try_join_next().is_some() {}
        if self.shutdown.is_set() {
            return;
        }
        t.spawn_on(fut, rt);
    }

    fn stats(&self) -> Stats {
        let c = &self.counters;
        let ps = lock(&self.proto).stats();
        let hs = lock(&self.acceptor)
            .as_ref()
            .map(|a| a.handshake_failures())
            .unwrap_or(0)
            .max(self.handshake_failures_seen.load(Ordering::Relaxed));
        self.handshake_failures_seen.store(hs, Ordering::Relaxed);
        Stats {
            peers: lock(&self.peers).len() as u64,
            sessions: ps.sessions,
            lanes_open: c.lanes_open.load(Ordering::Relaxed),
            lanes_opened: c.lanes_opened.load(Ordering::Relaxed),
            source_registrations: ps.source_registrations,
            sink_registrations: ps.sink_registrations,
            leases: ps.leases,
            staged_bytes: ps.staged_bytes,
            transfers_in_flight: ps.transfers_in_flight,
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            bytes_received_by_reference: c.bytes_by_reference.load(Ordering::Relaxed),
            bytes_received_unhashed: c.bytes_unhashed.load(Ordering::Relaxed),
            transfers_completed: ps.transfers_completed,
            transfers_failed: ps.transfers_failed,
            checksum_failures: c.checksum_failures.load(Ordering::Relaxed),
            peers_lost: c.peers_lost.load(Ordering::Relaxed) + ps.sessions_lost,
            handshake_failures: hs,
            lanes_refused: c.lanes_refused.load(Ordering::Relaxed),
        }
    }

    fn new_transfer(
        &self,
        request_id: u64,
        kind: TransferKind,
        staged_bytes: u64,
        num_layers: u32,
        gate: Option<watch::Sender<u32>>,
    ) -> Arc<TransferShared> {
        let mut p = lock(&self.proto);
        self.new_transfer_locked(&mut p, request_id, kind, staged_bytes, num_layers, gate)
    }

    /// [`Inner::new_transfer`] with the state machine already locked.
    fn new_transfer_locked(
        &self,
        p: &mut Proto,
        request_id: u64,
        kind: TransferKind,
        staged_bytes: u64,
        num_layers: u32,
        gate: Option<watch::Sender<u32>>,
    ) -> Arc<TransferShared> {
        let id = p.start_transfer(kind, request_id, staged_bytes);
        let t = Arc::new(TransferShared {
            id,
            request_id,
            kind,
            started: Instant::now(),
            result: Mutex::new(None),
            done: Signal::default(),
            cancel: Signal::default(),
            progress: Mutex::new(None),
            planned: Signal::default(),
            num_layers,
            gate,
            bytes: AtomicU64::new(0),
            driver: Default::default(),
        });
        lock(&self.transfers).insert(id, t.clone());
        crate::metrics::transfer_started(self.counters.transport(), kind.metrics_direction());
        t
    }

    /// Gives a transfer its result (the first one wins) and releases what it held.
    fn finish(&self, t: &TransferShared, r: Result<TransferStats>) {
        let a = lock(&self.proto).finish_transfer(t.id, r);
        self.apply(a);
    }

    /// Carries out the state machine's actions, in order.
    fn apply(&self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::SourceEnded {
                    request_id,
                    outcome,
                } => self.source_ended(request_id, outcome),
                Action::TransferDone { transfer, result } => self.transfer_done(transfer, result),
                Action::SessionDead { session, why } => {
                    if !self.shutdown.is_set() {
                        crate::metrics::peer_lost();
                    }
                    if let Some(s) = lock(&self.sessions).remove(&session) {
                        s.dead.fire(why);
                    }
                }
                Action::Ping { peer, seq } => {
                    if let Some(p) = lock(&self.peer_ids).get(&peer) {
                        if !self.opts.faults.mute_heartbeats {
                            let _ = p.ctl.send(wire::Control::Ping { seq });
                        }
                    }
                }
                Action::PeerDead { peer, why } => {
                    let p = lock(&self.peer_ids).get(&peer).cloned();
                    if let Some(p) = p {
                        let why = format!("{why} from {}", p.addr);
                        self.peer_died(&p, why, true);
                    }
                }
                Action::ReleaseDecided {
                    token,
                    request_id,
                    ended,
                } => {
                    let waiter = lock(&self.releases).remove(&token);
                    let unsent = match waiter {
                        Some(tx) => tx.send(ended).err().flatten(),
                        None => ended,
                    };
                    // Nobody is left to answer the release: end the registration here.
                    if let Some(o) = unsent {
                        self.source_ended(request_id, o);
                    }
                }
            }
        }
    }

    /// A source registration ended: its staging is dropped, its handle learns the outcome.
    fn source_ended(&self, request_id: u64, outcome: SourceOutcome) {
        let Some(io) = lock(&self.sources).remove(&request_id) else {
            return;
        };
        lock(&io.shared.outcome).get_or_insert(outcome);
        io.shared.done.fire("ended");
    }

    fn transfer_done(&self, id: TransferId, result: Result<TransferStats>) {
        let Some(t) = lock(&self.transfers).remove(&id) else {
            return;
        };
        let result = result.map(|mut s| {
            s.elapsed = t.started.elapsed();
            if t.kind == TransferKind::PushReceive {
                s.bytes = s.bytes.max(t.bytes.load(Ordering::Relaxed));
            }
            s
        });
        let (tk, dir) = (self.counters.transport(), t.kind.metrics_direction());
        match &result {
            Ok(_) => crate::metrics::transfer_completed(tk, dir, t.started.elapsed().as_secs_f64()),
            Err(e) => {
                log::info!("{:?} of request {} failed: {e}", t.kind, t.request_id);
                crate::metrics::transfer_failed(tk, dir, e.kind());
            }
        }
        *lock(&t.result) = Some(result);
        if t.kind == TransferKind::PushReceive {
            let mut sinks = lock(&self.sinks);
            if sinks
                .get(&t.request_id)
                .is_some_and(|s| Arc::ptr_eq(&s.transfer, &t))
            {
                sinks.remove(&t.request_id);
            }
        }
        t.cancel.fire("finished");
        t.done.fire("finished");
    }

    fn abort_all(&self, why: &str) {
        self.shutdown.fire(why);
        let unstarted: Vec<_> = lock(&self.transfers)
            .values()
            .filter_map(|t| t.driver.take())
            .collect();
        drop(unstarted);
        lock(&self.acceptor).take();
        let a = lock(&self.proto).shutdown(Instant::now(), why);
        self.apply(a);
        lock(&self.sinks).clear();
        let senders: Vec<_> = lock(&self.releases).drain().collect();
        drop(senders);
        let peers: Vec<_> = lock(&self.peers).drain().map(|(_, p)| p).collect();
        lock(&self.peer_ids).clear();
        for p in peers {
            p.dead.fire(why.to_string());
            lock(&p.idle).clear();
            p.conn.close();
        }
        let sessions: Vec<_> = lock(&self.sessions).drain().map(|(_, s)| s).collect();
        for s in sessions {
            s.dead.fire(why.to_string());
        }
        lock(&self.tasks).abort_all();
    }

    /// The timer task: runs the state machine's timers when they are due (at least every
    /// `min(heartbeat_interval, lease_ttl / 4)`, at least 10 ms apart).
    async fn timers(self: Arc<Self>) {
        let o = &self.opts;
        let period = o
            .heartbeat_interval
            .min(o.lease_ttl / 4)
            .max(Duration::from_millis(10));
        loop {
            let next = lock(&self.proto).poll_timeout();
            let now = Instant::now();
            let wake = next.map_or(now + period, |t| t.min(now + period)).max(now);
            tokio::select! {
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
                _ = self.shutdown.wait() => return,
            }
            let a = lock(&self.proto).handle_timeout(Instant::now());
            self.apply(a);
        }
    }
}

/// When a new transfer's driver starts ([`Inner::start_driver`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Start {
    /// A task on the endpoint's runtime starts it now (or a waiter, whichever comes first).
    Now,
    /// Polled once on the creating thread, then run by a task once woken unless a waiter took
    /// it first (`Now` where that thread may not poll it: `crate::drive::may_poll_first`).
    Inline,
    /// The first [`Transfer::wait`] runs it, or [`Transfer::start`] spawns its task.
    OnWait,
}
