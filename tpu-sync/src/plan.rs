//! The reshard planner: which bytes go from which source rank to which destination rank.
//!
//! Pure code, no I/O. Input: the request's [`Placement`] on the source (prefill) side and on the
//! destination (decode) side, and its number of tokens. Output: a [`Plan`], a list of [`Span`]s
//! that copy every logical element (layer, plane, token, head, dim) of the request exactly once,
//! from the source byte that holds it to the destination byte that must hold it, touching nothing
//! outside the request's blocks. Different TP (head split or replication), PCP (token chunks),
//! block sizes and block orders (NHD/HND) on the two sides are all handled; the last block may be
//! partial.
//!
//! Spans are coalesced: adjacent rows contiguous on both sides become one span, and runs of
//! equally sized spans with constant source and destination strides become one strided span
//! (`count`, `src_stride`, `dst_stride`). Spans are ordered by (destination rank, layer,
//! destination offset), which makes each receiver's writes sequential.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::ParallelLayout;

mod cache;
mod groups;
pub use cache::{
    plan_is_large, PlanCache, PlanCacheStats, DEFAULT_PLAN_CACHE_ENTRIES, LARGE_PLAN_TOKEN_HEADS,
};
pub use groups::HybridPlacement;

/// Where one request's KV blocks live on one side of a transfer.
///
/// JSON (every form refuses unknown keys): the uniform form `{"layout": ParallelLayout,
/// "dp_rank": R, "block_ids": [[...], ...]}`; the groups form of a [`HybridPlacement`]
/// (`{"layout": HybridLayout, "dp_rank": R, "block_ids": [group][rank][ids]}`, read as
/// [`Placement::from_groups`]); or what a grouped placement serializes to, the uniform fields
/// derived from its groups plus `"groups": HybridPlacement`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, try_from = "serde_json::Value")]
pub struct Placement {
    /// The instance's layout.
    pub layout: ParallelLayout,
    /// The DP replica holding the request.
    pub dp_rank: u32,
    /// Device block ids per rank of that replica, indexed by `pcp * tp_size + tp`. Entry
    /// `(pcp, tp)` lists, in order, the block ids of the request blocks
    /// `layout.pcp_chunk(num_tokens, pcp)`.
    pub block_ids: Vec<Vec<u32>>,
    /// The request's KV cache groups (hybrid models), or `None` (default, absent in JSON) for a
    /// uniform model. With groups, `layout`, `dp_rank` and `block_ids` are derived from them
    /// ([`Placement::from_groups`]: `layout` the grouped layout's spec and cache layer count,
    /// no uniform blocks, empty block id lists) and every geometry function of the placement
    /// (validation, staged ranges, [`Plan::build`], the transfer pipeline's buffer check) works
    /// on the groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<Box<HybridPlacement>>,
    /// The first token of the request whose KV this side holds or wants (default 0, absent in
    /// JSON when 0): a multiple of `layout.spec.block_size`, below the request's token count.
    /// A destination with `first_token = k * block_size` already holds tokens `[0,
    /// first_token)` (a prefix-cache hit) and receives only the rest: entry `(pcp, tp)` of
    /// `block_ids` then lists the request blocks [`Placement::held_chunk`] (the PCP chunk from
    /// request block `k` on), and a plan copies only tokens `first_token..num_tokens`. A source
    /// must hold every token its destination wants (its `first_token` <= the destination's).
    /// With groups it is the groups' [`HybridPlacement::first_token`] (the same semantics, per
    /// group).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_token: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Placement {
    /// Global rank of local rank `local` (index into `block_ids`).
    pub fn global_rank(&self, local: u32) -> u32 {
        self.dp_rank * self.layout.spec.ranks_per_replica() + local
    }

    /// Local index of a global rank, if it belongs to this placement's replica.
    ///
    /// `None` also for a layout without ranks (TP or PCP zero: never valid).
    pub fn local_rank(&self, global: u32) -> Option<u32> {
        let rpr = self.layout.spec.ranks_per_replica();
        (global.checked_div(rpr)? == self.dp_rank).then_some(global % rpr)
    }

