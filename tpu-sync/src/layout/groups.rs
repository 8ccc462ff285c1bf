//! KV cache groups: models whose cache layers do not all share one geometry.
//!
//! A uniform model ([`ModelKv`]) gives every layer the same heads, head size, dtype, block size
//! and block ids. Hybrid models do not:
//!
//! * **sliding window + full attention** (gpt-oss, Gemma 3): some attention layers keep only the
//!   blocks of the last `window` tokens;
//! * **MLA + indexer** (DeepSeek-V3.2): every layer has an MLA latent cache and a sparse-attention
//!   indexer key cache of another shape;
//! * **linear attention / Mamba + full attention** (Qwen3-Next, Qwen 3.5, Kimi Linear, Nemotron-H):
//!   most layers keep a fixed-size recurrent *state* per request instead of a per-token cache.
//!
//! As in vLLM (`KVCacheConfig.kv_cache_groups`: each group has its own block table) and SGLang
//! (several host pools sharing a key), a request's cache is a list of **groups**. A
//! [`HybridModel`] is a list of [`KvGroup`]s, each naming its **cache layers** (device buffers,
//! numbered `0..num_layers` across the whole model; a model layer with two caches, such as
//! DeepSeek-V3.2's latent and indexer keys, counts as two cache layers) and its [`GroupKind`] with
//! its own geometry. A [`HybridLayout`] adds how one serving instance splits it (TP/PCP/DP as in
//! [`ParallelSpec`]) and, per group, a [`GroupLayout`] (blocks or slots per rank, block size,
//! block order). Block ids, or slot ids for state groups, are given per group per rank
//! ([`crate::plan::HybridPlacement`]). A group's bytes are computed from its own geometry only.
//!
//! A uniform model is exactly one group ([`HybridModel::from_uniform`],
//! [`HybridLayout::from_uniform`]): the planner gives it the same spans as [`crate::plan::Plan::build`].
//!
//! # Per-kind rules
//!
//! | kind | per-rank buffer of one layer | TP | PCP | what a request holds |
//! |---|---|---|---|---|
//! | [`GroupKind::Attention`] | as [`KvLayout`] (`[planes, blocks, block, heads, head_dim]`, NHD/HND/LBHNC) | split by KV heads (replicated when TP > heads) | block chunks | blocks of its tokens; with a sliding window only the blocks of the tokens the next token attends to ([`HybridLayout::needed_tokens`]) |
//! | [`GroupKind::Mla`] | `[1, blocks, block, 1, head_dim]` | replicated | block chunks | blocks of its tokens |
//! | [`GroupKind::Indexer`] | `[blocks, block, value + scale bytes]`, per block all tokens' values then all tokens' scales | replicated | block chunks | blocks of its tokens |
//! | [`GroupKind::State`] | `[slots, slot stride]`, components one after another inside a slot | split by each segment's heads (or replicated) | replicated: every PCP rank holds the state | one slot |

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::{
    check_order_fits, BlockOrder, DType, KvLayout, ModelKv, ParallelLayout, ParallelSpec,
    RankCoord, MAX_RANKS,
};
use crate::error::{Error, Result};
use crate::pjrt::ElementType;

/// Most cache layers (buffers per rank) a [`HybridModel`] may have.
pub const MAX_LAYERS: u32 = 1 << 16;
/// Most groups a [`HybridModel`] may have.
pub const MAX_GROUPS: usize = 64;
/// Most components of a state group, and most segments of one component.
pub const MAX_STATE_PARTS: usize = 64;

/// Preset names accepted by [`HybridModel::preset`] beyond the uniform [`super::PRESETS`].
pub const HYBRID_PRESETS: &[&str] = &[
    "qwen3-next-80b",
    "qwen3.5-9b",
    "gpt-oss-120b",
    "gemma-3-27b",
    "deepseek-v3.2",
    "deepseek-v3.2-tpu",
];

fn two() -> u32 {
    2
}

fn one() -> u32 {
    1
}

/// What one KV cache group holds, with its geometry (independent of parallelism).
///
/// JSON: internally tagged by `type`, e.g. `{"type": "attention", "num_kv_heads": 8, "head_dim":
/// 64, "dtype": "bf16", "sliding_window": 128}`; unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum GroupKind {
    /// Paged attention: K and V planes (or one plane), split over TP by KV heads.
    Attention {
        /// KV heads of the whole model in each layer of the group.
        num_kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
        /// 2 (K and V) or 1 (one plane). Default 2.
        #[serde(default = "two")]
        kv_planes: u32,
        /// Element type.
        dtype: DType,
        /// Sliding window in tokens (the `sliding_window` of the model's config: a token attends
        /// to itself and the `window - 1` tokens before it). `None`: full attention.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sliding_window: Option<u32>,
    },
    /// MLA latent cache: one plane of `head_dim` elements per token, one head, replicated across
    /// TP (as [`ModelKv::is_mla`] models today).
    Mla {
        /// Elements per token (576 = 512 + 64 for DeepSeek-V3's latent + rope).
        head_dim: u32,
        /// Element type.
        dtype: DType,
    },
    /// Sparse-attention indexer key cache (DeepSeek-V3.2's DSA "lightning indexer"): per token
    /// `head_dim` elements of `dtype` plus `scale_bytes` bytes of quantization scale, one head,
    /// replicated across TP. Inside a block, the values of all `block_size` tokens come first and
    /// the scales of all tokens after them: vLLM's fp8 indexer cache
    /// (`indexer_k_quant_and_cache`, "per block, page_kv x 128 e4m3 values followed by one fp32
    /// scale per token"; `MLAAttentionSpec(head_size=128 + 4, dtype=uint8)`).
    Indexer {
        /// Value elements per token (DeepSeek-V3.2 `index_head_dim` 128).
        head_dim: u32,
        /// Value element type (fp8 in vLLM).
        dtype: DType,
        /// Scale bytes per token (4: one f32 per 128 values).
        scale_bytes: u32,
    },
    /// Linear-attention / Mamba-style state: a fixed number of bytes per request per layer, held
    /// in one slot per rank (a slot id instead of block ids).
    State {
        /// The state tensors, stored one after another inside a slot (vLLM `MambaSpec.shapes`:
        /// e.g. the convolution state, then the recurrent state).
        components: Vec<StateComponent>,
        /// Every TP rank holds the whole state (no split by heads). Default false.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        replicated: bool,
    },
}

/// One tensor of a state group's slot: `rows` rows, each the concatenation of `segments`, each
/// `heads x head_elems` elements of `dtype`. Under TP every segment's heads are split into
/// contiguous chunks (replicated when TP exceeds the head count, as KV heads), so a rank's row is
/// its share of each segment, in segment order.
///
/// Example (vLLM `MambaStateShapeCalculator.gated_delta_net_state_shape`, Qwen3-Next): the
/// convolution state `(conv_kernel - 1, conv_dim / tp)` whose channels are the rank's shares of
/// q, k and v is `rows = 3`, segments `[16 x 128, 16 x 128, 32 x 128]`; the recurrent state
/// `(num_v_heads / tp, head_v_dim, head_k_dim)` is `rows = 1`, one segment `32 x (128 * 128)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateComponent {
    /// Name (informational, e.g. `conv`, `ssm`).
    #[serde(default)]
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Rows (a leading dimension not split over TP). Default 1.
    #[serde(default = "one")]
    pub rows: u32,
    /// The segments of each row, in order.
    pub segments: Vec<StateSegment>,
}

/// `heads x head_elems` elements of a [`StateComponent`] row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateSegment {
    /// Heads of the whole model (split over TP).
    pub heads: u32,
    /// Elements per head.
    pub head_elems: u32,
}

impl StateComponent {
    /// A component of `rows` rows of the given `(heads, head_elems)` segments.
    pub fn new(name: &str, dtype: DType, rows: u32, segments: &[(u32, u32)]) -> StateComponent {
        StateComponent {
            name: name.to_string(),
            dtype,
            rows,
            segments: segments
                .iter()
                .map(|&(heads, head_elems)| StateSegment { heads, head_elems })
                .collect(),
        }
    }

