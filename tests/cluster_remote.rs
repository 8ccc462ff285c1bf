//! The remote tier on loopback: a host finds a prefix through the directory (a real etcd) and
//! fetches it byte-exact from the holder's store into its own memory; partial prefixes, a block
//! evicted between the lookup and the fetch (a miss, never wrong bytes), a stale directory entry,
//! another namespace, a dead server (a clean error, no hang), and offload to a peer.

mod cluster_util;
mod store_util;

use std::time::Duration;

use tpu_sync::cluster::remote::{self, RemoteOptions, RemoteServer};
use tpu_sync::cluster::{ClusterConfig, Directory, HostRecord};
use tpu_sync::store::{BlockKey, KvStore, Namespace};
use tpu_sync::ErrorKind;

const B: usize = 8192;

/// The tests of this file run one at a time: one of them counts the remote tier's threads of
/// the whole process.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn store(slots: u64) -> KvStore {
    KvStore::open(store_util::config(B as u64, slots)).unwrap()
}

fn put(s: &KvStore, chain: &[BlockKey]) {
    let data: Vec<Vec<u8>> = chain.iter().map(|&k| store_util::bytes_of(k, B)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    assert!(s.put_from_host(None, chain, &refs).unwrap().complete());
}

fn opts() -> RemoteOptions {
    RemoteOptions {
        connect_timeout: Duration::from_secs(1),
        io_timeout: Duration::from_secs(2),
        ..RemoteOptions::default()
    }
}

/// Fetches `chain` from `addr`; returns the count and checks every delivered block.
fn fetch_check(addr: &str, ns: &Namespace, chain: &[BlockKey]) -> tpu_sync::Result<usize> {
    let mut bufs: Vec<Vec<u8>> = chain.iter().map(|_| vec![0u8; B]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let n = remote::fetch(addr, ns, chain, &mut dst, &opts())?;
    for i in 0..n {
        assert_eq!(
            bufs[i],
            store_util::bytes_of(chain[i], B),
            "block {i} differs"
        );
    }
    Ok(n)
}

#[test]
fn fetch_through_the_directory() {
    let _serial = serial();
    let Some(e) = cluster_util::Etcd::start("fetch_through_the_directory") else {
        return;
    };
    let mut c = ClusterConfig::new(vec![e.endpoint()]);
    c.lease_ttl = Duration::from_secs(2);
    c.batch_interval = Duration::from_millis(10);
    let d = Directory::connect(c).unwrap();
    let ns = store_util::ns();
    let a = store(32);
    let chain = store_util::chain(10, 21);
    put(&a, &chain[..7]);
    let server = RemoteServer::serve(a.clone(), "127.0.0.1:0", opts()).unwrap();
    let addr = server.local_addr().to_string();
    let p = d.publish(&a, HostRecord::new("a", addr.clone())).unwrap();
    p.sync(Duration::from_secs(10)).unwrap();

    // B looks the chain up and fetches the prefix from the host the directory names.
    let cands = d.lookup(&ns, &chain).unwrap();
    assert_eq!(cands.len(), 1);
    assert_eq!(cands[0].blocks, 7);
    assert_eq!(fetch_check(&cands[0].host.addr, &ns, &chain).unwrap(), 7);
    // B stores what it fetched in its own host tier: now a local hit.
    let b = store(32);
    let mut bufs: Vec<Vec<u8>> = chain[..7].iter().map(|_| vec![0u8; B]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|x| x.as_mut_slice()).collect();
    assert_eq!(
        remote::fetch(&addr, &ns, &chain[..7], &mut dst, &opts()).unwrap(),
        7
    );
    let refs: Vec<&[u8]> = bufs.iter().map(|x| x.as_slice()).collect();
    assert!(b
        .put_from_host(None, &chain[..7], &refs)
        .unwrap()
        .complete());
    assert_eq!(b.lookup(&chain), 7);

    // Evicted between lookup and fetch: the directory still says 7 (not yet unpublished), the
    // fetch delivers only what is there.
    let stale = d.lookup(&ns, &chain).unwrap();
    assert_eq!(a.remove(&chain[4..5]), 3);
    assert_eq!(stale[0].blocks, 7);
    assert_eq!(fetch_check(&addr, &ns, &chain).unwrap(), 4);
    // Entirely gone: zero, not an error.
    a.clear();
    assert_eq!(fetch_check(&addr, &ns, &chain).unwrap(), 0);

    // Another namespace is refused as a mismatch.
    assert_eq!(
        fetch_check(&addr, &Namespace::new("other"), &chain)
            .unwrap_err()
            .kind(),
        ErrorKind::Mismatch
    );

    // Offload: A offers blocks to a peer with room (C), which then serves them.
    let cst = store(32);
    let cs = RemoteServer::serve(cst.clone(), "127.0.0.1:0", opts()).unwrap();
    let data: Vec<Vec<u8>> = chain.iter().map(|&k| store_util::bytes_of(k, B)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let caddr = cs.local_addr().to_string();
    assert_eq!(
        remote::offer(&caddr, &ns, &chain, &refs, &opts()).unwrap(),
        10
    );
    assert_eq!(cst.lookup(&chain), 10);
    assert_eq!(fetch_check(&caddr, &ns, &chain).unwrap(), 10);
    assert_eq!(cs.stats().blocks_offered, 10);

    // The server goes away: a clean error within the timeouts, no hang.
    drop(server);
    let k = fetch_check(&addr, &ns, &chain).unwrap_err().kind();
    assert!(
        matches!(k, ErrorKind::PeerClosed | ErrorKind::Timeout),
        "{k:?}"
    );
}

#[test]
fn bad_input() {
    let _serial = serial();
    let ns = store_util::ns();
    let chain = store_util::chain(2, 1);
    let mut one = vec![0u8; B];
    let mut dst: Vec<&mut [u8]> = vec![one.as_mut_slice()];
    assert_eq!(
        remote::fetch("127.0.0.1:1", &ns, &chain, &mut dst, &opts())
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        remote::fetch(
            "no-such-host.invalid:1",
            &ns,
            &chain[..1],
            &mut dst,
            &opts()
        )
        .unwrap_err()
        .kind(),
        ErrorKind::InvalidArgument
    );
    // A server that answers garbage: a protocol error, not a crash or hang.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 44];
        let _ = s.read_exact(&mut b);
        let _ = s.write_all(b"garbage-reply");
    });
    assert_eq!(
        remote::fetch(&addr, &ns, &chain[..1], &mut dst, &opts())
            .unwrap_err()
            .kind(),
        ErrorKind::Protocol
    );
    t.join().unwrap();
}

// ---- Trust boundary of the remote tier (issue 24 item 3): credentials, caps, streamed offers.

fn psk(key: &[u8]) -> RemoteOptions {
    RemoteOptions {
        security: tpu_sync::net::Security::from_psk(key).unwrap(),
        ..opts()
    }
}

const FLEET_KEY: &[u8] = b"remote tier fleet key: 32 bytes!";

fn fetch_with(
    addr: &str,
    ns: &Namespace,
    chain: &[BlockKey],
    o: &RemoteOptions,
) -> tpu_sync::Result<Vec<Vec<u8>>> {
    let mut bufs: Vec<Vec<u8>> = chain.iter().map(|_| vec![0u8; B]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let n = remote::fetch(addr, ns, chain, &mut dst, o)?;
    bufs.truncate(n);
    Ok(bufs)
}

/// `got` holds exactly `n` blocks, each byte-exact to its key's contents in `chain`.
fn assert_exact(got: &[Vec<u8>], chain: &[BlockKey], n: usize) {
    assert_eq!(got.len(), n);
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, store_util::bytes_of(chain[i], B), "block {i}");
    }
}

