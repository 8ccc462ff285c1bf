//! Two protocol state machines driven against each other with a manual clock and in-memory
//! queues (the `Pair` harness, after quinn-proto's): a consumer (decode) and a producer
//! (prefill). Nothing sleeps: the clock jumps to the next delivery or timer. Deterministic
//! scenario tests, then property tests over random interleavings of messages and clock steps.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::error::ErrorKind;
use crate::layout::{ModelKv, ParallelLayout, ParallelSpec};
use crate::plan::{spans_digest, Plan};
use crate::wire::Stripe;

const TTL: Duration = Duration::from_secs(10);
const HB: Duration = Duration::from_millis(100);
const HB_TIMEOUT: Duration = Duration::from_millis(1000);
const RELEASE_WAIT: Duration = Duration::from_millis(2500);

fn cfg() -> Config {
    Config {
        lease_ttl: TTL,
        heartbeat_interval: HB,
        heartbeat_timeout: HB_TIMEOUT,
        release_wait: RELEASE_WAIT,
        count_releases_by_rank: false,
    }
}

fn placement(spec: &str, tokens: u32, seed: u64) -> Placement {
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = 2;
    let spec = ParallelSpec::parse(spec).unwrap();
    let layout = ParallelLayout::new(m, spec, 24).unwrap();
    // Distinct, scattered block ids (at most 8 per rank here, so no wrap-around).
    let block_ids = (0..spec.ranks_per_replica())
        .map(|local| {
            let n = layout.pcp_chunk(tokens, local / spec.tp).unwrap().len() as u32;
            (0..n).map(|i| i * 3 + seed as u32 + local).collect()
        })
        .collect();
    Placement {
        first_token: 0,
        layout,
        dp_rank: 0,
        block_ids,
        groups: None,
    }
}

/// A request's placements and plan: TP=2 source, TP=1 destination, 100 tokens.
struct Fx {
    src: Placement,
    dst: Placement,
    tokens: u32,
    plan: Arc<Plan>,
}

fn fx() -> Fx {
    let tokens = 100;
    let src = placement("tp=2,block=16", tokens, 0);
    let dst = placement("tp=1,block=32", tokens, 2);
    let plan = Arc::new(Plan::build(&src, &dst, tokens).unwrap());
    Fx {
        src,
        dst,
        tokens,
        plan,
    }
}

/// Consumer -> producer.
#[derive(Debug, Clone)]
enum Up {
    Ping,
    Describe(u64),
    Pull(TransferId, PullAsk),
    Release(u64, bool),
    Reject(u64, String),
}

/// Producer -> consumer.
#[derive(Debug, Clone)]
enum Down {
    Pong,
    /// A stripe ended: bytes, or the error and whether the lane stayed in sync.
    Stripe(TransferId, PullAsk, std::result::Result<u64, (Error, bool)>),
    Released(u64),
    Rejected(u64, bool),
    Described,
}

struct Pulling {
    join: StripeJoin,
    outstanding: u32,
    backoff: Backoff,
}

/// Two endpoints and the queues between them.
struct Pair {
    now: Instant,
    /// The consumer's placement (the producer plans against it).
    dst: Option<Placement>,
    prod: Proto,
    cons: Proto,
    /// The consumer's session at the producer.
    sess: SessionId,
    /// The producer as the consumer's peer.
    peer: PeerId,
    up: VecDeque<(Instant, Up)>,
    down: VecDeque<(Instant, Down)>,
    /// Producer-side stripe completions: (when, stripe, transfer, ask, ok).
    serving: Vec<(Instant, StripeId, TransferId, PullAsk, bool)>,
    /// Consumer-side retries: (when, message).
    later: Vec<(Instant, Up)>,
    latency: Duration,
    serve_time: Duration,
    /// The consumer's heartbeats are not sent (a hung consumer).
    mute_pings: bool,
    /// The producer does not answer heartbeats (a hung producer).
    mute_pongs: bool,
    /// Served stripes of these requests fail (their lane closes), once each.
    fail_serve: Vec<u64>,
    pulls: HashMap<TransferId, Pulling>,
    generations: HashMap<u64, u64>,
    /// Registrations live at the producer (each must end exactly once).
    live: BTreeSet<u64>,
    ended: Vec<(u64, SourceOutcome)>,
    /// Transfer results at the consumer, in order.
    results: Vec<(TransferId, Result<TransferStats>)>,
    answers: Vec<Down>,
    waits: HashMap<ReleaseToken, u64>,
    peers_dead: u32,
    sessions_dead: u32,
}

impl Pair {
    fn new() -> Pair {
        Pair::with_cfg(cfg())
    }

    fn with_cfg(c: Config) -> Pair {
        let now = Instant::now();
        let mut prod = Proto::new(c.clone());
        let mut cons = Proto::new(c);
        let sess = prod.handle_hello(now, "decode", 7).unwrap();
        let a: Vec<Action> = Vec::new();
        assert!(a.is_empty());
        let peer = cons.peer_connected(now);
        Pair {
            now,
            dst: None,
            prod,
            cons,
            sess,
            peer,
            up: VecDeque::new(),
            down: VecDeque::new(),
            serving: Vec::new(),
            later: Vec::new(),
            latency: Duration::from_millis(1),
            serve_time: Duration::from_millis(5),
            mute_pings: false,
            mute_pongs: false,
            fail_serve: Vec::new(),
            pulls: HashMap::new(),
            generations: HashMap::new(),
            live: BTreeSet::new(),
            ended: Vec::new(),
            results: Vec::new(),
            answers: Vec::new(),
            waits: HashMap::new(),
            peers_dead: 0,
            sessions_dead: 0,
        }
    }

    fn register(&mut self, f: &Fx, rid: u64, consumers: u32) -> Result<()> {
        let spec = SourceSpec {
            request_id: rid,
            num_tokens: f.tokens,
            placement: f.src.clone(),
            hosted: [0, 1].into_iter().collect(),
            staged_bytes: 1000 + rid,
            expected_releases: consumers,
        };
        let (g, a) = self.prod.register_source(self.now, spec)?;
        self.generations.insert(rid, g);
        assert!(self.live.insert(rid), "registered twice");
        self.prod_actions(a);
        Ok(())
    }

    /// The consumer pulls `rid` whole (asserting it succeeded) and releases it as delivered.
    fn pull_and_release(&mut self, f: &Fx, rid: u64, streams: u32) {
        let t = self.pull(f, rid, streams, None);
        self.drive();
        assert!(self.result(t).unwrap().is_ok());
        self.send_up(Up::Release(rid, true));
        self.drive();
    }

    /// The consumer starts pulling `rid` (every pair, `streams` stripes each).
    fn pull(&mut self, f: &Fx, rid: u64, streams: u32, wait: Option<Duration>) -> TransferId {
        self.dst = Some(f.dst.clone());
        let t = self.cons.start_transfer(TransferKind::Pull, rid, 500);
        let mut n = 0;
        for (s, d) in f.plan.pairs() {
            let spans = f.plan.pair_spans(s, d);
            let total: u64 = spans.iter().map(|x| x.bytes()).sum();
            let chunk = 4096;
            let count = (total.div_ceil(chunk) as u32).clamp(1, streams);
            for index in 0..count {
                let ask = PullAsk {
                    request_id: rid,
                    src_rank: s,
                    dst_rank: d,
                    digest: spans_digest(&spans),
                    total_bytes: total,
                    stripe: Stripe {
                        index,
                        count,
                        chunk_bytes: chunk,
                    },
                    generation: 0,
                    attempt: t.0,
                };
                self.send_up(Up::Pull(t, ask));
                n += 1;
            }
        }
        self.pulls.insert(
            t,
            Pulling {
                join: StripeJoin::default(),
                outstanding: n,
                backoff: Backoff::new(wait.map(|w| self.now + w)),
            },
        );
        t
    }

    fn send_up(&mut self, m: Up) {
        self.up.push_back((self.now + self.latency, m));
    }

    fn send_down(&mut self, m: Down) {
        self.down.push_back((self.now + self.latency, m));
    }

