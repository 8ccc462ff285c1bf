//! Property tests of the host KV tier's index and eviction policy against a brute-force model.
//!
//! Random sequences of put / lookup / get (with loads from disk) / pin / unpin / remove / drop /
//! clear run against [`tpu_sync::store::index::Index`], driven the way the store drives it, and
//! against `Model`, a direct transcription of the policy that recomputes everything (children
//! counts, eviction candidates, LRU order) by scanning all entries. After every step the two must
//! agree on every result and on the state of every key, the index's own invariants must hold, and
//! the policy's promises must hold in the model: a block stored after its parent keeps that parent
//! resident for as long as it stays (prefixes stay usable), leased blocks are never evicted, DRAM
//! and disk never exceed their capacities. A second property runs random operations on a whole
//! `KvStore` (host memory, small DRAM and disk tiers) and checks every delivered byte.

use crate::store_util;

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use tpu_sync::store::index::{Begin, Dram, EntryId, Index, Take, PENDING_SLOT};

// ---------------------------------------------------------------- keys

/// Key of the depth-`i` block of root `r` along branch `bits` (a binary trie of chains).
fn key(r: u8, i: u8, bits: u8) -> u128 {
    let mask = ((1u16 << i) - 1) as u8;
    1 + ((r as u128) << 16 | (i as u128) << 8 | (bits & mask) as u128)
}

fn chain(r: u8, bits: u8, n: u8) -> Vec<u128> {
    (0..n).map(|i| key(r, i, bits)).collect()
}

fn all_keys() -> Vec<u128> {
    let mut v = HashSet::new();
    for r in 0..3 {
        for i in 0..5 {
            for b in 0..32 {
                v.insert(key(r, i, b));
            }
        }
    }
    v.into_iter().collect()
}

// ---------------------------------------------------------------- model

#[derive(Debug, Clone)]
struct ME {
    parent: Option<u128>,
    tick: u64,
    pins: u32,
    present: bool,
    filling: bool,
    evicting: bool,
    disk: bool,
    doomed: bool,
    /// Its parent was resident when it was committed.
    anchored: bool,
}

impl ME {
    fn visible(&self) -> bool {
        !self.doomed && (self.present || self.disk)
    }
}

#[derive(Debug)]
enum MTake {
    Slot,
    Spill(u128),
    NoSpace,
}

#[derive(Debug)]
struct Model {
    e: HashMap<u128, ME>,
    free: usize,
    slots: usize,
    tick: u64,
    disk_cap: Option<u64>,
    disk_count: u64,
    reserved: u64,
}

