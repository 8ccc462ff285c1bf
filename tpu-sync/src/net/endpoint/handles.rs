//! The handles callers hold: [`SourceHandle`] (a source registration) and [`Transfer`] (a pull,
//! push or push reception), with the state they share with the driver.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{lock, Inner};
use crate::error::{Error, Result};
use crate::net::proto::{SourceOutcome, TransferId, TransferKind, TransferStats};
use crate::net::signal::Signal;
use crate::net::stream::Progress;

/// What a source registration's handle and the driver share (not the staging: the driver drops
/// it as soon as the registration ends).
pub(crate) struct SourceShared {
    pub(crate) request_id: u64,
    pub(crate) num_layers: u32,
    /// Layers published so far.
    pub(crate) layers: watch::Sender<u32>,
    pub(crate) outcome: Mutex<Option<SourceOutcome>>,
    pub(crate) done: Signal,
}

/// The producer's handle of a source registration. Holding it does not keep the staging alive:
/// the endpoint drops its staging reference when the registration ends.
pub struct SourceHandle {
    pub(crate) reg: Arc<SourceShared>,
}

impl SourceHandle {
    /// The request id.
    pub fn request_id(&self) -> u64 {
        self.reg.request_id
    }

    /// Announces that the first `layers` layers are in the staging (monotone; smaller values are
    /// ignored). Pullers blocked on a later layer continue.
    pub fn publish_layers(&self, layers: u32) {
        let n = layers.min(self.reg.num_layers);
        self.reg.layers.send_if_modified(|v| {
            if n > *v {
                *v = n;
                true
            } else {
                false
            }
        });
    }

    /// Leading layers published so far (every layer unless registered with fewer ready).
    pub fn layers_published(&self) -> u32 {
        *self.reg.layers.borrow()
    }

    /// How the registration ended, if it did.
    pub fn outcome(&self) -> Option<SourceOutcome> {
        lock(&self.reg.outcome).clone()
    }

    /// Waits until the registration ends or `timeout` passes ([`Error::Timeout`]). Returns the
    /// outcome; only [`SourceOutcome::Released`] means every consumer pulled it completely.
    pub async fn wait(&self, timeout: Duration) -> Result<SourceOutcome> {
        match tokio::time::timeout(timeout, self.reg.done.wait()).await {
            Ok(()) => Ok(self.outcome().unwrap_or(SourceOutcome::Shutdown)),
            Err(_) => Err(Error::Timeout(format!(
                "request {} was not released within {timeout:?}",
                self.reg.request_id
            ))),
        }
    }
}

/// What a transfer's handles and the driver share.
pub(crate) struct TransferShared {
    pub(crate) id: TransferId,
    pub(crate) request_id: u64,
    pub(crate) kind: TransferKind,
    pub(crate) started: Instant,
    pub(crate) result: Mutex<Option<Result<TransferStats>>>,
    pub(crate) done: Signal,
    /// Fired with the result (stripes stop).
    pub(crate) cancel: Signal,
    pub(crate) progress: Mutex<Option<Arc<Progress>>>,
    /// Fired once `progress` is set (a push reception learns its plan with the first push).
    pub(crate) planned: Signal,
    pub(crate) num_layers: u32,
    pub(crate) gate: Option<watch::Sender<u32>>,
    pub(crate) bytes: AtomicU64,
    /// The transfer's driver (runs the protocol, then records the result) until something
    /// runs it ([`Inner::start_driver`]).
    pub(crate) driver: crate::drive::DriverSlot,
}

/// A submitted transfer: await it, poll it, watch its layers, or cancel it. `Send + Sync`;
/// dropping the handle does not cancel the transfer.
#[derive(Clone)]
pub struct Transfer {
    pub(crate) shared: Arc<TransferShared>,
    pub(crate) inner: std::sync::Weak<Inner>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("id", &self.shared.id.0)
            .field("request_id", &self.shared.request_id)
            .field("kind", &self.shared.kind)
            .finish()
    }
}

impl Transfer {
    /// Endpoint-unique id of this transfer.
    pub fn id(&self) -> u64 {
        self.shared.id.0
    }

    /// The request.
    pub fn request_id(&self) -> u64 {
        self.shared.request_id
    }

    /// Pull, push or push reception.
    pub fn kind(&self) -> TransferKind {
        self.shared.kind
    }

    /// The result if finished: `Ok` only when every byte arrived and verified.
    pub fn poll(&self) -> Option<Result<TransferStats>> {
        lock(&self.shared.result).clone()
    }