/// Fetches `chain` from `server` with each of `outsiders` (credentials it must refuse): each
/// fails in the handshake, no block is sent, and each refusal is counted.
fn assert_refused(
    server: &RemoteServer,
    ns: &Namespace,
    chain: &[BlockKey],
    outsiders: &[RemoteOptions],
) {
    let addr = server.local_addr().to_string();
    // The server counts a block once its write returned, which can be after the client has read
    // it: take the baseline once earlier connections are done (`serving` back to 0).
    let t0 = std::time::Instant::now();
    while server.stats().serving > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let before = server.stats();
    for o in outsiders {
        let e = fetch_with(&addr, ns, chain, o).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Protocol | ErrorKind::PeerClosed | ErrorKind::Timeout
            ),
            "{e}"
        );
    }
    // The server counts a failed handshake once it has read the client's alert (or its plain
    // bytes), which may be a moment after the client gave up.
    let want = before.handshake_failures + outsiders.len() as u64;
    let t0 = std::time::Instant::now();
    while server.stats().handshake_failures < want && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let after = server.stats();
    assert_eq!(after.blocks_sent, before.blocks_sent, "{after:?}");
    assert_eq!(after.handshake_failures, want, "{after:?}");
}

/// Offers a fresh chain of two blocks (seed `seed`) to the server at `addr` over `store`: with
/// `outsider` it is refused and nothing is stored; with `member` both blocks are stored.
fn assert_only_members_offer(
    addr: &str,
    ns: &Namespace,
    store: &KvStore,
    seed: u64,
    outsider: &RemoteOptions,
    member: &RemoteOptions,
) {
    let chain = store_util::chain(2, seed);
    let blocks: Vec<Vec<u8>> = chain.iter().map(|&k| store_util::bytes_of(k, B)).collect();
    let refs: Vec<&[u8]> = blocks.iter().map(|v| v.as_slice()).collect();
    assert!(remote::offer(addr, ns, &chain, &refs, outsider).is_err());
    assert_eq!(store.lookup(&chain), 0);
    assert_eq!(remote::offer(addr, ns, &chain, &refs, member).unwrap(), 2);
    assert_eq!(store.lookup(&chain), 2);
}

