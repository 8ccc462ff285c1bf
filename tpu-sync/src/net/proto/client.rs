//! Client-side rules: peer liveness (when to ping, when a silent peer is dead), how a transfer's
//! stripes combine into one result, the retry schedule of a pull waiting for a registration, and
//! the memory of failed pulls.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::{Action, Config, PeerId};
use crate::error::{Error, ErrorKind, Result};

struct PeerLive {
    last_heard: Instant,
    next_ping: Instant,
    seq: u64,
}

#[derive(Default)]
pub(super) struct Peers {
    live: HashMap<PeerId, PeerLive>,
}

impl Peers {
    pub(super) fn connect(&mut self, now: Instant, _cfg: &Config, p: PeerId) {
        self.live.insert(
            p,
            PeerLive {
                last_heard: now,
                next_ping: now,
                seq: 0,
            },
        );
    }

    pub(super) fn heard(&mut self, now: Instant, p: PeerId) {
        if let Some(x) = self.live.get_mut(&p) {
            x.last_heard = x.last_heard.max(now);
        }
    }

    pub(super) fn remove(&mut self, p: PeerId) {
        self.live.remove(&p);
    }

    pub(super) fn next_timeout(&self, cfg: &Config) -> Option<Instant> {
        self.live
            .values()
            .map(|x| x.next_ping.min(x.last_heard + cfg.heartbeat_timeout))
            .min()
    }

    /// Pings due peers; with `judge`, declares dead those silent past `heartbeat_timeout`
    /// (without it, the late-timer guard of [`super::Proto::handle_timeout`] holds verdicts).
    pub(super) fn timeout(&mut self, now: Instant, cfg: &Config, judge: bool) -> Vec<Action> {
        let mut ids: Vec<PeerId> = self.live.keys().copied().collect();
        ids.sort();
        let mut out = Vec::new();
        for p in ids {
            let x = self.live.get_mut(&p).expect("listed");
            if judge && now.saturating_duration_since(x.last_heard) >= cfg.heartbeat_timeout {
                self.live.remove(&p);
                out.push(Action::PeerDead {
                    peer: p,
                    why: format!("no heartbeat answer for {:?}", cfg.heartbeat_timeout),
                });
                continue;
            }
            if now >= x.next_ping {
                x.seq += 1;
                x.next_ping = now + cfg.heartbeat_interval;
                out.push(Action::Ping {
                    peer: p,
                    seq: x.seq,
                });
            }
        }
        out
    }
}

/// A bounded set of request ids, oldest forgotten first.
pub(super) struct Recent {
    set: HashSet<u64>,
    order: VecDeque<u64>,
    cap: usize,
}

impl Recent {
    pub(super) fn new(cap: usize) -> Recent {
        Recent {
            set: HashSet::new(),
            order: VecDeque::new(),
            cap,
        }
    }

    /// Records the outcome of a pull of `rid`: a failure is remembered, a success forgets it.
    pub(super) fn note(&mut self, rid: u64, ok: bool) {
        if ok {
            self.set.remove(&rid);
            return;
        }
        if self.set.insert(rid) {
            self.order.push_back(rid);
        }
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    pub(super) fn contains(&self, rid: u64) -> bool {
        self.set.contains(&rid)
    }
}

/// Combines the results of a transfer's stripes. A stripe whose lane stayed in frame sync (a
/// checksum mismatch, an error the peer answered with: `soft`) lets the others finish, so their
/// lanes stay reusable; any other failure ends the transfer at once. The most telling error
/// wins: a corrupt chunk, then a cause, over its consequences (a receiver that already dropped
/// the failed request, a cancellation).
#[derive(Debug, Default)]
pub(crate) struct StripeJoin {
    bytes: u64,
    first: Option<Error>,
}

fn telling(e: &Error) -> u8 {
    match e.kind() {
        ErrorKind::Checksum => 3,
        ErrorKind::UnknownRequest | ErrorKind::Cancelled => 1,
        _ => 2,
    }
}

impl StripeJoin {
    /// A stripe ended: `Ok(bytes)`, or its error and whether it was soft. Returns the error that
    /// ends the transfer now (abort the other stripes), if any.
    #[must_use]
    pub(crate) fn add(&mut self, r: std::result::Result<u64, (Error, bool)>) -> Option<Error> {
        match r {
            Ok(n) => {
                self.bytes += n;
                None
            }
            Err((e, false)) => Some(e),
            Err((e, true)) => {
                if self.first.as_ref().is_none_or(|f| telling(&e) > telling(f)) {
                    self.first = Some(e);
                }
                None
            }
        }
    }

    /// After every stripe ended: the bytes moved, or the most telling soft error.
    pub(crate) fn finish(self) -> Result<u64> {
        match self.first {
            Some(e) => Err(e),
            None => Ok(self.bytes),
        }
    }
}

/// The retry schedule of a stripe whose source does not know the request yet: 2 ms, doubling,
/// at most 100 ms, while the next attempt starts before `until`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    until: Option<Instant>,
}

impl Backoff {
    /// No retries when `until` is `None`.
    pub(crate) fn new(until: Option<Instant>) -> Backoff {
        Backoff {
            next: Duration::from_millis(2),
            until,
        }
    }

    /// The delay before the next attempt, or `None` when the deadline does not allow one.
    #[must_use]
    pub(crate) fn retry(&mut self, now: Instant) -> Option<Duration> {
        let d = self.next;
        if self.until.is_none_or(|u| now + d >= u) {
            return None;
        }
        self.next = (d * 2).min(Duration::from_millis(100));
        Some(d)
    }
}