    /// Checks the placement against its layout for a request of `num_tokens` tokens.
    ///
    /// Errors: [`Error::Layout`] for a bad layout or DP rank, [`Error::BlockRange`] for a wrong
    /// number of block ids, an id `>= num_blocks`, or an id used twice on one rank.
    pub fn validate(&self, num_tokens: u32) -> Result<()> {
        if let Some(h) = &self.groups {
            self.check_carrier(h)?;
            return h.validate(num_tokens);
        }
        self.layout.validate()?;
        if num_tokens == 0 {
            return Err(Error::InvalidArgument(
                "a request needs at least one token".into(),
            ));
        }
        let s = &self.layout.spec;
        if self.first_token % s.block_size != 0 || self.first_token >= num_tokens {
            return Err(Error::InvalidArgument(format!(
                "first_token {} must be a multiple of the block size {} below the request's \
                 {num_tokens} tokens",
                self.first_token, s.block_size
            )));
        }
        if self.dp_rank >= s.dp {
            return Err(Error::Layout(format!(
                "DP rank {} out of range for DP={}",
                self.dp_rank, s.dp
            )));
        }
        if self.block_ids.len() as u32 != s.ranks_per_replica() {
            return Err(Error::BlockRange(format!(
                "{} block id lists given, the replica has {} ranks (PCP={} x TP={})",
                self.block_ids.len(),
                s.ranks_per_replica(),
                s.pcp,
                s.tp
            )));
        }
        let nb = self.layout.num_blocks;
        for (local, ids) in self.block_ids.iter().enumerate() {
            let pcp = local as u32 / s.tp;
            let want = self.held_chunk(num_tokens, pcp)?.len();
            if ids.len() != want {
                return Err(Error::BlockRange(format!(
                    "rank {} (pcp {pcp}, tp {}) lists {} block ids; {num_tokens} tokens at block \
                     size {} from token {} need {want} on this rank",
                    self.global_rank(local as u32),
                    local as u32 % s.tp,
                    ids.len(),
                    s.block_size,
                    self.first_token
                )));
            }
            let mut seen = vec![false; nb as usize];
            for &id in ids {
                if id >= nb {
                    return Err(Error::BlockRange(format!(
                        "block id {id} on rank {} is >= num_blocks {nb}",
                        self.global_rank(local as u32)
                    )));
                }
                if std::mem::replace(&mut seen[id as usize], true) {
                    return Err(Error::BlockRange(format!(
                        "block id {id} appears twice on rank {}",
                        self.global_rank(local as u32)
                    )));
                }
            }
        }
        Ok(())
    }

    /// The request blocks (indices into the request's block sequence) whose ids entry `(pcp,
    /// tp)` of `block_ids` lists: PCP rank `pcp`'s chunk ([`ParallelLayout::pcp_chunk`]) from
    /// request block `first_token / block_size` on (possibly empty).
    ///
    /// Errors: [`Error::Layout`] for a zero PCP or block size.
    pub fn held_chunk(&self, num_tokens: u32, pcp: u32) -> Result<std::ops::Range<u32>> {
        let c = self.layout.pcp_chunk(num_tokens, pcp)?;
        let first = self.first_token / self.layout.spec.block_size;
        Ok(c.start.max(first).min(c.end)..c.end)
    }

    /// Whole-block byte ranges of local rank `local`'s request blocks in one layer buffer
    /// (every plane), merged. These are the bytes a sender stages.
    ///
    /// For a placement that passed [`Placement::validate`]; an invalid layout or a `local` rank
    /// the placement does not list yields no ranges (use [`Placement::try_block_ranges`] to get
    /// the reason).
    pub fn block_ranges(&self, local: u32) -> Vec<ByteRange> {
        self.try_block_ranges(local).unwrap_or_default()
    }

    /// [`Placement::block_ranges`], or why there are none.
    ///
    /// Errors: [`Error::Layout`] for a layout with a zero field, [`Error::InvalidArgument`]
    /// for a `local` rank the placement does not list.
    pub fn try_block_ranges(&self, local: u32) -> Result<Vec<ByteRange>> {
        if let Some(h) = &self.groups {
            return groups::grouped_block_ranges(h, local);
        }
        let kv = self.layout.rank_kv()?;
        let ids = self.block_ids.get(local as usize).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "local rank {local}: the placement lists {} ranks",
                self.block_ids.len()
            ))
        })?;
        let mut v = Vec::new();
        for layer in 0..kv.num_layers {
            for plane in 0..kv.kv_planes {
                for &id in ids {
                    v.push(ByteRange {
                        buffer: layer,
                        offset: kv.block_offset(plane, id),
                        len: kv.block_bytes(),
                    });
                }
            }
        }
        Ok(merge_ranges(v))
    }
}

