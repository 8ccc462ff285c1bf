//! KV-cache layouts: a model's KV geometry, how parallel ranks split it, and where each logical
//! element lives in a rank's device buffers.
//!
//! Vocabulary (as in vLLM and XLA):
//! * **layer**: one attention layer; each layer's KV cache is one device buffer per rank.
//! * **plane**: K or V (2 planes), or the single latent plane of MLA models (1 plane).
//! * **block / page**: `block_size` consecutive tokens of one request; the unit of allocation.
//! * **TP** splits KV heads across ranks (heads are replicated when TP > num_kv_heads, as for MLA);
//!   **PCP** (prefill context parallel) splits a request's tokens into contiguous block chunks;
//!   **DP** ranks are independent replicas: a request lives on one DP rank.
//!
//! A rank's buffer for one layer has shape `[planes, num_blocks, block_size, heads, head_dim]`
//! (order [`BlockOrder::Nhd`], vLLM's default flash-attention layout) or
//! `[planes, num_blocks, heads, block_size, head_dim]` ([`BlockOrder::Hnd`]), dense row-major,
//! of the model's dtype. Offsets in this module are bytes into that buffer.
//!
//! A third order, [`BlockOrder::Lbhnc`], is vLLM's per-layer `[num_blocks, heads, block_size,
//! planes * head_dim]` cache (its `LBHNC` layout, the only one of its CPU attention backend)
//! whose `(block, head)` interior is packed by the attention kernel: the bytes of one
//! `(block, head)` are an opaque region, moved whole and never split by token or plane.
//!
//! Two more orders are the TPU engines' caches (vLLM-TorchTPU, tpu-inference), written by the
//! ragged paged attention v3 kernels: [`BlockOrder::Rpa3`], per layer `[num_blocks, block_size,
//! R, P, D']` with K and V interleaved per head and packed `P` to a 32-bit word, and
//! [`BlockOrder::Rpa3Hd64`], the head_dim-64 kernel's `[num_blocks, block_size, R, P, 128]` with K
//! and V side by side in the 128 lanes. Both are padded (heads to a multiple of `P`, head_dim to
//! 128 lanes); padding is never moved and stays zero. See [`KvLayout::packing`] for the sources.
//! A sixth, [`BlockOrder::RpaMla`], is tpu-inference's MLA latent cache (one plane, one head
//! replicated over TP): per layer `[num_blocks, block_size, D']`, each token's latent and rope in
//! the first `head_dim` of its `D'` = 128-aligned lanes.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::pjrt::ElementType;

pub mod groups;
pub use groups::{
    BufferShape, GroupKind, GroupLayout, GroupRankKv, HeadSplit, HybridLayout, HybridModel,
    KvGroup, StateComponent, StateSegment, HYBRID_PRESETS,
};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// bfloat16 (2 bytes).
    Bf16,
    /// float16 (2 bytes).
    F16,
    /// float32 (4 bytes).
    F32,
    /// float8 e4m3fn (1 byte).
    Fp8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::Fp8 => 1,
        }
    }

    /// The PJRT element type of device buffers holding this dtype.
    pub fn element_type(self) -> ElementType {
        match self {
            DType::Bf16 => ElementType::BF16,
            DType::F16 => ElementType::F16,
            DType::F32 => ElementType::F32,
            DType::Fp8 => ElementType::F8E4M3FN,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::Fp8 => "fp8",
        }
    }
}

/// Order of tokens and heads inside one block of one plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockOrder {
    /// Token-major: `[block_size, heads, head_dim]`.
    Nhd,
    /// Head-major: `[heads, block_size, head_dim]`.
    Hnd,
    /// vLLM's `LBHNC` per-layer cache: `[num_blocks, heads, opaque region]`, the region of one
    /// `(block, head)` holding all planes (K and V) of `block_size` tokens of one head,
    /// `planes * block_size * head_dim` elements packed in a kernel- and dtype-specific order
    /// (vLLM's CPU backend: fp32 stores K transposed `[head_dim, block_size]` then V; AMX bf16
    /// uses VNNI tiles; `docs/plugins-and-engines.md`, "vLLM CPU backend: block interior").
    /// Plans move whole regions:
    /// whole blocks, or head slices of blocks when TP differs. Both sides must use this order,
    /// the same block size and the same [`ParallelLayout::block_format`] tag.
    Lbhnc,
    /// The TPU engines' ragged paged attention v3 cache, per layer `[num_blocks, block_size, R,
    /// P, D']`: `P` = 32 / element bits ([`KvLayout::packing`]), `D'` = head_dim rounded up to
    /// 128 lanes, `R` = `ceil(2 * heads / P)`. Row `j = 2 * head + plane` (K = plane 0, V = 1) of
    /// a token sits at `r = j / P`, `p = j % P`; slots `j >= 2 * heads` and lanes `d >= head_dim`
    /// are zero padding. Source: `PallasAttentionBackend.get_kv_cache_shape`
    /// (`vllm_torchtpu/layers/adapter/attention.py`, vllm-torchtpu-core 0.29.0) and `merge_kv`
    /// (`kernels/ragged_paged_attention/v3/kernel.py`, the same in tpu-inference 0.32.0);
    /// `docs/tpu.md`. Needs two planes.
    Rpa3,
    /// The ragged paged attention v3 head_dim-64 kernel's cache, per layer `[num_blocks,
    /// block_size, R, P, 128]` with `R` = `ceil(heads / P)`: head `h` at `r = h / P`, `p = h %
    /// P`, K in lanes 0..64 and V in lanes 64..128; slots `h >= heads` are zero padding. Source:
    /// `kernels/ragged_paged_attention/v3/kernel_hd64.py` (`get_kv_cache_shape`, `merge_kv`) of
    /// vllm-torchtpu-core 0.29.0 and tpu-inference 0.32.0. Needs two planes and head_dim 64.
    Rpa3Hd64,
    /// tpu-inference's MLA ragged paged attention cache (`kernels/mla/v2/kernel.py`
    /// `get_kv_cache_shape`, tpu-inference 0.32.0): per layer `[num_blocks, block_size / K, K,
    /// D']` (`K` = `MLA_KV_PACKING_SIZE` tokens per packed row, 32 by default; tokens in order),
    /// i.e. token-major `[num_blocks, block_size, D']` with `D'` = head_dim rounded up to 128. The
    /// kernel pads the latent (`kv_lora_rank`) and the rope part to 128 lanes each; where the
    /// latent is a multiple of 128 (DeepSeek-V2/V3 and Kimi-K2: 512 + 64 = 576 in 640 lanes) the
    /// real elements are the first `head_dim` lanes of each token and the rest is zero padding,
    /// never moved. Needs one plane (MLA); `block_size` must be a multiple of `K` (no padded
    /// tokens). Sharded `P(data, kv_context)`: replicated over TP like every MLA cache here.
    RpaMla,
}

