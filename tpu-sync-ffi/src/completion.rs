//! Completions of asynchronous operations (device copy batches, network transfers): poll, wait
//! with a timeout, or a callback, all on one object.
//!
//! A [`Completion`] is set exactly once, by whoever observes the operation finishing. Callbacks
//! run on one library thread, the *completion thread* (`tpu-sync-completions`), which also drives
//! the futures handed to [`drive`]. Because that thread delivers every completion, a callback
//! must not block waiting for another operation: a wait that would block on the completion
//! thread is refused with `TPU_SYNC_INVALID_ARGUMENT` instead of deadlocking.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::status::{invalid, tpu_sync_status, Failure, FfiResult};

/// Completion callback: `user_data` as given at registration, and the operation's final status
/// (`TPU_SYNC_OK` or the error it failed with; the message is available from the operation's
/// wait function, which does not block once the operation is done).
///
/// Called exactly once per registration, on the library's completion thread, never on the
/// registering thread and never while a library lock is held. It must return promptly and must
/// not wait for another unfinished operation (such waits return `TPU_SYNC_INVALID_ARGUMENT`
/// there); it may call any other function, including the operation's `*_free`.
pub type tpu_sync_callback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, status: tpu_sync_status)>;

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

enum Msg {
    Spawn(Task),
    Wake(u64),
    Run(Box<dyn FnOnce() + Send>),
}

thread_local! {
    static ON_COMPLETION_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is the completion thread.
pub(crate) fn on_completion_thread() -> bool {
    ON_COMPLETION_THREAD.with(|c| c.get())
}

fn sender() -> &'static Mutex<mpsc::Sender<Msg>> {
    static TX: OnceLock<Mutex<mpsc::Sender<Msg>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Msg>();
        let wake_tx = tx.clone();
        std::thread::Builder::new()
            .name("tpu-sync-completions".into())
            .spawn(move || completion_thread(rx, wake_tx))
            .expect("spawn the tpu-sync-completions thread");
        Mutex::new(tx)
    })
}

fn send(m: Msg) {
    let tx = sender().lock().unwrap_or_else(|p| p.into_inner()).clone();
    // The thread never exits while the process runs (it holds its own sender), so this only
    // fails during process teardown, when nothing is left to notify.
    let _ = tx.send(m);
}

struct TaskWaker {
    id: u64,
    tx: Mutex<mpsc::Sender<Msg>>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        let _ = self
            .tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(Msg::Wake(self.id));
    }
}

fn completion_thread(rx: mpsc::Receiver<Msg>, tx: mpsc::Sender<Msg>) {
    ON_COMPLETION_THREAD.with(|c| c.set(true));
    let mut tasks: HashMap<u64, Task> = HashMap::new();
    let mut next = 0u64;
    let poll = |tasks: &mut HashMap<u64, Task>, id: u64| {
        let Some(t) = tasks.get_mut(&id) else { return };
        let waker = Waker::from(Arc::new(TaskWaker {
            id,
            tx: Mutex::new(tx.clone()),
        }));
        let mut cx = Context::from_waker(&waker);
        // A task that panics is dropped; `Drive` turns its panics into a failed completion.
        match std::panic::catch_unwind(AssertUnwindSafe(|| t.as_mut().poll(&mut cx))) {
            Ok(Poll::Pending) => {}
            _ => {
                tasks.remove(&id);
            }
        }
    };
    for m in rx {
        match m {
            Msg::Spawn(t) => {
                let id = next;
                next += 1;
                tasks.insert(id, t);
                poll(&mut tasks, id);
            }
            Msg::Wake(id) => poll(&mut tasks, id),
            Msg::Run(f) => {
                let _ = std::panic::catch_unwind(AssertUnwindSafe(f));
            }
        }
    }
}

/// Stops delivering completion callbacks, process-wide and for good. Callbacks already due when
/// it is called (their operation had completed) are delivered first; then callbacks are turned
/// off: no callback registered with `tpu_sync_copy_set_callback` or
/// `tpu_sync_transfer_set_callback` is called any more. Registrations of operations that
/// complete later are dropped without a call (their `user_data` is not touched), and later
/// registrations are accepted and never called. Operations themselves are unaffected: they still
/// complete and can be polled, waited on and freed.
///
/// Waits up to `timeout_ms` milliseconds in all for the due callbacks and for a callback running
/// at the time of the call to return; returns `TPU_SYNC_TIMEOUT` if they did not (callbacks are
/// off regardless; a running one finishes on its own). Called from inside a callback it turns
/// callbacks off and returns at once, without waiting.
///
/// Meant for language runtimes that shut down while the process lives on: a runtime that tears
/// down its threads (CPython at interpreter exit) must not be entered from the library's
/// completion thread afterwards. The Python package calls it from `atexit`. Thread-safe.
#[no_mangle]
pub extern "C" fn tpu_sync_callbacks_disable(timeout_ms: u64) -> tpu_sync_status {
    crate::status::boundary("tpu_sync_callbacks_disable", || {
        if on_completion_thread() {
            CALLBACKS_OFF.store(true, Ordering::SeqCst);
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        // Everything queued on the completion thread before a marker has run once the marker
        // runs. First marker: the callbacks already due are delivered. Second (after turning
        // callbacks off): one scheduled in between has been dropped, and none is running.
        let flush = || -> FfiResult {
            let (tx, rx) = mpsc::channel::<()>();
            run_on_completion_thread(move || {
                let _ = tx.send(());
            });
            rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .map_err(|_| {
                    Failure(
                        tpu_sync_status::TPU_SYNC_TIMEOUT,
                        format!("completion callbacks were still running after {timeout_ms} ms"),
                    )
                })
        };
        let delivered = flush();
        CALLBACKS_OFF.store(true, Ordering::SeqCst);
        delivered.and_then(|_| flush())
    })
}

/// Runs `f` on the completion thread.
pub(crate) fn run_on_completion_thread(f: impl FnOnce() + Send + 'static) {
    send(Msg::Run(Box::new(f)));
}

#[derive(Clone, Copy)]
struct Callback {
    f: unsafe extern "C" fn(*mut c_void, tpu_sync_status),
    user: usize,
}

/// Set for good by [`tpu_sync_callbacks_disable`]: callbacks are dropped instead of called.
static CALLBACKS_OFF: AtomicBool = AtomicBool::new(false);

impl Callback {
    fn call(self, status: tpu_sync_status) {
        // Checked on the completion thread right before the call: a callback queued before
        // `tpu_sync_callbacks_disable` but not yet started is dropped too.
        if CALLBACKS_OFF.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: the caller registered `f` with `user` and promised both stay valid until the
        // one call (tpu_sync_*_set_callback contract).
        unsafe { (self.f)(self.user as *mut c_void, status) }
    }
}

struct State<T> {
    result: Option<Result<T, Failure>>,
    callback: Option<Callback>,
    callback_registered: bool,
}

/// The outcome of one asynchronous operation, set once.
pub(crate) struct Completion<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
}