    /// Waits for the result. A caller that waits before the endpoint's runtime started the
    /// transfer's driver runs the driver itself, on its own thread (within the endpoint's
    /// runtime context), which saves the wake-up of a runtime worker: about 50 us of a 16 KiB
    /// pull's 220 us on this project's 2-core VM (`tpu-sync bench latency`, docs/performance.md).
    /// Cancel-safe: dropping the wait before the end hands the driver back to the runtime. Not
    /// inside a current-thread runtime (`crate::drive::may_drive_here`): there a runtime task
    /// runs it.
    pub async fn wait(&self) -> Result<TransferStats> {
        let driver = if crate::drive::may_drive_here() {
            self.shared.driver.take()
        } else {
            // A transfer created unstarted (`Start::OnWait`) runs on the runtime instead.
            self.start();
            None
        };
        // Until the result is set, not until the driver ends: a cancelled transfer has its
        // result at once while its driver may still be unwinding (e.g. a connect bounded by the
        // handshake timeout); that rest goes back to the runtime when `here` is dropped.
        let mut here = driver.map(|d| crate::drive::DriveHere::new(Some(d)));
        loop {
            tokio::select! {
                biased;
                _ = self.shared.done.wait() => break,
                _ = async { if let Some(h) = here.as_mut() { h.await } }, if here.is_some() => {
                    here = None;
                }
            }
        }
        drop(here);
        self.poll()
            .unwrap_or_else(|| Err(Error::Cancelled("transfer vanished".into())))
    }

    /// Waits at most `timeout`; [`Error::Timeout`] leaves the transfer running.
    pub async fn wait_timeout(&self, timeout: Duration) -> Result<TransferStats> {
        match tokio::time::timeout(timeout, self.wait()).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "transfer of request {} not finished within {timeout:?}",
                self.shared.request_id
            ))),
        }
    }

    /// Starts the transfer's driver on the endpoint's runtime if nothing runs it yet: a
    /// transfer made by `Endpoint::pull_unstarted` or `Endpoint::push_unstarted` runs only once
    /// waited for or started. Idempotent; no effect once the endpoint is gone (its shutdown
    /// failed the transfer). Callable from any thread, inside a runtime or not.
    pub(crate) fn start(&self) {
        if !self.unstarted() {
            return;
        }
        if let Some(inner) = self.inner.upgrade() {
            inner.spawn_starter(&self.shared);
        }
    }

    /// Whether nothing has run the transfer's driver yet (made unstarted, not yet waited for
    /// or started).
    pub(crate) fn unstarted(&self) -> bool {
        self.shared.driver.is_full()
    }

    /// Cancels the transfer: it fails with [`Error::Cancelled`], its lanes are closed and its
    /// peers are told to stop. No effect on a finished transfer. A transfer that has not
    /// started sends nothing: its driver is dropped unrun.
    pub fn cancel(&self) {
        let unstarted = self.shared.driver.take();
        drop(unstarted);
        if let Some(inner) = self.inner.upgrade() {
            inner.finish(
                &self.shared,
                Err(Error::Cancelled(format!(
                    "request {} cancelled by the caller",
                    self.shared.request_id
                ))),
            );
            inner.send_cancel(
                self.shared.request_id,
                self.shared.kind == TransferKind::Push,
            );
        }
        self.shared.cancel.fire("cancelled");
    }

    /// Leading layers received and verified on every pair so far (receiving transfers).
    pub fn layers_complete(&self) -> u32 {
        match lock(&self.shared.progress).as_ref() {
            Some(p) => p.layers_complete(),
            None => 0,
        }
    }

    /// Waits until the first `layers` layers are complete (or the transfer fails: its error).
    pub async fn wait_layers(&self, layers: u32) -> Result<()> {
        self.start();
        let layers = layers.min(self.shared.num_layers);
        loop {
            let rx = lock(&self.shared.progress).as_ref().map(|p| p.subscribe());
            match rx {
                Some(mut rx) => {
                    tokio::select! {
                        r = rx.wait_for(|&v| v >= layers) => {
                            if r.is_ok() { return Ok(()); }
                        }
                        _ = self.shared.done.wait() => {}
                    }
                    if let Some(Err(e)) = self.poll() {
                        return Err(e);
                    }
                    if self.layers_complete() >= layers {
                        return Ok(());
                    }
                    if self.shared.done.is_set() {
                        return Ok(());
                    }
                }
                None => {
                    // A push reception learns its plan with the first push.
                    tokio::select! {
                        _ = self.shared.done.wait() => {
                            return self.wait().await.map(|_| ());
                        }
                        _ = self.shared.planned.wait() => {}
                    }
                }
            }
        }
    }

    /// Push senders: announces that the first `layers` layers are staged.
    pub fn publish_layers(&self, layers: u32) {
        if let Some(g) = &self.shared.gate {
            let n = layers.min(self.shared.num_layers);
            g.send_if_modified(|v| {
                if n > *v {
                    *v = n;
                    true
                } else {
                    false
                }
            });
        }
    }
}