impl BlockOrder {
    /// `nhd`, `hnd`, `lbhnc`, `rpa3`, `rpa3hd64` or `rpamla` (also the JSON and layout-spec
    /// names).
    pub fn name(self) -> &'static str {
        match self {
            BlockOrder::Nhd => "nhd",
            BlockOrder::Hnd => "hnd",
            BlockOrder::Lbhnc => "lbhnc",
            BlockOrder::Rpa3 => "rpa3",
            BlockOrder::Rpa3Hd64 => "rpa3hd64",
            BlockOrder::RpaMla => "rpamla",
        }
    }

    /// Every order, in declaration order.
    pub const ALL: [BlockOrder; 6] = [
        BlockOrder::Nhd,
        BlockOrder::Hnd,
        BlockOrder::Lbhnc,
        BlockOrder::Rpa3,
        BlockOrder::Rpa3Hd64,
        BlockOrder::RpaMla,
    ];

    /// The order named `name` (case-insensitive), as [`BlockOrder::name`] spells it.
    ///
    /// Errors: [`Error::Layout`] listing the known names.
    pub fn parse(name: &str) -> Result<BlockOrder> {
        let n = name.trim().to_ascii_lowercase();
        BlockOrder::ALL
            .into_iter()
            .find(|o| o.name() == n)
            .ok_or_else(|| {
                Error::Layout(format!(
                    "unknown block order `{name}` (known: nhd, hnd, lbhnc (vLLM CPU's opaque \
                     blocks), rpa3 and rpa3hd64 (the TPU engines' ragged paged attention v3 \
                     caches), rpamla (tpu-inference's MLA cache))"
                ))
            })
    }

    /// Whether the block interior is opaque (moved in whole `(block, head)` regions).
    pub fn is_opaque(self) -> bool {
        self == BlockOrder::Lbhnc
    }

    /// Whether the planes (K and V) of a block are interleaved inside it, so that a block's bytes
    /// are one contiguous range of the layer buffer (LBHNC and the RPA v3 orders) rather than
    /// one range per plane (NHD, HND). [`KvLayout::block_offset`] then names the `p`-th
    /// [`KvLayout::block_bytes`] slice of the block as plane `p`.
    pub fn planes_within_block(self) -> bool {
        matches!(
            self,
            BlockOrder::Lbhnc | BlockOrder::Rpa3 | BlockOrder::Rpa3Hd64
        )
    }

    /// Whether this is one of the TPU engines' ragged paged attention v3 orders (padded).
    pub fn is_rpa3(self) -> bool {
        matches!(self, BlockOrder::Rpa3 | BlockOrder::Rpa3Hd64)
    }

    /// Whether this is one of the TPU engines' padded caches (the RPA v3 orders and
    /// [`BlockOrder::RpaMla`]): padding that is never moved and stays zero
    /// ([`KvLayout::token_padding`]), rows addressed in a dense row-major buffer only.
    pub fn is_tpu(self) -> bool {
        matches!(
            self,
            BlockOrder::Rpa3 | BlockOrder::Rpa3Hd64 | BlockOrder::RpaMla
        )
    }
}

/// A model's KV-cache geometry, independent of parallelism.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelKv {
    /// Model name (informational; not part of compatibility).
    pub name: String,
    /// Number of attention layers.
    pub num_layers: u32,
    /// Number of KV heads in the whole model (1 for MLA's latent).
    pub num_kv_heads: u32,
    /// Elements per head (576 = 512 + 64 for DeepSeek-V3's MLA latent + rope).
    pub head_dim: u32,
    /// 2 for separate K and V planes, 1 for MLA (one latent plane).
    pub kv_planes: u32,
    /// KV cache element type.
    pub dtype: DType,
}

/// Most ranks (TP x PCP x DP) a parallel layout may have.
pub const MAX_RANKS: u32 = 4096;

/// Preset names accepted by [`ModelKv::preset`].
pub const PRESETS: &[&str] = &[
    "llama-3.1-8b",
    "qwen3-32b",
    "llama-3.1-70b",
    "deepseek-v3",
    "llama-3.2-1b",
];

impl ModelKv {
    /// Geometry of a published model, bf16 KV.
    ///
    /// Sources (Hugging Face `config.json` of each model): Llama-3.1-8B `num_hidden_layers` 32,
    /// `num_key_value_heads` 8, head_dim 128 (4096/32); Qwen3-32B 64 layers, 8 KV heads,
    /// `head_dim` 128; Llama-3.1-70B 80 layers, 8 KV heads, head_dim 128 (8192/64); DeepSeek-V3
    /// 61 layers, MLA with `kv_lora_rank` 512 + `qk_rope_head_dim` 64 = one 576-wide latent per
    /// token, replicated over TP; Llama-3.2-1B 16 layers, 8 KV heads, head_dim 64 (2048/32: the
    /// TPU kernels' head_dim-64 case).
    pub fn preset(name: &str) -> Result<ModelKv> {
        let (layers, heads, dim, planes) = match name {
            "llama-3.1-8b" => (32, 8, 128, 2),
            "qwen3-32b" => (64, 8, 128, 2),
            "llama-3.1-70b" => (80, 8, 128, 2),
            "deepseek-v3" => (61, 1, 576, 1),
            "llama-3.2-1b" => (16, 8, 64, 2),
            _ => {
                return Err(Error::Layout(format!(
                    "unknown model preset `{name}` (known: {})",
                    PRESETS.join(", ")
                )))
            }
        };
        Ok(ModelKv {
            name: name.to_string(),
            num_layers: layers,
            num_kv_heads: heads,
            head_dim: dim,
            kv_planes: planes,
            dtype: DType::Bf16,
        })
    }

    /// Whether this is an MLA model (one latent plane, replicated across TP).
    pub fn is_mla(&self) -> bool {
        self.kv_planes == 1
    }

    /// KV bytes per token for the whole model (all layers, planes and heads).
    pub fn bytes_per_token(&self) -> u64 {
        self.num_layers as u64
            * self.kv_planes as u64
            * self.num_kv_heads as u64
            * self.head_dim as u64
            * self.dtype.size()
    }

