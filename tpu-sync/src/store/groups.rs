//! Hybrid models in the host tier: one stored prefix made of several KV cache groups.
//!
//! A block of a hybrid model's prompt has one **part** per group (the block's bytes of every
//! layer of that group on one rank): full attention, MLA and indexer groups have a part for every
//! block; a sliding-window group needs only the parts of the blocks its window covers; a state
//! group (linear attention, Mamba) has a part only at the blocks at which the engine took the
//! state: **a state part belongs to the block after whose last token the state was taken**. This
//! is how vLLM's offloading keys its hybrid blocks (`OffloadKey = block_hash +
//! group_idx.to_bytes(4, "big")`) and SGLang its host pool groups.
//!
//! # Keys and chains
//!
//! A part is stored as one or more store blocks of at most `chunk_bytes` each (a Qwen3-Next
//! state part is tens of MiB; an attention part a few hundred KiB), keyed
//! [`part_key`]`(block key, group, chunk)`: derived from the block's chained key, so a part can
//! only ever be found under the prefix it was stored for. Part `(0, 0)` is the block key itself,
//! so a one-group (uniform) model stores exactly the keys it always did.
//!
//! The chunks of the **covering groups** (those whose parts every block has:
//! [`PartRole::Full`]) form the *spine*: block after block, group after group, chunk after
//! chunk, each chained on the previous one. A window or state part is a short chain of its own
//! hanging off the last spine chunk of its block. The index's prefix rule ([`super::index`])
//! then gives the eviction the engines need: a block's spine is never evicted while a window or
//! state part of it (or a later block) stays, and tails go first.
//!
//! # The prefix rule
//!
//! [`KvStore::lookup_groups`] reports the longest prefix of `n` blocks that **every group can
//! serve**: the spine of blocks `0..n` is present, every window group's parts of the blocks its
//! window covers at the end of block `n - 1` are present, and every state group's part of block
//! `n - 1` is present. A prefix whose state part or one group's block was evicted reports a
//! shorter hit (the longest one still whole), never bytes of another prefix. A part found
//! incomplete (a chunk evicted) is removed whole, with everything chained below it, so the
//! rest of it does not linger.
//!
//! Warm restarts need nothing more: parts are ordinary committed blocks with their parent keys
//! in the segment's slot table, so a re-attached segment serves the same hits, and a part whose
//! put was killed half-way is simply incomplete (a shorter hit).

use std::ops::Range;

use xxhash_rust::xxh3::Xxh3;

use super::{BlockKey, DeviceBlock, DeviceRange, GetReport, KvStore, Lease, PutReport, StopReason};
use crate::error::{Error, Result};
use crate::layout::{GroupKind, GroupRankKv, HybridLayout};
use crate::pjrt::Capabilities;

/// Seed of [`part_key`] ("kv-parts").
const PART_SEED: u64 = 0x6b76_2d70_6172_7473;

/// Key of chunk `chunk` of group `group`'s part of the block keyed `block`: the block key itself
/// for `(0, 0)`, else xxh3-128 over `block key (16 bytes LE) || group (u32 LE) || chunk (u32
/// LE)` with a fixed seed.
pub fn part_key(block: BlockKey, group: u32, chunk: u32) -> BlockKey {
    if group == 0 && chunk == 0 {
        return block;
    }
    let mut h = Xxh3::with_seed(PART_SEED);
    h.update(&block.to_bytes());
    h.update(&group.to_le_bytes());
    h.update(&chunk.to_le_bytes());
    BlockKey(h.digest128())
}

/// Which blocks of a prompt a group has a part for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PartRole {
    /// Every block (full attention, MLA, indexer): the spine of the prefix.
    Full,
    /// The blocks holding the tokens a sliding window of `tokens` tokens covers at the end of
    /// the prefix (see [`HybridLayout::needed_tokens`]).
    Window {
        /// The window in tokens (the model's `sliding_window`).
        tokens: u32,
    },
    /// A state part at the blocks after which the state was taken; a prefix of `n` blocks needs
    /// the part of block `n - 1`.
    State,
}

