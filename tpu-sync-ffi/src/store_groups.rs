//! C ABI of the host tier's KV cache groups (`tpu_sync::store::groups`): one stored prefix of a
//! hybrid model made of one part per group per block (full attention and MLA groups: every
//! block; a sliding-window group: the blocks its window covers; a state group: the block at
//! which the state was taken). A hit is the longest prefix every group can serve; a prefix
//! whose window or state part (or one group's block) was evicted reports the shorter hit, never
//! bytes of another prefix. Parts are ordinary committed store blocks, so a re-attached shm
//! segment serves the same hits. See `docs/hybrid.md`, "The host tier".
//!
//! Every call takes the groups as an array of [`tpu_sync_store_group`] (in the model's group
//! order) and the tokens per engine block; parts are split into chunks of at most the store's
//! block size (`block_bytes` of `tpu_sync_store_new`). A one-group [`TPU_SYNC_PART_FULL`]
//! description stores exactly the keys a uniform `tpu_sync_store_put*` does.
//!
//! [`TPU_SYNC_PART_FULL`]: tpu_sync_part_role::TPU_SYNC_PART_FULL

use std::sync::Arc;

use tpu_sync::store::{
    BlockKey, DeviceBlock, GetReport, GroupPart, PartRole, PutReport, StopReason, StoreGroup,
    StoreGroups,
};

use crate::device::slice_arg;
use crate::handle::{self, tpu_sync_handle_kind as K};
use crate::status::{boundary, invalid, null, tpu_sync_status, FfiResult};
use crate::store::{
    device_blocks, device_pieces, get_result, get_store, keys_arg, parent_arg, put_result,
    tpu_sync_device_range, tpu_sync_get_result, tpu_sync_key, tpu_sync_lease, tpu_sync_put_result,
    tpu_sync_store, StoreObj,
};

/// Which blocks of a prompt a group has a part for (`tpu_sync::store::PartRole`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types, clippy::enum_variant_names)]
pub enum tpu_sync_part_role {
    /// Every block (full attention, MLA, indexer): the spine of the prefix.
    TPU_SYNC_PART_FULL = 0,
    /// The blocks holding the tokens a sliding window of `window_tokens` tokens covers at the
    /// end of the prefix (`[T + 1 - w, T)` for a prefix of `T` tokens).
    TPU_SYNC_PART_WINDOW = 1,
    /// A state part at the blocks after which the state was taken; a prefix of `n` blocks
    /// needs the part of block `n - 1`.
    TPU_SYNC_PART_STATE = 2,
}

/// One KV cache group as the host tier sees it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tpu_sync_store_group {
    /// A `tpu_sync_part_role` value.
    pub role: u32,
    /// The sliding window in tokens for `TPU_SYNC_PART_WINDOW` (> 0); ignored otherwise.
    pub window_tokens: u32,
    /// Bytes of one block's part: the group's bytes of one block in every layer of the group
    /// on one rank (> 0).
    pub part_bytes: u64,
}

/// The groups of a call, with chunks of the store's block size; `None` while the store is not
/// ready (its block size is not known yet).
///
/// # Safety
/// `groups` holds `num_groups` entries.
unsafe fn groups_arg(
    s: &StoreObj,
    groups: *const tpu_sync_store_group,
    num_groups: usize,
    block_tokens: u32,
) -> FfiResult<Option<StoreGroups>> {
    // SAFETY: forwarded caller contract.
    let raw = unsafe { slice_arg(groups, num_groups, "groups") }?;
    let mut out = Vec::with_capacity(raw.len());
    for (g, x) in raw.iter().enumerate() {
        let role = match x.role {
            r if r == tpu_sync_part_role::TPU_SYNC_PART_FULL as u32 => PartRole::Full,
            r if r == tpu_sync_part_role::TPU_SYNC_PART_WINDOW as u32 => PartRole::Window {
                tokens: x.window_tokens,
            },
            r if r == tpu_sync_part_role::TPU_SYNC_PART_STATE as u32 => PartRole::State,
            r => return Err(invalid(format!("groups[{g}]: unknown part role {r}"))),
        };
        out.push(StoreGroup {
            role,
            part_bytes: x.part_bytes,
        });
    }
    let Some(chunk) = s.store.block_bytes() else {
        return Ok(None);
    };
    Ok(Some(StoreGroups::new(out, block_tokens, chunk)?))
}

