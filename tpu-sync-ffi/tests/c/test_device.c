/* C tests of the device layer over the ABI: adopting PJRT handles, zero-copy views and their
 * release, buffer descriptions, asynchronous copy batches (poll, wait, callback, cancel, free),
 * DMA pacing. Built and run by `make test-c` with: cc -std=c11 -Wall -Wextra -Werror -pedantic. */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

static char *info_of(const tpu_sync_buffer *b) {
  static char buf[4096];
  size_t len = 0;
  if (tpu_sync_buffer_info(b, buf, sizeof buf, &len) != TPU_SYNC_OK) return NULL;
  return buf;
}

static atomic_int callback_calls;
static atomic_int callback_status;
static void on_done(void *user, tpu_sync_status status) {
  atomic_store(&callback_status, (int)status);
  atomic_fetch_add(&callback_calls, *(int *)user);
}

static void test_adoption(tpu_sync_client *client) {
  const void *api = NULL;
  void *raw_client = NULL;
  CHECK(tpu_sync_client_pjrt(client, &api, &raw_client) == TPU_SYNC_OK && api && raw_client, "raw pointers");
  tpu_sync_client *adopted = NULL;
  CHECK(tpu_sync_client_adopt(api, raw_client, &adopted) == TPU_SYNC_OK, "adopt client: %s", last_error());
  CHECK(tpu_sync_client_adopt(NULL, raw_client, &adopted) == TPU_SYNC_NULL_POINTER, "adopt NULL api");
  size_t n = 0;
  CHECK(tpu_sync_client_device_count(adopted, &n) == TPU_SYNC_OK && n == 2, "adopted sees 2 devices: %zu", n);

  /* A buffer of the owning client, adopted through the adopted client. */
  enum { N = 4096 };
  uint8_t src[N], back[N];
  fill(src, N, 11);
  int64_t dims[2] = {64, 64};
  tpu_sync_buffer *owned = NULL, *adopted_buf = NULL;
  CHECK(tpu_sync_buffer_from_host(client, 1, src, N, dims, 2, TPU_SYNC_DTYPE_U8, &owned) == TPU_SYNC_OK, "from_host");
  void *raw_buf = NULL;
  CHECK(tpu_sync_buffer_pjrt(owned, &raw_buf) == TPU_SYNC_OK && raw_buf, "raw buffer");
  CHECK(tpu_sync_buffer_adopt(adopted, raw_buf, &adopted_buf) == TPU_SYNC_OK, "adopt buffer: %s", last_error());
  memset(back, 0, N);
  CHECK(tpu_sync_buffer_read(adopted_buf, 0, back, N) == TPU_SYNC_OK && memcmp(src, back, N) == 0, "adopted reads");
  const char *info = info_of(adopted_buf);
  CHECK(info && strstr(info, "\"owned\":false") && strstr(info, "\"device\":1"), "adopted info: %s", info);
  /* Freeing the adopted handles destroys nothing: the owned buffer still reads. */
  CHECK(tpu_sync_buffer_free(adopted_buf) == TPU_SYNC_OK, "free adopted buffer");
  CHECK(tpu_sync_client_free(adopted) == TPU_SYNC_OK, "free adopted client");
  memset(back, 0, N);
  CHECK(tpu_sync_buffer_read(owned, 0, back, N) == TPU_SYNC_OK && memcmp(src, back, N) == 0, "owner still reads");

  /* A buffer of another PJRT client is refused by this client. */
  tpu_sync_client *other = NULL;
  CHECK(tpu_sync_client_new(NULL, 1, &other) == TPU_SYNC_OK, "second client");
  tpu_sync_buffer *foreign = NULL, *bad = NULL;
  CHECK(tpu_sync_buffer_from_host(other, 0, src, N, dims, 2, TPU_SYNC_DTYPE_U8, &foreign) == TPU_SYNC_OK, "foreign");
  void *raw_foreign = NULL;
  tpu_sync_buffer_pjrt(foreign, &raw_foreign);
  CHECK(tpu_sync_buffer_adopt(client, raw_foreign, &bad) == TPU_SYNC_INVALID_ARGUMENT, "foreign buffer refused");
  CHECK(strstr(last_error(), "another client") != NULL, "message: %s", last_error());
  tpu_sync_buffer_free(foreign);
  tpu_sync_client_free(other);
  tpu_sync_buffer_free(owned);
}

