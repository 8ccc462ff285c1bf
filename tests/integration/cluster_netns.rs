//! Three hosts in network namespaces (A 10.78.0.1, B 10.78.0.2, and C 10.78.0.3 running etcd,
//! joined by a bridge in C): host A (TP=2, 16-token blocks, HND) stores a prompt's KV from its
//! PJRT device blocks, one host tier per rank, serves both and publishes them with their layout;
//! host B (another layout: TP=1, 32-token blocks, NHD, 40 blocks) asks for a longer prompt, finds
//! A's stores through the directory and loads the present prefix resharded byte-exact into its
//! device blocks (`cluster::load_to_device`), every other byte unchanged, and keeps it in its own
//! host tier. Then A is SIGKILLed: B's lookups stop naming A within the lease TTL and a load from
//! A fails cleanly, B's blocks untouched; then etcd is restarted without its data: B's store is
//! published again and lookups recover.
//!
//! Hosts are this test binary re-run inside `ip netns exec` with `TSYNC_NETNS_ROLE` set.
//! Skipped, with a message, when not root, `ip netns` or bridges are unavailable, or no etcd.

use crate::cluster_util;
use crate::common;
use crate::store_util;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use tpu_sync::budget::StagingBudget;
use tpu_sync::cluster::remote::{RemoteOptions, RemoteServer};
use tpu_sync::cluster::{
    load_to_device, Candidate, ClusterConfig, Directory, HostRecord, LoadOptions, LoadReport,
    RemoteLoad, RemoteRank, StoreSource,
};
use tpu_sync::layout::{KvLayout, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::pattern::{LayerCheck, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::Placement;
use tpu_sync::store::{BlockKey, DeviceBlock, KvStore, Namespace, StoreConfig};
use tpu_sync::transfer::KvBuffers;

const B_ADDR: &str = "10.78.0.2:7800";
const ETCD: &str = "http://10.78.0.3:2379";
/// Tokens A stores (6 of its blocks, 3 of B's).
const TOKENS: u32 = 6 * 16;
/// Tokens B asks for (a longer prompt: A holds its first TOKENS).
const LONG: u32 = 8 * 16;
const TTL: Duration = Duration::from_secs(2);

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

struct Net {
    ns: [String; 3],
}

impl Net {
    fn create() -> Result<Net, String> {
        let id = format!("{}", std::process::id() % 100_000);
        let n = Net {
            ns: [
                format!("tsc-{id}-a"),
                format!("tsc-{id}-b"),
                format!("tsc-{id}-c"),
            ],
        };
        let [a, b, c] = &n.ns;
        let (va, vac, vb, vbc) = (
            format!("tca{id}"),
            format!("tcA{id}"),
            format!("tcb{id}"),
            format!("tcB{id}"),
        );
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", a],
            vec!["netns", "add", b],
            vec!["netns", "add", c],
            vec!["-n", c, "link", "add", "br0", "type", "bridge"],
            vec!["-n", c, "link", "set", "br0", "up"],
            vec!["-n", c, "addr", "add", "10.78.0.3/24", "dev", "br0"],
            vec!["-n", c, "link", "set", "lo", "up"],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vac],
            vec!["link", "set", &va, "netns", a],
            vec!["link", "set", &vac, "netns", c],
            vec!["link", "add", &vb, "type", "veth", "peer", "name", &vbc],
            vec!["link", "set", &vb, "netns", b],
            vec!["link", "set", &vbc, "netns", c],
            vec!["-n", c, "link", "set", &vac, "master", "br0"],
            vec!["-n", c, "link", "set", &vbc, "master", "br0"],
            vec!["-n", c, "link", "set", &vac, "up"],
            vec!["-n", c, "link", "set", &vbc, "up"],
            vec!["-n", a, "addr", "add", "10.78.0.1/24", "dev", &va],
            vec!["-n", b, "addr", "add", "10.78.0.2/24", "dev", &vb],
            vec!["-n", a, "link", "set", &va, "up"],
            vec!["-n", b, "link", "set", &vb, "up"],
            vec!["-n", a, "link", "set", "lo", "up"],
            vec!["-n", b, "link", "set", "lo", "up"],
        ];
        for s in steps {
            if !ip(&s) {
                return Err(format!("`ip {}` failed", s.join(" ")));
            }
        }
        Ok(n)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in &self.ns {
            ip(&["netns", "del", n]);
        }
    }
}