    /// Checks field ranges.
    pub fn validate(&self) -> Result<()> {
        if self.num_layers == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return Err(Error::Layout(format!(
                "model `{}`: layers ({}), kv heads ({}) and head_dim ({}) must all be > 0",
                self.name, self.num_layers, self.num_kv_heads, self.head_dim
            )));
        }
        if self.kv_planes != 1 && self.kv_planes != 2 {
            return Err(Error::Layout(format!(
                "model `{}`: kv_planes must be 1 (MLA) or 2 (K and V), got {}",
                self.name, self.kv_planes
            )));
        }
        Ok(())
    }

    /// Errors with [`Error::Mismatch`] unless both describe the same KV geometry (layers, heads,
    /// head_dim, planes, dtype); the names may differ.
    pub fn check_compatible(&self, other: &ModelKv) -> Result<()> {
        let a = (
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.kv_planes,
            self.dtype,
        );
        let b = (
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
            other.kv_planes,
            other.dtype,
        );
        if a != b {
            return Err(Error::Mismatch(format!(
                "KV geometry differs: `{}` has layers={} kv_heads={} head_dim={} planes={} dtype={}, \
                 `{}` has layers={} kv_heads={} head_dim={} planes={} dtype={}",
                self.name, a.0, a.1, a.2, a.3, a.4.name(), other.name, b.0, b.1, b.2, b.3, b.4.name()
            )));
        }
        Ok(())
    }
}

/// How one serving instance splits the KV cache: the `--prefill`/`--decode` SPEC of the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    /// Tensor parallelism (splits KV heads).
    pub tp: u32,
    /// Prefill context parallelism (splits tokens in contiguous block chunks).
    pub pcp: u32,
    /// Data parallelism (independent replicas).
    pub dp: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Block-internal order.
    pub order: BlockOrder,
}

impl Default for ParallelSpec {
    fn default() -> Self {
        ParallelSpec {
            tp: 1,
            pcp: 1,
            dp: 1,
            block_size: 16,
            order: BlockOrder::Nhd,
        }
    }
}

impl std::fmt::Display for ParallelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TP={} x PCP={} x DP={}, block={}, {}",
            self.tp,
            self.pcp,
            self.dp,
            self.block_size,
            self.order.name().to_uppercase()
        )
    }
}

