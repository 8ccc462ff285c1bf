//! Plans over KV cache groups (hybrid models).
//!
//! A [`HybridPlacement`] says where one request's cache is on one side, group by group: block ids
//! (or one slot id for a state group) per group per rank. [`Plan::build_groups`] plans every
//! group from its own geometry ([`crate::layout::groups`]) and returns one ordinary [`Plan`]
//! whose buffer indices are cache layers, so everything that consumes plans (staging, the
//! network streams, digests) works unchanged. A uniform [`Placement`] is the one-group placement
//! [`HybridPlacement::from_uniform`], and its group plan equals [`Plan::build`]'s, span for span.
//!
//! Per group the plan moves exactly the bytes the destination needs
//! ([`HybridPlacement::needed_bytes`]): every token of a full-attention, MLA or indexer group;
//! the tokens the next token attends to for a sliding-window group (whole blocks for the opaque
//! LBHNC order); a state group's slot, resharded by heads where the state is split over TP and
//! read from PCP rank `dst_pcp % src_pcp` of the source (every PCP rank holds the state).

use std::collections::BTreeSet;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::{coalesce, compress_strided, merge_ranges, ByteRange, Placement, Plan, Span};
use crate::error::{Error, Result};
use crate::layout::{DType, GroupKind, GroupRankKv, HybridLayout, ModelKv, ParallelLayout};

/// Where one request's KV cache lives on one side of a transfer, group by group.
///
/// JSON: `{"layout": HybridLayout, "dp_rank": 0, "block_ids": [[[ids of rank 0], [ids of rank
/// 1], ...] of group 0, ...], "first_token": 0, "next_token": N}` (`first_token` and
/// `next_token` optional); unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HybridPlacement {
    /// The instance's layout.
    pub layout: HybridLayout,
    /// The DP replica holding the request.
    pub dp_rank: u32,
    /// `block_ids[group][local]`: for local rank `local = pcp * tp_size + tp` of the replica,
    /// the device block ids of the request blocks
    /// [`HybridPlacement::listed_blocks`]`(group, num_tokens, pcp)`, in order: the group's
    /// [`HybridLayout::held_blocks`] (a sliding-window group holds only the blocks of its
    /// window) from request block `first_token / block_size` on; for a state group exactly one
    /// slot id.
    pub block_ids: Vec<Vec<Vec<u32>>>,
    /// The first token of the request whose KV this side holds or wants (default 0, absent in
    /// JSON when 0), as [`Placement::first_token`] for uniform placements: a destination with
    /// `first_token = k` already holds tokens `[0, k)` of every paged group (a prefix-cache hit,
    /// block-aligned in every paged group) and receives only tokens `k..num_tokens` of each
    /// group's needed tokens, into the blocks it lists (from request block `k / block_size` on;
    /// the blocks before it, shared with other requests, are neither listed nor written). A
    /// state group's slot is the state after the whole request and always moves whole. A
    /// source must hold every token its destination wants (its `first_token` <= the
    /// destination's).
    #[serde(default, skip_serializing_if = "super::is_zero")]
    pub first_token: u32,
    /// The first token this side computes after the transfer (a destination's), or `None`
    /// (default, absent in JSON): the request's next token, `num_tokens`. A sliding-window
    /// group of `w` tokens then needs and holds the tokens token `next_token`'s window reads,
    /// `[next_token + 1 - w, num_tokens)`, one token more than the next token reads for
    /// `next_token = num_tokens - 1`: vLLM recomputes the last prompt token after loading the
    /// whole prompt (`Scheduler._update_waiting_for_remote_kv`), and a layer-wise consumer
    /// computes from its loaded tokens on. At most `num_tokens`. A plan refuses a source that
    /// does not hold those tokens ([`Error::Mismatch`]): vLLM frees the block before the
    /// window of `num_tokens`, so a producer of whole blocks holds token `num_tokens - w` only
    /// when it shares a block with token `num_tokens + 1 - w`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_token: Option<u32>,
}

impl HybridPlacement {
    /// The one-group form of a uniform placement.
    pub fn from_uniform(p: &Placement) -> HybridPlacement {
        HybridPlacement {
            layout: HybridLayout::from_uniform(&p.layout),
            dp_rank: p.dp_rank,
            block_ids: vec![p.block_ids.clone()],
            first_token: p.first_token,
            next_token: None,
        }
    }

