//! A real endpoint's server side fed one lane of (mostly structured) arbitrary traffic: the
//! handshake decoder (first frame, `Hello`, its size limit), every request handler (`Describe`,
//! `Pull`, `Push`, `PushFinish`, `Release`, `Reject`), stripe geometry validation (index, count, chunk
//! size against the receiver's own plan), the data-chunk sub-header (offset, length, checksum),
//! and stream ends (`StreamDone` byte counts). The endpoint runs over an in-memory transport.
//!
//! Properties: no panic, no hang (the endpoint closes the lane within its timeouts once the input
//! ends), bounded memory (libFuzzer's RSS limit), a push registration that completes holds
//! exactly the planned bytes, and every data frame a pull is answered with carries exactly the
//! bytes of the requested stripe (checked while the input speaks only structured messages).
#![no_main]
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::mpsc;
use tsync::arena::ArenaOptions;
use tsync::layout::{BlockOrder, DType, ModelKv, ParallelLayout, ParallelSpec};
use tsync::net::transport::{
    Acceptor, BoxFut, Connection, Lane, PeerInfo, Transport, TransportKind,
};
use tsync::net::{
    Endpoint, EndpointOptions, SinkRegistration, SourceRegistration, Transfer,
};
use tsync::pattern::RankContents;
use tsync::plan::{spans_digest, Placement, Plan, Span};
use tsync::staging::Staging;
use tsync::wire::{
    checksum, Control, DataHeader, FrameHeader, FrameKind, LaneRole, Stripe, HEADER_LEN,
    PROTOCOL_VERSION,
};

// ------------------------------------------------------------------ in-memory transport

struct MemLane(tokio::io::DuplexStream);

impl AsyncRead for MemLane {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, b)
    }
}

impl AsyncWrite for MemLane {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, b)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl Lane for MemLane {
    fn peer(&self) -> PeerInfo {
        PeerInfo { addr: SocketAddr::from(([127, 0, 0, 1], 1)), identity: None }
    }
}

struct MemAcceptor {
    rx: tokio::sync::Mutex<mpsc::Receiver<Box<dyn Lane>>>,
}

impl Acceptor for MemAcceptor {
    fn local_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 2))
    }
    fn accept(&self) -> BoxFut<'_, tsync::Result<Box<dyn Lane>>> {
        Box::pin(async move {
            self.rx.lock().await.recv().await.ok_or_else(|| tsync::Error::Cancelled("closed".into()))
        })
    }
    fn handshake_failures(&self) -> u64 {
        0
    }
}

struct MemTransport {
    tx: Mutex<Option<mpsc::Sender<Box<dyn Lane>>>>,
}

impl Transport for MemTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn listen(&self, _: SocketAddr) -> BoxFut<'_, tsync::Result<Arc<dyn Acceptor>>> {
        Box::pin(async move {
            let (tx, rx) = mpsc::channel(16);
            *self.tx.lock().unwrap() = Some(tx);
            Ok(Arc::new(MemAcceptor { rx: tokio::sync::Mutex::new(rx) }) as Arc<dyn Acceptor>)
        })
    }
    fn connect(&self, _: SocketAddr) -> BoxFut<'_, tsync::Result<Arc<dyn Connection>>> {
        Box::pin(async { Err(tsync::Error::InvalidArgument("the fuzz endpoint connects nowhere".into())) })
    }
}

// ------------------------------------------------------------------ the fixture

const TOKENS: u32 = 40;
const SINK: u64 = 1;
const SOURCE: u64 = 2;

struct World {
    rt: tokio::runtime::Runtime,
    ep: Endpoint,
    lanes: mpsc::Sender<Box<dyn Lane>>,
    src: Placement,
    dst: Placement,
    /// Source staging (pattern), served for pulls of `SOURCE`.
    src_staging: Arc<Staging>,
    /// Destination staging of the push registration `SINK` (zeroed before every input).
    dst_staging: Arc<Staging>,
    /// Per source rank (the pair `rank -> 0`): spans and the stream's bytes.
    pairs: Vec<(Vec<Span>, Vec<u8>)>,
    sink: Mutex<Option<Transfer>>,
}

fn arena() -> ArenaOptions {
    ArenaOptions { lock: false, huge_pages: false, populate: false }
}

