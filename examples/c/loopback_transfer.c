/* Prefill -> decode KV transfer between two endpoints in one process, over TCP on loopback,
 * through libtpu_sync's C ABI: a TP=2 prefill (16-token blocks, NHD) serves a request that a
 * TP=1 decode (32-token blocks, HND) pulls and writes into its own device buffers, resharded in
 * transit; then the same request is pushed by the prefill instead. Every byte the plan moves is
 * compared with its source, and every other byte must be unchanged.
 *
 * Build (only the header and a C compiler), from the repository root:
 *   cc -std=c11 -I tpu-sync-ffi/include examples/c/loopback_transfer.c -L target/release \
 *      -ltpu_sync -Wl,-rpath,$PWD/target/release -o loopback_transfer
 * (the rpath must be absolute for the binary to find libtpu_sync.so from any directory).
 * Statically: replace `-L target/release -ltpu_sync -Wl,-rpath,...` with
 * `target/release/libtpu_sync.a -lpthread -ldl -lm -lgcc_s` (see docs/c-abi.md).
 * `make examples-c` builds and runs every example here. */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tpu_sync.h"

enum { LAYERS = 2, TOKENS = 100, SRC_RANKS = 2, SRC_BYTES = 8192, DST_BYTES = 24576 };

/* llama-like toy model: 4 KV heads of 8 bf16, K and V. Prefill TP=2 (2 heads per rank), 8 blocks
 * of 16 tokens; decode TP=1, 6 blocks of 32 tokens. Per layer and rank the buffers hold
 * 2 x 8 x 16 x 2 x 8 x 2 = 8192 bytes (prefill) and 2 x 6 x 4 x 32 x 8 x 2 = 24576 (decode). */
#define MODEL "{\"name\":\"toy\",\"num_layers\":2,\"num_kv_heads\":4,\"head_dim\":8,\"kv_planes\":2,\"dtype\":\"bf16\"}"
static const char *SRC =
    "{\"layout\":{\"model\":" MODEL ",\"spec\":{\"tp\":2,\"pcp\":1,\"dp\":1,\"block_size\":16,\"order\":\"nhd\"},"
    "\"num_blocks\":8},\"dp_rank\":0,\"block_ids\":[[7,2,5,0,3,6,1],[1,4,0,6,2,7,5]]}";
static const char *DST =
    "{\"layout\":{\"model\":" MODEL ",\"spec\":{\"tp\":1,\"pcp\":1,\"dp\":1,\"block_size\":32,\"order\":\"hnd\"},"
    "\"num_blocks\":6},\"dp_rank\":0,\"block_ids\":[[5,1,3,0]]}";

static int fail(const char *what, tpu_sync_status s) {
  char msg[1024];
  tpu_sync_last_error(msg, sizeof msg, NULL);
  fprintf(stderr, "%s failed: %s: %s\n", what, tpu_sync_status_name((uint32_t)s), msg);
  return 1;
}

#define TRY(call)                                    \
  do {                                               \
    tpu_sync_status st_ = (call);                    \
    if (st_ != TPU_SYNC_OK) return fail(#call, st_); \
  } while (0)

static uint8_t src_host[SRC_RANKS][LAYERS][SRC_BYTES];
static uint8_t dst_init[LAYERS][DST_BYTES], dst_back[LAYERS][DST_BYTES];

static void fill(uint8_t *p, size_t n, uint64_t seed) {
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = (uint8_t)(x | 1u);
  }
}

/* Checks the decode buffers against the plan: spans hold their source bytes, the rest is as it
 * was before. Returns the number of wrong bytes. */