    /// Bytes of the whole (unsplit) component.
    pub fn bytes(&self) -> u64 {
        let row: u64 = self
            .segments
            .iter()
            .map(|s| s.heads as u64 * s.head_elems as u64)
            .sum();
        self.rows as u64 * row * self.dtype.size()
    }

    fn describe(&self) -> String {
        let segs: Vec<String> = self
            .segments
            .iter()
            .map(|s| format!("{}x{}", s.heads, s.head_elems))
            .collect();
        format!(
            "{}[{} x ({})] {}",
            if self.name.is_empty() {
                "state"
            } else {
                &self.name
            },
            self.rows,
            segs.join(" + "),
            self.dtype.name()
        )
    }
}

impl GroupKind {
    /// Short name: `attention`, `sliding_window`, `mla`, `indexer` or `state`.
    pub fn name(&self) -> &'static str {
        match self {
            GroupKind::Attention {
                sliding_window: Some(_),
                ..
            } => "sliding_window",
            GroupKind::Attention { .. } => "attention",
            GroupKind::Mla { .. } => "mla",
            GroupKind::Indexer { .. } => "indexer",
            GroupKind::State { .. } => "state",
        }
    }

    /// Whether the group holds state slots instead of blocks.
    pub fn is_state(&self) -> bool {
        matches!(self, GroupKind::State { .. })
    }

    /// The sliding window in tokens, if any.
    pub fn sliding_window(&self) -> Option<u32> {
        match self {
            GroupKind::Attention { sliding_window, .. } => *sliding_window,
            _ => None,
        }
    }

    /// Whether a request's blocks of this group cover every one of its tokens (full attention,
    /// MLA, indexer): the groups a host-tier prefix is chained on.
    pub fn covers_all_tokens(&self) -> bool {
        !self.is_state() && self.sliding_window().is_none()
    }

    /// Paged geometry `(heads, head_dim, planes, dtype)` of attention-like kinds (the indexer
    /// counts its value row only), `None` for state groups.
    fn paged(&self) -> Option<(u32, u32, u32, DType)> {
        match *self {
            GroupKind::Attention {
                num_kv_heads,
                head_dim,
                kv_planes,
                dtype,
                ..
            } => Some((num_kv_heads, head_dim, kv_planes, dtype)),
            GroupKind::Mla { head_dim, dtype } => Some((1, head_dim, 1, dtype)),
            GroupKind::Indexer {
                head_dim, dtype, ..
            } => Some((1, head_dim, 1, dtype)),
            GroupKind::State { .. } => None,
        }
    }

    /// A one-line description of the geometry.
    pub fn describe(&self) -> String {
        match self {
            GroupKind::Attention {
                num_kv_heads,
                head_dim,
                kv_planes,
                dtype,
                sliding_window,
            } => {
                let w = sliding_window
                    .map(|w| format!(", window {w}"))
                    .unwrap_or_default();
                format!(
                    "attention {num_kv_heads} heads x {head_dim} x {kv_planes} planes {}{w}",
                    dtype.name()
                )
            }
            GroupKind::Mla { head_dim, dtype } => format!("mla {head_dim} {}", dtype.name()),
            GroupKind::Indexer {
                head_dim,
                dtype,
                scale_bytes,
            } => format!(
                "indexer {head_dim} {} + {scale_bytes} scale bytes",
                dtype.name()
            ),
            GroupKind::State {
                components,
                replicated,
            } => {
                let c: Vec<String> = components.iter().map(StateComponent::describe).collect();
                format!(
                    "state {}{}",
                    c.join(", "),
                    if *replicated { " (replicated)" } else { "" }
                )
            }
        }
    }

    /// Bytes of the whole model's cache of this kind per token and layer (paged kinds; 0 for
    /// state groups).
    pub fn bytes_per_token_layer(&self) -> u64 {
        match *self {
            GroupKind::Indexer {
                head_dim,
                dtype,
                scale_bytes,
            } => head_dim as u64 * dtype.size() + scale_bytes as u64,
            _ => match self.paged() {
                Some((h, d, p, t)) => h as u64 * d as u64 * p as u64 * t.size(),
                None => 0,
            },
        }
    }

    /// Bytes of the whole (unsplit) state of one layer (state groups; 0 otherwise).
    pub fn state_bytes(&self) -> u64 {
        match self {
            GroupKind::State { components, .. } => components.iter().map(|c| c.bytes()).sum(),
            _ => 0,
        }
    }

    fn validate(&self, group: &str) -> Result<()> {
        let bad = |m: String| Err(Error::Layout(format!("group `{group}`: {m}")));
        match self {
            GroupKind::Attention {
                num_kv_heads,
                head_dim,
                kv_planes,
                sliding_window,
                ..
            } => {
                if *num_kv_heads == 0 || *head_dim == 0 {
                    return bad(format!(
                        "kv heads ({num_kv_heads}) and head_dim ({head_dim}) must be > 0"
                    ));
                }
                if *kv_planes != 1 && *kv_planes != 2 {
                    return bad(format!("kv_planes must be 1 or 2, got {kv_planes}"));
                }
                if *sliding_window == Some(0) {
                    return bad("a sliding window must be at least 1 token".into());
                }
            }
            GroupKind::Mla { head_dim, .. } | GroupKind::Indexer { head_dim, .. } => {
                if *head_dim == 0 {
                    return bad("head_dim must be > 0".into());
                }
            }
            GroupKind::State { components, .. } => {
                if components.is_empty() || components.len() > MAX_STATE_PARTS {
                    return bad(format!(
                        "a state group needs 1..={MAX_STATE_PARTS} components, got {}",
                        components.len()
                    ));
                }
                for c in components {
                    if c.rows == 0 || c.segments.is_empty() || c.segments.len() > MAX_STATE_PARTS {
                        return bad(format!(
                            "state component `{}` needs rows > 0 and 1..={MAX_STATE_PARTS} segments",
                            c.name
                        ));
                    }
                    if c.segments.iter().any(|s| s.heads == 0 || s.head_elems == 0) {
                        return bad(format!(
                            "state component `{}`: every segment needs heads > 0 and head_elems > 0",
                            c.name
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// One KV cache group of a [`HybridModel`]: its cache layers and what they hold.
///
/// JSON: `{"name": "full", "layers": [3, 7, 11], "kind": {"type": "attention", ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvGroup {
    /// Name (informational; not part of compatibility).
    #[serde(default)]
    pub name: String,
    /// The group's cache layers, strictly increasing. Every cache layer of the model belongs to
    /// exactly one group; the layer number is the buffer index in plans and registrations.
    pub layers: Vec<u32>,
    /// What the layers hold.
    pub kind: GroupKind,
}

impl KvGroup {
    /// A group over `layers`.
    pub fn new(name: &str, layers: impl IntoIterator<Item = u32>, kind: GroupKind) -> KvGroup {
        KvGroup {
            name: name.to_string(),
            layers: layers.into_iter().collect(),
            kind,
        }
    }
}

/// A model's KV cache as a list of groups, independent of parallelism.
///
/// JSON: `{"name": "gpt-oss-120b", "groups": [KvGroup, ...]}`; unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HybridModel {
    /// Model name (informational; not part of compatibility).
    pub name: String,
    /// The groups, in the engine's group order (vLLM's `kv_cache_groups` index).
    pub groups: Vec<KvGroup>,
}

/// Every `interval`-th layer (1-based) of `n` in one list, the others in another.
fn split_every(n: u32, interval: u32) -> (Vec<u32>, Vec<u32>) {
    (0..n).partition(|l| (l + 1) % interval == 0)
}

impl HybridModel {
    /// The one-group form of a uniform model: one [`GroupKind::Attention`] group over every
    /// layer (MLA models keep `kv_planes = 1`), named `kv`.
    pub fn from_uniform(m: &ModelKv) -> HybridModel {
        HybridModel {
            name: m.name.clone(),
            groups: vec![KvGroup::new(
                "kv",
                0..m.num_layers,
                GroupKind::Attention {
                    num_kv_heads: m.num_kv_heads,
                    head_dim: m.head_dim,
                    kv_planes: m.kv_planes,
                    dtype: m.dtype,
                    sliding_window: None,
                },
            )],
        }
    }

    /// Geometry of a published model, uniform ([`ModelKv::preset`], as one group) or hybrid
    /// ([`HYBRID_PRESETS`]). Sources, each the model's Hugging Face `config.json`:
    ///
    /// * `qwen3-next-80b` (`Qwen/Qwen3-Next-80B-A3B-Instruct`): `num_hidden_layers` 48,
    ///   `full_attention_interval` 4 (`layer_types`: three `linear_attention` then one
    ///   `full_attention`, so layers 3, 7, ..., 47 are full attention), `num_key_value_heads` 2,
    ///   `head_dim` 256; Gated DeltaNet layers `linear_num_key_heads` 16,
    ///   `linear_num_value_heads` 32, `linear_key_head_dim` / `linear_value_head_dim` 128,
    ///   `linear_conv_kernel_dim` 4, giving vLLM's state shapes
    ///   (`gated_delta_net_state_shape`) conv `(3, 2*16*128 + 32*128)` and recurrent
    ///   `(32, 128, 128)`; bf16 throughout (vLLM's `mamba_ssm_cache_dtype` "auto" = model dtype).
    /// * `qwen3.5-9b` (`Qwen/Qwen3.5-9B`, text config): 32 layers, `full_attention_interval` 4,
    ///   4 KV heads of 256, the same Gated DeltaNet geometry, and `mamba_ssm_dtype` `float32`:
    ///   the recurrent state in f32, the conv state in bf16.
    /// * `gpt-oss-120b` (`openai/gpt-oss-120b`): 36 layers, `layer_types`
    ///   `["sliding_attention", "full_attention"] * 18`, 8 KV heads, `head_dim` 64,
    ///   `sliding_window` 128.
    /// * `gemma-3-27b` (`google/gemma-3-27b-it`, text config): 62 layers,
    ///   `sliding_window_pattern` 6 (every 6th layer global: 52 local, 10 global),
    ///   `sliding_window` 1024, 16 KV heads, `head_dim` 128.
    /// * `deepseek-v3.2` (`deepseek-ai/DeepSeek-V3.2-Exp`): 61 layers, each with an MLA latent
    ///   cache (`kv_lora_rank` 512 + `qk_rope_head_dim` 64 = 576, bf16; cache layers 0..61) and
    ///   an indexer key cache (`index_head_dim` 128 fp8 + a 4-byte f32 scale per token, vLLM's
    ///   fp8 indexer cache; cache layers 61..122).
    /// * `deepseek-v3.2-tpu`: the same model's caches as vLLM-TorchTPU 0.29 allocates them
    ///   (`--kv-cache-dtype fp8`; docs/tpu.md, sparse MLA): per layer `l` a `nope` cache (cache
    ///   layer `3l`, 512 fp8 bytes a token), a `rope` cache (`3l + 1`, 64 bf16 lanes: 128 bytes)
    ///   and the indexer's K cache (`3l + 2`, a 129-byte record: 128 fp8 key bytes and one e8m0
    ///   scale byte, in a 256-byte row), each an MLA group (token-major rows; in the TPU MLA
    ///   order [`super::BlockOrder::RpaMla`] the rows are 512, 128 and 256 bytes).
    pub fn preset(name: &str) -> Result<HybridModel> {
        let attn = |heads, dim, window| GroupKind::Attention {
            num_kv_heads: heads,
            head_dim: dim,
            kv_planes: 2,
            dtype: DType::Bf16,
            sliding_window: window,
        };
        let gdn = |ssm: DType| GroupKind::State {
            components: vec![
                StateComponent::new("conv", DType::Bf16, 3, &[(16, 128), (16, 128), (32, 128)]),
                StateComponent::new("ssm", ssm, 1, &[(32, 128 * 128)]),
            ],
            replicated: false,
        };
        let groups = match name {
            "qwen3-next-80b" | "qwen3.5-9b" => {
                let (n, heads, ssm) = if name == "qwen3-next-80b" {
                    (48, 2, DType::Bf16)
                } else {
                    (32, 4, DType::F32)
                };
                let (full, linear) = split_every(n, 4);
                vec![
                    KvGroup::new("full_attention", full, attn(heads, 256, None)),
                    KvGroup::new("linear_attention", linear, gdn(ssm)),
                ]
            }
            "gpt-oss-120b" => {
                let (full, sliding) = split_every(36, 2);
                vec![
                    KvGroup::new("full_attention", full, attn(8, 64, None)),
                    KvGroup::new("sliding_attention", sliding, attn(8, 64, Some(128))),
                ]
            }
            "gemma-3-27b" => {
                let (global, local) = split_every(62, 6);
                vec![
                    KvGroup::new("full_attention", global, attn(16, 128, None)),
                    KvGroup::new("sliding_attention", local, attn(16, 128, Some(1024))),
                ]
            }
            "deepseek-v3.2" => vec![
                KvGroup::new(
                    "mla",
                    0..61,
                    GroupKind::Mla {
                        head_dim: 576,
                        dtype: DType::Bf16,
                    },
                ),
                KvGroup::new(
                    "indexer",
                    61..122,
                    GroupKind::Indexer {
                        head_dim: 128,
                        dtype: DType::Fp8,
                        scale_bytes: 4,
                    },
                ),
            ],
            "deepseek-v3.2-tpu" => {
                let fp8 = |head_dim| GroupKind::Mla {
                    head_dim,
                    dtype: DType::Fp8,
                };
                vec![
                    KvGroup::new("nope", (0..61).map(|l| 3 * l), fp8(512)),
                    KvGroup::new("rope", (0..61).map(|l| 3 * l + 1), fp8(128)),
                    KvGroup::new("indexer", (0..61).map(|l| 3 * l + 2), fp8(129)),
                ]
            }
            other => match ModelKv::preset(other) {
                Ok(m) => return Ok(HybridModel::from_uniform(&m)),
                Err(_) => {
                    return Err(Error::Layout(format!(
                        "unknown model preset `{other}` (known: {}, {})",
                        super::PRESETS.join(", "),
                        HYBRID_PRESETS.join(", ")
                    )))
                }
            },
        };
        Ok(HybridModel {
            name: name.to_string(),
            groups,
        })
    }

    /// Number of cache layers (buffers per rank) over all groups.
    pub fn num_layers(&self) -> u32 {
        self.groups.iter().map(|g| g.layers.len() as u32).sum()
    }

    /// The group of every cache layer: `map[layer] = (group, position in the group's layers)`.
    /// Layers outside every group (an invalid model) are absent from the end.
    pub fn layer_map(&self) -> Vec<(u32, u32)> {
        let n = self.num_layers() as usize;
        let mut m = vec![(u32::MAX, u32::MAX); n];
        for (g, grp) in self.groups.iter().enumerate() {
            for (i, &l) in grp.layers.iter().enumerate() {
                if let Some(e) = m.get_mut(l as usize) {
                    *e = (g as u32, i as u32);
                }
            }
        }
        m
    }

    /// The group holding cache layer `layer`, if any.
    pub fn group_of_layer(&self, layer: u32) -> Option<usize> {
        self.groups
            .iter()
            .position(|g| g.layers.binary_search(&layer).is_ok())
    }

    /// A group's display name (its name, or `group N`).
    pub fn group_name(&self, g: usize) -> String {
        match self.groups.get(g) {
            Some(x) if !x.name.is_empty() => format!("{} (`{}`)", g, x.name),
            _ => format!("{g}"),
        }
    }

    /// Checks the groups: 1..=[`MAX_GROUPS`] groups, each with a valid geometry and a strictly
    /// increasing, non-empty layer list, and the groups' layers together exactly `0..num_layers`
    /// (at most [`MAX_LAYERS`]).
    pub fn validate(&self) -> Result<()> {
        if self.groups.is_empty() || self.groups.len() > MAX_GROUPS {
            return Err(Error::Layout(format!(
                "model `{}`: 1..={MAX_GROUPS} KV cache groups needed, got {}",
                self.name,
                self.groups.len()
            )));
        }
        let mut total: u64 = 0;
        for (g, grp) in self.groups.iter().enumerate() {
            let gname = self.group_name(g);
            grp.kind.validate(&gname)?;
            if grp.layers.is_empty() {
                return Err(Error::Layout(format!("group {gname} has no layers")));
            }
            if grp.layers.windows(2).any(|w| w[0] >= w[1]) {
                return Err(Error::Layout(format!(
                    "group {gname}: layers must be strictly increasing"
                )));
            }
            total += grp.layers.len() as u64;
        }
        if total > MAX_LAYERS as u64 {
            return Err(Error::Layout(format!(
                "model `{}` has {total} cache layers, more than {MAX_LAYERS}",
                self.name
            )));
        }
        let mut seen = vec![false; total as usize];
        for (g, grp) in self.groups.iter().enumerate() {
            for &l in &grp.layers {
                match seen.get_mut(l as usize) {
                    None => {
                        return Err(Error::Layout(format!(
                            "group {}: layer {l} is outside 0..{total} (the groups' layers must \
                             number 0..num_layers)",
                            self.group_name(g)
                        )))
                    }
                    Some(s) if *s => {
                        return Err(Error::Layout(format!(
                            "layer {l} belongs to two groups (the second is {})",
                            self.group_name(g)
                        )))
                    }
                    Some(s) => *s = true,
                }
            }
        }
        Ok(())
    }

    /// Errors with [`Error::Mismatch`] unless both models have the same groups: the same number,
    /// and group by group the same layers and the same geometry (kind, heads, head size, planes,
    /// dtype, sliding window, state components). Names may differ. The message names the first
    /// group that differs and how.
    pub fn check_compatible(&self, other: &HybridModel) -> Result<()> {
        let names = |m: &HybridModel| -> String {
            m.groups
                .iter()
                .enumerate()
                .map(|(g, x)| format!("{g}:{}", x.kind.name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if self.groups.len() != other.groups.len() {
            return Err(Error::Mismatch(format!(
                "KV cache groups differ: `{}` has {} groups ({}), `{}` has {} ({})",
                self.name,
                self.groups.len(),
                names(self),
                other.name,
                other.groups.len(),
                names(other)
            )));
        }
        for (g, (a, b)) in self.groups.iter().zip(&other.groups).enumerate() {
            if a.layers != b.layers {
                return Err(Error::Mismatch(format!(
                    "KV cache group {} holds layers {:?} on `{}` but {:?} on `{}`",
                    self.group_name(g),
                    a.layers,
                    self.name,
                    b.layers,
                    other.name
                )));
            }
            if a.kind != b.kind {
                let what = match (&a.kind, &b.kind) {
                    (x, y)
                        if x.sliding_window() != y.sliding_window() && x.paged() == y.paged() =>
                    {
                        format!(
                            "sliding window {:?} vs {:?} tokens",
                            x.sliding_window(),
                            y.sliding_window()
                        )
                    }
                    (GroupKind::State { .. }, GroupKind::State { .. }) => format!(
                        "state shapes differ: {} vs {}",
                        a.kind.describe(),
                        b.kind.describe()
                    ),
                    _ => format!("{} vs {}", a.kind.describe(), b.kind.describe()),
                };
                return Err(Error::Mismatch(format!(
                    "KV cache group {} differs between `{}` and `{}`: {what}",
                    self.group_name(g),
                    self.name,
                    other.name
                )));
            }
        }
        Ok(())
    }

    /// A one-line description, e.g. `gpt-oss-120b: 18 x attention 8 heads x 64 ..., 18 x ...`.
    pub fn describe(&self) -> String {
        let g: Vec<String> = self
            .groups
            .iter()
            .map(|g| format!("{} x {}", g.layers.len(), g.kind.describe()))
            .collect();
        format!("{}: {}", self.name, g.join("; "))
    }
}

/// How one instance stores one group: blocks (or slots) per rank and, for paged groups, the
/// block size and order when they differ from the instance's [`ParallelSpec`].
///
/// JSON: `{"num_blocks": 512, "block_size": 32}`; absent keys take the defaults below; unknown
/// keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupLayout {
    /// Blocks per rank (paged groups) or state slots per rank (state groups): the capacity of
    /// each rank's buffers of the group's layers.
    pub num_blocks: u32,
    /// Tokens per block; `None`: the spec's `block_size`. Ignored for state groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Block order; `None`: the spec's `order`. Applies to [`GroupKind::Attention`] and
    /// [`GroupKind::Mla`] groups; indexer and state buffers have fixed interiors, and an order
    /// other than NHD given for them is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<BlockOrder>,
    /// State groups: bytes from one slot to the next (vLLM pads a Mamba page to the attention
    /// page size, `MambaSpec.page_size_padded`); `None` = the dense slot size. Ignored for paged
    /// groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_bytes: Option<u64>,
    /// Physical layout of this group's buffers as the PJRT plugin reports it (see
    /// [`ParallelLayout::physical_layout`]); compared when both sides know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_layout: Option<String>,
    /// Block format tag of this group's buffers (see [`ParallelLayout::block_format`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_format: Option<String>,
}

impl GroupLayout {
    /// `num_blocks` blocks or slots per rank, everything else from the spec.
    pub fn new(num_blocks: u32) -> GroupLayout {
        GroupLayout {
            num_blocks,
            block_size: None,
            order: None,
            slot_bytes: None,
            physical_layout: None,
            block_format: None,
        }
    }

    /// The same with its own block size.
    pub fn with_block_size(mut self, block_size: u32) -> GroupLayout {
        self.block_size = Some(block_size);
        self
    }

    /// The same with its own block order.
    pub fn with_order(mut self, order: BlockOrder) -> GroupLayout {
        self.order = Some(order);
        self
    }

    /// The same with a padded slot stride (state groups).
    pub fn with_slot_bytes(mut self, slot_bytes: u64) -> GroupLayout {
        self.slot_bytes = Some(slot_bytes);
        self
    }
}

/// How `heads` heads split over the TP ranks: each rank holds `per_rank` consecutive heads and
/// each head lives on `replicas` consecutive TP ranks (the rule of [`ParallelLayout`] for KV
/// heads: TP divides the heads, or the heads divide TP and are replicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadSplit {
    /// Heads of the whole model.
    pub heads: u32,
    /// Heads held by each TP rank.
    pub per_rank: u32,
    /// TP ranks holding each head.
    pub replicas: u32,
}

impl HeadSplit {
    /// The split of `heads` heads over `tp` ranks (assumes [`HeadSplit::valid`]).
    pub fn of(heads: u32, tp: u32) -> HeadSplit {
        let (h, t) = (heads.max(1), tp.max(1));
        HeadSplit {
            heads,
            per_rank: (h / t).max(1),
            replicas: (t / h).max(1),
        }
    }

    /// Every one of `tp` ranks holds all `heads` heads.
    pub fn replicated(heads: u32, tp: u32) -> HeadSplit {
        HeadSplit {
            heads,
            per_rank: heads.max(1),
            replicas: tp.max(1),
        }
    }

    /// Whether `heads` heads can be split over `tp` ranks.
    pub fn valid(heads: u32, tp: u32) -> bool {
        heads > 0 && tp > 0 && (heads % tp == 0 || tp % heads == 0)
    }

    /// Global index of the first head held by TP rank `tp`.
    pub fn first_head(&self, tp: u32) -> u32 {
        tp / self.replicas * self.per_rank
    }

    /// The TP ranks holding global head `head`.
    pub fn ranks_of_head(&self, head: u32) -> Range<u32> {
        let g = head / self.per_rank;
        g * self.replicas..(g + 1) * self.replicas
    }
}

/// One rank's buffers of an indexer group: one buffer per layer of `num_blocks` blocks, each
/// block the `block_size` value rows (`value_bytes` each) followed by the `block_size` scale
/// rows (`scale_bytes` each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IndexerKv {
    /// Layers (= buffers) of the group.
    pub num_layers: u32,
    /// Blocks per buffer.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Value bytes per token.
    pub value_bytes: u64,
    /// Scale bytes per token.
    pub scale_bytes: u64,
}

impl IndexerKv {
    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.block_size as u64 * (self.value_bytes + self.scale_bytes)
    }

    /// Bytes of one layer's buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.num_blocks as u64 * self.block_bytes()
    }

    /// Offset of token `token`'s value row in `block`.
    pub fn value_offset(&self, block: u32, token: u32) -> u64 {
        block as u64 * self.block_bytes() + token as u64 * self.value_bytes
    }

    /// Offset of token `token`'s scale row in `block`.
    pub fn scale_offset(&self, block: u32, token: u32) -> u64 {
        block as u64 * self.block_bytes()
            + self.block_size as u64 * self.value_bytes
            + token as u64 * self.scale_bytes
    }
}

/// One rank's share of a [`StateSegment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateSegmentKv {
    /// Byte offset inside the component's row.
    pub offset: u64,
    /// Heads held by the rank.
    pub heads: u32,
    /// Bytes per head.
    pub head_bytes: u64,
    /// How the segment's heads split over TP.
    pub split: HeadSplit,
}

/// One rank's share of a [`StateComponent`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StateComponentKv {
    /// Byte offset inside the slot.
    pub offset: u64,
    /// Rows.
    pub rows: u32,
    /// Bytes of one of the rank's rows.
    pub row_bytes: u64,
    /// Element type.
    pub dtype: DType,
    /// The rank's segment shares, in order.
    pub segments: Vec<StateSegmentKv>,
}

/// One rank's buffers of a state group: one buffer per layer of `num_slots` slots of
/// `slot_stride` bytes; a slot holds the components one after another (`slot_bytes` dense
/// bytes, then padding up to the stride).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StateKv {
    /// Layers (= buffers) of the group.
    pub num_layers: u32,
    /// Slots per buffer.
    pub num_slots: u32,
    /// Bytes from one slot to the next.
    pub slot_stride: u64,
    /// Dense bytes of one slot (the components).
    pub slot_bytes: u64,
    /// The components.
    pub components: Vec<StateComponentKv>,
}