fn staged_bytes(st: &Staging, rank: u32) -> Vec<(u32, u64, *mut u8, u64)> {
    st.ranges(rank)
        .iter()
        .map(|s| {
            let p = st.resolve(rank, s.range.buffer, s.range.offset, s.range.len).unwrap();
            (s.range.buffer, s.range.offset, p, s.range.len)
        })
        .collect()
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let m = ModelKv { name: "fuzz".into(), num_layers: 2, num_kv_heads: 2, head_dim: 8, kv_planes: 2, dtype: DType::Bf16 };
        let spec = |tp, block, order| ParallelSpec { tp, pcp: 1, dp: 1, block_size: block, order };
        let src = Placement { first_token: 0,
            layout: ParallelLayout::new(m.clone(), spec(2, 4, BlockOrder::Nhd), 16).unwrap(),
            dp_rank: 0,
            block_ids: vec![(0..10).rev().collect(), (3..13).collect()],
            groups: None,
        };
        let dst = Placement { first_token: 0,
            layout: ParallelLayout::new(m, spec(1, 8, BlockOrder::Hnd), 8).unwrap(),
            dp_rank: 0,
            block_ids: vec![vec![4, 0, 6, 2, 7]],
            groups: None,
        };
        let plan = Plan::build(&src, &dst, TOKENS).unwrap();
        // Source staging filled with the pattern.
        let ranges: BTreeMap<u32, _> = (0..2).map(|r| (r, src.block_ranges(r))).collect();
        let src_staging = Arc::new(Staging::new(ranges, &arena()).unwrap());
        let kv = src.layout.rank_kv().unwrap();
        let mut buf = vec![0u8; kv.buffer_bytes() as usize];
        for r in 0..2 {
            let c = RankContents::new(&src, r, TOKENS, 5).unwrap();
            for layer in 0..kv.num_layers {
                c.fill_layer(layer, &mut buf).unwrap();
                for (b, off, p, len) in staged_bytes(&src_staging, r) {
                    if b == layer {
                        // SAFETY: a staged range of `len` bytes; nothing else uses it yet.
                        unsafe { std::ptr::copy_nonoverlapping(buf[off as usize..].as_ptr(), p, len as usize) };
                    }
                }
            }
        }
        let pairs = (0..2)
            .map(|s| {
                let spans = plan.pair_spans(s, 0);
                let mut bytes = Vec::new();
                for sp in &spans {
                    for (so, _) in sp.runs() {
                        let p = src_staging.resolve(s, sp.src_buffer, so, sp.len).unwrap();
                        // SAFETY: resolved inside the staging; read-only from here on.
                        bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(p, sp.len as usize) });
                    }
                }
                (spans, bytes)
            })
            .collect();
        let dst_staging = Arc::new(Staging::new(tsync::net::plan_staging(&plan, &dst), &arena()).unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let t = Arc::new(MemTransport { tx: Mutex::new(None) });
        let opts = EndpointOptions {
            name: "fuzz-server".into(),
            listen: Some("127.0.0.1:0".parse().unwrap()),
            io_timeout: Duration::from_millis(300),
            handshake_timeout: Duration::from_millis(300),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1000),
            chunk_bytes: 256,
            ..EndpointOptions::default()
        };
        let ep = rt.block_on(Endpoint::with_transport(opts, t.clone() as Arc<dyn Transport>)).unwrap();
        let lanes = t.tx.lock().unwrap().clone().unwrap();
        World { rt, ep, lanes, src, dst, src_staging, dst_staging, pairs, sink: Mutex::new(None) }
    })
}

impl World {
    /// Fresh registrations for every input (deterministic runs): the source `SOURCE` and the push
    /// destination `SINK` with zeroed staging.
    fn reset(&self) {
        if let Some(t) = self.sink.lock().unwrap().take() {
            t.cancel();
        }
        self.ep.unregister_source(SOURCE);
        for (_, _, p, len) in staged_bytes(&self.dst_staging, 0) {
            // SAFETY: a staged range; the previous input's lane is closed, nothing writes it.
            unsafe { std::ptr::write_bytes(p, 0, len as usize) };
        }
        self.ep
            .register_source(SourceRegistration {
                request_id: SOURCE,
                num_tokens: TOKENS,
                placement: self.src.clone(),
                staging: self.src_staging.clone(),
                layers_ready: None,
                expected_releases: 1,
            })
            .unwrap();
        let t = self
            .ep
            .expect_push(SinkRegistration {
                request_id: SINK,
                num_tokens: TOKENS,
                placement: self.dst.clone(),
                staging: self.dst_staging.clone(),
                dst_ranks: None,
                src: None,
                plan: None,
            })
            .unwrap();
        *self.sink.lock().unwrap() = Some(t);
    }

