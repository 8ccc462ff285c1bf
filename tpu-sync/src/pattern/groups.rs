//! Deterministic contents of grouped (hybrid) KV buffers, for demos and tests.
//!
//! As [`super::RankContents`] for uniform models: every logical element of a request gets a
//! value derived from its coordinates, every other byte a background derived from a salt, the
//! rank, the layer and the byte position. Paged groups use [`super::element_value`]
//! `(layer, plane, token, head, dim)` (the indexer's value row is plane 0, its scale bytes plane
//! 1); state slots use [`state_value`] `(layer, component, row, segment, head, element)`. A
//! sliding-window group's request elements are only the tokens it must hold
//! ([`HybridLayout::needed_tokens`]); with the opaque LBHNC order, whole held blocks.

use super::{background_value, element_value, expect, mix64, store, LayerCheck};
use crate::error::{Error, Result};
use crate::layout::{GroupRankKv, HybridLayout, RankCoord};
use crate::plan::HybridPlacement;

/// The value of state element `(layer, component, row, segment, global head, element)`: a
/// 64-bit hash of which the low `dtype size` bytes are stored (never all zero).
#[inline]
pub fn state_value(layer: u32, comp: u32, row: u32, seg: u32, head: u32, elem: u32) -> u64 {
    let a = mix64((((layer as u64) << 32) | comp as u64) ^ 0x7374_6174_652d_6b76); // "state-kv"
    let b = mix64(a ^ (((row as u64) << 32) | seg as u64));
    mix64(b ^ (((head as u64) << 32) | elem as u64))
}

/// What a request element is, for its value.
#[derive(Debug, Clone, Copy)]
enum Elem {
    /// Paged row: plane, token, global head.
    Kv(u32, u32, u32),
    /// State row: component, row, segment, global head.
    State(u32, u32, u32, u32),
}

/// What one rank of a [`HybridPlacement`] holds in each of its cache layer buffers.
#[derive(Debug, Clone)]
pub struct GroupedContents {
    layout: HybridLayout,
    rank: u32,
    coord: RankCoord,
    num_tokens: u32,
    /// The placement's first computed token ([`HybridPlacement::next`]): which window tokens
    /// are the request's.
    next: u32,
    salt: u64,
    kvs: Vec<GroupRankKv>,
    /// Per group: the request block index held in each device block (slot), `u32::MAX` = none.
    request_block: Vec<Vec<u32>>,
}

