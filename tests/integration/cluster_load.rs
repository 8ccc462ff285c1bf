//! The remote tier's device path on loopback (`cluster::load_to_device`): a producer of one
//! layout serves its ranks' host tiers, a consumer of another layout loads the present prefix of
//! a prompt into its PJRT device blocks, resharded, byte-exact, every other byte unchanged.
//! Layout pairs (TP split, block size, block order, partial last blocks); a block missing,
//! evicted or corrupt at the producer (a shorter prefix, never wrong bytes); failures (a dead
//! producer, a store of another namespace, bad requests, a budget too small) that leave the
//! destination blocks untouched. No etcd needed: the addresses are given directly.

use crate::common;
use crate::port_util;
use crate::store_util;

use std::collections::BTreeMap;
use std::time::Duration;

use tpu_sync::budget::StagingBudget;
use tpu_sync::cluster::remote::{RemoteOptions, RemoteServer};
use tpu_sync::cluster::{load_to_device, LoadOptions, LoadReport, RemoteLoad, RemoteRank};
use tpu_sync::layout::{KvLayout, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::pattern::{LayerCheck, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::Placement;
use tpu_sync::store::{BlockKey, DeviceBlock, KvStore, Namespace};
use tpu_sync::transfer::KvBuffers;
use tpu_sync::ErrorKind;

fn layout(spec: &str, num_blocks: u32) -> ParallelLayout {
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = 2;
    ParallelLayout::new(m, ParallelSpec::parse(spec).unwrap(), num_blocks).unwrap()
}

fn placement(l: &ParallelLayout, ids: &[u32]) -> Placement {
    Placement {
        first_token: 0,
        layout: l.clone(),
        dp_rank: 0,
        block_ids: vec![ids.to_vec(); l.spec.tp as usize],
        groups: None,
    }
}

/// Per rank, its layer buffers filled from `c(rank)`.
fn buffers(
    client: &Client,
    l: &ParallelLayout,
    c: impl Fn(u32) -> RankContents,
) -> Vec<Vec<DeviceBuffer>> {
    let kv = l.rank_kv().unwrap();
    let d = client.device(0).unwrap();
    let mut host = vec![0u8; kv.buffer_bytes() as usize];
    (0..l.spec.ranks_per_replica())
        .map(|r| {
            let c = c(r);
            (0..kv.num_layers)
                .map(|layer| {
                    c.fill_layer(layer, &mut host).unwrap();
                    client
                        .buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &d)
                        .unwrap()
                })
                .collect()
        })
        .collect()
}

fn check(kv: &KvLayout, bufs: &[Vec<DeviceBuffer>], c: impl Fn(u32) -> RankContents) -> LayerCheck {
    let mut hb = vec![0u8; kv.buffer_bytes() as usize];
    let mut out = LayerCheck::default();
    for (r, rank) in bufs.iter().enumerate() {
        let c = c(r as u32);
        for (l, b) in rank.iter().enumerate() {
            b.to_host(&mut hb).unwrap();
            out.merge(c.verify_layer(l as u32, &hb).unwrap());
        }
    }
    out
}

fn prompt(n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (tpu_sync::pattern::mix64(0xab ^ (i as u64) << 8) % 50_000) as u32)
        .collect()
}

fn ropts() -> RemoteOptions {
    RemoteOptions {
        connect_timeout: Duration::from_secs(1),
        io_timeout: Duration::from_secs(2),
        ..RemoteOptions::default()
    }
}

fn lopts() -> LoadOptions {
    LoadOptions {
        remote: ropts(),
        arena: store_util::config(4096, 1).memory,
        staging_wait: None,
    }
}

/// A producer: one host tier per rank holding `tokens` tokens of the prompt, each served.
struct Producer {
    layout: ParallelLayout,
    stores: Vec<KvStore>,
    servers: Vec<RemoteServer>,
    keys: Vec<Vec<BlockKey>>,
    _bufs: Vec<Vec<DeviceBuffer>>,
}

fn ns_of(l: &ParallelLayout, rank: u32) -> Namespace {
    Namespace::new(format!(
        "cluster-load llama-3.1-8b/2 bf16 {} rank={rank}",
        l.spec
    ))
}

