/* Host KV offload through libtpu_sync's C ABI: a request's KV blocks go from PJRT device buffers
 * into the host KV store, are found again by their prompt's chained block keys, and are loaded
 * back into other device blocks; every byte is checked.
 *
 * Build (only the header and a C compiler), from the repository root:
 *   cc -std=c11 -I tpu-sync-ffi/include examples/c/kv_offload.c -L target/release -ltpu_sync \
 *      -Wl,-rpath,$PWD/target/release -o kv_offload
 * (the rpath must be absolute for the binary to find libtpu_sync.so from any directory).
 * Statically: replace `-L target/release -ltpu_sync -Wl,-rpath,...` with
 * `target/release/libtpu_sync.a -lpthread -ldl -lm -lgcc_s` (see docs/c-abi.md).
 * `make examples-c` builds and runs every example here. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tpu_sync.h"

enum {
  LAYERS = 2,
  BLOCKS = 16,                  /* device blocks per layer and plane */
  BLOCK_BYTES = 16 * 4 * 32,    /* 16 tokens x 4 KV heads x 32 dims x 1 byte, per plane */
  TOKENS_PER_BLOCK = 16,
  PROMPT_BLOCKS = 4,
};

static int fail(const char *what, tpu_sync_status s) {
  char msg[1024];
  tpu_sync_last_error(msg, sizeof msg, NULL);
  fprintf(stderr, "%s failed: %s: %s\n", what, tpu_sync_status_name((uint32_t)s), msg);
  return 1;
}