/// One group as the host tier sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoreGroup {
    /// Which blocks have a part.
    pub role: PartRole,
    /// Bytes of one block's part (all the group's layers of one rank).
    pub part_bytes: u64,
}

/// The groups of a hybrid model for the host tier: roles, part sizes, tokens per block and the
/// chunk size parts are split into (at most the store's block size).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreGroups {
    groups: Vec<StoreGroup>,
    block_tokens: u32,
    chunk_bytes: u64,
    spine: Vec<usize>,
}

/// One group's part of one block of a chain, with its data (host bytes or a [`DeviceBlock`]).
#[derive(Debug)]
pub struct GroupPart<T> {
    /// The block: an index into the chain.
    pub block: usize,
    /// The group.
    pub group: usize,
    /// The part's bytes (exactly [`StoreGroup::part_bytes`]).
    pub data: T,
}

/// Result of [`KvStore::lookup_groups`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupHit {
    /// Leading blocks that every group can serve (the usable hit).
    pub blocks: usize,
    /// Leading blocks whose spine (every [`PartRole::Full`] group's parts) is present.
    pub spine_blocks: usize,
    /// Incomplete parts found and removed (with what was chained below them).
    pub removed_parts: usize,
}

/// Result of a grouped put.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupPutReport {
    /// Store blocks (part chunks) written by this call.
    pub stored: usize,
    /// Store blocks already present (not written again).
    pub present: usize,
    /// The first block whose spine could not be stored ("full"); that block's and later blocks'
    /// parts were not stored.
    pub full_at: Option<usize>,
    /// Window or state parts (of blocks before `full_at`) that could not be stored, as
    /// `(block, group)`.
    pub missed: Vec<(usize, usize)>,
    /// The tier is not ready yet; nothing was stored.
    pub not_ready: bool,
    /// Bytes written.
    pub bytes: u64,
}

impl GroupPutReport {
    /// True when every part given is now stored or was already present.
    pub fn complete(&self) -> bool {
        self.full_at.is_none() && self.missed.is_empty() && !self.not_ready
    }
}

/// Result of a grouped get: `delivered` leading parts (in the order given) are in their
/// destinations, byte-exact.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupGetReport {
    /// Leading parts delivered whole.
    pub delivered: usize,
    /// Bytes delivered (of whole parts).
    pub bytes: u64,
    /// Why the get stopped before the last part (`None` when every part was delivered).
    pub stop: Option<StopReason>,
}

impl GroupGetReport {
    /// True when every part was delivered.
    pub fn complete(&self, parts: usize) -> bool {
        self.delivered == parts
    }
}