fn producer(client: &Client, spec: &str, tokens: u32, prompt_len: u32) -> Producer {
    let l = layout(spec, 16);
    let kv = l.rank_kv().unwrap();
    let n = l.request_blocks(tokens).unwrap();
    let ids: Vec<u32> = (0..n).map(|i| (i * 7 + 3) % 16).collect();
    // Rank (pcp, tp) holds the request blocks of its PCP chunk (all of them at PCP 1).
    let chunks: Vec<std::ops::Range<u32>> = (0..l.spec.ranks_per_replica())
        .map(|r| l.pcp_chunk(tokens, r / l.spec.tp).unwrap())
        .collect();
    let p = Placement {
        first_token: 0,
        layout: l.clone(),
        dp_rank: 0,
        block_ids: chunks
            .iter()
            .map(|c| c.clone().map(|j| ids[j as usize]).collect())
            .collect(),
        groups: None,
    };
    let bufs = buffers(client, &l, |r| RankContents::new(&p, r, tokens, 1).unwrap());
    let toks = prompt(prompt_len);
    let (mut stores, mut servers, mut keys) = (vec![], vec![], vec![]);
    for r in 0..l.spec.ranks_per_replica() {
        let ns = ns_of(&l, r);
        let mut cfg = store_util::config(kv.num_layers as u64 * 2 * kv.block_bytes(), 16);
        cfg.namespace = ns.clone();
        let s = KvStore::open(cfg).unwrap();
        let k = ns.chain_keys(&toks, l.spec.block_size as usize);
        let chunk = chunks[r as usize].clone();
        let blocks: Vec<DeviceBlock> = p.block_ids[r as usize]
            .iter()
            .map(|&id| DeviceBlock::kv_block(&kv, &bufs[r as usize], id).unwrap())
            .collect();
        let parent = chunk.start.checked_sub(1).map(|j| k[j as usize]);
        assert!(s
            .put_from_device(
                parent,
                &k[chunk.start as usize..chunk.end as usize],
                &blocks
            )
            .unwrap()
            .complete());
        servers.push(RemoteServer::serve(s.clone(), "127.0.0.1:0", ropts()).unwrap());
        stores.push(s);
        keys.push(k);
    }
    Producer {
        layout: l,
        stores,
        servers,
        keys,
        _bufs: bufs,
    }
}

impl Producer {
    fn sources(&self) -> Vec<RemoteRank> {
        (0..self.layout.spec.ranks_per_replica())
            .map(|r| RemoteRank {
                addr: self.servers[r as usize].local_addr().to_string(),
                namespace: ns_of(&self.layout, r),
                chain: self.keys[r as usize].clone(),
            })
            .collect()
    }
}

/// A consumer of layout `spec` (24 blocks, background salt 2) and its request's block ids.
struct Consumer {
    layout: ParallelLayout,
    kv: KvLayout,
    bufs: Vec<Vec<DeviceBuffer>>,
    buffers: KvBuffers,
    ids: Vec<u32>,
}

fn consumer(client: &Client, caps: &Capabilities, spec: &str, prompt_len: u32) -> Consumer {
    let l = layout(spec, 24);
    let empty = placement(&l, &[]);
    let bufs = buffers(client, &l, |r| {
        RankContents::new(&empty, r, prompt_len, 2).unwrap()
    });
    let n = l.request_blocks(prompt_len).unwrap();
    let ids: Vec<u32> = (0..n).map(|i| (i * 5 + 4) % 24).collect();
    let buffers = KvBuffers::new(
        caps,
        bufs.iter()
            .enumerate()
            .map(|(r, b)| (r as u32, b.clone()))
            .collect::<BTreeMap<_, _>>(),
    )
    .unwrap();
    Consumer {
        kv: l.rank_kv().unwrap(),
        layout: l,
        bufs,
        buffers,
        ids,
    }
}

impl Consumer {
    fn request(&self, p: &Producer, prompt_len: u32) -> RemoteLoad {
        RemoteLoad {
            src: p.layout.clone(),
            sources: p.sources(),
            dst: placement(&self.layout, &self.ids),
            num_tokens: prompt_len,
            kv: self.buffers.clone(),
        }
    }

    /// Checks the buffers hold exactly `tokens` tokens of the prompt in the first blocks of the
    /// request, background elsewhere. Returns (request bytes, mismatches).
    fn verify(&self, tokens: u32) -> LayerCheck {
        let n = self.layout.request_blocks(tokens).unwrap() as usize;
        let p = placement(&self.layout, &self.ids[..n]);
        let empty = placement(&self.layout, &[]);
        check(&self.kv, &self.bufs, |r| {
            if tokens == 0 {
                RankContents::new(&empty, r, 1, 2).unwrap()
            } else {
                RankContents::new(&p, r, tokens, 2).unwrap()
            }
        })
    }
}