#[test]
fn a_server_without_credentials_listens_beyond_loopback_only_when_told_insecure() {
    let _serial = serial();
    let s = store(4);
    let e = RemoteServer::serve(s.clone(), "0.0.0.0:0", opts()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("without credentials"), "{e}");
    // Loopback needs no credentials; credentials or an explicit `insecure` allow any address.
    drop(RemoteServer::serve(s.clone(), "127.0.0.1:0", opts()).unwrap());
    drop(RemoteServer::serve(s.clone(), "0.0.0.0:0", psk(FLEET_KEY)).unwrap());
    let insecure = RemoteOptions {
        insecure: true,
        ..opts()
    };
    drop(RemoteServer::serve(s, "0.0.0.0:0", insecure).unwrap());
}

#[test]
fn with_a_pre_shared_key_only_members_fetch_and_offer_and_members_fetch_only_from_members() {
    let _serial = serial();
    let ns = store_util::ns();
    let chain = store_util::chain(6, 41);
    let a = store(8);
    put(&a, &chain);
    let server = RemoteServer::serve(a.clone(), "127.0.0.1:0", psk(FLEET_KEY)).unwrap();
    let addr = server.local_addr().to_string();

    // A member: byte-exact.
    let got = fetch_with(&addr, &ns, &chain, &psk(FLEET_KEY)).unwrap();
    assert_exact(&got, &chain, 6);
    // No credentials, or another key: refused during the handshake, not a single block sent.
    assert_refused(
        &server,
        &ns,
        &chain,
        &[opts(), psk(b"another fleet's key, 32 bytes!!!")],
    );
    assert_eq!(server.stats().blocks_sent, 6);

    // An outsider's raw offer (plain frames to a TLS port) plants nothing.
    let planted = store_util::chain(1, 42);
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let mut w = Vec::new();
        w.extend_from_slice(b"TSRT");
        w.extend_from_slice(&1u16.to_le_bytes());
        w.extend_from_slice(&2u16.to_le_bytes());
        w.extend_from_slice(&ns.id().to_le_bytes());
        w.extend_from_slice(&1u32.to_le_bytes());
        let body = store_util::bytes_of(planted[0], B);
        w.extend_from_slice(&planted[0].0.to_le_bytes());
        w.extend_from_slice(&(B as u64).to_le_bytes());
        w.extend_from_slice(&tpu_sync::store::checksum::checksum(&body).to_le_bytes());
        w.extend_from_slice(&body);
        let _ = s.write_all(&w);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        assert!(
            !sink.starts_with(b"TSRT"),
            "a plain reply from a TLS server"
        );
    }
    assert_eq!(a.lookup(&planted), 0, "an unauthenticated offer was stored");

    // A member's offer is stored; a non-member's is refused.
    assert_only_members_offer(&addr, &ns, &a, 43, &opts(), &psk(FLEET_KEY));

    // A member never takes bytes from a server that cannot prove the key (a plain server at an
    // address a record names): the handshake fails, nothing is delivered.
    let plain = RemoteServer::serve(a.clone(), "127.0.0.1:0", opts()).unwrap();
    let e = fetch_with(
        &plain.local_addr().to_string(),
        &ns,
        &chain,
        &psk(FLEET_KEY),
    )
    .unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Protocol | ErrorKind::PeerClosed | ErrorKind::Timeout
        ),
        "{e}"
    );
    assert_eq!(plain.stats().blocks_sent, 0);
}