impl StateKv {
    /// Bytes of one layer's buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.num_slots as u64 * self.slot_stride
    }

    /// Byte offset of local head `head` of segment `seg` in row `row` of component `comp` of
    /// `slot`.
    pub fn head_offset(&self, slot: u32, comp: usize, row: u32, seg: usize, head: u32) -> u64 {
        let c = &self.components[comp];
        let s = &c.segments[seg];
        slot as u64 * self.slot_stride
            + c.offset
            + row as u64 * c.row_bytes
            + s.offset
            + head as u64 * s.head_bytes
    }
}

/// One rank's buffer geometry of one group (every layer of the group alike).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GroupRankKv {
    /// Attention or MLA blocks ([`KvLayout`], `num_layers` = the group's layers).
    Paged(KvLayout),
    /// Indexer blocks.
    Indexer(IndexerKv),
    /// State slots.
    State(StateKv),
}

/// The shape a device buffer of one cache layer must have: PJRT element type, dimensions and
/// bytes (dense, row-major).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BufferShape {
    /// Element type.
    pub element_type: ElementType,
    /// Dimensions in elements.
    pub dims: Vec<i64>,
    /// Bytes.
    pub bytes: u64,
}

impl GroupRankKv {
    /// Bytes of one layer's buffer.
    pub fn buffer_bytes(&self) -> u64 {
        match self {
            GroupRankKv::Paged(kv) => kv.buffer_bytes(),
            GroupRankKv::Indexer(ix) => ix.buffer_bytes(),
            GroupRankKv::State(st) => st.buffer_bytes(),
        }
    }