/// The groups and the key chain every grouped call takes (`groups_arg`, then `keys_arg`).
///
/// # Safety
/// `groups` holds `num_groups` entries, `keys` `num_keys`.
unsafe fn chain_args(
    s: &StoreObj,
    groups: *const tpu_sync_store_group,
    num_groups: usize,
    block_tokens: u32,
    keys: *const tpu_sync_key,
    num_keys: usize,
) -> FfiResult<(Option<StoreGroups>, Vec<BlockKey>)> {
    // SAFETY: forwarded caller contract.
    let g = unsafe { groups_arg(s, groups, num_groups, block_tokens) }?;
    // SAFETY: forwarded caller contract.
    let keys = unsafe { keys_arg(keys, num_keys) }?;
    Ok((g, keys))
}

/// Pairs each part's `(block, group)` with its device data, in order.
fn group_parts<'a>(
    at: &[(usize, usize)],
    data: Vec<DeviceBlock<'a>>,
) -> Vec<GroupPart<DeviceBlock<'a>>> {
    at.iter()
        .zip(data)
        .map(|(&(block, group), data)| GroupPart { block, group, data })
        .collect()
}

/// `(block, group)` of every part, checked against the chain and the groups.
///
/// # Safety
/// `part_blocks` and `part_groups` hold `num_parts` entries.
unsafe fn parts_arg(
    groups: &StoreGroups,
    chain: &[BlockKey],
    part_blocks: *const usize,
    part_groups: *const u32,
    num_parts: usize,
) -> FfiResult<Vec<(usize, usize)>> {
    // SAFETY: forwarded caller contract.
    let (b, g) = unsafe {
        (
            slice_arg(part_blocks, num_parts, "part_blocks")?,
            slice_arg(part_groups, num_parts, "part_groups")?,
        )
    };
    b.iter()
        .zip(g)
        .enumerate()
        .map(|(i, (&b, &g))| {
            if b >= chain.len() || g as usize >= groups.groups().len() {
                Err(invalid(format!(
                    "part {i}: block {b} of {} keys, group {g} of {} groups",
                    chain.len(),
                    groups.groups().len()
                )))
            } else {
                Ok((b, g as usize))
            }
        })
        .collect()
}

/// The longest prefix of the chain `keys[0..num_keys]` (block keys of consecutive blocks from
/// the start of a sequence) that every group can serve, in blocks, written to `hit_out`
/// (touches the parts of the hit; a part found incomplete is removed whole). 0 while the store
/// is not ready.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for no groups, an unknown role, a part of 0 bytes, a
/// window of 0 tokens or 0 tokens per block.
///
/// # Safety
/// `groups` holds `num_groups` entries, `keys` `num_keys`; `hit_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_lookup_groups(
    store: *const tpu_sync_store,
    groups: *const tpu_sync_store_group,
    num_groups: usize,
    block_tokens: u32,
    keys: *const tpu_sync_key,
    num_keys: usize,
    hit_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_lookup_groups", || {
        let s = get_store(store)?;
        if hit_out.is_null() {
            return Err(null("hit_out"));
        }
        // SAFETY: forwarded caller contract.
        let (g, keys) =
            unsafe { chain_args(&s, groups, num_groups, block_tokens, keys, num_keys) }?;
        let hit = g
            .map(|g| s.store.lookup_groups(&g, &keys).blocks)
            .unwrap_or(0);
        // SAFETY: checked non-NULL.
        unsafe { *hit_out = hit };
        Ok(())
    })
}

