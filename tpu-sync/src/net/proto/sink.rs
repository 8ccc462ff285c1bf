//! Push registrations (the receiving side of a push): planning from the senders' placement,
//! stripe acceptance, push-finish completion, idle expiry.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use super::{Config, SessionId, StripeId, TransferId, TransferStats};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::Placement;
use crate::wire::Stripe;

/// A push registration as the state machine sees it.
#[derive(Debug, Clone)]
pub(crate) struct SinkSpec {
    pub(crate) request_id: u64,
    pub(crate) num_tokens: u32,
    /// Where the request's blocks go on this side.
    pub(crate) placement: Placement,
    /// Destination ranks hosted here.
    pub(crate) dst_ranks: BTreeSet<u32>,
}

/// One planned pair of a push registration, as the driver computed it from the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlannedPair {
    pub(crate) src_rank: u32,
    pub(crate) dst_rank: u32,
    /// [`crate::plan::spans_digest`] of the pair's spans.
    pub(crate) digest: u64,
    /// Bytes of the pair's stream.
    pub(crate) total: u64,
    /// Spans of the pair.
    pub(crate) spans: u64,
}

/// The plan of a push registration: the senders' placement and the pairs of the destination
/// ranks hosted here (index = the driver's pair index).
#[derive(Debug, Clone)]
pub(crate) struct SinkPlan {
    pub(crate) src: Placement,
    pub(crate) num_tokens: u32,
    pub(crate) pairs: Vec<PlannedPair>,
}

/// A sender's offer of one stripe.
#[derive(Debug, Clone)]
pub(crate) struct PushAsk {
    pub(crate) request_id: u64,
    pub(crate) src_rank: u32,
    pub(crate) dst_rank: u32,
    pub(crate) src: Placement,
    pub(crate) num_tokens: u32,
    pub(crate) digest: u64,
    pub(crate) total_bytes: u64,
    pub(crate) stripe: Stripe,
}

/// An accepted stripe: receive it into pair `pair` (the driver's index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PushGrant {
    /// Report its end with [`super::Proto::handle_push_stripe_end`].
    pub(crate) stripe: StripeId,
    pub(crate) pair: usize,
    /// The registration's transfer.
    pub(crate) transfer: TransferId,
}

struct Slot {
    idx: usize,
    digest: u64,
    total: u64,
    spans: u64,
    count: u32,
    chunk: u64,
    started: Vec<bool>,
    done: Vec<bool>,
}

impl Slot {
    fn complete(&self) -> bool {
        self.count > 0 && self.done.iter().all(|&d| d)
    }
}

struct Sink {
    spec: SinkSpec,
    transfer: TransferId,
    src: Option<Placement>,
    slots: BTreeMap<(u32, u32), Slot>,
    finished_ranks: BTreeSet<u32>,
    senders: HashMap<u32, SessionId>,
    pushers: BTreeSet<SessionId>,
    stripes: u64,
    active: u32,
    last_activity: Instant,
    bytes: u64,
}

impl Sink {
    /// Takes the plan from the first sender's placement, or checks a later sender's against it.
    fn plan(
        &mut self,
        src: &Placement,
        num_tokens: u32,
        plan: Option<Result<SinkPlan>>,
    ) -> Result<()> {
        let rid = self.spec.request_id;
        if num_tokens != self.spec.num_tokens {
            return Err(Error::Mismatch(format!(
                "request {rid}: sender has {num_tokens} tokens, receiver {}",
                self.spec.num_tokens
            )));
        }
        if let Some(known) = &self.src {
            if known != src {
                return Err(Error::Mismatch(format!(
                    "request {rid}: a sender's placement differs from the one already in use"
                )));
            }
            return Ok(());
        }
        let plan = plan.unwrap_or_else(|| {
            Err(Error::Protocol(format!(
                "request {rid}: no plan for the first push"
            )))
        })?;
        if &plan.src != src || plan.num_tokens != num_tokens {
            return Err(Error::Mismatch(format!(
                "request {rid}: the plan was built for another sender placement"
            )));
        }
        self.slots = plan
            .pairs
            .iter()
            .enumerate()
            .filter(|(_, p)| self.spec.dst_ranks.contains(&p.dst_rank))
            .map(|(idx, p)| {
                (
                    (p.src_rank, p.dst_rank),
                    Slot {
                        idx,
                        digest: p.digest,
                        total: p.total,
                        spans: p.spans,
                        count: 0,
                        chunk: 0,
                        started: Vec::new(),
                        done: Vec::new(),
                    },
                )
            })
            .collect();
        self.src = Some(plan.src);
        Ok(())
    }
}