    fn prod_actions(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::SourceEnded {
                    request_id,
                    outcome,
                } => self.source_ended(request_id, outcome),
                Action::ReleaseDecided {
                    token,
                    request_id,
                    ended,
                } => {
                    assert_eq!(self.waits.remove(&token), Some(request_id), "decided once");
                    self.send_down(Down::Released(request_id));
                    if let Some(o) = ended {
                        self.source_ended(request_id, o);
                    }
                }
                Action::SessionDead { .. } => self.sessions_dead += 1,
                Action::TransferDone { .. } => {}
                a => panic!("producer action {a:?}"),
            }
        }
    }

    fn source_ended(&mut self, rid: u64, o: SourceOutcome) {
        assert!(self.live.remove(&rid), "request {rid} ended twice ({o:?})");
        self.ended.push((rid, o));
    }

    fn cons_actions(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::Ping { .. } => {
                    if !self.mute_pings {
                        self.send_up(Up::Ping);
                    }
                }
                Action::PeerDead { .. } => {
                    self.peers_dead += 1;
                    let running: Vec<TransferId> = self.pulls.keys().copied().collect();
                    for t in running {
                        self.finish_pull(t, Err(Error::PeerClosed("producer died".into())));
                    }
                }
                Action::TransferDone { transfer, result } => {
                    self.pulls.remove(&transfer);
                    self.results.push((transfer, result));
                }
                a => panic!("consumer action {a:?}"),
            }
        }
    }

    fn finish_pull(&mut self, t: TransferId, r: Result<TransferStats>) {
        let a = self.cons.finish_transfer(t, r);
        self.cons_actions(a);
    }

    fn at_producer(&mut self, m: Up) {
        let now = self.now;
        if !self.prod.session_alive(self.sess) {
            // The consumer's lanes to a dead session fail.
            if let Up::Pull(t, ask) = m {
                let e = Error::PeerClosed("session gone".into());
                self.send_down(Down::Stripe(t, ask, Err((e, false))));
            }
            return;
        }
        self.prod.handle_heard(now, self.sess);
        match m {
            Up::Ping => {
                if !self.mute_pongs {
                    self.send_down(Down::Pong);
                }
            }
            Up::Describe(rid) => {
                let _ = self.prod.handle_describe_source(now, self.sess, rid);
                self.send_down(Down::Described);
            }
            Up::Pull(t, mut ask) => {
                // The driver plans outside the state machine, from the registration it names.
                let plan = match self.prod.source_placement(ask.request_id) {
                    Ok((src, tokens, generation)) => {
                        ask.generation = generation;
                        let dst = self.dst.clone().expect("a pull set it");
                        Plan::build(&src, &dst, tokens).map(Arc::new)
                    }
                    Err(e) => Err(e),
                };
                match self.prod.handle_pull(now, self.sess, &ask, plan) {
                    Ok(g) => {
                        let fail = match self.fail_serve.iter().position(|r| *r == ask.request_id) {
                            Some(i) => {
                                self.fail_serve.remove(i);
                                true
                            }
                            None => false,
                        };
                        self.serving
                            .push((now + self.serve_time, g.stripe, t, ask, !fail));
                    }
                    Err(e) => self.send_down(Down::Stripe(t, ask, Err((e, true)))),
                }
            }
            Up::Release(rid, delivered) => {
                match self.prod.handle_release(now, self.sess, rid, delivered, 0) {
                    ReleaseStep::Now(end) => {
                        self.send_down(Down::Released(rid));
                        if let Some(o) = end {
                            self.source_ended(rid, o);
                        }
                    }
                    ReleaseStep::Wait(token) => {
                        self.waits.insert(token, rid);
                    }
                    // A release of a request this consumer never pulled (random order):
                    // refused, nothing changed; the consumer sees its answer.
                    ReleaseStep::Refused(_) => self.send_down(Down::Released(rid)),
                }
            }
            Up::Reject(rid, why) => {
                let (known, a) = self.prod.handle_reject(now, self.sess, rid, &why);
                self.send_down(Down::Rejected(rid, known));
                self.prod_actions(a);
            }
        }
    }

    fn at_consumer(&mut self, m: Down) {
        let now = self.now;
        self.cons.handle_peer_heard(now, self.peer);
        match m {
            Down::Stripe(t, ask, r) => {
                let Some(p) = self.pulls.get_mut(&t) else {
                    return; // the transfer already ended (cancelled, failed)
                };
                if let Err((e, true)) = &r {
                    if e.kind() == ErrorKind::UnknownRequest {
                        if let Some(d) = p.backoff.retry(now) {
                            self.later.push((now + d, Up::Pull(t, ask)));
                            return;
                        }
                    }
                }
                p.outstanding -= 1;
                if let Some(e) = p.join.add(r) {
                    self.finish_pull(t, Err(e));
                } else if p.outstanding == 0 {
                    let p = self.pulls.remove(&t).unwrap();
                    let r = p.join.finish().map(|bytes| TransferStats {
                        bytes,
                        ..Default::default()
                    });
                    self.finish_pull(t, r);
                }
            }
            other => self.answers.push(other),
        }
    }

    /// The earliest pending event that `with_timers` allows.
    fn next_event(&self, with_timers: bool) -> Option<Instant> {
        let mut v: Vec<Instant> = Vec::new();
        v.extend(self.up.front().map(|x| x.0));
        v.extend(self.down.front().map(|x| x.0));
        v.extend(self.serving.iter().map(|x| x.0));
        v.extend(self.later.iter().map(|x| x.0));
        if with_timers {
            v.extend(self.prod.poll_timeout());
            v.extend(self.cons.poll_timeout());
        }
        v.into_iter().min()
    }

    /// Processes everything due at the current time.
    fn run_due(&mut self) {
        let now = self.now;
        for _ in 0..100_000 {
            if let Some((at, _)) = self.up.front() {
                if *at <= now {
                    let (_, m) = self.up.pop_front().unwrap();
                    self.at_producer(m);
                    continue;
                }
            }
            if let Some((at, _)) = self.down.front() {
                if *at <= now {
                    let (_, m) = self.down.pop_front().unwrap();
                    self.at_consumer(m);
                    continue;
                }
            }
            if let Some(i) = self.serving.iter().position(|x| x.0 <= now) {
                let (_, stripe, t, ask, ok) = self.serving.remove(i);
                let a = self.prod.handle_pull_stripe_end(now, stripe, ok);
                self.prod_actions(a);
                let r = if ok {
                    Ok(ask.stripe.bytes(ask.total_bytes))
                } else {
                    Err((
                        Error::PeerClosed("the producer's lane closed".into()),
                        false,
                    ))
                };
                self.send_down(Down::Stripe(t, ask, r));
                continue;
            }
            if let Some(i) = self.later.iter().position(|x| x.0 <= now) {
                let (_, m) = self.later.remove(i);
                self.send_up(m);
                continue;
            }
            if self.prod.poll_timeout().is_some_and(|t| t <= now) {
                let a = self.prod.handle_timeout(now);
                self.prod_actions(a);
                if self.prod.poll_timeout().is_some_and(|t| t <= now) {
                    panic!("producer timer not re-armed");
                }
                continue;
            }
            if self.cons.poll_timeout().is_some_and(|t| t <= now) {
                let a = self.cons.handle_timeout(now);
                self.cons_actions(a);
                continue;
            }
            self.check();
            return;
        }
        panic!("livelock at one instant");
    }

    /// Runs until no message, stripe or retry is in flight (heartbeats and other timers run
    /// only while something is).
    fn drive(&mut self) {
        for _ in 0..100_000 {
            self.run_due();
            let Some(next) = self.next_event(false) else {
                return;
            };
            let next = self.next_event(true).map_or(next, |t| t.min(next));
            self.now = self.now.max(next);
        }
        panic!("drive did not settle");
    }

    /// Moves the clock forward by `d`, running everything due on the way (heartbeats included).
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        for _ in 0..1_000_000 {
            self.run_due();
            match self.next_event(true) {
                Some(t) if t <= end => self.now = self.now.max(t),
                _ => {
                    self.now = end;
                    self.run_due();
                    return;
                }
            }
        }
        panic!("advance did not finish");
    }

    fn check(&self) {
        self.prod.sources.check();
        self.prod.sinks.check();
        let st = self.prod.stats();
        assert_eq!(st.source_registrations, self.live.len() as u64);
    }

    fn outcome(&self, rid: u64) -> Option<SourceOutcome> {
        self.ended
            .iter()
            .rev()
            .find(|(r, _)| *r == rid)
            .map(|x| x.1.clone())
    }

    fn result(&self, t: TransferId) -> Option<&Result<TransferStats>> {
        let v: Vec<_> = self.results.iter().filter(|x| x.0 == t).collect();
        assert!(v.len() <= 1, "transfer {t:?} has {} results", v.len());
        v.first().map(|x| &x.1)
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

#[test]
fn pull_and_release_ends_released_and_frees_everything() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    assert_eq!(p.prod.stats().staged_bytes, 1001);
    let t = p.pull(&f, 1, 3, None);
    p.drive();
    assert_eq!(
        p.result(t).unwrap().as_ref().unwrap().bytes,
        f.plan.total_bytes()
    );
    assert_eq!(p.prod.stats().leases, 1);
    p.send_up(Up::Release(1, p.cons.delivered(1)));
    p.drive();
    assert_eq!(p.outcome(1), Some(SourceOutcome::Released));
    let s = p.prod.stats();
    assert_eq!(
        (s.staged_bytes, s.leases, s.source_registrations),
        (0, 0, 0)
    );
    assert_eq!(p.cons.stats().transfers_in_flight, 0);
}

