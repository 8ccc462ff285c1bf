//! Device buffers against the layout they are moved under: the one place that decides whether
//! the byte offsets a plan computes are valid in a rank's buffers.

use crate::error::{Error, Result};
use crate::layout::{HybridLayout, KvLayout, ParallelLayout};
use crate::pjrt::DeviceBuffer;

/// `dims` without leading dimensions of size 1 (so `[1, B, H, N, C]` equals `[B, H, N, C]`:
/// vLLM hands its per-layer LBHNC cache without the layout's leading 1).
fn squeezed(dims: &[i64]) -> &[i64] {
    let first = dims.iter().position(|&d| d != 1).unwrap_or(dims.len());
    &dims[first..]
}

/// Whether `layout` (the plugin's serialization, XLA notation `{minor_to_major}` possibly with
/// tiling after a `:`) is the dense row-major layout of an `ndims`-dimensional array:
/// `{ndims-1, ..., 1, 0}` without tiling or memory-space annotations.
pub fn is_dense_row_major(layout: &str, ndims: usize) -> bool {
    let t = layout.trim();
    let Some(inner) = t.strip_prefix('{').and_then(|x| x.strip_suffix('}')) else {
        return false;
    };
    if inner.contains(':') {
        return false;
    }
    let parsed: Option<Vec<usize>> = if inner.trim().is_empty() {
        Some(Vec::new())
    } else {
        inner.split(',').map(|p| p.trim().parse().ok()).collect()
    };
    match parsed {
        Some(v) => v.len() == ndims && v.iter().enumerate().all(|(i, &d)| d == ndims - 1 - i),
        None => false,
    }
}

/// An XLA layout in its text form (`{minor_to_major:T(tile)(tile)...}`, as PJRT plugins
/// serialize it, `xla::Layout::ToString`): the dimension order and the tiles, outermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XlaLayout {
    /// Dimensions from minor to major.
    pub minor_to_major: Vec<usize>,
    /// Tiles, each applied to the minor-most dimensions of the shape the previous one left
    /// (XLA's tiling: `T(8,128)(2,1)` tiles the last two dimensions by 8 x 128, then each tile's
    /// elements by 2 x 1).
    pub tiles: Vec<Vec<u64>>,
}

impl XlaLayout {
    /// Whether this is the dense row-major layout of its rank (`{n-1, ..., 1, 0}`, no tiles).
    pub fn is_dense(&self) -> bool {
        self.tiles.is_empty() && is_dense_order(&self.minor_to_major, self.minor_to_major.len())
    }

    /// Parses `{4,3,2,1,0}` or `{4,3,2,1,0:T(4,128)(4,1)}`; `None` for anything else (other
    /// annotations such as an element size `E(4)` or a memory space `S(1)`, combined tile
    /// dimensions `*`, malformed text), which callers refuse naming the text.
    pub fn parse(text: &str) -> Option<XlaLayout> {
        let inner = text.trim().strip_prefix('{')?.strip_suffix('}')?;
        let (order, rest) = match inner.split_once(':') {
            Some((o, r)) => (o, Some(r.trim())),
            None => (inner, None),
        };
        let minor_to_major = if order.trim().is_empty() {
            Vec::new()
        } else {
            order
                .split(',')
                .map(|p| p.trim().parse().ok())
                .collect::<Option<Vec<usize>>>()?
        };
        let mut tiles = Vec::new();
        if let Some(mut r) = rest {
            r = r.strip_prefix('T')?;
            while !r.is_empty() {
                let body = r.strip_prefix('(')?;
                let end = body.find(')')?;
                let tile = body[..end]
                    .split(',')
                    .map(|p| p.trim().parse().ok().filter(|&x: &u64| x > 0))
                    .collect::<Option<Vec<u64>>>()?;
                tiles.push(tile);
                r = &body[end + 1..];
            }
            if tiles.is_empty() {
                return None;
            }
        }
        Some(XlaLayout {
            minor_to_major,
            tiles,
        })
    }
}

