//! Drivers that run on whoever gets to them first: a task on the runtime, or a caller waiting
//! for their result on its own thread.
//!
//! A transfer is driven by a future. Spawned on a multi-threaded Tokio runtime, its first poll
//! waits for a parked worker thread to wake (15-50 us on this project's 2-core VM; Tokio's
//! woken worker then wakes a second one to look for more work), and the caller that then waits
//! for it is woken from another thread again at the end: on a 16 KiB pull these hand-overs cost
//! about as much as the network exchange (docs/performance.md, latency). So the driver is put
//! in a [`DriverSlot`]; a caller that waits takes the driver out of the slot if nothing else
//! has, and polls it itself ([`DriveHere`]), within the runtime's context so the tasks it
//! spawns go there. Nothing must wait for a caller, though, so the slot is started one of two
//! ways:
//! - [`start`]: a starter task spawned at once runs it unless a waiter took it first;
//! - [`DriverSlot::poll_first`]: the creator polls it once on its own thread (a pull's request
//!   leaves at once), with a waker that spawns it as a task when it is woken while still in
//!   the slot (its answer arrived and no caller waits). No thread is woken before the answer.
//!
//! Either way it runs exactly once, polled by one thread at a time.
//!
//! Thread-safety: the slot is a mutex; the driver is polled by one task or one waiter at a time.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// A driver and the runtime it belongs to.
pub(crate) type Driver = (
    Pin<Box<dyn Future<Output = ()> + Send>>,
    tokio::runtime::Handle,
);

/// Where a driver waits until a starter task, a waiter or its waker ([`DriverSlot::poll_first`])
/// takes it.
#[derive(Default)]
pub(crate) struct DriverSlot(Arc<Cell>);

#[derive(Default)]
struct Cell(Mutex<CellState>);

/// Spawns a driver taken out of its slot by its waker (the owner's own task tracking, so that a
/// shutdown can abort it and refuse new ones); without one, `Handle::spawn` of its runtime.
pub(crate) type Spawner = Arc<dyn Fn(Pin<Box<dyn Future<Output = ()> + Send>>) + Send + Sync>;

#[derive(Default)]
struct CellState {
    driver: Option<Driver>,
    spawner: Option<Spawner>,
    /// [`DriverSlot::poll_first`] is polling the driver (it is out of the slot).
    polling: bool,
    /// Woken during that poll: spawn it instead of putting it back.
    woken: bool,
}

impl Cell {
    fn lock(&self) -> std::sync::MutexGuard<'_, CellState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The waker of a driver polled by [`DriverSlot::poll_first`]: a wake that finds the driver in
/// its slot spawns it on its runtime. A driver that a waiter or a task took since is polled by
/// them with their own wakers, so a late wake of this one is dropped.
impl Wake for Cell {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut st = self.lock();
        if st.polling {
            st.woken = true;
            return;
        }
        let driver = st.driver.take();
        let spawner = st.spawner.clone();
        drop(st);
        if let Some((fut, rt)) = driver {
            spawn(fut, &rt, spawner.as_ref());
        }
    }
}

fn spawn(
    fut: Pin<Box<dyn Future<Output = ()> + Send>>,
    rt: &tokio::runtime::Handle,
    spawner: Option<&Spawner>,
) {
    match spawner {
        Some(s) => s(fut),
        None => {
            rt.spawn(fut);
        }
    }
}

impl DriverSlot {
    /// Puts `fut`, to run on `rt`, in the slot.
    pub(crate) fn put(
        &self,
        fut: impl Future<Output = ()> + Send + 'static,
        rt: tokio::runtime::Handle,
    ) {
        let old = self.0.lock().driver.replace((Box::pin(fut), rt));
        drop(old);
    }

    /// Sets how the driver's waker spawns it ([`DriverSlot::poll_first`]); without it, on its
    /// runtime directly.
    pub(crate) fn set_spawner(&self, spawner: Spawner) {
        self.0.lock().spawner = Some(spawner);
    }