impl Model {
    fn new(slots: usize, disk_cap: Option<u64>) -> Model {
        Model {
            e: HashMap::new(),
            free: slots,
            slots,
            tick: 1,
            disk_cap,
            disk_count: 0,
            reserved: 0,
        }
    }
    fn next_tick(&mut self) -> u64 {
        let t = self.tick;
        self.tick += 1;
        t
    }
    fn kids(&self, k: u128) -> (usize, usize) {
        let any = self.e.values().filter(|e| e.parent == Some(k));
        let dram = any.clone().filter(|e| e.present || e.filling).count();
        (
            dram,
            self.e.values().filter(|e| e.parent == Some(k)).count(),
        )
    }
    fn touch(&mut self, keys: &[u128]) {
        for k in keys.iter().rev() {
            let t = self.next_tick();
            self.e.get_mut(k).unwrap().tick = t;
        }
    }
    fn lookup(&mut self, keys: &[u128]) -> (usize, usize, usize) {
        let mut hit = vec![];
        let (mut d, mut o) = (0, 0);
        for k in keys {
            match self.e.get(k) {
                Some(e) if e.visible() => {
                    if e.present {
                        d += 1
                    } else {
                        o += 1
                    }
                    hit.push(*k);
                }
                _ => break,
            }
        }
        self.touch(&hit);
        (hit.len(), d, o)
    }
    fn remove_if_gone(&mut self, k: u128) {
        let e = &self.e[&k];
        if !e.visible() && !e.present && !e.filling && !e.disk && e.pins == 0 && !e.evicting {
            self.e.remove(&k);
        }
    }
    fn disk_victim(&self) -> Option<u128> {
        self.e
            .iter()
            .filter(|(k, e)| {
                e.disk
                    && e.pins == 0
                    && !e.doomed
                    && ((e.present && !e.evicting) || self.kids(**k).1 == 0)
            })
            .min_by_key(|(_, e)| e.tick)
            .map(|(k, _)| *k)
    }
    fn drop_disk(&mut self, k: u128) {
        let e = self.e.get_mut(&k).unwrap();
        e.disk = false;
        self.disk_count -= 1;
        let e = &self.e[&k];
        if !e.visible() && !e.present && !e.filling && e.pins == 0 {
            self.e.remove(&k);
        }
    }
    fn reserve_disk(&mut self) -> bool {
        let Some(cap) = self.disk_cap else {
            return false;
        };
        while self.disk_count + self.reserved >= cap {
            match self.disk_victim() {
                Some(v) => self.drop_disk(v),
                None => return false,
            }
        }
        self.reserved += 1;
        true
    }
    fn take_slot(&mut self) -> MTake {
        if self.free > 0 {
            self.free -= 1;
            return MTake::Slot;
        }
        let mut skipped = HashSet::new();
        loop {
            let v = self
                .e
                .iter()
                .filter(|(k, e)| {
                    e.present
                        && !e.evicting
                        && e.pins == 0
                        && !e.doomed
                        && !skipped.contains(*k)
                        && (self.kids(**k).0 == 0 || e.disk || self.disk_cap.is_some())
                })
                .min_by_key(|(_, e)| e.tick)
                .map(|(k, _)| *k);
            let Some(v) = v else {
                return MTake::NoSpace;
            };
            if self.e[&v].disk || self.disk_cap.is_none() {
                self.e.get_mut(&v).unwrap().present = false;
                self.remove_if_gone(v);
                return MTake::Slot;
            }
            if self.reserve_disk() {
                self.e.get_mut(&v).unwrap().evicting = true;
                return MTake::Spill(v);
            }
            if self.kids(v).1 == 0 {
                self.e.remove(&v);
                return MTake::Slot;
            }
            skipped.insert(v);
        }
    }
    fn finish_spill(&mut self, v: u128, ok: bool) -> bool {
        self.reserved -= 1;
        self.e.get_mut(&v).unwrap().evicting = false;
        if !ok {
            let t = self.next_tick();
            self.e.get_mut(&v).unwrap().tick = t;
            return false;
        }
        let e = self.e.get_mut(&v).unwrap();
        e.disk = true;
        e.present = false;
        self.disk_count += 1;
        let cap = self.disk_cap.unwrap();
        while self.disk_count + self.reserved > cap {
            match self.disk_victim() {
                Some(x) => self.drop_disk(x),
                None => break,
            }
        }
        true
    }
    /// Slots for filling keys, in order; returns how many got one (the rest must be aborted).
    fn acquire(&mut self, keys: &[u128], spill_ok: bool) -> usize {
        let mut stop = keys.len();
        let mut spills = vec![];
        let mut got = vec![false; keys.len()];
        for (j, _) in keys.iter().enumerate() {
            match self.take_slot() {
                MTake::Slot => got[j] = true,
                MTake::Spill(v) => spills.push((j, v)),
                MTake::NoSpace => {
                    stop = j;
                    break;
                }
            }
        }
        for (j, v) in spills {
            if self.finish_spill(v, spill_ok) {
                got[j] = true;
            } else {
                stop = stop.min(j);
            }
        }
        // Slots of aborted fills go back to the free list.
        for g in got.iter().skip(stop) {
            if *g {
                self.free += 1;
            }
        }
        stop
    }
    fn abort_fill(&mut self, k: u128) {
        let e = self.e.get_mut(&k).unwrap();
        e.filling = false;
        e.pins -= 1;
        self.remove_if_gone(k);
    }
    fn put_window(
        &mut self,
        keys: &[u128],
        parent: Option<u128>,
        spill_ok: bool,
    ) -> (usize, usize, bool) {
        let mut present = vec![];
        let mut started = vec![];
        let mut inflight = 0;
        let mut p = parent;
        for &k in keys {
            if let Some(e) = self.e.get(&k) {
                // Visible, or (dropped while leased) a doomed entry: either way not written again.
                if e.visible() {
                    present.push(k);
                } else {
                    inflight += 1;
                }
            } else {
                let t = self.next_tick();
                self.e.insert(
                    k,
                    ME {
                        parent: p,
                        tick: t,
                        pins: 1,
                        present: false,
                        filling: true,
                        evicting: false,
                        disk: false,
                        doomed: false,
                        anchored: false,
                    },
                );
                started.push(k);
            }
            p = Some(k);
        }
        let stop = if started.is_empty() {
            0
        } else {
            self.acquire(&started, spill_ok)
        };
        for &k in &started[stop..] {
            self.abort_fill(k);
        }
        for &k in &started[..stop] {
            let parent_ok = match self.e[&k].parent {
                None => true,
                Some(pk) => self.e.get(&pk).is_some_and(|e| e.visible()),
            };
            let e = self.e.get_mut(&k).unwrap();
            e.filling = false;
            e.present = true;
            e.pins -= 1;
            e.anchored = parent_ok;
        }
        let touch: Vec<u128> = keys
            .iter()
            .copied()
            .filter(|k| self.e.get(k).is_some_and(|e| e.visible()))
            .filter(|k| present.contains(k) || started[..stop].contains(k))
            .collect();
        self.touch(&touch);
        (stop, present.len() + inflight, stop < started.len())
    }
    fn descendants(&self, k: u128) -> Vec<u128> {
        let mut out = vec![];
        let mut stack = vec![k];
        while let Some(x) = stack.pop() {
            for (c, e) in &self.e {
                if e.parent == Some(x) && !out.contains(c) {
                    out.push(*c);
                    stack.push(*c);
                }
            }
        }
        out
    }
    fn drop_copies(&mut self, k: u128) {
        let e = self.e.get_mut(&k).unwrap();
        if e.present && !e.evicting {
            e.present = false;
            self.free += 1;
        }
        let e = self.e.get_mut(&k).unwrap();
        if e.disk {
            e.disk = false;
            self.disk_count -= 1;
        }
        let e = self.e.get_mut(&k).unwrap();
        if e.pins > 0 || e.evicting || e.filling {
            e.doomed = true;
        } else {
            self.e.remove(&k);
        }
    }
    fn unanchor_descendants(&mut self, k: u128) {
        for d in self.descendants(k) {
            if let Some(e) = self.e.get_mut(&d) {
                e.anchored = false;
            }
        }
    }
    fn drop_entry(&mut self, k: u128) -> usize {
        let desc = self.descendants(k);
        self.unanchor_descendants(k);
        self.drop_copies(k);
        let mut n = 1;
        for d in desc {
            let e = &self.e[&d];
            if e.pins > 0 || e.filling {
                continue;
            }
            self.drop_copies(d);
            n += 1;
        }
        n
    }
    fn remove(&mut self, k: u128) -> usize {
        if !self.e.contains_key(&k) {
            return 0;
        }
        let mut sub = self.descendants(k);
        sub.push(k);
        if sub.iter().any(|d| {
            let e = &self.e[d];
            e.pins > 0 || e.evicting || e.filling
        }) {
            return 0;
        }
        for d in &sub {
            self.drop_copies(*d);
        }
        sub.len()
    }
    fn clear(&mut self) -> usize {
        let mut keep = HashSet::new();
        let busy: Vec<u128> = self
            .e
            .iter()
            .filter(|(_, e)| e.pins > 0 || e.evicting || e.filling)
            .map(|(k, _)| *k)
            .collect();
        for k in busy {
            let mut cur = Some(k);
            while let Some(c) = cur {
                if !keep.insert(c) {
                    break;
                }
                cur = self
                    .e
                    .get(&c)
                    .and_then(|e| e.parent)
                    .filter(|p| self.e.contains_key(p));
            }
        }
        let all: Vec<u128> = self
            .e
            .keys()
            .copied()
            .filter(|k| !keep.contains(k))
            .collect();
        for k in &all {
            self.drop_copies(*k);
        }
        all.len()
    }
    fn unpin(&mut self, k: u128) {
        let e = self.e.get_mut(&k).unwrap();
        e.pins -= 1;
        if e.pins == 0 && e.doomed {
            self.drop_copies(k);
        }
    }
}

