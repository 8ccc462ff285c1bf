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