impl ParallelSpec {
    /// Parses `key=value` pairs separated by commas among `tp`, `pcp`, `dp`, `block`, `order`
    /// (`nhd`|`hnd`|`lbhnc`|`rpa3`|`rpa3hd64`); missing keys keep the values of `base`.
    ///
    /// Example: `tp=2,pcp=2,block=64,order=nhd`.
    pub fn parse_with(spec: &str, base: ParallelSpec) -> Result<ParallelSpec> {
        let mut out = base;
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::Layout(format!("`{part}` in layout spec `{spec}` is not key=value"))
            })?;
            let num = |v: &str| -> Result<u32> {
                v.trim().parse::<u32>().map_err(|_| {
                    Error::Layout(format!("`{k}={v}` in layout spec `{spec}`: not a number"))
                })
            };
            match k.trim() {
                "tp" => out.tp = num(v)?,
                "pcp" => out.pcp = num(v)?,
                "dp" => out.dp = num(v)?,
                "block" => out.block_size = num(v)?,
                "order" => {
                    out.order = BlockOrder::parse(v).map_err(|e| {
                        Error::Layout(format!("in layout spec `{spec}`: {}", e.detail()))
                    })?
                }
                other => {
                    return Err(Error::Layout(format!(
                        "unknown key `{other}` in layout spec `{spec}` (keys: tp, pcp, dp, block, order)"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Parses a spec with defaults TP=PCP=DP=1, block 16, NHD.
    pub fn parse(spec: &str) -> Result<ParallelSpec> {
        Self::parse_with(spec, ParallelSpec::default())
    }

    /// Number of ranks: `dp * pcp * tp`.
    pub fn num_ranks(&self) -> u32 {
        // Saturating: a spec not yet validated (at most MAX_RANKS ranks) never wraps around.
        self.dp.saturating_mul(self.pcp).saturating_mul(self.tp)
    }

    /// Ranks per DP replica: `pcp * tp`.
    pub fn ranks_per_replica(&self) -> u32 {
        self.pcp.saturating_mul(self.tp)
    }
}

/// Coordinates of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankCoord {
    /// DP replica.
    pub dp: u32,
    /// PCP rank within the replica.
    pub pcp: u32,
    /// TP rank within the PCP group.
    pub tp: u32,
}

/// A model's KV cache split over the ranks of one serving instance.
///
/// Ranks are numbered `rank = (dp * pcp_size + pcp) * tp_size + tp`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelLayout {
    /// The model's KV geometry.
    pub model: ModelKv,
    /// How the instance splits it.
    pub spec: ParallelSpec,
    /// KV blocks allocated per rank (capacity of each rank's buffers).
    pub num_blocks: u32,
    /// Physical (on-device) memory layout of the rank buffers, as the PJRT plugin reports it
    /// ([`DeviceBuffer::physical_layout`](crate::pjrt::DeviceBuffer::physical_layout)): e.g.
    /// `{4,3,2,1,0}` for the dense row-major layout this module's offsets assume, or a tiled
    /// TPU layout. Raw KV bytes are only meaningful between equal physical layouts, so
    /// [`Plan::build`](crate::plan::Plan::build) refuses two known, different ones. `None` =
    /// unknown (not checked); absent in JSON from peers that predate the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_layout: Option<String>,
    /// What packs the bytes inside a block: the engine, attention kernel and cache dtype that
    /// wrote them, e.g. `vllm-cpu/vec/float32` (an opaque tag compared for equality). Required
    /// on both sides, and equal, for [`BlockOrder::Lbhnc`]; for the other orders compared only
    /// when both sides know it. `None` = unknown; absent in JSON from peers that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_format: Option<String>,
}

impl ParallelLayout {
    /// Builds and validates a layout (physical layout unknown).
    pub fn new(model: ModelKv, spec: ParallelSpec, num_blocks: u32) -> Result<ParallelLayout> {
        let l = ParallelLayout {
            model,
            spec,
            num_blocks,
            physical_layout: None,
            block_format: None,
        };
        l.validate()?;
        Ok(l)
    }

    /// The same layout with its physical layout recorded.
    pub fn with_physical_layout(mut self, physical: impl Into<String>) -> ParallelLayout {
        self.physical_layout = Some(physical.into());
        self
    }

    /// The same layout with its block format tag recorded (see [`ParallelLayout::block_format`]).
    pub fn with_block_format(mut self, format: impl Into<String>) -> ParallelLayout {
        self.block_format = Some(format.into());
        self
    }

    /// Errors with [`Error::Mismatch`] unless raw blocks of `self` can be copied into `other`
    /// without knowing their interior: for [`BlockOrder::Lbhnc`] on either side, both sides must
    /// use it with the same block size and the same, known [`ParallelLayout::block_format`]
    /// (fail closed: an unknown tag is refused); for the other orders, two known block format
    /// tags must be equal.
    pub fn check_block_format(&self, other: &ParallelLayout) -> Result<()> {
        let (a, b) = (self.spec.order, other.spec.order);
        if a.is_opaque() || b.is_opaque() {
            if a != b {
                return Err(Error::Mismatch(format!(
                    "block orders {} and {} differ and {} blocks are opaque (packed by the \
                     attention kernel), so they cannot be converted",
                    a.name(),
                    b.name(),
                    BlockOrder::Lbhnc.name()
                )));
            }
            if self.spec.block_size != other.spec.block_size {
                return Err(Error::Mismatch(format!(
                    "block sizes differ ({} vs {} tokens) and lbhnc blocks are opaque: both \
                     sides must use the same block size",
                    self.spec.block_size, other.spec.block_size
                )));
            }
            return match (&self.block_format, &other.block_format) {
                (Some(x), Some(y)) if x == y => Ok(()),
                (Some(x), Some(y)) => Err(Error::Mismatch(format!(
                    "block formats differ: `{x}` vs `{y}` (cache dtype or attention kernel); \
                     opaque blocks can only be copied between identical formats"
                ))),
                (x, y) => Err(Error::Mismatch(format!(
                    "lbhnc blocks need a known block format on both sides (got {x:?} and \
                     {y:?})"
                ))),
            };
        }
        match (&self.block_format, &other.block_format) {
            (Some(x), Some(y)) if x != y => Err(Error::Mismatch(format!(
                "block formats differ: `{x}` vs `{y}`"
            ))),
            _ => Ok(()),
        }
    }

    /// Tokens whose KV the request's blocks carry: `num_tokens`, rounded up to whole blocks for
    /// [`BlockOrder::Lbhnc`] (whose last block moves whole, tail included).
    ///
    /// Errors: [`Error::Layout`] for a zero block size (or another zero field).
    pub fn covered_tokens(&self, num_tokens: u32) -> Result<u32> {
        if self.spec.order.is_opaque() {
            Ok(self
                .request_blocks(num_tokens)?
                .saturating_mul(self.spec.block_size))
        } else {
            self.check_nonzero()?;
            Ok(num_tokens)
        }
    }

    /// Errors with [`Error::Mismatch`] naming both layouts when both sides' physical layouts are
    /// known and differ (raw bytes copied between them would be garbage: TPU layouts are tiled).
    ///
    /// Plans compute byte offsets in a dense row-major buffer, so a known layout that is not
    /// dense (any order, any rank) is refused naming it, with one exception: for the RPA v3
    /// orders a tiling that keeps each packed row (the `P x D'` elements of a `(block, token,
    /// r)`) contiguous ([`crate::transfer::rows_stay_contiguous`]: a TPU's fp8
    /// `{4,3,2,1,0:T(4,128)(4,1)}`), when both sides are RPA v3 and name that same layout (a
    /// tiled side against an unknown one, or another order, is refused); the plan must then
    /// move whole packed rows ([`Plan::build`](crate::plan::Plan::build) refuses one that cuts
    /// a row: lane padding, `head_dim < D'`, or a TP split inside a packed row).
    pub fn check_physical_layout(&self, other: &ParallelLayout) -> Result<()> {
        if let (Some(a), Some(b)) = (&self.physical_layout, &other.physical_layout) {
            if a != b {
                return Err(Error::Mismatch(format!(
                    "physical KV buffer layouts differ: `{a}` ({}) vs `{b}` ({}); raw KV bytes \
                     can only be copied between identical device layouts",
                    self.describe(),
                    other.describe()
                )));
            }
        }
        for (l, o) in [(self, other), (other, self)] {
            let Some(p) = &l.physical_layout else {
                continue;
            };
            // Dense row-major of the buffer's rank: 5 for RPA v3; tpu-inference's MLA arrays
            // are `[N, BS / K, K, D']` (4), viewed as `[N, BS, D']` (3), and tpu-sync's own
            // shape of them is `[1, 1, N, BS, D']` (5, `KvLayout::dims`: the demos' buffers);
            // the other orders' buffers come with or without leading 1s (any rank).
            let ranks: &[usize] = match l.spec.order {
                BlockOrder::RpaMla => &[5, 4, 3],
                o if o.is_rpa3() => &[5],
                _ => &[],
            };
            if crate::transfer::XlaLayout::parse(p).is_some_and(|x| {
                x.is_dense() && (ranks.is_empty() || ranks.contains(&x.minor_to_major.len()))
            }) {
                continue;
            }
            // Not dense: only an RPA v3 tiling that keeps packed rows contiguous, named by
            // both sides, both RPA v3 (the plan then moves whole rows only: check_tiled_rows).
            let rows = l.spec.order.is_rpa3()
                && crate::transfer::rows_stay_contiguous(p, &l.rank_kv()?.dims());
            if rows && o.spec.order.is_rpa3() && o.physical_layout.as_deref() == Some(p.as_str()) {
                continue;
            }
            return Err(Error::Mismatch(if rows {
                format!(
                    "physical layout `{p}` of the {} buffers ({}) is tiled and the other side \
                     ({}, physical layout {}) is not the same RPA v3 tiling: whole packed rows \
                     are copied raw, which is exact only between RPA v3 buffers of the same \
                     tiled layout",
                    l.spec.order.name(),
                    l.describe(),
                    o.spec.order.name(),
                    o.physical_layout
                        .as_deref()
                        .map_or("unknown".to_string(), |x| format!("`{x}`"))
                )
            } else {
                format!(
                    "physical layout `{p}` of the {} buffers ({}): tpu-sync plans byte offsets \
                     in the dense row-major layout, and for the RPA v3 orders also in a tiling \
                     of the last two dimensions that divides them (each packed row one run); \
                     this layout is neither (docs/tpu.md)",
                    l.spec.order.name(),
                    l.describe()
                )
            }));
        }
        Ok(())
    }

    /// Bytes of one packed row (`P x D'` elements, a `(block, token, r)` of the RPA v3 orders)
    /// when this layout names a tiled physical layout that keeps such rows contiguous (the
    /// unit a plan must move whole, [`ParallelLayout::check_physical_layout`]); `None` for the
    /// dense or an unknown layout and the other orders.
    pub fn tiled_row_bytes(&self) -> Option<u64> {
        let p = self.physical_layout.as_deref()?;
        if !self.spec.order.is_rpa3() || crate::transfer::is_dense_row_major(p, 5) {
            return None;
        }
        let kv = self.rank_kv().ok()?;
        Some(kv.packing() as u64 * kv.padded_head_dim() as u64 * kv.dtype.size())
    }

    /// Checks that the split is possible: sizes > 0, TP divides the KV heads or the heads divide
    /// TP (replication), and buffers fit in an `i64` byte size.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let s = &self.spec;
        if s.tp == 0 || s.pcp == 0 || s.dp == 0 || s.block_size == 0 {
            return Err(Error::Layout(format!(
                "tp ({}), pcp ({}), dp ({}) and block ({}) must all be > 0",
                s.tp, s.pcp, s.dp, s.block_size
            )));
        }
        // In u64: TP x PCP x DP of three u32 values from a peer or a config must not wrap into
        // a small count (found by the layout_validate fuzz target).
        let ranks = u64::from(s.tp) * u64::from(s.pcp) * u64::from(s.dp);
        if ranks > MAX_RANKS as u64 {
            return Err(Error::Layout(format!(
                "TP={} x PCP={} x DP={} is {ranks} ranks, more than {MAX_RANKS}",
                s.tp, s.pcp, s.dp
            )));
        }
        let h = self.model.num_kv_heads;
        if !(h % s.tp == 0 || s.tp % h == 0) {
            return Err(Error::Layout(format!(
                "{} KV heads cannot be split over TP={}: TP must divide the head count or be a \
                 multiple of it (replication)",
                h, s.tp
            )));
        }
        if self.num_blocks == 0 {
            return Err(Error::Layout("num_blocks must be > 0".into()));
        }
        check_order_fits(s.order, &self.model)?;
        let kv = self.rank_kv()?;
        // In u128 first: the padded RPA v3 sizes of a peer's u32 fields must not wrap.
        if kv.buffer_bytes_wide() > (i64::MAX / 2) as u128 {
            return Err(Error::Layout(format!(
                "per-layer buffer of {} bytes is too large",
                kv.buffer_bytes_wide()
            )));
        }
        let bytes = kv.buffer_bytes();
        if bytes > i64::MAX as u64 / 2 {
            return Err(Error::Layout(format!(
                "per-layer buffer of {bytes} bytes is too large"
            )));
        }
        Ok(())
    }

    /// Number of ranks (`dp * pcp * tp`).
    pub fn num_ranks(&self) -> u32 {
        self.spec.num_ranks()
    }

    /// Errors with [`Error::Layout`] when a field this type divides by is zero (TP, PCP, DP,
    /// block size, KV heads). Every geometry function below checks it first, so a layout that
    /// was never [validated](ParallelLayout::validate) gets an error, never a division by zero.
    pub fn check_nonzero(&self) -> Result<()> {
        let s = &self.spec;
        if s.tp == 0 || s.pcp == 0 || s.dp == 0 || s.block_size == 0 || self.model.num_kv_heads == 0
        {
            return Err(Error::Layout(format!(
                "tp ({}), pcp ({}), dp ({}), block ({}) and KV heads ({}) must all be > 0",
                s.tp, s.pcp, s.dp, s.block_size, self.model.num_kv_heads
            )));
        }
        Ok(())
    }

    /// Coordinates of `rank`.
    ///
    /// Errors: [`Error::Layout`] for a zero TP or PCP ([`ParallelLayout::check_nonzero`]).
    pub fn coord(&self, rank: u32) -> Result<RankCoord> {
        self.check_nonzero()?;
        let tp = rank % self.spec.tp;
        let pcp = (rank / self.spec.tp) % self.spec.pcp;
        let dp = rank / self.spec.tp.saturating_mul(self.spec.pcp);
        Ok(RankCoord { dp, pcp, tp })
    }

    /// Global rank of coordinates.
    pub fn rank(&self, c: RankCoord) -> u32 {
        (c.dp * self.spec.pcp + c.pcp) * self.spec.tp + c.tp
    }

    /// KV heads held by each rank (1 when heads are replicated).
    ///
    /// Errors: [`Error::Layout`] for a zero TP or head count.
    pub fn heads_per_rank(&self) -> Result<u32> {
        self.check_nonzero()?;
        Ok((self.model.num_kv_heads / self.spec.tp).max(1))
    }

    /// How many TP ranks hold each head (1 unless TP > num_kv_heads).
    ///
    /// Errors: [`Error::Layout`] for a zero TP or head count.
    pub fn head_replicas(&self) -> Result<u32> {
        self.check_nonzero()?;
        Ok((self.spec.tp / self.model.num_kv_heads).max(1))
    }

    /// Global index of the first KV head held by TP rank `tp`.
    ///
    /// Errors: [`Error::Layout`] for a zero TP or head count.
    pub fn first_head(&self, tp: u32) -> Result<u32> {
        Ok(tp / self.head_replicas()? * self.heads_per_rank()?)
    }

    /// The TP ranks that hold global head `head` (several when replicated).
    ///
    /// Errors: [`Error::Layout`] for a zero TP or head count.
    pub fn tp_ranks_of_head(&self, head: u32) -> Result<std::ops::Range<u32>> {
        let rep = self.head_replicas()?;
        let group = head / self.heads_per_rank()?;
        Ok(group * rep..(group + 1) * rep)
    }

    /// Number of request blocks for `num_tokens` tokens at this layout's block size.
    ///
    /// Errors: [`Error::Layout`] for a zero block size (or another zero field).
    pub fn request_blocks(&self, num_tokens: u32) -> Result<u32> {
        self.check_nonzero()?;
        Ok(num_tokens.div_ceil(self.spec.block_size))
    }

    /// The request blocks (indices into the request's block sequence) held by PCP rank `pcp`:
    /// the blocks are divided into `pcp_size` contiguous chunks of `ceil(n / pcp_size)` blocks
    /// (the last chunks may be shorter or empty).
    ///
    /// Errors: [`Error::Layout`] for a zero PCP or block size.
    pub fn pcp_chunk(&self, num_tokens: u32, pcp: u32) -> Result<std::ops::Range<u32>> {
        let n = self.request_blocks(num_tokens)?;
        let chunk = n.div_ceil(self.spec.pcp);
        let start = pcp.saturating_mul(chunk).min(n);
        let end = pcp.saturating_add(1).saturating_mul(chunk).min(n);
        Ok(start..end)
    }

    /// The PCP rank holding request block `block` (an index into the request's blocks).
    ///
    /// Errors: [`Error::Layout`] for a zero PCP or block size.
    pub fn pcp_of_block(&self, num_tokens: u32, block: u32) -> Result<u32> {
        let n = self.request_blocks(num_tokens)?;
        let chunk = n.div_ceil(self.spec.pcp).max(1);
        Ok(block / chunk)
    }

    /// The per-rank buffer layout (same for every rank).
    ///
    /// Errors: [`Error::Layout`] for a zero TP or head count.
    pub fn rank_kv(&self) -> Result<KvLayout> {
        Ok(KvLayout {
            num_layers: self.model.num_layers,
            kv_planes: self.model.kv_planes,
            num_blocks: self.num_blocks,
            block_size: self.spec.block_size,
            num_heads: self.heads_per_rank()?,
            head_dim: self.model.head_dim,
            dtype: self.model.dtype,
            order: self.spec.order,
        })
    }

    /// A one-line description, e.g. `TP=2 x PCP=2 x DP=1, block=64, NHD`.
    pub fn describe(&self) -> String {
        self.spec.to_string()
    }
}

/// Errors with [`Error::Layout`] unless `order` can hold `model`'s KV: the RPA v3 orders need two
/// planes (K and V; MLA caches have their own TPU layout, [`BlockOrder::RpaMla`], which needs one
/// plane and one head) and [`BlockOrder::Rpa3Hd64`] a head_dim of 64.
pub fn check_order_fits(order: BlockOrder, model: &ModelKv) -> Result<()> {
    if order == BlockOrder::RpaMla && (model.kv_planes != 1 || model.num_kv_heads != 1) {
        return Err(Error::Layout(format!(
            "model `{}`: block order rpamla is tpu-inference's MLA latent cache (one plane, one \
             head); this model has {} plane(s) and {} KV heads",
            model.name, model.kv_planes, model.num_kv_heads
        )));
    }
    if order.is_rpa3() && model.kv_planes != 2 {
        return Err(Error::Layout(format!(
            "model `{}`: block order {} holds K and V planes; an MLA latent cache ({} plane) \
             has another TPU layout (order rpamla: tpu-inference's MLA cache)",
            model.name,
            order.name(),
            model.kv_planes
        )));
    }
    if order == BlockOrder::Rpa3Hd64 && model.head_dim != 64 {
        return Err(Error::Layout(format!(
            "model `{}`: block order rpa3hd64 is the head_dim-64 kernel's cache, but head_dim is \
             {} (use rpa3)",
            model.name, model.head_dim
        )));
    }
    Ok(())
}

/// One rank's KV buffers: one buffer per layer of shape
/// `[kv_planes, num_blocks, block_size, num_heads, head_dim]` (NHD),
/// `[kv_planes, num_blocks, num_heads, block_size, head_dim]` (HND) or
/// `[num_blocks, num_heads, block_size, kv_planes * head_dim]` (LBHNC, opaque `(block, head)`
/// regions of [`KvLayout::region_bytes`]; [`KvLayout::dims`] gives it a leading 1), or
/// `[num_blocks, block_size, R, P, D']` (the RPA v3 orders, padded: [`KvLayout::packing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Layers (= buffers).
    pub num_layers: u32,
    /// Planes per layer (2: K and V; 1: MLA latent).
    pub kv_planes: u32,
    /// Blocks per plane.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads held by this rank.
    pub num_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Element type.
    pub dtype: DType,
    /// Block-internal order.
    pub order: BlockOrder,
}

