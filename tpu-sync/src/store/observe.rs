//! Observers of a store's contents: who else should know which blocks this host tier holds.
//!
//! The cluster prefix directory ([`crate::cluster`]) publishes a store's keys to etcd; it learns
//! what changed through a [`StoreObserver`] registered with [`super::KvStore::observe`]. The
//! store calls observers **while it holds its index lock**, in the order the changes happened, so
//! an observer sees a block's put before its removal and never the other way round. An observer
//! must therefore be quick and must not call back into the store: record the change (a short
//! mutex, a channel) and act on it elsewhere.
//!
//! What is reported:
//!
//! * [`StoreObserver::stored`]: blocks a put has just committed (new blocks only; a block already
//!   present, or loaded back from the disk tier into DRAM, is not new), in chain order, with the
//!   parent each was stored under.
//! * [`StoreObserver::removed`]: blocks that left the store entirely (evicted from the last tier
//!   holding them, dropped as corrupt or unreadable, [`super::KvStore::remove`],
//!   [`super::KvStore::clear`]). A block that moves from DRAM to the disk tier stays. A removal
//!   may name a key that was never reported stored (a put that was aborted before its commit):
//!   observers ignore keys they do not know.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::key::BlockKey;

/// A block as observers see it: `(key, parent)`, the parent being the key the block was stored
/// under (`None` for the first block of a sequence).
pub type ObservedBlock = (BlockKey, Option<BlockKey>);

/// Told about blocks entering and leaving a [`super::KvStore`] (see the module docs for the
/// ordering and the rules: quick, no calls back into the store). `Send + Sync`: called from
/// whichever thread changed the store.
pub trait StoreObserver: Send + Sync {
    /// Blocks just committed by a put: `(key, parent)` in chain order (`parent` is the key the
    /// block was stored under, `None` for the first block of a sequence).
    fn stored(&self, blocks: &[ObservedBlock]);
    /// Blocks no longer in the store (no DRAM and no disk copy).
    fn removed(&self, keys: &[BlockKey]);
}

/// Identifies a registered observer, for [`super::KvStore::unobserve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObserverId(pub(crate) u64);

#[derive(Default)]
pub(crate) struct Observers {
    next: AtomicU64,
    list: Mutex<Vec<(u64, Arc<dyn StoreObserver>)>>,
    /// Fast path: no observer, nothing to collect.
    any: std::sync::atomic::AtomicBool,
}

impl Observers {
    pub(crate) fn add(&self, o: Arc<dyn StoreObserver>) -> ObserverId {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut l = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        l.push((id, o));
        self.any.store(true, Ordering::Release);
        ObserverId(id)
    }

    pub(crate) fn remove(&self, id: ObserverId) -> bool {
        let mut l = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        let before = l.len();
        l.retain(|(i, _)| *i != id.0);
        self.any.store(!l.is_empty(), Ordering::Release);
        l.len() != before
    }

    pub(crate) fn active(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    pub(crate) fn stored(&self, blocks: &[ObservedBlock]) {
        if blocks.is_empty() || !self.active() {
            return;
        }
        for (_, o) in self
            .list
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            o.stored(blocks);
        }
    }

    pub(crate) fn removed(&self, keys: &[BlockKey]) {
        if keys.is_empty() || !self.active() {
            return;
        }
        for (_, o) in self
            .list
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            o.removed(keys);
        }
    }
}