    /// Blocks (or slots) per buffer.
    pub fn num_blocks(&self) -> u32 {
        match self {
            GroupRankKv::Paged(kv) => kv.num_blocks,
            GroupRankKv::Indexer(ix) => ix.num_blocks,
            GroupRankKv::State(st) => st.num_slots,
        }
    }

    /// Bytes of one whole block (all planes) or one slot stride.
    pub fn unit_bytes(&self) -> u64 {
        match self {
            GroupRankKv::Paged(kv) => kv.kv_planes as u64 * kv.block_bytes(),
            GroupRankKv::Indexer(ix) => ix.block_bytes(),
            GroupRankKv::State(st) => st.slot_stride,
        }
    }

    /// The byte ranges `(offset, len)` of one layer's buffer that hold block (or slot) `id`:
    /// every plane of a paged block, a whole indexer block, or a slot's dense bytes.
    pub fn unit_ranges(&self, id: u32) -> Vec<(u64, u64)> {
        match self {
            GroupRankKv::Paged(kv) => (0..kv.kv_planes)
                .map(|p| (kv.block_offset(p, id), kv.block_bytes()))
                .collect(),
            GroupRankKv::Indexer(ix) => vec![(id as u64 * ix.block_bytes(), ix.block_bytes())],
            GroupRankKv::State(st) => vec![(id as u64 * st.slot_stride, st.slot_bytes)],
        }
    }