static void test_view(tpu_sync_client *client) {
  enum { N = 1 << 16 };
  uint8_t *mem = aligned_alloc(64, N + 64);
  fill(mem, N + 64, 5);
  int64_t dims[1] = {N / 4};
  tpu_sync_buffer *view = NULL;
  tpu_sync_release *rel = NULL;
  /* Misaligned memory is refused, not silently copied. */
  CHECK(tpu_sync_client_view(client, 0, mem + 8, N, dims, 1, TPU_SYNC_DTYPE_F32, NULL, &view, &rel) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "misaligned view");
  CHECK(strstr(last_error(), "64-byte aligned") != NULL, "message: %s", last_error());
  CHECK(tpu_sync_client_view(client, 0, mem, N - 1, dims, 1, TPU_SYNC_DTYPE_F32, NULL, &view, &rel) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "len too small");
  CHECK(tpu_sync_client_view(client, 0, mem, N, dims, 1, TPU_SYNC_DTYPE_F32, "no-such-memory", &view, &rel) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "unknown memory kind");
  CHECK(tpu_sync_client_view(client, 5, mem, N, dims, 1, TPU_SYNC_DTYPE_F32, NULL, &view, &rel) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "bad device");
  CHECK(tpu_sync_client_view(client, 0, mem, N, dims, 1, TPU_SYNC_DTYPE_F32, NULL, &view, &rel) == TPU_SYNC_OK,
        "view: %s", last_error());
  const char *info = info_of(view);
  CHECK(info && strstr(info, "\"view\":true") && strstr(info, "\"dtype\":\"f32\"") &&
            strstr(info, "\"physical_layout\":\"{0}\""),
        "view info: %s", info);
  /* Zero-copy: the view reads the memory, and a change to the memory shows through. */
  uint8_t *back = malloc(N);
  CHECK(tpu_sync_buffer_read(view, 0, back, N) == TPU_SYNC_OK && memcmp(back, mem, N) == 0, "view reads memory");
  mem[1234] ^= 0x5a;
  CHECK(tpu_sync_buffer_read(view, 1234, back, 1) == TPU_SYNC_OK && back[0] == mem[1234], "aliasing read");
  uint8_t patch[300];
  fill(patch, sizeof patch, 6);
  CHECK(tpu_sync_buffer_write(view, 4000, patch, sizeof patch) == TPU_SYNC_OK, "write through view");
  CHECK(memcmp(mem + 4000, patch, sizeof patch) == 0, "write lands in caller memory");
  /* Release: pending while the buffer lives, released after it is freed. */
  CHECK(tpu_sync_release_wait(rel, 0) == TPU_SYNC_PENDING, "not released while alive");
  CHECK(tpu_sync_buffer_free(view) == TPU_SYNC_OK, "free view");
  CHECK(tpu_sync_release_wait(rel, 5000) == TPU_SYNC_OK, "released: %s", last_error());
  CHECK(tpu_sync_release_free(rel) == TPU_SYNC_OK, "free release");
  CHECK(tpu_sync_release_wait(rel, 0) == TPU_SYNC_INVALID_HANDLE, "freed release handle");
  free(back);
  free(mem);
}

