/* C tests of the host KV store over the ABI: configuration errors, keys, put/lookup/get round
 * trips from host and device memory, leases, removal, bad sizes and freed handles, segments.
 * Built and run by `make test-c` with: cc -std=c11 -Wall -Wextra -Werror -pedantic. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

enum { BLOCK = 4096, BLOCKS = 8, TOKENS_PER_BLOCK = 16 };

static void test_config_errors(void) {
  tpu_sync_store *s = NULL;
  CHECK(tpu_sync_store_new("{not json", NULL, &s) == TPU_SYNC_INVALID_ARGUMENT, "bad JSON");
  CHECK(tpu_sync_store_new("{\"namespace\":\"x\",\"block_bytes\":4096,\"capacity_bytes\":65536,\"colour\":1}", NULL,
                           &s) == TPU_SYNC_INVALID_ARGUMENT,
        "unknown key");
  CHECK(strstr(last_error(), "colour") != NULL, "names the key: %s", last_error());
  CHECK(tpu_sync_store_new("{\"namespace\":\"x\",\"block_bytes\":0,\"capacity_bytes\":65536}", NULL, &s) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "zero block size");
  CHECK(tpu_sync_store_new("{\"namespace\":\"x\",\"block_bytes\":4096,\"capacity_bytes\":65536,\"shm_name\":\"../x\"}",
                           NULL, &s) == TPU_SYNC_INVALID_ARGUMENT,
        "bad segment name");
  CHECK(tpu_sync_store_new("{\"namespace\":\"x\",\"block_bytes\":4096,\"capacity_bytes\":65536,\"disk_dir\":\"/tmp\"}",
                           NULL, &s) == TPU_SYNC_INVALID_ARGUMENT,
        "disk dir without capacity");
  CHECK(tpu_sync_store_new(NULL, NULL, &s) == TPU_SYNC_NULL_POINTER, "NULL config");
  CHECK(tpu_sync_store_new("{\"namespace\":\"x\",\"block_bytes\":4096,\"capacity_bytes\":65536}",
                           (const tpu_sync_client *)(uintptr_t)0x40, &s) == TPU_SYNC_INVALID_HANDLE,
        "forged client handle");
}

static void test_host_round_trip(void) {
  tpu_sync_store *s = NULL;
  const char *cfg =
      "{\"namespace\":\"c-test bf16 tp=1 block=16\",\"block_bytes\":4096,\"capacity_bytes\":65536,"
      "\"lock_memory\":false,\"populate\":false}";
  CHECK(tpu_sync_store_new(cfg, NULL, &s) == TPU_SYNC_OK, "store: %s", last_error());
  uint32_t state = 99;
  CHECK(tpu_sync_store_state(s, &state) == TPU_SYNC_OK && state == TPU_SYNC_STORE_READY, "ready");
  CHECK(tpu_sync_store_wait_ready(s, 0) == TPU_SYNC_OK, "wait_ready");

  uint32_t tokens[BLOCKS * TOKENS_PER_BLOCK + 5];
  for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++) tokens[i] = (uint32_t)(1000 + i * 7);
  tpu_sync_key keys[BLOCKS];
  size_t n = 0;
  CHECK(tpu_sync_store_chain_keys(s, tokens, sizeof tokens / 4, TOKENS_PER_BLOCK, NULL, keys, 2, &n) ==
                TPU_SYNC_BUFFER_TOO_SMALL &&
            n == BLOCKS,
        "too small: needs %zu", n);
  CHECK(tpu_sync_store_chain_keys(s, tokens, sizeof tokens / 4, TOKENS_PER_BLOCK, NULL, keys, BLOCKS, &n) ==
                TPU_SYNC_OK &&
            n == BLOCKS,
        "keys");
  CHECK(tpu_sync_store_chain_keys(s, tokens, 10, 0, NULL, keys, BLOCKS, &n) == TPU_SYNC_INVALID_ARGUMENT,
        "block_tokens 0");
  /* Chaining: keys of the tail computed on the parent equal the full chain's. */
  tpu_sync_key tail[BLOCKS];
  CHECK(tpu_sync_store_chain_keys(s, tokens + 3 * TOKENS_PER_BLOCK, 5 * TOKENS_PER_BLOCK, TOKENS_PER_BLOCK, &keys[2],
                                  tail, BLOCKS, &n) == TPU_SYNC_OK &&
            n == 5 && memcmp(tail, keys + 3, 5 * sizeof(tpu_sync_key)) == 0,
        "parent chaining");
  tpu_sync_key ek1, ek2;
  CHECK(tpu_sync_store_engine_key(s, "abc", 3, &ek1) == TPU_SYNC_OK &&
            tpu_sync_store_engine_key(s, "abd", 3, &ek2) == TPU_SYNC_OK && memcmp(&ek1, &ek2, 16) != 0,
        "engine keys differ");

  uint8_t *data = malloc(BLOCKS * BLOCK), *back = malloc(BLOCKS * BLOCK);
  fill(data, BLOCKS * BLOCK, 21);
  const void *srcs[BLOCKS];
  void *dsts[BLOCKS];
  size_t lens[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) {
    srcs[i] = data + i * BLOCK;
    dsts[i] = back + i * BLOCK;
    lens[i] = BLOCK - (size_t)i; /* blocks of different sizes */
  }
  tpu_sync_put_result pr;
  CHECK(tpu_sync_store_put(s, NULL, keys, 5, srcs, lens, &pr) == TPU_SYNC_OK, "put: %s", last_error());
  CHECK(pr.stored == 5 && pr.present == 0 && pr.full_at == SIZE_MAX && !pr.not_ready, "put result %zu %zu %zu",
        pr.stored, pr.present, pr.full_at);
  CHECK(tpu_sync_store_put(s, &keys[4], keys + 5, 3, srcs + 5, lens + 5, &pr) == TPU_SYNC_OK && pr.stored == 3,
        "put the rest with a parent");
  CHECK(tpu_sync_store_put(s, NULL, keys, 2, srcs, lens, &pr) == TPU_SYNC_OK && pr.stored == 0 && pr.present == 2,
        "put again: present");
  size_t hits = 0, in_dram = 0, disk_only = 9;
  CHECK(tpu_sync_store_lookup(s, keys, BLOCKS, &hits, &in_dram, &disk_only) == TPU_SYNC_OK && hits == BLOCKS &&
            in_dram == BLOCKS && disk_only == 0,
        "lookup %zu", hits);

  memset(back, 0, BLOCKS * BLOCK);
  tpu_sync_get_result gr;
  CHECK(tpu_sync_store_get(s, keys, BLOCKS, dsts, lens, &gr) == TPU_SYNC_OK, "get: %s", last_error());
  CHECK(gr.delivered == BLOCKS && gr.from_dram == BLOCKS && gr.stop == TPU_SYNC_GET_COMPLETE, "get result");
  for (int i = 0; i < BLOCKS; i++) CHECK(memcmp(back + i * BLOCK, data + i * BLOCK, lens[i]) == 0, "block %d", i);

  /* Bad sizes and pointers are errors, not crashes. */
  size_t wrong[BLOCKS];
  memcpy(wrong, lens, sizeof wrong);
  wrong[1] += 1;
  CHECK(tpu_sync_store_get(s, keys, 2, dsts, wrong, &gr) == TPU_SYNC_INVALID_ARGUMENT, "dst length mismatch");
  size_t big[1] = {BLOCK + 1};
  CHECK(tpu_sync_store_put(s, NULL, &ek1, 1, srcs, big, &pr) == TPU_SYNC_INVALID_ARGUMENT, "block too large");
  size_t zero[1] = {0};
  CHECK(tpu_sync_store_put(s, NULL, &ek1, 1, srcs, zero, &pr) == TPU_SYNC_INVALID_ARGUMENT, "empty block");
  const void *nullsrc[1] = {NULL};
  CHECK(tpu_sync_store_put(s, NULL, &ek1, 1, nullsrc, lens, &pr) == TPU_SYNC_NULL_POINTER, "NULL block");
  CHECK(tpu_sync_store_lookup(s, NULL, 3, &hits, NULL, NULL) == TPU_SYNC_NULL_POINTER, "NULL keys");
  CHECK(tpu_sync_store_lookup(s, keys, (size_t)1 << 40, &hits, NULL, NULL) == TPU_SYNC_INVALID_ARGUMENT,
        "absurd count");

  /* A missing block in the middle: get delivers the prefix and says why it stopped. */
  tpu_sync_key gap[3] = {keys[0], keys[1], ek2};
  CHECK(tpu_sync_store_get(s, gap, 3, dsts, lens, &gr) == TPU_SYNC_OK && gr.delivered == 2 &&
            gr.stop == TPU_SYNC_GET_MISSING,
        "stopped at the gap: %zu %u", gr.delivered, gr.stop);

  /* Leases pin the present prefix; clear keeps pinned blocks and their prefixes. */
  tpu_sync_lease *lease = NULL;
  CHECK(tpu_sync_store_pin(s, gap, 3, &lease) == TPU_SYNC_OK, "pin");
  size_t count = 0;
  CHECK(tpu_sync_lease_count(lease, &count) == TPU_SYNC_OK && count == 2, "lease pins 2: %zu", count);
  size_t removed = 0;
  CHECK(tpu_sync_store_clear(s, &removed) == TPU_SYNC_OK && removed == BLOCKS - 2, "clear removed %zu", removed);
  CHECK(tpu_sync_store_lookup(s, keys, BLOCKS, &hits, NULL, NULL) == TPU_SYNC_OK && hits == 2, "pinned survive");
  CHECK(tpu_sync_lease_free(lease) == TPU_SYNC_OK, "unpin");
  CHECK(tpu_sync_lease_free(lease) == TPU_SYNC_INVALID_HANDLE, "double unpin");
  CHECK(tpu_sync_store_remove(s, keys, 1, &removed) == TPU_SYNC_OK && removed == 2, "remove chain: %zu", removed);
  CHECK(tpu_sync_store_flush_to_disk(s, NULL) == TPU_SYNC_INVALID_ARGUMENT, "flush without disk tier");

  char stats[2048];
  CHECK(tpu_sync_store_stats(s, stats, sizeof stats, NULL) == TPU_SYNC_OK && strstr(stats, "\"put_blocks\":8"),
        "stats: %s", stats);
  char info[2048];
  CHECK(tpu_sync_store_info(s, info, sizeof info, NULL) == TPU_SYNC_OK && strstr(info, "\"attach\":\"anonymous\""),
        "info: %s", info);

  CHECK(tpu_sync_store_free(s) == TPU_SYNC_OK, "free store");
  CHECK(tpu_sync_store_lookup(s, keys, 1, &hits, NULL, NULL) == TPU_SYNC_INVALID_HANDLE, "use after free");
  CHECK(tpu_sync_store_free(s) == TPU_SYNC_INVALID_HANDLE, "double free");
  free(data);
  free(back);
}

