//! # tpu-sync
//!
//! Zero-copy KV-cache transfer for LLM serving. tpu-sync moves the paged attention KV cache of a
//! request between accelerator memory (through the PJRT C API), pinned host memory, and other
//! serving instances over the network, resharding it in transit when the prefill and decode
//! instances split the cache differently (TP / PCP / DP, block size, block order).
//!
//! The path of a block in a prefill/decode transfer (see `docs/architecture.md`):
//!
//! 1. **D2H**: [`device::d2h_batch`] copies the request's blocks from the prefill ranks' PJRT
//!    device buffers into a [`arena::PinnedArena`] (`PJRT_Buffer_CopyRawToHost`; 1 copy).
//! 2. **Plan**: [`plan::Plan::build`] computes, from the two sides' [`plan::Placement`]s, which
//!    byte spans each decode rank needs from which prefill rank. Pure code.
//! 3. **Network**: [`net`] moves each `(source rank, destination rank)` stream from the sender's
//!    arena into the receiver's arena, pulled or pushed, over TCP, TLS 1.3 or QUIC (on plain TCP
//!    vectored writes and reads: 1 copy into the kernel and 1 out).
//! 4. **H2D**: [`device::h2d_batch`] writes the received bytes into the decode ranks' existing
//!    device buffers in place, by the path [`pjrt::Capabilities`] probed (1 copy).
//!
//! Modules with no I/O: [`layout`], [`plan`], [`wire`], [`pattern`]. Adapters: [`pjrt`],
//! [`device`], [`arena`], [`staging`], [`net`]. The host KV tier (prefix-keyed pinned store,
//! warm restart from `/dev/shm`, disk tier): [`store`].
//!
//! # Cargo features
//!
//! All on by default (and always on in the `tpu-sync` CLI, the C library `libtpu_sync` and the
//! Python wheel). `--no-default-features` gives the lean core: device copies, staging, planning,
//! the TCP/TLS/shm transports and the host tier, with no `protoc` at build time and none of the
//! dependencies below (`make test-lean` builds and tests it that way).
//!
//! | feature | what it adds | dependencies |
//! |---|---|---|
//! | `cluster` | the fleet prefix cache: [`cluster`] (etcd directory, remote tier member, loads) | `etcd-client`, `tonic` (protoc at build time) |
//! | `kv-events` | the ZMQ publisher of [`kv_events`] ([`kv_events::KvEventPublisher::start`]) | `zeromq` |
//! | `metrics-http` | the HTTP `GET /metrics` endpoint ([`metrics::serve`], `TPU_SYNC_METRICS_ADDR`) | `hyper`, `hyper-util`, `http-body-util` |
//! | `quic` | the QUIC transport ([`net::TransportKind::Quic`]) | `quinn` |
//!
//! Without a feature its configuration still parses, and asking for it is an
//! [`Error::InvalidArgument`] that names the missing feature (e.g. `transport quic`, a store with
//! `kv_events` set, `TPU_SYNC_METRICS_ADDR`), never a silent no-op.

pub mod arena;
pub mod budget;
#[cfg(feature = "cluster")]
pub mod cluster;
pub mod device;
mod drive;
pub mod error;
pub mod kv_events;
pub mod layout;
pub mod metrics;
pub mod net;
pub mod pattern;
pub mod pjrt;
pub mod plan;
pub mod staging;
pub mod store;
pub mod transfer;
pub mod util;
pub mod wire;

pub use error::{Error, ErrorKind, Result};

/// The lean build (`--no-default-features`, `make test-lean`): each left-out part, when asked
/// for, is a clear error that names its feature.
#[cfg(test)]
mod lean_tests {
    #[cfg(not(feature = "quic"))]
    #[test]
    fn quic_without_its_feature_is_refused_by_name() {
        let o = crate::net::EndpointOptions {
            transport: crate::net::TransportKind::Quic,
            ..Default::default()
        };
        let Err(e) = crate::net::endpoint::make_transport(&o) else {
            panic!("transport quic was not refused")
        };
        assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("`quic` cargo feature"), "{e}");
    }

    #[cfg(not(feature = "kv-events"))]
    #[test]
    fn kv_events_without_their_feature_are_refused_by_name() {
        let cfg = crate::kv_events::KvEventsConfig {
            endpoint: "tcp://127.0.0.1:0".into(),
            ..Default::default()
        };
        let e = crate::kv_events::KvEventPublisher::start(&cfg).expect_err("refused");
        assert!(e.to_string().contains("`kv-events` cargo feature"), "{e}");
        // A bad endpoint is still reported as such.
        let bad = crate::kv_events::KvEventsConfig {
            endpoint: "udp://x".into(),
            ..Default::default()
        };
        let e = crate::kv_events::KvEventPublisher::start(&bad).expect_err("refused");
        assert!(e.to_string().contains("expected tcp://HOST:PORT"), "{e}");
    }

    #[cfg(not(feature = "metrics-http"))]
    #[test]
    fn the_metrics_endpoint_without_its_feature_is_refused_by_name() {
        // The address still parses; only serving it needs the feature.
        assert!(crate::metrics::parse_addr("127.0.0.1:0", 0)
            .unwrap()
            .is_some());
        assert!(crate::metrics::serve_from_env_value("off", None)
            .unwrap()
            .is_none());
        let e = crate::metrics::serve_from_env_value("127.0.0.1:0", None).expect_err("refused");
        assert!(
            e.to_string().contains("`metrics-http` cargo feature"),
            "{e}"
        );
    }
}