/// Pins every part a hit of `blocks` leading blocks of the chain needs (never evicted while
/// the lease lives, so a grouped get of them cannot miss). `lease_out` receives a new lease
/// handle owned by the caller (free it with `tpu_sync_lease_free` to unpin), or NULL when not
/// every such part is present (nothing pinned) or the store is not ready.
///
/// Errors: as `tpu_sync_store_lookup_groups`.
///
/// # Safety
/// `groups` holds `num_groups` entries, `keys` `num_keys`; `lease_out` writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tpu_sync_store_pin_groups(
    store: *const tpu_sync_store,
    groups: *const tpu_sync_store_group,
    num_groups: usize,
    block_tokens: u32,
    keys: *const tpu_sync_key,
    num_keys: usize,
    blocks: usize,
    lease_out: *mut *mut tpu_sync_lease,
) -> tpu_sync_status {
    boundary("tpu_sync_store_pin_groups", || {
        let s = get_store(store)?;
        if lease_out.is_null() {
            return Err(null("lease_out"));
        }
        // SAFETY: forwarded caller contract.
        let (g, keys) =
            unsafe { chain_args(&s, groups, num_groups, block_tokens, keys, num_keys) }?;
        let lease = g.and_then(|g| s.store.pin_groups(&g, &keys, blocks));
        let h = match lease {
            Some(l) => handle::insert(K::TPU_SYNC_HANDLE_LEASE, Arc::new(l)),
            None => std::ptr::null_mut(),
        };
        // SAFETY: checked non-NULL.
        unsafe { *lease_out = h };
        Ok(())
    })
}

/// Stores parts of the blocks of the chain `keys[0..num_keys]` from PJRT device memory (D2H,
/// completed before the call returns). Part `i` is group `part_groups[i]`'s part of block
/// `part_blocks[i]`: the concatenation, in order, of the `pieces_per_part[i]` next ranges of
/// `pieces` (the group's block in each of its layers), exactly the group's `part_bytes`. Every
/// `TPU_SYNC_PART_FULL` group's part of every block is required; window and state parts are
/// optional. `parent` is the key of the block before `keys[0]` (NULL at a sequence's start).
/// Parts already present are not written again; a lack of room is not an error
/// (`result_out->full_at`: the first block whose full-group parts were not stored; window or
/// state parts not stored for lack of room are counted in `missed_out`, optional).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for the groups (as `tpu_sync_store_lookup_groups`), a
/// part of the wrong size, block or group, a part given twice, a missing full-group part, a
/// range outside a buffer; `TPU_SYNC_PJRT`.
///
/// # Safety
/// `groups` holds `num_groups` entries, `keys` `num_keys`, `part_blocks`, `part_groups` and
/// `pieces_per_part` `num_parts`, `pieces` `num_pieces`; `parent` NULL or readable;
/// `result_out` writable; `missed_out` NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tpu_sync_store_put_groups_from_device(
    store: *const tpu_sync_store,
    groups: *const tpu_sync_store_group,
    num_groups: usize,
    block_tokens: u32,
    parent: *const tpu_sync_key,
    keys: *const tpu_sync_key,
    num_keys: usize,
    part_blocks: *const usize,
    part_groups: *const u32,
    num_parts: usize,
    pieces: *const tpu_sync_device_range,
    num_pieces: usize,
    pieces_per_part: *const usize,
    result_out: *mut tpu_sync_put_result,
    missed_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_put_groups_from_device", || {
        let s = get_store(store)?;
        if result_out.is_null() {
            return Err(null("result_out"));
        }
        // SAFETY: forwarded caller contract.
        let (g, keys) =
            unsafe { chain_args(&s, groups, num_groups, block_tokens, keys, num_keys) }?;
        let Some(g) = g else {
            let r = PutReport {
                not_ready: true,
                ..PutReport::default()
            };
            // SAFETY: checked non-NULL; caller contract for the optional one.
            unsafe {
                *result_out = put_result(r);
                if !missed_out.is_null() {
                    *missed_out = 0;
                }
            }
            return Ok(());
        };
        // SAFETY: forwarded caller contract.
        let at = unsafe { parts_arg(&g, &keys, part_blocks, part_groups, num_parts) }?;
        // SAFETY: forwarded caller contract.
        let (bufs, ranges, per) =
            unsafe { device_pieces(pieces, num_pieces, pieces_per_part, num_parts) }?;
        let data = device_blocks(&bufs, &ranges, &per);
        let parts = group_parts(&at, data);
        // SAFETY: forwarded caller contract.
        let parent = unsafe { parent_arg(parent) };
        let r = s.store.put_groups_from_device(&g, parent, &keys, &parts)?;
        let missed = r.missed.len();
        let pr = PutReport {
            stored: r.stored,
            present: r.present,
            full_at: r.full_at,
            not_ready: r.not_ready,
            bytes: r.bytes,
        };
        // SAFETY: checked non-NULL; caller contract for the optional one.
        unsafe {
            *result_out = put_result(pr);
            if !missed_out.is_null() {
                *missed_out = missed;
            }
        }
        Ok(())
    })
}

