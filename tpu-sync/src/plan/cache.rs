//! A bounded cache of built plans ([`PlanCache`]).

use std::collections::hash_map::DefaultHasher;
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{Placement, Plan};
use crate::error::Result;

/// Default capacity of a [`PlanCache`] (plans).
pub const DEFAULT_PLAN_CACHE_ENTRIES: usize = 64;

/// Counters of a [`PlanCache`] ([`PlanCache::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanCacheStats {
    /// Most plans kept.
    pub capacity: u64,
    /// Gauge: plans kept now.
    pub entries: u64,
    /// Total: lookups answered from the cache.
    pub hits: u64,
    /// Total: lookups that built a plan ([`Plan::build`]), failed builds included.
    pub misses: u64,
}

struct Entry {
    hash: u64,
    src: Placement,
    dst: Placement,
    num_tokens: u32,
    plan: Arc<Plan>,
}

impl Entry {
    fn same(&self, hash: u64, src: &Placement, dst: &Placement, num_tokens: u32) -> bool {
        self.hash == hash && self.num_tokens == num_tokens && self.src == *src && self.dst == *dst
    }
}

/// Plans by `(source placement, destination placement, tokens)`, least recently used evicted
/// past the capacity. [`Plan::build`] is a pure function of those three, so a hit is the plan a
/// build would return; keys compare by value (the whole placements, block ids included), a hash
/// only narrows the search. Failed builds are not cached.
///
/// Thread-safety: `Send + Sync`; a build runs outside the lock (two threads missing the same key
/// both build, the second insert replaces nothing and returns the first plan).
pub struct PlanCache {
    capacity: usize,
    /// Most recently used last.
    entries: Mutex<VecDeque<Entry>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanCache")
            .field("stats", &self.stats())
            .finish()
    }
}

/// Token-heads (tokens x KV heads, KV cache groups counted four times) above which a plan build
/// leaves the async worker ([`PlanCache::get_or_build_off_worker`]): [`Plan::build`] walks
/// every (token, head) row of the destination once, a few tens of nanoseconds each, so this
/// many take about a millisecond on one core (Llama-3.1-8B's 8 heads at 2,048 tokens: 16,384).
pub const LARGE_PLAN_TOKEN_HEADS: u64 = 16 << 10;

/// Whether building `src -> dst` for `num_tokens` is large enough to leave an async worker
/// ([`LARGE_PLAN_TOKEN_HEADS`]).
pub fn plan_is_large(src: &Placement, dst: &Placement, num_tokens: u32) -> bool {
    let heads = src
        .layout
        .model
        .num_kv_heads
        .max(dst.layout.model.num_kv_heads)
        .max(1) as u64;
    let groups = if src.groups.is_some() || dst.groups.is_some() {
        4
    } else {
        1
    };
    num_tokens as u64 * heads * groups >= LARGE_PLAN_TOKEN_HEADS
}

fn key_hash(src: &Placement, dst: &Placement, num_tokens: u32) -> u64 {
    let mut h = DefaultHasher::new();
    for p in [src, dst] {
        p.layout.hash(&mut h);
        p.dp_rank.hash(&mut h);
        p.block_ids.hash(&mut h);
        p.groups.is_some().hash(&mut h);
        p.first_token.hash(&mut h);
    }
    num_tokens.hash(&mut h);
    h.finish()
}

