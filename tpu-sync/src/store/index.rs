//! The store's index and eviction policy: pure bookkeeping, no I/O and no memory access.
//!
//! [`Index`] maps block keys to entries. An entry is **resident** when it has a committed copy in
//! DRAM (a slot of the arena) or on disk; only resident, uncorrupted entries are **visible** to
//! [`Index::lookup`]. It tracks, for every block, its parent (the previous block of its chain), its
//! recency (a logical tick), its pin count, and where its copies are; for every parent key it
//! counts the children with a DRAM copy and the children that exist at all.
//!
//! # Eviction policy
//!
//! * **LRU among safe victims.** DRAM victims are taken in increasing tick order from the set of
//!   *DRAM candidates*: committed DRAM copies, unpinned, not already being evicted, and either with
//!   no child in DRAM, or with a disk copy, or (with a disk tier) spillable: leaving DRAM for disk
//!   keeps a block resident. When a spill is impossible (the disk tier is full of blocks that
//!   cannot go), only a candidate with no resident child is dropped. Disk victims likewise come
//!   from the *disk candidates*: unpinned disk copies whose block either also has a DRAM copy or
//!   has no resident child at all.
//! * **Prefixes stay usable.** A block is never removed from the store while a later block of its
//!   chain stays resident: a suffix without its prefix can never hit, since `lookup` counts leading
//!   blocks. Without a disk tier a DRAM victim is therefore always a leaf of its chain tree.
//! * **Recency** is updated by [`Index::touch`], which the store calls on lookup, get and put. It
//!   gives the deepest block of a chain the *oldest* of the new ticks, so that among a chain's
//!   blocks the tail is evicted first.
//! * **Pinned** entries (leases, and blocks an operation is using) are never victims. When no
//!   victim exists, [`Index::take_slot`] answers [`Take::NoSpace`] and the put reports "full".
//!
//! Every DRAM slot that stops holding a committed block is queued in the *invalidate* list (drain
//! it with [`Index::drain_invalidated`]; the store marks those slots "not committed" in shared
//! memory at once, so that neither an optimistic reader nor a restarted process serves them). Disk
//! copies removed are queued in the *unlink* list ([`Index::drain_unlink`]).
//!
//! Costs: lookups and touches are O(log n) per block (hash map + ordered sets); removing a
//! corrupt block's descendants and [`Index::clear`] are O(n).
//!
//! Thread-safety: none inside; the store keeps the index behind one mutex.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Index of an entry inside the index (stable while the entry exists).
pub type EntryId = u32;

/// Marker of a slot not yet assigned (a fill waiting for an evicted slot).
pub const PENDING_SLOT: u32 = u32::MAX;

/// A hasher for 128-bit keys that are already hashes: one folded multiply.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 ^= (v as u64) ^ ((v >> 64) as u64);
    }
    fn finish(&self) -> u64 {
        let x = (self.0 as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (x as u64) ^ ((x >> 64) as u64)
    }
}

type KeyMap<V> = HashMap<u128, V, BuildHasherDefault<KeyHasher>>;

/// Where an entry's DRAM copy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dram {
    /// No DRAM copy.
    Absent,
    /// Being written (a put) or loaded from disk (a promotion) into `slot`; not readable yet.
    /// `slot` is [`PENDING_SLOT`] until an evicted slot is handed over.
    Filling {
        /// The slot, or [`PENDING_SLOT`].
        slot: u32,
    },
    /// Committed in `slot` with generation `gen` (the slot's sequence number at commit).
    Present {
        /// The slot.
        slot: u32,
        /// The slot's committed sequence number.
        gen: u64,
    },
}

/// One block's bookkeeping.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The block key.
    pub key: u128,
    /// The previous block of the chain, if known.
    pub parent: Option<u128>,
    /// Last use (logical clock).
    pub tick: u64,
    /// Leases and in-flight operations holding the block.
    pub pins: u32,
    /// The DRAM copy.
    pub dram: Dram,
    /// The DRAM copy is being evicted (spilled to disk); still readable until the slot moves.
    pub evicting: bool,
    /// A committed disk copy exists.
    pub on_disk: bool,
    /// Found corrupt while pinned: invisible, removed at the last unpin.
    pub corrupt: bool,
    /// Stored length in bytes.
    pub len: u64,
    /// xxh3-64 of the stored bytes.
    pub checksum: u64,
    live: bool,
    in_dram_lru: bool,
    in_disk_lru: bool,
}

impl Entry {
    /// Resident and not corrupt: counted by lookups.
    pub fn visible(&self) -> bool {
        !self.corrupt && (matches!(self.dram, Dram::Present { .. }) || self.on_disk)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Family {
    /// Children with a DRAM copy or a DRAM fill in progress.
    dram: u32,
    /// Children that exist (any state).
    any: u32,
}

/// Result of [`Index::lookup`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LookupCount {
    /// Leading visible blocks.
    pub hits: usize,
    /// Of those, with a committed DRAM copy.
    pub in_dram: usize,
    /// Of those, on disk only.
    pub disk_only: usize,
}

/// Result of [`Index::begin_put`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin {
    /// The key is already visible.
    Present(EntryId),
    /// Another put of the same key is in progress.
    InFlight,
    /// A new entry in [`Dram::Filling`] with a pending slot, one pin held by the caller.
    Started(EntryId),
}