// ---------------------------------------------------------------- the index, driven like the store

struct Harness {
    ix: Index,
    slots: usize,
    /// The block whose disk file the last get found bad (dropped even if leased).
    bad_file: Option<u128>,
}

impl Harness {
    fn acquire(&mut self, ids: &[EntryId], spill_ok: bool) -> usize {
        let mut stop = ids.len();
        let mut spills = vec![];
        for (j, &id) in ids.iter().enumerate() {
            match self.ix.take_slot() {
                Take::Slot { slot, .. } => self.ix.assign_slot(id, slot),
                Take::Spill(v) => spills.push((j, v)),
                Take::NoSpace => {
                    stop = j;
                    break;
                }
            }
        }
        for (j, v) in spills {
            match self.ix.finish_spill(v, spill_ok) {
                Some(s) => self.ix.assign_slot(ids[j], s),
                None => stop = stop.min(j),
            }
        }
        stop
    }
    fn put_window(
        &mut self,
        keys: &[u128],
        parent: Option<u128>,
        spill_ok: bool,
    ) -> (usize, usize, bool) {
        let mut present = vec![];
        let mut started = vec![];
        let mut inflight = 0;
        let mut p = parent;
        for (pos, &k) in keys.iter().enumerate() {
            match self.ix.begin_put(k, p) {
                Begin::Present(id) => present.push((pos, id)),
                Begin::InFlight => inflight += 1,
                Begin::Started(id) => started.push((pos, id)),
            }
            p = Some(k);
        }
        let ids: Vec<EntryId> = started.iter().map(|s| s.1).collect();
        let stop = if ids.is_empty() {
            0
        } else {
            self.acquire(&ids, spill_ok)
        };
        for &id in &ids[stop..] {
            self.ix.abort_fill(id);
        }
        for &id in &ids[..stop] {
            let Dram::Filling { slot } = self.ix.entry(id).dram else {
                panic!("not filling")
            };
            assert_ne!(slot, PENDING_SLOT);
            self.ix.commit_fill(id, 2, 100, 7);
        }
        let mut all: Vec<(usize, EntryId)> = present.clone();
        all.extend(started[..stop].iter().copied());
        all.sort_unstable();
        let touch: Vec<EntryId> = all
            .into_iter()
            .filter(|&(pos, id)| {
                let e = self.ix.entry(id);
                e.visible() && e.key == keys[pos]
            })
            .map(|(_, id)| id)
            .collect();
        self.ix.touch(&touch);
        (stop, present.len() + inflight, stop < ids.len())
    }
    /// One get window: resolve, load disk blocks (the first load fails when `!file_ok`), copy
    /// (nothing to copy here), unpin. Returns the blocks delivered.
    fn get_window(&mut self, keys: &[u128], file_ok: bool) -> usize {
        let max_promote = (self.slots / 4).max(1);
        let mut items: Vec<(EntryId, bool)> = vec![];
        let mut promote = vec![];
        let mut touched = vec![];
        for &k in keys {
            let Some(id) = self.ix.find(k) else { break };
            let e = self.ix.entry(id);
            if !e.visible() {
                break;
            }
            match e.dram {
                Dram::Present { .. } => items.push((id, false)),
                Dram::Filling { .. } => panic!("no concurrent fills here"),
                Dram::Absent => {
                    if promote.len() == max_promote || !self.ix.begin_promote(id) {
                        break;
                    }
                    promote.push(items.len());
                    items.push((id, true));
                }
            }
            touched.push(id);
        }
        self.ix.touch(&touched);
        if promote.is_empty() {
            return items.len();
        }
        let ids: Vec<EntryId> = promote.iter().map(|&j| items[j].0).collect();
        let stop = self.acquire(&ids, true);
        let mut cut = items.len();
        for (n, &j) in promote.iter().enumerate() {
            let id = items[j].0;
            let ok = n < stop && (file_ok || n > 0);
            if n < stop && ok {
                if j < cut {
                    self.ix.pin(id);
                } else {
                    items[j].1 = false;
                }
                self.ix.commit_fill(id, 4, 100, 7);
            } else if n >= stop {
                self.ix.abort_fill(id);
                cut = cut.min(j);
                items[j].1 = false;
            } else {
                self.ix.abort_fill(id);
                self.ix.drop_entry(id);
                self.bad_file = Some(keys[j]);
                cut = cut.min(j);
                items[j].1 = false;
            }
        }
        items.truncate(cut);
        for &(id, pinned) in &items {
            if pinned {
                self.ix.unpin(id);
            }
        }
        items.len()
    }
}