/// A byte range of one buffer (buffer index = layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ByteRange {
    /// Buffer (layer) index.
    pub buffer: u32,
    /// Byte offset in the buffer.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Sorts and merges overlapping or adjacent ranges of the same buffer.
pub fn merge_ranges(mut v: Vec<ByteRange>) -> Vec<ByteRange> {
    v.sort_unstable();
    let mut out: Vec<ByteRange> = Vec::with_capacity(v.len());
    for r in v {
        if r.len == 0 {
            continue;
        }
        if let Some(last) = out.last_mut() {
            if last.buffer == r.buffer && r.offset <= last.offset + last.len {
                let end = (last.offset + last.len).max(r.offset + r.len);
                last.len = end - last.offset;
                continue;
            }
        }
        out.push(r);
    }
    out
}

/// One copy: `count` runs of `len` bytes, run `i` from `src_offset + i * src_stride` of source
/// rank `src_rank`'s buffer `src_buffer` to `dst_offset + i * dst_stride` of destination rank
/// `dst_rank`'s buffer `dst_buffer`. When `count == 1` the strides are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Span {
    /// Global source rank.
    pub src_rank: u32,
    /// Source buffer (layer).
    pub src_buffer: u32,
    /// Source byte offset.
    pub src_offset: u64,
    /// Global destination rank.
    pub dst_rank: u32,
    /// Destination buffer (layer).
    pub dst_buffer: u32,
    /// Destination byte offset.
    pub dst_offset: u64,
    /// Bytes per run.
    pub len: u64,
    /// Number of runs (>= 1).
    pub count: u32,
    /// Source distance between runs.
    pub src_stride: u64,
    /// Destination distance between runs.
    pub dst_stride: u64,
}

impl Span {
    /// Total bytes moved (`len * count`).
    pub fn bytes(&self) -> u64 {
        self.len * self.count as u64
    }

    /// `(src_offset, dst_offset)` of each run.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count as u64).map(move |i| {
            (
                self.src_offset + i * self.src_stride,
                self.dst_offset + i * self.dst_stride,
            )
        })
    }
}

/// A transfer plan: spans ordered by (destination rank, layer, destination offset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Tokens of the request.
    pub num_tokens: u32,
    /// The copies.
    pub spans: Vec<Span>,
}