#[test]
fn lease_expiry() {
    let f = fx();
    let mut p = Pair::new();
    // Nobody holds it: it expires exactly lease_ttl after registration.
    p.register(&f, 1, 1).unwrap();
    p.advance(TTL - Duration::from_millis(1));
    assert_eq!(p.outcome(1), None);
    p.advance(Duration::from_millis(1));
    assert_eq!(p.outcome(1), Some(SourceOutcome::Expired));
    // A live holder keeps it past the TTL (its heartbeats keep the session alive).
    p.register(&f, 2, 1).unwrap();
    p.send_up(Up::Describe(2));
    p.advance(TTL * 3);
    assert_eq!(p.outcome(2), None);
    // A release that is no delivery ends the lease only: it expires a TTL later.
    p.send_up(Up::Release(2, false));
    p.advance(TTL - Duration::from_millis(5));
    assert_eq!(p.outcome(2), None);
    p.advance(Duration::from_millis(10));
    assert_eq!(p.outcome(2), Some(SourceOutcome::Expired));
    assert_eq!(p.prod.stats().staged_bytes, 0);
}

#[test]
fn heartbeat_loss_either_way() {
    let f = fx();
    // A hung consumer: its session dies after the heartbeat timeout, its lease with it. One
    // that was being served request 2 ends it `PeerLost`; request 1, which it only described,
    // goes on (a describe ends nothing) and expires a lease TTL later.
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    p.register(&f, 2, 1).unwrap();
    p.serve_time = Duration::from_secs(60);
    p.send_up(Up::Describe(1));
    let _t = p.pull(&f, 2, 1, None);
    p.advance(HB_TIMEOUT * 2);
    assert_eq!(p.outcome(1), None, "heartbeats keep it");
    assert_eq!(p.outcome(2), None, "heartbeats keep it");
    p.mute_pings = true;
    p.advance(HB_TIMEOUT - Duration::from_millis(200));
    assert_eq!(p.sessions_dead, 0);
    p.advance(Duration::from_millis(300));
    assert_eq!(p.sessions_dead, 1);
    assert!(matches!(p.outcome(2), Some(SourceOutcome::PeerLost(w)) if w.contains("no heartbeat")));
    assert_eq!(p.outcome(1), None, "a describe-only lease ends nothing");
    assert_eq!(p.prod.stats().sessions_lost, 1);
    p.advance(TTL + Duration::from_millis(10));
    assert_eq!(p.outcome(1), Some(SourceOutcome::Expired));
    // A hung producer: the consumer declares it dead and its pull fails.
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    p.serve_time = Duration::from_secs(60);
    let t = p.pull(&f, 1, 2, None);
    p.advance(Duration::from_millis(10));
    p.mute_pongs = true;
    p.advance(HB_TIMEOUT + HB);
    assert_eq!(p.peers_dead, 1);
    assert_eq!(
        p.result(t).unwrap().as_ref().unwrap_err().kind(),
        ErrorKind::PeerClosed
    );
    assert_eq!(p.cons.stats().transfers_in_flight, 0);
}

#[test]
fn a_late_timer_reads_before_it_judges() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    p.send_up(Up::Describe(1));
    p.advance(HB_TIMEOUT);
    // The process did not run for 3 heartbeat timeouts (descheduled): its timer fires late,
    // with the consumer's heartbeats of that time still unread in the socket.
    let late = p.now + HB_TIMEOUT * 3;
    let a = p.prod.handle_timeout(late);
    assert!(
        !a.iter().any(|a| matches!(a, Action::SessionDead { .. })),
        "no verdict on a late tick: {a:?}"
    );
    let a = p.cons.handle_timeout(late);
    assert!(
        !a.iter().any(|a| matches!(a, Action::PeerDead { .. })),
        "{a:?}"
    );
    // The verdicts wait a short recheck, not a heartbeat timeout.
    let again = p.prod.poll_timeout().unwrap();
    assert!(
        again > late && again <= late + super::LATE_TIMER_RECHECK,
        "{again:?}"
    );
    // The readers run first: the heartbeats that arrived are recorded, nobody dies.
    p.prod.handle_heard(late, p.sess);
    p.cons.handle_peer_heard(late, p.peer);
    let a = p.prod.handle_timeout(again);
    assert!(!a.iter().any(|a| matches!(a, Action::SessionDead { .. })));
    let a = p.cons.handle_timeout(again);
    assert!(!a.iter().any(|a| matches!(a, Action::PeerDead { .. })));
    assert_eq!(p.prod.stats().sessions, 1);
    // A peer that really went silent is still judged at the recheck after a late tick.
    let later = again + HB_TIMEOUT * 3;
    let a = p.prod.handle_timeout(later);
    assert!(!a.iter().any(|a| matches!(a, Action::SessionDead { .. })));
    let when = p.prod.poll_timeout().unwrap();
    let a = p.prod.handle_timeout(when);
    assert!(
        a.iter().any(|a| matches!(a, Action::SessionDead { .. })),
        "{a:?}"
    );
}

#[test]
fn release_before_the_last_stripe() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    p.serve_time = Duration::from_millis(50);
    let _t = p.pull(&f, 1, 2, None);
    // The release overtakes the stripes still being sent: it waits for them.
    p.advance(Duration::from_millis(10));
    p.send_up(Up::Release(1, true));
    p.advance(Duration::from_millis(5));
    assert_eq!(p.waits.len(), 1, "deferred");
    assert_eq!(p.outcome(1), None);
    p.drive();
    assert!(p.waits.is_empty());
    assert_eq!(p.outcome(1), Some(SourceOutcome::Released));
    assert!(p.answers.iter().any(|a| matches!(a, Down::Released(1))));

    // The same, but a stripe's send fails: the release is no delivery.
    p.register(&f, 2, 1).unwrap();
    p.fail_serve.push(2);
    let t = p.pull(&f, 2, 2, None);
    p.advance(Duration::from_millis(10));
    p.send_up(Up::Release(2, true));
    p.drive();
    assert!(p.result(t).unwrap().is_err());
    assert_eq!(p.outcome(2), None, "not delivered: still registered");
    // A retry delivers it.
    let t = p.pull(&f, 2, 2, None);
    p.drive();
    assert!(p.result(t).unwrap().is_ok());
    p.send_up(Up::Release(2, p.cons.delivered(2)));
    p.drive();
    assert_eq!(p.outcome(2), Some(SourceOutcome::Released));

    // A stripe that never ends: the release is decided after the wait, not as a delivery.
    p.register(&f, 3, 1).unwrap();
    p.serve_time = Duration::from_secs(3600);
    let _t = p.pull(&f, 3, 1, None);
    p.advance(Duration::from_millis(10));
    p.send_up(Up::Release(3, true));
    p.advance(RELEASE_WAIT + Duration::from_millis(10));
    assert!(p.waits.is_empty());
    assert_eq!(p.outcome(3), None);
}

