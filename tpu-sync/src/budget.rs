//! Byte budgets for pinned host memory.
//!
//! Staging memory ([`crate::staging::Staging`]) and the host tier's slots
//! ([`crate::store::KvStore`]) are pre-faulted and, where `RLIMIT_MEMLOCK` allows, locked: the
//! kernel can neither swap nor reclaim them. A producer that registers requests faster than its
//! consumers pull them would grow without bound until an OOM killer ends the process, and every
//! staged request with it. A [`StagingBudget`] bounds that: each allocation first takes a
//! [`Reservation`] of its bytes, which is returned when the allocation is dropped. A reservation
//! that does not fit fails at once with [`Error::StagingExhausted`] (or, by option, waits up to a
//! deadline for earlier reservations to be returned); nothing already reserved is touched.
//!
//! Every [`crate::transfer::Pipeline`] uses the process-wide budget
//! ([`StagingBudget::process`]) unless it is given its own, and so does the host tier. The
//! process-wide limit is [`default_limit`]: a quarter of the memory this process may use, capped
//! by the hard `RLIMIT_MEMLOCK` where that is finite (and at least 64 MiB), or the value of
//! `TPU_SYNC_STAGING_BUDGET_BYTES`.
//!
//! Reclaimable bytes: a holder of idle reservations (the transfer pipeline's staging arena pool,
//! [`crate::staging::ArenaPool`]) registers itself with [`StagingBudget::add_reclaimer`]; a
//! reservation that does not fit first asks every live reclaimer to give idle bytes back
//! ([`Reclaim::reclaim`]) before it fails or waits, and a holder does not keep bytes idle while a
//! reservation waits ([`StagingBudget::has_waiters`]).
//!
//! Thread-safety: `Send + Sync`; reservations may be taken and dropped from any thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::util::fmt_bytes;

/// Environment variable overriding [`default_limit`] (a byte count, e.g. `1073741824`).
pub const ENV_STAGING_BUDGET: &str = "TPU_SYNC_STAGING_BUDGET_BYTES";

/// Smallest finite hard `RLIMIT_MEMLOCK` that caps the default budget. A smaller limit (8 MiB
/// is common for unprivileged users) means locking is effectively unavailable; staging then runs
/// unlocked ([`crate::arena::LockStatus::Failed`]) and capping the budget at it would refuse
/// ordinary requests.
pub const MIN_MEMLOCK_CAP: u64 = 64 << 20;

/// Counters of a budget ([`StagingBudget::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BudgetStats {
    /// The limit in bytes.
    pub limit_bytes: u64,
    /// Gauge: bytes reserved now.
    pub used_bytes: u64,
    /// Largest `used_bytes` seen.
    pub peak_bytes: u64,
    /// Gauge: live reservations.
    pub reservations: u64,
    /// Total: reservations refused ([`Error::StagingExhausted`]).
    pub refused: u64,
    /// Total: reservations that had to wait for bytes to be returned (and then got them).
    pub waited: u64,
}

#[derive(Debug, Default)]
struct State {
    used: u64,
    peak: u64,
    reservations: u64,
    /// Reservations waiting for bytes now.
    waiters: u64,
}

/// A holder of idle reservations that can give them back when a budget needs room
/// ([`StagingBudget::add_reclaimer`]).
pub trait Reclaim: Send + Sync + std::fmt::Debug {
    /// Drops idle reservations of about `bytes` (at least that many where it holds them) and
    /// returns the bytes given back. Called without any lock of the budget held; must not
    /// reserve from the budget.
    fn reclaim(&self, bytes: u64) -> u64;
}

/// A byte budget for pinned memory. See the [module docs](self).
#[derive(Debug)]
pub struct StagingBudget {
    name: String,
    limit: u64,
    state: Mutex<State>,
    freed: Condvar,
    refused: AtomicU64,
    waited: AtomicU64,
    reclaimers: Mutex<Vec<Weak<dyn Reclaim>>>,
}