/// How a push-finish left a registration.
pub(super) enum Finish {
    Incomplete,
    Complete(TransferId, TransferStats),
}

/// An error, and the registration's transfer when the error fails it.
type Refusal = (Error, Option<TransferId>);

#[derive(Default)]
pub(super) struct Sinks {
    regs: HashMap<u64, Sink>,
    /// Stripes being received: request, pair, stripe index.
    stripes: HashMap<StripeId, (u64, (u32, u32), u32)>,
}

/// Errors after which a registration cannot complete: a protocol violation or a disagreement
/// about the plan.
fn fatal(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Protocol | ErrorKind::Mismatch)
}

fn expects_none(rid: u64) -> Error {
    Error::UnknownRequest(format!("request {rid} expects no push here"))
}

impl Sinks {
    pub(super) fn len(&self) -> usize {
        self.regs.len()
    }

    pub(super) fn expect(
        &mut self,
        now: Instant,
        spec: SinkSpec,
        t: TransferId,
        src_plan: Option<(Placement, Result<SinkPlan>)>,
    ) -> Result<()> {
        let rid = spec.request_id;
        if self.regs.contains_key(&rid) {
            return Err(Error::InvalidArgument(format!(
                "request {rid} already expects a push"
            )));
        }
        let mut sink = Sink {
            spec,
            transfer: t,
            src: None,
            slots: BTreeMap::new(),
            finished_ranks: BTreeSet::new(),
            senders: HashMap::new(),
            pushers: BTreeSet::new(),
            stripes: 0,
            active: 0,
            last_activity: now,
            bytes: 0,
        };
        if let Some((src, plan)) = src_plan {
            let n = sink.spec.num_tokens;
            sink.plan(&src, n, Some(plan))?;
        }
        self.regs.insert(rid, sink);
        Ok(())
    }

    pub(super) fn describe(&self, rid: u64) -> Result<(Placement, u32)> {
        let k = self.regs.get(&rid).ok_or_else(|| expects_none(rid))?;
        Ok((k.spec.placement.clone(), k.spec.num_tokens))
    }

    pub(super) fn needs_plan(&self, rid: u64) -> Result<Option<(Placement, BTreeSet<u32>)>> {
        let k = self.regs.get(&rid).ok_or_else(|| expects_none(rid))?;
        Ok(k.src
            .is_none()
            .then(|| (k.spec.placement.clone(), k.spec.dst_ranks.clone())))
    }

    pub(super) fn transfer_of(&self, rid: u64) -> Option<TransferId> {
        self.regs.get(&rid).map(|k| k.transfer)
    }

    pub(super) fn is_pushing(&self, rid: u64, s: SessionId) -> bool {
        self.regs.get(&rid).is_some_and(|k| k.pushers.contains(&s))
    }

    pub(super) fn remove_transfer(&mut self, rid: u64, t: TransferId) {
        if self.regs.get(&rid).is_some_and(|k| k.transfer == t) {
            self.regs.remove(&rid);
            self.stripes.retain(|_, v| v.0 != rid);
        }
    }