#[test]
fn refused_pulls_consume_nothing() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    // A stripe whose digest differs: refused (mismatch), no lease.
    p.dst = Some(f.dst.clone());
    let t = p.cons.start_transfer(TransferKind::Pull, 1, 0);
    let (s, d) = f.plan.pairs()[0];
    let ask = PullAsk {
        request_id: 1,
        src_rank: s,
        dst_rank: d,
        digest: 1,
        total_bytes: 1,
        stripe: Stripe {
            index: 0,
            count: 1,
            chunk_bytes: 4096,
        },
        generation: 0,
        attempt: t.0,
    };
    p.pulls.insert(
        t,
        Pulling {
            join: StripeJoin::default(),
            outstanding: 1,
            backoff: Backoff::new(None),
        },
    );
    p.send_up(Up::Pull(t, ask));
    p.drive();
    assert_eq!(
        p.result(t).unwrap().as_ref().unwrap_err().kind(),
        ErrorKind::Mismatch
    );
    assert_eq!(p.prod.stats().leases, 0);
    // The consumer (wrongly) claims delivery: not counted, the producer refused its pair.
    p.send_up(Up::Release(1, true));
    p.drive();
    assert_eq!(p.outcome(1), None);
    let t = p.pull(&f, 1, 2, None);
    p.drive();
    assert!(p.result(t).unwrap().is_ok());
    p.send_up(Up::Release(1, true));
    p.drive();
    assert_eq!(p.outcome(1), Some(SourceOutcome::Released));
}

#[test]
fn reject() {
    let f = fx();
    let mut p = Pair::new();
    // One consumer of two pulls and releases, the other rejects.
    p.register(&f, 1, 2).unwrap();
    p.pull_and_release(&f, 1, 2);
    assert_eq!(p.outcome(1), None);
    // A consumer's repeated reject counts once.
    p.register(&f, 7, 2).unwrap();
    for _ in 0..2 {
        p.send_up(Up::Reject(7, "twice".into()));
        p.drive();
    }
    assert_eq!(p.outcome(7), None, "one consumer of two rejected");
    let other = p.prod.handle_hello(p.now, "decode-2", 9).unwrap();
    let (_, a) = p.prod.handle_reject(p.now, other, 7, "too");
    p.prod_actions(a);
    assert!(matches!(p.outcome(7), Some(SourceOutcome::Rejected(w)) if w.contains("twice")));
    let (known, a) = p.prod.handle_reject(p.now, other, 1, "aborted");
    assert!(known);
    p.prod_actions(a);
    assert!(
        matches!(p.outcome(1), Some(SourceOutcome::Rejected(w)) if w == "consumer decode-2 rejected the request: aborted")
    );
    assert_eq!(p.prod.stats().staged_bytes, 0);
    // A reject before the registration is counted when it comes.
    p.send_up(Up::Reject(2, "refused".into()));
    p.drive();
    assert!(p
        .answers
        .iter()
        .any(|a| matches!(a, Down::Rejected(2, false))));
    p.register(&f, 2, 1).unwrap();
    assert!(matches!(p.outcome(2), Some(SourceOutcome::Rejected(_))));
    // ...but not after the lease time.
    p.send_up(Up::Reject(3, "refused".into()));
    p.advance(TTL + Duration::from_millis(10));
    p.register(&f, 3, 1).unwrap();
    assert_eq!(p.outcome(3), None);
    // A reject while the consumer pulls cuts the registration (its stripes stop counting).
    p.serve_time = Duration::from_millis(100);
    let _t = p.pull(&f, 3, 2, None);
    p.advance(Duration::from_millis(10));
    p.send_up(Up::Reject(3, "gave up".into()));
    p.drive();
    assert!(matches!(p.outcome(3), Some(SourceOutcome::Rejected(_))));
    assert_eq!(p.prod.stats().staged_bytes, 0);
}

#[test]
fn releases_counted_by_consumer_rank() {
    let tokens = 100;
    let fx_to = |dst_tp: u32| {
        let src = placement("tp=2,block=16", tokens, 0);
        let dst = placement(&format!("tp={dst_tp},block=32"), tokens, 2);
        let plan = Arc::new(Plan::build(&src, &dst, tokens).unwrap());
        Fx {
            src,
            dst,
            tokens,
            plan,
        }
    };
    let (two, one) = (fx_to(2), fx_to(1));
    let by_rank = Config {
        count_releases_by_rank: true,
        ..cfg()
    };
    let pulled = |p: &mut Pair, f: &Fx, rid: u64| {
        let t = p.pull(f, rid, 2, None);
        p.drive();
        assert!(p.result(t).unwrap().is_ok());
        p.send_up(Up::Release(rid, true));
        p.drive();
    };
    // Counting endpoints (the default): one consumer endpoint that pulled both destination
    // ranks is one release of the two expected.
    let mut p = Pair::new();
    p.register(&two, 1, 2).unwrap();
    pulled(&mut p, &two, 1);
    assert_eq!(p.outcome(1), None);
    // Counting ranks: the same release speaks for both of its ranks (a JAX runner's endpoint).
    let mut p = Pair::with_cfg(by_rank.clone());
    p.register(&two, 1, 2).unwrap();
    pulled(&mut p, &two, 1);
    assert_eq!(p.outcome(1), Some(SourceOutcome::Released));
    // ...and a consumer served one destination rank counts one (one endpoint per rank).
    p.register(&one, 2, 2).unwrap();
    pulled(&mut p, &one, 2);
    assert_eq!(p.outcome(2), None, "one rank of two released");
    // An undelivered release counts nothing.
    p.register(&two, 3, 2).unwrap();
    let t = p.pull(&two, 3, 2, None);
    p.drive();
    assert!(p.result(t).unwrap().is_ok());
    p.send_up(Up::Release(3, false));
    p.drive();
    assert_eq!(p.outcome(3), None);
    // A reject gives the request up for the whole consumer instance, also before it exists.
    p.register(&two, 4, 4).unwrap();
    p.send_up(Up::Reject(4, "aborted".into()));
    p.drive();
    assert!(matches!(p.outcome(4), Some(SourceOutcome::Rejected(_))));
    p.send_up(Up::Reject(5, "refused".into()));
    p.drive();
    p.register(&two, 5, 3).unwrap();
    assert!(matches!(p.outcome(5), Some(SourceOutcome::Rejected(_))));
}

#[test]
fn pull_waits_for_a_late_registration() {
    let f = fx();
    let mut p = Pair::new();
    let t = p.pull(&f, 1, 2, Some(Duration::from_secs(5)));
    p.advance(Duration::from_millis(300));
    assert!(p.result(t).is_none(), "still asking");
    p.register(&f, 1, 1).unwrap();
    p.drive();
    assert!(p.result(t).unwrap().is_ok());
    // Without the option, at once; with a short one, after it.
    let t = p.pull(&f, 9, 2, None);
    p.drive();
    assert_eq!(
        p.result(t).unwrap().as_ref().unwrap_err().kind(),
        ErrorKind::UnknownRequest
    );
    let t0 = p.now;
    let t = p.pull(&f, 9, 2, Some(Duration::from_millis(200)));
    p.drive();
    assert_eq!(
        p.result(t).unwrap().as_ref().unwrap_err().kind(),
        ErrorKind::UnknownRequest
    );
    assert!(p.now - t0 >= Duration::from_millis(100));
}