impl KvLayout {
    /// Bytes of one head's row of one plane (`head_dim * dtype size`): the real bytes, never
    /// padding.
    pub fn row_bytes(&self) -> u64 {
        self.head_dim as u64 * self.dtype.size()
    }

    /// `P`, the elements packed into one 32-bit word along the RPA v3 caches' fourth dimension:
    /// 32 / element bits (fp32 1, bf16 and f16 2, fp8 4). Source: `get_dtype_packing` (`32 //
    /// bits`) in `kernels/ragged_paged_attention/v3/util.py` of vllm-torchtpu-core 0.29.0 and
    /// tpu-inference 0.32.0. 1 for the other orders (no packing).
    pub fn packing(&self) -> u32 {
        if self.order.is_rpa3() {
            (4 / self.dtype.size()) as u32
        } else {
            1
        }
    }

    /// `D'`: lanes per packed slot, head_dim rounded up to 128 (`TPU_HEAD_SIZE_ALIGNMENT`);
    /// always 128 for [`BlockOrder::Rpa3Hd64`] (K and V side by side). `head_dim` for the other
    /// orders.
    pub fn padded_head_dim(&self) -> u32 {
        match self.order {
            BlockOrder::Rpa3 | BlockOrder::RpaMla => {
                self.head_dim.div_ceil(128).saturating_mul(128)
            }
            BlockOrder::Rpa3Hd64 => 128,
            _ => self.head_dim,
        }
    }

