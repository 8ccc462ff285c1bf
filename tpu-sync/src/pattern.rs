//! Deterministic KV contents for demos, tests and benchmarks.
//!
//! Every logical element `(layer, plane, token, head, dim)` of a request gets a value derived from
//! a 64-bit mix of its coordinates ([`element_value`]): non-zero, not periodic, and different for
//! every coordinate, so a byte delivered to the wrong place is detected. Bytes outside a request
//! (other blocks, the tail of a partial last block) get a *background* value derived from a salt,
//! the rank, the layer and the byte position, so an unintended write is detected too.
//!
//! With the opaque block order [`BlockOrder::Lbhnc`] a request owns its blocks whole: the tail
//! rows of a partial last block are request elements too (their token index runs past the
//! request), because plans move such blocks whole.

use crate::error::{Error, Result};
use crate::layout::{BlockOrder, KvLayout};
use crate::plan::Placement;

pub mod groups;
pub use groups::{state_value, GroupedContents};

/// splitmix64 finaliser (Steele, Lea, Flood 2014): a fast, well-distributed 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The value of logical element `(layer, plane, token, head, dim)`: a 64-bit hash of which the
/// low `dtype size` bytes are stored (little endian). Never zero in those bytes.
#[inline]
pub fn element_value(layer: u32, plane: u32, token: u32, head: u32, dim: u32) -> u64 {
    let key = ((layer as u64) << 48)
        ^ ((plane as u64) << 44)
        ^ ((token as u64) << 20)
        ^ ((head as u64) << 12)
        ^ dim as u64;
    mix64(key ^ 0x7470_752D_7379_6E63) // "tpu-sync"
}

/// The background value of byte chunk `index` of a buffer, for a salt and rank.
#[inline]
pub fn background_value(salt: u64, rank: u32, layer: u32, index: u64) -> u64 {
    mix64(mix64(salt ^ ((rank as u64) << 32) ^ layer as u64) ^ index)
}

#[inline]
fn store(dst: &mut [u8], v: u64) {
    let n = dst.len();
    let b = v.to_le_bytes();
    dst.copy_from_slice(&b[..n]);
    if dst.iter().all(|&x| x == 0) {
        dst[0] = 1;
    }
}

#[inline]
fn expect(dst: &[u8], v: u64) -> bool {
    let n = dst.len();
    let b = v.to_le_bytes();
    if b[..n].iter().all(|&x| x == 0) {
        dst[0] == 1 && dst[1..].iter().all(|&x| x == 0)
    } else {
        dst == &b[..n]
    }
}

/// What one rank holds: which device block carries which request block.
#[derive(Debug, Clone)]
pub struct RankContents {
    kv: KvLayout,
    rank: u32,
    num_tokens: u32,
    first_head: u32,
    /// request block index per device block id (`u32::MAX` = not part of the request).
    request_block: Vec<u32>,
    salt: u64,
}