    pub(super) fn push(
        &mut self,
        now: Instant,
        s: SessionId,
        ask: &PushAsk,
        plan: Option<Result<SinkPlan>>,
        id: StripeId,
    ) -> std::result::Result<PushGrant, Refusal> {
        let rid = ask.request_id;
        let Some(k) = self.regs.get_mut(&rid) else {
            return Err((expects_none(rid), None));
        };
        let t = k.transfer;
        let r = (|| -> Result<usize> {
            ask.stripe.validate()?;
            k.plan(&ask.src, ask.num_tokens, plan)?;
            let (sr, dr) = (ask.src_rank, ask.dst_rank);
            if let Some(owner) = k.senders.get(&sr) {
                if *owner != s {
                    return Err(Error::Protocol(format!(
                        "source rank {sr} of request {rid} is already pushed by another sender"
                    )));
                }
            }
            if k.finished_ranks.contains(&sr) {
                return Err(Error::Protocol(format!(
                    "source rank {sr} of request {rid} already declared itself finished"
                )));
            }
            let slot = k.slots.get_mut(&(sr, dr)).ok_or_else(|| {
                Error::BlockRange(format!(
                    "request {rid}: no bytes planned from source rank {sr} to destination rank \
                     {dr} on this endpoint"
                ))
            })?;
            if slot.digest != ask.digest || slot.total != ask.total_bytes {
                return Err(Error::Mismatch(format!(
                    "plan for ranks {sr}->{dr} of request {rid} differs: receiver has {} bytes \
                     (digest {:016x}), sender {} (digest {:016x})",
                    slot.total, slot.digest, ask.total_bytes, ask.digest
                )));
            }
            ask.stripe.validate_for(ask.total_bytes)?;
            let st = ask.stripe;
            if slot.count == 0 {
                slot.count = st.count;
                slot.chunk = st.chunk_bytes;
                slot.started = vec![false; st.count as usize];
                slot.done = vec![false; st.count as usize];
            } else if slot.count != st.count || slot.chunk != st.chunk_bytes {
                return Err(Error::Protocol(format!(
                    "sender changed its declared stream count for ranks {sr}->{dr} of request \
                     {rid}: {} stripes of {} bytes, now {} of {}",
                    slot.count, slot.chunk, st.count, st.chunk_bytes
                )));
            }
            if std::mem::replace(&mut slot.started[st.index as usize], true) {
                return Err(Error::Protocol(format!(
                    "stripe {} of ranks {sr}->{dr} of request {rid} delivered twice \
                     (over-delivery)",
                    st.index
                )));
            }
            Ok(slot.idx)
        })();
        match r {
            Ok(pair) => {
                k.senders.insert(ask.src_rank, s);
                k.pushers.insert(s);
                k.stripes += 1;
                k.active += 1;
                k.last_activity = now;
                self.stripes
                    .insert(id, (rid, (ask.src_rank, ask.dst_rank), ask.stripe.index));
                Ok(PushGrant {
                    stripe: id,
                    pair,
                    transfer: t,
                })
            }
            Err(e) => {
                let f = fatal(&e).then_some(t);
                Err((e, f))
            }
        }
    }