static long verify(const tpu_sync_plan *plan, tpu_sync_buffer *const *dst, uint64_t *moved) {
  static uint8_t covered[LAYERS][DST_BYTES];
  memset(covered, 0, sizeof covered);
  for (int l = 0; l < LAYERS; l++)
    if (tpu_sync_buffer_read(dst[l], 0, dst_back[l], DST_BYTES) != TPU_SYNC_OK) return -1;
  size_t nspans = 0;
  tpu_sync_plan_summary(plan, NULL, &nspans);
  tpu_sync_span *spans = calloc(nspans, sizeof *spans);
  size_t got = 0;
  tpu_sync_plan_spans(plan, 0, spans, nspans, &got);
  long bad = 0;
  *moved = 0;
  for (size_t i = 0; i < got; i++) {
    const tpu_sync_span *s = &spans[i];
    for (uint32_t c = 0; c < s->count; c++) {
      const uint8_t *from = &src_host[s->src_rank][s->src_buffer][s->src_offset + c * s->src_stride];
      uint64_t at = s->dst_offset + c * s->dst_stride;
      bad += memcmp(&dst_back[s->dst_buffer][at], from, s->len) != 0;
      memset(&covered[s->dst_buffer][at], 1, s->len);
      *moved += s->len;
    }
  }
  for (int l = 0; l < LAYERS; l++)
    for (size_t i = 0; i < DST_BYTES; i++) bad += !covered[l][i] && dst_back[l][i] != dst_init[l][i];
  free(spans);
  return bad;
}