    /// The first token this side computes after the transfer
    /// ([`HybridPlacement::next_token`], default `num_tokens`), at most `num_tokens`.
    pub fn next(&self, num_tokens: u32) -> u32 {
        self.next_token.unwrap_or(num_tokens).min(num_tokens)
    }

    /// The tokens of group `g` this side needs ([`HybridLayout::needed_tokens`] for its
    /// [`HybridPlacement::next_token`]; before `first_token` included).
    ///
    /// Errors: [`Error::Layout`] for a group index out of range.
    pub fn needed_tokens(&self, g: usize, num_tokens: u32) -> Result<Range<u32>> {
        self.layout.needed_tokens(g, num_tokens)?;
        Ok(self
            .layout
            .u_needed_tokens_from(g, num_tokens, self.next(num_tokens)))
    }

    /// The request blocks of group `g` whose ids local ranks of PCP rank `pcp` list in
    /// [`HybridPlacement::block_ids`]: the group's held blocks ([`HybridLayout::held_blocks`],
    /// a sliding window's those of the window of [`HybridPlacement::next_token`]) from request
    /// block `first_token / block_size` on (for a state group, its slot `0..1` whatever
    /// `first_token`). Possibly empty.
    ///
    /// Errors: [`Error::Layout`] for a group index out of range.
    pub fn listed_blocks(&self, g: usize, num_tokens: u32, pcp: u32) -> Result<Range<u32>> {
        self.layout.held_blocks(g, num_tokens, pcp)?;
        Ok(self.u_listed_blocks(g, num_tokens, pcp))
    }

    pub(crate) fn u_listed_blocks(&self, g: usize, num_tokens: u32, pcp: u32) -> Range<u32> {
        let l = &self.layout;
        let held = l.u_held_blocks_from(g, num_tokens, pcp, self.next(num_tokens));
        if l.model.groups[g].kind.is_state() {
            return held;
        }
        let first = self.first_token / l.u_block_size(g);
        held.start.max(first).min(held.end)..held.end
    }

    /// Global rank of local rank `local`.
    pub fn global_rank(&self, local: u32) -> u32 {
        self.dp_rank * self.layout.spec.ranks_per_replica() + local
    }

    /// Local index of a global rank, if it belongs to this placement's replica.
    pub fn local_rank(&self, global: u32) -> Option<u32> {
        let rpr = self.layout.spec.ranks_per_replica().max(1);
        (global / rpr == self.dp_rank).then_some(global % rpr)
    }