impl StoreGroups {
    /// Groups of the given roles and part sizes, for blocks of `block_tokens` tokens, split into
    /// chunks of at most `chunk_bytes` (the store's [`super::StoreConfig::block_bytes`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for no groups, a part of 0 bytes, a window of 0
    /// tokens, 0 tokens per block or a chunk of 0 bytes.
    pub fn new(
        groups: Vec<StoreGroup>,
        block_tokens: u32,
        chunk_bytes: u64,
    ) -> Result<StoreGroups> {
        if groups.is_empty() || block_tokens == 0 || chunk_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "store groups need at least one group ({} given), tokens per block ({block_tokens}) \
                 and chunk bytes ({chunk_bytes}) > 0",
                groups.len()
            )));
        }
        for (g, x) in groups.iter().enumerate() {
            if x.part_bytes == 0 || x.role == (PartRole::Window { tokens: 0 }) {
                return Err(Error::InvalidArgument(format!(
                    "store group {g}: a part needs > 0 bytes and a window > 0 tokens ({x:?})"
                )));
            }
        }
        let spine = (0..groups.len())
            .filter(|&g| groups[g].role == PartRole::Full)
            .collect();
        Ok(StoreGroups {
            groups,
            block_tokens,
            chunk_bytes,
            spine,
        })
    }

    /// One [`PartRole::Full`] group of `block_bytes`: the layout of a uniform model, whose keys
    /// are exactly the chain keys.
    ///
    /// Errors: as [`StoreGroups::new`].
    pub fn uniform(block_bytes: u64, block_tokens: u32, chunk_bytes: u64) -> Result<StoreGroups> {
        StoreGroups::new(
            vec![StoreGroup {
                role: PartRole::Full,
                part_bytes: block_bytes,
            }],
            block_tokens,
            chunk_bytes,
        )
    }

    /// The groups of one rank of `layout` for store blocks of `block_tokens` tokens: roles from
    /// the group kinds, a paged group's part = one of its blocks in every layer (all planes), a
    /// state group's part = its slot's dense bytes in every layer.
    ///
    /// Errors: [`Error::InvalidArgument`] when a paged group's block size is not `block_tokens`
    /// (a part is one engine block), or as [`StoreGroups::new`].
    pub fn from_layout(
        layout: &HybridLayout,
        block_tokens: u32,
        chunk_bytes: u64,
    ) -> Result<StoreGroups> {
        let mut groups = Vec::with_capacity(layout.groups.len());
        for (g, grp) in layout.model.groups.iter().enumerate() {
            let kv = layout.rank_kv(g)?;
            let layers = grp.layers.len() as u64;
            let role = match &grp.kind {
                GroupKind::State { .. } => PartRole::State,
                k => match k.sliding_window() {
                    Some(w) => PartRole::Window { tokens: w },
                    None => PartRole::Full,
                },
            };
            let bs = layout.block_size(g)?;
            if !grp.kind.is_state() && bs != block_tokens {
                return Err(Error::InvalidArgument(format!(
                    "group {}: blocks of {bs} tokens, but store blocks hold {block_tokens}",
                    layout.model.group_name(g),
                )));
            }
            let unit = match &kv {
                GroupRankKv::State(st) => st.slot_bytes,
                other => other.unit_bytes(),
            };
            groups.push(StoreGroup {
                role,
                part_bytes: unit * layers,
            });
        }
        StoreGroups::new(groups, block_tokens, chunk_bytes)
    }

    /// The groups.
    pub fn groups(&self) -> &[StoreGroup] {
        &self.groups
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Store blocks one part of group `g` takes.
    pub fn chunks(&self, g: usize) -> u32 {
        self.groups[g].part_bytes.div_ceil(self.chunk_bytes) as u32
    }

    /// `(offset, len)` of each chunk of group `g`'s part.
    fn chunk_ranges(&self, g: usize) -> impl Iterator<Item = (u64, u64)> + '_ {
        let total = self.groups[g].part_bytes;
        (0..self.chunks(g) as u64).map(move |c| {
            let a = c * self.chunk_bytes;
            (a, self.chunk_bytes.min(total - a))
        })
    }

    /// The keys of the chunks of group `g`'s part of the block keyed `block`, in order.
    pub fn part_keys(&self, block: BlockKey, g: usize) -> Vec<BlockKey> {
        (0..self.chunks(g))
            .map(|c| part_key(block, g as u32, c))
            .collect()
    }

    /// The last spine chunk of `block` (what the next block's spine and the block's window and
    /// state parts chain on), `None` without covering groups.
    fn spine_tail(&self, block: BlockKey) -> Option<BlockKey> {
        let g = *self.spine.last()?;
        Some(part_key(block, g as u32, self.chunks(g) - 1))
    }

    /// Spine chunk keys of `chain`'s blocks, in chain order.
    pub fn spine_keys(&self, chain: &[BlockKey]) -> Vec<BlockKey> {
        let mut v = Vec::new();
        for &b in chain {
            for &g in &self.spine {
                v.extend(self.part_keys(b, g));
            }
        }
        v
    }

    fn spine_chunks_per_block(&self) -> usize {
        self.spine.iter().map(|&g| self.chunks(g) as usize).sum()
    }

    /// The blocks whose parts of window group `g` a prefix of `blocks` blocks needs (empty for
    /// other roles): the blocks holding the tokens the window covers after the prefix's last
    /// token.
    pub fn window_blocks(&self, g: usize, blocks: usize) -> Range<usize> {
        match self.groups[g].role {
            PartRole::Window { tokens } => {
                let end = blocks as u64 * self.block_tokens as u64;
                let start = (end + 1).saturating_sub(tokens as u64).min(end);
                if start == end {
                    return blocks..blocks;
                }
                (start / self.block_tokens as u64) as usize..blocks
            }
            _ => blocks..blocks,
        }
    }

    /// The parts `(block, group)` a hit of `blocks` blocks consists of, in the order a grouped
    /// get takes them: the spine of every block, then each window group's window, then each
    /// state group's part of the last block.
    pub fn required_parts(&self, blocks: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        if blocks == 0 {
            return v;
        }
        for b in 0..blocks {
            for &g in &self.spine {
                v.push((b, g));
            }
        }
        for (g, x) in self.groups.iter().enumerate() {
            match x.role {
                PartRole::Window { .. } => v.extend(self.window_blocks(g, blocks).map(|b| (b, g))),
                PartRole::State => v.push((blocks - 1, g)),
                PartRole::Full => {}
            }
        }
        v
    }

    fn check_parts<T>(
        &self,
        chain: &[BlockKey],
        parts: &[GroupPart<T>],
        len: impl Fn(&T) -> u64,
    ) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for (i, p) in parts.iter().enumerate() {
            let Some(x) = self.groups.get(p.group) else {
                return Err(Error::InvalidArgument(format!(
                    "part {i}: group {} of {}",
                    p.group,
                    self.groups.len()
                )));
            };
            if p.block >= chain.len() {
                return Err(Error::InvalidArgument(format!(
                    "part {i}: block {} of a chain of {}",
                    p.block,
                    chain.len()
                )));
            }
            if len(&p.data) != x.part_bytes {
                return Err(Error::InvalidArgument(format!(
                    "part {i} (block {}, group {}) is {} bytes, the group's parts are {}",
                    p.block,
                    p.group,
                    len(&p.data),
                    x.part_bytes
                )));
            }
            if !seen.insert((p.block, p.group)) {
                return Err(Error::InvalidArgument(format!(
                    "part (block {}, group {}) given twice",
                    p.block, p.group
                )));
            }
        }
        Ok(())
    }
}

