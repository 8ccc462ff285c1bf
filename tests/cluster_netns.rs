//! Three hosts in network namespaces (A 10.78.0.1, B 10.78.0.2, and C 10.78.0.3 running etcd,
//! joined by a bridge in C): host A stores a prompt's KV from its PJRT device blocks, serves its
//! host tier and publishes it; host B (another placement: 40 blocks instead of 24, other block
//! ids) finds the prompt through the directory, fetches it from A and loads it byte-exact into
//! its device blocks. Then A is SIGKILLed: B's lookups stop naming A within the lease TTL and a
//! fetch from A fails cleanly; then etcd is restarted without its data: B's store is published
//! again and lookups recover.
//!
//! Hosts are this test binary re-run inside `ip netns exec` with `TSYNC_NETNS_ROLE` set.
//! Skipped, with a message, when not root, `ip netns` or bridges are unavailable, or no etcd.

mod cluster_util;
mod common;
mod store_util;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use tpu_sync::cluster::remote::{self, RemoteOptions, RemoteServer};
use tpu_sync::cluster::{ClusterConfig, Directory, HostRecord};
use tpu_sync::layout::{KvLayout, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::pattern::{LayerCheck, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::Placement;
use tpu_sync::store::{DeviceBlock, KvStore};

const A_ADDR: &str = "10.78.0.1:7800";
const B_ADDR: &str = "10.78.0.2:7800";
const ETCD: &str = "http://10.78.0.3:2379";
const TOKENS: u32 = 6 * 16;
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
            .args(["--exact", "child", "--nocapture", "--test-threads=1"])
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

struct Dev {
    client: Client,
    caps: Capabilities,
    layout: ParallelLayout,
    kv: KvLayout,
}

fn dev(num_blocks: u32) -> Dev {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = 3;
    let spec = ParallelSpec::parse("block=16,order=hnd").unwrap();
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
    fn placement(&self, ids: Vec<u32>) -> Placement {
        Placement {
            layout: self.layout.clone(),
            dp_rank: 0,
            block_ids: vec![ids],
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
    fn block_bytes(&self) -> u64 {
        self.kv.num_layers as u64 * 2 * self.kv.block_bytes()
    }
}

fn directory() -> Directory {
    let mut c = ClusterConfig::new(vec![ETCD.into()]);
    c.lease_ttl = TTL;
    c.request_timeout = Duration::from_secs(2);
    c.connect_timeout = Duration::from_secs(1);
    c.batch_interval = Duration::from_millis(10);
    Directory::connect(c).unwrap()
}

fn ropts() -> RemoteOptions {
    RemoteOptions {
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(3),
    }
}

fn host_a() {
    let d = dev(24);
    let src_ids = vec![17, 3, 9, 22, 0, 11];
    let bufs = d.buffers(&RankContents::new(&d.placement(src_ids.clone()), 0, TOKENS, 1).unwrap());
    let s = KvStore::open(store_util::config(d.block_bytes(), 16)).unwrap();
    let keys = store_util::chain(6, 31);
    let blocks: Vec<DeviceBlock> = src_ids
        .iter()
        .map(|&id| DeviceBlock::kv_block(&d.kv, &bufs, id).unwrap())
        .collect();
    assert_eq!(s.put_from_device(None, &keys, &blocks).unwrap().stored, 6);
    let _server = RemoteServer::serve(s.clone(), A_ADDR, ropts()).unwrap();
    let dir = directory();
    let p = dir.publish(&s, HostRecord::new("host-a", A_ADDR)).unwrap();
    p.sync(Duration::from_secs(20)).unwrap();
    println!("READY");
    // Until killed.
    std::thread::sleep(Duration::from_secs(600));
}

fn names(dir: &Directory, keys: &[tpu_sync::store::BlockKey]) -> Option<Vec<(String, usize)>> {
    dir.lookup(&store_util::ns(), keys)
        .ok()
        .map(|v| v.into_iter().map(|c| (c.host.id, c.blocks)).collect())
}

fn host_b() {
    let d = dev(40);
    let dst_ids = vec![5, 33, 1, 14, 38, 19];
    let empty = d.placement(vec![]);
    let bufs = d.buffers(&RankContents::new(&empty, 0, TOKENS, 2).unwrap());
    let keys = store_util::chain(6, 31);
    let dir = directory();
    let cands = dir.lookup(&store_util::ns(), &keys).unwrap();
    assert_eq!(cands.len(), 1, "{cands:?}");
    println!(
        "FOUND {} {} {}",
        cands[0].host.id, cands[0].host.addr, cands[0].blocks
    );
    // Fetch into host memory, keep it in B's host tier, load into B's device blocks.
    let bb = d.block_bytes() as usize;
    let mut host: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; bb]).collect();
    let mut dst: Vec<&mut [u8]> = host.iter_mut().map(|b| b.as_mut_slice()).collect();
    let n = remote::fetch(
        &cands[0].host.addr,
        &store_util::ns(),
        &keys,
        &mut dst,
        &ropts(),
    )
    .unwrap();
    let s = KvStore::open(store_util::config(d.block_bytes(), 16)).unwrap();
    let refs: Vec<&[u8]> = host[..n].iter().map(|b| b.as_slice()).collect();
    assert!(s.put_from_host(None, &keys[..n], &refs).unwrap().complete());
    let dblocks: Vec<DeviceBlock> = dst_ids
        .iter()
        .map(|&id| DeviceBlock::kv_block(&d.kv, &bufs, id).unwrap())
        .collect();
    let g = s.get_to_device(&d.caps, &keys, &dblocks).unwrap();
    let c = RankContents::new(&d.placement(dst_ids), 0, TOKENS, 2).unwrap();
    let mut hb = vec![0u8; d.kv.buffer_bytes() as usize];
    let mut check = LayerCheck::default();
    for (l, b) in bufs.iter().enumerate() {
        b.to_host(&mut hb).unwrap();
        check.merge(c.verify_layer(l as u32, &hb).unwrap());
    }
    println!(
        "LOADED {n} {} mismatches {} request_bytes {}",
        g.delivered, check.mismatches, check.request_bytes
    );
    let _server = RemoteServer::serve(s.clone(), B_ADDR, ropts()).unwrap();
    let p = dir.publish(&s, HostRecord::new("host-b", B_ADDR)).unwrap();
    p.sync(Duration::from_secs(20)).unwrap();
    println!("PUBLISHED");

    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    assert_eq!(lines.next().unwrap().unwrap(), "KILLED");
    let t0 = Instant::now();
    loop {
        if let Some(v) = names(&dir, &keys) {
            if !v.iter().any(|(h, _)| h == "host-a") {
                println!("A_GONE {} ms {:?}", t0.elapsed().as_millis(), v);
                break;
            }
        }
        assert!(
            t0.elapsed() < TTL * 10,
            "host-a still listed after {:?}",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let t1 = Instant::now();
    let mut one = vec![0u8; bb];
    let mut dst: Vec<&mut [u8]> = vec![one.as_mut_slice()];
    let e = remote::fetch(A_ADDR, &store_util::ns(), &keys[..1], &mut dst, &ropts()).unwrap_err();
    println!("FETCH_A {:?} {} ms", e.kind(), t1.elapsed().as_millis());

    assert_eq!(lines.next().unwrap().unwrap(), "RESTARTED");
    let t2 = Instant::now();
    loop {
        if names(&dir, &keys) == Some(vec![("host-b".to_string(), 6)]) {
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
    assert_eq!(b.expect("FOUND", limit), format!("host-a {A_ADDR} 6"));
    let loaded = b.expect("LOADED", limit);
    // 6 blocks x 3 layers x 2 planes x 8 heads x 16 tokens x 128 dims x 2 bytes.
    assert_eq!(loaded, "6 6 mismatches 0 request_bytes 1179648", "{loaded}");
    b.expect("PUBLISHED", limit);

    // Host A dies.
    let _ = a.child.kill();
    let _ = a.child.wait();
    a.stdin.take();
    b.say("KILLED");
    let gone = b.expect("A_GONE", limit);
    eprintln!("lookups stopped naming A after {gone}");
    assert!(gone.ends_with("[(\"host-b\", 6)]"), "{gone}");
    let f = b.expect("FETCH_A", limit);
    assert!(
        f.starts_with("PeerClosed") || f.starts_with("Timeout"),
        "a fetch from the dead host fails cleanly: {f}"
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
