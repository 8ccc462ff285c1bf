//! Source registrations (the producer side of a pull): leases, served stripes, releases,
//! rejects, expiry.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::{Action, Config, ReleaseStep, ReleaseToken, SessionId, SourceOutcome, StripeId};
use crate::error::{Error, Result};
use crate::plan::{spans_digest, Placement, Plan, Span};
use crate::wire::Stripe;

/// Most early rejects (rejects of requests not registered yet) remembered at once, for all
/// peers together; each keeps a reason of at most [`MAX_REJECT_REASON_BYTES`], so they hold at
/// most about 4 MiB. Past the cap a reject of an unregistered request is answered but not
/// remembered (its registration, when it comes, then waits for its lease to expire).
pub(crate) const MAX_EARLY_REJECTS: usize = 4096;

/// Most early rejects remembered per peer session (a quarter of [`MAX_EARLY_REJECTS`]), so one
/// peer cannot use up the room of the others.
pub(crate) const MAX_EARLY_REJECTS_PER_SESSION: usize = MAX_EARLY_REJECTS / 4;

/// Longest reject reason kept (bytes of UTF-8; a longer one is cut at a character boundary
/// and marked with "..."). The reason only goes into logs and the registration's outcome.
pub(crate) const MAX_REJECT_REASON_BYTES: usize = 1024;

/// Most producer refusals ([`Sources::refuse`]) remembered at once; each keeps a reason of at
/// most [`MAX_REJECT_REASON_BYTES`], so they hold at most about 4 MiB. Past the cap the one
/// that expires first is forgotten (a pull of it then waits for a registration again).
pub(crate) const MAX_REFUSALS: usize = 4096;

/// `reason` cut to at most [`MAX_REJECT_REASON_BYTES`].
pub(crate) fn bounded_reason(reason: &str) -> std::borrow::Cow<'_, str> {
    if reason.len() <= MAX_REJECT_REASON_BYTES {
        return reason.into();
    }
    let mut end = MAX_REJECT_REASON_BYTES - 3;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &reason[..end]).into()
}

/// A source registration as the state machine sees it (the staging itself stays with the
/// driver).
#[derive(Debug, Clone)]
pub(crate) struct SourceSpec {
    /// Request id.
    pub(crate) request_id: u64,
    /// Tokens of the request.
    pub(crate) num_tokens: u32,
    /// Where the request's blocks are on this side.
    pub(crate) placement: Placement,
    /// Global ranks whose blocks this endpoint staged.
    pub(crate) hosted: BTreeSet<u32>,
    /// Staged bytes (for the stats).
    pub(crate) staged_bytes: u64,
    /// Consumers that must release (or reject) it.
    pub(crate) expected_releases: u32,
}

/// A consumer's request for one stripe of one pair.
#[derive(Debug, Clone)]
pub(crate) struct PullAsk {
    pub(crate) request_id: u64,
    pub(crate) src_rank: u32,
    pub(crate) dst_rank: u32,
    /// The consumer's digest of the pair's spans.
    pub(crate) digest: u64,
    /// The consumer's byte count of the pair's stream.
    pub(crate) total_bytes: u64,
    pub(crate) stripe: Stripe,
    /// Which registration the driver's plan belongs to (from [`super::Proto::register_source`]).
    pub(crate) generation: u64,
    /// The consumer's pull this stripe belongs to (`wire::Control::Pull::attempt`; 0 unknown).
    pub(crate) attempt: u64,
}

/// A granted pull stripe: what to send.
#[derive(Debug, Clone)]
pub(crate) struct PullGrant {
    /// Report its end with [`super::Proto::handle_pull_stripe_end`].
    pub(crate) stripe: StripeId,
    /// The pair's spans (the sender's own plan).
    pub(crate) spans: Vec<Span>,
    /// Layers of the model.
    pub(crate) num_layers: u32,
}

