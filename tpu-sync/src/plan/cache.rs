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

fn key_hash(src: &Placement, dst: &Placement, num_tokens: u32) -> u64 {
    let mut h = DefaultHasher::new();
    for p in [src, dst] {
        p.layout.hash(&mut h);
        p.dp_rank.hash(&mut h);
        p.block_ids.hash(&mut h);
        p.groups.is_some().hash(&mut h);
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
        if self.capacity == 0 {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return Plan::build(src, dst, num_tokens).map(Arc::new);
        }
        let hash = key_hash(src, dst, num_tokens);
        let same = |e: &Entry| {
            e.hash == hash && e.num_tokens == num_tokens && e.src == *src && e.dst == *dst
        };
        {
            let mut g = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = g.iter().position(same).and_then(|n| g.remove(n)) {
                let plan = e.plan.clone();
                g.push_back(e);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(plan);
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let plan = Arc::new(Plan::build(src, dst, num_tokens)?);
        let mut g = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = g.iter().find(|e| same(e)) {
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