impl Plan {
    /// Plans a request of `num_tokens` tokens from `src` to `dst`.
    ///
    /// Errors: [`Error::Mismatch`] when the two models' KV geometries differ, both physical
    /// buffer layouts are known and differ (the plan copies raw bytes at offsets computed for
    /// one layout; see [`ParallelLayout::check_physical_layout`]), or the block formats cannot
    /// be copied raw ([`ParallelLayout::check_block_format`]: opaque LBHNC blocks need the same
    /// order, block size and known format tag on both sides), and the errors of
    /// [`Placement::validate`] for either side.
    ///
    /// When either side has KV cache groups ([`Placement::groups`]), both are planned group by
    /// group ([`Plan::build_groups`]; a uniform side is its one-group form, so a uniform and a
    /// grouped side of different geometry are a [`Error::Mismatch`]).
    pub fn build(src: &Placement, dst: &Placement, num_tokens: u32) -> Result<Plan> {
        if src.groups.is_some() || dst.groups.is_some() {
            return groups::build_placements(src, dst, num_tokens);
        }
        src.layout.model.check_compatible(&dst.layout.model)?;
        src.layout.check_physical_layout(&dst.layout)?;
        src.layout.check_block_format(&dst.layout)?;
        src.validate(num_tokens)?;
        dst.validate(num_tokens)?;
        if src.first_token > dst.first_token {
            return Err(Error::Mismatch(format!(
                "the destination wants tokens from {}, the source holds them from {}",
                dst.first_token, src.first_token
            )));
        }
        if src.layout.spec.order.is_opaque() {
            return Self::build_regions(src, dst, num_tokens);
        }
        let sl = &src.layout;
        let dl = &dst.layout;
        let skv = sl.rank_kv()?;
        let dkv = dl.rank_kv()?;
        let row = skv.row_bytes();
        let planes = skv.kv_planes;
        let sbs = sl.spec.block_size;
        let dbs = dl.spec.block_size;
        let t = num_tokens;

        // Rows of layer 0; every layer has the same spans with another buffer index.
        let mut rows: Vec<Span> = Vec::new();
        for ld in 0..dl.spec.ranks_per_replica() {
            let dst_rank = dst.global_rank(ld);
            let dc = dl.coord(dst_rank)?;
            let first_head = dl.first_head(dc.tp)?;
            let chunk = dst.held_chunk(t, dc.pcp)?;
            let dst_heads = dl.heads_per_rank()?;
            for (i, jd) in chunk.enumerate() {
                let dst_block = dst.block_ids[ld as usize][i];
                // Every token of a held destination block is wanted (first_token is a multiple
                // of its block size) and held by the source (src.first_token <= it).
                for tok in jd * dbs..((jd + 1) * dbs).min(t) {
                    let js = tok / sbs;
                    let ps = sl.pcp_of_block(t, js)?;
                    let idx_s = (js - src.held_chunk(t, ps)?.start) as usize;
                    for hl in 0..dst_heads {
                        let g = first_head + hl;
                        let reps = sl.tp_ranks_of_head(g)?;
                        let ts = reps.start + ld % (reps.end - reps.start);
                        let ls = ps * sl.spec.tp + ts;
                        let src_block = src.block_ids[ls as usize][idx_s];
                        let hs = g - sl.first_head(ts)?;
                        let src_rank = src.global_rank(ls);
                        for p in 0..planes {
                            rows.push(Span {
                                src_rank,
                                src_buffer: 0,
                                src_offset: skv.row_offset(p, src_block, tok % sbs, hs),
                                dst_rank,
                                dst_buffer: 0,
                                dst_offset: dkv.row_offset(p, dst_block, tok % dbs, hl),
                                len: row,
                                count: 1,
                                src_stride: 0,
                                dst_stride: 0,
                            });
                        }
                    }
                }
            }
        }
        let plan = Self::from_layer_rows(rows, skv.num_layers, num_tokens);
        check_tiled_rows(&plan.spans, sl, dl)?;
        Ok(plan)
    }

    /// The plan between two validated [`BlockOrder::Lbhnc`](crate::layout::BlockOrder::Lbhnc)
    /// placements of equal block size: one whole `(block, head)` region per request block and
    /// destination head, coalesced.
    fn build_regions(src: &Placement, dst: &Placement, num_tokens: u32) -> Result<Plan> {
        let sl = &src.layout;
        let dl = &dst.layout;
        let skv = sl.rank_kv()?;
        let dkv = dl.rank_kv()?;
        let t = num_tokens;
        let mut rows: Vec<Span> = Vec::new();
        for ld in 0..dl.spec.ranks_per_replica() {
            let dst_rank = dst.global_rank(ld);
            let dc = dl.coord(dst_rank)?;
            let first_head = dl.first_head(dc.tp)?;
            let dst_heads = dl.heads_per_rank()?;
            for (i, jd) in dst.held_chunk(t, dc.pcp)?.enumerate() {
                let dst_block = dst.block_ids[ld as usize][i];
                // Equal block sizes: request block `jd` is the same block on both sides.
                let ps = sl.pcp_of_block(t, jd)?;
                let idx_s = (jd - src.held_chunk(t, ps)?.start) as usize;
                for hl in 0..dst_heads {
                    let g = first_head + hl;
                    let reps = sl.tp_ranks_of_head(g)?;
                    let ts = reps.start + ld % (reps.end - reps.start);
                    let ls = ps * sl.spec.tp + ts;
                    let src_block = src.block_ids[ls as usize][idx_s];
                    let hs = g - sl.first_head(ts)?;
                    rows.push(Span {
                        src_rank: src.global_rank(ls),
                        src_buffer: 0,
                        src_offset: skv.region_offset(src_block, hs),
                        dst_rank,
                        dst_buffer: 0,
                        dst_offset: dkv.region_offset(dst_block, hl),
                        len: skv.region_bytes(),
                        count: 1,
                        src_stride: 0,
                        dst_stride: 0,
                    });
                }
            }
        }
        Ok(Self::from_layer_rows(rows, skv.num_layers, num_tokens))
    }

