//! The remote tier, device path: load the present prefix of a prompt that other instances hold in
//! their host tiers straight into this instance's device blocks, resharded when the two layouts
//! differ (as P/D transfer is).
//!
//! # What a "block" of another layout is
//!
//! A host tier stores *one rank's* blocks of *one layout*: its [`Namespace`] names the model,
//! dtype, layout and rank, and a stored block is exactly what
//! [`DeviceBlock::kv_block`](crate::store::DeviceBlock::kv_block) copies out of that rank's
//! device buffers (every layer in order, K then V, the block's `block_size` tokens of the rank's
//! heads, in the layout's block order). Such a block means nothing to an instance of another
//! layout byte for byte, so it is never stored under the consumer's namespace as is. The rule:
//!
//! * the **producer** serves its blocks unchanged, per rank, as a P/D source would
//!   ([`super::remote::RemoteServer`], one store per rank), and describes each store in its
//!   directory record ([`StoreSource`] as the [`HostRecord`](super::HostRecord)'s `meta`:
//!   layout, rank, namespace description);
//! * the **consumer** fetches, for every rank of the producer's replica, the leading present
//!   blocks of that rank's key chain ([`super::remote::fetch`]: pinned while read at the
//!   producer, checksummed on arrival) into one pinned arena, then plans the copy from the
//!   producer's layout to its own with the reshard planner ([`Plan::build`]: other TP split,
//!   block size, block order) exactly as a P/D pull does, gathers what each of its ranks needs
//!   into a destination [`Staging`] (budgeted, exactly the planned bytes) and writes it into its
//!   device blocks in place (H2D, [`Staging::drain_to_device`]). If it wants the prefix in its
//!   own host tier it stores its device blocks afterwards, under its own namespace.
//!
//! # Guarantees
//!
//! * **The present prefix, never wrong bytes.** The tokens loaded are the longest prefix every
//!   producer rank delivered whole, rounded down to whole destination blocks (unless it is the
//!   whole request): a block evicted at the producer between the directory lookup and the read
//!   shortens the prefix (a miss), a stale directory entry is a shorter or empty load.
//! * **All or nothing on the device.** Nothing is written to a device buffer before every
//!   source's bytes arrived and verified; any error leaves the destination blocks untouched.
//!   Bytes outside the loaded tokens (the rest of a partial block, other blocks) are never
//!   written.
//! * **Bounded memory.** Both the fetched blocks and the destination staging are reserved from a
//!   [`StagingBudget`] before anything is allocated ([`Error::StagingExhausted`] otherwise).
//!
//! # A producer with PCP > 1
//!
//! A PCP rank's store holds the blocks of its token chunk of each request it prefilled (request
//! blocks [`ParallelLayout::pcp_chunk`] of *that* request's length, under the chain keys of
//! those blocks), so which rank holds block `i` of a prefix depends on the length of the request
//! that stored it, which the consumer does not know. The consumer therefore asks, per TP column
//! `t` (in parallel), PCP rank 0 for the leading present blocks of the chain, then PCP rank 1 for
//! the leading present blocks from where rank 0 stopped, and so on: the column's present prefix
//! is the concatenation, whatever request lengths stored it (keys name whole prefixes, so a
//! block under a key is the same bytes on whichever rank holds it). The fetched column is then
//! a PCP = 1 rank `t` of the producer's layout, and the plan is built from that.
//!
//! Limits: PCP = 1 on the consumer (its placement's chunks depend on the request length it
//! loads); the destination's DMA map is not registered (the pipeline's pull does; on the CPU
//! plugin it is a no-op).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::remote::{self, RemoteOptions};
use crate::arena::{ArenaOptions, PinnedArena};
use crate::budget::StagingBudget;
use crate::error::{Error, Result};
use crate::layout::{KvLayout, ParallelLayout};
use crate::plan::{Placement, Plan};
use crate::staging::Staging;
use crate::store::{BlockKey, Namespace};
use crate::transfer::KvBuffers;

