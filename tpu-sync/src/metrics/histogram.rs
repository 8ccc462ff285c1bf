//! A lock-free histogram for the hot path, encoded by `prometheus-client`.
//!
//! `prometheus_client::metrics::histogram::Histogram` takes a mutex on every observation. The
//! copy engine and the network layer observe from PJRT callback threads and tokio tasks, so this
//! one keeps one `AtomicU64` per bucket, a count and the sum (an `f64` updated by
//! compare-and-swap) and hands them to the crate's encoder
//! ([`MetricEncoder::encode_histogram`]) at scrape time: the exposition format is still written
//! by the crate.
//!
//! A scrape reads the buckets, count and sum one after another without a lock, so an observation
//! racing a scrape may show in the count and not yet in a bucket (Prometheus tolerates this; the
//! next scrape is exact).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Upper bounds (seconds) of the duration histograms: 100 µs to 2 min, roughly 1-2.5-5 per
/// decade (the spread of one KV block copy to a whole long-prompt transfer).
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Debug)]
struct Inner {
    bounds: &'static [f64],
    /// One counter per bound, plus the `+Inf` bucket last.
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

/// A histogram with fixed upper bounds; cheap to clone (shared counters). `Send + Sync`.
#[derive(Debug, Clone)]
pub struct Histogram {
    inner: Arc<Inner>,
}

impl Histogram {
    /// A histogram over `bounds` (ascending upper bounds; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            inner: Arc::new(Inner {
                bounds,
                buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                count: AtomicU64::new(0),
                sum_bits: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    /// A histogram over [`SECONDS_BUCKETS`].
    pub fn seconds() -> Histogram {
        Histogram::new(SECONDS_BUCKETS)
    }

    /// Records one observation (NaN is ignored). Lock-free: three relaxed atomic adds and a
    /// compare-and-swap loop for the sum.
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = &self.inner;
        let b = i
            .bounds
            .iter()
            .position(|&u| v <= u)
            .unwrap_or(i.bounds.len());
        i.buckets[b].fetch_add(1, Ordering::Relaxed);
        let _ = i
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some((f64::from_bits(s) + v).to_bits())
            });
        i.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner.count.load(Ordering::Relaxed)
    }

    /// Sum of the observations so far.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.inner.sum_bits.load(Ordering::Relaxed))
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let i = &self.inner;
        let mut buckets: Vec<(f64, u64)> = Vec::with_capacity(i.buckets.len());
        for (n, c) in i.buckets.iter().enumerate() {
            let bound = i.bounds.get(n).copied().unwrap_or(f64::INFINITY);
            buckets.push((bound, c.load(Ordering::Relaxed)));
        }
        // The count is the sum of the buckets read, so that `+Inf` == `_count` in one scrape.
        let count = buckets.iter().map(|b| b.1).sum();
        encoder.encode_histogram::<NoLabelSet>(self.sum(), count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_count_and_sum() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 3.0, f64::NAN] {
            h.observe(v);
        }
        assert_eq!(h.count(), 4);
        assert_eq!(h.sum(), 6.0);
        let got: Vec<u64> = h
            .inner
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        assert_eq!(got, vec![2, 1, 1]);
    }
}