/// Issue 24, item 3, the other credential: certificates of a private CA (mutual TLS, as the
/// endpoints' `Security::from_pem_files`). A member (a certificate the CA signed) fetches
/// byte-exact and offers; a peer with a certificate of another CA, with none, or with a PSK is
/// refused in the handshake: no block sent, nothing stored, each failure counted.
#[test]
fn with_certificates_of_a_private_ca_only_members_fetch_and_offer() {
    let _serial = serial();
    let base = std::env::temp_dir().join(format!("tpu-sync-remote-pki-{}", std::process::id()));
    let fleet =
        tpu_sync::net::tls::generate_test_pki(&base.join("fleet"), &["host-a", "host-b"]).unwrap();
    let rogue = tpu_sync::net::tls::generate_test_pki(&base.join("rogue"), &["host-b"]).unwrap();
    let tls = |p: &tpu_sync::net::tls::TestPki, name: &str| RemoteOptions {
        security: p.security(name).unwrap(),
        ..opts()
    };
    let ns = store_util::ns();
    let chain = store_util::chain(4, 51);
    let a = store(8);
    put(&a, &chain);
    let server = RemoteServer::serve(a.clone(), "127.0.0.1:0", tls(&fleet, "host-a")).unwrap();
    let addr = server.local_addr().to_string();
    let got = fetch_with(&addr, &ns, &chain, &tls(&fleet, "host-b")).unwrap();
    assert_exact(&got, &chain, 4);
    assert_refused(
        &server,
        &ns,
        &chain,
        &[tls(&rogue, "host-b"), opts(), psk(FLEET_KEY)],
    );
    // Offers: the rogue's is refused and stores nothing; the member's is stored.
    assert_only_members_offer(
        &addr,
        &ns,
        &a,
        52,
        &tls(&rogue, "host-b"),
        &tls(&fleet, "host-b"),
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&base);
}

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with(prefix))
        .count()
}

