//! Drivers that run on whoever gets to them first: a task on the runtime, or a caller waiting
//! for their result on its own thread.
//!
//! A transfer is driven by a future. Spawned on a multi-threaded Tokio runtime, its first poll
//! waits for a parked worker thread to wake (15-50 us on this project's 2-core VM), and the
//! caller that then waits for it is woken from another thread again at the end: on a 16 KiB
//! pull these two hand-overs cost about as much as the network exchange (docs/performance.md,
//! latency). So the driver is put in a [`DriverSlot`] and a starter task is spawned; a caller
//! that waits takes the driver out of the slot if the starter has not, and polls it itself
//! ([`DriveHere`]), within the runtime's context so the tasks it spawns go there. Either way
//! it runs exactly once.
//!
//! Thread-safety: the slot is a mutex; the driver is polled by one task or one waiter at a time.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

/// A driver and the runtime it belongs to.
pub(crate) type Driver = (
    Pin<Box<dyn Future<Output = ()> + Send>>,
    tokio::runtime::Handle,
);

/// Where a driver waits until a starter task or a waiter takes it.
#[derive(Default)]
pub(crate) struct DriverSlot(Mutex<Option<Driver>>);

impl DriverSlot {
    /// Puts `fut`, to run on `rt`, in the slot.
    pub(crate) fn put(
        &self,
        fut: impl Future<Output = ()> + Send + 'static,
        rt: tokio::runtime::Handle,
    ) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((Box::pin(fut), rt));
    }

    /// Takes the driver if nobody did yet.
    pub(crate) fn take(&self) -> Option<Driver> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The starter task's future: runs the driver of `owner`'s slot unless a waiter took it first.
/// Dropped before it ran (its runtime shut down, or its owner aborted its tasks), it drops the
/// driver too: a driver left in its slot would keep its owner alive (it holds the owner).
pub(crate) async fn start<T: Send + Sync + 'static>(owner: Arc<T>, slot: fn(&T) -> &DriverSlot) {
    struct ClearOnDrop<T>(Arc<T>, fn(&T) -> &DriverSlot);
    impl<T> Drop for ClearOnDrop<T> {
        fn drop(&mut self) {
            let unstarted = (self.1)(&self.0).take();
            drop(unstarted);
        }
    }
    let guard = ClearOnDrop(owner, slot);
    let driver = (guard.1)(&guard.0).take();
    if let Some((fut, _)) = driver {
        fut.await;
    }
}

/// Whether a waiter on this thread may run a driver itself: only inside a multi-threaded Tokio
/// runtime (a worker, or its `block_on`). Not inside a current-thread runtime: the driver's
/// large copies go through [`crate::util::off_worker`], whose `block_in_place` is refused there
/// once the driver's own (multi-threaded) runtime is entered. Not outside any runtime: such a
/// waiter is typically an executor of its own (the C ABI's completion thread, which also runs
/// user callbacks), where a driver would wait behind unrelated work. The starter task runs it
/// instead.
///
/// `TPU_SYNC_DRIVE_HERE=0` turns it off (every driver runs on a runtime task, as before
/// 2026-12-06): for comparing the two in one benchmark session.
pub(crate) fn may_drive_here() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("TPU_SYNC_DRIVE_HERE").map_or(true, |v| v != "0"));
    on && tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// A driver polled by a waiting caller, inside its runtime's context. Dropped before the driver
/// finished (the wait was cancelled, e.g. by a timeout, or the waiter only needed part of what
/// the driver does), it hands the driver to a task on that runtime, so the work goes on.
pub(crate) struct DriveHere(Option<Driver>);

impl DriveHere {
    /// Runs `driver` (nothing for `None`) when awaited.
    pub(crate) fn new(driver: Option<Driver>) -> DriveHere {
        DriveHere(driver)
    }
}

impl Future for DriveHere {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some((fut, rt)) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        let in_runtime = rt.enter();
        let r = fut.as_mut().poll(cx);
        drop(in_runtime);
        if r.is_ready() {
            self.0 = None;
        }
        r
    }
}

impl Drop for DriveHere {
    fn drop(&mut self) {
        if let Some((fut, rt)) = self.0.take() {
            rt.spawn(fut);
        }
    }
}
