/* C tests of the transfer pipeline behind the endpoint: every kind of buffer/layout
 * disagreement is refused with TPU_SYNC_MISMATCH before anything is staged or sent, then a
 * correct pull on the same endpoints is byte-exact; a pull to the wrong address, then the right
 * one, is byte-exact; a reject frees the producer's staging at once (stats) and its state is
 * TPU_SYNC_SOURCE_REJECTED; a registration past the staging budget fails with
 * TPU_SYNC_STAGING_EXHAUSTED while earlier ones still pull byte-exact; a pull that reaches the
 * producer before its registration waits for it (tpu_sync_endpoint_pull_wait); the DMA map is
 * attempted and reported. Built and run by `make test-c`. */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check.h"

/* 2 layers, 2 KV heads of 8 bf16, K and V; TP=1, 16-token NHD blocks, 6 blocks per buffer. */
#define MODEL "{\"name\":\"toy\",\"num_layers\":2,\"num_kv_heads\":2,\"head_dim\":8,\"kv_planes\":2,\"dtype\":\"bf16\"}"
#define LAYOUT \
  "{\"model\":" MODEL ",\"spec\":{\"tp\":1,\"pcp\":1,\"dp\":1,\"block_size\":16,\"order\":\"nhd\"},\"num_blocks\":6}"
static const char *SRC = "{\"layout\":" LAYOUT ",\"dp_rank\":0,\"block_ids\":[[4,1,5]]}";
static const char *DST = "{\"layout\":" LAYOUT ",\"dp_rank\":0,\"block_ids\":[[2,0,3]]}";
enum { LAYERS = 2, TOKENS = 40, BYTES = 2 * 6 * 16 * 2 * 8 * 2, REQUEST = TOKENS * 2 * 2 * 8 * 2 * LAYERS };

static tpu_sync_client *client;
static uint8_t src_host[LAYERS][BYTES];

/* A number in compact JSON: the first `"key":N`. */
static uint64_t json_u64(const char *json, const char *key) {
  char pat[96];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(json, pat);
  return p ? strtoull(p + strlen(pat), NULL, 10) : UINT64_MAX;
}

static const char *stats(tpu_sync_endpoint *ep) {
  static char buf[8192];
  size_t n = 0;
  if (tpu_sync_endpoint_stats(ep, buf, sizeof buf, &n) != TPU_SYNC_OK) return "";
  return buf;
}

/* Budget bytes held by live operations: the budget's use less the pool's idle staging arenas. */
static uint64_t in_use(tpu_sync_endpoint *ep) {
  const char *s = stats(ep);
  return json_u64(s, "used_bytes") - json_u64(s, "idle_bytes");
}

/* LAYERS buffers of `dims`/`dtype`, filled with seeded data (`seed` 0: zeros). */
static void make(tpu_sync_buffer **out, const int64_t *dims, size_t ndims, uint32_t dtype, size_t bytes,
                 uint32_t seed) {
  uint8_t *data = calloc(1, bytes);
  for (int l = 0; l < LAYERS; l++) {
    if (seed) fill(data, bytes, seed + (uint32_t)l);
    out[l] = NULL;
    tpu_sync_buffer_from_host(client, 0, data, bytes, dims, ndims, dtype, &out[l]);
  }
  free(data);
}

static const int64_t DIMS[5] = {2, 6, 16, 2, 8};

/* The producer's buffers, of the layout exactly; their contents are kept in src_host. */
static void good(tpu_sync_buffer **out, uint32_t seed) {
  for (int l = 0; l < LAYERS; l++) fill(src_host[l], BYTES, seed + (uint32_t)l);
  make(out, DIMS, 5, TPU_SYNC_DTYPE_BF16, BYTES, seed);
}

/* Whether `dst` still holds `init` exactly. */
static int unchanged(tpu_sync_buffer **dst, uint8_t init[LAYERS][BYTES]) {
  static uint8_t got[BYTES];
  for (int l = 0; l < LAYERS; l++)
    if (tpu_sync_buffer_read(dst[l], 0, got, BYTES) != TPU_SYNC_OK || memcmp(got, init[l], BYTES) != 0) return 0;
  return 1;
}

/* Number of bytes of `dst` (after a pull of SRC's `src_host` contents) that differ from what the
 * plan says: spans hold their source bytes, the rest its initial contents `init`. */