/// Issue 25: a producer that refuses a request (its registration failed, or it gave the
/// request up) has its consumers' pulls fail at once with the reason, where "unknown request"
/// would be asked again until the pull's registration wait ran out; a later registration of
/// the id clears the refusal, which also passes after the lease TTL; the refusals kept are
/// bounded.
#[test]
fn a_refused_request_fails_its_pulls_at_once() {
    use super::source::MAX_REFUSALS;
    let f = fx();
    let mut p = Pair::new();
    let reason = "staging D2H of layer 3 failed";
    // A pull waiting for the registration (up to 60 s) ends as soon as the refusal is made.
    let t = p.pull(&f, 1, 2, Some(Duration::from_secs(60)));
    p.advance(Duration::from_millis(50));
    assert!(p.result(t).is_none(), "still asking");
    let t0 = p.now;
    let (existed, a) = p.prod.refuse_source(p.now, 1, reason);
    assert!(!existed);
    p.prod_actions(a);
    p.drive();
    let e = p.result(t).unwrap().as_ref().unwrap_err().clone();
    assert_eq!(e.kind(), ErrorKind::Cancelled, "{e}");
    assert!(e.to_string().contains(reason), "{e}");
    assert!(p.now - t0 < Duration::from_secs(1), "{:?}", p.now - t0);
    let e = p.prod.handle_describe_source(p.now, p.sess, 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Cancelled, "{e}");
    assert_eq!(p.prod.stats().leases, 0);

    // Registered again: served as usual.
    p.register(&f, 1, 1).unwrap();
    p.pull_and_release(&f, 1, 2);
    assert_eq!(p.outcome(1), Some(SourceOutcome::Released));

    // A live registration refused: it ends, nothing stays staged, later pulls fail at once.
    p.register(&f, 2, 1).unwrap();
    let (existed, a) = p.prod.refuse_source(p.now, 2, reason);
    assert!(existed);
    p.prod_actions(a);
    assert_eq!(p.outcome(2), Some(SourceOutcome::Unregistered));
    assert_eq!(p.prod.stats().staged_bytes, 0);
    let t = p.pull(&f, 2, 1, Some(Duration::from_secs(60)));
    p.drive();
    let e = p.result(t).unwrap().as_ref().unwrap_err().clone();
    assert_eq!(e.kind(), ErrorKind::Cancelled, "{e}");

    // The refusal passes with the lease TTL: then "unknown request" again.
    p.advance(TTL + Duration::from_millis(10));
    let t = p.pull(&f, 2, 1, None);
    p.drive();
    let e = p.result(t).unwrap().as_ref().unwrap_err().clone();
    assert_eq!(e.kind(), ErrorKind::UnknownRequest, "{e}");

    // Bounded: past the cap, the refusal that expires first is forgotten.
    for rid in 100..100 + MAX_REFUSALS as u64 + 1 {
        let (_, a) = p.prod.refuse_source(p.now, rid, &"x".repeat(5000));
        assert!(a.is_empty());
        p.advance(Duration::from_nanos(1));
    }
    let e = p
        .prod
        .handle_describe_source(p.now, p.sess, 100)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownRequest, "{e}");
    let e = p
        .prod
        .handle_describe_source(p.now, p.sess, 101)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Cancelled, "{e}");
    assert!(
        e.to_string().len() < 1200,
        "reason kept whole: {} bytes",
        e.to_string().len()
    );
}

/// Issue 24: a new incarnation of a name (a second live endpoint with the same name, e.g. in
/// another container with the same pid) does not end the first one's session or its leases;
/// the old session ends only when it is dead (here: its control lane is lost).
#[test]
fn a_new_incarnation_of_a_live_name_keeps_the_old_session() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    p.send_up(Up::Describe(1));
    p.drive();
    let s2 = p.prod.handle_hello(p.now, "decode", 8).unwrap();
    assert_ne!(s2, p.sess);
    assert!(
        p.prod.session_alive(p.sess),
        "the live old incarnation keeps its session"
    );
    assert!(p.prod.session_alive(s2));
    assert_eq!(p.outcome(1), None);
    assert_eq!(p.prod.stats().leases, 1);
    // Its lane closes: it is dead now; a describe-only lease ends nothing (see below).
    let a = p
        .prod
        .handle_session_lost(p.now, p.sess, "lane closed".into());
    p.prod_actions(a);
    assert!(!p.prod.session_alive(p.sess));
    assert_eq!(p.outcome(1), None);
    assert_eq!(p.prod.stats().leases, 0);
}

/// Issue 24: a session that only described a request (took a lease, pulled nothing) and then
/// disconnected does not end it; the registration stays pullable by its real consumer.
#[test]
fn a_describe_then_disconnect_ends_nothing() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    let stranger = p.prod.handle_hello(p.now, "stranger", 99).unwrap();
    p.prod.handle_describe_source(p.now, stranger, 1).unwrap();
    assert_eq!(p.prod.stats().leases, 1);
    let a = p
        .prod
        .handle_session_lost(p.now, stranger, "lane closed".into());
    p.prod_actions(a);
    assert_eq!(p.outcome(1), None, "a describe ends nothing");
    let t = p.pull(&f, 1, 1, None);
    p.drive();
    assert!(p.result(t).unwrap().is_ok());
}

/// Issue 24: `Release{delivered: true}` from a session that never pulled the request is
/// refused and changes nothing: the real consumer's pull still gets every byte, and only its
/// release ends the registration as released.
#[test]
fn a_release_from_a_session_that_never_pulled_is_refused() {
    let f = fx();
    let mut p = Pair::new();
    p.register(&f, 1, 1).unwrap();
    let stranger = p.prod.handle_hello(p.now, "stranger", 99).unwrap();
    match p.prod.handle_release(p.now, stranger, 1, true, 0) {
        ReleaseStep::Refused(e) => assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}"),
        _ => panic!("a stranger's release must be refused"),
    }
    assert_eq!(p.outcome(1), None);
    assert_eq!(p.prod.stats().source_registrations, 1);
    let t = p.pull(&f, 1, 1, None);
    p.drive();
    assert!(p.result(t).unwrap().is_ok());
    p.send_up(Up::Release(1, true));
    p.drive();
    assert!(matches!(p.outcome(1), Some(SourceOutcome::Released)));
}

/// The non-delivering release of a failed pull that reaches the producer after the consumer's
/// retry began (it travels on the control lane, the retry's stripes on data lanes) speaks for
/// the failed pull only: it leaves the retry's lease alone, and the retry's delivering release
/// ends the registration as released. Without its attempt (an older peer) it ends the lease.
#[test]
fn a_release_of_an_earlier_pull_leaves_the_retry_alone() {
    let f = fx();
    for tagged in [true, false] {
        let mut p = Pair::new();
        p.register(&f, 1, 1).unwrap();
        p.fail_serve.push(1);
        let t1 = p.pull(&f, 1, 1, None);
        p.drive();
        assert!(p.result(t1).unwrap().is_err());
        let t2 = p.pull(&f, 1, 1, None);
        p.drive();
        assert!(p.result(t2).unwrap().is_ok());
        assert_eq!(p.prod.stats().leases, 1);
        let stale = if tagged { t1.0 } else { 0 };
        match p.prod.handle_release(p.now, p.sess, 1, false, stale) {
            ReleaseStep::Now(None) => {}
            _ => panic!("a release that is no delivery ends nothing at once"),
        }
        if !tagged {
            // The old meaning: the consumer's lease and what it was served are gone, so the
            // retry's delivering release is refused and the request waits for its lease.
            assert_eq!(p.prod.stats().leases, 0);
            assert!(matches!(
                p.prod.handle_release(p.now, p.sess, 1, true, 0),
                ReleaseStep::Refused(_)
            ));
            assert_eq!(p.prod.stats().source_registrations, 1);
            continue;
        }
        assert_eq!(p.prod.stats().leases, 1, "the retry keeps its lease");
        match p.prod.handle_release(p.now, p.sess, 1, true, t2.0) {
            ReleaseStep::Now(Some(SourceOutcome::Released)) => {}
            _ => panic!("the retry's delivering release ends the registration"),
        }
        assert_eq!(p.prod.stats().source_registrations, 0);
    }
}

