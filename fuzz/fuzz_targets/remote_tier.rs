//! The remote tier's two wire parsers fed arbitrary bytes over loopback (`cluster::remote`):
//!
//! * the server's request reader: the 28-byte header (magic, version, op, namespace, count), the
//!   key list of a fetch, the records of an offer (key, length, checksum, bytes) and its batches;
//! * the client's reply reader: the status header, the count, each block's length and checksum,
//!   the end marker.
//!
//! Properties: no panic and no hang (every connection ends within the deadlines); after each
//! input the server still answers a well-formed fetch of its chain byte-exact, so no input
//! corrupts or loses a stored block; a fetch from a lying server either fails or delivers at
//! most the blocks asked for, each of exactly the destination's length and matching the checksum
//! it came with (verified here independently).
#![no_main]
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tsync::arena::ArenaOptions;
use tsync::cluster::remote::{self, RemoteOptions, RemoteServer};
use tsync::store::{checksum, BlockKey, KvStore, Namespace, StoreConfig};

/// Small blocks, so that well-formed replies fit in a few hundred bytes of fuzz input.
const B: usize = 256;
const N: usize = 4;

struct Fixture {
    _server: RemoteServer,
    addr: String,
    ns: Namespace,
    chain: Vec<BlockKey>,
    blocks: Vec<Vec<u8>>,
}

fn opts() -> RemoteOptions {
    RemoteOptions {
        connect_timeout: Duration::from_millis(500),
        io_timeout: Duration::from_millis(100),
        workers: 2,
        max_queued: 8,
        ..RemoteOptions::default()
    }
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let ns = Namespace::new("fuzz remote tier");
        // Room for far more blocks than one input can offer (libFuzzer's inputs are at most a
        // few KiB), and every valid fetch below refreshes the chain: offers never evict it.
        let mut c = StoreConfig::new(ns.clone(), B as u64, (B * 16384) as u64);
        c.memory = ArenaOptions {
            lock: false,
            huge_pages: false,
            populate: true,
        };
        let store = KvStore::open(c).expect("store");
        let chain: Vec<BlockKey> = (1..=N as u128).map(|i| BlockKey(i * 0x9e37_79b9)).collect();
        let blocks: Vec<Vec<u8>> = (0..N)
            .map(|i| {
                (0..B)
                    .map(|j| ((i * 131 + j * 7) % 251 + 1) as u8)
                    .collect()
            })
            .collect();
        let refs: Vec<&[u8]> = blocks.iter().map(|b| b.as_slice()).collect();
        assert!(store
            .put_from_host(None, &chain, &refs)
            .expect("put")
            .complete());
        let server = RemoteServer::serve(store, "127.0.0.1:0", opts()).expect("serve");
        Fixture {
            addr: server.local_addr().to_string(),
            _server: server,
            ns,
            chain,
            blocks,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    // The first byte says where the rest splits between the two sides.
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let (to_server, to_client) = body.split_at(sel as usize * body.len() / 256);

    // The server side: arbitrary request bytes, then the write side closed.
    if let Ok(mut s) = TcpStream::connect(&f.addr) {
        let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
        let _ = s.write_all(to_server);
        let _ = s.shutdown(Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    // ... and the stored chain is still served whole and byte-exact.
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; B]; N];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let o = RemoteOptions {
        io_timeout: Duration::from_secs(2),
        ..opts()
    };
    let n = remote::fetch(&f.addr, &f.ns, &f.chain, &mut dst, &o).expect("a valid fetch");
    assert_eq!(n, N);
    assert!(bufs == f.blocks, "a stored block changed");

    // The client side: a server that answers any request with `to_client`.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let reply = to_client.to_vec();
    let t = std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let mut req = vec![0u8; 28 + 16 * N];
            let _ = s.read_exact(&mut req);
            let _ = s.write_all(&reply);
        }
    });
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; B]; N];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    if let Ok(n) = remote::fetch(&addr, &f.ns, &f.chain, &mut dst, &opts()) {
        assert!(n <= N);
        // Each delivered block is exactly what the reply carried under its checksum.
        let mut off = 10;
        for b in &bufs[..n] {
            let sum = u64::from_le_bytes(to_client[off + 8..off + 16].try_into().unwrap());
            assert_eq!(checksum::checksum(b), sum);
            assert_eq!(&to_client[off + 16..off + 16 + B], b.as_slice());
            off += 16 + B;
        }
    }
    let _ = t.join();
});