    /// The shape a device buffer of one layer must have: paged groups [`KvLayout::dims`] of the
    /// dtype; indexer `u8 [num_blocks, block_size, value + scale bytes]` (vLLM's uint8 indexer
    /// cache); state groups `[num_slots, slot_stride / size]` of the components' dtype when they
    /// all share one that divides the stride, else `u8 [num_slots, slot_stride]`.
    pub fn shape(&self) -> BufferShape {
        match self {
            GroupRankKv::Paged(kv) => BufferShape {
                element_type: kv.dtype.element_type(),
                dims: kv.dims().to_vec(),
                bytes: kv.buffer_bytes(),
            },
            GroupRankKv::Indexer(ix) => BufferShape {
                element_type: ElementType::U8,
                dims: vec![
                    ix.num_blocks as i64,
                    ix.block_size as i64,
                    (ix.value_bytes + ix.scale_bytes) as i64,
                ],
                bytes: ix.buffer_bytes(),
            },
            GroupRankKv::State(st) => {
                let first = st.components[0].dtype;
                let same = st.components.iter().all(|c| c.dtype == first)
                    && st.slot_stride % first.size() == 0;
                let (element_type, elem) = if same {
                    (first.element_type(), first.size())
                } else {
                    (ElementType::U8, 1)
                };
                BufferShape {
                    element_type,
                    dims: vec![st.num_slots as i64, (st.slot_stride / elem) as i64],
                    bytes: st.buffer_bytes(),
                }
            }
        }
    }
}

/// A [`HybridModel`] split over the ranks of one serving instance.
///
/// Ranks are numbered as in [`ParallelLayout`]: `rank = (dp * pcp_size + pcp) * tp_size + tp`.
/// JSON: `{"model": HybridModel, "spec": ParallelSpec, "groups": [GroupLayout, ...]}` (one
/// [`GroupLayout`] per model group, in order); unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HybridLayout {
    /// The model's groups.
    pub model: HybridModel,
    /// TP, PCP, DP, and the default block size and order of paged groups.
    pub spec: ParallelSpec,
    /// Per group (same order as `model.groups`): blocks or slots per rank and overrides.
    pub groups: Vec<GroupLayout>,
}

impl HybridLayout {
    /// Builds and validates a layout.
    ///
    /// Errors: as [`HybridLayout::validate`].
    pub fn new(
        model: HybridModel,
        spec: ParallelSpec,
        groups: Vec<GroupLayout>,
    ) -> Result<HybridLayout> {
        let l = HybridLayout {
            model,
            spec,
            groups,
        };
        l.validate()?;
        Ok(l)
    }