/// Issue 24: reject reasons are kept to [`MAX_REJECT_REASON_BYTES`] and early rejects of one
/// session to [`MAX_EARLY_REJECTS_PER_SESSION`], however many and large a peer sends.
#[test]
fn rejects_of_one_peer_are_bounded() {
    use super::source::{MAX_EARLY_REJECTS_PER_SESSION, MAX_REJECT_REASON_BYTES};
    let f = fx();
    let mut p = Pair::new();
    let big = "\u{e9}".repeat(8 << 20);
    for rid in 0..(MAX_EARLY_REJECTS_PER_SESSION as u64 + 100) {
        let (known, a) = p
            .prod
            .handle_reject(p.now, p.sess, 1000 + rid, &big[..1 << 12]);
        assert!(!known);
        assert!(a.is_empty());
    }
    // The first ones are remembered: a registration of one of them ends rejected at once, its
    // reason cut to the bound (at a character boundary).
    p.register(&f, 1000, 1).unwrap();
    match p.outcome(1000) {
        Some(SourceOutcome::Rejected(r)) => {
            assert!(r.len() <= MAX_REJECT_REASON_BYTES + 64, "{}", r.len());
            assert!(r.ends_with("..."));
        }
        o => panic!("{o:?}"),
    }
    // One past this session's cap was not remembered: it registers and stays.
    let late = 1000 + MAX_EARLY_REJECTS_PER_SESSION as u64 + 50;
    p.register(&f, late, 1).unwrap();
    assert_eq!(p.outcome(late), None);
    // A huge reason on a registered request is cut too.
    p.register(&f, 7, 1).unwrap();
    let (known, a) = p.prod.handle_reject(p.now, p.sess, 7, &big);
    assert!(known);
    p.prod_actions(a);
    match p.outcome(7) {
        Some(SourceOutcome::Rejected(r)) => assert!(r.len() <= MAX_REJECT_REASON_BYTES + 64),
        o => panic!("{o:?}"),
    }
}

/// Issue 24: the early rejects of all peers together are bounded ([`MAX_EARLY_REJECTS`]): four
/// peers at their own cap fill it, and a fifth peer's rejects of unregistered requests are
/// answered but not remembered (its request, registered later, waits for its lease), while the
/// remembered ones still end their registrations at once.
#[test]
fn early_rejects_of_all_peers_together_are_bounded() {
    use super::source::{MAX_EARLY_REJECTS, MAX_EARLY_REJECTS_PER_SESSION};
    let f = fx();
    let mut p = Pair::new();
    let peers = MAX_EARLY_REJECTS / MAX_EARLY_REJECTS_PER_SESSION;
    let mut rid = 10_000u64;
    for i in 0..=peers {
        let s = p
            .prod
            .handle_hello(p.now, &format!("decode-{i}"), i as u64 + 1)
            .unwrap();
        for _ in 0..MAX_EARLY_REJECTS_PER_SESSION {
            let (known, a) = p.prod.handle_reject(p.now, s, rid, "not mine");
            assert!(!known && a.is_empty());
            rid += 1;
        }
    }
    // The first peer's first reject was remembered; the last peer's were not.
    p.register(&f, 10_000, 1).unwrap();
    assert!(matches!(
        p.outcome(10_000),
        Some(SourceOutcome::Rejected(_))
    ));
    let last = rid - 1;
    p.register(&f, last, 1).unwrap();
    assert_eq!(p.outcome(last), None, "past the cap: not remembered");
}

/// Issue 24: at most [`MAX_SESSIONS`] peer sessions; one more hello is refused with a clear
/// error (nothing else changes), and once a session is gone a new peer is admitted.
#[test]
fn peer_sessions_are_capped() {
    let mut p = Proto::new(cfg());
    let now = Instant::now();
    let ids: Vec<SessionId> = (0..MAX_SESSIONS)
        .map(|i| p.handle_hello(now, &format!("peer-{i}"), 1).unwrap())
        .collect();
    let e = p.handle_hello(now, "one-too-many", 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("4096 peer sessions"), "{e}");
    // An existing session's hello (another lane of it) is still answered.
    assert_eq!(p.handle_hello(now, "peer-7", 1).unwrap(), ids[7]);
    let _ = p.handle_session_lost(now, ids[0], "closed".into());
    assert!(p.handle_hello(now, "one-too-many", 1).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Push receptions
// ---------------------------------------------------------------------------------------------

/// A receiver with one push registration for `f` and its sender's session.
struct Sink {
    p: Proto,
    now: Instant,
    s: SessionId,
    t: TransferId,
    f: Fx,
    results: Vec<Result<TransferStats>>,
}

impl Sink {
    fn new() -> Sink {
        let f = fx();
        let now = Instant::now();
        let mut p = Proto::new(cfg());
        let s = p.handle_hello(now, "prefill", 1).unwrap();
        let t = p.start_transfer(TransferKind::PushReceive, 5, 777);
        p.expect_push(
            now,
            SinkSpec {
                request_id: 5,
                num_tokens: f.tokens,
                placement: f.dst.clone(),
                dst_ranks: [0].into_iter().collect(),
            },
            t,
            None,
        )
        .unwrap();
        Sink {
            p,
            now,
            s,
            t,
            f,
            results: Vec::new(),
        }
    }

    fn sink_plan(&self) -> SinkPlan {
        SinkPlan {
            src: self.f.src.clone(),
            num_tokens: self.f.tokens,
            pairs: self
                .f
                .plan
                .pairs()
                .into_iter()
                .map(|(s, d)| {
                    let sp = self.f.plan.pair_spans(s, d);
                    PlannedPair {
                        src_rank: s,
                        dst_rank: d,
                        digest: spans_digest(&sp),
                        total: sp.iter().map(|x| x.bytes()).sum(),
                        spans: sp.len() as u64,
                    }
                })
                .collect(),
        }
    }

    fn ask(&self, pair: usize, index: u32, count: u32, chunk: u64) -> PushAsk {
        let (s, d) = self.f.plan.pairs()[pair];
        let sp = self.f.plan.pair_spans(s, d);
        PushAsk {
            request_id: 5,
            src_rank: s,
            dst_rank: d,
            src: self.f.src.clone(),
            num_tokens: self.f.tokens,
            digest: spans_digest(&sp),
            total_bytes: sp.iter().map(|x| x.bytes()).sum(),
            stripe: Stripe {
                index,
                count,
                chunk_bytes: chunk,
            },
        }
    }

    fn push(&mut self, s: SessionId, ask: &PushAsk) -> Result<PushGrant> {
        let plan = match self.p.sink_needs_plan(ask.request_id) {
            Ok(Some(_)) => Some(Ok(self.sink_plan())),
            _ => None,
        };
        let (r, a) = self.p.handle_push(self.now, s, ask, plan);
        self.actions(a);
        r
    }

    fn end(&mut self, g: PushGrant, r: std::result::Result<u64, Error>) {
        let a = self.p.handle_push_stripe_end(self.now, g.stripe, r);
        self.actions(a);
    }

    fn finish(&mut self, s: SessionId) -> Result<bool> {
        let plan = match self.p.sink_needs_plan(5) {
            Ok(Some(_)) => Some(Ok(self.sink_plan())),
            _ => None,
        };
        let src = self.f.src.clone();
        let (r, a) = self
            .p
            .handle_push_finish(self.now, s, 5, &[0, 1], &src, self.f.tokens, plan);
        self.actions(a);
        r
    }

    fn actions(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::TransferDone { transfer, result } => {
                    assert_eq!(transfer, self.t);
                    self.results.push(result);
                }
                Action::SessionDead { .. } | Action::SourceEnded { .. } => {}
                a => panic!("{a:?}"),
            }
        }
        assert!(self.results.len() <= 1, "one result: {:?}", self.results);
        self.p.sinks.check();
    }

    /// Pushes every stripe of every pair (one stripe per pair) and declares the ranks finished.
    fn complete(&mut self) -> Vec<PushGrant> {
        let mut gs = Vec::new();
        for pair in 0..self.f.plan.pairs().len() {
            let ask = self.ask(pair, 0, 1, 1 << 20);
            let g = self.push(self.s, &ask).unwrap();
            self.end(g, Ok(ask.total_bytes));
            gs.push(g);
        }
        gs
    }
}

