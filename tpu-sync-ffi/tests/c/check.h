/* Helpers shared by the C tests in this folder: a non-fatal CHECK that counts failures, the
 * thread's last library error, live handle counts, test data and clocks. Each test file
 * includes this once, after defining _POSIX_C_SOURCE where it needs POSIX clocks. */
#ifndef TPU_SYNC_TESTS_CHECK_H
#define TPU_SYNC_TESTS_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "tpu_sync.h"

/* Number of failed CHECKs so far; main() exits non-zero when it is not 0. */
static int failures = 0;

/* Records a failure (file, line, condition and a printf-style message) and goes on. */
#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);      \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
      failures++;                                                          \
    }                                                                      \
  } while (0)

/* The calling thread's last error message; the buffer is static (tests are single-threaded
 * where they read it). */
static inline const char *last_error(void) {
  static char buf[2048];
  size_t len = 0;
  tpu_sync_last_error(buf, sizeof buf, &len);
  return buf;
}

/* Live handles of one kind (TPU_SYNC_HANDLE_ALL: every kind). */
static inline uint64_t live_handles(uint32_t kind) {
  uint64_t n = 0;
  tpu_sync_handle_stats(kind, &n);
  return n;
}

/* Fills `n` bytes with non-zero, non-repeating data (xorshift64, seeded). */
static inline void fill(uint8_t *p, size_t n, uint32_t seed) {
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = (uint8_t)(x | 1u);
  }
}

#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 199309L
/* Monotonic clock, seconds. */
static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static inline void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}
#endif

#endif