impl KvStore {
    /// The longest prefix of `chain` (block keys of consecutive blocks from the start of a
    /// sequence) that every group of `groups` can serve (see the module docs); touches the
    /// parts of the hit. A part found incomplete is removed whole. 0 while the tier is not
    /// ready.
    pub fn lookup_groups(&self, groups: &StoreGroups, chain: &[BlockKey]) -> GroupHit {
        let mut hit = GroupHit::default();
        let Some(c) = self.core() else {
            return hit;
        };
        let spine = groups.spine_keys(chain);
        let per = groups.spine_chunks_per_block();
        let raw: Vec<u128> = spine.iter().map(|k| k.0).collect();
        c.with_index(|ix| {
            let present = |ix: &crate::store::index::Index, k: BlockKey| {
                ix.find(k.0).is_some_and(|id| ix.entry(id).visible())
            };
            // Leading spine chunks present, without touching yet.
            let lead = raw
                .iter()
                .take_while(|&&k| present(ix, BlockKey(k)))
                .count();
            hit.spine_blocks = lead.checked_div(per).unwrap_or(chain.len());
            // A block whose spine is only partly present: its present chunks, and everything
            // chained below them, can never hit.
            let mut dead: Vec<u128> = Vec::new();
            if per > 0 && lead % per != 0 {
                dead.push(raw[lead - lead % per]);
            }
            let whole =
                |ix: &crate::store::index::Index, keys: &[BlockKey], dead: &mut Vec<u128>| {
                    let n = keys.iter().take_while(|&&k| present(ix, k)).count();
                    if n > 0 && n < keys.len() {
                        dead.push(keys[0].0);
                    }
                    n == keys.len()
                };
            let mut best = 0;
            for n in (1..=hit.spine_blocks).rev() {
                let mut ok = true;
                for (g, x) in groups.groups.iter().enumerate() {
                    let blocks = match x.role {
                        PartRole::Full => continue,
                        PartRole::Window { .. } => groups.window_blocks(g, n),
                        PartRole::State => n - 1..n,
                    };
                    for b in blocks {
                        if !whole(ix, &groups.part_keys(chain[b], g), &mut dead) {
                            ok = false;
                        }
                    }
                }
                if ok {
                    best = n;
                    break;
                }
            }
            hit.blocks = best;
            // Touch what the hit consists of: the spine through the regular lookup (tail oldest),
            // then the other parts.
            let _ = ix.lookup(&raw[..best * per]);
            let mut ids = Vec::new();
            for (b, g) in groups.required_parts(best) {
                if groups.groups[g].role != PartRole::Full {
                    for k in groups.part_keys(chain[b], g) {
                        ids.extend(ix.find(k.0));
                    }
                }
            }
            ix.touch(&ids);
            if !dead.is_empty() {
                dead.sort_unstable();
                dead.dedup();
                hit.removed_parts = dead.len();
                ix.remove(&dead);
            }
        });
        hit
    }