    /// Sorts, coalesces and compresses the spans of layer 0, then repeats them for every layer.
    fn from_layer_rows(mut rows: Vec<Span>, num_layers: u32, num_tokens: u32) -> Plan {
        rows.sort_unstable_by_key(|s| (s.dst_rank, s.dst_offset));
        let base = compress_strided(coalesce(rows));

        let mut spans = Vec::with_capacity(base.len() * num_layers as usize);
        let mut i = 0;
        while i < base.len() {
            let mut j = i;
            while j < base.len() && base[j].dst_rank == base[i].dst_rank {
                j += 1;
            }
            for layer in 0..num_layers {
                spans.extend(base[i..j].iter().map(|s| Span {
                    src_buffer: layer,
                    dst_buffer: layer,
                    ..*s
                }));
            }
            i = j;
        }
        Plan { num_tokens, spans }
    }

    /// Total bytes moved.
    pub fn total_bytes(&self) -> u64 {
        self.spans.iter().map(Span::bytes).sum()
    }

    /// The distinct `(src_rank, dst_rank)` pairs that exchange bytes, sorted.
    pub fn pairs(&self) -> Vec<(u32, u32)> {
        self.spans
            .iter()
            .map(|s| (s.src_rank, s.dst_rank))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The spans of one `(src_rank, dst_rank)` pair, in plan order.
    pub fn pair_spans(&self, src_rank: u32, dst_rank: u32) -> Vec<Span> {
        self.spans
            .iter()
            .filter(|s| s.src_rank == src_rank && s.dst_rank == dst_rank)
            .copied()
            .collect()
    }

    /// Merged destination byte ranges written on `dst_rank` (what must be copied to the device).
    pub fn dst_ranges(&self, dst_rank: u32) -> Vec<ByteRange> {
        let mut v = Vec::new();
        for s in self.spans.iter().filter(|s| s.dst_rank == dst_rank) {
            for (_, d) in s.runs() {
                v.push(ByteRange {
                    buffer: s.dst_buffer,
                    offset: d,
                    len: s.len,
                });
            }
        }
        merge_ranges(v)
    }

    /// Merged source byte ranges read on `src_rank`.
    pub fn src_ranges(&self, src_rank: u32) -> Vec<ByteRange> {
        let mut v = Vec::new();
        for s in self.spans.iter().filter(|s| s.src_rank == src_rank) {
            for (o, _) in s.runs() {
                v.push(ByteRange {
                    buffer: s.src_buffer,
                    offset: o,
                    len: s.len,
                });
            }
        }
        merge_ranges(v)
    }
}

/// A 64-bit digest of a span list (xxh3 over the fields, little endian), used by both peers to
/// check that they computed the same plan.
pub fn spans_digest(spans: &[Span]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for s in spans {
        h.update(&s.src_rank.to_le_bytes());
        h.update(&s.src_buffer.to_le_bytes());
        h.update(&s.src_offset.to_le_bytes());
        h.update(&s.dst_rank.to_le_bytes());
        h.update(&s.dst_buffer.to_le_bytes());
        h.update(&s.dst_offset.to_le_bytes());
        h.update(&s.len.to_le_bytes());
        h.update(&s.count.to_le_bytes());
        h.update(&s.src_stride.to_le_bytes());
        h.update(&s.dst_stride.to_le_bytes());
    }
    h.digest()
}

fn coalesce(rows: Vec<Span>) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::with_capacity(rows.len());
    for r in rows {
        if let Some(last) = out.last_mut() {
            if last.src_rank == r.src_rank
                && last.dst_rank == r.dst_rank
                && last.src_offset + last.len == r.src_offset
                && last.dst_offset + last.len == r.dst_offset
            {
                last.len += r.len;
                continue;
            }
        }
        out.push(r);
    }
    out
}

fn compress_strided(spans: Vec<Span>) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::with_capacity(spans.len());
    for r in spans {
        if let Some(g) = out.last_mut() {
            if g.src_rank == r.src_rank && g.dst_rank == r.dst_rank && g.len == r.len {
                if g.count == 1 {
                    if r.src_offset > g.src_offset && r.dst_offset >= g.dst_offset + g.len {
                        g.src_stride = r.src_offset - g.src_offset;
                        g.dst_stride = r.dst_offset - g.dst_offset;
                        g.count = 2;
                        continue;
                    }
                } else if r.src_offset == g.src_offset + g.count as u64 * g.src_stride
                    && r.dst_offset == g.dst_offset + g.count as u64 * g.dst_stride
                {
                    g.count += 1;
                    continue;
                }
            }
        }
        out.push(r);
    }
    out
}