/// Bytes taken from a [`StagingBudget`]; returned when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<StagingBudget>,
    bytes: u64,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The budget the bytes belong to.
    pub fn budget(&self) -> &Arc<StagingBudget> {
        &self.budget
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut s = self
            .budget
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        s.used = s.used.saturating_sub(self.bytes);
        s.reservations = s.reservations.saturating_sub(1);
        drop(s);
        self.budget.freed.notify_all();
    }
}

impl StagingBudget {
    /// A budget of `limit_bytes` (0 refuses every non-empty reservation). `name` appears in
    /// error messages (e.g. `endpoint prefill-0`).
    pub fn new(name: impl Into<String>, limit_bytes: u64) -> Arc<StagingBudget> {
        Arc::new(StagingBudget {
            name: name.into(),
            limit: limit_bytes,
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
            refused: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            reclaimers: Mutex::new(Vec::new()),
        })
    }

    /// Registers a holder of idle reservations of this budget: a reservation that does not fit
    /// asks it to give bytes back ([`Reclaim::reclaim`]) before failing or waiting. Held weakly
    /// (a dropped holder is forgotten).
    pub fn add_reclaimer(&self, r: Weak<dyn Reclaim>) {
        let mut v = self
            .reclaimers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        v.retain(|w| w.strong_count() > 0);
        v.push(r);
    }

    /// Whether a reservation is waiting for bytes now (a holder of idle bytes then returns them
    /// instead of keeping them idle).
    pub fn has_waiters(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .waiters
            > 0
    }

    /// Asks the registered reclaimers for `bytes`; returns the bytes given back.
    fn reclaim(&self, bytes: u64) -> u64 {
        let live: Vec<Arc<dyn Reclaim>> = self
            .reclaimers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut got = 0;
        for r in live {
            if got >= bytes {
                break;
            }
            got += r.reclaim(bytes - got);
        }
        got
    }

    /// The process-wide budget (limit [`default_limit`], read once), shared by every pipeline
    /// and host tier not given their own.
    pub fn process() -> &'static Arc<StagingBudget> {
        static P: OnceLock<Arc<StagingBudget>> = OnceLock::new();
        P.get_or_init(|| StagingBudget::new("process", default_limit()))
    }

    /// The budget's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .used
    }

    /// Counters.
    pub fn stats(&self) -> BudgetStats {
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        BudgetStats {
            limit_bytes: self.limit,
            used_bytes: s.used,
            peak_bytes: s.peak,
            reservations: s.reservations,
            refused: self.refused.load(Ordering::Relaxed),
            waited: self.waited.load(Ordering::Relaxed),
        }
    }

    /// Reserves `bytes` for `what` (a phrase for the error message, e.g. `staging of request
    /// 7`). With `wait` `None` a reservation that does not fit fails at once; with `Some(d)` it
    /// blocks the calling thread up to `d` for other reservations to be returned.
    ///
    /// Errors: [`Error::StagingExhausted`] naming the budget, the bytes asked for, the bytes in
    /// use and the limit; at once (whatever `wait` says) when `bytes` exceeds the limit itself.
    pub fn reserve(
        self: &Arc<Self>,
        bytes: u64,
        what: &str,
        wait: Option<Duration>,
    ) -> Result<Reservation> {
        let refuse = |used: u64, waited: Option<Duration>| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            Error::StagingExhausted(format!(
                "{what}: {} more would exceed the {} budget `{}` ({} in use by earlier \
                 requests{}); release or reject staged requests, or raise the budget \
                 (staging_budget_bytes, {ENV_STAGING_BUDGET})",
                fmt_bytes(bytes),
                fmt_bytes(self.limit),
                self.name,
                fmt_bytes(used),
                match waited {
                    Some(d) => format!(", waited {d:?}"),
                    None => String::new(),
                }
            ))
        };
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if bytes > self.limit {
            return Err(refuse(s.used, None));
        }
        let fits = |s: &State| s.used.saturating_add(bytes) <= self.limit;
        if !fits(&s) {
            // Idle bytes of reclaimers first (outside the lock: they drop reservations). The
            // waiter count is raised before, so that a holder returning bytes meanwhile frees
            // them instead of keeping them idle.
            let short = s.used.saturating_add(bytes) - self.limit;
            s.waiters += 1;
            drop(s);
            self.reclaim(short);
            s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            s.waiters -= 1;
        }
        if !fits(&s) {
            let Some(d) = wait else {
                return Err(refuse(s.used, None));
            };
            let deadline = Instant::now() + d;
            s.waiters += 1;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    s.waiters -= 1;
                    return Err(refuse(s.used, Some(d)));
                }
                s = self
                    .freed
                    .wait_timeout(s, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                if fits(&s) {
                    s.waiters -= 1;
                    self.waited.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        s.used += bytes;
        s.peak = s.peak.max(s.used);
        s.reservations += 1;
        Ok(Reservation {
            budget: self.clone(),
            bytes,
        })
    }
}

