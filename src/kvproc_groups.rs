//! The prefill and decode halves of `tpu-sync demo --preset NAME` for hybrid models (KV cache
//! groups, [`tpu_sync::layout::groups`]).
//!
//! As for uniform presets, each half owns its PJRT client with one device per rank and real
//! device buffers, one per cache layer, shaped by the layer's own group (so buffers of different
//! groups have different shapes, sizes and block counts). The request moves through the one
//! transfer pipeline ([`tpu_sync::transfer::Pipeline`]): the prefill offers a grouped
//! [`Placement`] ([`Placement::from_groups`]), the decode pulls it into its own grouped
//! placement, resharded, and then checks every byte of every layer buffer of every rank (the
//! request's bytes element by element, everything else unchanged) and reports the bytes of each
//! group, moved against needed.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tpu_sync::layout::{GroupKind, GroupLayout, HybridLayout, HybridModel, ParallelSpec};
use tpu_sync::net::PeerMap;
use tpu_sync::pattern::{GroupedContents, LayerCheck};
use tpu_sync::pjrt::{Client, DeviceBuffer};
use tpu_sync::plan::{HybridPlacement, Placement, Plan};
use tpu_sync::transfer::{KvBuffers, Pipeline};
use tpu_sync::{Error, Result};

use crate::kvproc::{self, Report};
use crate::JobArgs;

/// Spare state slots per rank beyond the request's one (so slot ids can be scattered).
const SPARE_SLOTS: u32 = 2;

/// What one KV cache group moved and needed (decode side).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GroupReport {
    /// Group name.
    pub name: String,
    /// Group kind (`attention`, `sliding_window`, `mla`, `indexer`, `state`).
    pub kind: String,
    /// Cache layers of the group.
    pub layers: u32,
    /// Blocks (slots) per rank of each of the group's buffers on the decode side.
    pub num_blocks: u32,
    /// Bytes the plan moved into the group's buffers.
    pub moved_bytes: u64,
    /// Bytes the decode placement needs for the group, from its geometry alone.
    pub needed_bytes: u64,
    /// Request bytes of the group verified element by element.
    pub verified_bytes: u64,
    /// Differing bytes in the group's buffers (request or background).
    pub mismatches: u64,
}

/// Whether `--preset` names a hybrid model (KV cache groups).
pub fn is_grouped(job: &JobArgs) -> bool {
    tpu_sync::layout::HYBRID_PRESETS.contains(&job.preset.as_str())
}

/// The preset's groups, as this side sees them (`--fault-groups` applied on the decode side).
fn model(job: &JobArgs) -> Result<HybridModel> {
    if job.layers.is_some() {
        return Err(Error::InvalidArgument(format!(
            "--layers applies to uniform presets; `{}` is a hybrid model whose KV cache groups \
             name their layers",
            job.preset
        )));
    }
    HybridModel::preset(&job.preset)
}

/// Applies `--fault-groups KIND` to a model (see `JobArgs::fault_groups`).
fn mutate(m: &mut HybridModel, kind: &str) -> Result<()> {
    match kind {
        "window" => {
            let mut any = false;
            for g in &mut m.groups {
                if let GroupKind::Attention {
                    sliding_window: Some(w),
                    ..
                } = &mut g.kind
                {
                    *w += 16;
                    any = true;
                }
            }
            if !any {
                return Err(Error::InvalidArgument(format!(
                    "--fault-groups window: `{}` has no sliding-window group",
                    m.name
                )));
            }
        }
        "state" => {
            let c = m
                .groups
                .iter_mut()
                .find_map(|g| match &mut g.kind {
                    GroupKind::State { components, .. } => components.first_mut(),
                    _ => None,
                })
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "--fault-groups state: `{}` has no state group",
                        m.name
                    ))
                })?;
            c.rows += 1;
        }
        "missing" => {
            // Drop the group holding the highest cache layers when they are the tail of the
            // layer range (so the rest still numbers its layers 0..n).
            let n = m.num_layers();
            let last = m
                .groups
                .iter()
                .position(|g| {
                    let mut l = g.layers.clone();
                    l.sort_unstable();
                    l.iter()
                        .enumerate()
                        .all(|(i, &x)| x == n - l.len() as u32 + i as u32)
                })
                .filter(|_| m.groups.len() > 1)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "--fault-groups missing: no group of `{}` holds exactly its last layers",
                        m.name
                    ))
                })?;
            m.groups.remove(last);
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "--fault-groups {other}: expected window, state or missing"
            )))
        }
    }
    Ok(())
}