/// A host process: its stdout lines arrive on a channel; killed on drop.
struct Host {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Host {
    fn spawn(ns: &str, role: &str) -> Host {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(exe)
            .args([
                "--exact",
                &crate::test_name(module_path!(), "child"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TSYNC_NETNS_ROLE", role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a host");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Host {
            stdin: child.stdin.take(),
            child,
            lines: rx,
        }
    }

    /// The first line containing `tag`, after the tag (panics after `limit`).
    fn expect(&self, tag: &str, limit: Duration) -> String {
        let t0 = Instant::now();
        loop {
            let left = limit.saturating_sub(t0.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(i) = l.find(tag) {
                        return l[i + tag.len()..].trim().to_string();
                    }
                }
                Err(_) => panic!("no {tag} line within {limit:?}"),
            }
        }
    }

    fn say(&mut self, cmd: &str) {
        let s = self.stdin.as_mut().unwrap();
        writeln!(s, "{cmd}").unwrap();
        s.flush().unwrap();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One instance's device side: a layout and its ranks' layer buffers on one PJRT client.
struct Dev {
    client: Client,
    caps: Capabilities,
    layout: ParallelLayout,
    kv: KvLayout,
}

/// Host A's layout: TP=2 (4 of the 8 KV heads per rank), blocks of 16 tokens, HND.
const A_SPEC: &str = "tp=2,block=16,order=hnd";
/// Host B's layout: TP=1 (all 8 heads), blocks of 32 tokens, NHD.
const B_SPEC: &str = "tp=1,block=32,order=nhd";

fn dev(spec: &str, num_blocks: u32) -> Dev {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = 3;
    let spec = ParallelSpec::parse(spec).unwrap();
    let layout = ParallelLayout::new(m, spec, num_blocks).unwrap();
    let kv = layout.rank_kv().unwrap();
    Dev {
        client,
        caps,
        layout,
        kv,
    }
}

impl Dev {
    /// The placement of a request whose blocks are `ids` on every rank.
    fn placement(&self, ids: Vec<u32>) -> Placement {
        Placement {
            first_token: 0,
            layout: self.layout.clone(),
            dp_rank: 0,
            block_ids: vec![ids; self.layout.spec.tp as usize],
            groups: None,
        }
    }
    fn buffers(&self, c: &RankContents) -> Vec<DeviceBuffer> {
        let d = self.client.device(0).unwrap();
        let mut host = vec![0u8; self.kv.buffer_bytes() as usize];
        (0..self.kv.num_layers)
            .map(|l| {
                c.fill_layer(l, &mut host).unwrap();
                self.client
                    .buffer_from_host(&host, self.kv.dtype.element_type(), &self.kv.dims(), &d)
                    .unwrap()
            })
            .collect()
    }
    /// Bytes of one stored block of one rank (every layer and plane).
    fn block_bytes(&self) -> u64 {
        self.kv.num_layers as u64 * 2 * self.kv.block_bytes()
    }
    /// The namespace of rank `rank`'s host tier: model, dtype, layout and rank.
    fn namespace(&self, rank: u32) -> String {
        format!(
            "cluster-netns llama-3.1-8b/3 bf16 {} rank={rank}",
            self.layout.spec
        )
    }
    /// The buffers checked against `c` (every request byte and every byte outside it).
    fn check(&self, bufs: &[DeviceBuffer], c: &RankContents) -> LayerCheck {
        let mut hb = vec![0u8; self.kv.buffer_bytes() as usize];
        let mut check = LayerCheck::default();
        for (l, b) in bufs.iter().enumerate() {
            b.to_host(&mut hb).unwrap();
            check.merge(c.verify_layer(l as u32, &hb).unwrap());
        }
        check
    }
}

/// The prompt's token ids (`n` of them; a longer prompt starts with the shorter one).
fn prompt(n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (tpu_sync::pattern::mix64(0x5eed ^ (i as u64) << 8) % 50_000) as u32)
        .collect()
}

fn directory() -> Directory {
    let mut c = ClusterConfig::new(vec![ETCD.into()]);
    c.lease_ttl = TTL;
    c.request_timeout = Duration::from_secs(2);
    c.connect_timeout = Duration::from_secs(1);
    c.batch_interval = Duration::from_millis(10);
    Directory::connect(c).unwrap()
}

/// The remote tier across hosts: servers and clients authenticate each other with the fleet's
/// pre-shared key (a non-loopback server without credentials refuses to start).
fn ropts() -> RemoteOptions {
    RemoteOptions {
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(3),
        security: tpu_sync::net::Security::from_psk(b"cluster-netns fleet key, 32 bytes").unwrap(),
        ..RemoteOptions::default()
    }
}

fn store_config(ns: &str, block_bytes: u64, slots: u64) -> StoreConfig {
    let mut c = store_util::config(block_bytes, slots);
    c.namespace = Namespace::new(ns);
    c
}

/// Host A (TP=2): stores the prompt's KV of both ranks, each rank in its own host tier (its own
/// namespace), serves each on its own port and publishes each as `host-a-r{rank}` with a
/// [`StoreSource`] record.
fn host_a() {
    let d = dev(A_SPEC, 24);
    let src_ids = vec![17, 3, 9, 22, 0, 11];
    let place = d.placement(src_ids.clone());
    let dir = directory();
    let toks = prompt(TOKENS);
    let mut keep = Vec::new();
    for rank in 0..2u32 {
        let bufs = d.buffers(&RankContents::new(&place, rank, TOKENS, 1).unwrap());
        let ns = d.namespace(rank);
        let s = KvStore::open(store_config(&ns, d.block_bytes(), 16)).unwrap();
        let keys = Namespace::new(ns.clone()).chain_keys(&toks, 16);
        let blocks: Vec<DeviceBlock> = src_ids
            .iter()
            .map(|&id| DeviceBlock::kv_block(&d.kv, &bufs, id).unwrap())
            .collect();
        assert_eq!(s.put_from_device(None, &keys, &blocks).unwrap().stored, 6);
        let addr = format!("10.78.0.1:{}", 7800 + rank);
        let server = RemoteServer::serve(s.clone(), &addr, ropts()).unwrap();
        let mut rec = HostRecord::new(format!("host-a-r{rank}"), addr);
        rec.meta = StoreSource {
            layout: d.layout.clone(),
            rank,
            namespace: ns,
        }
        .to_meta();
        let p = dir.publish(&s, rec).unwrap();
        p.sync(Duration::from_secs(20)).unwrap();
        keep.push((s, server, p, bufs));
    }
    println!("READY");
    // Until killed.
    std::thread::sleep(Duration::from_secs(600));
}

fn names(dir: &Directory, ns: &Namespace, keys: &[BlockKey]) -> Option<Vec<(String, usize)>> {
    dir.lookup(ns, keys)
        .ok()
        .map(|v| v.into_iter().map(|c| (c.host.id, c.blocks)).collect())
}

/// What B found in the directory for a prompt: per producer rank, its namespace, chain and the
/// host the lookup named.
struct Found {
    layout: ParallelLayout,
    ranks: Vec<(Namespace, Vec<BlockKey>, Candidate)>,
}

/// Finds the stores of another layout holding a prefix of `toks`: the host records name the
/// layouts and namespaces, a lookup per rank names the holder.
fn find(dir: &Directory, own: &ParallelLayout, toks: &[u32]) -> Option<Found> {
    let mut by_layout: Vec<(ParallelLayout, Vec<StoreSource>)> = Vec::new();
    for h in dir.hosts().ok()? {
        let Some(s) = StoreSource::from_meta(&h.meta) else {
            continue;
        };
        if &s.layout == own {
            continue;
        }
        match by_layout.iter_mut().find(|(l, _)| *l == s.layout) {
            Some((_, v)) => v.push(s),
            None => by_layout.push((s.layout.clone(), vec![s])),
        }
    }
    for (layout, mut stores) in by_layout {
        stores.sort_by_key(|s| s.rank);
        let mut ranks = Vec::new();
        for s in &stores {
            let ns = s.namespace();
            let keys = ns.chain_keys(toks, layout.spec.block_size as usize);
            let c = dir.lookup(&ns, &keys).ok()?.into_iter().next()?;
            ranks.push((ns, keys, c));
        }
        if ranks.len() == layout.spec.tp as usize {
            return Some(Found { layout, ranks });
        }
    }
    None
}

fn load(found: &Found, dst: Placement, kv: &KvBuffers) -> tpu_sync::Result<LoadReport> {
    let req = RemoteLoad {
        src: found.layout.clone(),
        sources: found
            .ranks
            .iter()
            .map(|(ns, keys, c)| RemoteRank {
                addr: c.host.addr.clone(),
                namespace: ns.clone(),
                chain: keys.clone(),
            })
            .collect(),
        num_tokens: LONG,
        dst,
        kv: kv.clone(),
    };
    let o = LoadOptions {
        remote: ropts(),
        arena: store_util::config(4096, 1).memory,
        staging_wait: None,
    };
    load_to_device(&req, &StagingBudget::new("host-b", 256 << 20), &o)
}

/// Host B (TP=1, 32-token blocks, NHD): asks for a longer prompt (LONG tokens) whose first
/// TOKENS A holds; finds A's stores through the directory, loads the present prefix into its
/// device blocks resharded, checks every byte, keeps it in its own host tier (its namespace)
/// and publishes that.
fn host_b() {
    let d = dev(B_SPEC, 40);
    let dst_ids = vec![5, 33, 1, 14];
    let bufs = d.buffers(&RankContents::new(&d.placement(vec![]), 0, LONG, 2).unwrap());
    let kv = KvBuffers::new(&d.caps, BTreeMap::from([(0, bufs.clone())])).unwrap();
    let dir = directory();
    let long = prompt(LONG);
    let found = find(&dir, &d.layout, &long).expect("A's stores in the directory");
    for (_, _, c) in &found.ranks {
        println!("FOUND {} {} {}", c.host.id, c.host.addr, c.blocks);
    }
    let r = load(&found, d.placement(dst_ids.clone()), &kv).unwrap();
    // The present prefix: TOKENS tokens, 3 of B's blocks; block 14 is not written.
    let c = RankContents::new(&d.placement(dst_ids[..3].to_vec()), 0, TOKENS, 2).unwrap();
    let check = d.check(&bufs, &c);
    println!(
        "LOADED {} {} {:?} mismatches {} request_bytes {} background_bytes {}",
        r.tokens,
        r.dst_blocks,
        r.present,
        check.mismatches,
        check.request_bytes,
        check.background_bytes
    );
    eprintln!("host B load: {r:?}");

    // B keeps the prefix in its own host tier, in its own layout and namespace.
    let ns = d.namespace(0);
    let s = KvStore::open(store_config(&ns, d.block_bytes(), 16)).unwrap();
    let own_keys = Namespace::new(ns.clone()).chain_keys(&long[..TOKENS as usize], 32);
    let blocks: Vec<DeviceBlock> = dst_ids[..3]
        .iter()
        .map(|&id| DeviceBlock::kv_block(&d.kv, &bufs, id).unwrap())
        .collect();
    assert!(s
        .put_from_device(None, &own_keys, &blocks)
        .unwrap()
        .complete());
    let _server = RemoteServer::serve(s.clone(), B_ADDR, ropts()).unwrap();
    let mut rec = HostRecord::new("host-b", B_ADDR);
    rec.meta = StoreSource {
        layout: d.layout.clone(),
        rank: 0,
        namespace: ns.clone(),
    }
    .to_meta();
    let p = dir.publish(&s, rec).unwrap();
    p.sync(Duration::from_secs(20)).unwrap();
    println!("PUBLISHED");
    let own_ns = Namespace::new(ns);

    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    assert_eq!(lines.next().unwrap().unwrap(), "KILLED");
    let t0 = Instant::now();
    loop {
        let gone = found
            .ranks
            .iter()
            .all(|(ns, keys, _)| names(&dir, ns, keys) == Some(vec![]));
        if gone {
            println!(
                "A_GONE {} ms {:?}",
                t0.elapsed().as_millis(),
                names(&dir, &own_ns, &own_keys)
            );
            break;
        }
        assert!(
            t0.elapsed() < TTL * 10,
            "host A still listed after {:?}",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A load from the dead host fails cleanly and leaves B's device blocks as they were.
    let t1 = Instant::now();
    let e = load(&found, d.placement(dst_ids.clone()), &kv).unwrap_err();
    let after = d.check(&bufs, &c);
    println!(
        "FETCH_A {:?} {} ms mismatches {}",
        e.kind(),
        t1.elapsed().as_millis(),
        after.mismatches
    );

    assert_eq!(lines.next().unwrap().unwrap(), "RESTARTED");
    let t2 = Instant::now();
    loop {
        if names(&dir, &own_ns, &own_keys) == Some(vec![("host-b".to_string(), 3)]) {
            break;
        }
        assert!(t2.elapsed() < Duration::from_secs(60), "no recovery");
        std::thread::sleep(Duration::from_millis(100));
    }
    p.sync(Duration::from_secs(20)).unwrap();
    println!(
        "RECOVERED {} ms republishes {} leases {}",
        t2.elapsed().as_millis(),
        p.stats().republishes,
        p.stats().leases
    );
}

/// Host body when re-run inside a namespace; nothing otherwise.
#[test]
fn child() {
    match std::env::var("TSYNC_NETNS_ROLE").as_deref() {
        Ok("host-a") => host_a(),
        Ok("host-b") => host_b(),
        _ => {}
    }
}

#[test]
fn three_hosts_share_a_prefix_through_etcd() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP three_hosts_share_a_prefix_through_etcd: needs root for ip netns");
        return;
    }
    if cluster_util::etcd_bin().is_none() {
        eprintln!(
            "SKIP three_hosts_share_a_prefix_through_etcd: no etcd (scripts/install-etcd.sh)"
        );
        return;
    }
    let net = match Net::create() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("SKIP three_hosts_share_a_prefix_through_etcd: {e}");
            return;
        }
    };
    let mut etcd = cluster_util::Etcd::start_with(
        "three_hosts_share_a_prefix_through_etcd",
        "10.78.0.3",
        Some(&net.ns[2]),
        &[],
    )
    .expect("etcd");
    let limit = Duration::from_secs(120);
    let mut a = Host::spawn(&net.ns[0], "host-a");
    a.expect("READY", limit);
    let mut b = Host::spawn(&net.ns[1], "host-b");
    assert_eq!(b.expect("FOUND", limit), "host-a-r0 10.78.0.1:7800 6");
    assert_eq!(b.expect("FOUND", limit), "host-a-r1 10.78.0.1:7801 6");
    let loaded = b.expect("LOADED", limit);
    eprintln!("loaded: {loaded}");
    // 96 tokens (3 of B's 32-token blocks) from 6 blocks of each of A's two ranks;
    // 96 tokens x 3 layers x 2 planes x 8 heads x 128 dims x 2 bytes checked byte-exact, and
    // every other byte of B's 40-block buffers (block 14, asked for but not present, included)
    // unchanged.
    assert!(
        loaded.starts_with("96 3 [6, 6] mismatches 0 request_bytes 1179648 background_bytes "),
        "{loaded}"
    );
    let bg: u64 = loaded.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(bg, 3 * 2 * 40 * 32 * 8 * 128 * 2 - 1_179_648, "{loaded}");
    b.expect("PUBLISHED", limit);

    // Host A dies.
    let _ = a.child.kill();
    let _ = a.child.wait();
    a.stdin.take();
    b.say("KILLED");
    let gone = b.expect("A_GONE", limit);
    eprintln!("lookups stopped naming A after {gone}");
    assert!(gone.ends_with("Some([(\"host-b\", 3)])"), "{gone}");
    let f = b.expect("FETCH_A", limit);
    assert!(
        (f.starts_with("PeerClosed") || f.starts_with("Timeout")) && f.ends_with("mismatches 0"),
        "a load from the dead host fails cleanly, B's blocks untouched: {f}"
    );

    // etcd loses everything.
    etcd.restart(true);
    b.say("RESTARTED");
    let r = b.expect("RECOVERED", limit);
    eprintln!("recovered: {r}");
    let parts: Vec<&str> = r.split_whitespace().collect();
    assert!(parts[3].parse::<u64>().unwrap() >= 1, "{r}");
    assert!(b.child.wait().unwrap().success());
    drop(etcd);
    drop(net);
}