#[test]
fn duplicate_and_late_stripes_and_geometry() {
    let mut k = Sink::new();
    let a = k.ask(0, 0, 2, 8192);
    let g = k.push(k.s, &a).unwrap();
    // The same stripe again: over-delivery, the registration fails.
    let e = k.push(k.s, &a).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol);
    assert!(e.to_string().contains("delivered twice"), "{e}");
    assert_eq!(k.results.len(), 1);
    assert!(k.results[0].is_err());
    // Its stripe ending late changes nothing; a later stripe finds no registration.
    k.end(g, Ok(100));
    let e = k.push(k.s, &k.ask(0, 1, 2, 8192)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownRequest);
    assert_eq!(k.p.stats().sink_registrations, 0);
    assert_eq!(k.p.stats().staged_bytes, 0);

    // Another stream count, then another chunk size, for the same pair.
    let mut k = Sink::new();
    k.push(k.s, &k.ask(0, 0, 2, 8192)).unwrap();
    let e = k.push(k.s, &k.ask(0, 1, 3, 8192)).unwrap_err();
    assert!(
        e.to_string().contains("changed its declared stream count"),
        "{e}"
    );
    let mut k = Sink::new();
    k.push(k.s, &k.ask(0, 0, 2, 8192)).unwrap();
    let e = k.push(k.s, &k.ask(0, 1, 2, 4096)).unwrap_err();
    assert!(
        e.to_string().contains("changed its declared stream count"),
        "{e}"
    );
    // A digest that differs.
    let mut k = Sink::new();
    let mut a = k.ask(0, 0, 1, 8192);
    a.digest ^= 1;
    assert_eq!(k.push(k.s, &a).unwrap_err().kind(), ErrorKind::Mismatch);
    assert!(k.results[0].is_err());
    // A rank pushed by a second sender.
    let mut k = Sink::new();
    k.push(k.s, &k.ask(0, 0, 2, 8192)).unwrap();
    let other = k.p.handle_hello(k.now, "prefill-2", 3).unwrap();
    assert_eq!(
        k.push(other, &k.ask(0, 1, 2, 8192)).unwrap_err().kind(),
        ErrorKind::Protocol
    );
    // Finished without the bytes.
    let mut k = Sink::new();
    assert!(k.finish(k.s).unwrap_err().to_string().contains("without"));
    assert!(k.results[0].is_err());
    // Complete, then a late stripe.
    let mut k = Sink::new();
    k.complete();
    assert!(k.finish(k.s).unwrap());
    assert_eq!(k.results.len(), 1);
    assert_eq!(k.results[0].as_ref().unwrap().bytes, k.f.plan.total_bytes());
    let e = k.push(k.s, &k.ask(0, 0, 1, 1 << 20)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownRequest);
}

#[test]
fn cancel_racing_a_completion() {
    // The completion first: the cancel finds nothing.
    let mut k = Sink::new();
    k.complete();
    assert!(k.finish(k.s).unwrap());
    let a = k.p.handle_remote_cancel(k.s, 5, true);
    assert!(a.is_empty());
    assert!(k.results[0].is_ok());
    // The cancel first: the finish finds no registration.
    let mut k = Sink::new();
    k.complete();
    let a = k.p.handle_remote_cancel(k.s, 5, true);
    k.actions(a);
    assert_eq!(k.finish(k.s).unwrap_err().kind(), ErrorKind::UnknownRequest);
    assert_eq!(
        k.results[0].as_ref().unwrap_err().kind(),
        ErrorKind::Cancelled
    );
    // A local cancel and a completion of a pull in the same instant: the first wins.
    let mut p = Proto::new(cfg());
    let t = p.start_transfer(TransferKind::Pull, 1, 10);
    assert_eq!(p.finish_transfer(t, Ok(TransferStats::default())).len(), 1);
    assert!(p
        .finish_transfer(t, Err(Error::Cancelled("late".into())))
        .is_empty());
    assert!(p.delivered(1));
    let t = p.start_transfer(TransferKind::Pull, 2, 10);
    assert_eq!(
        p.finish_transfer(t, Err(Error::Cancelled("first".into())))
            .len(),
        1
    );
    assert!(p
        .finish_transfer(t, Ok(TransferStats::default()))
        .is_empty());
    assert!(!p.delivered(2), "a cancelled pull is no delivery");
    assert_eq!(p.stats().staged_bytes, 0);
}

/// Issue 24: only a push's sender can cancel it. A session that never offered the push a
/// stripe (a stranger that connected and said `Cancel{push: true}`, a decode that only pulls)
/// is ignored, before and after the real sender's first stripe; the push then completes with
/// every byte. The sender itself can still cancel.
#[test]
fn a_cancel_of_a_push_from_a_session_that_is_not_its_sender_is_ignored() {
    let mut k = Sink::new();
    let stranger = k.p.handle_hello(k.now, "stranger", 9).unwrap();
    // Before any stripe: nobody is a sender yet.
    assert!(k.p.handle_remote_cancel(stranger, 5, true).is_empty());
    assert!(k.p.handle_remote_cancel(k.s, 5, true).is_empty());
    let a = k.ask(0, 0, 1, 1 << 20);
    let g = k.push(k.s, &a).unwrap();
    // While the real sender pushes: the stranger's cancel, push flag or not, changes nothing.
    assert!(k.p.handle_remote_cancel(stranger, 5, true).is_empty());
    assert!(k.p.handle_remote_cancel(stranger, 5, false).is_empty());
    assert!(k.results.is_empty());
    assert_eq!(k.p.stats().sink_registrations, 1);
    k.end(g, Ok(a.total_bytes));
    for pair in 1..k.f.plan.pairs().len() {
        let a = k.ask(pair, 0, 1, 1 << 20);
        let g = k.push(k.s, &a).unwrap();
        k.end(g, Ok(a.total_bytes));
    }
    assert!(k.finish(k.s).unwrap());
    assert_eq!(k.results.len(), 1);
    assert_eq!(k.results[0].as_ref().unwrap().bytes, k.f.plan.total_bytes());
    // The real sender's cancel, mid-push, ends it as cancelled.
    let mut k = Sink::new();
    let a = k.ask(0, 0, 1, 1 << 20);
    let g = k.push(k.s, &a).unwrap();
    k.end(g, Ok(a.total_bytes));
    let acts = k.p.handle_remote_cancel(k.s, 5, true);
    k.actions(acts);
    assert_eq!(
        k.results[0].as_ref().unwrap_err().kind(),
        ErrorKind::Cancelled
    );
}

#[test]
fn sender_death_and_idle_registrations() {
    // A sender dies with a stripe delivered and its ranks unfinished: the registration fails.
    let mut k = Sink::new();
    let a = k.ask(0, 0, 1, 1 << 20);
    let g = k.push(k.s, &a).unwrap();
    k.end(g, Ok(a.total_bytes));
    let acts = k.p.handle_session_lost(k.now, k.s, "closed".into());
    k.actions(acts);
    assert_eq!(
        k.results[0].as_ref().unwrap_err().kind(),
        ErrorKind::PeerClosed
    );
    // Nobody comes: it fails after the lease time, not before.
    let mut k = Sink::new();
    let a = k.p.handle_timeout(k.now + TTL - Duration::from_millis(1));
    assert!(a.iter().all(|a| !matches!(a, Action::TransferDone { .. })));
    let when = k.p.poll_timeout().unwrap();
    assert!(when <= k.now + TTL);
    let a = k.p.handle_timeout(k.now + TTL);
    k.actions(
        a.into_iter()
            .filter(|a| matches!(a, Action::TransferDone { .. }))
            .collect(),
    );
    assert_eq!(
        k.results[0].as_ref().unwrap_err().kind(),
        ErrorKind::Timeout
    );
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Register(u64, u32),
    Pull(u64, u32, bool),
    Describe(u64),
    Release(u64, bool),
    Reject(u64),
    Unregister(u64),
    FailNextServe(u64),
    Cancel,
    Advance(u64),
    MutePings(bool),
    MutePongs(bool),
    Reconnect,
    Drive,
}

