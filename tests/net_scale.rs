//! 50,000 small transfers between two endpoints reuse a bounded set of sockets (no connection per
//! transfer, so no ephemeral-port exhaustion / EADDRNOTAVAIL), and every byte arrives.

mod net_util;

use std::sync::Arc;
use std::time::{Duration, Instant};

use net_util::*;
use tpu_sync::net::{PeerMap, PullRequest, TransportKind};
use tpu_sync::plan::Plan;

const TRANSFERS: usize = 50_000;
const CONCURRENCY: usize = 32;

#[test]
fn fifty_thousand_small_transfers_use_bounded_sockets() {
    run(Duration::from_secs(300), async {
        let pki = pki(&["prefill", "decode"]);
        let kind = TransportKind::Tcp;
        let mut m = tpu_sync::layout::ModelKv::preset("deepseek-v3").unwrap();
        m.num_layers = 1;
        let tokens = 3;
        let src = placement(layout(&m, "tp=1,block=16", tokens), 0, tokens, 1);
        let dst = placement(layout(&m, "tp=1,block=16", tokens), 0, tokens, 2);
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        let base = fds();
        let prefill = endpoint(kind, &pki, "prefill", true).await;
        let decode = Arc::new(endpoint(kind, &pki, "decode", false).await);
        register_whole(&prefill, &src, tokens, 1);
        let addr = prefill.local_addr().unwrap().to_string();
        let t0 = Instant::now();
        let max_sockets = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..CONCURRENCY {
            let (decode, src, dst, plan, addr, max_sockets) = (
                decode.clone(),
                src.clone(),
                dst.clone(),
                plan.clone(),
                addr.clone(),
                max_sockets.clone(),
            );
            workers.spawn(async move {
                let st = dest_staging(&plan, &dst, None);
                let mut n = 0;
                let mut i = w;
                while i < TRANSFERS {
                    let t = decode
                        .pull(PullRequest {
                            request_id: 1,
                            num_tokens: tokens,
                            src: src.clone(),
                            sources: PeerMap::single(addr.clone()),
                            dst: dst.clone(),
                            staging: st.clone(),
                            dst_ranks: None,
                            plan: None,
                            wait_for_registration: None,
                        })
                        .unwrap();
                    let s = t
                        .wait()
                        .await
                        .unwrap_or_else(|e| panic!("transfer {i} failed: {e}"));
                    assert_eq!(s.bytes, plan.total_bytes());
                    if i % 1000 == w {
                        assert_eq!(verify_dest(&dst, tokens, &st, None), plan.total_bytes());
                        max_sockets.fetch_max(fds().1, std::sync::atomic::Ordering::Relaxed);
                    }
                    n += 1;
                    i += CONCURRENCY;
                }
                n
            });
        }
        let mut done = 0;
        while let Some(r) = workers.join_next().await {
            done += r.unwrap();
        }
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(done, TRANSFERS);
        let ds = decode.stats();
        let ps = prefill.stats();
        eprintln!(
            "{TRANSFERS} transfers in {secs:.1} s ({:.0}/s); decode lanes opened {}, prefill lanes \
             accepted {}, peak sockets in this process {}",
            TRANSFERS as f64 / secs,
            ds.lanes_opened,
            ps.lanes_opened,
            max_sockets.load(std::sync::atomic::Ordering::Relaxed)
        );
        assert_eq!(ds.transfers_completed, TRANSFERS as u64);
        assert_eq!(ds.transfers_failed, 0);
        // One control lane plus at most max_lanes_per_peer (8) data lanes, each one socket, on
        // each side; plus the listener.
        assert!(ds.lanes_opened <= 9, "{ds:?}");
        assert!(ps.lanes_opened <= 9, "{ps:?}");
        let peak = max_sockets.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            peak <= base.1 + 2 * 9 + 1,
            "peak {peak} sockets (baseline {})",
            base.1
        );
        drop(decode);
        drop(prefill);
        let t = Instant::now();
        while fds().1 > base.1 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "sockets leaked: {:?} vs {base:?}",
                fds()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