/// A layout with room for the request on every rank plus spare blocks, different per group
/// (so the buffers of different groups hold different numbers of blocks): `2 x held + 5 + g`
/// blocks for paged group `g`, `1 +` [`SPARE_SLOTS`] slots for a state group.
fn sized_layout(m: &HybridModel, spec: ParallelSpec, tokens: u32) -> Result<HybridLayout> {
    let probe = HybridLayout::uniform_blocks(m.clone(), spec, 1)?;
    let groups = (0..m.groups.len())
        .map(|g| -> Result<GroupLayout> {
            if m.groups[g].kind.is_state() {
                return Ok(GroupLayout::new(1 + SPARE_SLOTS));
            }
            let held = (0..spec.pcp)
                .map(|p| probe.held_blocks(g, tokens, p).map(|r| r.len() as u32))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .max()
                .unwrap_or(0);
            Ok(GroupLayout::new(held * 2 + 5 + g as u32))
        })
        .collect::<Result<Vec<_>>>()?;
    HybridLayout::new(m.clone(), spec, groups)
}

/// Scattered block (slot) ids for every group and rank.
fn placement(
    layout: HybridLayout,
    dp_rank: u32,
    tokens: u32,
    seed: u64,
) -> Result<HybridPlacement> {
    let s = layout.spec;
    let block_ids = (0..layout.groups.len())
        .map(|g| {
            (0..s.ranks_per_replica())
                .map(|local| {
                    let n = layout.held_blocks(g, tokens, local / s.tp)?.len() as u32;
                    Ok(kvproc::scattered_ids(
                        layout.groups[g].num_blocks,
                        n,
                        seed ^ ((local as u64) << 20) ^ ((g as u64) << 40),
                    ))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let p = HybridPlacement {
        layout,
        dp_rank,
        block_ids,
        first_token: 0,
        next_token: None,
    };
    p.validate(tokens)?;
    Ok(p)
}

/// The `validate` checks of a grouped job: the model, the token count and both layouts.
pub fn validate(job: &JobArgs) -> Result<()> {
    let m = model(job)?;
    if job.tokens == 0 {
        return Err(Error::InvalidArgument(
            "--tokens 0: the prompt needs at least one token".into(),
        ));
    }
    sized_layout(&m, kvproc::prefill_spec(job)?, job.tokens)?;
    sized_layout(&m, kvproc::decode_spec(job)?, job.tokens)?;
    Ok(())
}

/// The decode-side model checks of a grouped job.
pub fn validate_decode(job: &JobArgs, spec: ParallelSpec) -> Result<()> {
    let mut m = model(job)?;
    if let Some(k) = &job.fault_groups {
        mutate(&mut m, k)?;
    }
    HybridLayout::uniform_blocks(m, spec, 1)?;
    Ok(())
}

/// Device buffers of every rank of `placement.layout` (one per cache layer, each of its group's
/// shape), filled with `salt`'s contents of `placement` (ranks in parallel).
fn make_buffers(
    client: &Client,
    placement: &HybridPlacement,
    tokens: u32,
    salt: u64,
) -> Result<Vec<Vec<DeviceBuffer>>> {
    let l = &placement.layout;
    let ranks = l.num_ranks();
    let n = client.addressable_devices().len();
    if n < ranks as usize {
        return Err(Error::InvalidArgument(format!(
            "the {} client has {n} devices, the layout needs {ranks} ranks",
            client.platform_name()
        )));
    }
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                sc.spawn(move || -> Result<Vec<DeviceBuffer>> {
                    let c = GroupedContents::new(placement, r, tokens, salt)?;
                    let dev = client.device(r as usize)?;
                    (0..l.num_layers())
                        .map(|layer| {
                            let shape = l.layer_shape(layer)?;
                            let mut host = vec![0u8; shape.bytes as usize];
                            c.fill_layer(layer, &mut host)?;
                            client.buffer_from_host(&host, shape.element_type, &shape.dims, &dev)
                        })
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Cancelled("buffer thread panicked".into())))
            })
            .collect()
    })
}

/// Records the plugin's physical layout of each group's buffers in the layout (the first
/// buffer of the group's first layer), so the two sides' raw bytes are compared per group.
fn record_physical(layout: &mut HybridLayout, buffers: &[Vec<DeviceBuffer>]) {
    let Some(bufs) = buffers.first() else { return };
    for (g, grp) in layout.model.groups.iter().enumerate() {
        let first = grp.layers.iter().min().copied().unwrap_or(0) as usize;
        if let Some(p) = bufs.get(first).and_then(|b| b.physical_layout()) {
            layout.groups[g].physical_layout = Some(p.to_string());
        }
    }
}