/// What one consumer session was served of one pair.
#[derive(Debug, Clone)]
struct Served {
    /// Stripes of the pair (0: a pull of the pair was refused before any byte).
    count: u32,
    done: Vec<bool>,
}

impl Served {
    fn complete(&self) -> bool {
        self.count > 0 && self.done.iter().all(|&d| d)
    }
}

struct Pending {
    token: ReleaseToken,
    session: SessionId,
    name: String,
    delivered: bool,
    until: Instant,
}

struct Source {
    spec: SourceSpec,
    generation: u64,
    /// Releases counted as deliveries.
    releases: u32,
    /// Consumers that rejected the request (each counts once).
    rejects: u32,
    rejected_by: BTreeSet<SessionId>,
    reject_reason: Option<String>,
    holders: BTreeSet<SessionId>,
    /// Expiry while no consumer holds a lease.
    deadline: Instant,
    served: HashMap<SessionId, HashMap<(u32, u32), Served>>,
    serving: HashMap<SessionId, u32>,
    /// Sessions granted at least one stripe of it (a later refusal of a pair does not undo
    /// that): the death of one of them ends the registration `PeerLost`.
    granted: BTreeSet<SessionId>,
    pending: Vec<Pending>,
    /// The latest pull (its `attempt`) each consumer session asked a stripe for: a release of
    /// an earlier one is stale.
    attempts: HashMap<SessionId, u64>,
}

impl Source {
    fn accounted(&self) -> bool {
        self.releases.saturating_add(self.rejects) >= self.spec.expected_releases
    }

    fn final_outcome(&self) -> SourceOutcome {
        match (&self.reject_reason, self.rejects) {
            (_, 0) => SourceOutcome::Released,
            (Some(r), _) => SourceOutcome::Rejected(r.clone()),
            (None, _) => SourceOutcome::Rejected(String::new()),
        }
    }

    /// Whether `s` was served at least one pair and every stripe of every pair it asked for (a
    /// session that was never served anything was not served completely).
    fn served_completely(&self, s: SessionId) -> bool {
        self.served
            .get(&s)
            .is_some_and(|m| !m.is_empty() && m.values().all(Served::complete))
    }

    /// Whether `s` was granted at least one stripe (not only refused, not only a describe).
    fn was_served(&self, s: SessionId) -> bool {
        self.granted.contains(&s) || self.serving.contains_key(&s)
    }

    fn refused(&mut self, s: SessionId, pair: (u32, u32)) {
        self.served.entry(s).or_default().insert(
            pair,
            Served {
                count: 0,
                done: Vec::new(),
            },
        );
    }

    /// Applies a release by `s` now; `Some(outcome)` when it accounts for the last consumer.
    fn settle_release(
        &mut self,
        now: Instant,
        cfg: &Config,
        s: SessionId,
        name: &str,
        delivered: bool,
    ) -> Option<SourceOutcome> {
        self.holders.remove(&s);
        let complete = self.served_completely(s);
        // The consumer ranks this release speaks for: the distinct destination ranks served.
        let ranks = self.served.get(&s).map_or(0, |m| {
            m.keys()
                .map(|&(_, dst)| dst)
                .collect::<BTreeSet<u32>>()
                .len() as u32
        });
        self.served.remove(&s);
        self.granted.remove(&s);
        self.deadline = now + cfg.lease_ttl;
        if delivered && complete {
            self.releases =
                self.releases
                    .saturating_add(if cfg.count_releases_by_rank { ranks } else { 1 });
        } else {
            log::info!(
                "release of request {} by {name} is not a delivery ({}): the registration stays \
                 pullable",
                self.spec.request_id,
                if delivered {
                    "not every stripe it asked for was served"
                } else {
                    "the consumer says its pull failed"
                }
            );
        }
        self.accounted().then(|| self.final_outcome())
    }
}

struct EarlyReject {
    until: Instant,
    /// The consumers that rejected it (each counts once).
    by: BTreeSet<SessionId>,
    reason: String,
}