fn op() -> impl Strategy<Value = Op> {
    let rid = 1u64..4;
    prop_oneof![
        4 => (rid.clone(), 1u32..3).prop_map(|(r, n)| Op::Register(r, n)),
        4 => (rid.clone(), 1u32..4, any::<bool>()).prop_map(|(r, s, w)| Op::Pull(r, s, w)),
        1 => rid.clone().prop_map(Op::Describe),
        3 => (rid.clone(), any::<bool>()).prop_map(|(r, d)| Op::Release(r, d)),
        1 => rid.clone().prop_map(Op::Reject),
        1 => rid.clone().prop_map(Op::Unregister),
        1 => rid.prop_map(Op::FailNextServe),
        1 => Just(Op::Cancel),
        2 => (0u64..3000).prop_map(Op::Advance),
        1 => any::<bool>().prop_map(Op::MutePings),
        1 => any::<bool>().prop_map(Op::MutePongs),
        1 => Just(Op::Reconnect),
        3 => Just(Op::Drive),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random interleavings of registrations, pulls, releases, rejects, faults and clock steps:
    /// every registration ends exactly once (the harness asserts it at every end), every
    /// deferred release is answered exactly once, every transfer has exactly one result, and
    /// once everything is over, the producer holds no registration, lease or staged byte.
    #[test]
    fn pulls_releases_and_rejects_in_any_order(ops in proptest::collection::vec(op(), 1..60)) {
        let f = fx();
        let mut p = Pair::new();
        p.serve_time = Duration::from_millis(7);
        let mut incarnation = 7;
        for op in ops {
            match op {
                Op::Register(r, n) => {
                    let known = p.live.contains(&r);
                    prop_assert_eq!(p.register(&f, r, n).is_err(), known);
                }
                Op::Pull(r, s, w) => {
                    p.pull(&f, r, s, w.then_some(Duration::from_millis(500)));
                }
                Op::Describe(r) => p.send_up(Up::Describe(r)),
                Op::Release(r, d) => p.send_up(Up::Release(r, d)),
                Op::Reject(r) => p.send_up(Up::Reject(r, "no".into())),
                Op::Unregister(r) => {
                    if let Some(a) = p.prod.unregister_source(r) {
                        p.prod_actions(a);
                    }
                }
                Op::FailNextServe(r) => p.fail_serve.push(r),
                Op::Cancel => {
                    if let Some(t) = p.pulls.keys().min().copied() {
                        p.finish_pull(t, Err(Error::Cancelled("caller".into())));
                    }
                }
                Op::Advance(ms) => p.advance(Duration::from_millis(ms)),
                Op::MutePings(m) => p.mute_pings = m,
                Op::MutePongs(m) => p.mute_pongs = m,
                Op::Reconnect => {
                    incarnation += 1;
                    let s = p.prod.handle_hello(p.now, "decode", incarnation).unwrap();
                    p.sess = s;
                    let a = p.cons.peer_connected(p.now);
                    p.cons.peer_gone(p.peer);
                    p.peer = a;
                }
                Op::Drive => p.drive(),
            }
        }
        // Let everything in flight finish, then let the consumer go silent: its session dies,
        // its leases end, unheld registrations expire.
        p.mute_pings = false;
        p.mute_pongs = false;
        p.drive();
        p.mute_pings = true;
        p.advance(TTL + HB_TIMEOUT + RELEASE_WAIT + Duration::from_secs(1));
        prop_assert!(p.live.is_empty(), "still registered: {:?}", p.live);
        prop_assert!(p.waits.is_empty());
        let s = p.prod.stats();
        prop_assert_eq!((s.source_registrations, s.leases, s.staged_bytes), (0, 0, 0));
        prop_assert!(p.pulls.is_empty(), "pulls without a result");
        prop_assert_eq!(p.cons.stats().transfers_in_flight, 0);
        let ids: HashSet<TransferId> = p.results.iter().map(|x| x.0).collect();
        prop_assert_eq!(ids.len(), p.results.len(), "a transfer with two results");
    }
}

#[derive(Debug, Clone)]
enum PushOp {
    /// Offer stripe `index` of `count` (chunk 4096 << `chunk`) of pair `pair` from sender `who`.
    Push {
        who: usize,
        pair: usize,
        index: u32,
        count: u32,
        chunk: u32,
    },
    /// The oldest stripe being received ends, verified or not.
    End(bool),
    Finish(usize),
    RemoteCancel(usize, bool),
    LocalCancel,
    SenderLost(usize),
    Advance(u64),
}

fn push_op() -> impl Strategy<Value = PushOp> {
    prop_oneof![
        4 => (0usize..2, 0usize..2, 0u32..3, 1u32..3, 0u32..2).prop_map(|(who, pair, index, count, chunk)| PushOp::Push { who, pair, index, count, chunk }),
        4 => any::<bool>().prop_map(PushOp::End),
        1 => (0usize..2).prop_map(PushOp::Finish),
        1 => (0usize..2, any::<bool>()).prop_map(|(w, p)| PushOp::RemoteCancel(w, p)),
        1 => Just(PushOp::LocalCancel),
        1 => (0usize..2).prop_map(PushOp::SenderLost),
        1 => (0u64..20_000).prop_map(PushOp::Advance),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random pushes, duplicates, stripe ends, finishes, cancels, sender deaths and clock steps
    /// into one push registration: no stripe is accepted twice, the registration has exactly
    /// one result, and afterwards nothing is left (no registration, no staged byte).
    #[test]
    fn pushes_in_any_order(ops in proptest::collection::vec(push_op(), 1..60)) {
        let mut k = Sink::new();
        let s2 = k.p.handle_hello(k.now, "prefill-2", 2).unwrap();
        let senders = [k.s, s2];
        let npairs = k.f.plan.pairs().len();
        let mut accepted: HashSet<(usize, u32)> = HashSet::new();
        let mut receiving: VecDeque<(PushGrant, u64)> = VecDeque::new();
        for op in ops {
            match op {
                PushOp::Push { who, pair, index, count, chunk } => {
                    let pair = pair % npairs;
                    let ask = k.ask(pair, index, count, 4096 << chunk);
                    if let Ok(g) = k.push(senders[who], &ask) {
                        prop_assert!(accepted.insert((g.pair, index)), "stripe accepted twice");
                        receiving.push_back((g, ask.stripe.bytes(ask.total_bytes)));
                    }
                }
                PushOp::End(ok) => {
                    if let Some((g, n)) = receiving.pop_front() {
                        k.end(g, if ok { Ok(n) } else { Err(Error::Checksum("bad".into())) });
                    }
                }
                PushOp::Finish(who) => { let _ = k.finish(senders[who]); }
                PushOp::RemoteCancel(who, push) => {
                    let a = k.p.handle_remote_cancel(senders[who], 5, push);
                    k.actions(a);
                }
                PushOp::LocalCancel => {
                    let a = k.p.finish_transfer(k.t, Err(Error::Cancelled("caller".into())));
                    k.actions(a);
                }
                PushOp::SenderLost(who) => {
                    let a = k.p.handle_session_lost(k.now, senders[who], "gone".into());
                    k.actions(a);
                }
                PushOp::Advance(ms) => {
                    k.now += Duration::from_millis(ms);
                    let a: Vec<Action> = k.p.handle_timeout(k.now).into_iter()
                        .filter(|a| matches!(a, Action::TransferDone { .. }))
                        .collect();
                    k.actions(a);
                }
            }
        }
        while let Some((g, n)) = receiving.pop_front() {
            k.end(g, Ok(n));
        }
        let a = k.p.handle_timeout(k.now + TTL * 2);
        k.actions(a.into_iter().filter(|a| matches!(a, Action::TransferDone { .. })).collect());
        prop_assert_eq!(k.results.len(), 1);
        let s = k.p.stats();
        prop_assert_eq!((s.sink_registrations, s.staged_bytes, s.transfers_in_flight), (0, 0, 0));
    }
}