/// `tpu-sync prefill` of a hybrid preset.
pub fn prefill(
    job: &JobArgs,
    listen: Option<&str>,
    ranks: Option<&[u32]>,
    t0: Instant,
) -> Result<ExitCode> {
    kvproc::validate(job)?;
    let m = model(job)?;
    let spec = kvproc::prefill_spec(job)?;
    let layout = sized_layout(&m, spec, job.tokens)?;
    let mut place = placement(layout.clone(), 0, job.tokens, 0x5052_4546)?;
    if let Some(r) = ranks.and_then(|v| v.iter().find(|r| place.local_rank(**r).is_none())) {
        return Err(Error::InvalidArgument(format!(
            "--ranks: prefill rank {r} does not exist ({} ranks)",
            spec.ranks_per_replica()
        )));
    }
    let (client, caps) =
        kvproc::open_client(job.plugin.as_deref(), Some(layout.num_ranks() as i64))?;
    let buffers = make_buffers(&client, &place, job.tokens, kvproc::PREFILL_SALT)?;
    record_physical(&mut place.layout, &buffers);
    let place = Placement::from_groups(place)?;
    let hosted: BTreeMap<u32, Vec<DeviceBuffer>> = (0..spec.ranks_per_replica())
        .map(|l| place.global_rank(l))
        .filter(|r| ranks.map(|v| v.contains(r)).unwrap_or(true))
        .map(|r| (r, buffers[r as usize].clone()))
        .collect();
    let kv = KvBuffers::new(&caps, hosted)?;
    let report = kvproc::serve_offer(job, listen, ranks, &place, kv, &layout.describe())?;
    kvproc::print_report(&Report {
        role: "prefill".into(),
        platform: client.platform_name().into(),
        api_version: format!("{}.{}", caps.api_version.0, caps.api_version.1),
        devices: client.addressable_devices().len() as u32,
        layout: layout.describe(),
        d2h_path: caps.d2h.to_string(),
        h2d_path: caps.h2d.to_string(),
        lock: kvproc::lock_and_dma(&report),
        device_bytes: report.device_bytes,
        device_ops: report.device_ops,
        device_secs: report.device_time.as_secs_f64(),
        layers: m.num_layers(),
        num_tokens: job.tokens,
        wall_secs: t0.elapsed().as_secs_f64(),
        ..Report::default()
    });
    Ok(ExitCode::SUCCESS)
}