fn budget() -> std::sync::Arc<StagingBudget> {
    StagingBudget::new("cluster-load", 64 << 20)
}

fn load(req: &RemoteLoad) -> tpu_sync::Result<LoadReport> {
    load_to_device(req, &budget(), &lopts())
}

#[test]
fn loads_the_whole_prompt_across_layouts() {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    // 96 tokens: whole producer blocks (only whole blocks have keys), a partial last block on
    // the 64-token consumer.
    let t = 96;
    for (a, b) in [
        ("tp=2,block=16,order=hnd", "tp=1,block=32,order=nhd"),
        ("tp=1,block=32,order=nhd", "tp=2,block=16,order=hnd"),
        ("tp=4,block=16,order=nhd", "tp=2,block=64,order=hnd"),
        ("tp=2,block=16,order=nhd", "tp=2,block=16,order=nhd"),
    ] {
        let p = producer(&client, a, t, t);
        let c = consumer(&client, &caps, b, t);
        let r = load(&c.request(&p, t)).unwrap();
        assert_eq!(r.tokens, t, "{a} -> {b}: {r:?}");
        assert_eq!(r.dst_blocks, c.layout.request_blocks(t).unwrap());
        let v = c.verify(t);
        assert_eq!(v.mismatches, 0, "{a} -> {b}: {:?}", v.first_mismatch);
        // 96 tokens x 2 layers x 2 planes x 8 heads x 128 dims x 2 bytes, whatever the split.
        assert_eq!(v.request_bytes, 96 * 2 * 2 * 8 * 128 * 2, "{a} -> {b}");
        assert_eq!(r.device_bytes, v.request_bytes, "{a} -> {b}");
        assert!(v.background_bytes > 0);
    }
}

#[test]
fn a_missing_evicted_or_corrupt_block_is_a_shorter_prefix() {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let (a, b) = ("tp=2,block=16,order=hnd", "tp=1,block=32,order=nhd");
    // The producer holds 96 of the 128 tokens asked for: 96 loaded (3 of B's blocks).
    let p = producer(&client, a, 96, 128);
    let c = consumer(&client, &caps, b, 128);
    let r = load(&c.request(&p, 128)).unwrap();
    assert_eq!(
        (r.tokens, r.dst_blocks, r.present.clone()),
        (96, 3, vec![6, 6])
    );
    assert_eq!(c.verify(96).mismatches, 0);

    // Rank 1 lost its block 4 (evicted after the lookup): 64 tokens present on every rank, 64
    // loaded (whole B blocks).
    let c = consumer(&client, &caps, b, 128);
    // (Removing a block removes the chain below it too: blocks 4 and 5.)
    assert_eq!(p.stores[1].remove(&p.keys[1][4..5]), 2);
    let r = load(&c.request(&p, 128)).unwrap();
    assert_eq!((r.tokens, r.present.clone()), (64, vec![6, 4]));
    let v = c.verify(64);
    assert_eq!(v.mismatches, 0, "{:?}", v.first_mismatch);
    assert_eq!(v.request_bytes, 64 * 2 * 2 * 8 * 128 * 2);

    // Rank 0's block 2 is corrupt in the producer's memory: its store refuses it, so the
    // prefix ends there: 32 tokens present, rounded down to B's 32-token block.
    let c = consumer(&client, &caps, b, 128);
    let ptr = p.stores[0].debug_slot_ptr(p.keys[0][2]).unwrap();
    // SAFETY: a byte inside the slot of a block this test stored; nobody reads it concurrently.
    unsafe { *ptr ^= 0x5a };
    let r = load(&c.request(&p, 128)).unwrap();
    assert_eq!((r.tokens, r.present.clone()), (32, vec![2, 4]));
    assert_eq!(c.verify(32).mismatches, 0);

    // Rank 1 holds nothing any more: a miss, nothing written.
    let c = consumer(&client, &caps, b, 128);
    p.stores[1].clear();
    let r = load(&c.request(&p, 128)).unwrap();
    assert_eq!((r.tokens, r.dst_blocks, r.device_bytes), (0, 0, 0));
    assert_eq!(c.verify(0).mismatches, 0);
}

