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

pub mod arena;
pub mod budget;
pub mod cluster;
pub mod device;
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