/// The decode half of a hybrid preset, after the prefill described the request.
#[allow(clippy::too_many_arguments)]
pub async fn decode_request(
    job: &JobArgs,
    p: &Pipeline,
    sources: &PeerMap,
    spec: ParallelSpec,
    dp_rank: u32,
    src: Placement,
    num_tokens: u32,
    t0: Instant,
) -> Result<ExitCode> {
    let mut m = model(job)?;
    let mut src = src;
    if let Some(k) = &job.fault_groups {
        // This side's groups differ, and it believes the prefill's differ the same way (so
        // its own plan passes): only the prefill, which re-plans against the groups it
        // registered, can refuse the pull.
        mutate(&mut m, k)?;
        let mut h = src.to_groups();
        let theirs = sized_layout(&m, h.layout.spec, num_tokens)?;
        h = placement(theirs, h.dp_rank, num_tokens, 0x5052_4546)?;
        src = Placement::from_groups(h)?;
    }
    let layout = sized_layout(&m, spec, num_tokens)?;
    let mut dst_h = placement(layout.clone(), dp_rank, num_tokens, 0x4445_434f)?;
    // Plan before touching devices: groups that differ from the prefill's fail here.
    let dst_probe = Placement::from_groups(dst_h.clone())?;
    Plan::build(&src, &dst_probe, num_tokens)?;
    let (client, caps) =
        kvproc::open_client(job.plugin.as_deref(), Some(layout.num_ranks() as i64))?;
    caps.require_h2d()?;
    // Every rank starts with background contents; only the request's bytes may change.
    let background = HybridPlacement {
        dp_rank: u32::MAX,
        block_ids: vec![],
        first_token: 0,
        next_token: None,
        ..dst_h.clone()
    };
    let buffers = make_buffers(&client, &background, num_tokens, kvproc::DECODE_SALT)?;
    record_physical(&mut dst_h.layout, &buffers);
    let dst = Placement::from_groups(dst_h.clone())?;
    let plan = Plan::build(&src, &dst, num_tokens)?;
    let pulled =
        kvproc::pull_replica(p, job, &caps, (&src, sources), &dst, &buffers, num_tokens).await?;

    let per_group = verify(&dst_h, num_tokens, &buffers)?;
    let moved = plan.group_bytes(&dst_h.layout);
    let needed = dst_h.needed_bytes(num_tokens)?;
    let mut total = LayerCheck::default();
    let groups: Vec<GroupReport> = per_group
        .into_iter()
        .enumerate()
        .map(|(g, c)| {
            let grp = &dst_h.layout.model.groups[g];
            let r = GroupReport {
                name: grp.name.clone(),
                kind: grp.kind.name().to_string(),
                layers: grp.layers.len() as u32,
                num_blocks: dst_h.layout.groups[g].num_blocks,
                moved_bytes: moved[g],
                needed_bytes: needed[g],
                verified_bytes: c.request_bytes,
                mismatches: c.mismatches,
            };
            total.merge(c);
            r
        })
        .collect();
    let request_blocks: u64 = dst_h
        .block_ids
        .iter()
        .flatten()
        .map(|v| v.len() as u64)
        .sum();
    let ok = total.mismatches == 0
        && total.request_bytes == pulled.net_bytes
        && pulled.net_bytes == plan.total_bytes()
        && pulled.device_bytes == pulled.net_bytes
        && groups.iter().all(|g| g.moved_bytes == g.needed_bytes);
    kvproc::print_report(&Report {
        role: "decode".into(),
        platform: client.platform_name().into(),
        api_version: format!("{}.{}", caps.api_version.0, caps.api_version.1),
        devices: client.addressable_devices().len() as u32,
        layout: format!("{}, request on DP rank {dp_rank}", layout.describe()),
        d2h_path: caps.d2h.to_string(),
        h2d_path: caps.h2d.to_string(),
        lock: kvproc::lock_and_dma(&pulled),
        device_bytes: pulled.device_bytes,
        device_ops: pulled.device_ops,
        device_secs: pulled.device_time.as_secs_f64(),
        net_bytes: pulled.net_bytes,
        net_spans: pulled.spans,
        net_pairs: pulled.pairs,
        net_stripes: pulled.stripes,
        net_secs: pulled.net_time.as_secs_f64(),
        transport: format!(
            "{} ({})",
            p.endpoint().transport_kind(),
            kvproc::security(job)?.describe()
        ),
        verified_request_bytes: total.request_bytes,
        verified_background_bytes: total.background_bytes,
        mismatches: total.mismatches,
        first_mismatch: total.first_mismatch.clone(),
        request_blocks,
        layers: m.num_layers(),
        num_tokens,
        wall_secs: t0.elapsed().as_secs_f64(),
        groups,
    });
    if !ok {
        errln!(
            "decode: verification FAILED: {} mismatching bytes, {} request bytes checked, {} \
             received, {} written, {} planned; first: {}",
            total.mismatches,
            total.request_bytes,
            pulled.net_bytes,
            pulled.device_bytes,
            plan.total_bytes(),
            total.first_mismatch.as_deref().unwrap_or("-")
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads back every layer buffer of every rank and checks each byte; one check per group.
fn verify(
    dst: &HybridPlacement,
    num_tokens: u32,
    buffers: &[Vec<DeviceBuffer>],
) -> Result<Vec<LayerCheck>> {
    let l = &dst.layout;
    let results: Vec<Result<Vec<LayerCheck>>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..l.num_ranks())
            .map(|r| {
                sc.spawn(move || -> Result<Vec<LayerCheck>> {
                    let c = GroupedContents::new(dst, r, num_tokens, kvproc::DECODE_SALT)?;
                    let mut per_group = vec![LayerCheck::default(); l.groups.len()];
                    for (layer, b) in buffers[r as usize].iter().enumerate() {
                        let layer = layer as u32;
                        let mut host = vec![0u8; c.layer_bytes(layer)? as usize];
                        b.to_host(&mut host)?;
                        let g = l.model.group_of_layer(layer).unwrap_or_default();
                        per_group[g].merge(c.verify_layer(layer, &host)?);
                    }
                    Ok(per_group)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Cancelled("verify thread panicked".into())))
            })
            .collect()
    });
    let mut total = vec![LayerCheck::default(); l.groups.len()];
    for r in results {
        for (t, c) in total.iter_mut().zip(r?) {
            t.merge(c);
        }
    }
    Ok(total)
}