impl Model {
    fn get_window(&mut self, keys: &[u128], file_ok: bool) -> usize {
        let max_promote = (self.slots / 4).max(1);
        let mut items: Vec<(u128, bool)> = vec![];
        let mut promote = vec![];
        let mut touched = vec![];
        for &k in keys {
            match self.e.get(&k) {
                Some(e) if e.visible() => {
                    if e.present {
                        items.push((k, false));
                    } else {
                        if promote.len() == max_promote {
                            break;
                        }
                        let e = self.e.get_mut(&k).unwrap();
                        e.pins += 1;
                        e.filling = true;
                        promote.push(items.len());
                        items.push((k, true));
                    }
                    touched.push(k);
                }
                _ => break,
            }
        }
        self.touch(&touched);
        if promote.is_empty() {
            return items.len();
        }
        let pk: Vec<u128> = promote.iter().map(|&j| items[j].0).collect();
        let stop = self.acquire(&pk, true);
        let mut cut = items.len();
        for (n, &j) in promote.iter().enumerate() {
            let k = items[j].0;
            let ok = n < stop && (file_ok || n > 0);
            if ok {
                let e = self.e.get_mut(&k).unwrap();
                e.filling = false;
                e.present = true;
                // The fill pin becomes the copy pin (released below) or goes.
                if j >= cut {
                    e.pins -= 1;
                    items[j].1 = false;
                }
            } else {
                if n < stop {
                    self.free += 1;
                }
                self.abort_fill(k);
                if n < stop {
                    self.drop_entry(k);
                }
                cut = cut.min(j);
                items[j].1 = false;
            }
        }
        items.truncate(cut);
        for &(k, pinned) in &items {
            if pinned {
                self.unpin(k);
            }
        }
        items.len()
    }
}