    /// The same layout with every group holding `num_blocks` blocks or slots per rank.
    pub fn uniform_blocks(
        model: HybridModel,
        spec: ParallelSpec,
        num_blocks: u32,
    ) -> Result<HybridLayout> {
        let groups = vec![GroupLayout::new(num_blocks); model.groups.len()];
        HybridLayout::new(model, spec, groups)
    }

    /// The one-group form of a uniform layout (its physical layout and block format carried
    /// over to the group).
    pub fn from_uniform(l: &ParallelLayout) -> HybridLayout {
        HybridLayout {
            model: HybridModel::from_uniform(&l.model),
            spec: l.spec,
            groups: vec![GroupLayout {
                num_blocks: l.num_blocks,
                block_size: None,
                order: None,
                slot_bytes: None,
                physical_layout: l.physical_layout.clone(),
                block_format: l.block_format.clone(),
            }],
        }
    }

    /// Checks the layout: the model ([`HybridModel::validate`]); TP, PCP, DP and every paged
    /// group's block size > 0 and at most [`MAX_RANKS`] ranks; one [`GroupLayout`] per group,
    /// each with blocks (slots) > 0; every group's heads (every state segment's heads unless
    /// replicated) split over TP (TP divides them, or they divide TP); an LBHNC order only on
    /// attention and MLA groups; a state slot stride of at least the dense slot; every buffer
    /// below `i64::MAX / 2` bytes.
    ///
    /// Errors: [`Error::Layout`] naming the group.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let s = &self.spec;
        if s.tp == 0 || s.pcp == 0 || s.dp == 0 || s.block_size == 0 {
            return Err(Error::Layout(format!(
                "tp ({}), pcp ({}), dp ({}) and block ({}) must all be > 0",
                s.tp, s.pcp, s.dp, s.block_size
            )));
        }
        let ranks = u64::from(s.tp) * u64::from(s.pcp) * u64::from(s.dp);
        if ranks > MAX_RANKS as u64 {
            return Err(Error::Layout(format!(
                "TP={} x PCP={} x DP={} is {ranks} ranks, more than {MAX_RANKS}",
                s.tp, s.pcp, s.dp
            )));
        }
        if self.groups.len() != self.model.groups.len() {
            return Err(Error::Layout(format!(
                "{} group layouts for a model of {} KV cache groups",
                self.groups.len(),
                self.model.groups.len()
            )));
        }
        for (g, (grp, gl)) in self.model.groups.iter().zip(&self.groups).enumerate() {
            let name = self.model.group_name(g);
            let bad = |m: String| Err(Error::Layout(format!("group {name}: {m}")));
            if gl.num_blocks == 0 {
                return bad("num_blocks must be > 0".into());
            }
            if gl.block_size == Some(0) {
                return bad("block size must be > 0".into());
            }
            match &grp.kind {
                GroupKind::State {
                    components,
                    replicated,
                } => {
                    if !replicated {
                        for c in components {
                            for seg in &c.segments {
                                if !HeadSplit::valid(seg.heads, s.tp) {
                                    return bad(format!(
                                        "state component `{}`: {} heads cannot be split over \
                                         TP={}: TP must divide the head count or be a multiple \
                                         of it",
                                        c.name, seg.heads, s.tp
                                    ));
                                }
                            }
                        }
                    }
                    let dense = self.state_kv_unchecked(g).slot_bytes;
                    if let Some(stride) = gl.slot_bytes {
                        if stride < dense {
                            return bad(format!(
                                "slot_bytes {stride} is smaller than the {dense} bytes of a slot"
                            ));
                        }
                    }
                }
                kind => {
                    let (heads, ..) = kind.paged().unwrap_or((1, 1, 1, DType::Bf16));
                    if !HeadSplit::valid(heads, s.tp) {
                        return bad(format!(
                            "{heads} KV heads cannot be split over TP={}: TP must divide the \
                             head count or be a multiple of it (replication)",
                            s.tp
                        ));
                    }
                }
            }
            if matches!(
                grp.kind,
                GroupKind::Indexer { .. } | GroupKind::State { .. }
            ) && gl.order.is_some_and(|o| o != BlockOrder::Nhd)
            {
                return bad(format!(
                    "{} buffers have a fixed interior; a block order applies to attention and \
                     MLA groups only",
                    grp.kind.name()
                ));
            }
            let order = self.u_order(g);
            if order.is_tpu() {
                // The RPA v3 caches hold attention groups (vLLM-TorchTPU's sliding-window and
                // full-attention groups, each layer its own RPA v3 tensor); the TPU MLA cache
                // holds MLA groups (vLLM-TorchTPU's sparse MLA: the `nope`, `rope` and indexer
                // caches of one block table, each a token-major cache of its own row width).
                // The unified hybrid pools are not mapped yet.
                let fits = match grp.kind {
                    GroupKind::Attention {
                        num_kv_heads,
                        head_dim,
                        kv_planes,
                        dtype,
                        ..
                    } if order.is_rpa3() => Some((num_kv_heads, head_dim, kv_planes, dtype)),
                    GroupKind::Mla { head_dim, dtype } if order == BlockOrder::RpaMla => {
                        Some((1, head_dim, 1, dtype))
                    }
                    _ => None,
                };
                let Some((num_kv_heads, head_dim, kv_planes, dtype)) = fits else {
                    return bad(format!(
                        "block order {} (a TPU engine's cache) holds {} groups only here; {} \
                         groups in it and the unified hybrid pools are not mapped yet \
                         (docs/tpu.md)",
                        order.name(),
                        if order == BlockOrder::RpaMla {
                            "mla"
                        } else {
                            "attention"
                        },
                        grp.kind.name()
                    ));
                };
                let m = ModelKv {
                    name: self.model.name.clone(),
                    num_layers: grp.layers.len() as u32,
                    num_kv_heads,
                    head_dim,
                    kv_planes,
                    dtype,
                };
                match check_order_fits(order, &m) {
                    Err(Error::Layout(msg)) => return bad(msg),
                    Err(e) => return Err(e),
                    Ok(()) => {}
                }
            }
            // Sizes in u128: a peer's u32 fields must not wrap.
            let bytes = self.buffer_bytes_wide(g);
            if bytes > (i64::MAX / 2) as u128 {
                return bad(format!("per-layer buffer of {bytes} bytes is too large"));
            }
        }
        Ok(())
    }

    /// Per-layer buffer bytes of group `g` without overflow (for validation).
    fn buffer_bytes_wide(&self, g: usize) -> u128 {
        let gl = &self.groups[g];
        let nb = gl.num_blocks as u128;
        match &self.model.groups[g].kind {
            GroupKind::State { .. } => {
                let st = self.state_kv_unchecked(g);
                nb * gl.slot_bytes.unwrap_or(st.slot_bytes) as u128
            }
            // A rank holds at most every head: bounded by the whole model's bytes per token
            // (the TPU caches with their padding: slots and lanes).
            kind => {
                let order = self.u_order(g);
                match kind.paged() {
                    Some((num_heads, head_dim, kv_planes, dtype)) if order.is_tpu() => KvLayout {
                        num_layers: 1,
                        kv_planes,
                        num_blocks: gl.num_blocks,
                        block_size: self.u_block_size(g),
                        num_heads,
                        head_dim,
                        dtype,
                        order,
                    }
                    .buffer_bytes_wide(),
                    _ => nb * self.u_block_size(g) as u128 * kind.bytes_per_token_layer() as u128,
                }
            }
        }
    }

    /// Number of ranks (`dp * pcp * tp`).
    pub fn num_ranks(&self) -> u32 {
        self.spec.num_ranks()
    }

    /// Number of cache layers (buffers per rank).
    pub fn num_layers(&self) -> u32 {
        self.model.num_layers()
    }

    /// Errors with [`Error::Layout`] when a field the geometry divides by is zero (TP, PCP, DP,
    /// the spec's or a group's block size) or the group layouts do not match the model's groups.
    /// Every geometry function below checks it first, so a layout that was never
    /// [validated](HybridLayout::validate) gets an error, never a division by zero.
    pub fn check_nonzero(&self) -> Result<()> {
        let s = &self.spec;
        if s.tp == 0 || s.pcp == 0 || s.dp == 0 || s.block_size == 0 {
            return Err(Error::Layout(format!(
                "tp ({}), pcp ({}), dp ({}) and block ({}) must all be > 0",
                s.tp, s.pcp, s.dp, s.block_size
            )));
        }
        if self.groups.len() != self.model.groups.len() {
            return Err(Error::Layout(format!(
                "{} group layouts for a model of {} KV cache groups",
                self.groups.len(),
                self.model.groups.len()
            )));
        }
        if let Some(g) = self.groups.iter().position(|gl| gl.block_size == Some(0)) {
            return Err(Error::Layout(format!(
                "group {}: block size must be > 0",
                self.model.group_name(g)
            )));
        }
        Ok(())
    }

    /// [`HybridLayout::check_nonzero`], and `g` names a group.
    fn check_group(&self, g: usize) -> Result<()> {
        self.check_nonzero()?;
        if g >= self.groups.len() {
            return Err(Error::InvalidArgument(format!(
                "group {g} of a model of {} KV cache groups",
                self.groups.len()
            )));
        }
        Ok(())
    }

    /// Coordinates of `rank`.
    ///
    /// Errors: as [`HybridLayout::check_nonzero`].
    pub fn coord(&self, rank: u32) -> Result<RankCoord> {
        self.check_nonzero()?;
        Ok(self.u_coord(rank))
    }

    pub(crate) fn u_coord(&self, rank: u32) -> RankCoord {
        let (tp, pcp) = (self.spec.tp.max(1), self.spec.pcp.max(1));
        RankCoord {
            dp: rank / tp.saturating_mul(pcp),
            pcp: (rank / tp) % pcp,
            tp: rank % tp,
        }
    }

    /// Global rank of coordinates.
    pub fn rank(&self, c: RankCoord) -> u32 {
        (c.dp * self.spec.pcp + c.pcp) * self.spec.tp + c.tp
    }

    /// Tokens per block of group `g` (paged groups; 1 for state groups, which have none).
    ///
    /// Errors: as [`HybridLayout::check_nonzero`]; [`Error::InvalidArgument`] for a group
    /// outside the model (as every function below that takes a group).
    pub fn block_size(&self, g: usize) -> Result<u32> {
        self.check_group(g)?;
        Ok(self.u_block_size(g))
    }

    pub(crate) fn u_block_size(&self, g: usize) -> u32 {
        if self.model.groups[g].kind.is_state() {
            return 1;
        }
        self.groups[g]
            .block_size
            .unwrap_or(self.spec.block_size)
            .max(1)
    }

    /// Block order of group `g` (indexer and state groups: NHD, their interiors are fixed).
    pub fn order(&self, g: usize) -> Result<BlockOrder> {
        self.check_group(g)?;
        Ok(self.u_order(g))
    }

    pub(crate) fn u_order(&self, g: usize) -> BlockOrder {
        match self.model.groups[g].kind {
            GroupKind::Attention { .. } | GroupKind::Mla { .. } => {
                self.groups[g].order.unwrap_or(self.spec.order)
            }
            _ => BlockOrder::Nhd,
        }
    }

    /// How group `g`'s heads split over TP (paged groups; MLA and indexer: one replicated head).
    pub fn head_split(&self, g: usize) -> Result<HeadSplit> {
        self.check_group(g)?;
        Ok(self.u_head_split(g))
    }

    pub(crate) fn u_head_split(&self, g: usize) -> HeadSplit {
        let heads = self.model.groups[g].kind.paged().map(|p| p.0).unwrap_or(1);
        HeadSplit::of(heads, self.spec.tp)
    }

    /// The per-rank buffer geometry of group `g` (the same on every rank).
    pub fn rank_kv(&self, g: usize) -> Result<GroupRankKv> {
        self.check_group(g)?;
        Ok(self.u_rank_kv(g))
    }

    pub(crate) fn u_rank_kv(&self, g: usize) -> GroupRankKv {
        let grp = &self.model.groups[g];
        let layers = grp.layers.len() as u32;
        let nb = self.groups[g].num_blocks;
        match &grp.kind {
            GroupKind::State { .. } => GroupRankKv::State(self.state_kv_unchecked(g)),
            GroupKind::Indexer {
                head_dim,
                dtype,
                scale_bytes,
            } => GroupRankKv::Indexer(IndexerKv {
                num_layers: layers,
                num_blocks: nb,
                block_size: self.u_block_size(g),
                value_bytes: *head_dim as u64 * dtype.size(),
                scale_bytes: *scale_bytes as u64,
            }),
            kind => {
                let (_, head_dim, planes, dtype) = kind.paged().unwrap_or((1, 1, 1, DType::Bf16));
                GroupRankKv::Paged(KvLayout {
                    num_layers: layers,
                    kv_planes: planes,
                    num_blocks: nb,
                    block_size: self.u_block_size(g),
                    num_heads: self.u_head_split(g).per_rank,
                    head_dim,
                    dtype,
                    order: self.u_order(g),
                })
            }
        }
    }

    fn state_kv_unchecked(&self, g: usize) -> StateKv {
        let GroupKind::State {
            components,
            replicated,
        } = &self.model.groups[g].kind
        else {
            return StateKv {
                num_layers: 0,
                num_slots: 0,
                slot_stride: 0,
                slot_bytes: 0,
                components: Vec::new(),
            };
        };
        let tp = self.spec.tp;
        let mut off = 0u64;
        let mut comps = Vec::with_capacity(components.len());
        for c in components {
            let es = c.dtype.size();
            let mut row = 0u64;
            let mut segs = Vec::with_capacity(c.segments.len());
            for s in &c.segments {
                let split = if *replicated {
                    HeadSplit::replicated(s.heads, tp)
                } else {
                    HeadSplit::of(s.heads, tp)
                };
                let head_bytes = s.head_elems as u64 * es;
                segs.push(StateSegmentKv {
                    offset: row,
                    heads: split.per_rank,
                    head_bytes,
                    split,
                });
                row = row.saturating_add((split.per_rank as u64).saturating_mul(head_bytes));
            }
            comps.push(StateComponentKv {
                offset: off,
                rows: c.rows,
                row_bytes: row,
                dtype: c.dtype,
                segments: segs,
            });
            off = off.saturating_add((c.rows as u64).saturating_mul(row));
        }
        let gl = &self.groups[g];
        StateKv {
            num_layers: self.model.groups[g].layers.len() as u32,
            num_slots: gl.num_blocks,
            slot_stride: gl.slot_bytes.unwrap_or(off).max(off),
            slot_bytes: off,
            components: comps,
        }
    }

    /// The shape every rank's buffer of cache layer `layer` must have.
    ///
    /// Errors: [`Error::InvalidArgument`] for a layer outside the model; as
    /// [`HybridLayout::check_nonzero`].
    pub fn layer_shape(&self, layer: u32) -> Result<BufferShape> {
        let g = self.model.group_of_layer(layer).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "layer {layer} is outside the model's {} cache layers",
                self.num_layers()
            ))
        })?;
        Ok(self.rank_kv(g)?.shape())
    }

    /// Request blocks of group `g` for `num_tokens` tokens (all its tokens, from block 0; a
    /// sliding-window group holds only [`HybridLayout::window_blocks`] of them; 1 "block" for
    /// a state group, its slot).
    pub fn request_blocks(&self, g: usize, num_tokens: u32) -> Result<u32> {
        self.check_group(g)?;
        Ok(self.u_request_blocks(g, num_tokens))
    }

    pub(crate) fn u_request_blocks(&self, g: usize, num_tokens: u32) -> u32 {
        if self.model.groups[g].kind.is_state() {
            return 1;
        }
        num_tokens.div_ceil(self.u_block_size(g))
    }

    /// The request blocks of group `g` on PCP rank `pcp`: the blocks divided into `pcp_size`
    /// contiguous chunks of `ceil(n / pcp_size)` blocks, as [`ParallelLayout::pcp_chunk`].
    /// A state group's slot is on every PCP rank (`0..1`).
    pub fn pcp_chunk(&self, g: usize, num_tokens: u32, pcp: u32) -> Result<Range<u32>> {
        self.check_group(g)?;
        Ok(self.u_pcp_chunk(g, num_tokens, pcp))
    }

    pub(crate) fn u_pcp_chunk(&self, g: usize, num_tokens: u32, pcp: u32) -> Range<u32> {
        if self.model.groups[g].kind.is_state() {
            return 0..1;
        }
        let n = self.u_request_blocks(g, num_tokens);
        let chunk = n.div_ceil(self.spec.pcp.max(1));
        let start = pcp.saturating_mul(chunk).min(n);
        let end = pcp.saturating_add(1).saturating_mul(chunk).min(n);
        start..end
    }

    /// The PCP rank holding request block `block` of group `g`.
    pub fn pcp_of_block(&self, g: usize, num_tokens: u32, block: u32) -> Result<u32> {
        self.check_group(g)?;
        Ok(self.u_pcp_of_block(g, num_tokens, block))
    }

    pub(crate) fn u_pcp_of_block(&self, g: usize, num_tokens: u32, block: u32) -> u32 {
        let n = self.u_request_blocks(g, num_tokens);
        let chunk = n.div_ceil(self.spec.pcp.max(1)).max(1);
        block / chunk
    }

    /// The tokens of a `num_tokens`-token request whose KV group `g` must hold and move: all of
    /// them, or for a sliding window of `w` tokens the last `w - 1` (the ones the next token
    /// attends to besides itself; vLLM's `SlidingWindowManager.get_num_skipped_tokens` skips
    /// `num_tokens - w + 1`). Empty for state groups, which hold no tokens.
    pub fn needed_tokens(&self, g: usize, num_tokens: u32) -> Result<Range<u32>> {
        self.check_group(g)?;
        Ok(self.u_needed_tokens(g, num_tokens))
    }

    pub(crate) fn u_needed_tokens(&self, g: usize, num_tokens: u32) -> Range<u32> {
        self.u_needed_tokens_from(g, num_tokens, num_tokens)
    }

    /// [`HybridLayout::needed_tokens`] for a side whose first computed token is `next` (`<=
    /// num_tokens`; `num_tokens` when it computes the request's next token): a sliding window
    /// of `w` tokens needs `[next + 1 - w, num_tokens)`, the tokens token `next`'s window reads
    /// (vLLM recomputes the last prompt token after loading the whole prompt: `next =
    /// num_tokens - 1`, one token more than the next token reads).
    pub(crate) fn u_needed_tokens_from(&self, g: usize, num_tokens: u32, next: u32) -> Range<u32> {
        let kind = &self.model.groups[g].kind;
        if kind.is_state() {
            return 0..0;
        }
        match kind.sliding_window() {
            Some(w) => {
                (next.min(num_tokens).saturating_add(1).saturating_sub(w)).min(num_tokens)
                    ..num_tokens
            }
            None => 0..num_tokens,
        }
    }

    /// The request blocks of group `g` that exist: those holding [`HybridLayout::needed_tokens`]
    /// (for a state group, its slot: `0..1`).
    pub fn window_blocks(&self, g: usize, num_tokens: u32) -> Result<Range<u32>> {
        self.check_group(g)?;
        Ok(self.u_window_blocks(g, num_tokens))
    }

    pub(crate) fn u_window_blocks(&self, g: usize, num_tokens: u32) -> Range<u32> {
        self.u_window_blocks_from(g, num_tokens, num_tokens)
    }

    /// [`HybridLayout::window_blocks`] of the tokens [`HybridLayout::u_needed_tokens_from`]
    /// `next` needs.
    pub(crate) fn u_window_blocks_from(&self, g: usize, num_tokens: u32, next: u32) -> Range<u32> {
        if self.model.groups[g].kind.is_state() {
            return 0..1;
        }
        let n = self.u_request_blocks(g, num_tokens);
        let t = self.u_needed_tokens_from(g, num_tokens, next);
        if t.is_empty() {
            return n..n;
        }
        t.start / self.u_block_size(g)..n
    }

    /// The request blocks of group `g` held by PCP rank `pcp`:
    /// [`HybridLayout::pcp_chunk`] ∩ [`HybridLayout::window_blocks`]. A placement lists exactly
    /// these blocks' ids for each rank, in order.
    pub fn held_blocks(&self, g: usize, num_tokens: u32, pcp: u32) -> Result<Range<u32>> {
        self.check_group(g)?;
        Ok(self.u_held_blocks(g, num_tokens, pcp))
    }

    pub(crate) fn u_held_blocks(&self, g: usize, num_tokens: u32, pcp: u32) -> Range<u32> {
        self.u_held_blocks_from(g, num_tokens, pcp, num_tokens)
    }

    /// [`HybridLayout::held_blocks`] of a side whose first computed token is `next`.
    pub(crate) fn u_held_blocks_from(
        &self,
        g: usize,
        num_tokens: u32,
        pcp: u32,
        next: u32,
    ) -> Range<u32> {
        let c = self.u_pcp_chunk(g, num_tokens, pcp);
        let w = self.u_window_blocks_from(g, num_tokens, next);
        let start = c.start.max(w.start);
        let end = c.end.min(w.end).max(start);
        start..end
    }

    /// Errors with [`Error::Mismatch`] unless raw bytes of every group can be copied between
    /// `self` and `other`: per group, known physical layouts must be equal and block formats
    /// compatible as [`ParallelLayout::check_physical_layout`] and
    /// [`ParallelLayout::check_block_format`] say (opaque LBHNC blocks: the same order, block
    /// size and known format tag on both sides). The message names the group.
    pub fn check_raw_compatible(&self, other: &HybridLayout) -> Result<()> {
        for g in 0..self.groups.len().min(other.groups.len()) {
            let a = self.group_as_parallel(g);
            let b = other.group_as_parallel(g);
            a.check_physical_layout(&b)
                .and_then(|_| a.check_block_format(&b))
                .map_err(|e| e.context(format!("KV cache group {}", self.model.group_name(g))))?;
        }
        Ok(())
    }

    /// Group `g` seen as a uniform [`ParallelLayout`] (paged attention geometry, block size and
    /// order, tags), for the raw-compatibility checks shared with uniform layouts.
    pub(crate) fn group_as_parallel(&self, g: usize) -> ParallelLayout {
        let gl = &self.groups[g];
        let (heads, head_dim, planes, dtype) =
            self.model.groups[g]
                .kind
                .paged()
                .unwrap_or((1, 1, 1, DType::Bf16));
        ParallelLayout {
            model: ModelKv {
                name: self.model.name.clone(),
                num_layers: self.model.groups[g].layers.len() as u32,
                num_kv_heads: heads,
                head_dim,
                kv_planes: planes,
                dtype,
            },
            spec: ParallelSpec {
                block_size: self.u_block_size(g),
                order: self.u_order(g),
                ..self.spec
            },
            num_blocks: gl.num_blocks,
            physical_layout: gl.physical_layout.clone(),
            block_format: gl.block_format.clone(),
        }
    }

    /// A one-line description: the spec, then each group's block size or `slots`.
    pub fn describe(&self) -> String {
        let g: Vec<String> = (0..self.groups.len())
            .map(|g| {
                let k = &self.model.groups[g].kind;
                if k.is_state() {
                    format!("{}: {} slots", k.name(), self.groups[g].num_blocks)
                } else {
                    format!(
                        "{}: block={} {}",
                        k.name(),
                        self.u_block_size(g),
                        self.u_order(g).name().to_uppercase()
                    )
                }
            })
            .collect();
        format!(
            "TP={} x PCP={} x DP={} [{}]",
            self.spec.tp,
            self.spec.pcp,
            self.spec.dp,
            g.join(", ")
        )
    }
}

#[cfg(test)]
mod tests;