    /// Pins every part of a hit of `blocks` blocks of `chain` (see
    /// [`StoreGroups::required_parts`]), so a grouped get of them cannot race an eviction.
    /// `None` (nothing pinned) unless every part is present.
    pub fn pin_groups(
        &self,
        groups: &StoreGroups,
        chain: &[BlockKey],
        blocks: usize,
    ) -> Option<Lease> {
        let c = self.core()?;
        let keys: Vec<BlockKey> = groups
            .required_parts(blocks.min(chain.len()))
            .into_iter()
            .flat_map(|(b, g)| groups.part_keys(chain[b], g))
            .collect();
        let ids = c.with_index(|ix| {
            let ids: Option<Vec<_>> = keys
                .iter()
                .map(|k| ix.find(k.0).filter(|&id| ix.entry(id).visible()))
                .collect();
            if let Some(ids) = &ids {
                for &id in ids {
                    ix.pin(id);
                }
            }
            ids
        })?;
        Some(Lease {
            store: self.clone(),
            keys,
            ids,
        })
    }

    /// Stores parts of the blocks of `chain` from host memory: the parts of every
    /// [`PartRole::Full`] group for every block of the chain (required), and any window or state
    /// parts. `parent` is the block key before `chain[0]` (`None` at the start of a sequence).
    /// Parts already present are not written again.
    ///
    /// Errors: [`Error::InvalidArgument`] for a part of the wrong size, group or block, a part
    /// given twice, or a missing full-group part; a lack of room is not an error (see
    /// [`GroupPutReport`]).
    pub fn put_groups_from_host(
        &self,
        groups: &StoreGroups,
        parent: Option<BlockKey>,
        chain: &[BlockKey],
        parts: &[GroupPart<&[u8]>],
    ) -> Result<GroupPutReport> {
        groups.check_parts(chain, parts, |d| d.len() as u64)?;
        self.put_parts(
            groups,
            parent,
            chain,
            parts,
            |d, a, n| &d[a as usize..(a + n) as usize],
            |s, p, k, v| s.put_from_host(p, k, v),
        )
    }

