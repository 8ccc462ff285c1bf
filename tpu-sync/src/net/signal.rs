//! [`Signal`]: a one-shot broadcast flag with a reason, awaited by the driver's tasks.

use std::sync::atomic::{AtomicBool, Ordering};

/// A one-shot broadcast flag with a reason.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    set: AtomicBool,
    why: std::sync::Mutex<Option<String>>,
    n: tokio::sync::Notify,
}

impl Signal {
    pub(crate) fn fire(&self, why: impl Into<String>) {
        {
            let mut g = self.why.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                *g = Some(why.into());
            }
        }
        self.set.store(true, Ordering::SeqCst);
        self.n.notify_waiters();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    pub(crate) fn reason(&self) -> String {
        self.why
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_default()
    }

    pub(crate) async fn wait(&self) {
        loop {
            let f = self.n.notified();
            tokio::pin!(f);
            f.as_mut().enable();
            if self.is_set() {
                return;
            }
            f.await;
        }
    }
}