// ---------------------------------------------------------------- operations

#[derive(Debug, Clone)]
enum Op {
    Put {
        r: u8,
        bits: u8,
        n: u8,
        spill_ok: bool,
    },
    Lookup {
        r: u8,
        bits: u8,
        n: u8,
    },
    Get {
        r: u8,
        bits: u8,
        n: u8,
        file_ok: bool,
    },
    Pin {
        r: u8,
        bits: u8,
        n: u8,
    },
    Unpin {
        idx: usize,
    },
    Remove {
        r: u8,
        bits: u8,
        depth: u8,
    },
    Drop {
        r: u8,
        bits: u8,
        depth: u8,
    },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let c = || (0u8..3, 0u8..32, 1u8..=5);
    prop_oneof![
        6 => (c(), prop::bool::weighted(0.9)).prop_map(|((r, bits, n), spill_ok)| Op::Put { r, bits, n, spill_ok }),
        3 => c().prop_map(|(r, bits, n)| Op::Lookup { r, bits, n }),
        3 => (c(), prop::bool::weighted(0.85)).prop_map(|((r, bits, n), file_ok)| Op::Get { r, bits, n, file_ok }),
        2 => c().prop_map(|(r, bits, n)| Op::Pin { r, bits, n }),
        2 => (0usize..8).prop_map(|idx| Op::Unpin { idx }),
        1 => (0u8..3, 0u8..32, 0u8..5).prop_map(|(r, bits, depth)| Op::Remove { r, bits, depth }),
        1 => (0u8..3, 0u8..32, 0u8..5).prop_map(|(r, bits, depth)| Op::Drop { r, bits, depth }),
        1 => Just(Op::Clear),
    ]
}