/// A copy between two destination ranks' bytes on one host: `len` bytes of layer `buffer` from
/// `from_offset` on rank `from_rank` to `to_offset` on rank `to_rank` (device byte offsets,
/// as in [`Span`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LocalCopy {
    /// Global destination rank whose bytes crossed the network.
    pub from_rank: u32,
    /// Global destination rank that receives a copy.
    pub to_rank: u32,
    /// Buffer (layer) index, the same on both ranks.
    pub buffer: u32,
    /// Device byte offset on `from_rank`.
    pub from_offset: u64,
    /// Device byte offset on `to_rank`.
    pub to_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Delivery of a plan's replicated destination bytes once per destination host.
///
/// When the destination's TP exceeds the model's KV heads (MLA's single latent "head" of
/// DeepSeek-V3, an indexer cache, GQA with TP > KV heads), several TP ranks of one PCP rank hold
/// identical KV: a [`Plan`] gives each of them its own copy, so a TP=4 decode receives an MLA
/// request four times. A `FanOut` picks, per host and per group of such replicas, one rank whose
/// bytes cross the network ([`FanOut::pulled`]) and the local copies that give every other
/// replica on that host the same bytes ([`FanOut::copies`]). Replicas hold the request's blocks
/// at their own block ids; a copy maps block `i` of one to block `i` of the other at the same
/// offset inside the block, so it is exact for every block order.
///
/// Use: pull only [`FanOut::pulled`] (`PullRequest::dst_ranks`), then run the copies on the
/// received staging ([`crate::staging::Staging::apply_fan_out`]) before draining to devices.
/// Pure computation; `Send + Sync`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanOut {
    /// Destination ranks of the plan whose bytes must cross the network, sorted.
    pub pulled: Vec<u32>,
    /// Copies from a pulled rank's bytes to each replica on its host, by destination rank then
    /// offset.
    pub copies: Vec<LocalCopy>,
    /// Bytes the pulled ranks receive over the network.
    pub wire_bytes: u64,
    /// Bytes the plan delivers in total (every rank).
    pub plan_bytes: u64,
}