/// Memory this process may use: physical memory (`sysconf(_SC_PHYS_PAGES)`), or the lowest
/// memory limit of the process's own cgroup and its ancestors ([`cgroup_memory`]) when that is
/// lower.
pub fn process_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let phys = if pages > 0 && page > 0 {
        (pages as u64).saturating_mul(page as u64)
    } else {
        8 << 30
    };
    match cgroup_memory() {
        Some((limit, _)) if limit > 0 => phys.min(limit),
        _ => phys,
    }
}

/// The memory limit that binds this process and that cgroup's usage, in bytes: the lowest
/// limit of the process's own cgroup (from `/proc/self/cgroup`) and each ancestor up to the
/// root of the mounted hierarchy. cgroup v2: `memory.max` and `memory.current` under
/// `/sys/fs/cgroup`; v1: `memory.limit_in_bytes` and `memory.usage_in_bytes` under
/// `/sys/fs/cgroup/memory`. `None` when no limit is set or nothing is readable (no cgroup
/// filesystem).
pub fn cgroup_memory() -> Option<(u64, u64)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut tries: Vec<(std::path::PathBuf, &str, &str)> = Vec::new();
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = match (f.next(), f.next(), f.next()) {
            (Some(a), Some(b), Some(c)) => (a, b, c),
            _ => continue,
        };
        let (root, max, cur) = if ctrl.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if ctrl.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        // The cgroup itself, then each ancestor (a container sees its own cgroup as "/").
        let mut p = std::path::PathBuf::from(root);
        p.push(path.trim_start_matches('/'));
        loop {
            tries.push((p.clone(), max, cur));
            if p.as_os_str().len() <= root.len() || !p.pop() {
                break;
            }
        }
    }
    if tries.is_empty() {
        tries.push(("/sys/fs/cgroup".into(), "memory.max", "memory.current"));
        tries.push((
            "/sys/fs/cgroup/memory".into(),
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        ));
    }
    let read = |p: &std::path::Path| -> Option<u64> {
        std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok()
    };
    let mut best: Option<(u64, u64)> = None;
    for (dir, max, cur) in tries {
        // v1 reports "no limit" as a huge page-aligned number; anything past 2^62 is none.
        let Some(limit) = read(&dir.join(max)).filter(|&l| l > 0 && l < (1 << 62)) else {
            continue;
        };
        if best.is_none_or(|(b, _)| limit < b) {
            best = Some((limit, read(&dir.join(cur)).unwrap_or(0)));
        }
    }
    best
}

/// Bytes this process could still allocate now: `MemAvailable` of `/proc/meminfo`, or the
/// binding cgroup's limit less its usage ([`cgroup_memory`]) when that is lower.
pub fn available_memory() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib.saturating_mul(1024))
        .unwrap_or_else(process_memory);
    match cgroup_memory() {
        Some((limit, used)) => avail.min(limit.saturating_sub(used)),
        None => avail,
    }
}