fn compare(h: &Harness, m: &Model, keys: &[u128]) -> Result<(), TestCaseError> {
    h.ix.check_invariants().map_err(TestCaseError::fail)?;
    for &k in keys {
        let a = h.ix.find(k).map(|id| {
            let e = h.ix.entry(id);
            (
                e.visible(),
                matches!(e.dram, Dram::Present { .. }),
                e.on_disk,
                e.pins,
            )
        });
        let b =
            m.e.get(&k)
                .map(|e| (e.visible(), e.present, e.disk, e.pins));
        prop_assert_eq!(a, b, "key {:x}", k);
    }
    prop_assert_eq!(h.ix.free_slots(), m.free);
    prop_assert_eq!(h.ix.disk_blocks(), m.disk_count);
    // Policy promises, checked in the model.
    prop_assert!(m.e.values().filter(|e| e.present || e.filling).count() <= m.slots);
    if let Some(cap) = m.disk_cap {
        prop_assert!(m.disk_count <= cap);
    }
    for (k, e) in &m.e {
        if e.visible() && e.anchored {
            if let Some(p) = e.parent {
                prop_assert!(
                    m.e.get(&p).is_some_and(|pe| pe.visible()),
                    "block {:x} is resident without its prefix {:x}",
                    k,
                    p
                );
            }
        }
    }
    Ok(())
}

fn run(ops: Vec<Op>, slots: usize, disk: Option<u64>) -> Result<(), TestCaseError> {
    let mut h = Harness {
        ix: Index::new(slots as u32, disk),
        slots,
        bad_file: None,
    };
    let mut m = Model::new(slots, disk);
    let keys = all_keys();
    // Leases: (keys pinned, index ids).
    let mut leases: Vec<(Vec<u128>, Vec<EntryId>)> = vec![];
    let mut dropped_pinned: HashSet<u128> = HashSet::new();
    for op in ops {
        match op {
            Op::Put {
                r,
                bits,
                n,
                spill_ok,
            } => {
                let c = chain(r, bits, n);
                let w = (slots / 2).max(1);
                let mut start = 0;
                while start < c.len() {
                    let end = (start + w).min(c.len());
                    let parent = start.checked_sub(1).map(|i| c[i]);
                    let a = h.put_window(&c[start..end], parent, spill_ok);
                    let b = m.put_window(&c[start..end], parent, spill_ok);
                    prop_assert_eq!(a, b, "put window {}..{} of {:?}", start, end, c);
                    if a.2 {
                        break;
                    }
                    start = end;
                }
            }
            Op::Lookup { r, bits, n } => {
                let c = chain(r, bits, n);
                let a = h.ix.lookup(&c);
                let b = m.lookup(&c);
                prop_assert_eq!((a.hits, a.in_dram, a.disk_only), b);
            }
            Op::Get {
                r,
                bits,
                n,
                file_ok,
            } => {
                let c = chain(r, bits, n);
                let a = h.get_window(&c, file_ok);
                let b = m.get_window(&c, file_ok);
                prop_assert_eq!(a, b, "get {:?}", c);
                if let Some(k) = h.bad_file.take() {
                    dropped_pinned.insert(k);
                }
            }
            Op::Pin { r, bits, n } => {
                let c = chain(r, bits, n);
                let mut ids = vec![];
                let mut ks = vec![];
                for &k in &c {
                    match h.ix.find(k) {
                        Some(id) if h.ix.entry(id).visible() => {
                            h.ix.pin(id);
                            ids.push(id);
                            ks.push(k);
                        }
                        _ => break,
                    }
                }
                h.ix.touch(&ids);
                for &k in &ks {
                    m.e.get_mut(&k).unwrap().pins += 1;
                }
                m.touch(&ks);
                leases.push((ks, ids));
            }
            Op::Unpin { idx } => {
                if !leases.is_empty() {
                    let (ks, ids) = leases.remove(idx % leases.len());
                    for id in ids {
                        h.ix.unpin(id);
                    }
                    for k in ks {
                        m.unpin(k);
                    }
                }
            }
            Op::Remove { r, bits, depth } => {
                let k = key(r, depth, bits);
                let a = h.ix.remove(&[k]).keys.len();
                let b = m.remove(k);
                prop_assert_eq!(a, b);
            }
            Op::Drop { r, bits, depth } => {
                let k = key(r, depth, bits);
                if let Some(id) = h.ix.find(k) {
                    if h.ix.entry(id).visible() {
                        if leases.iter().any(|l| l.0.contains(&k)) {
                            dropped_pinned.insert(k);
                        }
                        let a = h.ix.drop_entry(id).keys.len();
                        let b = m.drop_entry(k);
                        prop_assert_eq!(a, b);
                    }
                }
            }
            Op::Clear => {
                let a = h.ix.clear().keys.len();
                let b = m.clear();
                prop_assert_eq!(a, b);
            }
        }
        h.ix.drain_invalidated();
        h.ix.drain_unlink();
        compare(&h, &m, &keys)?;
        // Leased blocks stay (unless dropped as corrupt).
        for (ks, _) in &leases {
            for k in ks {
                if !dropped_pinned.contains(k) {
                    prop_assert!(m.e[k].visible(), "leased block {:x} was evicted", k);
                }
            }
        }
    }
    for (_, ids) in leases {
        for id in ids {
            h.ix.unpin(id);
        }
    }
    h.ix.check_invariants().map_err(TestCaseError::fail)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_model_dram_only(ops in prop::collection::vec(op(), 1..60), slots in 1usize..10) {
        run(ops, slots, None)?;
    }

    #[test]
    fn index_matches_model_with_disk(ops in prop::collection::vec(op(), 1..60), slots in 1usize..8, disk in 1u64..12) {
        run(ops, slots, Some(disk))?;
    }
}