impl PlanCache {
    /// A cache of at most `capacity` plans (0: nothing is cached, every lookup builds).
    pub fn new(capacity: usize) -> PlanCache {
        PlanCache {
            capacity,
            entries: Mutex::new(VecDeque::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The plan of `src -> dst` for `num_tokens`: the cached one (the same `Arc`), or
    /// [`Plan::build`]'s, which is then cached.
    ///
    /// Errors: those of [`Plan::build`].
    pub fn get_or_build(
        &self,
        src: &Placement,
        dst: &Placement,
        num_tokens: u32,
    ) -> Result<Arc<Plan>> {
        if let Some(p) = self.cached(src, dst, num_tokens) {
            return Ok(p);
        }
        self.build(src, dst, num_tokens)
    }

    /// [`PlanCache::get_or_build`] from async code: a hit is answered here; a build that
    /// [`plan_is_large`] runs with the runtime worker handed over to another thread first
    /// ([`crate::util::off_worker`]), so the worker's other tasks (heartbeats, lanes) keep
    /// running meanwhile; a small one (tens of microseconds) runs here.
    ///
    /// Errors: those of [`Plan::build`].
    pub fn get_or_build_off_worker(
        &self,
        src: &Placement,
        dst: &Placement,
        num_tokens: u32,
    ) -> Result<Arc<Plan>> {
        match self.cached(src, dst, num_tokens) {
            Some(p) => Ok(p),
            None if plan_is_large(src, dst, num_tokens) => {
                crate::util::off_worker(|| self.build(src, dst, num_tokens))
            }
            None => self.build(src, dst, num_tokens),
        }
    }

    /// The cached plan of `src -> dst` for `num_tokens` (counted as a hit), if any.
    pub fn cached(&self, src: &Placement, dst: &Placement, num_tokens: u32) -> Option<Arc<Plan>> {
        if self.capacity == 0 {
            return None;
        }
        let hash = key_hash(src, dst, num_tokens);
        let mut g = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let n = g.iter().position(|e| e.same(hash, src, dst, num_tokens))?;
        let e = g.remove(n)?;
        let plan = e.plan.clone();
        g.push_back(e);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(plan)
    }

    /// Builds the plan (a miss) and caches it.
    fn build(&self, src: &Placement, dst: &Placement, num_tokens: u32) -> Result<Arc<Plan>> {
        self.misses.fetch_add(1, Ordering::Relaxed);
        let plan = Arc::new(Plan::build(src, dst, num_tokens)?);
        if self.capacity == 0 {
            return Ok(plan);
        }
        let hash = key_hash(src, dst, num_tokens);
        let mut g = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = g.iter().find(|e| e.same(hash, src, dst, num_tokens)) {
            return Ok(e.plan.clone());
        }
        while g.len() >= self.capacity {
            g.pop_front();
        }
        g.push_back(Entry {
            hash,
            src: src.clone(),
            dst: dst.clone(),
            num_tokens,
            plan: plan.clone(),
        });
        Ok(plan)
    }

    /// Counters.
    pub fn stats(&self) -> PlanCacheStats {
        PlanCacheStats {
            capacity: self.capacity as u64,
            entries: self.entries.lock().unwrap_or_else(|p| p.into_inner()).len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, ModelKv, ParallelLayout, ParallelSpec};

    fn place(spec: &str, ids: Vec<Vec<u32>>) -> Placement {
        let model = ModelKv {
            name: "toy".into(),
            num_layers: 2,
            num_kv_heads: 4,
            head_dim: 8,
            kv_planes: 2,
            dtype: DType::Bf16,
        };
        Placement {
            first_token: 0,
            layout: ParallelLayout::new(model, ParallelSpec::parse(spec).unwrap(), 16).unwrap(),
            dp_rank: 0,
            block_ids: ids,
            groups: None,
        }
    }

    #[test]
    fn hits_return_the_same_plan_and_keys_do_not_collide() {
        let src = place("tp=2,block=16", vec![vec![7, 2, 5], vec![1, 4, 0]]);
        let dst = place("tp=1,block=32,order=hnd", vec![vec![5, 1]]);
        let other = place("tp=1,block=32,order=hnd", vec![vec![1, 5]]);
        let cache = PlanCache::new(2);
        let a = cache.get_or_build(&src, &dst, 40).unwrap();
        let again = cache.get_or_build(&src, &dst, 40).unwrap();
        assert!(Arc::ptr_eq(&a, &again), "a hit is the cached plan");
        assert_eq!(*a, Plan::build(&src, &dst, 40).unwrap());
        // Other tokens, other destination blocks: other plans, each equal to a fresh build.
        let fewer = cache.get_or_build(&src, &dst, 33).unwrap();
        assert!(!Arc::ptr_eq(&a, &fewer));
        assert_eq!(*fewer, Plan::build(&src, &dst, 33).unwrap());
        assert_ne!(*fewer, *a);
        let moved = cache.get_or_build(&src, &other, 40).unwrap();
        assert_eq!(*moved, Plan::build(&src, &other, 40).unwrap());
        assert_ne!(*moved, *a);
        let st = cache.stats();
        assert_eq!((st.hits, st.misses, st.entries), (1, 3, 2), "{st:?}");
        // Capacity 2: the least recently used (src -> dst, 40) was evicted.
        let rebuilt = cache.get_or_build(&src, &dst, 40).unwrap();
        assert!(!Arc::ptr_eq(&a, &rebuilt));
        assert_eq!(*rebuilt, *a);
        // A failed build is an error, not cached.
        assert!(cache.get_or_build(&src, &dst, 0).is_err());
        assert_eq!(cache.stats().entries, 2);
        let off = PlanCache::new(0);
        let x = off.get_or_build(&src, &dst, 40).unwrap();
        assert!(!Arc::ptr_eq(&x, &off.get_or_build(&src, &dst, 40).unwrap()));
    }
}