/// A request this producer will not serve ([`Sources::refuse`]), until `until`.
struct Refusal {
    until: Instant,
    reason: String,
}

#[derive(Default)]
pub(super) struct Sources {
    regs: HashMap<u64, Source>,
    /// Stripes being served: request, session, pair, geometry.
    stripes: HashMap<StripeId, (u64, SessionId, (u32, u32), Stripe)>,
    early: HashMap<u64, EarlyReject>,
    /// Requests refused by this producer: a pull or describe of one fails at once.
    refused: HashMap<u64, Refusal>,
    next_generation: u64,
}

impl Sources {
    pub(super) fn len(&self) -> usize {
        self.regs.len()
    }

    pub(super) fn leases(&self) -> u64 {
        self.regs.values().map(|r| r.holders.len() as u64).sum()
    }

    pub(super) fn staged_bytes(&self) -> u64 {
        self.regs.values().map(|r| r.spec.staged_bytes).sum()
    }

    /// Registers `spec`; returns its generation and the actions (an early reject may end it).
    pub(super) fn register(
        &mut self,
        now: Instant,
        cfg: &Config,
        spec: SourceSpec,
    ) -> Result<(u64, Vec<Action>)> {
        let rid = spec.request_id;
        if self.regs.contains_key(&rid) {
            return Err(Error::InvalidArgument(format!(
                "request {rid} is already registered"
            )));
        }
        self.refused.remove(&rid);
        self.next_generation += 1;
        let generation = self.next_generation;
        let mut src = Source {
            spec,
            generation,
            releases: 0,
            rejects: 0,
            rejected_by: BTreeSet::new(),
            reject_reason: None,
            holders: BTreeSet::new(),
            deadline: now + cfg.lease_ttl,
            served: HashMap::new(),
            serving: HashMap::new(),
            granted: BTreeSet::new(),
            pending: Vec::new(),
            attempts: HashMap::new(),
        };
        let mut end = None;
        if let Some(e) = self.early.remove(&rid).filter(|e| e.until > now) {
            // Counting consumer ranks: a reject gives the request up for its whole instance.
            src.rejects += if cfg.count_releases_by_rank {
                src.spec.expected_releases
            } else {
                e.by.len() as u32
            };
            src.rejected_by = e.by;
            src.reject_reason = Some(e.reason);
            end = src.accounted().then(|| src.final_outcome());
        }
        self.regs.insert(rid, src);
        Ok((
            generation,
            end.map(|o| self.end(rid, o)).unwrap_or_default(),
        ))
    }

    /// Ends registration `rid` with `outcome` (deferred releases of it are answered).
    pub(super) fn end(&mut self, rid: u64, outcome: SourceOutcome) -> Vec<Action> {
        let Some(reg) = self.regs.remove(&rid) else {
            return Vec::new();
        };
        self.stripes.retain(|_, v| v.0 != rid);
        let mut out: Vec<Action> = reg
            .pending
            .iter()
            .map(|p| Action::ReleaseDecided {
                token: p.token,
                request_id: rid,
                ended: None,
            })
            .collect();
        out.push(Action::SourceEnded {
            request_id: rid,
            outcome,
        });
        out
    }

    pub(super) fn end_all(&mut self, outcome: SourceOutcome) -> Vec<Action> {
        let mut ids: Vec<u64> = self.regs.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter()
            .flat_map(|id| self.end(id, outcome.clone()))
            .collect()
    }

    #[cfg(test)]
    pub(super) fn placement(&self, rid: u64) -> Result<(Placement, u32, u64)> {
        let r = self.regs.get(&rid).ok_or_else(|| unknown(rid))?;
        Ok((r.spec.placement.clone(), r.spec.num_tokens, r.generation))
    }