    /// Checks the placement against its layout for a request of `num_tokens` tokens.
    ///
    /// Errors: [`Error::Layout`] for a bad layout or DP rank; [`Error::InvalidArgument`] for no
    /// tokens, or a `first_token` not below `num_tokens` or not a multiple of every paged
    /// group's block size; [`Error::BlockRange`] naming the group and rank for a wrong number
    /// of id lists or ids (a rank lists [`HybridPlacement::listed_blocks`] of each paged group,
    /// one slot of each state group), an id `>=` the group's blocks (slots), or an id used
    /// twice in one group on one rank.
    pub fn validate(&self, num_tokens: u32) -> Result<()> {
        let l = &self.layout;
        l.validate()?;
        if num_tokens == 0 {
            return Err(Error::InvalidArgument(
                "a request needs at least one token".into(),
            ));
        }
        let s = &l.spec;
        if self.dp_rank >= s.dp {
            return Err(Error::Layout(format!(
                "DP rank {} out of range for DP={}",
                self.dp_rank, s.dp
            )));
        }
        if self.next_token.is_some_and(|n| n > num_tokens) {
            return Err(Error::InvalidArgument(format!(
                "next_token {} is past the request's {num_tokens} tokens",
                self.next_token.unwrap_or(0)
            )));
        }
        if self.first_token != 0 {
            if self.first_token >= num_tokens {
                return Err(Error::InvalidArgument(format!(
                    "first_token {} must be below the request's {num_tokens} tokens",
                    self.first_token
                )));
            }
            for g in 0..l.groups.len() {
                let bs = l.u_block_size(g);
                if !l.model.groups[g].kind.is_state() && self.first_token % bs != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "first_token {} must be a multiple of the block size {bs} of KV cache \
                         group {}",
                        self.first_token,
                        l.model.group_name(g)
                    )));
                }
            }
        }
        if self.block_ids.len() != l.groups.len() {
            return Err(Error::BlockRange(format!(
                "block ids given for {} groups, the model has {} KV cache groups",
                self.block_ids.len(),
                l.groups.len()
            )));
        }
        for (g, per_rank) in self.block_ids.iter().enumerate() {
            let name = l.model.group_name(g);
            if per_rank.len() as u32 != s.ranks_per_replica() {
                return Err(Error::BlockRange(format!(
                    "group {name}: {} block id lists given, the replica has {} ranks (PCP={} x \
                     TP={})",
                    per_rank.len(),
                    s.ranks_per_replica(),
                    s.pcp,
                    s.tp
                )));
            }
            let nb = l.groups[g].num_blocks;
            let state = l.model.groups[g].kind.is_state();
            for (local, ids) in per_rank.iter().enumerate() {
                let rank = self.global_rank(local as u32);
                let pcp = local as u32 / s.tp;
                let want = self.u_listed_blocks(g, num_tokens, pcp).len();
                if ids.len() != want {
                    return Err(Error::BlockRange(if state {
                        format!(
                            "group {name}: rank {rank} lists {} slot ids; a state group needs \
                             exactly one per rank",
                            ids.len()
                        )
                    } else {
                        format!(
                            "group {name}: rank {rank} (pcp {pcp}, tp {}) lists {} block ids; \
                             {num_tokens} tokens at block size {} from token {} need {want} on \
                             this rank",
                            local as u32 % s.tp,
                            ids.len(),
                            l.u_block_size(g),
                            self.first_token
                        )
                    }));
                }
                let mut seen = vec![false; nb as usize];
                for &id in ids {
                    if id >= nb {
                        return Err(Error::BlockRange(format!(
                            "group {name}: {} {id} on rank {rank} is >= {nb}",
                            if state { "slot id" } else { "block id" }
                        )));
                    }
                    if std::mem::replace(&mut seen[id as usize], true) {
                        return Err(Error::BlockRange(format!(
                            "group {name}: block id {id} appears twice on rank {rank}"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Byte ranges of local rank `local`'s request blocks and slots in every layer buffer
    /// (buffer index = cache layer), merged: whole blocks (every plane) of paged groups, the
    /// dense bytes of state slots. These are the bytes a sender stages.
    ///
    /// Errors: as [`HybridLayout::check_nonzero`] (ids are not checked: validate first).
    pub fn block_ranges(&self, local: u32) -> Result<Vec<ByteRange>> {
        self.layout.check_nonzero()?;
        let mut v = Vec::new();
        for (g, grp) in self.layout.model.groups.iter().enumerate() {
            let kv = self.layout.u_rank_kv(g);
            let Some(ids) = self.block_ids.get(g).and_then(|r| r.get(local as usize)) else {
                continue;
            };
            for &id in ids {
                for (offset, len) in kv.unit_ranges(id) {
                    for &layer in &grp.layers {
                        v.push(ByteRange {
                            buffer: layer,
                            offset,
                            len,
                        });
                    }
                }
            }
        }
        Ok(merge_ranges(v))
    }

    /// Bytes the ranks of this placement's replica must receive per group (the group's share of
    /// a plan into this placement), from the geometry alone: the needed tokens
    /// ([`HybridPlacement::needed_tokens`], from `first_token` on) of each rank's listed blocks
    /// ([`HybridPlacement::listed_blocks`]) times the rank's bytes per token of all the group's
    /// layers (whole listed blocks for the LBHNC order), or the dense slot bytes of every layer
    /// for a state group.
    ///
    /// Errors: as [`HybridLayout::check_nonzero`].
    pub fn needed_bytes(&self, num_tokens: u32) -> Result<Vec<u64>> {
        let l = &self.layout;
        l.check_nonzero()?;
        let s = &l.spec;
        Ok((0..l.groups.len())
            .map(|g| {
                let kv = l.u_rank_kv(g);
                let layers = l.model.groups[g].layers.len() as u64;
                let need = l.u_needed_tokens_from(g, num_tokens, self.next(num_tokens));
                let bs = l.u_block_size(g) as u64;
                let mut total = 0u64;
                for local in 0..s.ranks_per_replica() {
                    let held = self.u_listed_blocks(g, num_tokens, local / s.tp);
                    let tokens = || {
                        let a = (held.start as u64 * bs).max(need.start as u64);
                        let b = (held.end as u64 * bs).min(need.end as u64);
                        b.saturating_sub(a)
                    };
                    total += layers
                        * match &kv {
                            GroupRankKv::Paged(k) if k.order.is_opaque() => {
                                held.len() as u64 * k.kv_planes as u64 * k.block_bytes()
                            }
                            GroupRankKv::Paged(k) => {
                                tokens() * k.kv_planes as u64 * k.num_heads as u64 * k.row_bytes()
                            }
                            GroupRankKv::Indexer(ix) => {
                                tokens() * (ix.value_bytes + ix.scale_bytes)
                            }
                            GroupRankKv::State(st) => st.slot_bytes,
                        };
                }
                total
            })
            .collect())
    }
}

impl Plan {
    /// Plans a request of `num_tokens` tokens from `src` to `dst`, group by group.
    ///
    /// A destination with a `first_token` receives only its tokens from there on
    /// ([`HybridPlacement::first_token`]).
    ///
    /// Errors, before anything is planned: [`Error::Mismatch`] when the two models' groups
    /// differ ([`crate::layout::HybridModel::check_compatible`]: a group missing, other layers, a
    /// different window or state shape, ...), a group's raw bytes cannot be copied
    /// ([`HybridLayout::check_raw_compatible`]), the source's `first_token` is past the
    /// destination's, or the source's blocks do not hold a token the destination reads (a
    /// sliding window of its [`HybridPlacement::next_token`]); the errors of
    /// [`HybridPlacement::validate`] for either side.
    pub fn build_groups(
        src: &HybridPlacement,
        dst: &HybridPlacement,
        num_tokens: u32,
    ) -> Result<Plan> {
        src.layout.model.check_compatible(&dst.layout.model)?;
        src.layout.check_raw_compatible(&dst.layout)?;
        src.validate(num_tokens)?;
        dst.validate(num_tokens)?;
        if src.first_token > dst.first_token {
            return Err(Error::Mismatch(format!(
                "the destination wants tokens from {}, the source holds them from {}",
                dst.first_token, src.first_token
            )));
        }
        let groups = dst.layout.groups.len();
        for g in 0..groups {
            // The first token the destination reads of this group (whole blocks for LBHNC),
            // and the first the source holds (its listed blocks start on a block boundary).
            let (sl, dl) = (&src.layout, &dst.layout);
            if sl.model.groups[g].kind.is_state() {
                continue;
            }
            let (sbs, dbs) = (sl.u_block_size(g), dl.u_block_size(g));
            let need = dl.u_needed_tokens_from(g, num_tokens, dst.next(num_tokens));
            let wants = if dl.u_order(g).is_opaque() {
                dl.u_window_blocks_from(g, num_tokens, dst.next(num_tokens))
                    .start
                    * dbs
            } else {
                need.start
            }
            .max(dst.first_token);
            // The source's window blocks (none when it needs no token: a window of one).
            let holds = (sl
                .u_window_blocks_from(g, num_tokens, src.next(num_tokens))
                .start
                .saturating_mul(sbs))
            .max(src.first_token);
            if wants < holds && wants < num_tokens {
                return Err(Error::Mismatch(format!(
                    "KV cache group {}: the destination reads tokens from {wants} (the window of \
                     its next token {}), the source's blocks hold them from {holds}",
                    src.layout.model.group_name(g),
                    dst.next(num_tokens)
                )));
            }
        }
        let mut bases: Vec<Vec<Span>> = Vec::with_capacity(groups);
        for g in 0..groups {
            let mut rows = group_rows(src, dst, g, num_tokens);
            rows.sort_unstable_by_key(|s| (s.dst_rank, s.dst_offset));
            let base = compress_strided(coalesce(rows));
            // A tiled layout that keeps packed rows contiguous: whole rows only.
            super::check_tiled_rows(
                &base,
                &src.layout.group_as_parallel(g),
                &dst.layout.group_as_parallel(g),
            )
            .map_err(|e| e.context(format!("KV cache group {}", src.layout.model.group_name(g))))?;
            bases.push(base);
        }
        // Order by (destination rank, layer, destination offset), as Plan::build.
        let ranks: BTreeSet<u32> = bases.iter().flatten().map(|s| s.dst_rank).collect();
        let map = dst.layout.model.layer_map();
        let total: usize = (0..groups)
            .map(|g| bases[g].len() * dst.layout.model.groups[g].layers.len())
            .sum();
        let mut spans = Vec::with_capacity(total);
        for r in ranks {
            for (layer, &(g, _)) in map.iter().enumerate() {
                let base = &bases[g as usize];
                let a = base.partition_point(|s| s.dst_rank < r);
                let b = base.partition_point(|s| s.dst_rank <= r);
                spans.extend(base[a..b].iter().map(|s| Span {
                    src_buffer: layer as u32,
                    dst_buffer: layer as u32,
                    ..*s
                }));
            }
        }
        Ok(Plan { num_tokens, spans })
    }

    /// Bytes of the plan per group of `layout` (by destination buffer = cache layer).
    pub fn group_bytes(&self, layout: &HybridLayout) -> Vec<u64> {
        let map = layout.model.layer_map();
        let mut v = vec![0u64; layout.groups.len()];
        for s in &self.spans {
            if let Some(&(g, _)) = map.get(s.dst_buffer as usize) {
                if let Some(x) = v.get_mut(g as usize) {
                    *x += s.bytes();
                }
            }
        }
        v
    }
}

/// One row span (`count == 1`, buffer 0) per contiguous piece of group `g` that a destination
/// rank needs, for the group's first layer (every layer of a group has the same offsets).
fn group_rows(src: &HybridPlacement, dst: &HybridPlacement, g: usize, t: u32) -> Vec<Span> {
    let (sl, dl) = (&src.layout, &dst.layout);
    let (skv, dkv) = (sl.u_rank_kv(g), dl.u_rank_kv(g));
    let row = |src_rank, src_offset, dst_rank, dst_offset, len| Span {
        src_rank,
        src_buffer: 0,
        src_offset,
        dst_rank,
        dst_buffer: 0,
        dst_offset,
        len,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
    };
    let (ssplit, dsplit) = (sl.u_head_split(g), dl.u_head_split(g));
    let (sbs, dbs) = (sl.u_block_size(g), dl.u_block_size(g));
    // Listed destination blocks start at its first_token (block-aligned), so every token of
    // them from the group's needed tokens on is wanted.
    let need = dl.u_needed_tokens_from(g, t, dst.next(t));
    let mut rows = Vec::new();
    for ld in 0..dl.spec.ranks_per_replica() {
        let dst_rank = dst.global_rank(ld);
        let dc = dl.u_coord(dst_rank);
        let dids = &dst.block_ids[g][ld as usize];
        // Source local rank and index of request block `js` for global head `gh`.
        let source = |js: u32, gh: u32, split: crate::layout::HeadSplit| {
            let ps = sl.u_pcp_of_block(g, t, js);
            let idx = (js - src.u_listed_blocks(g, t, ps).start) as usize;
            let reps = split.ranks_of_head(gh);
            let ts = reps.start + ld % (reps.end - reps.start);
            let ls = ps * sl.spec.tp + ts;
            (ls, idx, gh - split.first_head(ts))
        };
        match (&skv, &dkv) {
            (GroupRankKv::Paged(s), GroupRankKv::Paged(d)) if s.order.is_opaque() => {
                // Equal block sizes (checked): request block `jd` is the same block on both
                // sides; whole (block, head) regions.
                for (i, jd) in dst.u_listed_blocks(g, t, dc.pcp).enumerate() {
                    for hl in 0..d.num_heads {
                        let gh = dsplit.first_head(dc.tp) + hl;
                        let (ls, idx, hs) = source(jd, gh, ssplit);
                        let sb = src.block_ids[g][ls as usize][idx];
                        rows.push(row(
                            src.global_rank(ls),
                            s.region_offset(sb, hs),
                            dst_rank,
                            d.region_offset(dids[i], hl),
                            s.region_bytes(),
                        ));
                    }
                }
            }
            (GroupRankKv::Paged(s), GroupRankKv::Paged(d)) => {
                for (i, jd) in dst.u_listed_blocks(g, t, dc.pcp).enumerate() {
                    for tok in (jd * dbs).max(need.start)..((jd + 1) * dbs).min(t) {
                        let js = tok / sbs;
                        for hl in 0..d.num_heads {
                            let gh = dsplit.first_head(dc.tp) + hl;
                            let (ls, idx, hs) = source(js, gh, ssplit);
                            let sb = src.block_ids[g][ls as usize][idx];
                            let sr = src.global_rank(ls);
                            for p in 0..s.kv_planes {
                                rows.push(row(
                                    sr,
                                    s.row_offset(p, sb, tok % sbs, hs),
                                    dst_rank,
                                    d.row_offset(p, dids[i], tok % dbs, hl),
                                    s.row_bytes(),
                                ));
                            }
                        }
                    }
                }
            }
            (GroupRankKv::Indexer(s), GroupRankKv::Indexer(d)) => {
                for (i, jd) in dst.u_listed_blocks(g, t, dc.pcp).enumerate() {
                    for tok in (jd * dbs).max(need.start)..((jd + 1) * dbs).min(t) {
                        let js = tok / sbs;
                        let (ls, idx, _) = source(js, 0, ssplit);
                        let sb = src.block_ids[g][ls as usize][idx];
                        let sr = src.global_rank(ls);
                        let (st, dt) = (tok % sbs, tok % dbs);
                        rows.push(row(
                            sr,
                            s.value_offset(sb, st),
                            dst_rank,
                            d.value_offset(dids[i], dt),
                            s.value_bytes,
                        ));
                        if s.scale_bytes > 0 {
                            rows.push(row(
                                sr,
                                s.scale_offset(sb, st),
                                dst_rank,
                                d.scale_offset(dids[i], dt),
                                s.scale_bytes,
                            ));
                        }
                    }
                }
            }
            (GroupRankKv::State(s), GroupRankKv::State(d)) => {
                // Every PCP rank holds the state; spread the reads over the source's PCP ranks.
                let ps = dc.pcp % sl.spec.pcp;
                let dslot = dids[0];
                for (ci, c) in d.components.iter().enumerate() {
                    for r in 0..c.rows {
                        for (si, seg) in c.segments.iter().enumerate() {
                            let sseg = &s.components[ci].segments[si];
                            for hl in 0..seg.heads {
                                let gh = seg.split.first_head(dc.tp) + hl;
                                let reps = sseg.split.ranks_of_head(gh);
                                let ts = reps.start + ld % (reps.end - reps.start);
                                let ls = ps * sl.spec.tp + ts;
                                let hs = gh - sseg.split.first_head(ts);
                                let sslot = src.block_ids[g][ls as usize][0];
                                rows.push(row(
                                    src.global_rank(ls),
                                    s.head_offset(sslot, ci, r, si, hs),
                                    dst_rank,
                                    d.head_offset(dslot, ci, r, si, hl),
                                    seg.head_bytes,
                                ));
                            }
                        }
                    }
                }
            }
            // The kinds are equal on both sides (checked before planning).
            _ => unreachable_kinds(&dl.model.groups[g].kind),
        }
    }
    rows
}

/// Both sides' group kinds were checked equal before planning, so their per-rank geometries
/// have the same variant; nothing to plan otherwise.
fn unreachable_kinds(_kind: &GroupKind) {}

/// The uniform fields of a grouped [`Placement`]: the grouped layout's spec and cache layer count
/// on a placeholder geometry (one 1-byte element per token, no blocks, so that nothing can
/// compute uniform byte offsets from it), no uniform blocks.
fn carrier_layout(h: &HybridPlacement) -> ParallelLayout {
    ParallelLayout {
        model: ModelKv {
            name: h.layout.model.name.clone(),
            num_layers: h.layout.num_layers(),
            num_kv_heads: 1,
            head_dim: 1,
            kv_planes: 1,
            dtype: DType::Fp8,
        },
        spec: h.layout.spec,
        num_blocks: 0,
        physical_layout: None,
        block_format: None,
    }
}

impl Placement {
    /// The placement of a request in KV cache groups, in the form every consumer of placements
    /// takes (the transfer pipeline, the network endpoint and its wire messages, the C ABI):
    /// `groups` set, `layout` the groups' spec with their cache layer count (one buffer per
    /// cache layer), `dp_rank` theirs, one empty block id list per rank.
    ///
    /// A one-group placement of a uniform model is kept grouped (use
    /// [`HybridPlacement::from_uniform`]'s source instead when the uniform form is wanted).
    ///
    /// Errors: as [`HybridLayout::validate`].
    pub fn from_groups(h: HybridPlacement) -> Result<Placement> {
        h.layout.validate()?;
        let rpr = h.layout.spec.ranks_per_replica();
        Ok(Placement {
            layout: carrier_layout(&h),
            dp_rank: h.dp_rank,
            block_ids: vec![Vec::new(); rpr as usize],
            first_token: h.first_token,
            groups: Some(Box::new(h)),
        })
    }

    /// The placement group by group: its groups, or the one-group form of a uniform placement.
    pub fn to_groups(&self) -> HybridPlacement {
        match &self.groups {
            Some(h) => (**h).clone(),
            None => HybridPlacement::from_uniform(self),
        }
    }

    /// Checks that a grouped placement's uniform fields are the ones derived from its groups
    /// ([`Placement::from_groups`]), so a peer cannot describe one thing in `layout` and another
    /// in `groups`.
    pub(super) fn check_carrier(&self, h: &HybridPlacement) -> Result<()> {
        let rpr = h.layout.spec.ranks_per_replica() as usize;
        if self.layout != carrier_layout(h)
            || self.dp_rank != h.dp_rank
            || self.first_token != h.first_token
            || self.block_ids.len() != rpr
            || self.block_ids.iter().any(|v| !v.is_empty())
        {
            return Err(Error::Layout(format!(
                "a placement with KV cache groups must have the layout, DP rank, first token and \
                 (empty) block id lists derived from its groups (model `{}`: {} cache layers, {}, \
                 DP rank {}, first token {}, {rpr} empty block id lists)",
                h.layout.model.name,
                h.layout.num_layers(),
                h.layout.spec,
                h.dp_rank,
                h.first_token
            )));
        }
        Ok(())
    }
}

/// The fields of a placement as written (uniform, or with `groups`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlacementFields {
    layout: ParallelLayout,
    dp_rank: u32,
    block_ids: Vec<Vec<u32>>,
    #[serde(default)]
    groups: Option<Box<HybridPlacement>>,
    #[serde(default)]
    first_token: u32,
}

impl TryFrom<serde_json::Value> for Placement {
    type Error = String;

    /// Reads any of [`Placement`]'s JSON forms: a `layout` with `groups` is a
    /// [`HybridPlacement`] ([`Placement::from_groups`]); otherwise the uniform fields, with an
    /// optional `groups`.
    fn try_from(v: serde_json::Value) -> std::result::Result<Placement, String> {
        let grouped = v.get("layout").and_then(|l| l.get("groups")).is_some();
        if grouped {
            let h: HybridPlacement = serde_json::from_value(v)
                .map_err(|e| format!("placement with KV cache groups: {e}"))?;
            return Placement::from_groups(h).map_err(|e| e.to_string());
        }
        let f: PlacementFields = serde_json::from_value(v).map_err(|e| e.to_string())?;
        Ok(Placement {
            layout: f.layout,
            dp_rank: f.dp_rank,
            block_ids: f.block_ids,
            groups: f.groups,
            first_token: f.first_token,
        })
    }
}

/// [`Placement::try_block_ranges`] of a grouped placement.
pub(super) fn grouped_block_ranges(h: &HybridPlacement, local: u32) -> Result<Vec<ByteRange>> {
    if local as usize >= h.layout.spec.ranks_per_replica() as usize {
        return Err(Error::InvalidArgument(format!(
            "local rank {local}: the placement lists {} ranks",
            h.layout.spec.ranks_per_replica()
        )));
    }
    h.block_ranges(local)
}

/// [`Plan::build`] when either side is grouped: both sides' uniform fields checked against
/// their groups, then [`Plan::build_groups`].
pub(super) fn build_placements(src: &Placement, dst: &Placement, num_tokens: u32) -> Result<Plan> {
    for (p, side) in [(src, "source"), (dst, "destination")] {
        if let Some(h) = &p.groups {
            p.check_carrier(h)
                .map_err(|e| e.context(format!("{side} placement")))?;
        }
    }
    Plan::build_groups(&src.to_groups(), &dst.to_groups(), num_tokens)
}

#[cfg(test)]
mod tests;