impl RankContents {
    /// Contents of global rank `rank` of `placement.layout`; ranks outside the placement's DP
    /// replica hold only background. `salt` distinguishes the backgrounds of different sides.
    pub fn new(
        placement: &Placement,
        rank: u32,
        num_tokens: u32,
        salt: u64,
    ) -> Result<RankContents> {
        let l = &placement.layout;
        if rank >= l.num_ranks() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} >= {} ranks",
                l.num_ranks()
            )));
        }
        let kv = l.rank_kv()?;
        let mut request_block = vec![u32::MAX; kv.num_blocks as usize];
        let c = l.coord(rank)?;
        if let Some(local) = placement.local_rank(rank) {
            let chunk = placement.held_chunk(num_tokens, c.pcp)?;
            let ids = placement.block_ids.get(local as usize).map(Vec::as_slice);
            for (i, &id) in ids.unwrap_or_default().iter().enumerate() {
                let slot = request_block.get_mut(id as usize).ok_or_else(|| {
                    Error::BlockRange(format!("block id {id} >= num_blocks {}", kv.num_blocks))
                })?;
                *slot = chunk.start + i as u32;
            }
        }
        Ok(RankContents {
            kv,
            rank,
            num_tokens,
            first_head: l.first_head(c.tp)?,
            request_block,
            salt,
        })
    }

    /// The rank's buffer layout.
    pub fn kv(&self) -> &KvLayout {
        &self.kv
    }

    /// Calls `f(offset, Some((plane, token, global_head)))` for every row of a layer that holds a
    /// request element, and `f(offset, None)` for every other row.
    fn for_each_row(&self, mut f: impl FnMut(u64, Option<(u32, u32, u32)>)) {
        let kv = &self.kv;
        let whole_blocks = kv.order == BlockOrder::Lbhnc;
        for plane in 0..kv.kv_planes {
            for block in 0..kv.num_blocks {
                let rb = self.request_block[block as usize];
                for tok in 0..kv.block_size {
                    for h in 0..kv.num_heads {
                        let off = kv.row_offset(plane, block, tok, h);
                        let token = rb.wrapping_mul(kv.block_size).wrapping_add(tok);
                        if rb != u32::MAX && (whole_blocks || token < self.num_tokens) {
                            f(off, Some((plane, token, self.first_head + h)));
                        } else {
                            f(off, None);
                        }
                    }
                }
            }
        }
    }

    /// Fills one layer's buffer (`kv.buffer_bytes()` bytes).
    pub fn fill_layer(&self, layer: u32, out: &mut [u8]) -> Result<()> {
        let kv = self.kv;
        if out.len() as u64 != kv.buffer_bytes() {
            return Err(Error::InvalidArgument(format!(
                "layer buffer is {} bytes, layout needs {}",
                out.len(),
                kv.buffer_bytes()
            )));
        }
        if kv.order.is_tpu() {
            // The padding of the RPA v3 orders is zero (as the engines allocate it); the rows
            // are written below.
            out.fill(0);
        }
        let es = kv.dtype.size() as usize;
        let rb = kv.row_bytes() as usize;
        self.for_each_row(|off, who| {
            let row = &mut out[off as usize..off as usize + rb];
            for (d, el) in row.chunks_exact_mut(es).enumerate() {
                let v = match who {
                    Some((p, t, h)) => element_value(layer, p, t, h, d as u32),
                    None => background_value(
                        self.salt,
                        self.rank,
                        layer,
                        (off as usize + d * es) as u64,
                    ),
                };
                store(el, v);
            }
        });
        Ok(())
    }

    /// Checks one layer's buffer against the expected request elements and background.
    pub fn verify_layer(&self, layer: u32, data: &[u8]) -> Result<LayerCheck> {
        let kv = self.kv;
        if data.len() as u64 != kv.buffer_bytes() {
            return Err(Error::InvalidArgument(format!(
                "layer buffer is {} bytes, layout needs {}",
                data.len(),
                kv.buffer_bytes()
            )));
        }
        let es = kv.dtype.size() as usize;
        let rb = kv.row_bytes() as usize;
        let mut c = LayerCheck::default();
        self.for_each_row(|off, who| {
            let row = &data[off as usize..off as usize + rb];
            for (d, el) in row.chunks_exact(es).enumerate() {
                let (v, is_req) = match who {
                    Some((p, t, h)) => (element_value(layer, p, t, h, d as u32), true),
                    None => (background_value(self.salt, self.rank, layer, (off as usize + d * es) as u64), false),
                };
                if is_req {
                    c.request_bytes += es as u64;
                } else {
                    c.background_bytes += es as u64;
                }
                if !expect(el, v) {
                    c.mismatches += 1;
                    if c.first_mismatch.is_none() {
                        c.first_mismatch = Some(match who {
                            Some((p, t, h)) => format!(
                                "rank {} layer {layer} plane {p} token {t} head {h} dim {d}: got {:02x?}",
                                self.rank, el
                            ),
                            None => format!(
                                "rank {} layer {layer} byte {} outside the request was modified",
                                self.rank,
                                off as usize + d * es
                            ),
                        });
                    }
                }
            }
        });
        // The RPA v3 orders' padding (unused slots and lanes) is never written: it must still
        // be zero, as the engines allocate it.
        let pad = kv.token_padding();
        if !pad.is_empty() {
            for block in 0..kv.num_blocks {
                for tok in 0..kv.block_size {
                    let base = kv.token_offset(block, tok);
                    for &(o, n) in &pad {
                        let at = (base + o) as usize;
                        let bytes = &data[at..at + n as usize];
                        c.padding_bytes += n;
                        if let Some(i) = bytes.iter().position(|&b| b != 0) {
                            c.mismatches += 1;
                            if c.first_mismatch.is_none() {
                                c.first_mismatch = Some(format!(
                                    "rank {} layer {layer} block {block} token {tok}: padding \
                                     byte {} is {:#04x}, not zero",
                                    self.rank,
                                    at + i,
                                    bytes[i]
                                ));
                            }
                        }
                    }
                }
            }
        }
        Ok(c)
    }
}

/// Result of [`RankContents::verify_layer`].
#[derive(Debug, Clone, Default)]
pub struct LayerCheck {
    /// Bytes of request elements checked.
    pub request_bytes: u64,
    /// Bytes outside the request checked (must be unchanged).
    pub background_bytes: u64,
    /// Padding bytes of the RPA v3 orders checked (must be zero).
    pub padding_bytes: u64,
    /// Elements (or padding runs) that differ from the expectation.
    pub mismatches: u64,
    /// Description of the first mismatch.
    pub first_mismatch: Option<String>,
}

impl LayerCheck {
    /// Adds another layer's result.
    pub fn merge(&mut self, o: LayerCheck) {
        self.request_bytes += o.request_bytes;
        self.background_bytes += o.background_bytes;
        self.padding_bytes += o.padding_bytes;
        self.mismatches += o.mismatches;
        if self.first_mismatch.is_none() {
            self.first_mismatch = o.first_mismatch;
        }
    }
}