/// Whether the physical layout `text` of a buffer of `dims` keeps every row of its last two
/// dimensions contiguous: dense row-major dimension order, and tiles that cover only those two
/// dimensions and divide them (no padding), each later tile dividing the one before. Then the
/// `dims[n-2] x dims[n-1]` elements of each row (an RPA v3 packed row of `P x D'` elements: a
/// `(block, token, r)`) are one contiguous run of bytes whose inner order the tiling permutes,
/// the same in every row; raw copies of whole rows between two buffers of the same layout are
/// exact, copies of parts of rows are not. A TPU's fp8 cache `{4,3,2,1,0:T(4,128)(4,1)}` over
/// `[N, BS, R, 4, D']` is such a layout (its `(block, token, r)` rows of `4 * D'` bytes stay
/// contiguous: the reading of `vllm_torchtpu/distributed/kv_transfer/raiden/
/// layout_fingerprint.py`, vllm-torchtpu-core 0.29.0); the dense layout is one too.
pub fn rows_stay_contiguous(text: &str, dims: &[i64]) -> bool {
    let n = dims.len();
    let Some(l) = XlaLayout::parse(text) else {
        return false;
    };
    if n < 2 || !is_dense_order(&l.minor_to_major, n) || dims.iter().any(|&d| d <= 0) {
        return false;
    }
    // The minor dimensions of the tiled shape that hold one row's elements, as XLA's tiling
    // leaves them: a tile of rank k over the last k of them turns each into (count, tile);
    // a tile that reaches beyond them (into the rows' own index) or pads one is refused.
    let mut row: Vec<u64> = vec![dims[n - 2] as u64, dims[n - 1] as u64];
    for tile in &l.tiles {
        if tile.is_empty() || tile.len() > row.len() {
            return false;
        }
        let off = row.len() - tile.len();
        if tile.iter().enumerate().any(|(i, &t)| row[off + i] % t != 0) {
            return false;
        }
        let counts: Vec<u64> = tile
            .iter()
            .enumerate()
            .map(|(i, &t)| row[off + i] / t)
            .collect();
        row.truncate(off);
        row.extend(counts);
        row.extend(tile);
    }
    true
}

fn is_dense_order(m2m: &[usize], ndims: usize) -> bool {
    m2m.len() == ndims && m2m.iter().enumerate().all(|(i, &d)| d == ndims - 1 - i)
}

fn describe(b: &DeviceBuffer) -> String {
    format!(
        "{}{:?}, {} bytes on device, layout {}",
        b.element_type().name(),
        b.dims(),
        b.on_device_size(),
        b.physical_layout().unwrap_or("unknown")
    )
}

/// What the layout's byte offsets assume about one layer's buffer, as text.
fn expected(kv: &KvLayout) -> String {
    let d = kv.dims();
    format!(
        "{}{:?} ({} order: {}), {} dense bytes, row-major",
        kv.dtype.element_type().name(),
        d,
        kv.order.name(),
        match kv.order {
            crate::layout::BlockOrder::Nhd => "[planes, blocks, block tokens, heads, head_dim]",
            crate::layout::BlockOrder::Hnd => "[planes, blocks, heads, block tokens, head_dim]",
            crate::layout::BlockOrder::Lbhnc =>
                "[1, blocks, heads, block tokens, planes * head_dim]",
            crate::layout::BlockOrder::Rpa3 | crate::layout::BlockOrder::Rpa3Hd64 =>
                "[blocks, block tokens, packed rows, packing, padded head_dim]",
            crate::layout::BlockOrder::RpaMla => "[blocks, block tokens, padded head_dim]",
        },
        kv.buffer_bytes()
    )
}