    /// The runtime of the driver still in the slot (none once taken).
    pub(crate) fn runtime(&self) -> Option<tokio::runtime::Handle> {
        self.0.lock().driver.as_ref().map(|(_, rt)| rt.clone())
    }

    /// Takes the driver if nobody did yet.
    pub(crate) fn take(&self) -> Option<Driver> {
        self.0.lock().driver.take()
    }

    /// Whether the driver is still in the slot (nothing took it yet).
    pub(crate) fn is_full(&self) -> bool {
        self.0.lock().driver.is_some()
    }

    /// Polls the driver once on this thread, inside its runtime's context, with a waker that
    /// spawns it on the runtime when it is woken while still in the slot; a waiter may take it
    /// from the slot meanwhile and poll it itself. Returns at once (nothing for an empty slot).
    /// A panic of the driver is caught and logged; the driver is then dropped (its owner's
    /// drop guards report the failure).
    pub(crate) fn poll_first(&self) {
        let driver = {
            let mut st = self.0.lock();
            let d = st.driver.take();
            st.polling = d.is_some();
            d
        };
        let Some((mut fut, rt)) = driver else {
            return;
        };
        let waker = Waker::from(self.0.clone());
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _in_runtime = rt.enter();
            fut.as_mut().poll(&mut Context::from_waker(&waker))
        }));
        let mut st = self.0.lock();
        st.polling = false;
        let woken = std::mem::take(&mut st.woken);
        let spawner = st.spawner.clone();
        match polled {
            Ok(Poll::Pending) if !woken => {
                st.driver = Some((fut, rt));
            }
            Ok(Poll::Pending) => {
                drop(st);
                spawn(fut, &rt, spawner.as_ref());
            }
            Ok(Poll::Ready(())) => {
                drop(st);
                drop(fut);
            }
            Err(_) => {
                drop(st);
                log::error!("a transfer driver panicked in its first poll; it is dropped");
                drop(fut);
            }
        }
    }
}

/// The starter task's future: runs the driver of `owner`'s slot unless a waiter took it first.
/// Dropped before it ran (its runtime shut down, or its owner aborted its tasks), it drops the
/// driver too: a driver left in its slot would keep its owner alive (it holds the owner).
/// The guard exists from the call on, so a starter dropped before its first poll (queued when
/// its runtime shut down) also drops the driver.
pub(crate) fn start<T: Send + Sync + 'static>(
    owner: Arc<T>,
    slot: fn(&T) -> &DriverSlot,
) -> impl Future<Output = ()> + Send + 'static {
    struct ClearOnDrop<T>(Arc<T>, fn(&T) -> &DriverSlot);
    impl<T> Drop for ClearOnDrop<T> {
        fn drop(&mut self) {
            let unstarted = (self.1)(&self.0).take();
            drop(unstarted);
        }
    }
    let guard = ClearOnDrop(owner, slot);
    async move {
        let driver = (guard.1)(&guard.0).take();
        if let Some((fut, _)) = driver {
            fut.await;
        }
    }
}

/// Whether this thread may poll a driver once ([`DriverSlot::poll_first`]): anywhere but inside
/// a current-thread runtime, where the driver's large copies could not leave the thread
/// ([`crate::util::off_worker`]'s `block_in_place` is refused there). `TPU_SYNC_DRIVE_HERE=0`
/// turns it off too (a starter task runs every driver).
pub(crate) fn may_poll_first() -> bool {
    drive_here_on()
        && tokio::runtime::Handle::try_current().map_or(true, |h| {
            h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        })
}