static void test_copies(tpu_sync_client *client) {
  enum { L = 4, N = 1 << 16 };
  uint8_t *src = malloc(L * N), *host = malloc(L * N);
  fill(src, L * N, 9);
  int64_t dims[1] = {N};
  tpu_sync_buffer *bufs[L];
  for (int i = 0; i < L; i++)
    CHECK(tpu_sync_buffer_from_host(client, (size_t)(i % 2), src + i * N, N, dims, 1, TPU_SYNC_DTYPE_U8, &bufs[i]) ==
              TPU_SYNC_OK,
          "buffer %d", i);

  /* Small chunks so that the batch is split: the counters show it. */
  CHECK(tpu_sync_pacing_set(8192, 1 << 20) == TPU_SYNC_OK, "pacing");
  char pacing[1024];
  CHECK(tpu_sync_pacing_stats(pacing, sizeof pacing, NULL) == TPU_SYNC_OK && strstr(pacing, "\"chunk_bytes\":8192"),
        "pacing stats: %s", pacing);

  /* D2H of every buffer, in reverse order into the host array; callback + wait. */
  tpu_sync_copy_op ops[L];
  for (int i = 0; i < L; i++) ops[i] = (tpu_sync_copy_op){bufs[i], 0, N, host + (L - 1 - i) * N};
  memset(host, 0, L * N);
  tpu_sync_copy *copy = NULL;
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, ops, L, 0, &copy) == TPU_SYNC_OK, "submit: %s", last_error());
  static int one = 1;
  atomic_store(&callback_calls, 0);
  CHECK(tpu_sync_copy_set_callback(copy, on_done, &one) == TPU_SYNC_OK, "callback");
  CHECK(tpu_sync_copy_set_callback(copy, on_done, &one) == TPU_SYNC_INVALID_ARGUMENT, "one callback only");
  tpu_sync_copy_stats st = {0};
  CHECK(tpu_sync_copy_wait(copy, 10000, &st) == TPU_SYNC_OK, "wait: %s", last_error());
  CHECK(st.bytes == (uint64_t)L * N && st.ops == L && st.chunks == (uint64_t)L * N / 8192, "stats %llu %llu %llu",
        (unsigned long long)st.bytes, (unsigned long long)st.ops, (unsigned long long)st.chunks);
  for (int i = 0; i < L; i++) CHECK(memcmp(host + (L - 1 - i) * N, src + i * N, N) == 0, "d2h bytes of %d", i);
  for (int t = 0; t < 500 && atomic_load(&callback_calls) == 0; t++) sleep_ms(10);
  CHECK(atomic_load(&callback_calls) == 1 && atomic_load(&callback_status) == TPU_SYNC_OK, "callback ran once");
  bool done = false;
  uint64_t bytes_done = 0;
  CHECK(tpu_sync_copy_poll(copy, &done, &bytes_done) == TPU_SYNC_OK && done && bytes_done == (uint64_t)L * N, "poll");
  CHECK(tpu_sync_copy_wait(copy, 0, NULL) == TPU_SYNC_OK, "wait again after completion");
  CHECK(tpu_sync_copy_free(copy) == TPU_SYNC_OK, "free copy");
  CHECK(tpu_sync_copy_free(copy) == TPU_SYNC_INVALID_HANDLE, "double free copy");
  CHECK(tpu_sync_copy_wait(copy, 0, NULL) == TPU_SYNC_INVALID_HANDLE, "wait on freed copy");

  /* H2D in place: new bytes into every buffer, then read back. */
  fill(host, L * N, 10);
  for (int i = 0; i < L; i++) ops[i] = (tpu_sync_copy_op){bufs[i], 0, N, host + i * N};
  CHECK(tpu_sync_copy_submit(TPU_SYNC_H2D, ops, L, 2, &copy) == TPU_SYNC_OK, "h2d submit: %s", last_error());
  CHECK(tpu_sync_copy_wait(copy, -1, &st) == TPU_SYNC_OK && st.bytes == (uint64_t)L * N, "h2d wait: %s",
        last_error());
  tpu_sync_copy_free(copy);
  for (int i = 0; i < L; i++) {
    memset(src, 0, N);
    CHECK(tpu_sync_buffer_read(bufs[i], 0, src, N) == TPU_SYNC_OK && memcmp(src, host + i * N, N) == 0, "h2d %d", i);
  }

  /* Refused before anything is issued. */
  tpu_sync_copy_op bad = {bufs[0], N - 8, 16, host};
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, &bad, 1, 0, &copy) == TPU_SYNC_INVALID_ARGUMENT, "range past end");
  tpu_sync_copy_op overlap[2] = {{bufs[0], 0, 100, host}, {bufs[1], 0, 100, host + 50}};
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, overlap, 2, 0, &copy) == TPU_SYNC_INVALID_ARGUMENT, "overlap");
  CHECK(strstr(last_error(), "overlapping") != NULL, "message: %s", last_error());
  CHECK(tpu_sync_copy_submit(7, ops, 1, 0, &copy) == TPU_SYNC_INVALID_ARGUMENT, "bad direction");
  tpu_sync_copy_op nullbuf = {NULL, 0, 16, host};
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, &nullbuf, 1, 0, &copy) == TPU_SYNC_INVALID_HANDLE, "NULL buffer");
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, NULL, 3, 0, &copy) == TPU_SYNC_NULL_POINTER, "NULL ops");
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, ops, (size_t)1 << 40, 0, &copy) == TPU_SYNC_INVALID_ARGUMENT,
        "absurd count");

  /* While the pacer is paused nothing is issued: the wait times out (PENDING, not a failure),
   * and a cancel completes the batch with CANCELLED without writing anything. */
  CHECK(tpu_sync_pacing_pause(true) == TPU_SYNC_OK, "pause");
  for (int i = 0; i < L; i++) ops[i] = (tpu_sync_copy_op){bufs[i], 0, N, host + i * N};
  memset(host, 0, L * N);
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, ops, L, 1, &copy) == TPU_SYNC_OK, "submit to cancel");
  CHECK(tpu_sync_copy_wait(copy, 50, NULL) == TPU_SYNC_PENDING, "pending while paused");
  CHECK(tpu_sync_copy_poll(copy, &done, &bytes_done) == TPU_SYNC_OK && !done && bytes_done == 0, "not done");
  atomic_store(&callback_calls, 0);
  CHECK(tpu_sync_copy_set_callback(copy, on_done, &one) == TPU_SYNC_OK, "callback before cancel");
  CHECK(tpu_sync_copy_cancel(copy) == TPU_SYNC_OK, "cancel");
  CHECK(tpu_sync_copy_wait(copy, 10000, NULL) == TPU_SYNC_CANCELLED, "cancelled: %s", last_error());
  for (int t = 0; t < 500 && atomic_load(&callback_calls) == 0; t++) sleep_ms(10);
  CHECK(atomic_load(&callback_status) == TPU_SYNC_CANCELLED, "callback saw CANCELLED");
  int untouched = 1;
  for (size_t i = 0; i < (size_t)L * N; i++) untouched &= host[i] == 0;
  CHECK(untouched, "a cancelled batch wrote nothing");
  CHECK(tpu_sync_copy_free(copy) == TPU_SYNC_OK, "free cancelled");
  /* Freeing a queued batch cancels it and returns once nothing is in flight. */
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, ops, L, 1, &copy) == TPU_SYNC_OK, "submit to free");
  CHECK(tpu_sync_copy_free(copy) == TPU_SYNC_OK, "free while queued");
  CHECK(tpu_sync_pacing_pause(false) == TPU_SYNC_OK, "resume");
  /* Running again after the resume. */
  CHECK(tpu_sync_copy_submit(TPU_SYNC_D2H, ops, L, 0, &copy) == TPU_SYNC_OK, "submit after resume");
  CHECK(tpu_sync_copy_wait(copy, 10000, NULL) == TPU_SYNC_OK, "done after resume: %s", last_error());
  for (int i = 0; i < L; i++) {
    CHECK(tpu_sync_buffer_read(bufs[i], 0, src, N) == TPU_SYNC_OK && memcmp(host + i * N, src, N) == 0,
          "d2h after resume %d", i);
  }
  tpu_sync_copy_free(copy);
  tpu_sync_pacing_set(16 << 20, 64 << 20);

  for (int i = 0; i < L; i++) tpu_sync_buffer_free(bufs[i]);
  free(src);
  free(host);
}

int main(void) {
  tpu_sync_client *client = NULL;
  if (tpu_sync_client_new(NULL, 2, &client) != TPU_SYNC_OK) {
    fprintf(stderr, "client_new: %s\n", last_error());
    return 1;
  }
  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  test_adoption(client);
  test_view(client);
  test_copies(client);
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles: %llu vs %llu",
        (unsigned long long)live_handles(TPU_SYNC_HANDLE_ALL), (unsigned long long)before);
  CHECK(live_handles(TPU_SYNC_HANDLE_COPY) == 0 && live_handles(TPU_SYNC_HANDLE_RELEASE) == 0, "per-kind counts");
  uint64_t n = 0;
  CHECK(tpu_sync_handle_stats(1000, &n) == TPU_SYNC_INVALID_ARGUMENT, "unknown kind");
  tpu_sync_client_free(client);
  if (failures) {
    fprintf(stderr, "%d device checks FAILED\n", failures);
    return 1;
  }
  printf("C device tests: all checks passed\n");
  return 0;
}