/// Checks the per-layer buffers of global rank `rank` against `layout`'s per-rank buffer
/// ([`ParallelLayout::rank_kv`]): one buffer per layer, each live, of the layout's element type,
/// of its dims (leading 1s ignored), with `PJRT_Buffer_OnDeviceSizeInBytes` equal to the dense
/// size the byte offsets assume, and a physical layout that is dense row-major (when the plugin
/// reports one) and equal to `layout.physical_layout` (when the placement names one). For the
/// RPA v3 orders a tiled layout that keeps packed rows contiguous ([`rows_stay_contiguous`]) is
/// taken too, when the placement names it (its plans then move whole rows only).
///
/// Errors: [`Error::Mismatch`] naming the rank, the layer, the buffer and what was expected;
/// [`Error::Layout`] for a layout with a zero field; [`Error::InvalidArgument`] for a deleted
/// buffer.
pub fn check_rank_buffers(
    rank: u32,
    layout: &ParallelLayout,
    buffers: &[DeviceBuffer],
) -> Result<()> {
    let kv = layout.rank_kv()?;
    if buffers.len() != kv.num_layers as usize {
        return Err(Error::Mismatch(format!(
            "rank {rank}: {} layer buffers given, the layout has {} layers (one buffer per layer, \
             in layer order)",
            buffers.len(),
            kv.num_layers
        )));
    }
    let want_dims = kv.dims();
    let want_ty = kv.dtype.element_type();
    for (layer, b) in buffers.iter().enumerate() {
        b.check_live()
            .map_err(|e| e.context(format!("rank {rank} layer {layer}")))?;
        let what = || {
            format!(
                "rank {rank} layer {layer}: buffer {} does not match the layout {} ({})",
                describe(b),
                layout.describe(),
                expected(&kv)
            )
        };
        if b.element_type() != want_ty {
            return Err(Error::Mismatch(format!(
                "{}: element type {}, the layout's KV dtype {} needs {}",
                what(),
                b.element_type().name(),
                kv.dtype.name(),
                want_ty.name()
            )));
        }
        if squeezed(b.dims()) != squeezed(&want_dims) {
            return Err(Error::Mismatch(format!(
                "{}: dims {:?}, expected {:?} ({} blocks of {} tokens, {} heads of {})",
                what(),
                b.dims(),
                want_dims,
                kv.num_blocks,
                kv.block_size,
                kv.num_heads,
                kv.head_dim
            )));
        }
        if b.on_device_size() != kv.buffer_bytes() {
            return Err(Error::Mismatch(format!(
                "{}: {} bytes on device (PJRT_Buffer_OnDeviceSizeInBytes), the layout's byte \
                 offsets assume {} dense bytes (a padded or tiled device layout)",
                what(),
                b.on_device_size(),
                kv.buffer_bytes()
            )));
        }
        if let Some(p) = b.physical_layout() {
            // The RPA v3 orders also take a tiling that keeps each packed row contiguous (the
            // plan then moves whole rows only: ParallelLayout::check_physical_layout).
            let dense = is_dense_row_major(p, b.dims().len());
            let rows_whole = kv.order.is_rpa3() && rows_stay_contiguous(p, b.dims());
            if !dense && rows_whole && layout.physical_layout.is_none() {
                return Err(Error::Mismatch(format!(
                    "{}: physical layout `{p}` is tiled (packed rows contiguous) and the \
                     placement names no physical layout: it must name `{p}`, so that its plans \
                     move whole packed rows only (ParallelLayout::physical_layout)",
                    what()
                )));
            }
            if !dense && !rows_whole {
                return Err(Error::Mismatch(format!(
                    "{}: physical layout `{p}`, the layout's byte offsets assume dense row-major \
                     `{{{}}}`",
                    what(),
                    (0..b.dims().len())
                        .rev()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                )));
            }
            if let Some(named) = &layout.physical_layout {
                if named != p {
                    return Err(Error::Mismatch(format!(
                        "{}: physical layout `{p}`, the placement names `{named}`",
                        what()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Checks the per-cache-layer buffers of global rank `rank` against a grouped layout: one
/// buffer per cache layer (`0..layout.num_layers()`, in order), each live and of the shape its
/// own group gives it ([`HybridLayout::layer_shape`]: element type, dims with leading 1s
/// ignored, `PJRT_Buffer_OnDeviceSizeInBytes` equal to the dense bytes), with a dense row-major
/// physical layout (when the plugin reports one) equal to the group's
/// [`GroupLayout::physical_layout`](crate::layout::GroupLayout) when the layout names one (an
/// RPA v3 group also takes a named tiling that keeps packed rows contiguous). So
/// layers of different groups may have buffers of different sizes and shapes; each is checked
/// against its own group's geometry, never another's.
///
/// Errors: [`Error::Mismatch`] naming the rank, the layer, its group, the buffer and what was
/// expected; [`Error::Layout`] for a layout with a zero field; [`Error::InvalidArgument`] for a
/// deleted buffer.
pub fn check_group_buffers(
    rank: u32,
    layout: &HybridLayout,
    buffers: &[DeviceBuffer],
) -> Result<()> {
    layout.check_nonzero()?;
    let n = layout.num_layers();
    if buffers.len() != n as usize {
        return Err(Error::Mismatch(format!(
            "rank {rank}: {} layer buffers given, the model `{}` has {n} cache layers in {} KV \
             cache groups (one buffer per cache layer, in layer order)",
            buffers.len(),
            layout.model.name,
            layout.groups.len()
        )));
    }
    for (layer, b) in buffers.iter().enumerate() {
        let layer = layer as u32;
        b.check_live()
            .map_err(|e| e.context(format!("rank {rank} layer {layer}")))?;
        let g = layout.model.group_of_layer(layer).unwrap_or_default();
        let shape = layout.layer_shape(layer)?;
        let what = || {
            format!(
                "rank {rank} layer {layer} (KV cache group {}, {}): buffer {} does not match the \
                 group's {}{:?}, {} dense bytes, row-major",
                layout.model.group_name(g),
                layout.model.groups[g].kind.name(),
                describe(b),
                shape.element_type.name(),
                shape.dims,
                shape.bytes
            )
        };
        if b.element_type() != shape.element_type {
            return Err(Error::Mismatch(format!(
                "{}: element type {}",
                what(),
                b.element_type().name()
            )));
        }
        if squeezed(b.dims()) != squeezed(&shape.dims) {
            return Err(Error::Mismatch(format!("{}: dims {:?}", what(), b.dims())));
        }
        if b.on_device_size() != shape.bytes {
            return Err(Error::Mismatch(format!(
                "{}: {} bytes on device (PJRT_Buffer_OnDeviceSizeInBytes; a padded or tiled \
                 device layout)",
                what(),
                b.on_device_size()
            )));
        }
        if let Some(p) = b.physical_layout() {
            // As check_rank_buffers: an RPA v3 group also takes a tiling that keeps each packed
            // row contiguous, when the group names it (its plans move whole rows only).
            let named = layout.groups[g].physical_layout.as_deref();
            let rpa3 = layout.group_as_parallel(g).spec.order.is_rpa3();
            let rows_whole = rpa3 && named == Some(p) && rows_stay_contiguous(p, b.dims());
            if !is_dense_row_major(p, b.dims().len()) && !rows_whole {
                return Err(Error::Mismatch(format!(
                    "{}: physical layout `{p}` is not dense row-major{}",
                    what(),
                    if rpa3 && rows_stay_contiguous(p, b.dims()) {
                        " (a tiling that keeps packed rows contiguous is taken when the group's \
                         layout names it)"
                    } else {
                        ""
                    }
                )));
            }
            if let Some(named) = &layout.groups[g].physical_layout {
                if named != p {
                    return Err(Error::Mismatch(format!(
                        "{}: physical layout `{p}`, the placement names `{named}`",
                        what()
                    )));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_row_major_layouts() {
        assert!(is_dense_row_major("{4,3,2,1,0}", 5));
        assert!(is_dense_row_major(" {3, 2, 1, 0} ", 4));
        assert!(is_dense_row_major("{0}", 1));
        assert!(is_dense_row_major("{}", 0));
        assert!(!is_dense_row_major("{0,1}", 2), "column-major");
        assert!(!is_dense_row_major("{1,0:T(8,128)(2,1)}", 2), "tiled");
        assert!(!is_dense_row_major("{2,1,0}", 4), "rank differs");
        assert!(!is_dense_row_major("4,3,2,1,0", 5));
        assert!(!is_dense_row_major("{x}", 1));
    }

    #[test]
    fn xla_layouts_and_rows_that_stay_contiguous() {
        let l = XlaLayout::parse("{4,3,2,1,0:T(4,128)(4,1)}").unwrap();
        assert_eq!(l.minor_to_major, vec![4, 3, 2, 1, 0]);
        assert_eq!(l.tiles, vec![vec![4, 128], vec![4, 1]]);
        assert_eq!(
            XlaLayout::parse("{1,0}").unwrap().tiles,
            Vec::<Vec<u64>>::new()
        );
        for bad in [
            "{1,0:T()}",
            "{1,0:T(8,128",
            "{1,0:E(4)}",
            "{1,0:T(8,*)}",
            "{1,0:T(0,1)}",
            "1,0",
        ] {
            assert!(XlaLayout::parse(bad).is_none(), "{bad}");
        }
        let fp8 = [16, 16, 4, 4, 256];
        assert!(rows_stay_contiguous("{4,3,2,1,0:T(4,128)(4,1)}", &fp8));
        assert!(rows_stay_contiguous("{4,3,2,1,0}", &fp8), "dense");
        assert!(rows_stay_contiguous(
            "{4,3,2,1,0:T(2,128)(2,1)}",
            &[8, 16, 2, 2, 128]
        ));
        assert!(
            rows_stay_contiguous("{4,3,2,1,0:T(128)}", &fp8),
            "one lane tile"
        );
        let refused: [(&str, &[i64], &str); 6] = [
            ("{4,3,2,1,0:T(8,128)(2,1)}", &[8, 16, 2, 2, 128], "P padded"),
            ("{4,3,2,1,0:T(4,96)}", &fp8, "lanes padded"),
            ("{4,3,2,1,0:T(2,4,128)}", &fp8, "across rows"),
            ("{3,4,2,1,0:T(4,128)}", &fp8, "not row-major"),
            ("{4,3,2,1,0:T(4,128)(8,1)}", &fp8, "sub-tile too tall"),
            ("{4,3,2,1,0:T(4,128)}", &[16, 16, 4], "rank differs"),
        ];
        for (text, dims, why) in refused {
            assert!(!rows_stay_contiguous(text, dims), "{why}: {text}");
        }
    }

    #[test]
    fn leading_ones_are_ignored() {
        assert_eq!(squeezed(&[1, 6, 2, 16, 64]), &[6, 2, 16, 64]);
        assert_eq!(squeezed(&[2, 6, 1]), &[2, 6, 1]);
        assert_eq!(squeezed(&[1, 1]), &[] as &[i64]);
    }
}