/// A DRAM copy chosen for eviction whose bytes must first be written to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Victim {
    /// The entry.
    pub id: EntryId,
    /// Its key.
    pub key: u128,
    /// The slot it occupies (handed to the requester once the spill is done).
    pub slot: u32,
}

/// Result of [`Index::take_slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// A slot ready for writing: a free one, or one whose block was just evicted without a spill
    /// (`evicted` names it).
    Slot {
        /// The slot.
        slot: u32,
        /// The key evicted from it, if any.
        evicted: Option<u128>,
    },
    /// A victim that must be spilled to disk first; call [`Index::finish_spill`] afterwards.
    Spill(Victim),
    /// Every DRAM copy is pinned, in use, or protects a later block of its chain.
    NoSpace,
}

/// A block gained or lost its copy in one tier (recorded only while
/// [`Index::record_changes`] is on; the host tier's KV events are built from these, in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// The block.
    pub key: u128,
    /// The block before it in its chain.
    pub parent: Option<u128>,
    /// `false`: the DRAM copy; `true`: the disk copy.
    pub disk: bool,
    /// The copy became readable (`true`) or went away (`false`).
    pub stored: bool,
}

/// Summary of entries dropped by [`Index::drop_entry`], [`Index::remove`] and [`Index::clear`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Keys no longer resident.
    pub keys: Vec<u128>,
}

/// The index (see the module docs).
#[derive(Debug)]
pub struct Index {
    entries: Vec<Entry>,
    free_ids: Vec<EntryId>,
    map: KeyMap<EntryId>,
    fam: KeyMap<Family>,
    dram_lru: BTreeSet<(u64, EntryId)>,
    disk_lru: BTreeSet<(u64, EntryId)>,
    free_slots: Vec<u32>,
    num_slots: u32,
    tick: u64,
    disk_capacity: Option<u64>,
    disk_count: u64,
    disk_reserved: u64,
    dram_count: u64,
    invalidate: Vec<u32>,
    unlink: Vec<u128>,
    /// Keys of entries removed since the last [`Index::drain_gone`], while tracking is on.
    gone: Option<Vec<u128>>,
    changes: Option<Vec<Change>>,
}

impl Index {
    /// An empty index over `num_slots` DRAM slots (all free) and, when `disk_capacity` is
    /// `Some(n)`, a disk tier of at most `n` blocks.
    pub fn new(num_slots: u32, disk_capacity: Option<u64>) -> Index {
        let mut ix = Index::empty(num_slots, disk_capacity);
        ix.free_slots = (0..num_slots).rev().collect();
        ix
    }

    fn empty(num_slots: u32, disk_capacity: Option<u64>) -> Index {
        Index {
            entries: Vec::new(),
            free_ids: Vec::new(),
            map: KeyMap::default(),
            fam: KeyMap::default(),
            dram_lru: BTreeSet::new(),
            disk_lru: BTreeSet::new(),
            free_slots: Vec::new(),
            num_slots,
            tick: 1,
            disk_capacity,
            disk_count: 0,
            disk_reserved: 0,
            dram_count: 0,
            invalidate: Vec::new(),
            unlink: Vec::new(),
            gone: None,
            changes: None,
        }
    }

    /// Rebuilds an index from the committed slots of a re-attached segment and the block files of
    /// a disk tier. `dram` items are `(slot, key, parent, gen, len, checksum, tick)`; `disk` items
    /// are `(key, parent, len, checksum, tick)`. A key found in two slots keeps the newer one (the
    /// other slot is queued for invalidation). Slots not named are free. The clock continues after
    /// the largest tick seen.
    #[allow(clippy::type_complexity)]
    pub fn restore(
        num_slots: u32,
        disk_capacity: Option<u64>,
        dram: impl IntoIterator<Item = (u32, u128, Option<u128>, u64, u64, u64, u64)>,
        disk: impl IntoIterator<Item = (u128, Option<u128>, u64, u64, u64)>,
    ) -> Index {
        let mut ix = Index::empty(num_slots, disk_capacity);
        let mut used = vec![false; num_slots as usize];
        let mut max_tick = 0;
        for (slot, key, parent, gen, len, checksum, tick) in dram {
            if slot >= num_slots || used[slot as usize] {
                continue;
            }
            max_tick = max_tick.max(tick);
            if let Some(&id) = ix.map.get(&key) {
                // Duplicate key: keep the newer copy.
                let e = &ix.entries[id as usize];
                if e.tick >= tick {
                    ix.invalidate.push(slot);
                    continue;
                }
                if let Dram::Present { slot: old, .. } = e.dram {
                    used[old as usize] = false;
                    ix.invalidate.push(old);
                }
                ix.set_dram(id, Dram::Absent);
                ix.set_dram(id, Dram::Present { slot, gen });
                let e = &mut ix.entries[id as usize];
                e.len = len;
                e.checksum = checksum;
                e.tick = tick;
            } else {
                let id = ix.insert(key, parent, tick);
                ix.set_dram(id, Dram::Present { slot, gen });
                let e = &mut ix.entries[id as usize];
                e.len = len;
                e.checksum = checksum;
            }
            used[slot as usize] = true;
        }
        for (key, parent, len, checksum, tick) in disk {
            max_tick = max_tick.max(tick);
            let id = match ix.map.get(&key) {
                Some(&id) => {
                    let e = &ix.entries[id as usize];
                    if e.on_disk || e.len != len || e.checksum != checksum {
                        // Same key, different bytes: the DRAM copy wins, the file goes.
                        if !e.on_disk {
                            ix.unlink.push(key);
                        }
                        continue;
                    }
                    id
                }
                None => ix.insert(key, parent, tick),
            };
            if let Some(cap) = ix.disk_capacity {
                if ix.disk_count >= cap {
                    ix.unlink.push(key);
                    if !ix.entries[id as usize].visible()
                        && ix.entries[id as usize].dram == Dram::Absent
                    {
                        ix.remove_entry(id);
                    }
                    continue;
                }
            }
            let e = &mut ix.entries[id as usize];
            e.on_disk = true;
            e.len = len;
            e.checksum = checksum;
            ix.disk_count += 1;
        }
        ix.free_slots = (0..num_slots)
            .rev()
            .filter(|&s| !used[s as usize])
            .collect();
        ix.tick = max_tick + 1;
        let ids: Vec<EntryId> = ix.live_ids().collect();
        for id in ids {
            ix.refresh(id);
        }
        ix
    }