impl GroupedContents {
    /// Contents of global rank `rank` of `placement.layout`; ranks outside the placement's DP
    /// replica hold only background. `salt` distinguishes the backgrounds of different sides.
    ///
    /// Errors: [`Error::InvalidArgument`] for a rank outside the layout; [`Error::Layout`] for a
    /// layout with a zero field; [`Error::BlockRange`] for ids the placement does not have or
    /// outside the group's blocks.
    pub fn new(
        placement: &HybridPlacement,
        rank: u32,
        num_tokens: u32,
        salt: u64,
    ) -> Result<GroupedContents> {
        let l = &placement.layout;
        l.check_nonzero()?;
        if rank >= l.num_ranks() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} >= {} ranks",
                l.num_ranks()
            )));
        }
        let coord = l.u_coord(rank);
        let kvs: Vec<GroupRankKv> = (0..l.groups.len()).map(|g| l.u_rank_kv(g)).collect();
        let mut request_block = Vec::with_capacity(kvs.len());
        for (g, kv) in kvs.iter().enumerate() {
            let mut rb = vec![u32::MAX; kv.num_blocks() as usize];
            if let Some(local) = placement.local_rank(rank) {
                let held = placement.u_listed_blocks(g, num_tokens, coord.pcp);
                let ids = placement
                    .block_ids
                    .get(g)
                    .and_then(|r| r.get(local as usize))
                    .ok_or_else(|| {
                        Error::BlockRange(format!("no block ids for group {g} rank {rank}"))
                    })?;
                for (i, &id) in ids.iter().enumerate() {
                    let slot = rb.get_mut(id as usize).ok_or_else(|| {
                        Error::BlockRange(format!("block id {id} of group {g} out of range"))
                    })?;
                    *slot = held.start + i as u32;
                }
            }
            request_block.push(rb);
        }
        Ok(GroupedContents {
            layout: l.clone(),
            rank,
            coord,
            num_tokens,
            next: placement.next(num_tokens),
            salt,
            kvs,
            request_block,
        })
    }

    /// The contents of a source that computed its whole request: every token of its blocks
    /// (below the request's end) holds the request's KV, also a sliding window's tokens before
    /// the window that share its first block (a plan into a destination that recomputes an
    /// earlier token, [`HybridPlacement::next_token`], reads them).
    pub fn whole_blocks(mut self) -> Self {
        self.next = 0;
        self
    }

    /// Bytes of the rank's buffer of cache layer `layer`.
    ///
    /// Errors: [`Error::InvalidArgument`] for a layer outside the model.
    pub fn layer_bytes(&self, layer: u32) -> Result<u64> {
        Ok(self.kvs[self.group(layer)?].buffer_bytes())
    }

    fn group(&self, layer: u32) -> Result<usize> {
        self.layout.model.group_of_layer(layer).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "layer {layer} is outside the model's {} cache layers",
                self.layout.num_layers()
            ))
        })
    }

    /// Calls `f(offset, len, element size, element)` for every request row of a layer.
    fn for_each_request_row(&self, g: usize, mut f: impl FnMut(u64, u64, u64, Elem)) {
        let l = &self.layout;
        let need = l.u_needed_tokens_from(g, self.num_tokens, self.next);
        let rbs = &self.request_block[g];
        match &self.kvs[g] {
            GroupRankKv::Paged(kv) => {
                let first = l.u_head_split(g).first_head(self.coord.tp);
                let whole = kv.order.is_opaque();
                let es = kv.dtype.size();
                for (block, &rb) in rbs.iter().enumerate() {
                    if rb == u32::MAX {
                        continue;
                    }
                    for tok in 0..kv.block_size {
                        let token = rb * kv.block_size + tok;
                        if !whole && !need.contains(&token) {
                            continue;
                        }
                        for h in 0..kv.num_heads {
                            for p in 0..kv.kv_planes {
                                let off = kv.row_offset(p, block as u32, tok, h);
                                f(off, kv.row_bytes(), es, Elem::Kv(p, token, first + h));
                            }
                        }
                    }
                }
            }
            GroupRankKv::Indexer(ix) => {
                let es = match &l.model.groups[g].kind {
                    crate::layout::GroupKind::Indexer { dtype, .. } => dtype.size(),
                    _ => 1,
                };
                for (block, &rb) in rbs.iter().enumerate() {
                    if rb == u32::MAX {
                        continue;
                    }
                    for tok in 0..ix.block_size {
                        let token = rb * ix.block_size + tok;
                        if !need.contains(&token) {
                            continue;
                        }
                        let b = block as u32;
                        f(
                            ix.value_offset(b, tok),
                            ix.value_bytes,
                            es,
                            Elem::Kv(0, token, 0),
                        );
                        if ix.scale_bytes > 0 {
                            f(
                                ix.scale_offset(b, tok),
                                ix.scale_bytes,
                                1,
                                Elem::Kv(1, token, 0),
                            );
                        }
                    }
                }
            }
            GroupRankKv::State(st) => {
                for (slot, &rb) in rbs.iter().enumerate() {
                    if rb == u32::MAX {
                        continue;
                    }
                    for (ci, c) in st.components.iter().enumerate() {
                        for r in 0..c.rows {
                            for (si, seg) in c.segments.iter().enumerate() {
                                let first = seg.split.first_head(self.coord.tp);
                                for h in 0..seg.heads {
                                    f(
                                        st.head_offset(slot as u32, ci, r, si, h),
                                        seg.head_bytes,
                                        c.dtype.size(),
                                        Elem::State(ci as u32, r, si as u32, first + h),
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Fills the rank's buffer of cache layer `layer` (exactly [`GroupedContents::layer_bytes`]
    /// bytes): request elements where the placement puts them, background everywhere else.
    ///
    /// Errors: [`Error::InvalidArgument`] for a layer outside the model or a buffer of another
    /// length.
    pub fn fill_layer(&self, layer: u32, out: &mut [u8]) -> Result<()> {
        let g = self.group(layer)?;
        let want = self.kvs[g].buffer_bytes();
        if out.len() as u64 != want {
            return Err(Error::InvalidArgument(format!(
                "layer {layer} buffer is {} bytes, layout needs {want}",
                out.len()
            )));
        }
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            store(
                chunk,
                background_value(self.salt, self.rank, layer, i as u64),
            );
        }
        self.for_each_request_row(g, |off, len, es, e| {
            let row = &mut out[off as usize..(off + len) as usize];
            for (d, el) in row.chunks_mut(es as usize).enumerate() {
                store(el, value(layer, e, d as u32));
            }
        });
        Ok(())
    }

    /// Checks the rank's buffer of cache layer `layer` against the expected request elements
    /// and background. `mismatches` counts differing bytes.
    ///
    /// Errors: as [`GroupedContents::fill_layer`].
    pub fn verify_layer(&self, layer: u32, data: &[u8]) -> Result<LayerCheck> {
        let g = self.group(layer)?;
        let mut want = vec![0u8; data.len()];
        self.fill_layer(layer, &mut want)?;
        let mut c = LayerCheck::default();
        let mut first_bad: Option<usize> = None;
        self.for_each_request_row(g, |off, len, es, e| {
            c.request_bytes += len;
            let row = &data[off as usize..(off + len) as usize];
            for (d, el) in row.chunks(es as usize).enumerate() {
                if !expect(el, value(layer, e, d as u32)) && c.first_mismatch.is_none() {
                    c.first_mismatch = Some(format!(
                        "rank {} layer {layer} {} element {d}: got {el:02x?}",
                        self.rank,
                        match e {
                            Elem::Kv(p, t, h) => format!("plane {p} token {t} head {h}"),
                            Elem::State(ci, r, si, h) =>
                                format!("state component {ci} row {r} segment {si} head {h}"),
                        }
                    ));
                }
            }
        });
        for (i, (a, b)) in data.iter().zip(&want).enumerate() {
            if a != b {
                c.mismatches += 1;
                first_bad.get_or_insert(i);
            }
        }
        c.background_bytes = data.len() as u64 - c.request_bytes;
        if c.first_mismatch.is_none() {
            if let Some(i) = first_bad {
                c.first_mismatch = Some(format!(
                    "rank {} layer {layer} byte {i} outside the request was modified",
                    self.rank
                ));
            }
        }
        Ok(c)
    }
}

fn value(layer: u32, e: Elem, d: u32) -> u64 {
    match e {
        Elem::Kv(p, t, h) => element_value(layer, p, t, h, d),
        Elem::State(ci, r, si, h) => state_value(layer, ci, r, si, h, d),
    }
}