/// Copies parts of the chain `keys[0..num_keys]` into existing device blocks in place (H2D by
/// the buffers' client's probed path, completed before the call returns), in order: part `i`
/// (group `part_groups[i]`'s part of block `part_blocks[i]`) goes to the `pieces_per_part[i]`
/// next ranges of `pieces`. Stops at the first part not wholly present;
/// `result_out->delivered` counts the leading parts delivered whole (`bytes` their bytes,
/// `stop` why it stopped). Pin the parts first (`tpu_sync_store_pin_groups`) to rule out a
/// concurrent eviction.
///
/// Errors: as `tpu_sync_store_get_to_device`, and `TPU_SYNC_INVALID_ARGUMENT` for the groups or
/// a part of the wrong size, block or group.
///
/// # Safety
/// As `tpu_sync_store_put_groups_from_device` (no `parent`, `missed_out`); `result_out`
/// writable. No computation may use the destination ranges during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tpu_sync_store_get_groups_to_device(
    store: *const tpu_sync_store,
    groups: *const tpu_sync_store_group,
    num_groups: usize,
    block_tokens: u32,
    keys: *const tpu_sync_key,
    num_keys: usize,
    part_blocks: *const usize,
    part_groups: *const u32,
    num_parts: usize,
    pieces: *const tpu_sync_device_range,
    num_pieces: usize,
    pieces_per_part: *const usize,
    result_out: *mut tpu_sync_get_result,
) -> tpu_sync_status {
    boundary("tpu_sync_store_get_groups_to_device", || {
        let s = get_store(store)?;
        if result_out.is_null() {
            return Err(null("result_out"));
        }
        // SAFETY: forwarded caller contract.
        let (g, keys) =
            unsafe { chain_args(&s, groups, num_groups, block_tokens, keys, num_keys) }?;
        let Some(g) = g else {
            let r = GetReport {
                stop: Some(StopReason::NotReady),
                ..GetReport::default()
            };
            // SAFETY: checked non-NULL.
            unsafe { *result_out = get_result(r) };
            return Ok(());
        };
        // SAFETY: forwarded caller contract.
        let at = unsafe { parts_arg(&g, &keys, part_blocks, part_groups, num_parts) }?;
        // SAFETY: forwarded caller contract.
        let (bufs, ranges, per) =
            unsafe { device_pieces(pieces, num_pieces, pieces_per_part, num_parts) }?;
        let Some(first) = bufs.first() else {
            if num_parts > 0 {
                return Err(invalid(format!(
                    "{num_parts} parts but no device pieces to write them to"
                )));
            }
            // SAFETY: checked non-NULL.
            unsafe { *result_out = get_result(GetReport::default()) };
            return Ok(());
        };
        if let Some(i) = bufs.iter().position(|b| b.caps.plugin != first.caps.plugin) {
            return Err(invalid(format!(
                "piece {i}: buffer of plugin {} among buffers of plugin {}",
                bufs[i].caps.plugin, first.caps.plugin
            )));
        }
        let data = device_blocks(&bufs, &ranges, &per);
        let parts = group_parts(&at, data);
        let r = s
            .store
            .get_groups_to_device(&first.caps, &g, &keys, &parts)?;
        let gr = GetReport {
            delivered: r.delivered,
            bytes: r.bytes,
            stop: r.stop,
            ..GetReport::default()
        };
        // SAFETY: checked non-NULL.
        unsafe { *result_out = get_result(gr) };
        Ok(())
    })
}