    /// `R`: packed rows per token of the RPA v3 orders, `ceil(2 * heads / P)` ([`BlockOrder::
    /// Rpa3`]) or `ceil(heads / P)` ([`BlockOrder::Rpa3Hd64`]); for the other orders the heads.
    pub fn packed_rows(&self) -> u32 {
        let p = self.packing();
        match self.order {
            BlockOrder::Rpa3 => self.num_heads.saturating_mul(2).div_ceil(p),
            BlockOrder::Rpa3Hd64 => self.num_heads.div_ceil(p),
            _ => self.num_heads,
        }
    }

    /// Bytes of one token of one block in the RPA v3 orders (`R * P * D' * dtype size`, padding
    /// included): the stride between tokens. Each of its `R` packed rows of `P * D'` elements is
    /// what a tiled TPU layout keeps contiguous.
    fn rpa3_token_bytes(&self) -> u64 {
        if self.order == BlockOrder::RpaMla {
            return self.padded_head_dim() as u64 * self.dtype.size();
        }
        self.packed_rows() as u64
            * self.packing() as u64
            * self.padded_head_dim() as u64
            * self.dtype.size()
    }

    /// Bytes of one block of one plane. For the orders whose planes are interleaved inside a
    /// block ([`BlockOrder::planes_within_block`]) a block is `kv_planes * block_bytes()`
    /// contiguous bytes (RPA v3: padding included, `block_size * R * P * D' * size / 2`).
    pub fn block_bytes(&self) -> u64 {
        if self.order.is_tpu() {
            return self.block_size as u64 * self.rpa3_token_bytes() / self.kv_planes.max(1) as u64;
        }
        self.block_size as u64 * self.num_heads as u64 * self.row_bytes()
    }

    /// [`KvLayout::buffer_bytes`] in `u128`, without wrapping (for validating a peer's fields).
    pub fn buffer_bytes_wide(&self) -> u128 {
        let token = if self.order == BlockOrder::RpaMla {
            (self.head_dim as u128).div_ceil(128) * 128 * self.dtype.size() as u128
        } else if self.order.is_rpa3() {
            let p = self.packing() as u128;
            let rows = match self.order {
                BlockOrder::Rpa3 => (2 * self.num_heads as u128).div_ceil(p),
                _ => (self.num_heads as u128).div_ceil(p),
            };
            let lanes = match self.order {
                BlockOrder::Rpa3 => (self.head_dim as u128).div_ceil(128) * 128,
                _ => 128,
            };
            rows * p * lanes * self.dtype.size() as u128
        } else {
            self.kv_planes as u128
                * self.num_heads as u128
                * self.head_dim as u128
                * self.dtype.size() as u128
        };
        self.num_blocks as u128 * self.block_size as u128 * token
    }