/// What one published store holds: the layout and rank whose blocks it keeps and its namespace
/// description. Carried as JSON in the [`HostRecord::meta`](super::HostRecord::meta) of the store's
/// directory record, so that a consumer of another layout can find the producer's namespaces and
/// plan a load ([`Directory::hosts`](super::Directory::hosts) lists them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSource {
    /// The producer instance's layout.
    pub layout: ParallelLayout,
    /// The rank (local to its DP replica: `pcp * tp_size + tp`) whose blocks the store holds.
    pub rank: u32,
    /// The store's namespace description ([`Namespace::new`] of it is the store's namespace).
    pub namespace: String,
}

impl StoreSource {
    /// The JSON for [`HostRecord::meta`](super::HostRecord::meta).
    pub fn to_meta(&self) -> String {
        serde_json::to_string(self).expect("a StoreSource serializes")
    }

    /// Parses [`StoreSource::to_meta`]'s JSON; `None` for anything else (a host record of
    /// another kind).
    pub fn from_meta(meta: &str) -> Option<StoreSource> {
        serde_json::from_str(meta).ok()
    }

    /// The store's namespace.
    pub fn namespace(&self) -> Namespace {
        Namespace::new(self.namespace.clone())
    }
}

/// One rank of the producer's replica: where its store is served and its key chain.
#[derive(Debug, Clone)]
pub struct RemoteRank {
    /// The remote tier address serving that rank's store (`host:port`,
    /// [`Candidate::host`](super::Candidate::host)'s `addr`).
    pub addr: String,
    /// The store's namespace.
    pub namespace: Namespace,
    /// Keys of the rank's blocks of the request in chain order: key `i` holds request block `i`
    /// (tokens `i * block_size ..`, the producer's block size). At least as many as the request
    /// has producer blocks; extra keys are ignored.
    pub chain: Vec<BlockKey>,
}

/// One load ([`load_to_device`]).
#[derive(Debug, Clone)]
pub struct RemoteLoad {
    /// The producer's layout (its `num_blocks` is ignored).
    pub src: ParallelLayout,
    /// One entry per rank of the producer's replica, indexed by its local rank
    /// `pcp * tp_size + tp` (see the module docs for PCP > 1).
    pub sources: Vec<RemoteRank>,
    /// Where the request's tokens go on this side: the consumer's layout, DP replica and block
    /// ids of `num_tokens` tokens per rank.
    pub dst: Placement,
    /// Tokens asked for (the prompt prefix the chain keys cover).
    pub num_tokens: u32,
    /// This side's ranks of `dst`'s replica with their layer buffers; ranks not given are not
    /// written.
    pub kv: KvBuffers,
}

/// Options of [`load_to_device`] (default: [`RemoteOptions::default`], [`ArenaOptions::default`],
/// no wait).
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Timeouts of the fetches.
    pub remote: RemoteOptions,
    /// Memory of the fetched blocks and the destination staging.
    pub arena: ArenaOptions,
    /// How long a reservation may wait for the budget (`None`: fail at once).
    pub staging_wait: Option<Duration>,
}

/// What [`load_to_device`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Tokens written into the destination blocks (`0`: a miss, nothing written).
    pub tokens: u32,
    /// Destination blocks (per rank) those tokens fill, the last one possibly partial only when
    /// `tokens == num_tokens`.
    pub dst_blocks: u32,
    /// Blocks each producer rank delivered, by local rank (`pcp * tp_size + tp`); with PCP > 1
    /// a rank's count starts where the PCP rank before it in the same TP column stopped.
    pub present: Vec<usize>,
    /// Bytes fetched over the network (blocks delivered).
    pub fetched_bytes: u64,
    /// Bytes written to the device.
    pub device_bytes: u64,
    /// Bytes reserved from the budget (fetch arena and destination staging, page-rounded).
    pub staged_bytes: u64,
    /// Spans of the reshard plan.
    pub spans: usize,
    /// Time of the fetches (all ranks in parallel).
    pub fetch_time: Duration,
    /// Time of the gather and the H2D copies.
    pub device_time: Duration,
}