    // ----- queries -----

    /// Number of DRAM slots.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// Free DRAM slots.
    pub fn free_slots(&self) -> usize {
        self.free_slots.len()
    }

    /// Entries with a committed DRAM copy.
    pub fn dram_blocks(&self) -> u64 {
        self.dram_count
    }

    /// Entries with a committed disk copy.
    pub fn disk_blocks(&self) -> u64 {
        self.disk_count
    }

    /// Entries that exist (resident, filling, or pinned-corrupt).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no entry exists.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The current logical clock.
    pub fn clock(&self) -> u64 {
        self.tick
    }

    /// The entry of `key`, if one exists (visible or not).
    pub fn find(&self, key: u128) -> Option<EntryId> {
        self.map.get(&key).copied()
    }

    /// An entry by id. Panics on an id that does not exist (ids come from this index).
    pub fn entry(&self, id: EntryId) -> &Entry {
        let e = &self.entries[id as usize];
        debug_assert!(e.live);
        e
    }

    /// Ids of every existing entry.
    pub fn live_ids(&self) -> impl Iterator<Item = EntryId> + '_ {
        self.map.values().copied()
    }

    /// Number of leading `keys` that are visible; touches them (see the module docs).
    pub fn lookup(&mut self, keys: &[u128]) -> LookupCount {
        let mut c = LookupCount::default();
        let mut ids = Vec::with_capacity(keys.len().min(256));
        for k in keys {
            match self.map.get(k) {
                Some(&id) if self.entries[id as usize].visible() => {
                    c.hits += 1;
                    if matches!(self.entries[id as usize].dram, Dram::Present { .. }) {
                        c.in_dram += 1;
                    } else {
                        c.disk_only += 1;
                    }
                    ids.push(id);
                }
                _ => break,
            }
        }
        self.touch(&ids);
        c
    }

    /// Marks `ids` (leading blocks of one chain, in chain order) as just used: the last id gets
    /// the oldest of the new ticks and the first the newest, so a chain's tail is evicted first.
    pub fn touch(&mut self, ids: &[EntryId]) {
        for &id in ids.iter().rev() {
            let t = self.tick;
            self.tick += 1;
            self.set_tick(id, t);
        }
    }

    // ----- pins -----

    /// Adds a pin (a lease or an in-flight use): the entry is no eviction candidate until the
    /// matching [`Index::unpin`].
    pub fn pin(&mut self, id: EntryId) {
        self.entries[id as usize].pins += 1;
        self.refresh(id);
    }

    /// Releases a pin. A corrupt entry whose last pin goes is removed.
    pub fn unpin(&mut self, id: EntryId) {
        let e = &mut self.entries[id as usize];
        debug_assert!(e.live && e.pins > 0);
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 && e.corrupt {
            self.drop_copies(id, true);
        } else {
            self.refresh(id);
        }
    }

    // ----- puts and promotions -----

    /// Starts storing `key` (child of `parent`): a new entry in [`Dram::Filling`] with a pending
    /// slot and one pin held by the caller (released by [`Index::commit_fill`] /
    /// [`Index::abort_fill`]). The entry already counts as a child of `parent`, so the parent is
    /// protected from eviction from here on.
    pub fn begin_put(&mut self, key: u128, parent: Option<u128>) -> Begin {
        if let Some(&id) = self.map.get(&key) {
            let e = &self.entries[id as usize];
            return if e.visible() {
                Begin::Present(id)
            } else {
                Begin::InFlight
            };
        }
        let t = self.tick;
        self.tick += 1;
        let id = self.insert(key, parent, t);
        self.entries[id as usize].pins = 1;
        self.set_dram(id, Dram::Filling { slot: PENDING_SLOT });
        Begin::Started(id)
    }

    /// Starts loading the disk copy of visible entry `id` into DRAM. Returns false (and changes
    /// nothing) unless the entry is on disk and has no DRAM copy or fill. On true, the entry is
    /// in [`Dram::Filling`] with a pending slot and holds one pin for the caller.
    pub fn begin_promote(&mut self, id: EntryId) -> bool {
        let e = &self.entries[id as usize];
        if !e.live || !e.on_disk || e.corrupt || e.dram != Dram::Absent {
            return false;
        }
        self.entries[id as usize].pins += 1;
        self.set_dram(id, Dram::Filling { slot: PENDING_SLOT });
        true
    }

    /// Finds a DRAM slot for a fill: a free slot, else the least recently used DRAM candidate.
    ///
    /// A candidate that is on disk (or, with no disk tier, any candidate) is evicted at once and
    /// its slot returned. A candidate that must be spilled first is returned as [`Take::Spill`]
    /// when the disk tier has room (disk victims are evicted to make it); when it has none, a
    /// candidate with no resident child is dropped instead, and one with children is skipped.
    pub fn take_slot(&mut self) -> Take {
        if let Some(s) = self.free_slots.pop() {
            return Take::Slot {
                slot: s,
                evicted: None,
            };
        }
        let mut skipped: Vec<(u64, EntryId)> = Vec::new();
        let result = loop {
            let Some(&(t, id)) = self.dram_lru.iter().next() else {
                break Take::NoSpace;
            };
            let e = &self.entries[id as usize];
            let Dram::Present { slot, .. } = e.dram else {
                unreachable!("DRAM candidates are committed");
            };
            let key = e.key;
            if e.on_disk || self.disk_capacity.is_none() {
                // Drop the DRAM copy; the block stays resident on disk, or (no disk tier) the
                // candidate rule guarantees it is a leaf.
                self.set_dram(id, Dram::Absent);
                self.invalidate.push(slot);
                if !self.entries[id as usize].visible() {
                    self.remove_entry(id);
                } else {
                    self.refresh(id);
                }
                break Take::Slot {
                    slot,
                    evicted: Some(key),
                };
            }
            if self.reserve_disk() {
                self.entries[id as usize].evicting = true;
                self.refresh(id);
                break Take::Spill(Victim { id, key, slot });
            }
            if self.fam.get(&key).map_or(0, |f| f.any) == 0 {
                // No room on disk and nothing depends on it: drop it.
                self.set_dram(id, Dram::Absent);
                self.invalidate.push(slot);
                self.remove_entry(id);
                break Take::Slot {
                    slot,
                    evicted: Some(key),
                };
            }
            // Cannot be dropped (a resident suffix depends on it) and cannot be spilled.
            self.dram_lru.remove(&(t, id));
            self.entries[id as usize].in_dram_lru = false;
            skipped.push((t, id));
        };
        for (t, id) in skipped {
            if self.entries[id as usize].live {
                self.entries[id as usize].in_dram_lru = true;
                self.dram_lru.insert((t, id));
            }
        }
        result
    }

    /// Ends the spill of victim `v`: on success its disk copy is committed and its DRAM copy
    /// dropped, and the slot is returned for the waiting fill; on failure the block keeps its
    /// DRAM copy (it is not dropped, since a spill failure is no reason to lose data) and `None`
    /// is returned.
    pub fn finish_spill(&mut self, v: Victim, spilled: bool) -> Option<u32> {
        self.disk_reserved = self.disk_reserved.saturating_sub(1);
        let id = v.id;
        self.entries[id as usize].evicting = false;
        if self.entries[id as usize].corrupt {
            // Dropped while it was being spilled: discard the copy just written.
            if spilled {
                self.unlink.push(v.key);
            }
            self.set_dram(id, Dram::Absent);
            self.invalidate.push(v.slot);
            if self.entries[id as usize].pins == 0 {
                self.remove_entry(id);
            }
            return Some(v.slot);
        }
        if !spilled {
            // Make it the most recent block so the next attempt picks another victim.
            let t = self.tick;
            self.tick += 1;
            self.set_tick(id, t);
            self.refresh(id);
            return None;
        }
        self.entries[id as usize].on_disk = true;
        self.note(id, true, true);
        self.disk_count += 1;
        self.set_dram(id, Dram::Absent);
        self.invalidate.push(v.slot);
        self.refresh(id);
        self.enforce_disk_capacity();
        Some(v.slot)
    }

    /// Gives filling entry `id` its slot.
    pub fn assign_slot(&mut self, id: EntryId, slot: u32) {
        debug_assert!(matches!(
            self.entries[id as usize].dram,
            Dram::Filling { slot: PENDING_SLOT }
        ));
        self.entries[id as usize].dram = Dram::Filling { slot };
    }

    /// Returns an unused slot (one taken by [`Index::take_slot`] but not assigned) to the free
    /// list.
    pub fn release_slot(&mut self, slot: u32) {
        debug_assert!(slot < self.num_slots);
        self.invalidate.push(slot);
        self.free_slots.push(slot);
    }

    /// Commits a fill: the DRAM copy in its slot is now readable with generation `gen`. Releases
    /// the caller's pin.
    pub fn commit_fill(&mut self, id: EntryId, gen: u64, len: u64, checksum: u64) {
        let Dram::Filling { slot } = self.entries[id as usize].dram else {
            panic!("commit_fill of an entry that is not filling");
        };
        debug_assert_ne!(slot, PENDING_SLOT);
        {
            let e = &mut self.entries[id as usize];
            e.len = len;
            e.checksum = checksum;
        }
        self.set_dram(id, Dram::Present { slot, gen });
        self.unpin(id);
    }

    /// Abandons a fill (copy failed, no slot found, or a promotion read a bad file). Its slot, if
    /// any, goes back to the free list; the entry is removed unless it stays resident on disk.
    /// Releases the caller's pin.
    pub fn abort_fill(&mut self, id: EntryId) {
        let Dram::Filling { slot } = self.entries[id as usize].dram else {
            panic!("abort_fill of an entry that is not filling");
        };
        self.set_dram(id, Dram::Absent);
        if slot != PENDING_SLOT {
            self.release_slot(slot);
        }
        let e = &mut self.entries[id as usize];
        e.pins -= 1;
        if !e.visible() && e.pins == 0 {
            self.remove_entry(id);
        } else {
            self.refresh(id);
        }
    }

    /// Records that a disk copy of committed entry `id` was written (a flush). Disk capacity is
    /// enforced afterwards (queueing files to unlink). False if the disk tier is full of blocks
    /// that cannot be evicted (the written file must then be deleted by the caller).
    pub fn add_disk_copy(&mut self, id: EntryId) -> bool {
        if self.entries[id as usize].on_disk {
            return true;
        }
        if !self.reserve_disk() {
            return false;
        }
        self.disk_reserved -= 1;
        self.entries[id as usize].on_disk = true;
        self.note(id, true, true);
        self.disk_count += 1;
        self.refresh(id);
        true
    }

    /// Whether a disk copy could be reserved now, evicting disk victims to make room. Always
    /// false without a disk tier.
    fn reserve_disk(&mut self) -> bool {
        let Some(cap) = self.disk_capacity else {
            return false;
        };
        while self.disk_count + self.disk_reserved >= cap {
            if !self.evict_one_disk() {
                return false;
            }
        }
        self.disk_reserved += 1;
        true
    }

    fn enforce_disk_capacity(&mut self) {
        if let Some(cap) = self.disk_capacity {
            while self.disk_count + self.disk_reserved > cap {
                if !self.evict_one_disk() {
                    break;
                }
            }
        }
    }

    fn evict_one_disk(&mut self) -> bool {
        let Some(&(_, id)) = self.disk_lru.iter().next() else {
            return false;
        };
        self.drop_disk_copy(id);
        true
    }

    /// Removes the disk copy of `id` (queued for unlink); the entry goes if nothing else holds it.
    fn drop_disk_copy(&mut self, id: EntryId) {
        let e = &mut self.entries[id as usize];
        if !e.on_disk {
            return;
        }
        e.on_disk = false;
        self.disk_count -= 1;
        self.unlink.push(e.key);
        self.note(id, true, false);
        let gone = !self.entries[id as usize].visible()
            && self.entries[id as usize].dram == Dram::Absent
            && self.entries[id as usize].pins == 0;
        if gone {
            self.remove_entry(id);
        } else {
            self.refresh(id);
        }
    }

    /// Drops a block found corrupt or unreadable (DRAM and disk copies), and every unpinned block
    /// of its chain below it (they can no longer hit). A pinned block is marked corrupt and
    /// removed at its last unpin. O(n).
    pub fn drop_entry(&mut self, id: EntryId) -> Dropped {
        let mut out = Dropped::default();
        let root = self.entries[id as usize].key;
        // Parent -> children over every entry, then a walk from the root.
        let mut kids: KeyMap<Vec<EntryId>> = KeyMap::default();
        for (&k, &i) in &self.map {
            if let Some(p) = self.entries[i as usize].parent {
                if k != root {
                    kids.entry(p).or_default().push(i);
                }
            }
        }
        let mut stack = vec![id];
        let mut first = true;
        while let Some(i) = stack.pop() {
            let key = self.entries[i as usize].key;
            if let Some(v) = kids.remove(&key) {
                stack.extend(v);
            }
            let e = &self.entries[i as usize];
            if !first && (e.pins > 0 || matches!(e.dram, Dram::Filling { .. })) {
                continue;
            }
            self.drop_copies(i, first);
            out.keys.push(key);
            first = false;
        }
        out
    }

    /// Drops every copy of `id`; removes it unless pinned (then it is marked corrupt if `corrupt`).
    fn drop_copies(&mut self, id: EntryId, corrupt: bool) {
        if let Dram::Present { slot, .. } = self.entries[id as usize].dram {
            if !self.entries[id as usize].evicting {
                self.set_dram(id, Dram::Absent);
                self.invalidate.push(slot);
                self.free_slots.push(slot);
            }
        }
        if self.entries[id as usize].on_disk {
            self.entries[id as usize].on_disk = false;
            self.disk_count -= 1;
            self.unlink.push(self.entries[id as usize].key);
            self.note(id, true, false);
        }
        let e = &mut self.entries[id as usize];
        if e.pins > 0 || e.evicting || matches!(e.dram, Dram::Filling { .. }) {
            e.corrupt |= corrupt || e.evicting;
            self.refresh(id);
        } else {
            self.remove_entry(id);
        }
    }

    /// Removes visible blocks by key, each with every resident block of its chain below it.
    /// A key whose subtree holds a pinned or in-flight block is left alone (not in the result).
    /// Unknown keys are ignored. O(n) per call.
    pub fn remove(&mut self, keys: &[u128]) -> Dropped {
        let mut out = Dropped::default();
        for &k in keys {
            let Some(&id) = self.map.get(&k) else {
                continue;
            };
            let subtree = self.subtree(id);
            let busy = subtree.iter().any(|&i| {
                let e = &self.entries[i as usize];
                e.pins > 0 || e.evicting || matches!(e.dram, Dram::Filling { .. })
            });
            if busy {
                continue;
            }
            for i in subtree {
                out.keys.push(self.entries[i as usize].key);
                self.drop_copies(i, false);
            }
        }
        out
    }

    fn subtree(&self, id: EntryId) -> Vec<EntryId> {
        let mut kids: KeyMap<Vec<EntryId>> = KeyMap::default();
        for &i in self.map.values() {
            if let Some(p) = self.entries[i as usize].parent {
                kids.entry(p).or_default().push(i);
            }
        }
        let mut out = vec![];
        let mut stack = vec![id];
        let mut seen = std::collections::HashSet::new();
        while let Some(i) = stack.pop() {
            if !seen.insert(i) {
                continue;
            }
            out.push(i);
            if let Some(v) = kids.get(&self.entries[i as usize].key) {
                stack.extend(v.iter().copied());
            }
        }
        out
    }

    /// Removes every block that is not pinned, in flight, or an ancestor of one (ancestors stay so
    /// that the pinned blocks keep their prefix). O(n).
    pub fn clear(&mut self) -> Dropped {
        let mut keep: std::collections::HashSet<EntryId> = std::collections::HashSet::new();
        for &i in self.map.values() {
            let e = &self.entries[i as usize];
            if e.pins > 0 || e.evicting || matches!(e.dram, Dram::Filling { .. }) {
                let mut cur = Some(i);
                while let Some(c) = cur {
                    if !keep.insert(c) {
                        break;
                    }
                    cur = self.entries[c as usize]
                        .parent
                        .and_then(|p| self.map.get(&p).copied());
                }
            }
        }
        let all: Vec<EntryId> = self.map.values().copied().collect();
        let mut out = Dropped::default();
        for i in all {
            if !keep.contains(&i) && self.entries[i as usize].live {
                out.keys.push(self.entries[i as usize].key);
                self.drop_copies(i, false);
            }
        }
        out
    }

    /// DRAM slots whose committed block went away since the last call (evicted, dropped, or
    /// released): the store must mark them not committed before it unlocks the index.
    pub fn drain_invalidated(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.invalidate)
    }

    /// Keys whose disk copy was removed since the last call: the store deletes their files.
    pub fn drain_unlink(&mut self) -> Vec<u128> {
        std::mem::take(&mut self.unlink)
    }

    /// Starts recording the keys of entries that leave the index (evicted from the last tier,
    /// dropped, removed, or an aborted first put), for [`Index::drain_gone`]. Off by default
    /// (no cost when nobody observes the store).
    pub fn track_gone(&mut self) {
        self.gone.get_or_insert_with(Vec::new);
    }

    /// Keys of entries removed since the last call, in order (empty unless
    /// [`Index::track_gone`] was called).
    pub fn drain_gone(&mut self) -> Vec<u128> {
        self.gone.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// `(key, parent)` of every visible (committed) entry, for a first snapshot of an observer.
    pub fn visible_keys(&self) -> Vec<(u128, Option<u128>)> {
        self.map
            .values()
            .map(|&i| &self.entries[i as usize])
            .filter(|e| e.visible())
            .map(|e| (e.key, e.parent))
            .collect()
    }

    /// Starts (or stops) recording every [`Change`] of a DRAM or disk copy.
    pub fn record_changes(&mut self, on: bool) {
        self.changes = on.then(Vec::new);
    }

    /// The changes recorded since the last call, in order (empty when not recording).
    pub fn drain_changes(&mut self) -> Vec<Change> {
        match &mut self.changes {
            Some(c) => std::mem::take(c),
            None => Vec::new(),
        }
    }

    fn note(&mut self, id: EntryId, disk: bool, stored: bool) {
        if let Some(c) = &mut self.changes {
            let e = &self.entries[id as usize];
            c.push(Change {
                key: e.key,
                parent: e.parent,
                disk,
                stored,
            });
        }
    }

    // ----- internals -----

    fn insert(&mut self, key: u128, parent: Option<u128>, tick: u64) -> EntryId {
        let e = Entry {
            key,
            parent: parent.filter(|&p| p != key),
            tick,
            pins: 0,
            dram: Dram::Absent,
            evicting: false,
            on_disk: false,
            corrupt: false,
            len: 0,
            checksum: 0,
            live: true,
            in_dram_lru: false,
            in_disk_lru: false,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.entries[id as usize] = e;
                id
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as EntryId
            }
        };
        self.map.insert(key, id);
        if let Some(p) = self.entries[id as usize].parent {
            self.fam.entry(p).or_default().any += 1;
            self.refresh_key(p);
        }
        id
    }

    fn remove_entry(&mut self, id: EntryId) {
        debug_assert_eq!(self.entries[id as usize].dram, Dram::Absent);
        debug_assert!(!self.entries[id as usize].on_disk);
        self.lru_out(id);
        let e = &mut self.entries[id as usize];
        e.live = false;
        let key = e.key;
        let parent = e.parent;
        self.map.remove(&key);
        self.free_ids.push(id);
        if let Some(g) = &mut self.gone {
            g.push(key);
        }
        if let Some(p) = parent {
            if let Some(f) = self.fam.get_mut(&p) {
                f.any -= 1;
                if f.any == 0 && f.dram == 0 {
                    self.fam.remove(&p);
                }
            }
            self.refresh_key(p);
        }
    }

    /// Changes the DRAM state, keeping the parent's child counts and the DRAM count right.
    fn set_dram(&mut self, id: EntryId, d: Dram) {
        let e = &mut self.entries[id as usize];
        let was_dram = e.dram != Dram::Absent;
        let was_present = matches!(e.dram, Dram::Present { .. });
        e.dram = d;
        let is_dram = d != Dram::Absent;
        let is_present = matches!(d, Dram::Present { .. });
        let parent = e.parent;
        if was_present != is_present {
            self.note(id, false, is_present);
            if is_present {
                self.dram_count += 1;
            } else {
                self.dram_count -= 1;
            }
        }
        if was_dram != is_dram {
            if let Some(p) = parent {
                let f = self.fam.entry(p).or_default();
                if is_dram {
                    f.dram += 1;
                } else {
                    f.dram -= 1;
                }
                self.refresh_key(p);
            }
        }
        self.refresh(id);
    }

    fn set_tick(&mut self, id: EntryId, t: u64) {
        let e = &mut self.entries[id as usize];
        let old = e.tick;
        e.tick = t;
        if e.in_dram_lru {
            self.dram_lru.remove(&(old, id));
            self.dram_lru.insert((t, id));
        }
        if e.in_disk_lru {
            self.disk_lru.remove(&(old, id));
            self.disk_lru.insert((t, id));
        }
    }

    fn refresh_key(&mut self, key: u128) {
        if let Some(&id) = self.map.get(&key) {
            self.refresh(id);
        }
    }

    fn lru_out(&mut self, id: EntryId) {
        let e = &mut self.entries[id as usize];
        if e.in_dram_lru {
            self.dram_lru.remove(&(e.tick, id));
            e.in_dram_lru = false;
        }
        if e.in_disk_lru {
            self.disk_lru.remove(&(e.tick, id));
            e.in_disk_lru = false;
        }
    }

    /// Recomputes whether `id` is a DRAM and/or disk eviction candidate.
    fn refresh(&mut self, id: EntryId) {
        let e = &self.entries[id as usize];
        if !e.live {
            return;
        }
        let fam = self.fam.get(&e.key).copied().unwrap_or_default();
        let usable = e.pins == 0 && !e.corrupt;
        let dram_c = usable
            && !e.evicting
            && matches!(e.dram, Dram::Present { .. })
            && (fam.dram == 0 || e.on_disk || self.disk_capacity.is_some());
        let disk_c = usable
            && e.on_disk
            && (matches!(e.dram, Dram::Present { .. }) && !e.evicting || fam.any == 0);
        let (t, in_dram, in_disk) = (e.tick, e.in_dram_lru, e.in_disk_lru);
        if dram_c != in_dram {
            if dram_c {
                self.dram_lru.insert((t, id));
            } else {
                self.dram_lru.remove(&(t, id));
            }
            self.entries[id as usize].in_dram_lru = dram_c;
        }
        if disk_c != in_disk {
            if disk_c {
                self.disk_lru.insert((t, id));
            } else {
                self.disk_lru.remove(&(t, id));
            }
            self.entries[id as usize].in_disk_lru = disk_c;
        }
    }

    /// Checks internal consistency (counts, candidate sets, slot ownership). For tests; O(n).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut fam: KeyMap<Family> = KeyMap::default();
        let mut slots = vec![false; self.num_slots as usize];
        for &s in &self.free_slots {
            if std::mem::replace(&mut slots[s as usize], true) {
                return Err(format!("slot {s} free twice"));
            }
        }
        let (mut dram, mut disk) = (0, 0);
        for (&k, &id) in &self.map {
            let e = &self.entries[id as usize];
            if !e.live || e.key != k {
                return Err(format!("map entry {k:x} -> dead or wrong entry"));
            }
            if let Some(p) = e.parent {
                let f = fam.entry(p).or_default();
                f.any += 1;
                if e.dram != Dram::Absent {
                    f.dram += 1;
                }
            }
            let used = match e.dram {
                Dram::Present { slot, .. } | Dram::Filling { slot } => Some(slot),
                Dram::Absent => None,
            };
            if let Some(slot) = used.filter(|&s| s != PENDING_SLOT) {
                if std::mem::replace(&mut slots[slot as usize], true) {
                    return Err(format!("slot {slot} used twice"));
                }
            }
            if matches!(e.dram, Dram::Present { .. }) {
                dram += 1;
            }
            if e.on_disk {
                disk += 1;
            }
            if e.in_dram_lru != self.dram_lru.contains(&(e.tick, id))
                || e.in_disk_lru != self.disk_lru.contains(&(e.tick, id))
            {
                return Err(format!("LRU membership flags of {k:x} are stale"));
            }
        }
        if dram != self.dram_count || disk != self.disk_count {
            return Err(format!(
                "counts: dram {dram} vs {}, disk {disk} vs {}",
                self.dram_count, self.disk_count
            ));
        }
        for (k, f) in &fam {
            let g = self.fam.get(k).copied().unwrap_or_default();
            if g.any != f.any || g.dram != f.dram {
                return Err(format!("family of {k:x}: {g:?} recorded, {f:?} actual"));
            }
        }
        if self.dram_lru.len() + self.disk_lru.len() > self.map.len() * 2 {
            return Err("candidate sets hold dead entries".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(ix: &mut Index, key: u128, parent: Option<u128>) -> Option<EntryId> {
        let Begin::Started(id) = ix.begin_put(key, parent) else {
            return None;
        };
        match ix.take_slot() {
            Take::Slot { slot, .. } => {
                ix.assign_slot(id, slot);
                ix.commit_fill(id, 2, 10, 0);
                Some(id)
            }
            Take::Spill(_) => panic!("no disk tier"),
            Take::NoSpace => {
                ix.abort_fill(id);
                None
            }
        }
    }

    #[test]
    fn lru_evicts_chain_tail_first_and_never_orphans() {
        let mut ix = Index::new(3, None);
        put(&mut ix, 1, None).unwrap();
        put(&mut ix, 2, Some(1)).unwrap();
        put(&mut ix, 3, Some(2)).unwrap();
        // Touch the root only: it is newest, but it must not go before its children.
        ix.lookup(&[1]);
        put(&mut ix, 10, None).unwrap();
        // The tail (3) went first although the root is the least recently used block.
        assert_eq!(ix.lookup(&[1, 2, 3]).hits, 2);
        // That lookup made 1 and 2 newer than 10: 10 goes next.
        put(&mut ix, 11, None).unwrap();
        assert_eq!(ix.lookup(&[10]).hits, 0);
        assert_eq!(ix.lookup(&[1, 2]).hits, 2);
        put(&mut ix, 12, None).unwrap();
        assert_eq!(ix.lookup(&[11]).hits, 0);
        // Only the chain and 12 are left: the chain's tail is the victim, never its root.
        put(&mut ix, 13, None).unwrap();
        assert_eq!(ix.lookup(&[1, 2]).hits, 1);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn pinned_blocks_are_never_victims() {
        let mut ix = Index::new(2, None);
        let a = put(&mut ix, 1, None).unwrap();
        let b = put(&mut ix, 2, None).unwrap();
        ix.pin(a);
        ix.pin(b);
        assert!(put(&mut ix, 3, None).is_none(), "full");
        assert_eq!(ix.lookup(&[1]).hits, 1);
        ix.unpin(b);
        assert!(put(&mut ix, 3, None).is_some());
        assert_eq!(ix.lookup(&[2]).hits, 0);
        assert_eq!(ix.lookup(&[1]).hits, 1);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn spill_keeps_blocks_resident_on_disk() {
        let mut ix = Index::new(1, Some(2));
        put(&mut ix, 1, None).unwrap();
        let Begin::Started(id) = ix.begin_put(2, Some(1)) else {
            panic!()
        };
        let Take::Spill(v) = ix.take_slot() else {
            panic!("expected a spill")
        };
        assert_eq!(v.key, 1);
        assert_eq!(ix.finish_spill(v, true), Some(v.slot));
        assert_eq!(ix.drain_invalidated(), vec![v.slot]);
        ix.assign_slot(id, v.slot);
        ix.commit_fill(id, 4, 10, 0);
        let c = ix.lookup(&[1, 2]);
        assert_eq!((c.hits, c.in_dram, c.disk_only), (2, 1, 1));
        ix.check_invariants().unwrap();
    }

    #[test]
    fn drop_entry_takes_descendants() {
        let mut ix = Index::new(4, None);
        let a = put(&mut ix, 1, None).unwrap();
        put(&mut ix, 2, Some(1)).unwrap();
        put(&mut ix, 3, Some(2)).unwrap();
        put(&mut ix, 4, None).unwrap();
        let d = ix.drop_entry(a);
        assert_eq!(d.keys.len(), 3);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.free_slots(), 3);
        assert_eq!(ix.drain_invalidated().len(), 3);
        ix.check_invariants().unwrap();
    }
}