// ---------------------------------------------------------------- the whole store

mod whole_store {
    use super::store_util::*;
    use proptest::prelude::*;
    use tpu_sync::store::{DiskOptions, KvStore};

    const LEN: usize = 4096 + 123;

    #[derive(Debug, Clone)]
    enum SOp {
        Put(u64, usize),
        Get(u64, usize),
        Lookup(u64, usize),
        Pin(u64, usize),
        Unpin,
        Flush,
    }

    fn sop() -> impl Strategy<Value = SOp> {
        prop_oneof![
            4 => (0u64..6, 1usize..6).prop_map(|(s, n)| SOp::Put(s, n)),
            4 => (0u64..6, 1usize..6).prop_map(|(s, n)| SOp::Get(s, n)),
            2 => (0u64..6, 1usize..6).prop_map(|(s, n)| SOp::Lookup(s, n)),
            1 => (0u64..6, 1usize..6).prop_map(|(s, n)| SOp::Pin(s, n)),
            1 => Just(SOp::Unpin),
            1 => Just(SOp::Flush),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Every block a get delivers is byte-exact; a lookup's count is what a get then delivers;
        /// a whole chain just put (when it fit) is found whole.
        #[test]
        fn store_delivers_exact_bytes(ops in prop::collection::vec(sop(), 1..40), slots in 2u64..6, disk in prop::bool::ANY) {
            let d = TempDir::new("prop");
            let mut c = config(LEN as u64, slots);
            if disk {
                c.disk = Some(DiskOptions::new(&d.0, 6 * (4096 + 8192)));
            }
            let s = KvStore::open(c).unwrap();
            let mut leases = vec![];
            for op in ops {
                match op {
                    SOp::Put(seed, n) => {
                        let keys = chain(n, seed);
                        let r = put_chain(&s, &keys, LEN);
                        if r.complete() {
                            prop_assert_eq!(s.lookup(&keys), n);
                        }
                    }
                    SOp::Get(seed, n) => {
                        let keys = chain(n, seed);
                        let l = s.lookup(&keys);
                        let (g, bufs) = get_chain(&s, &keys, LEN);
                        assert_exact(&keys, &bufs, g.delivered);
                        // Disk blocks load through DRAM: with every slot leased they cannot.
                        if g.stop != Some(tpu_sync::store::StopReason::NoSpace) {
                            prop_assert_eq!(g.delivered, l, "{:?}", g);
                        }
                    }
                    SOp::Lookup(seed, n) => {
                        let keys = chain(n, seed);
                        let l = s.lookup(&keys);
                        for (i, k) in keys.iter().enumerate().skip(l) {
                            prop_assert_eq!(s.lookup(std::slice::from_ref(k)) , 0, "orphan {}", i);
                        }
                    }
                    SOp::Pin(seed, n) => leases.push(s.pin(&chain(n, seed))),
                    SOp::Unpin => { leases.pop(); }
                    SOp::Flush => { if disk { s.flush_to_disk().unwrap(); } }
                }
                s.debug_check().map_err(TestCaseError::fail)?;
            }
        }
    }
}
