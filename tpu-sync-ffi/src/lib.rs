//! C ABI of tpu-sync.