#[test]
fn failures_leave_the_destination_untouched() {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let (a, b) = ("tp=2,block=16,order=hnd", "tp=1,block=32,order=nhd");
    let p = producer(&client, a, 64, 64);
    let c = consumer(&client, &caps, b, 64);
    let untouched = |c: &Consumer| assert_eq!(c.verify(0).mismatches, 0);

    // A dead producer rank: refused connection, a clean error.
    let mut req = c.request(&p, 64);
    let dead = port_util::reserve(); // nothing listens on a reserved port
    req.sources[1].addr = dead.addr();
    let e = load(&req).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::PeerClosed | ErrorKind::Timeout),
        "{e}"
    );
    untouched(&c);

    // Rank 0's address serves rank 1's store (another namespace).
    let mut req = c.request(&p, 64);
    req.sources[0].addr = req.sources[1].addr.clone();
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::Mismatch);
    untouched(&c);

    // Bad requests, refused before any byte moves.
    let mut req = c.request(&p, 64);
    req.sources.pop();
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let mut req = c.request(&p, 64);
    req.sources[0].chain.truncate(3);
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let mut req = c.request(&p, 64);
    req.src = layout("tp=2,pcp=2,block=16", 16);
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let mut req = c.request(&p, 64);
    req.dst = Placement {
        first_token: 0,
        layout: layout("tp=1,pcp=2,block=32,order=nhd", 24),
        dp_rank: 0,
        block_ids: vec![vec![4], vec![9]],
        groups: None,
    };
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::Unsupported);
    let mut req = c.request(&p, 64);
    req.dst.block_ids[0][1] = 99;
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::BlockRange);
    let mut req = c.request(&p, 64);
    let mut m = req.src.model.clone();
    m.num_layers = 3;
    req.src = ParallelLayout::new(m, req.src.spec, 16).unwrap();
    assert_eq!(load(&req).unwrap_err().kind(), ErrorKind::Mismatch);
    // A budget too small for the fetched blocks.
    let e = load_to_device(
        &c.request(&p, 64),
        &StagingBudget::new("tiny", 4096),
        &lopts(),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StagingExhausted);
    untouched(&c);

    // And the same consumer then loads it fine.
    let r = load(&c.request(&p, 64)).unwrap();
    assert_eq!(r.tokens, 64);
    assert_eq!(c.verify(64).mismatches, 0);
}

#[test]
fn loads_from_a_producer_with_pcp() {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let b = "tp=1,block=32,order=nhd";
    for a in [
        "tp=2,pcp=2,block=16,order=hnd",
        "tp=1,pcp=3,block=16,order=nhd",
    ] {
        // The whole 96-token request (6 producer blocks in PCP chunks), into a TP=1 consumer.
        let p = producer(&client, a, 96, 96);
        let c = consumer(&client, &caps, b, 96);
        let r = load(&c.request(&p, 96)).unwrap();
        assert_eq!(r.tokens, 96, "{a}: {r:?}");
        let v = c.verify(96);
        assert_eq!(v.mismatches, 0, "{a}: {:?}", v.first_mismatch);
        assert_eq!(v.request_bytes, 96 * 2 * 2 * 8 * 128 * 2, "{a}");
        assert_eq!(r.device_bytes, v.request_bytes, "{a}");

        // A 64-token prefix of it: the chunk boundaries of the stored request (not of 64
        // tokens) decide which PCP rank delivers which block.
        let c = consumer(&client, &caps, b, 64);
        let r = load(&c.request(&p, 64)).unwrap();
        assert_eq!(r.tokens, 64, "{a}: {r:?}");
        assert_eq!(
            r.present.iter().sum::<usize>(),
            4 * p.layout.spec.tp as usize
        );
        assert_eq!(c.verify(64).mismatches, 0, "{a}");
    }

    // TP=2 x PCP=2: rank (pcp 1, tp 0) lost its block 4 (and the chain below it): column 0 holds
    // 4 blocks, so 64 tokens load; PCP rank 1 of column 1 still delivered its 3.
    let a = "tp=2,pcp=2,block=16,order=hnd";
    let p = producer(&client, a, 96, 96);
    assert_eq!(p.stores[2].remove(&p.keys[2][4..5]), 2);
    let c = consumer(&client, &caps, b, 96);
    let r = load(&c.request(&p, 96)).unwrap();
    assert_eq!((r.tokens, r.present.clone()), (64, vec![3, 3, 1, 3]));
    let v = c.verify(64);
    assert_eq!(v.mismatches, 0, "{:?}", v.first_mismatch);
    // PCP rank 0 of column 1 is dead: a clean error, nothing written.
    let c = consumer(&client, &caps, b, 96);
    let mut req = c.request(&p, 96);
    let dead = port_util::reserve(); // nothing listens on a reserved port
    req.sources[1].addr = dead.addr();
    let e = load(&req).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::PeerClosed | ErrorKind::Timeout),
        "{e}"
    );
    assert_eq!(c.verify(0).mismatches, 0);
}