impl<T: Clone + Send + 'static> Completion<T> {
    pub(crate) fn new() -> Arc<Completion<T>> {
        Arc::new(Completion {
            state: Mutex::new(State {
                result: None,
                callback: None,
                callback_registered: false,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the outcome (only the first call counts), wakes waiters, schedules the callback.
    pub(crate) fn complete(&self, r: Result<T, Failure>) {
        let mut g = self.lock();
        if g.result.is_some() {
            return;
        }
        let status = match &r {
            Ok(_) => tpu_sync_status::TPU_SYNC_OK,
            Err(f) => f.0,
        };
        g.result = Some(r);
        // The callback is queued before anyone can see the outcome (still under the lock): a
        // caller that saw the operation done and then calls `tpu_sync_callbacks_disable` finds
        // it due and has it delivered. Queueing only sends on a channel; it never blocks.
        if let Some(cb) = g.callback.take() {
            run_on_completion_thread(move || cb.call(status));
        }
        drop(g);
        self.cv.notify_all();
    }

    /// Whether the outcome is known.
    pub(crate) fn is_done(&self) -> bool {
        self.lock().result.is_some()
    }

    /// Waits up to `timeout` (`None`: without limit) and returns the outcome, or
    /// `TPU_SYNC_PENDING` when it is still running. Refuses to block on the completion thread.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> FfiResult<T> {
        let mut g = self.lock();
        if g.result.is_none() && timeout != Some(Duration::ZERO) && on_completion_thread() {
            return Err(invalid(
                "a completion callback may not wait for an unfinished operation (it would \
                 deadlock the completion thread); poll with a zero timeout instead",
            ));
        }
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        while g.result.is_none() {
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break;
                    }
                    g = self
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        match &g.result {
            Some(r) => r.clone(),
            None => Err(Failure(
                tpu_sync_status::TPU_SYNC_PENDING,
                format!(
                    "not complete after {} ms",
                    timeout.unwrap_or_default().as_millis()
                ),
            )),
        }
    }

    /// Registers the one callback; if the outcome is already known it is scheduled at once.
    pub(crate) fn set_callback(
        &self,
        f: unsafe extern "C" fn(*mut c_void, tpu_sync_status),
        user: *mut c_void,
    ) -> FfiResult {
        let cb = Callback {
            f,
            user: user as usize,
        };
        let mut g = self.lock();
        if g.callback_registered {
            return Err(invalid("a callback is already registered"));
        }
        g.callback_registered = true;
        match &g.result {
            Some(r) => {
                let status = match r {
                    Ok(_) => tpu_sync_status::TPU_SYNC_OK,
                    Err(f) => f.0,
                };
                drop(g);
                run_on_completion_thread(move || cb.call(status));
            }
            None => g.callback = Some(cb),
        }
        Ok(())
    }
}

/// A future that drives an operation to its [`Completion`], turning a panic into `TPU_SYNC_PANIC`.
struct Drive<T, F> {
    fut: Pin<Box<F>>,
    completion: Arc<Completion<T>>,
}

impl<T, F> Future for Drive<T, F>
where
    T: Clone + Send + 'static,
    F: Future<Output = Result<T, Failure>> + Send,
{
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        match std::panic::catch_unwind(AssertUnwindSafe(|| this.fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(r)) => {
                this.completion.complete(r);
                Poll::Ready(())
            }
            Err(_) => {
                this.completion.complete(Err(Failure(
                    tpu_sync_status::TPU_SYNC_PANIC,
                    "internal panic while completing an operation".into(),
                )));
                Poll::Ready(())
            }
        }
    }
}

/// Polls `fut` on the completion thread until it resolves, then completes `completion` with it.
/// `fut` must not block (it is polled on the shared completion thread).
pub(crate) fn drive<T, F>(completion: Arc<Completion<T>>, fut: F)
where
    T: Clone + Send + 'static,
    F: Future<Output = Result<T, Failure>> + Send + 'static,
{
    send(Msg::Spawn(Box::pin(Drive {
        fut: Box::pin(fut),
        completion,
    })));
}

/// Converts a C timeout in milliseconds (negative: no limit) into an optional duration.
pub(crate) fn timeout_ms(ms: i64) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}