/// Loads the present prefix of `req`'s key chains from the producer's stores into the consumer's
/// device blocks (see the module docs). Blocks the producer no longer holds are a miss (fewer
/// tokens), not an error. The call blocks the calling thread; one fetch thread per producer rank.
///
/// Errors (the destination buffers are untouched in every case): [`Error::InvalidArgument`] for
/// a number of sources other than the producer's ranks per replica, a chain shorter than the
/// request, or mismatched buffers; [`Error::Unsupported`] for PCP > 1 on the consumer or no
/// in-place H2D path; the placement and plan errors of [`Plan::build`] ([`Error::Mismatch`] for
/// another model or physical layout, [`Error::BlockRange`] for bad block ids);
/// [`Error::StagingExhausted`]; the fetch errors of [`remote::fetch`] ([`Error::PeerClosed`] /
/// [`Error::Timeout`] for a dead or stalled producer, [`Error::Checksum`] for a corrupt block,
/// [`Error::Mismatch`] for a store of another namespace); device copy errors.
pub fn load_to_device(
    req: &RemoteLoad,
    budget: &Arc<StagingBudget>,
    o: &LoadOptions,
) -> Result<LoadReport> {
    let t0 = Instant::now();
    let src = &req.src;
    src.validate()?;
    if req.dst.layout.spec.pcp != 1 {
        return Err(Error::Unsupported {
            plugin: "tpu-sync".into(),
            what: format!(
                "remote load into a consumer with PCP={}: only PCP=1 on the consumer (any PCP \
                 on the producer)",
                req.dst.layout.spec.pcp
            ),
        });
    }
    if req.dst.groups.is_some() {
        return Err(Error::Unsupported {
            plugin: "tpu-sync".into(),
            what: "remote load into a placement with KV cache groups (hybrid models): only \
                   uniform layouts"
                .into(),
        });
    }
    if req.dst.first_token != 0 {
        return Err(Error::Unsupported {
            plugin: "tpu-sync".into(),
            what: format!(
                "remote load into a placement from token {}: a remote load delivers the \
                 matched prefix from token 0",
                req.dst.first_token
            ),
        });
    }
    let ranks = src.spec.ranks_per_replica() as usize;
    if req.sources.len() != ranks {
        return Err(Error::InvalidArgument(format!(
            "remote load: {} sources for a producer of {ranks} ranks per replica ({})",
            req.sources.len(),
            src.describe()
        )));
    }
    // Checks the consumer's side (and that the two models agree) before any byte moves.
    req.dst.validate(req.num_tokens)?;
    src.model.check_compatible(&req.dst.layout.model)?;
    req.kv.check(&req.dst, "destination")?;
    req.kv.caps().require_h2d()?;
    let need = src.request_blocks(req.num_tokens)? as usize;
    for (r, s) in req.sources.iter().enumerate() {
        if s.chain.len() < need {
            return Err(Error::InvalidArgument(format!(
                "remote load: producer rank {r}'s chain has {} keys, {} tokens at block size {} \
                 need {need}",
                s.chain.len(),
                req.num_tokens,
                src.spec.block_size
            )));
        }
    }

    // 1. Fetch every TP column's present prefix into one pinned arena (one stored block = every
    //    layer and plane of one block of that rank): column `t`'s block `i` at
    //    `(t * need + i) * stored`, its PCP ranks asked in turn (see the module docs).
    let tp = src.spec.tp as usize;
    let pcp = src.spec.pcp as usize;
    let mut vsrc = src.clone();
    vsrc.num_blocks = need as u32;
    vsrc.spec.pcp = 1;
    let skv = vsrc.rank_kv()?;
    let stored = skv.num_layers as u64 * skv.kv_planes as u64 * skv.block_bytes();
    let fetch_bytes = (stored * (need * tp) as u64).div_ceil(4096) * 4096;
    let reservation = budget.reserve(fetch_bytes, "remote load: fetched blocks", o.staging_wait)?;
    let arena = PinnedArena::new(fetch_bytes as usize, &o.arena)?;
    let base = arena.ptr_at(0, stored * (need * tp) as u64)?;
    let results: Vec<Result<Vec<usize>>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..tp)
            .map(|t| {
                let col_base = base as usize + t * need * stored as usize;
                let opts = &o.remote;
                let sources = &req.sources;
                sc.spawn(move || {
                    // Per PCP rank of the column, the blocks it delivered.
                    let mut got = vec![0usize; pcp];
                    let mut pos = 0usize;
                    for (p, n) in got.iter_mut().enumerate() {
                        if pos == need {
                            break;
                        }
                        let r = p * tp + t;
                        let s = &sources[r];
                        let mut dst: Vec<&mut [u8]> = (pos..need)
                            .map(|i| {
                                // SAFETY: block `i` of column `t` is its own `stored`-byte range
                                // of the arena (inside it: checked by `ptr_at` above); no two
                                // ranges overlap (each column's thread writes only its own, each
                                // block once), and the arena outlives the scope.
                                unsafe {
                                    std::slice::from_raw_parts_mut(
                                        (col_base + i * stored as usize) as *mut u8,
                                        stored as usize,
                                    )
                                }
                            })
                            .collect();
                        *n = remote::fetch(
                            &s.addr,
                            &s.namespace,
                            &s.chain[pos..need],
                            &mut dst,
                            opts,
                        )
                        .map_err(|e| e.context(format!("producer rank {r} at {}", s.addr)))?;
                        if *n == 0 {
                            break;
                        }
                        pos += *n;
                    }
                    Ok(got)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Protocol(
                        "remote load: a fetch thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let per_column = results.into_iter().collect::<Result<Vec<Vec<usize>>>>()?;
    // Leading blocks of each TP column, and per local rank (`p * tp + t`) what it delivered.
    let present: Vec<usize> = per_column.iter().map(|c| c.iter().sum()).collect();
    let mut by_rank = vec![0usize; tp * pcp];
    for (t, c) in per_column.iter().enumerate() {
        for (p, &n) in c.iter().enumerate() {
            by_rank[p * tp + t] = n;
        }
    }
    let fetch_time = t0.elapsed();
    let mut report = LoadReport {
        fetched_bytes: present.iter().map(|&n| n as u64 * stored).sum(),
        present: by_rank,
        staged_bytes: reservation.bytes(),
        fetch_time,
        ..LoadReport::default()
    };

    // 2. The prefix every column delivered, in whole destination blocks unless it is the request.
    let whole = *present.iter().min().unwrap_or(&0) as u64 * src.spec.block_size as u64;
    let dbs = req.dst.layout.spec.block_size;
    let tokens = if whole >= req.num_tokens as u64 {
        req.num_tokens
    } else {
        (whole as u32 / dbs) * dbs
    };
    if tokens == 0 {
        return Ok(report);
    }

    // 3. Plan from the fetched blocks (the producer's layout at PCP 1, the chain positions as
    //    block ids) to the consumer's blocks of those tokens.
    let n_src = src.request_blocks(tokens)? as usize;
    let vplace = Placement {
        first_token: 0,
        layout: vsrc,
        dp_rank: 0,
        block_ids: vec![(0..n_src as u32).collect(); tp],
        groups: None,
    };
    let n_dst = req.dst.layout.request_blocks(tokens)? as usize;
    let dplace = Placement {
        first_token: 0,
        layout: req.dst.layout.clone(),
        dp_rank: req.dst.dp_rank,
        block_ids: req
            .dst
            .block_ids
            .iter()
            .map(|ids| ids[..n_dst].to_vec())
            .collect(),
        groups: None,
    };
    let plan = Plan::build(&vplace, &dplace, tokens)?;
    report.spans = plan.spans.len();
    let kv_ranks = req.kv.ranks();
    let ranges = kv_ranks
        .iter()
        .map(|&r| (r, plan.dst_ranges(r)))
        .collect::<BTreeMap<_, _>>();
    let staging = Staging::new_in(
        ranges,
        &o.arena,
        budget,
        "remote load: destination staging",
        o.staging_wait,
    )?;
    report.staged_bytes += staging.reserved_bytes();

    // 4. Gather each destination rank's bytes from the fetched blocks, then H2D in place.
    let t1 = Instant::now();
    for s in plan.spans.iter().filter(|s| kv_ranks.contains(&s.dst_rank)) {
        let r = s.src_rank as usize;
        for (so, d) in s.runs() {
            let mut done = 0;
            while done < s.len {
                let (off, max) = stored_offset(&skv, s.src_buffer, so + done)?;
                let len = max.min(s.len - done);
                let blk = off / stored;
                if blk >= present[r] as u64 {
                    return Err(Error::Protocol(format!(
                        "remote load: the plan reads block {blk} of producer TP column {r}, \
                         which delivered {}",
                        present[r]
                    )));
                }
                let from = arena.ptr_at((r * need) as u64 * stored + off, len)?;
                let to = staging.resolve(s.dst_rank, s.dst_buffer, d + done, len)?;
                // SAFETY: `from` lies in the fetch arena and `to` in the staging arena (both
                // resolved with their lengths just above): two distinct mappings, alive for the
                // call, written only by this thread (the fetches have ended). Nothing reaches a
                // device before every piece is copied.
                unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to, len as usize) };
                done += len;
            }
        }
    }
    for &r in &kv_ranks {
        if staging.ranges(r).is_empty() {
            continue;
        }
        let bufs = req.kv.get(r).expect("a rank of kv");
        let st = staging.drain_to_device(req.kv.caps(), r, bufs)?;
        report.device_bytes += st.bytes;
    }
    report.device_time = t1.elapsed();
    report.tokens = tokens;
    report.dst_blocks = n_dst as u32;
    drop(staging);
    drop(arena);
    drop(reservation);
    Ok(report)
}

/// Byte offset, within one producer rank's run of stored blocks (`block i` at `i * stored`), of
/// byte `offset` of layer `layer`'s buffer in the layout `kv` (whose block ids are chain
/// positions), and how many bytes from there stay inside the same block and plane.
fn stored_offset(kv: &KvLayout, layer: u32, offset: u64) -> Result<(u64, u64)> {
    let bb = kv.block_bytes();
    let planes = kv.kv_planes as u64;
    let (plane, block) = if kv.order.planes_within_block() {
        let q = offset / bb;
        (q % planes, q / planes)
    } else {
        (offset / kv.plane_bytes(), (offset % kv.plane_bytes()) / bb)
    };
    if plane >= planes || block >= kv.num_blocks as u64 || layer >= kv.num_layers {
        return Err(Error::InvalidArgument(format!(
            "remote load: source byte {offset} of layer {layer} outside the fetched blocks"
        )));
    }
    let within = offset - kv.block_offset(plane as u32, block as u32);
    let stored = kv.num_layers as u64 * planes * bb;
    Ok((
        block * stored + (layer as u64 * planes + plane) * bb + within,
        bb - within,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{ModelKv, ParallelSpec};

    #[test]
    fn stored_offsets_follow_the_device_block_format() {
        for order in ["nhd", "hnd"] {
            let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
            m.num_layers = 3;
            let spec = ParallelSpec::parse(&format!("tp=2,block=16,order={order}")).unwrap();
            let l = ParallelLayout::new(m, spec, 5).unwrap();
            let kv = l.rank_kv().unwrap();
            let bb = kv.block_bytes();
            let stored = 3 * 2 * bb;
            // Plane 1 (V) of block 4, layer 2, byte 7.
            let (o, max) = stored_offset(&kv, 2, kv.block_offset(1, 4) + 7).unwrap();
            assert_eq!(o, 4 * stored + (2 * 2 + 1) * bb + 7);
            assert_eq!(max, bb - 7);
            assert!(stored_offset(&kv, 3, 0).is_err());
            assert!(stored_offset(&kv, 0, kv.buffer_bytes()).is_err());
        }
    }

    #[test]
    fn store_source_round_trips_through_host_metadata() {
        let m = ModelKv::preset("llama-3.1-8b").unwrap();
        let l = ParallelLayout::new(m, ParallelSpec::parse("tp=2,block=16").unwrap(), 64).unwrap();
        let s = StoreSource {
            layout: l,
            rank: 1,
            namespace: "llama-3.1-8b bf16 tp=2 rank=1 block=16".into(),
        };
        let meta = s.to_meta();
        assert!(meta.len() <= 4096, "{} B", meta.len());
        assert_eq!(StoreSource::from_meta(&meta), Some(s));
        assert_eq!(StoreSource::from_meta("{}"), None);
        assert_eq!(StoreSource::from_meta(""), None);
    }
}