impl FanOut {
    /// Plans the fan-out of `plan` (built for destination placement `dst`), where `host_of`
    /// names the host of each global destination rank: ranks on one host with the same PCP
    /// coordinate and the same KV heads form a replica group whose lowest rank is pulled.
    /// Without replicas every rank is pulled and there are no copies.
    ///
    /// Errors: [`Error::Mismatch`] if a replica's block ids or staged bytes do not line up with
    /// its group's pulled rank (a placement that does not match the plan).
    pub fn build<H: Ord>(
        plan: &Plan,
        dst: &Placement,
        host_of: impl Fn(u32) -> H,
    ) -> Result<FanOut> {
        if dst.groups.is_some() {
            return Err(Error::InvalidArgument(
                "the local fan-out of replicated ranks is planned for uniform placements only, \
                 not for KV cache groups"
                    .into(),
            ));
        }
        let l = &dst.layout;
        let rpr = l.spec.ranks_per_replica();
        let mut groups: std::collections::BTreeMap<(H, u32, u32), Vec<u32>> = Default::default();
        for local in 0..rpr {
            let g = dst.global_rank(local);
            let c = l.coord(g)?;
            groups
                .entry((host_of(g), c.pcp, l.first_head(c.tp)?))
                .or_default()
                .push(g);
        }
        let kv = l.rank_kv()?;
        let bb = kv.block_bytes();
        let mut pulled = Vec::new();
        let mut copies = Vec::new();
        for ranks in groups.values() {
            let primary = ranks[0];
            pulled.push(primary);
            let la = dst.local_rank(primary).unwrap_or(0) as usize;
            for &r in &ranks[1..] {
                let lb = dst.local_rank(r).unwrap_or(0) as usize;
                let (ia, ib) = (&dst.block_ids[la], &dst.block_ids[lb]);
                if ia.len() != ib.len() {
                    return Err(Error::Mismatch(format!(
                        "replica ranks {primary} and {r} hold {} and {} request blocks",
                        ia.len(),
                        ib.len()
                    )));
                }
                let index: std::collections::HashMap<u32, usize> =
                    ib.iter().enumerate().map(|(i, &b)| (b, i)).collect();
                for range in plan.dst_ranges(r) {
                    let mut o = range.offset;
                    let end = range.offset + range.len;
                    while o < end {
                        let (u, within) = (o / bb, o % bb);
                        let (plane, block) = if kv.order.planes_within_block() {
                            (
                                (u % kv.kv_planes as u64) as u32,
                                (u / kv.kv_planes as u64) as u32,
                            )
                        } else {
                            (
                                (u / kv.num_blocks as u64) as u32,
                                (u % kv.num_blocks as u64) as u32,
                            )
                        };
                        let n = (bb - within).min(end - o);
                        let i = *index.get(&block).ok_or_else(|| {
                            Error::Mismatch(format!(
                                "rank {r} receives bytes of block {block}, which is not one of \
                                 its request blocks"
                            ))
                        })?;
                        copies.push(LocalCopy {
                            from_rank: primary,
                            to_rank: r,
                            buffer: range.buffer,
                            from_offset: kv.block_offset(plane, ia[i]) + within,
                            to_offset: o,
                            len: n,
                        });
                        o += n;
                    }
                }
            }
        }
        pulled.sort_unstable();
        // Merge copies contiguous on both sides.
        let mut merged: Vec<LocalCopy> = Vec::with_capacity(copies.len());
        for c in copies {
            if let Some(m) = merged.last_mut() {
                if m.from_rank == c.from_rank
                    && m.to_rank == c.to_rank
                    && m.buffer == c.buffer
                    && m.from_offset + m.len == c.from_offset
                    && m.to_offset + m.len == c.to_offset
                {
                    m.len += c.len;
                    continue;
                }
            }
            merged.push(c);
        }
        let wire_bytes = plan
            .spans
            .iter()
            .filter(|s| pulled.binary_search(&s.dst_rank).is_ok())
            .map(Span::bytes)
            .sum();
        Ok(FanOut {
            pulled,
            copies: merged,
            wire_bytes,
            plan_bytes: plan.total_bytes(),
        })
    }

    /// Bytes the local copies move.
    pub fn copy_bytes(&self) -> u64 {
        self.copies.iter().map(|c| c.len).sum()
    }
}

/// With a tiled physical layout that keeps packed rows contiguous on either side
/// ([`ParallelLayout::tiled_row_bytes`]; both sides name the same one,
/// [`ParallelLayout::check_physical_layout`]), every run of `spans` must be whole packed rows of
/// that side: the tiling permutes the bytes inside a row, so only whole rows copy exactly.
///
/// Errors: [`Error::Mismatch`] naming the layout, the row size and the first run that cuts a
/// row.
fn check_tiled_rows(spans: &[Span], src: &ParallelLayout, dst: &ParallelLayout) -> Result<()> {
    for (layout, is_src) in [(src, true), (dst, false)] {
        let Some(row) = layout.tiled_row_bytes() else {
            continue;
        };
        let cut = |x: u64| x % row != 0;
        let bad = spans.iter().find(|s| {
            let (off, stride) = if is_src {
                (s.src_offset, s.src_stride)
            } else {
                (s.dst_offset, s.dst_stride)
            };
            cut(off) || cut(s.len) || (s.count > 1 && cut(stride))
        });
        if let Some(s) = bad {
            let kv = layout.rank_kv()?;
            return Err(Error::Mismatch(format!(
                "physical layout `{}` is tiled: tpu-sync copies whole packed rows ({} bytes: {} \
                 x {} lanes of {}) there, and this plan cuts one (a run of {} bytes at source \
                 offset {}, destination offset {}): lane padding (head_dim {} < {} lanes) or a \
                 TP split inside a packed row ({} heads per rank); move such caches in a layout \
                 where both sides have whole rows, or in the dense layout",
                layout.physical_layout.as_deref().unwrap_or_default(),
                row,
                kv.packing(),
                kv.padded_head_dim(),
                kv.dtype.name(),
                s.len,
                s.src_offset,
                s.dst_offset,
                kv.head_dim,
                kv.padded_head_dim(),
                kv.num_heads
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