    /// If the push registration completed, its staging holds exactly the planned bytes.
    fn check_sink(&self) {
        let t = self.sink.lock().unwrap().clone().unwrap();
        if let Some(Ok(_)) = t.poll() {
            let kv = self.dst.layout.rank_kv().unwrap();
            let c = RankContents::new(&self.dst, 0, TOKENS, 6).unwrap();
            let mut buf = vec![0u8; kv.buffer_bytes() as usize];
            for layer in 0..kv.num_layers {
                c.fill_layer(layer, &mut buf).unwrap();
                for (b, off, p, len) in staged_bytes(&self.dst_staging, 0) {
                    if b == layer {
                        // SAFETY: the transfer completed; nothing writes the staging.
                        let got = unsafe { std::slice::from_raw_parts(p, len as usize) };
                        assert!(got == &buf[off as usize..(off + len) as usize], "a completed push holds wrong bytes");
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------ the input

#[derive(Debug, Arbitrary)]
enum Hello {
    Data,
    Control,
    Protocol(u8),
    Raw(Vec<u8>),
    Nothing,
}

#[derive(Debug, Arbitrary)]
struct Geometry {
    pair: bool,
    index: u8,
    count: u8,
    /// Replaces `index`/`count` (huge declared stripe counts).
    raw: Option<(u32, u32)>,
    chunk: u16,
    bad_digest: bool,
    total_delta: i8,
}

#[derive(Debug, Arbitrary)]
enum Step {
    /// Arbitrary bytes.
    Raw(Vec<u8>),
    /// A valid frame header with an arbitrary body.
    Frame { data: bool, rid: u8, body: Vec<u8> },
    Describe { sink: bool, rid: u8 },
    Release { rid: u8 },
    /// The consumer will not pull the request (ends the registration when it is the last).
    Reject { rid: u8 },
    Pull(Geometry),
    Push { g: Geometry, tokens_delta: i8 },
    /// A data frame for chunk `k` of the current push stripe.
    Data { k: u16, flip: Option<u16>, len_delta: i8, offset_delta: i8 },
    /// Every chunk of the current push stripe, genuine, then its `StreamDone`.
    Rest,
    StreamDone { delta: i8 },
    PushFinish { ranks: Vec<u8> },
    /// An honest stripe: `Push`, every chunk, `StreamDone`.
    Honest { pair: bool, index: u8, count: u8, chunk: u16 },
}

#[derive(Debug, Arbitrary)]
struct Input {
    hello: Hello,
    steps: Vec<Step>,
}

fn frame(m: &Control, rid: u64) -> Vec<u8> {
    m.to_frame(rid).unwrap()
}

fn data(rid: u64, offset: u64, payload: &[u8], sum: u64) -> Vec<u8> {
    let mut v = FrameHeader { kind: FrameKind::Data, body_len: (16 + payload.len()) as u32, request_id: rid }.encode().to_vec();
    v.extend_from_slice(&DataHeader { stream_offset: offset, checksum: sum }.encode());
    v.extend_from_slice(payload);
    v
}

fn stripe_of(g: &Geometry) -> Stripe {
    let count = (g.count % 5) as u32;
    let index = if count == 0 { g.index as u32 } else { g.index as u32 % (count + 1) };
    let (index, count) = g.raw.unwrap_or((index, count));
    Stripe { index, count, chunk_bytes: g.chunk as u64 % 2048 }
}

/// Which exchange a response belongs to (for checking pull answers).
enum Exchange {
    Other,
    Pull { pair: usize, stripe: Stripe },
}

struct Script {
    bytes: Vec<u8>,
    /// Exchanges in order, while every message so far is structured (`None`: unknown).
    exchanges: Option<VecDeque<Exchange>>,
}

fn script(w: &World, inp: &Input) -> Script {
    let mut out = Vec::new();
    let mut ex: Option<VecDeque<Exchange>> = Some(VecDeque::new());
    let hello = |role| Control::Hello { name: "fuzz-peer".into(), protocol: PROTOCOL_VERSION, incarnation: 7, role };
    match &inp.hello {
        Hello::Data => out.extend(frame(&hello(LaneRole::Data), 0)),
        Hello::Control => {
            out.extend(frame(&hello(LaneRole::Control), 0));
            ex = None;
        }
        Hello::Protocol(p) => {
            out.extend(frame(&Control::Hello { name: "fuzz-peer".into(), protocol: *p, incarnation: 7, role: LaneRole::Data }, 0));
            ex = None;
        }
        Hello::Raw(b) => {
            out.extend(b.iter().take(4096));
            ex = None;
        }
        Hello::Nothing => ex = None,
    }
    // The current push stripe: (pair, stripe, bytes sent on it).
    let mut cur: Option<(usize, Stripe, u64)> = None;
    let bounds = |pair: usize| -> Vec<u64> {
        // Layer ends of the pair's stream (the endpoint cuts chunks at layer boundaries).
        let spans = &w.pairs[pair].0;
        let mut ends = vec![0u64; 2];
        let mut t = 0;
        for s in spans {
            t += s.bytes();
            ends[(s.src_buffer as usize).min(1)] = t;
        }
        if ends[0] > ends[1] {
            ends[1] = ends[0];
        }
        ends.push(t);
        ends
    };
    let push_msg = |pair: usize, stripe: Stripe, bad_digest: bool, total_delta: i8, tokens_delta: i8| {
        let (spans, bytes) = &w.pairs[pair];
        Control::Push {
            request_id: SINK,
            src_rank: pair as u32,
            dst_rank: 0,
            src: w.src.clone(),
            num_tokens: (TOKENS as i64 + tokens_delta as i64).max(0) as u32,
            digest: spans_digest(spans) ^ bad_digest as u64,
            total_bytes: (bytes.len() as i64 + total_delta as i64).max(0) as u64,
            stripe,
        }
    };
    for step in inp.steps.iter().take(48) {
        match step {
            Step::Raw(b) => {
                out.extend(b.iter().take(4096));
                ex = None;
            }
            Step::Frame { data, rid, body } => {
                let body: Vec<u8> = body.iter().take(4096).copied().collect();
                let kind = if *data { FrameKind::Data } else { FrameKind::Control };
                out.extend(FrameHeader { kind, body_len: body.len() as u32, request_id: *rid as u64 }.encode());
                out.extend(body);
                ex = None;
            }
            Step::Describe { sink, rid } => {
                out.extend(frame(&Control::Describe { request_id: *rid as u64 % 4, sink: *sink }, 0));
                if let Some(e) = ex.as_mut() {
                    e.push_back(Exchange::Other);
                }
            }
            Step::Release { rid } => {
                out.extend(frame(
                    &Control::Release {
                        request_id: *rid as u64 % 4,
                        delivered: *rid % 2 == 0,
                    },
                    0,
                ));
                if let Some(e) = ex.as_mut() {
                    e.push_back(Exchange::Other);
                }
            }
            Step::Reject { rid } => {
                out.extend(frame(
                    &Control::Reject {
                        request_id: *rid as u64 % 4,
                        reason: "fuzz".into(),
                    },
                    0,
                ));
                if let Some(e) = ex.as_mut() {
                    e.push_back(Exchange::Other);
                }
            }
            Step::Pull(g) => {
                let pair = g.pair as usize;
                let stripe = stripe_of(g);
                let (spans, bytes) = &w.pairs[pair];
                out.extend(frame(
                    &Control::Pull {
                        request_id: SOURCE,
                        src_rank: pair as u32,
                        dst_rank: 0,
                        dst: w.dst.clone(),
                        digest: spans_digest(spans) ^ g.bad_digest as u64,
                        total_bytes: (bytes.len() as i64 + g.total_delta as i64).max(0) as u64,
                        stripe,
                        attempt: 0,
                    },
                    SOURCE,
                ));
                if let Some(e) = ex.as_mut() {
                    e.push_back(Exchange::Pull { pair, stripe });
                }
            }
            Step::Push { g, tokens_delta } => {
                let pair = g.pair as usize;
                let stripe = stripe_of(g);
                out.extend(frame(&push_msg(pair, stripe, g.bad_digest, g.total_delta, *tokens_delta), SINK));
                cur = Some((pair, stripe, 0));
                ex = None;
            }
            Step::Data { k, flip, len_delta, offset_delta } => {
                let Some((pair, stripe, sent)) = cur.as_mut() else { continue };
                let chunks: Vec<(u64, u64)> = stripe.chunks_in(bounds(*pair)).take(4096).collect();
                if chunks.is_empty() {
                    continue;
                }
                let (a, b) = chunks[*k as usize % chunks.len()];
                let bytes = &w.pairs[*pair].1;
                let b2 = ((b as i64 + *len_delta as i64).max(a as i64) as u64).min(bytes.len() as u64);
                let mut payload = bytes[a as usize..b2 as usize].to_vec();
                let sum = checksum([&payload[..]]);
                if let (Some(f), false) = (flip, payload.is_empty()) {
                    let i = *f as usize % payload.len();
                    payload[i] ^= 0x40;
                }
                let off = (a as i64 + *offset_delta as i64).max(0) as u64;
                out.extend(data(SINK, off, &payload, sum));
                *sent += payload.len() as u64;
            }
            Step::Rest => {
                let Some((pair, stripe, sent)) = cur.take() else { continue };
                let bytes = &w.pairs[pair].1;
                let mut n = sent;
                for (a, b) in stripe.chunks_in(bounds(pair)).take(4096) {
                    let p = &bytes[a as usize..b as usize];
                    out.extend(data(SINK, a, p, checksum([p])));
                    n += b - a;
                }
                out.extend(frame(&Control::StreamDone { request_id: SINK, bytes: n }, SINK));
            }
            Step::StreamDone { delta } => {
                let Some((_, _, sent)) = cur.take() else { continue };
                out.extend(frame(&Control::StreamDone { request_id: SINK, bytes: (sent as i64 + *delta as i64).max(0) as u64 }, SINK));
            }
            Step::PushFinish { ranks } => {
                let src_ranks = ranks.iter().take(4).map(|&r| r as u32 % 3).collect();
                out.extend(frame(&Control::PushFinish { request_id: SINK, src_ranks, src: w.src.clone(), num_tokens: TOKENS }, SINK));
                ex = None;
            }
            Step::Honest { pair, index, count, chunk } => {
                let pair = *pair as usize;
                let count = 1 + (*count % 3) as u32;
                let stripe = Stripe { index: *index as u32 % count, count, chunk_bytes: 16 + *chunk as u64 % 512 };
                out.extend(frame(&push_msg(pair, stripe, false, 0, 0), SINK));
                let bytes = &w.pairs[pair].1;
                let mut n = 0;
                for (a, b) in stripe.chunks_in(bounds(pair)) {
                    let p = &bytes[a as usize..b as usize];
                    out.extend(data(SINK, a, p, checksum([p])));
                    n += b - a;
                }
                out.extend(frame(&Control::StreamDone { request_id: SINK, bytes: n }, SINK));
                ex = None;
            }
        }
    }
    Script { bytes: out, exchanges: ex }
}

/// Checks the answers to structured pulls: every data frame carries exactly the bytes of the
/// requested stripe's chunk at that offset.
fn check_answers(w: &World, resp: &[u8], mut ex: VecDeque<Exchange>) {
    let mut at = 0;
    let mut first = true;
    while resp.len() >= at + HEADER_LEN {
        let Ok(h) = FrameHeader::decode(&resp[at..]) else { panic!("the endpoint sent a bad frame header") };
        let end = at + HEADER_LEN + h.body_len as usize;
        if end > resp.len() {
            return; // cut by the close
        }
        let body = &resp[at + HEADER_LEN..end];
        at = end;
        if first {
            first = false;
            continue; // HelloAck
        }
        match h.kind {
            FrameKind::Data => {
                let Some(Exchange::Pull { pair, stripe }) = ex.front() else { panic!("data frame outside a pull") };
                let d = DataHeader::decode(body).unwrap();
                let payload = &body[16..];
                let stream = &w.pairs[*pair].1;
                let o = d.stream_offset as usize;
                assert!(o + payload.len() <= stream.len(), "data beyond the stream");
                assert_eq!(payload, &stream[o..o + payload.len()], "pulled bytes differ from the source");
                assert_eq!(checksum([payload]), d.checksum);
                assert!(payload.len() as u64 <= stripe.chunk_bytes);
            }
            // The fuzzed lanes are not same-host (shm) lanes: never data by reference.
            FrameKind::DataRef => panic!("data by reference on a lane without shm"),
            FrameKind::Control => {
                let m = Control::decode(body).expect("the endpoint sends valid control messages");
                match m {
                    Control::StreamDone { .. }
                    | Control::Failed { .. }
                    | Control::Description { .. }
                    | Control::Released { .. }
                    | Control::Rejected { .. } => {
                        ex.pop_front();
                    }
                    _ => {}
                }
            }
        }
    }
}

fuzz_target!(|inp: Input| {
    let w = world();
    w.reset();
    let s = script(w, &inp);
    let resp = w.rt.block_on(async {
        let (client, server) = tokio::io::duplex(1 << 20);
        w.lanes.send(Box::new(MemLane(server))).await.unwrap();
        let (mut rd, mut wr) = tokio::io::split(client);
        let reader = tokio::spawn(async move {
            let mut v = Vec::new();
            let r = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut v)).await;
            assert!(r.is_ok(), "the endpoint kept the lane open 10 s after the input ended (hang)");
            v
        });
        let _ = wr.write_all(&s.bytes).await;
        let _ = wr.shutdown().await;
        drop(wr);
        reader.await.unwrap()
    });
    w.check_sink();
    if let Some(ex) = s.exchanges {
        check_answers(w, &resp, ex);
    }
});