    /// Byte ranges `(offset, len)` of one token's padding inside its block, relative to the
    /// token's first byte, in the TPU orders (empty for the others, which have none): the
    /// unused slots `j >= 2 * heads` (`>= heads` for head_dim 64) and the lanes `d >= head_dim`
    /// of used slots (RPA v3), the lanes `d >= head_dim` ([`BlockOrder::RpaMla`]). Padding is
    /// never moved; a destination's stays as it was (zero).
    pub fn token_padding(&self) -> Vec<(u64, u64)> {
        let es = self.dtype.size();
        let slot = self.padded_head_dim() as u64 * es;
        let slots = self.packed_rows() as u64 * self.packing() as u64;
        let (used, real) = match self.order {
            BlockOrder::Rpa3 => (2 * self.num_heads as u64, self.row_bytes()),
            BlockOrder::Rpa3Hd64 => (self.num_heads as u64, 2 * self.row_bytes()),
            BlockOrder::RpaMla => {
                let real = self.row_bytes();
                return if real < slot {
                    vec![(real, slot - real)]
                } else {
                    Vec::new()
                };
            }
            _ => return Vec::new(),
        };
        let mut v = Vec::new();
        if real < slot {
            for j in 0..used {
                v.push((j * slot + real, slot - real));
            }
        }
        if used < slots {
            v.push((used * slot, (slots - used) * slot));
        }
        v
    }

    /// Byte offset of token `token` of `block` in the TPU orders ([`BlockOrder::is_tpu`]).
    pub fn token_offset(&self, block: u32, token: u32) -> u64 {
        (block as u64 * self.block_size as u64 + token as u64) * self.rpa3_token_bytes()
    }

    /// Bytes of one plane (all blocks).
    pub fn plane_bytes(&self) -> u64 {
        self.num_blocks as u64 * self.block_bytes()
    }