static long wrong_bytes(tpu_sync_buffer **dst, uint8_t init[LAYERS][BYTES]) {
  static uint8_t want[LAYERS][BYTES], got[LAYERS][BYTES];
  memcpy(want, init, sizeof want);
  tpu_sync_plan *plan = NULL;
  if (tpu_sync_plan_new(SRC, DST, TOKENS, &plan) != TPU_SYNC_OK) return -1;
  size_t nspans = 0, n = 0;
  tpu_sync_plan_summary(plan, NULL, &nspans);
  tpu_sync_span *spans = calloc(nspans, sizeof *spans);
  tpu_sync_plan_spans(plan, 0, spans, nspans, &n);
  for (size_t i = 0; i < n; i++)
    for (uint32_t c = 0; c < spans[i].count; c++)
      memcpy(&want[spans[i].dst_buffer][spans[i].dst_offset + c * spans[i].dst_stride],
             &src_host[spans[i].src_buffer][spans[i].src_offset + c * spans[i].src_stride], spans[i].len);
  free(spans);
  tpu_sync_plan_free(plan);
  long bad = 0;
  for (int l = 0; l < LAYERS; l++) {
    if (tpu_sync_buffer_read(dst[l], 0, got[l], BYTES) != TPU_SYNC_OK) return -1;
    for (size_t i = 0; i < BYTES; i++) bad += got[l][i] != want[l][i];
  }
  return bad;
}

static void free_all(tpu_sync_buffer **b, int n) {
  for (int i = 0; i < n; i++) tpu_sync_buffer_free(b[i]);
}

static const uint32_t RANK0[1] = {0};

static tpu_sync_status pull(tpu_sync_endpoint *ep, uint64_t id, const char *at, tpu_sync_buffer **dst, int64_t wait_ms,
                            tpu_sync_transfer_stats *st) {
  tpu_sync_transfer *t = NULL;
  tpu_sync_status s = tpu_sync_endpoint_pull_wait(ep, id, at, SRC, DST, TOKENS, RANK0, 1,
                                                  (const tpu_sync_buffer *const *)dst, LAYERS, wait_ms, &t);
  if (s != TPU_SYNC_OK) return s;
  s = tpu_sync_transfer_wait(t, 30000, st);
  tpu_sync_transfer_free(t);
  return s;
}

static uint32_t state_of(tpu_sync_endpoint *ep, uint64_t id) {
  uint32_t s = 99;
  tpu_sync_endpoint_source_state(ep, id, &s);
  return s;
}