    /// As [`KvStore::put_groups_from_host`], from PJRT device memory (each part a
    /// [`DeviceBlock`], copied with `PJRT_Buffer_CopyRawToHost`).
    ///
    /// Errors: as [`KvStore::put_groups_from_host`], plus the device layer's errors.
    pub fn put_groups_from_device(
        &self,
        groups: &StoreGroups,
        parent: Option<BlockKey>,
        chain: &[BlockKey],
        parts: &[GroupPart<DeviceBlock<'_>>],
    ) -> Result<GroupPutReport> {
        groups.check_parts(chain, parts, |d| d.len())?;
        self.put_parts(
            groups,
            parent,
            chain,
            parts,
            |d, a, n| d.slice(a, n),
            |s, p, k, v| s.put_from_device(p, k, v),
        )
    }

    fn put_parts<'p, T, C>(
        &self,
        groups: &StoreGroups,
        parent: Option<BlockKey>,
        chain: &[BlockKey],
        parts: &'p [GroupPart<T>],
        cut: impl Fn(&'p T, u64, u64) -> C,
        put: impl Fn(&KvStore, Option<BlockKey>, &[BlockKey], &[C]) -> Result<PutReport>,
    ) -> Result<GroupPutReport> {
        let mut rep = GroupPutReport::default();
        if chain.is_empty() {
            return Ok(rep);
        }
        let find = |b: usize, g: usize| parts.iter().find(|p| p.block == b && p.group == g);
        // The spine: every block's covering parts, chunk by chunk, as one chain.
        let mut keys = Vec::new();
        let mut data = Vec::new();
        for (b, &bk) in chain.iter().enumerate() {
            for &g in &groups.spine {
                let p = find(b, g).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "block {b} has no part of group {g}, which every block needs"
                    ))
                })?;
                for (c, (a, n)) in groups.chunk_ranges(g).enumerate() {
                    keys.push(part_key(bk, g as u32, c as u32));
                    data.push(cut(&p.data, a, n));
                }
            }
        }
        let per = groups.spine_chunks_per_block();
        let mut stored_blocks = chain.len();
        if per > 0 {
            let r = put(
                self,
                parent.and_then(|p| groups.spine_tail(p)),
                &keys,
                &data,
            )?;
            if r.not_ready {
                rep.not_ready = true;
                return Ok(rep);
            }
            rep.bytes += r.bytes;
            if let Some(at) = r.full_at {
                stored_blocks = at.checked_div(per).unwrap_or(0);
                rep.full_at = Some(stored_blocks);
            }
            rep.stored += r.stored;
            rep.present += r.present;
        }
        // Window and state parts, each a chain of its chunks on its block's spine tail.
        for p in parts {
            let x = groups.groups[p.group];
            if x.role == PartRole::Full {
                continue;
            }
            if p.block >= stored_blocks {
                continue;
            }
            let bk = chain[p.block];
            let keys = groups.part_keys(bk, p.group);
            let data: Vec<C> = groups
                .chunk_ranges(p.group)
                .map(|(a, n)| cut(&p.data, a, n))
                .collect();
            let r = put(self, groups.spine_tail(bk), &keys, &data)?;
            if r.not_ready {
                rep.not_ready = true;
                return Ok(rep);
            }
            rep.bytes += r.bytes;
            rep.stored += r.stored;
            rep.present += r.present;
            if r.full_at.is_some() {
                rep.missed.push((p.block, p.group));
            }
        }
        Ok(rep)
    }

    /// Copies parts of `chain`'s blocks into host memory, in the order given: `parts[i].data`
    /// receives the part `(block, group)` and must be exactly the group's part size. Stops at
    /// the first part not wholly present. Pin the parts first ([`KvStore::pin_groups`]) to rule
    /// out a concurrent eviction.
    ///
    /// Errors: as [`KvStore::get_to_host`], and [`Error::InvalidArgument`] for a part of the
    /// wrong size, group or block.
    pub fn get_groups_to_host(
        &self,
        groups: &StoreGroups,
        chain: &[BlockKey],
        parts: &mut [GroupPart<&mut [u8]>],
    ) -> Result<GroupGetReport> {
        groups.check_parts(chain, parts, |d| d.len() as u64)?;
        let keys = part_chunk_keys(groups, chain, parts);
        let mut dst: Vec<&mut [u8]> = Vec::with_capacity(keys.len());
        for p in parts.iter_mut() {
            let mut rest: &mut [u8] = &mut p.data[..];
            for (_, n) in groups.chunk_ranges(p.group) {
                let (a, b) = rest.split_at_mut(n as usize);
                dst.push(a);
                rest = b;
            }
        }
        let r = self.get_to_host(&keys, &mut dst)?;
        Ok(part_report(groups, parts, r))
    }

    /// As [`KvStore::get_groups_to_host`], into existing device blocks in place (by the path
    /// `caps` probed).
    ///
    /// Errors: as [`KvStore::get_to_device`], and as [`KvStore::get_groups_to_host`].
    pub fn get_groups_to_device(
        &self,
        caps: &Capabilities,
        groups: &StoreGroups,
        chain: &[BlockKey],
        parts: &[GroupPart<DeviceBlock<'_>>],
    ) -> Result<GroupGetReport> {
        groups.check_parts(chain, parts, |d| d.len())?;
        let keys = part_chunk_keys(groups, chain, parts);
        let dst: Vec<DeviceBlock<'_>> = parts
            .iter()
            .flat_map(|p| {
                groups
                    .chunk_ranges(p.group)
                    .map(|(a, n)| p.data.slice(a, n))
                    .collect::<Vec<_>>()
            })
            .collect();
        let r = self.get_to_device(caps, &keys, &dst)?;
        Ok(part_report(groups, parts, r))
    }
}