    /// Bytes of one layer's buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.kv_planes as u64 * self.plane_bytes()
    }

    /// Bytes of one `(block, head)` region of an [`BlockOrder::Lbhnc`] buffer: every plane of
    /// `block_size` tokens of one head.
    pub fn region_bytes(&self) -> u64 {
        self.kv_planes as u64 * self.block_size as u64 * self.row_bytes()
    }

    /// Byte offset of the `(block, head)` region of an [`BlockOrder::Lbhnc`] buffer.
    pub fn region_offset(&self, block: u32, head: u32) -> u64 {
        (block as u64 * self.num_heads as u64 + head as u64) * self.region_bytes()
    }

    /// Dimensions of one layer's buffer, in elements (LBHNC: `[1, num_blocks, num_heads,
    /// block_size, kv_planes * head_dim]`, vLLM's per-layer shape with a leading 1; RPA v3:
    /// `[num_blocks, block_size, R, P, D']`; [`BlockOrder::RpaMla`]: `[1, 1, num_blocks,
    /// block_size, D']`, i.e. `[num_blocks, block_size, D']` as leading 1s are ignored).
    pub fn dims(&self) -> [i64; 5] {
        if self.order == BlockOrder::RpaMla {
            return [
                1,
                1,
                self.num_blocks as i64,
                self.block_size as i64,
                self.padded_head_dim() as i64,
            ];
        }
        if self.order.is_rpa3() {
            return [
                self.num_blocks as i64,
                self.block_size as i64,
                self.packed_rows() as i64,
                self.packing() as i64,
                self.padded_head_dim() as i64,
            ];
        }
        let (a, b) = match self.order {
            BlockOrder::Nhd => (self.block_size, self.num_heads),
            BlockOrder::Hnd => (self.num_heads, self.block_size),
            BlockOrder::Lbhnc | BlockOrder::Rpa3 | BlockOrder::Rpa3Hd64 | BlockOrder::RpaMla => {
                return [
                    1,
                    self.num_blocks as i64,
                    self.num_heads as i64,
                    self.block_size as i64,
                    self.kv_planes as i64 * self.head_dim as i64,
                ]
            }
        };
        [
            self.kv_planes as i64,
            self.num_blocks as i64,
            a as i64,
            b as i64,
            self.head_dim as i64,
        ]
    }

    /// Byte offset of the row `(plane, block, token_in_block, head)` (element `dim = 0`).
    ///
    /// For [`BlockOrder::Lbhnc`] the interior of a `(block, head)` region is opaque; this gives
    /// the *nominal* position of the logical `[block, head, token, plane * head_dim]` view
    /// (token-major, planes side by side), which test patterns use. Real kernels pack the
    /// region differently, which is why plans never split it.
    pub fn row_offset(&self, plane: u32, block: u32, token: u32, head: u32) -> u64 {
        let within = match self.order {
            BlockOrder::Nhd => token as u64 * self.num_heads as u64 + head as u64,
            BlockOrder::Hnd => head as u64 * self.block_size as u64 + token as u64,
            BlockOrder::Lbhnc => {
                return self.region_offset(block, head)
                    + (token as u64 * self.kv_planes as u64 + plane as u64) * self.row_bytes()
            }
            BlockOrder::Rpa3 => {
                // Slot j = 2 * head + plane at (r, p) = (j / P, j % P): slot j's lanes start at
                // ((r * P) + p) * D' = j * D' elements into the token.
                let j = 2 * head as u64 + plane as u64;
                return self.token_offset(block, token)
                    + j * self.padded_head_dim() as u64 * self.dtype.size();
            }
            BlockOrder::Rpa3Hd64 => {
                return self.token_offset(block, token)
                    + head as u64 * 128 * self.dtype.size()
                    + plane as u64 * self.row_bytes();
            }
            // One plane, one head: the token's row.
            BlockOrder::RpaMla => return self.token_offset(block, token),
        };
        plane as u64 * self.plane_bytes()
            + block as u64 * self.block_bytes()
            + within * self.row_bytes()
    }

    /// Byte offset of the start of `block` in `plane`. For the orders whose planes are
    /// interleaved inside a block ([`BlockOrder::planes_within_block`]), plane `p` names the `p`-th
    /// `block_bytes()` slice of the block's `kv_planes * block_bytes()` bytes, so the planes
    /// together cover the whole block.
    pub fn block_offset(&self, plane: u32, block: u32) -> u64 {
        if self.order.planes_within_block() {
            return (block as u64 * self.kv_planes as u64 + plane as u64) * self.block_bytes();
        }
        plane as u64 * self.plane_bytes() + block as u64 * self.block_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parse() {
        let s = ParallelSpec::parse("tp=2,pcp=2,block=64,order=nhd").unwrap();
        assert_eq!(
            (s.tp, s.pcp, s.dp, s.block_size, s.order),
            (2, 2, 1, 64, BlockOrder::Nhd)
        );
        let s = ParallelSpec::parse("tp=1, dp=2, block=16, order=HND").unwrap();
        assert_eq!(
            (s.tp, s.pcp, s.dp, s.block_size, s.order),
            (1, 1, 2, 16, BlockOrder::Hnd)
        );
        assert!(ParallelSpec::parse("tp=two").is_err());
        assert!(ParallelSpec::parse("xp=1").is_err());
        assert!(ParallelSpec::parse("order=abc").is_err());
        assert!(ParallelSpec::parse("tp").is_err());
    }

    /// TP x PCP x DP whose u32 product wraps to 0 (2^32 divides it) or to a small number is
    /// refused, not taken for a tiny layout (seed `fuzz/regressions/layout_validate/rank-product-wraps`).
    #[test]
    fn rank_count_that_wraps_u32_is_refused() {
        let m = ModelKv::preset("llama-3.1-8b").unwrap();
        for (tp, pcp, dp) in [
            (1 << 16, 1 << 16, 1),
            (8, 1 << 29, 1),
            (1, 3, 1_431_655_766),
        ] {
            let spec = ParallelSpec {
                tp,
                pcp,
                dp,
                ..ParallelSpec::default()
            };
            let e = ParallelLayout::new(m.clone(), spec, 4).unwrap_err();
            assert!(
                e.to_string().contains("more than 4096"),
                "{tp}x{pcp}x{dp}: {e}"
            );
            assert!(
                spec.num_ranks() > MAX_RANKS,
                "saturates instead of wrapping"
            );
        }
        let ok = ParallelSpec {
            tp: 8,
            pcp: 8,
            dp: 64,
            ..ParallelSpec::default()
        };
        assert!(
            ParallelLayout::new(m, ok, 4).is_ok(),
            "exactly 4096 ranks are allowed"
        );
    }

    #[test]
    fn heads_split_and_replicate() {
        let m = ModelKv::preset("llama-3.1-8b").unwrap();
        let l = ParallelLayout::new(m.clone(), ParallelSpec::parse("tp=2").unwrap(), 4).unwrap();
        assert_eq!(l.heads_per_rank().unwrap(), 4);
        assert_eq!(l.first_head(1).unwrap(), 4);
        assert_eq!(l.tp_ranks_of_head(5).unwrap(), 1..2);
        let l = ParallelLayout::new(m.clone(), ParallelSpec::parse("tp=16").unwrap(), 4).unwrap();
        assert_eq!(l.heads_per_rank().unwrap(), 1);
        assert_eq!(l.head_replicas().unwrap(), 2);
        assert_eq!(l.first_head(5).unwrap(), 2);
        assert_eq!(l.tp_ranks_of_head(2).unwrap(), 4..6);
        let e = ParallelLayout::new(m, ParallelSpec::parse("tp=3").unwrap(), 4).unwrap_err();
        assert!(e.to_string().contains("cannot be split"), "{e}");
        let mla = ModelKv::preset("deepseek-v3").unwrap();
        let l = ParallelLayout::new(mla, ParallelSpec::parse("tp=4").unwrap(), 4).unwrap();
        assert_eq!(l.heads_per_rank().unwrap(), 1);
        assert_eq!(l.tp_ranks_of_head(0).unwrap(), 0..4);
    }

    #[test]
    fn ranks_and_chunks() {
        let m = ModelKv::preset("llama-3.1-8b").unwrap();
        let l = ParallelLayout::new(
            m,
            ParallelSpec::parse("tp=2,pcp=3,dp=2,block=16").unwrap(),
            8,
        )
        .unwrap();
        for r in 0..l.num_ranks() {
            assert_eq!(l.rank(l.coord(r).unwrap()), r);
        }
        assert_eq!(
            l.coord(7).unwrap(),
            RankCoord {
                dp: 1,
                pcp: 0,
                tp: 1
            }
        );
        // 100 tokens at block 16 -> 7 blocks -> chunks of 3: 0..3, 3..6, 6..7
        assert_eq!(l.pcp_chunk(100, 0).unwrap(), 0..3);
        assert_eq!(l.pcp_chunk(100, 2).unwrap(), 6..7);
        assert_eq!(l.pcp_of_block(100, 6).unwrap(), 2);
        // 10 tokens -> 1 block; pcp ranks 1 and 2 hold nothing
        assert_eq!(l.pcp_chunk(10, 1).unwrap(), 1..1);
    }

    #[test]
    fn offsets_follow_order() {
        let kv = KvLayout {
            num_layers: 1,
            kv_planes: 2,
            num_blocks: 3,
            block_size: 4,
            num_heads: 2,
            head_dim: 8,
            dtype: DType::Bf16,
            order: BlockOrder::Nhd,
        };
        assert_eq!(kv.row_bytes(), 16);
        assert_eq!(kv.block_bytes(), 128);
        assert_eq!(kv.buffer_bytes(), 768);
        assert_eq!(kv.row_offset(1, 2, 3, 1), 384 + 256 + (3 * 2 + 1) * 16);
        let hnd = KvLayout {
            order: BlockOrder::Hnd,
            ..kv
        };
        assert_eq!(hnd.row_offset(1, 2, 3, 1), 384 + 256 + (4 + 3) * 16);
        assert_eq!(hnd.dims(), [2, 3, 2, 4, 8]);
    }

    #[test]
    fn lbhnc_regions() {
        // vLLM CPU, tiny model: 2 KV heads of 32, fp32, 32-token blocks -> [B, 2, 32, 64].
        let kv = KvLayout {
            num_layers: 2,
            kv_planes: 2,
            num_blocks: 10,
            block_size: 32,
            num_heads: 2,
            head_dim: 32,
            dtype: DType::F32,
            order: BlockOrder::Lbhnc,
        };
        assert_eq!(kv.dims(), [1, 10, 2, 32, 64]);
        assert_eq!(kv.region_bytes(), 2 * 32 * 32 * 4);
        assert_eq!(kv.region_offset(3, 1), (3 * 2 + 1) * 8192);
        assert_eq!(kv.buffer_bytes(), 10 * 2 * 8192);
        // Nominal rows stay inside their region; the planes of a block tile the whole block.
        let r = kv.row_offset(1, 3, 31, 1);
        assert!(r >= kv.region_offset(3, 1) && r + kv.row_bytes() <= kv.region_offset(4, 0));
        assert_eq!(kv.block_offset(0, 3), 3 * 16384);
        assert_eq!(kv.block_offset(1, 3), 3 * 16384 + 8192);
        let s = ParallelSpec::parse("order=lbhnc,block=32").unwrap();
        assert_eq!(s.order, BlockOrder::Lbhnc);
        assert_eq!(s.to_string(), "TP=1 x PCP=1 x DP=1, block=32, LBHNC");
        let m = ModelKv {
            num_layers: 2,
            ..ModelKv::preset("llama-3.1-8b").unwrap()
        };
        let l = ParallelLayout::new(m, s, 4).unwrap();
        assert_eq!(l.covered_tokens(33).unwrap(), 64);
        assert_eq!(l.covered_tokens(64).unwrap(), 64);
    }
}