int main(void) {
  tpu_sync_client *client = NULL;
  TRY(tpu_sync_client_new(NULL, 3, &client));
  /* Each buffer has exactly its layout's shape and element type (refused otherwise):
   * bf16 [planes, blocks, tokens, heads, head_dim] (NHD), [planes, blocks, heads, tokens,
   * head_dim] (HND). */
  int64_t sdims[5] = {2, 8, 16, 2, 8}, ddims[5] = {2, 6, 4, 32, 8};
  tpu_sync_buffer *src[SRC_RANKS * LAYERS], *dst[LAYERS];
  for (int r = 0; r < SRC_RANKS; r++)
    for (int l = 0; l < LAYERS; l++) {
      fill(src_host[r][l], SRC_BYTES, 10 + r * LAYERS + l);
      TRY(tpu_sync_buffer_from_host(client, (size_t)r, src_host[r][l], SRC_BYTES, sdims, 5, TPU_SYNC_DTYPE_BF16,
                                    &src[r * LAYERS + l]));
    }
  for (int l = 0; l < LAYERS; l++) {
    fill(dst_init[l], DST_BYTES, 100 + l);
    TRY(tpu_sync_buffer_from_host(client, 2, dst_init[l], DST_BYTES, ddims, 5, TPU_SYNC_DTYPE_BF16, &dst[l]));
  }
  tpu_sync_plan *plan = NULL;
  TRY(tpu_sync_plan_new(SRC, DST, TOKENS, &plan));

  /* Two endpoints on loopback: prefill listens; decode listens too (for the push). */
  tpu_sync_endpoint *prefill = NULL, *decode = NULL;
  TRY(tpu_sync_endpoint_new("{\"listen\":\"127.0.0.1:0\",\"name\":\"prefill\",\"timeout_s\":20}", &prefill));
  TRY(tpu_sync_endpoint_new("{\"listen\":\"127.0.0.1:0\",\"name\":\"decode\",\"timeout_s\":20}", &decode));
  char prefill_addr[64], decode_addr[64];
  TRY(tpu_sync_endpoint_address(prefill, prefill_addr, sizeof prefill_addr, NULL));
  TRY(tpu_sync_endpoint_address(decode, decode_addr, sizeof decode_addr, NULL));
  printf("prefill endpoint %s, decode endpoint %s\n", prefill_addr, decode_addr);

  /* Pull: the prefill registers (stages its blocks: D2H), the decode pulls and writes in place. */
  const uint32_t src_ranks[SRC_RANKS] = {0, 1}, dst_ranks[1] = {0};
  TRY(tpu_sync_endpoint_register(prefill, 7, SRC, TOKENS, src_ranks, SRC_RANKS,
                                 (const tpu_sync_buffer *const *)src, LAYERS, 1));
  tpu_sync_transfer *t = NULL;
  TRY(tpu_sync_endpoint_pull(decode, 7, prefill_addr, SRC, DST, TOKENS, dst_ranks, 1,
                             (const tpu_sync_buffer *const *)dst, LAYERS, &t));
  tpu_sync_transfer_stats st;
  TRY(tpu_sync_transfer_wait(t, 30000, &st));
  TRY(tpu_sync_transfer_free(t));
  uint64_t moved = 0;
  long bad = verify(plan, dst, &moved);
  uint32_t state = 99;
  for (int i = 0; i < 200 && state != TPU_SYNC_SOURCE_RELEASED; i++) {
    TRY(tpu_sync_endpoint_source_state(prefill, 7, &state));
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
  }
  printf("pull: %" PRIu64 " bytes over the network, %" PRIu64 " written to the device, %" PRIu64
         " spans, %" PRIu64 " pairs; plan bytes %" PRIu64 "; wrong bytes %ld; prefill registration %s\n",
         st.bytes, st.device_bytes, st.spans, st.pairs, moved, bad,
         state == TPU_SYNC_SOURCE_RELEASED ? "released" : "NOT released");
  if (bad != 0 || st.bytes != moved || st.device_bytes < moved || state != TPU_SYNC_SOURCE_RELEASED) {
    fprintf(stderr, "FAILED: pull\n");
    return 1;
  }

  /* Push: the decode expects request 8, the prefill pushes it. Reset the decode buffers first. */
  for (int l = 0; l < LAYERS; l++) TRY(tpu_sync_buffer_write(dst[l], 0, dst_init[l], DST_BYTES));
  tpu_sync_transfer *rx = NULL, *tx = NULL;
  TRY(tpu_sync_endpoint_expect_push(decode, 8, SRC, DST, TOKENS, dst_ranks, 1, (const tpu_sync_buffer *const *)dst,
                                    LAYERS, &rx));
  TRY(tpu_sync_endpoint_push(prefill, 8, decode_addr, SRC, DST, TOKENS, src_ranks, SRC_RANKS,
                             (const tpu_sync_buffer *const *)src, LAYERS, &tx));
  tpu_sync_transfer_stats sent, got;
  TRY(tpu_sync_transfer_wait(tx, 30000, &sent));
  TRY(tpu_sync_transfer_wait(rx, 30000, &got));
  TRY(tpu_sync_transfer_free(tx));
  TRY(tpu_sync_transfer_free(rx));
  bad = verify(plan, dst, &moved);
  printf("push: %" PRIu64 " bytes sent, %" PRIu64 " received, %" PRIu64 " written to the device; wrong bytes %ld\n",
         sent.bytes, got.bytes, got.device_bytes, bad);
  if (bad != 0 || sent.bytes != moved || got.bytes != moved) {
    fprintf(stderr, "FAILED: push\n");
    return 1;
  }

  char stats[2048];
  TRY(tpu_sync_endpoint_stats(decode, stats, sizeof stats, NULL));
  printf("decode endpoint stats: %s\n", stats);
  TRY(tpu_sync_endpoint_shutdown(decode, 1000));
  TRY(tpu_sync_endpoint_shutdown(prefill, 1000));
  TRY(tpu_sync_endpoint_free(decode));
  TRY(tpu_sync_endpoint_free(prefill));
  TRY(tpu_sync_plan_free(plan));
  for (int i = 0; i < SRC_RANKS * LAYERS; i++) TRY(tpu_sync_buffer_free(src[i]));
  for (int l = 0; l < LAYERS; l++) TRY(tpu_sync_buffer_free(dst[l]));
  TRY(tpu_sync_client_free(client));
  uint64_t live = 1;
  TRY(tpu_sync_handle_stats(TPU_SYNC_HANDLE_ALL, &live));
  if (live != 0) {
    fprintf(stderr, "FAILED: %" PRIu64 " live handles\n", live);
    return 1;
  }
  printf("verified: request of %d tokens, %d layers, TP=2 NHD block 16 -> TP=1 HND block 32, %" PRIu64
         " bytes pulled and pushed over TCP loopback, byte-exact, nothing else changed\n",
         TOKENS, LAYERS, moved);
  return 0;
}