static void test_device_round_trip(void) {
  tpu_sync_client *client = NULL;
  CHECK(tpu_sync_client_new(NULL, 1, &client) == TPU_SYNC_OK, "client");
  /* One layer: 8 blocks of K and 8 of V, 1 KiB each ([2, 8, 1024] u8). */
  enum { PLANE = 8 * 1024 };
  uint8_t *kv = malloc(2 * PLANE), *back = malloc(2 * PLANE);
  fill(kv, 2 * PLANE, 33);
  int64_t dims[3] = {2, 8, 1024};
  tpu_sync_buffer *src = NULL, *dst = NULL;
  CHECK(tpu_sync_buffer_from_host(client, 0, kv, 2 * PLANE, dims, 3, TPU_SYNC_DTYPE_U8, &src) == TPU_SYNC_OK, "src");
  memset(back, 0, 2 * PLANE);
  CHECK(tpu_sync_buffer_from_host(client, 0, back, 2 * PLANE, dims, 3, TPU_SYNC_DTYPE_U8, &dst) == TPU_SYNC_OK, "dst");
  tpu_sync_store *s = NULL;
  CHECK(tpu_sync_store_new("{\"namespace\":\"dev\",\"block_bytes\":2048,\"capacity_bytes\":65536,"
                           "\"lock_memory\":false,\"populate\":false}",
                           client, &s) == TPU_SYNC_OK,
        "store: %s", last_error());
  /* Store blocks 1, 4, 6 (K and V of each = 2 pieces) under 3 chained keys. */
  uint32_t tok[3 * 16];
  for (int i = 0; i < 48; i++) tok[i] = (uint32_t)(i * 31 + 5);
  tpu_sync_key keys[3];
  size_t n = 0;
  tpu_sync_store_chain_keys(s, tok, 48, 16, NULL, keys, 3, &n);
  int blocks[3] = {1, 4, 6}, into[3] = {7, 0, 3};
  tpu_sync_device_range pieces[6];
  size_t per[3] = {2, 2, 2};
  for (int i = 0; i < 3; i++)
    for (int p = 0; p < 2; p++)
      pieces[2 * i + p] = (tpu_sync_device_range){src, (uint64_t)(p * PLANE + blocks[i] * 1024), 1024};
  tpu_sync_put_result pr;
  CHECK(tpu_sync_store_put_from_device(s, NULL, keys, 3, pieces, 6, per, &pr) == TPU_SYNC_OK && pr.stored == 3,
        "put_from_device: %s", last_error());
  /* Load them into other blocks of another buffer. */
  for (int i = 0; i < 3; i++)
    for (int p = 0; p < 2; p++)
      pieces[2 * i + p] = (tpu_sync_device_range){dst, (uint64_t)(p * PLANE + into[i] * 1024), 1024};
  tpu_sync_get_result gr;
  CHECK(tpu_sync_store_get_to_device(s, keys, 3, pieces, 6, per, &gr) == TPU_SYNC_OK && gr.delivered == 3,
        "get_to_device: %s", last_error());
  CHECK(tpu_sync_buffer_read(dst, 0, back, 2 * PLANE) == TPU_SYNC_OK, "read dst");
  for (int i = 0; i < 3; i++)
    for (int p = 0; p < 2; p++)
      CHECK(memcmp(back + p * PLANE + into[i] * 1024, kv + p * PLANE + blocks[i] * 1024, 1024) == 0, "block %d/%d",
            i, p);
  /* Blocks not written stay zero. */
  for (int b = 0; b < 8; b++)
    if (b != 7 && b != 0 && b != 3) CHECK(back[b * 1024] == 0 && back[PLANE + b * 1024 + 1023] == 0, "untouched %d", b);
  /* Piece counts that do not add up, and ranges outside the buffer. */
  size_t badper[3] = {2, 2, 1};
  CHECK(tpu_sync_store_get_to_device(s, keys, 3, pieces, 6, badper, &gr) == TPU_SYNC_INVALID_ARGUMENT, "bad counts");
  pieces[5].offset = 2 * PLANE;
  tpu_sync_key fresh;
  tpu_sync_store_engine_key(s, "fresh", 5, &fresh);
  size_t one[1] = {2};
  CHECK(tpu_sync_store_put_from_device(s, NULL, &fresh, 1, pieces + 4, 2, one, &pr) == TPU_SYNC_INVALID_ARGUMENT,
        "range past the end: %s", last_error());
  tpu_sync_store_free(s);
  tpu_sync_buffer_free(src);
  tpu_sync_buffer_free(dst);
  tpu_sync_client_free(client);
  free(kv);
  free(back);
}