    pub(super) fn describe(
        &mut self,
        now: Instant,
        s: SessionId,
        rid: u64,
    ) -> Result<(Placement, u32)> {
        let Some(r) = self.regs.get_mut(&rid) else {
            return Err(self.missing(now, rid));
        };
        r.holders.insert(s);
        Ok((r.spec.placement.clone(), r.spec.num_tokens))
    }

    pub(super) fn pull(
        &mut self,
        now: Instant,
        s: SessionId,
        ask: &PullAsk,
        plan: Result<Arc<Plan>>,
        id: StripeId,
    ) -> Result<PullGrant> {
        ask.stripe.validate()?;
        let rid = ask.request_id;
        let Some(reg) = self.regs.get_mut(&rid) else {
            return Err(self.missing(now, rid));
        };
        let latest = reg.attempts.entry(s).or_insert(0);
        *latest = (*latest).max(ask.attempt);
        let pair = (ask.src_rank, ask.dst_rank);
        let checked = (|| -> Result<Vec<Span>> {
            if reg.generation != ask.generation {
                return Err(Error::UnknownRequest(format!(
                    "request {rid} was registered again while its pull was being planned"
                )));
            }
            if !reg.spec.hosted.contains(&ask.src_rank) {
                return Err(Error::BlockRange(format!(
                    "source rank {} of request {rid} is not hosted here",
                    ask.src_rank
                )));
            }
            let plan = plan?;
            let spans = plan.pair_spans(ask.src_rank, ask.dst_rank);
            let mine = spans_digest(&spans);
            let bytes: u64 = spans.iter().map(Span::bytes).sum();
            if mine != ask.digest || bytes != ask.total_bytes {
                return Err(Error::Mismatch(format!(
                    "plan for ranks {}->{} of request {rid} differs: sender has {bytes} bytes \
                     (digest {mine:016x}), receiver expects {} (digest {:016x})",
                    ask.src_rank, ask.dst_rank, ask.total_bytes, ask.digest
                )));
            }
            ask.stripe.validate_for(bytes)?;
            Ok(spans)
        })();
        let spans = match checked {
            Ok(s) => s,
            Err(e) => {
                // Not a delivery, but it takes no lease and consumes nothing.
                reg.refused(s, pair);
                return Err(e);
            }
        };
        reg.holders.insert(s);
        reg.granted.insert(s);
        let served = reg
            .served
            .entry(s)
            .or_default()
            .entry(pair)
            .or_insert(Served {
                count: 0,
                done: Vec::new(),
            });
        if served.count != ask.stripe.count {
            *served = Served {
                count: ask.stripe.count,
                done: vec![false; ask.stripe.count as usize],
            };
        }
        served.done[ask.stripe.index as usize] = false;
        *reg.serving.entry(s).or_insert(0) += 1;
        self.stripes.insert(id, (rid, s, pair, ask.stripe));
        Ok(PullGrant {
            stripe: id,
            spans,
            num_layers: reg.spec.placement.layout.model.num_layers,
        })
    }

    pub(super) fn stripe_end(
        &mut self,
        now: Instant,
        cfg: &Config,
        id: StripeId,
        ok: bool,
    ) -> Vec<Action> {
        let Some((rid, s, pair, stripe)) = self.stripes.remove(&id) else {
            return Vec::new();
        };
        let Some(reg) = self.regs.get_mut(&rid) else {
            return Vec::new();
        };
        if ok {
            if let Some(x) = reg.served.get_mut(&s).and_then(|m| m.get_mut(&pair)) {
                if x.count == stripe.count {
                    x.done[stripe.index as usize] = true;
                }
            }
        }
        let busy = match reg.serving.get_mut(&s) {
            Some(n) => {
                *n -= 1;
                *n > 0
            }
            None => false,
        };
        if busy {
            return Vec::new();
        }
        reg.serving.remove(&s);
        // Releases of this consumer that waited for its stripes.
        self.decide(now, cfg, rid, |p| p.session == s)
    }