fn drive_here_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TPU_SYNC_DRIVE_HERE").map_or(true, |v| v != "0"))
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
    drive_here_on()
        && tokio::runtime::Handle::try_current()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    use std::thread::ThreadId;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A driver that sleeps 20 ms, then reports the thread it ends on.
    async fn sleeper(tx: mpsc::Sender<ThreadId>) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(std::thread::current().id()).unwrap();
    }

    #[test]
    fn a_first_polled_driver_nobody_waits_for_runs_on_the_runtime_once_woken() {
        let rt = runtime();
        let slot = DriverSlot::default();
        let (tx, rx) = mpsc::channel();
        slot.put(sleeper(tx), rt.handle().clone());
        slot.poll_first();
        assert!(slot.is_full(), "a pending driver goes back to its slot");
        let ended_on = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the woken driver was never run");
        assert_ne!(ended_on, std::thread::current().id());
        assert!(!slot.is_full(), "its wake took it out of the slot");
    }

    #[test]
    fn a_waiter_takes_a_first_polled_driver_over_and_ends_it_on_its_own_thread() {
        let rt = runtime();
        let slot = DriverSlot::default();
        let (tx, rx) = mpsc::channel();
        slot.put(sleeper(tx), rt.handle().clone());
        slot.poll_first();
        let driver = slot.take();
        assert!(driver.is_some());
        rt.block_on(DriveHere::new(driver));
        assert_eq!(rx.try_recv().unwrap(), std::thread::current().id());
        // The first poll's waker may still fire (the timer's registration): it finds the slot
        // empty and does nothing.
        std::thread::sleep(Duration::from_millis(40));
        assert!(rx.try_recv().is_err(), "the driver ran exactly once");
    }

    #[test]
    fn a_driver_woken_during_its_first_poll_is_spawned_and_one_ready_at_once_is_dropped() {
        let rt = runtime();
        let slot = DriverSlot::default();
        let (tx, rx) = mpsc::channel();
        let mut first = true;
        slot.put(
            std::future::poll_fn(move |cx| {
                if std::mem::take(&mut first) {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                tx.send(std::thread::current().id()).unwrap();
                Poll::Ready(())
            }),
            rt.handle().clone(),
        );
        slot.poll_first();
        assert!(!slot.is_full(), "woken while polled: spawned, not put back");
        let ended_on = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_ne!(ended_on, std::thread::current().id());

        let (tx, rx) = mpsc::channel();
        slot.put(
            async move { tx.send(std::thread::current().id()).unwrap() },
            rt.handle().clone(),
        );
        slot.poll_first();
        assert!(!slot.is_full());
        assert_eq!(rx.try_recv().unwrap(), std::thread::current().id());
    }

    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_starter_dropped_before_its_first_poll_drops_the_driver() {
        struct Owner(DriverSlot);
        let rt = runtime();
        let owner = Arc::new(Owner(DriverSlot::default()));
        let dropped = Arc::new(AtomicBool::new(false));
        let guard = Dropped(dropped.clone());
        owner.0.put(
            async move {
                let _guard = guard;
            },
            rt.handle().clone(),
        );
        assert!(owner.0.runtime().is_some());
        let starter = start(owner.clone(), |o: &Owner| &o.0);
        drop(starter);
        assert!(!owner.0.is_full());
        assert!(owner.0.runtime().is_none());
        assert!(
            dropped.load(Ordering::SeqCst),
            "the unrun driver was dropped"
        );
    }

    #[test]
    fn a_panic_in_the_first_poll_is_caught_and_the_driver_dropped() {
        let rt = runtime();
        let slot = DriverSlot::default();
        let dropped = Arc::new(AtomicBool::new(false));
        let guard = Dropped(dropped.clone());
        slot.put(
            async move {
                let _guard = guard;
                if !_guard.0.load(Ordering::SeqCst) {
                    panic!("driver bug");
                }
            },
            rt.handle().clone(),
        );
        slot.poll_first();
        assert!(!slot.is_full());
        assert!(
            dropped.load(Ordering::SeqCst),
            "the driver's state was dropped"
        );
    }
}
