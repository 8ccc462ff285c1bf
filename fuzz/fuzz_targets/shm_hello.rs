//! The same-host transport's handshake (`net::shm`) fed arbitrary bytes over real abstract Unix
//! sockets, both ways:
//!
//! * the listener side: a raw local connector writes arbitrary bytes where the 48-byte hello
//!   (magic, pid, port, version, probe address and length, listen address) and the probe's
//!   answer byte belong, then goes away;
//! * the client side: a squatter on the name `@tpu-sync-shm/<port>` of a port whose TCP
//!   listener is genuine answers the client's hello with arbitrary bytes.
//!
//! Properties: no panic and no hang (every handshake ends within the transport's timeouts);
//! after each input the real listener still accepts a genuine same-host lane and carries bytes
//! on it both ways, exactly; a client talking to the squatter either fails with an error, falls
//! back to TCP (the lane then reaches the genuine TCP listener), or, only when the squatter's
//! hello was well-formed and named the port the client asked for, gets a Unix lane.
#![no_main]
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tsync::net::shm::{socket_name, ShmTransport, HELLO_LEN};
use tsync::net::transport::{Acceptor, Lane, Transport, TransportTimeouts};

const TIMEOUTS: TransportTimeouts = TransportTimeouts {
    connect: Duration::from_millis(500),
    handshake: Duration::from_millis(300),
};

struct Fixture {
    rt: tokio::runtime::Runtime,
    shm: Arc<ShmTransport>,
    acceptor: Arc<dyn Acceptor>,
    addr: SocketAddr,
    /// A port whose TCP listener is genuine (it accepts and drops lanes) and whose abstract
    /// Unix name this process squats.
    squat_addr: SocketAddr,
    squat: UnixListener,
}

fn abstract_name(port: u16) -> UnixAddr {
    UnixAddr::from_abstract_name(socket_name(port).as_bytes()).expect("abstract name")
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let shm = Arc::new(ShmTransport::new(TIMEOUTS));
        let acceptor = rt
            .block_on(shm.listen(SocketAddr::from(([127, 0, 0, 1], 0))))
            .expect("listen");
        let addr = acceptor.local_addr();
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let squat_addr = tcp.local_addr().expect("addr");
        std::thread::spawn(move || {
            for s in tcp.incoming() {
                drop(s);
            }
        });
        let squat = UnixListener::bind_addr(&abstract_name(squat_addr.port())).expect("squat");
        Fixture {
            rt,
            shm,
            acceptor,
            addr,
            squat_addr,
            squat,
        }
    })
}

/// Whether `h` is a hello the client must accept for a lane to `port` on 127.0.0.1: the magic,
/// version 1, the port, and the loopback or unspecified address (IPv4-mapped, as it is encoded).
fn acceptable_hello(h: &[u8], port: u16) -> bool {
    if h.len() < HELLO_LEN + 1 {
        return false;
    }
    let ip = &h[32..48];
    let v4_mapped = ip[..10].iter().all(|&b| b == 0) && ip[10] == 0xff && ip[11] == 0xff;
    let ip_ok = (v4_mapped && (ip[12..16] == [127, 0, 0, 1] || ip[12..16] == [0, 0, 0, 0]))
        || ip.iter().all(|&b| b == 0);
    &h[0..8] == b"TSYNCSHM"
        && u16::from_le_bytes([h[12], h[13]]) == port
        && u16::from_le_bytes([h[14], h[15]]) == 1
        && ip_ok
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    // The first byte says where the rest splits between the two sides.
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let (to_listener, to_client) = body.split_at(sel as usize * body.len() / 256);

    // The listener side: a raw local connector's bytes, then it goes away.
    if let Ok(mut s) = UnixStream::connect_addr(&abstract_name(f.addr.port())) {
        let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
        let _ = s.write_all(to_listener);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = [0u8; HELLO_LEN + 1];
        let _ = s.read(&mut sink);
    }

    // ... and a genuine lane is still accepted and carries bytes both ways. A raw connector
    // whose hello passed is accepted too; its lane carries what it wrote after the hello, or
    // ends, and is skipped.
    let token: [u8; 16] = std::array::from_fn(|i| data.len() as u8 ^ (i as u8 * 37 + 1));
    f.rt.block_on(async {
        let conn = f.shm.connect(f.addr).await.expect("connect");
        let mut lane = conn.open_lane().await.expect("a genuine lane");
        assert!(
            lane.shm_peer().is_some(),
            "the lane is a same-host (Unix) lane"
        );
        lane.write_all(&token).await.expect("write");
        loop {
            let mut srv = tokio::time::timeout(Duration::from_secs(5), f.acceptor.accept())
                .await
                .expect("the genuine lane is accepted in time")
                .expect("accept");
            let mut got = [0u8; 16];
            match tokio::time::timeout(Duration::from_secs(5), srv.read_exact(&mut got)).await {
                // The raw connector's lane: its hello passed (same user), and it carries the
                // bytes the connector wrote after its hello and probe answer.
                Ok(Ok(_)) if got != token => {
                    assert_eq!(
                        to_listener.get(HELLO_LEN + 1..HELLO_LEN + 17),
                        Some(&got[..]),
                        "a lane carried bytes nobody wrote"
                    );
                    continue;
                }
                Ok(Ok(_)) => {
                    let back: Vec<u8> = token.iter().rev().copied().collect();
                    srv.write_all(&back).await.expect("write back");
                    let mut echo = [0u8; 16];
                    lane.read_exact(&mut echo).await.expect("read back");
                    assert_eq!(&echo[..], &back[..]);
                    break;
                }
                // The raw connector's lane (it wrote a valid hello and left).
                Ok(Err(_)) => continue,
                Err(_) => panic!("an accepted lane neither carried bytes nor ended"),
            }
        }
    });

    // The client side: the squatter answers the client's hello with `to_client`.
    let reply = to_client.to_vec();
    let squat = f.squat.try_clone().expect("clone");
    let t = std::thread::spawn(move || {
        if let Ok((mut s, _)) = squat.accept() {
            let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
            let mut hello = [0u8; HELLO_LEN];
            let _ = s.read_exact(&mut hello);
            let _ = s.write_all(&reply);
            // Nothing more comes: the client sees the end of the stream, not a silence.
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut one = [0u8; 1];
            let _ = s.read(&mut one);
        }
    });
    let got = f.rt.block_on(async {
        let conn = f
            .shm
            .connect(f.squat_addr)
            .await
            .expect("the TCP listener is genuine");
        tokio::time::timeout(Duration::from_secs(5), conn.open_lane())
            .await
            .expect("the handshake ends within its timeouts")
    });
    if let Ok(lane) = got {
        if lane.shm_peer().is_some() {
            assert!(
                acceptable_hello(to_client, f.squat_addr.port()),
                "a Unix lane on a hello that did not name this port"
            );
        }
    }
    let _ = t.join();
});