    /// Decides the deferred releases of `rid` that `pick` selects.
    fn decide(
        &mut self,
        now: Instant,
        cfg: &Config,
        rid: u64,
        pick: impl Fn(&Pending) -> bool,
    ) -> Vec<Action> {
        let Some(reg) = self.regs.get_mut(&rid) else {
            return Vec::new();
        };
        let (due, keep): (Vec<Pending>, Vec<Pending>) =
            std::mem::take(&mut reg.pending).into_iter().partition(pick);
        reg.pending = keep;
        let mut out = Vec::new();
        let mut ended = None;
        for p in due {
            let e = if ended.is_none() {
                reg.settle_release(now, cfg, p.session, &p.name, p.delivered)
            } else {
                None
            };
            out.push(Action::ReleaseDecided {
                token: p.token,
                request_id: rid,
                ended: e.clone(),
            });
            if e.is_some() {
                ended = e;
            }
        }
        if ended.is_some() {
            // The waiter that ended it ends it (after its answer): only drop it here.
            let reg = self.regs.remove(&rid).expect("present");
            self.stripes.retain(|_, v| v.0 != rid);
            for p in reg.pending {
                out.push(Action::ReleaseDecided {
                    token: p.token,
                    request_id: rid,
                    ended: None,
                });
            }
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn release(
        &mut self,
        now: Instant,
        cfg: &Config,
        (s, name): (SessionId, &str),
        rid: u64,
        (delivered, attempt): (bool, u64),
        token: ReleaseToken,
    ) -> ReleaseStep {
        let Some(reg) = self.regs.get_mut(&rid) else {
            return ReleaseStep::Now(None);
        };
        // A release of a pull older than the latest one this consumer began (a failed pull's
        // release overtaken by its retry's stripes, which travel on other lanes) speaks for a
        // lease that is no longer there: it changes nothing, so the retry keeps its lease and
        // its own release decides. Only a session that pulled it has a latest pull, so this
        // admits no stranger.
        let latest = reg.attempts.get(&s).copied().unwrap_or(0);
        if attempt != 0 && attempt < latest {
            log::info!(
                "release of request {rid} by {name} ignored: it speaks for pull {attempt}, and \
                 pull {latest} of it began since"
            );
            return ReleaseStep::Now(None);
        }
        // Only a consumer that holds a lease on it (it described or pulled it) or was served
        // some of it may release it; any other session is refused, and nothing changes (its
        // lease deadline included). A consumer that will never pull it rejects it instead.
        if !reg.holders.contains(&s) && !reg.served.contains_key(&s) {
            log::warn!("release of request {rid} by {name} refused: it never pulled it");
            return ReleaseStep::Refused(Error::InvalidArgument(format!(
                "request {rid}: {name} neither pulled nor described it, so it cannot release it \
                 (a consumer that will not pull a request rejects it)"
            )));
        }
        // A delivery is counted only after the stripes still being served to this consumer
        // ended (it may have their bytes before the sender saw its write complete).
        if delivered && reg.serving.get(&s).copied().unwrap_or(0) > 0 {
            reg.pending.push(Pending {
                token,
                session: s,
                name: name.to_string(),
                delivered,
                until: now + cfg.release_wait,
            });
            return ReleaseStep::Wait(token);
        }
        let end = reg.settle_release(now, cfg, s, name, delivered);
        if end.is_some() {
            self.regs.remove(&rid);
            self.stripes.retain(|_, v| v.0 != rid);
        }
        ReleaseStep::Now(end)
    }

    pub(super) fn reject(
        &mut self,
        now: Instant,
        cfg: &Config,
        s: SessionId,
        name: &str,
        rid: u64,
        reason: &str,
    ) -> (bool, Vec<Action>) {
        let reason = bounded_reason(reason);
        let why = format!("consumer {name} rejected the request: {reason}");
        let Some(reg) = self.regs.get_mut(&rid) else {
            let n = self.early.len();
            let mine = self.early.values().filter(|e| e.by.contains(&s)).count();
            match self.early.get_mut(&rid) {
                Some(e) if e.by.contains(&s) || e.by.len() < MAX_EARLY_REJECTS_PER_SESSION => {
                    e.by.insert(s);
                    e.until = now + cfg.lease_ttl;
                }
                Some(_) => {
                    log::warn!("reject of unregistered request {rid} not remembered: too many")
                }
                None if n < MAX_EARLY_REJECTS && mine < MAX_EARLY_REJECTS_PER_SESSION => {
                    self.early.insert(
                        rid,
                        EarlyReject {
                            until: now + cfg.lease_ttl,
                            by: [s].into_iter().collect(),
                            reason: why,
                        },
                    );
                }
                None => log::warn!("reject of unregistered request {rid} not remembered: too many"),
            }
            return (false, Vec::new());
        };
        reg.holders.remove(&s);
        reg.served.remove(&s);
        reg.granted.remove(&s);
        if !reg.rejected_by.insert(s) {
            // This consumer's reject is already counted.
            return (true, Vec::new());
        }
        log::info!("request {rid} rejected by {name}: {reason}");
        // Counting consumer ranks: a reject gives the request up for its whole instance.
        reg.rejects = reg.rejects.saturating_add(if cfg.count_releases_by_rank {
            reg.spec.expected_releases
        } else {
            1
        });
        reg.reject_reason.get_or_insert(why);
        reg.deadline = now + cfg.lease_ttl;
        let end = reg.accounted().then(|| reg.final_outcome());
        (true, end.map(|o| self.end(rid, o)).unwrap_or_default())
    }

    /// This producer refuses request `rid` (it will not serve it: its registration failed or
    /// was given up): a registration of it ends [`SourceOutcome::Unregistered`], and for
    /// [`Config::lease_ttl`] a pull or describe of it fails at once with
    /// [`Error::Cancelled`] carrying `reason` (cut to [`MAX_REJECT_REASON_BYTES`] at a character
    /// boundary and marked with "...", or "no reason given" for an empty one) instead of
    /// "unknown request", which consumers ask again until their pull timeout. A later
    /// registration of the id clears it. At most [`MAX_REFUSALS`] are kept. Returns whether
    /// a registration ended, and the actions.
    pub(super) fn refuse(
        &mut self,
        now: Instant,
        cfg: &Config,
        rid: u64,
        reason: &str,
    ) -> (bool, Vec<Action>) {
        self.refused.retain(|_, r| r.until > now);
        if self.refused.len() >= MAX_REFUSALS && !self.refused.contains_key(&rid) {
            let first = self
                .refused
                .iter()
                .min_by_key(|(id, r)| (r.until, **id))
                .map(|(id, _)| *id);
            if let Some(id) = first {
                log::warn!("refusal of request {id} forgotten: more than {MAX_REFUSALS} kept");
                self.refused.remove(&id);
            }
        }
        let reason = if reason.is_empty() {
            "no reason given".to_string()
        } else {
            bounded_reason(reason).into_owned()
        };
        log::info!("request {rid} refused by this producer: {reason}");
        self.refused.insert(
            rid,
            Refusal {
                until: now + cfg.lease_ttl,
                reason,
            },
        );
        let a = self.end(rid, SourceOutcome::Unregistered);
        (!a.is_empty(), a)
    }

    /// The error for a pull or describe of `rid`, which is not registered: its refusal, or
    /// "unknown request" (which a consumer asks again).
    fn missing(&self, now: Instant, rid: u64) -> Error {
        match self.refused.get(&rid) {
            Some(r) if r.until > now => Error::Cancelled(format!(
                "request {rid} was refused by its producer: {}",
                r.reason
            )),
            _ => unknown(rid),
        }
    }

    /// A session died: registrations it was served some of (it was pulling them) end
    /// `PeerLost`; one it only described or was only refused keeps going (its lease is
    /// dropped: a describe ends nothing); what it was served is forgotten.
    pub(super) fn session_died(
        &mut self,
        now: Instant,
        cfg: &Config,
        s: SessionId,
        why: &str,
    ) -> Vec<Action> {
        let mut held: Vec<u64> = self
            .regs
            .iter()
            .filter(|(_, r)| r.holders.contains(&s) && r.was_served(s))
            .map(|(id, _)| *id)
            .collect();
        held.sort_unstable();
        let mut out = Vec::new();
        for rid in held {
            out.extend(self.end(rid, SourceOutcome::PeerLost(why.to_string())));
        }
        let mut dropped = Vec::new();
        for (rid, r) in self.regs.iter_mut() {
            if r.holders.remove(&s) && r.holders.is_empty() {
                r.deadline = now + cfg.lease_ttl;
            }
            r.served.remove(&s);
            r.serving.remove(&s);
            r.granted.remove(&s);
            r.pending.retain(|p| {
                let gone = p.session == s;
                if gone {
                    dropped.push((*rid, p.token));
                }
                !gone
            });
        }
        self.stripes.retain(|_, v| v.1 != s);
        dropped.sort();
        out.extend(
            dropped
                .into_iter()
                .map(|(rid, token)| Action::ReleaseDecided {
                    token,
                    request_id: rid,
                    ended: None,
                }),
        );
        out
    }

    /// Registrations a session holds leases on.
    pub(super) fn held_by(&self, s: SessionId) -> usize {
        self.regs
            .values()
            .filter(|r| r.holders.contains(&s))
            .count()
    }

    pub(super) fn next_timeout(&self) -> Option<Instant> {
        let regs = self.regs.values().flat_map(|r| {
            let expiry = r.holders.is_empty().then_some(r.deadline);
            expiry.into_iter().chain(r.pending.iter().map(|p| p.until))
        });
        let early = self.early.values().map(|e| e.until);
        let refused = self.refused.values().map(|r| r.until);
        regs.chain(early).chain(refused).min()
    }

    pub(super) fn timeout(&mut self, now: Instant, cfg: &Config) -> Vec<Action> {
        let mut out = Vec::new();
        let mut waited: Vec<u64> = self
            .regs
            .iter()
            .filter(|(_, r)| r.pending.iter().any(|p| p.until <= now))
            .map(|(id, _)| *id)
            .collect();
        waited.sort_unstable();
        for rid in waited {
            out.extend(self.decide(now, cfg, rid, |p| p.until <= now));
        }
        let mut expired: Vec<u64> = self
            .regs
            .iter()
            .filter(|(_, r)| r.holders.is_empty() && r.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        expired.sort_unstable();
        for rid in expired {
            log::info!("lease of request {rid} expired");
            out.extend(self.end(rid, SourceOutcome::Expired));
        }
        self.early.retain(|_, e| e.until > now);
        self.refused.retain(|_, r| r.until > now);
        out
    }

    /// Invariant checks for tests: every stripe being served belongs to a live registration and
    /// is counted in its `serving`.
    #[cfg(test)]
    pub(super) fn check(&self) {
        for (id, (rid, s, _, _)) in &self.stripes {
            let r = self
                .regs
                .get(rid)
                .unwrap_or_else(|| panic!("stripe {id:?} of a gone reg"));
            assert!(
                r.serving.get(s).copied().unwrap_or(0) > 0,
                "{id:?} not counted"
            );
        }
        for r in self.regs.values() {
            let n: u32 = r.serving.values().sum();
            let m = self
                .stripes
                .values()
                .filter(|v| v.0 == r.spec.request_id)
                .count() as u32;
            assert_eq!(n, m, "serving count of request {}", r.spec.request_id);
        }
    }
}

fn unknown(rid: u64) -> Error {
    Error::UnknownRequest(format!("request {rid} is not registered here"))
}