#define TRY(call)                               \
  do {                                          \
    tpu_sync_status st_ = (call);               \
    if (st_ != TPU_SYNC_OK) return fail(#call, st_); \
  } while (0)

/* The bytes of (layer, plane, block): a value no other block holds, never zero. */
static uint8_t value(int layer, int plane, int block, int i) {
  return (uint8_t)(((layer * 2 + plane) * 131 + block * 17 + i * 7) % 251 + 1);
}

/* The pieces of engine block `block` of every layer: K then V of layer 0, then layer 1. */
static void pieces_of(tpu_sync_buffer *const *layers, int block, tpu_sync_device_range *out) {
  for (int l = 0; l < LAYERS; l++)
    for (int p = 0; p < 2; p++)
      out[l * 2 + p] = (tpu_sync_device_range){layers[l], (uint64_t)(p * BLOCKS + block) * BLOCK_BYTES, BLOCK_BYTES};
}

int main(void) {
  if (tpu_sync_abi_version() != TPU_SYNC_ABI_VERSION) {
    fprintf(stderr, "header ABI %d, library ABI %u\n", TPU_SYNC_ABI_VERSION, tpu_sync_abi_version());
    return 1;
  }
  printf("libtpu_sync %s (ABI %u)\n", tpu_sync_version(), tpu_sync_abi_version());

  tpu_sync_client *client = NULL;
  TRY(tpu_sync_client_new(NULL, 1, &client));

  /* Per-layer KV buffers [2 planes, BLOCKS, BLOCK_BYTES] on device 0, filled by "prefill". */
  const size_t layer_bytes = 2u * BLOCKS * BLOCK_BYTES;
  uint8_t *host = malloc(layer_bytes);
  int64_t dims[3] = {2, BLOCKS, BLOCK_BYTES};
  tpu_sync_buffer *kv[LAYERS];
  for (int l = 0; l < LAYERS; l++) {
    for (int p = 0; p < 2; p++)
      for (int b = 0; b < BLOCKS; b++)
        for (int i = 0; i < BLOCK_BYTES; i++)
          host[((size_t)p * BLOCKS + b) * BLOCK_BYTES + i] = value(l, p, b, i);
    TRY(tpu_sync_buffer_from_host(client, 0, host, layer_bytes, dims, 3, TPU_SYNC_DTYPE_U8, &kv[l]));
  }

  /* The host KV tier: one store block = one engine block of every layer, K and V. */
  char config[256];
  snprintf(config, sizeof config,
           "{\"namespace\":\"example u8 layers=%d block=%d\",\"block_bytes\":%d,\"capacity_bytes\":%d,"
           "\"lock_memory\":false}",
           LAYERS, TOKENS_PER_BLOCK, LAYERS * 2 * BLOCK_BYTES, 64 * LAYERS * 2 * BLOCK_BYTES);
  tpu_sync_store *store = NULL;
  TRY(tpu_sync_store_new(config, client, &store));

  /* The prompt's token ids and its chained block keys. */
  uint32_t tokens[PROMPT_BLOCKS * TOKENS_PER_BLOCK + 3];
  for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++) tokens[i] = (uint32_t)(128000 + i * 13 % 977);
  tpu_sync_key keys[PROMPT_BLOCKS];
  size_t nkeys = 0;
  TRY(tpu_sync_store_chain_keys(store, tokens, sizeof tokens / sizeof tokens[0], TOKENS_PER_BLOCK, NULL, keys,
                                PROMPT_BLOCKS, &nkeys));

  /* Offload: the request's blocks sit at scattered device block ids. */
  const int src_blocks[PROMPT_BLOCKS] = {3, 9, 1, 12};
  tpu_sync_device_range pieces[PROMPT_BLOCKS * LAYERS * 2];
  size_t per_block[PROMPT_BLOCKS];
  for (int k = 0; k < PROMPT_BLOCKS; k++) {
    pieces_of(kv, src_blocks[k], pieces + k * LAYERS * 2);
    per_block[k] = LAYERS * 2;
  }
  tpu_sync_put_result put;
  TRY(tpu_sync_store_put_from_device(store, NULL, keys, nkeys, pieces, nkeys * LAYERS * 2, per_block, &put));
  printf("put: %zu blocks stored, %zu present, %" PRIu64 " bytes\n", put.stored, put.present, put.bytes);

  /* A later request with the same prompt: look it up, pin it, load it into other blocks. */
  size_t hits = 0;
  TRY(tpu_sync_store_lookup(store, keys, nkeys, &hits, NULL, NULL));
  tpu_sync_lease *lease = NULL;
  TRY(tpu_sync_store_pin(store, keys, hits, &lease));
  const int dst_blocks[PROMPT_BLOCKS] = {0, 5, 6, 2};
  for (int k = 0; k < PROMPT_BLOCKS; k++) pieces_of(kv, dst_blocks[k], pieces + k * LAYERS * 2);
  tpu_sync_get_result got;
  TRY(tpu_sync_store_get_to_device(store, keys, hits, pieces, hits * LAYERS * 2, per_block, &got));
  TRY(tpu_sync_lease_free(lease));
  printf("lookup: %zu of %zu blocks hit; get: %zu delivered (%zu from DRAM)\n", hits, nkeys, got.delivered,
         got.from_dram);

  /* Check every byte of every layer: loaded blocks hold their source block, others unchanged. */
  size_t bad = 0;
  for (int l = 0; l < LAYERS; l++) {
    TRY(tpu_sync_buffer_read(kv[l], 0, host, layer_bytes));
    for (int p = 0; p < 2; p++)
      for (int b = 0; b < BLOCKS; b++) {
        int from = b;
        for (int k = 0; k < PROMPT_BLOCKS; k++)
          if (dst_blocks[k] == b) from = src_blocks[k];
        for (int i = 0; i < BLOCK_BYTES; i++)
          bad += host[((size_t)p * BLOCKS + b) * BLOCK_BYTES + i] != value(l, p, from, i);
      }
  }
  char stats[2048];
  TRY(tpu_sync_store_stats(store, stats, sizeof stats, NULL));
  printf("store stats: %s\n", stats);

  TRY(tpu_sync_store_free(store));
  for (int l = 0; l < LAYERS; l++) TRY(tpu_sync_buffer_free(kv[l]));
  TRY(tpu_sync_client_free(client));
  free(host);
  uint64_t live = 1;
  TRY(tpu_sync_handle_stats(TPU_SYNC_HANDLE_ALL, &live));
  if (bad || got.delivered != PROMPT_BLOCKS || live != 0) {
    fprintf(stderr, "FAILED: %zu wrong bytes, %zu blocks delivered, %" PRIu64 " live handles\n", bad, got.delivered,
            live);
    return 1;
  }
  printf("verified: %d blocks x %d layers x K/V (%d bytes) offloaded and loaded into other blocks, byte-exact\n",
         PROMPT_BLOCKS, LAYERS, PROMPT_BLOCKS * LAYERS * 2 * BLOCK_BYTES);
  return 0;
}