    /// A received stripe ended; `Some` when its failure fails the registration.
    pub(super) fn stripe_end(
        &mut self,
        now: Instant,
        id: StripeId,
        r: std::result::Result<u64, Error>,
    ) -> Option<(TransferId, Error)> {
        let (rid, pair, index) = self.stripes.remove(&id)?;
        let k = self.regs.get_mut(&rid)?;
        k.active = k.active.saturating_sub(1);
        k.last_activity = now;
        match r {
            Ok(n) => {
                if let Some(slot) = k.slots.get_mut(&pair) {
                    slot.done[index as usize] = true;
                }
                k.bytes += n;
                None
            }
            Err(e) => Some((k.transfer, e)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(
        &mut self,
        now: Instant,
        s: SessionId,
        rid: u64,
        src_ranks: &[u32],
        src: &Placement,
        num_tokens: u32,
        plan: Option<Result<SinkPlan>>,
    ) -> std::result::Result<Finish, Refusal> {
        let Some(k) = self.regs.get_mut(&rid) else {
            return Err((expects_none(rid), None));
        };
        let t = k.transfer;
        k.last_activity = now;
        k.pushers.insert(s);
        let r = (|| -> Result<()> {
            k.plan(src, num_tokens, plan)?;
            for &r in src_ranks {
                if src.local_rank(r).is_none() {
                    return Err(Error::Protocol(format!(
                        "source rank {r} is not in the senders' DP replica"
                    )));
                }
                // A rank with bytes for this registration has one sender; a rank without (no
                // token of the request, or nothing for these destination ranks) may be declared
                // finished by any of the pushers (each pushing the whole replica's empty ranks).
                let has_bytes = k.slots.keys().any(|(sr, _)| *sr == r);
                if has_bytes && k.senders.get(&r).is_some_and(|o| *o != s) {
                    return Err(Error::Protocol(format!(
                        "source rank {r} of request {rid} is pushed by another sender"
                    )));
                }
                let incomplete: Vec<u32> = k
                    .slots
                    .iter()
                    .filter(|((sr, _), slot)| *sr == r && !slot.complete())
                    .map(|((_, d), _)| *d)
                    .collect();
                if !incomplete.is_empty() {
                    return Err(Error::Protocol(format!(
                        "request {rid}: source rank {r} declared itself finished without \
                         delivering its bytes for destination ranks {incomplete:?}"
                    )));
                }
                if has_bytes || !k.senders.contains_key(&r) {
                    k.senders.insert(r, s);
                }
                k.finished_ranks.insert(r);
            }
            Ok(())
        })();
        if let Err(e) = r {
            // Any disagreement at the end means the registration cannot complete.
            return Err((e, Some(t)));
        }
        let all = (0..src.layout.spec.ranks_per_replica()).map(|l| src.global_rank(l));
        let complete = all.into_iter().all(|r| k.finished_ranks.contains(&r))
            && k.slots.values().all(Slot::complete);
        if !complete {
            return Ok(Finish::Incomplete);
        }
        Ok(Finish::Complete(
            t,
            TransferStats {
                bytes: k.bytes,
                spans: k.slots.values().map(|p| p.spans).sum(),
                pairs: k.slots.len() as u64,
                stripes: k.stripes,
                elapsed: Default::default(),
            },
        ))
    }

    /// Registrations `s` was sending to and has unfinished ranks in.
    pub(super) fn sender_died(&self, s: SessionId) -> Vec<(u64, TransferId)> {
        let mut v: Vec<(u64, TransferId)> = self
            .regs
            .iter()
            .filter(|(_, k)| {
                k.senders
                    .iter()
                    .any(|(r, o)| *o == s && !k.finished_ranks.contains(r))
            })
            .map(|(rid, k)| (*rid, k.transfer))
            .collect();
        v.sort();
        v
    }

    pub(super) fn next_timeout(&self, cfg: &Config) -> Option<Instant> {
        self.regs
            .values()
            .filter(|k| k.active == 0)
            .map(|k| k.last_activity + cfg.lease_ttl)
            .min()
    }

    /// Registrations nobody worked on for the lease time (no sender came, or every sender died
    /// before reaching this endpoint).
    pub(super) fn idle(&self, now: Instant, cfg: &Config) -> Vec<(TransferId, Error)> {
        let mut v: Vec<(TransferId, Error)> = self
            .regs
            .values()
            .filter(|k| {
                k.active == 0 && now.saturating_duration_since(k.last_activity) >= cfg.lease_ttl
            })
            .map(|k| {
                (
                    k.transfer,
                    Error::Timeout(format!(
                        "request {}: no push activity for {:?} (no sender came, or every sender \
                         died before reaching this endpoint)",
                        k.spec.request_id, cfg.lease_ttl
                    )),
                )
            })
            .collect();
        v.sort_by_key(|x| x.0);
        v
    }

    /// Invariant checks for tests: no stripe of a slot is done without having started, and
    /// every stripe being received is counted active.
    #[cfg(test)]
    pub(super) fn check(&self) {
        for (rid, k) in &self.regs {
            for slot in k.slots.values() {
                for (s, d) in slot.started.iter().zip(&slot.done) {
                    assert!(*s || !*d, "request {rid}: a stripe done without starting");
                }
            }
            let n = self.stripes.values().filter(|v| v.0 == *rid).count() as u32;
            assert_eq!(n, k.active, "request {rid}: active stripes");
        }
    }
}