/// Refuses an allocation of `bytes` (described by `what`, e.g. "device buffers of 4 ranks")
/// that this process cannot hold: more than [`available_memory`]. Checked before allocating,
/// so an impossible size is an error instead of an abort on a failed allocation (a Rust
/// allocation that fails aborts the process). A size that passes may still fail later if other
/// processes take the memory first.
///
/// Errors: [`Error::HostMemory`] naming `what`, the bytes needed and the bytes available.
pub fn check_fits(bytes: u64, what: &str) -> Result<()> {
    let avail = available_memory();
    if bytes > avail {
        return Err(Error::HostMemory(format!(
            "{what} need {} ({bytes} bytes), but this process can allocate at most {} now \
             (MemAvailable, or its cgroup's memory limit less usage)",
            fmt_bytes(bytes),
            fmt_bytes(avail)
        )));
    }
    Ok(())
}

/// The hard `RLIMIT_MEMLOCK`, `None` when unlimited or unreadable.
pub fn memlock_hard_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return None;
    }
    (r.rlim_max != libc::RLIM_INFINITY).then_some(r.rlim_max)
}

/// The default limit of the process-wide budget: `TPU_SYNC_STAGING_BUDGET_BYTES` when set to a
/// number; else a quarter of [`process_memory`], capped by the hard `RLIMIT_MEMLOCK` when that
/// is finite and at least [`MIN_MEMLOCK_CAP`] (pinned memory beyond it could not be locked).
pub fn default_limit() -> u64 {
    if let Some(v) = std::env::var(ENV_STAGING_BUDGET)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        return v;
    }
    let quarter = process_memory() / 4;
    match memlock_hard_limit() {
        Some(m) if m >= MIN_MEMLOCK_CAP => quarter.min(m),
        _ => quarter,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_refused_before_allocating() {
        let e = check_fits(u64::MAX / 2, "device buffers").unwrap_err();
        assert!(matches!(e, Error::HostMemory(_)), "{e}");
        assert!(e.to_string().contains("device buffers"), "{e}");
        check_fits(4096, "a page").unwrap();
        let avail = available_memory();
        assert!(avail > 4096 && avail <= process_memory(), "{avail}");
    }

    #[test]
    fn reservations_are_refused_past_the_limit_and_returned_on_drop() {
        let b = StagingBudget::new("test", 1000);
        let a = b.reserve(600, "a", None).unwrap();
        let e = b.reserve(500, "request 7", None).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::StagingExhausted);
        assert!(e.to_string().contains("request 7"), "{e}");
        let c = b.reserve(400, "c", None).unwrap();
        assert_eq!(b.used(), 1000);
        drop(a);
        assert_eq!(b.used(), 400);
        let s = b.stats();
        assert_eq!((s.peak_bytes, s.reservations, s.refused), (1000, 1, 1));
        drop(c);
        assert_eq!(b.stats().reservations, 0);
        assert!(b
            .reserve(1001, "too big", Some(Duration::from_secs(5)))
            .is_err());
    }

    #[test]
    fn a_waiting_reservation_gets_bytes_returned_by_another_thread() {
        let b = StagingBudget::new("test", 100);
        let a = b.reserve(100, "a", None).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(a);
        });
        let r = b.reserve(60, "b", Some(Duration::from_secs(30))).unwrap();
        t.join().unwrap();
        assert_eq!(r.bytes(), 60);
        assert_eq!(b.stats().waited, 1);
        let e = b
            .reserve(60, "c", Some(Duration::from_millis(20)))
            .unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::StagingExhausted);
    }

    #[test]
    fn default_limit_is_a_fraction_of_memory() {
        let m = process_memory();
        assert!(m > 0);
        if std::env::var_os(ENV_STAGING_BUDGET).is_none() {
            let d = default_limit();
            assert!(d > 0 && d <= m / 4, "{d} of {m}");
        }
    }
}