/// Chunk keys of `parts`, in order.
fn part_chunk_keys<T>(
    groups: &StoreGroups,
    chain: &[BlockKey],
    parts: &[GroupPart<T>],
) -> Vec<BlockKey> {
    parts
        .iter()
        .flat_map(|p| groups.part_keys(chain[p.block], p.group))
        .collect()
}

/// Whole leading parts delivered by a get of their chunks.
fn part_report<T>(groups: &StoreGroups, parts: &[GroupPart<T>], r: GetReport) -> GroupGetReport {
    let mut rep = GroupGetReport::default();
    let mut chunks = 0usize;
    for p in parts {
        chunks += groups.chunks(p.group) as usize;
        if chunks > r.delivered {
            break;
        }
        rep.delivered += 1;
        rep.bytes += groups.groups[p.group].part_bytes;
    }
    if rep.delivered < parts.len() {
        rep.stop = Some(r.stop.unwrap_or(StopReason::Missing));
    }
    rep
}

impl<'a> DeviceBlock<'a> {
    /// Group `g`'s part of block (or slot) `id` on one rank of `layout`: for each of the group's
    /// cache layers in order, the block's bytes in every plane (paged groups) or the slot's dense
    /// bytes (state groups) of that layer's buffer in `layers` (indexed by cache layer, one
    /// buffer per layer of the model). Its length is [`StoreGroups::from_layout`]'s part size.
    ///
    /// Errors: [`Error::InvalidArgument`] for a group outside the layout or a buffer count other
    /// than the model's layers; [`Error::BlockRange`] for an id outside the group's blocks.
    pub fn group_part(
        layout: &HybridLayout,
        g: usize,
        layers: &'a [crate::pjrt::DeviceBuffer],
        id: u32,
    ) -> Result<DeviceBlock<'a>> {
        let grp = layout.model.groups.get(g).ok_or_else(|| {
            Error::InvalidArgument(format!("group {g} of {}", layout.model.groups.len()))
        })?;
        if layers.len() != layout.num_layers() as usize {
            return Err(Error::InvalidArgument(format!(
                "{} layer buffers for a model of {} cache layers",
                layers.len(),
                layout.num_layers()
            )));
        }
        let kv = layout.rank_kv(g)?;
        if id >= kv.num_blocks() {
            return Err(Error::BlockRange(format!(
                "block {id} outside group {}'s {} blocks",
                layout.model.group_name(g),
                kv.num_blocks()
            )));
        }
        let ranges = kv.unit_ranges(id);
        let mut pieces = Vec::with_capacity(grp.layers.len() * ranges.len());
        for &l in &grp.layers {
            for &(offset, len) in &ranges {
                pieces.push(DeviceRange {
                    buffer: &layers[l as usize],
                    offset,
                    len,
                });
            }
        }
        Ok(DeviceBlock::new(pieces))
    }

    /// The `len` bytes of this block starting at byte `offset` (pieces cut at the edges).
    /// Bytes outside the block are not included: the result may be shorter when the range runs
    /// past the end.
    pub fn slice(&self, offset: u64, len: u64) -> DeviceBlock<'a> {
        let (start, end) = (offset, offset.saturating_add(len));
        let mut at = 0u64;
        let mut pieces: Vec<DeviceRange<'a>> = Vec::new();
        for p in &self.pieces {
            let (a, b) = (at, at + p.len);
            at = b;
            let (s, e) = (a.max(start), b.min(end));
            if s < e {
                pieces.push(DeviceRange {
                    buffer: p.buffer,
                    offset: p.offset + (s - a),
                    len: e - s,
                });
            }
        }
        DeviceBlock::new(pieces)
    }
}

#[cfg(test)]
mod tests;