static void test_segments(void) {
  char dir[] = "/tmp/tpu-sync-c-shm-XXXXXX";
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  char cfg[512];
  snprintf(cfg, sizeof cfg,
           "{\"namespace\":\"seg\",\"block_bytes\":4096,\"capacity_bytes\":65536,\"shm_name\":\"c-test\","
           "\"shm_dir\":\"%s\",\"lock_memory\":false}",
           dir);
  tpu_sync_store *s = NULL;
  CHECK(tpu_sync_store_new(cfg, NULL, &s) == TPU_SYNC_OK, "named store: %s", last_error());
  char list[4096];
  CHECK(tpu_sync_shm_list(dir, list, sizeof list, NULL) == TPU_SYNC_OK && strstr(list, "\"name\":\"c-test\"") &&
            strstr(list, "\"in_use\":true"),
        "list: %s", list);
  CHECK(tpu_sync_shm_remove(dir, "c-test", false) == TPU_SYNC_IO, "in use");
  tpu_sync_store_free(s);
  CHECK(tpu_sync_shm_remove(dir, "c-test", false) == TPU_SYNC_OK, "remove: %s", last_error());
  CHECK(tpu_sync_shm_remove(dir, "c-test", false) == TPU_SYNC_IO, "gone");
  CHECK(tpu_sync_shm_remove(dir, "../etc", false) == TPU_SYNC_INVALID_ARGUMENT, "bad name");
  CHECK(tpu_sync_shm_list("/nonexistent-dir", list, sizeof list, NULL) == TPU_SYNC_IO, "bad dir");
  rmdir(dir);
}

int main(void) {
  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  test_config_errors();
  test_host_round_trip();
  test_device_round_trip();
  test_segments();
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles: %llu vs %llu", (unsigned long long)live_handles(TPU_SYNC_HANDLE_ALL), (unsigned long long)before);
  if (failures) {
    fprintf(stderr, "%d store checks FAILED\n", failures);
    return 1;
  }
  printf("C store tests: all checks passed\n");
  return 0;
}