int main(void) {
  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  CHECK(tpu_sync_client_new(NULL, 1, &client) == TPU_SYNC_OK, "client: %s", last_error());
  tpu_sync_endpoint *prod = NULL, *cons = NULL, *other = NULL;
  CHECK(tpu_sync_endpoint_new("{\"listen\":\"127.0.0.1:0\",\"timeout_s\":5,\"staging_budget_bytes\":1073741824}",
                              &prod) == TPU_SYNC_OK,
        "producer: %s", last_error());
  CHECK(tpu_sync_endpoint_new("{\"timeout_s\":5}", &cons) == TPU_SYNC_OK, "consumer");
  CHECK(tpu_sync_endpoint_new("{\"listen\":\"127.0.0.1:0\",\"timeout_s\":5}", &other) == TPU_SYNC_OK, "other");
  CHECK(tpu_sync_endpoint_new("{\"staging_budgett_bytes\":1}", &cons) == TPU_SYNC_INVALID_ARGUMENT, "unknown key");
  char addr[64], other_addr[64];
  tpu_sync_endpoint_address(prod, addr, sizeof addr, NULL);
  tpu_sync_endpoint_address(other, other_addr, sizeof other_addr, NULL);

  tpu_sync_buffer *src[LAYERS], *dst[LAYERS];
  good(src, 10);
  CHECK(tpu_sync_endpoint_register(prod, 7, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, LAYERS, 1) ==
            TPU_SYNC_OK,
        "register: %s", last_error());
  uint64_t staged = json_u64(stats(prod), "used_bytes");
  CHECK(staged >= 2 * 3 * 2 * 16 * 2 * 8 * 2 && staged != UINT64_MAX, "staged %llu", (unsigned long long)staged);

  /* Every kind of disagreement, on both sides, refused before anything moves. */
  struct {
    const char *name;
    int64_t dims[5];
    size_t ndims;
    uint32_t dtype;
    size_t bytes;
  } bad[] = {
      {"more blocks", {2, 8, 16, 2, 8}, 5, TPU_SYNC_DTYPE_BF16, 2 * 8 * 16 * 2 * 8 * 2},
      {"padded block stride", {2, 6, 16, 2, 12}, 5, TPU_SYNC_DTYPE_BF16, 2 * 6 * 16 * 2 * 12 * 2},
      {"f16 under bf16", {2, 6, 16, 2, 8}, 5, TPU_SYNC_DTYPE_F16, BYTES},
      {"f32 of the same size", {2, 6, 16, 2, 4}, 5, TPU_SYNC_DTYPE_F32, BYTES},
      {"fewer blocks", {2, 4, 16, 2, 8}, 5, TPU_SYNC_DTYPE_BF16, 2 * 4 * 16 * 2 * 8 * 2},
      {"flat u8", {BYTES, 0, 0, 0, 0}, 1, TPU_SYNC_DTYPE_U8, BYTES},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    tpu_sync_buffer *b[LAYERS];
    make(b, bad[k].dims, bad[k].ndims, bad[k].dtype, bad[k].bytes, 0);
    tpu_sync_transfer *t = NULL;
    CHECK(tpu_sync_endpoint_register(prod, 8, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)b, LAYERS, 1) ==
              TPU_SYNC_MISMATCH,
          "%s: register: %s", bad[k].name, last_error());
    CHECK(strstr(last_error(), "rank 0 layer 0") != NULL, "%s names rank and layer: %s", bad[k].name, last_error());
    CHECK(tpu_sync_endpoint_pull(cons, 7, addr, SRC, DST, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)b, LAYERS,
                                 &t) == TPU_SYNC_MISMATCH,
          "%s: pull: %s", bad[k].name, last_error());
    CHECK(tpu_sync_endpoint_expect_push(cons, 7, SRC, DST, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)b, LAYERS,
                                        &t) == TPU_SYNC_MISMATCH,
          "%s: expect_push: %s", bad[k].name, last_error());
    CHECK(tpu_sync_endpoint_push(prod, 9, addr, SRC, DST, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)b, LAYERS,
                                 &t) == TPU_SYNC_MISMATCH,
          "%s: push: %s", bad[k].name, last_error());
    CHECK(state_of(prod, 8) == TPU_SYNC_SOURCE_UNKNOWN, "%s: nothing registered", bad[k].name);
    free_all(b, LAYERS);
  }
  /* One layer missing. */
  CHECK(tpu_sync_endpoint_register(prod, 8, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, 1, 1) ==
            TPU_SYNC_MISMATCH,
        "one layer: %s", last_error());
  CHECK(json_u64(stats(prod), "used_bytes") == staged, "nothing staged for the refused ones");
  CHECK(json_u64(stats(cons), "bytes_received") == 0, "nothing received");

  /* Pulls to the wrong addresses fail and leave the registration; the right one is exact. */
  static uint8_t init[LAYERS][BYTES];
  for (int l = 0; l < LAYERS; l++) fill(init[l], BYTES, 50 + (uint32_t)l);
  make(dst, DIMS, 5, TPU_SYNC_DTYPE_BF16, BYTES, 50);
  tpu_sync_transfer_stats st;
  tpu_sync_status s = pull(cons, 7, "127.0.0.1:1", dst, 0, &st);
  CHECK(s != TPU_SYNC_OK && s != TPU_SYNC_PENDING, "nothing listening: %s", tpu_sync_status_name(s));
  s = pull(cons, 7, other_addr, dst, 0, &st);
  CHECK(s == TPU_SYNC_UNKNOWN_REQUEST, "an endpoint without it: %s (%s)", tpu_sync_status_name(s), last_error());
  CHECK(state_of(prod, 7) == TPU_SYNC_SOURCE_ACTIVE, "the failed pulls left it registered");
  CHECK(unchanged(dst, init), "nothing written by the failed pulls");
  CHECK(pull(cons, 7, addr, dst, 0, &st) == TPU_SYNC_OK && st.bytes == REQUEST && st.device_bytes == REQUEST,
        "right address: %s", last_error());
  CHECK(wrong_bytes(dst, init) == 0, "byte-exact");
  for (int i = 0; i < 500 && state_of(prod, 7) != TPU_SYNC_SOURCE_RELEASED; i++) sleep_ms(2);
  CHECK(state_of(prod, 7) == TPU_SYNC_SOURCE_RELEASED, "released");

  /* Reject: the staging is freed at once, the state says rejected. */
  for (int i = 0; i < 500 && in_use(prod) != 0; i++) sleep_ms(2);
  CHECK(tpu_sync_endpoint_register(prod, 10, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, LAYERS,
                                   1) == TPU_SYNC_OK,
        "register 10");
  CHECK(json_u64(stats(prod), "staged_bytes") > 0, "staged");
  CHECK(tpu_sync_endpoint_reject(cons, 10, addr, "decode aborted it") == TPU_SYNC_OK, "reject: %s", last_error());
  CHECK(state_of(prod, 10) == TPU_SYNC_SOURCE_REJECTED, "rejected: %u", state_of(prod, 10));
  CHECK(json_u64(stats(prod), "staged_bytes") == 0, "the endpoint no longer stages it");
  double t0 = now();
  while (in_use(prod) != 0 && now() - t0 < 0.1) sleep_ms(1);
  CHECK(in_use(prod) == 0, "staging freed within 100 ms");
  CHECK(tpu_sync_endpoint_reject(cons, 10, "", NULL) == TPU_SYNC_INVALID_ARGUMENT, "empty peers");
  CHECK(tpu_sync_endpoint_reject(cons, 0, addr, NULL) == TPU_SYNC_INVALID_ARGUMENT, "id 0");

  /* Refuse: a registered request ends and its staging is freed; a pull waiting up to 60 s for a
     refused one fails at once with the producer's reason, the destination untouched. */
  CHECK(tpu_sync_endpoint_register(prod, 81, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, LAYERS,
                                   1) == TPU_SYNC_OK,
        "register 81");
  bool existed = false;
  CHECK(tpu_sync_endpoint_refuse(prod, 81, "staging failed", &existed) == TPU_SYNC_OK && existed, "refuse 81: %s",
        last_error());
  CHECK(state_of(prod, 81) == TPU_SYNC_SOURCE_UNREGISTERED, "refused: %u", state_of(prod, 81));
  CHECK(tpu_sync_endpoint_refuse(prod, 82, NULL, &existed) == TPU_SYNC_OK && !existed, "refuse 82");
  {
    static uint8_t untouched[LAYERS][BYTES];
    tpu_sync_buffer *d[LAYERS];
    for (int l = 0; l < LAYERS; l++) fill(untouched[l], BYTES, 70 + (uint32_t)l);
    make(d, DIMS, 5, TPU_SYNC_DTYPE_BF16, BYTES, 70);
    s = pull(cons, 81, addr, d, 60000, &st); /* (TPU_SYNC_TIMEOUT after 30 s if it waited) */
    CHECK(s == TPU_SYNC_CANCELLED && strstr(last_error(), "refused by its producer: staging failed") != NULL,
          "a refused request's pull: %s (%s)", tpu_sync_status_name(s), last_error());
    s = pull(cons, 82, addr, d, 60000, &st);
    CHECK(s == TPU_SYNC_CANCELLED && strstr(last_error(), "refused by its producer: no reason given") != NULL,
          "refused before it was registered: %s (%s)", tpu_sync_status_name(s), last_error());
    CHECK(json_u64(stats(prod), "refusals") == 2, "refusals counted: %s", stats(prod));
    CHECK(unchanged(d, untouched), "nothing written by the refused pulls");
    free_all(d, LAYERS);
  }
  CHECK(tpu_sync_endpoint_refuse(prod, 0, "x", NULL) == TPU_SYNC_INVALID_ARGUMENT, "id 0");
  s = tpu_sync_endpoint_refuse(NULL, 83, "x", NULL);
  CHECK(s != TPU_SYNC_OK, "no endpoint: %s", tpu_sync_status_name(s));

  /* The staging budget: room for two registrations; the third is refused, the first two pull. */
  tpu_sync_endpoint *small = NULL;
  char cfg[160];
  snprintf(cfg, sizeof cfg, "{\"listen\":\"127.0.0.1:0\",\"staging_budget_bytes\":%llu}",
           (unsigned long long)(2 * staged));
  CHECK(tpu_sync_endpoint_new(cfg, &small) == TPU_SYNC_OK, "small budget");
  char small_addr[64];
  tpu_sync_endpoint_address(small, small_addr, sizeof small_addr, NULL);
  for (uint64_t id = 1; id <= 3; id++) {
    s = tpu_sync_endpoint_register(small, id, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, LAYERS, 1);
    CHECK(s == (id < 3 ? TPU_SYNC_OK : TPU_SYNC_STAGING_EXHAUSTED), "register %llu: %s (%s)", (unsigned long long)id,
          tpu_sync_status_name(s), last_error());
  }
  CHECK(state_of(small, 3) == TPU_SYNC_SOURCE_UNKNOWN, "3 not registered");
  CHECK(json_u64(stats(small), "refused") == 1, "refused counted: %s", stats(small));
  for (uint64_t id = 1; id <= 2; id++) {
    tpu_sync_buffer *d[LAYERS];
    make(d, DIMS, 5, TPU_SYNC_DTYPE_BF16, BYTES, 50);
    CHECK(pull(cons, id, small_addr, d, 0, &st) == TPU_SYNC_OK, "pull %llu: %s", (unsigned long long)id, last_error());
    CHECK(wrong_bytes(d, init) == 0, "pull %llu byte-exact", (unsigned long long)id);
    free_all(d, LAYERS);
  }

  /* A pull before the registration waits for it. */
  tpu_sync_transfer *t = NULL;
  free_all(dst, LAYERS);
  make(dst, DIMS, 5, TPU_SYNC_DTYPE_BF16, BYTES, 50);
  CHECK(tpu_sync_endpoint_pull_wait(cons, 11, addr, SRC, DST, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)dst,
                                    LAYERS, 30000, &t) == TPU_SYNC_OK,
        "early pull");
  sleep_ms(50);
  CHECK(tpu_sync_transfer_wait(t, 0, NULL) == TPU_SYNC_PENDING, "waiting for the registration");
  CHECK(tpu_sync_endpoint_register(prod, 11, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, LAYERS,
                                   1) == TPU_SYNC_OK,
        "register 11");
  CHECK(tpu_sync_transfer_wait(t, 30000, &st) == TPU_SYNC_OK, "the early pull succeeds: %s", last_error());
  CHECK(wrong_bytes(dst, init) == 0, "early pull byte-exact");
  /* The DMA map was attempted (the CPU plugin answers UNIMPLEMENTED) and is reported. */
  char rep[1024];
  CHECK(tpu_sync_transfer_report(t, rep, sizeof rep, NULL) == TPU_SYNC_OK && strstr(rep, "\"dma_map\":\"skipped"),
        "report: %s", rep);
  CHECK(json_u64(stats(cons), "dma_skipped") >= 1 && strstr(stats(cons), "UNIMPLEMENTED"), "stats: %s", stats(cons));
  tpu_sync_transfer_free(t);

  /* A negative wait is the endpoint's own wait_for_registration_s: it waits too. */
  tpu_sync_endpoint *patient = NULL;
  CHECK(tpu_sync_endpoint_new("{\"timeout_s\":5,\"wait_for_registration_s\":30}", &patient) == TPU_SYNC_OK,
        "patient consumer: %s", last_error());
  free_all(dst, LAYERS);
  make(dst, DIMS, 5, TPU_SYNC_DTYPE_BF16, BYTES, 50);
  t = NULL;
  CHECK(tpu_sync_endpoint_pull_wait(patient, 12, addr, SRC, DST, TOKENS, RANK0, 1,
                                    (const tpu_sync_buffer *const *)dst, LAYERS, -1, &t) == TPU_SYNC_OK,
        "early pull, endpoint's wait");
  sleep_ms(50);
  CHECK(tpu_sync_transfer_wait(t, 0, NULL) == TPU_SYNC_PENDING, "waiting for registration 12");
  CHECK(tpu_sync_endpoint_register(prod, 12, SRC, TOKENS, RANK0, 1, (const tpu_sync_buffer *const *)src, LAYERS,
                                   1) == TPU_SYNC_OK,
        "register 12");
  CHECK(tpu_sync_transfer_wait(t, 30000, NULL) == TPU_SYNC_OK, "the early pull succeeds: %s", last_error());
  CHECK(wrong_bytes(dst, init) == 0, "early pull (endpoint's wait) byte-exact");
  tpu_sync_transfer_free(t);
  tpu_sync_endpoint_free(patient);

  free_all(src, LAYERS);
  free_all(dst, LAYERS);
  tpu_sync_endpoint_free(small);
  tpu_sync_endpoint_free(other);
  tpu_sync_endpoint_free(cons);
  tpu_sync_endpoint_free(prod);
  tpu_sync_client_free(client);
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles");
  if (failures) {
    fprintf(stderr, "%d pipeline checks FAILED\n", failures);
    return 1;
  }
  printf("C pipeline tests: all checks passed\n");
  return 0;
}