#[test]
fn connections_are_capped_served_by_a_fixed_pool_and_a_trickling_peer_is_cut_off() {
    let _serial = serial();
    let ns = store_util::ns();
    let chain = store_util::chain(3, 44);
    let a = store(4);
    put(&a, &chain);
    let o = RemoteOptions {
        io_timeout: Duration::from_millis(1500),
        workers: 2,
        max_queued: 2,
        ..opts()
    };
    let server = RemoteServer::serve(a.clone(), "127.0.0.1:0", o.clone()).unwrap();
    let addr = server.local_addr();
    // Two workers and the accept thread (each names itself once it runs).
    let t0 = std::time::Instant::now();
    while threads_named("tpu-sync-remot") < 3 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let threads = threads_named("tpu-sync-remot");
    assert_eq!(threads, 3, "two workers and the accept thread");
    let wait_for = |what: &str, f: &dyn Fn(&remote::RemoteStats) -> bool| {
        let t0 = std::time::Instant::now();
        while !f(&server.stats()) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "never {what}: {:?}",
                server.stats()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // Twelve strangers connect and send nothing: two are being served (each worker waits up to
    // io_timeout for a request), two wait in the queue, the rest are closed at once. No thread
    // per connection.
    let mut idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    wait_for("two connections in service", &|s| s.serving == 2);
    idle.extend((0..10).map(|_| std::net::TcpStream::connect(addr).unwrap()));
    wait_for("eight refused", &|s| s.refused >= 8);
    let st = server.stats();
    assert_eq!((st.refused, st.serving), (8, 2), "{st:?}");
    assert_eq!(threads_named("tpu-sync-remot"), threads);
    // A peer that trickles one byte of a request every 200 ms holds a worker for at most one
    // io_timeout, so the pool frees and a member's fetch goes through.
    let trickle = std::thread::spawn(move || {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let t0 = std::time::Instant::now();
        for b in b"TSRT\x01\x00\x01\x00".iter().cycle().take(40) {
            if s.write_all(&[*b]).is_err() {
                return t0.elapsed();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        t0.elapsed()
    });
    drop(idle);
    let t1 = std::time::Instant::now();
    let got = loop {
        match fetch_with(&addr.to_string(), &ns, &chain, &o) {
            Ok(g) => break g,
            Err(e) if t1.elapsed() < Duration::from_secs(10) => {
                log::debug!("retrying after {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("the pool never freed: {e}"),
        }
    };
    assert_eq!(got.len(), 3);
    assert_eq!(got[2], store_util::bytes_of(chain[2], B));
    // The trickler was cut off well before its 8 s of bytes were sent.
    let held = trickle.join().unwrap();
    assert!(
        held < Duration::from_secs(7),
        "a trickling peer held a worker for {held:?}"
    );
}

#[test]
fn an_offer_larger_than_one_batch_is_streamed_into_the_store_as_one_chain() {
    let _serial = serial();
    const BIG: usize = 1 << 20;
    let ns = store_util::ns();
    // 40 blocks of 1 MiB: two and a half batches of OFFER_BATCH_BYTES (16 MiB).
    assert!(40 * BIG as u64 > 2 * remote::OFFER_BATCH_BYTES);
    let a = KvStore::open(store_util::config(BIG as u64, 48)).unwrap();
    let server = RemoteServer::serve(a.clone(), "127.0.0.1:0", psk(FLEET_KEY)).unwrap();
    let addr = server.local_addr().to_string();
    let chain = store_util::chain(40, 45);
    let blocks: Vec<Vec<u8>> = chain
        .iter()
        .map(|&k| store_util::bytes_of(k, BIG))
        .collect();
    let refs: Vec<&[u8]> = blocks.iter().map(|v| v.as_slice()).collect();
    assert_eq!(
        remote::offer(&addr, &ns, &chain, &refs, &psk(FLEET_KEY)).unwrap(),
        40
    );
    assert_eq!(server.stats().blocks_offered, 40);
    // One chain: the whole prefix is found and reads back byte-exact.
    assert_eq!(a.lookup(&chain), 40);
    let mut bufs: Vec<Vec<u8>> = chain.iter().map(|_| vec![0u8; BIG]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    assert_eq!(
        remote::fetch(&addr, &ns, &chain, &mut dst, &psk(FLEET_KEY)).unwrap(),
        40
    );
    for (i, b) in bufs.iter().enumerate() {
        assert!(*b == blocks[i], "block {i} differs");
    }
}
