/* The host tier's KV cache groups through the C ABI (tpu_sync_store_*_groups*): a sliding-window
 * group (window 24 tokens, layer 0) and a full-attention group (layer 1) at 16 tokens per block,
 * one 1 KiB part per block per group, real XLA CPU PJRT buffers. A removed window part cuts the
 * hit; a get delivers only whole leading parts, byte-exact; bad input is refused. */
#include <stdlib.h>
#include <string.h>

#include "check.h"

enum { NB = 8, LBB = 1024, BT = 16 };

/* Parts of chain blocks 0..n-1: the full group's (layer 1) of every block, then the window
 * group's (layer 0) of every block, each in device block ids[g][i] of layers[g]. */
static size_t parts(tpu_sync_buffer *const layers[2], const int ids[2][3], size_t n, size_t *blocks, uint32_t *groups,
                    tpu_sync_device_range *pieces, size_t *per) {
  size_t k = 0;
  for (int g = 1; g >= 0; g--)
    for (size_t i = 0; i < n; i++) {
      blocks[k] = i;
      groups[k] = (uint32_t)g;
      pieces[k] = (tpu_sync_device_range){layers[g], (uint64_t)ids[g][i] * LBB, LBB};
      per[k] = 1;
      k++;
    }
  return k;
}

int main(void) {
  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  tpu_sync_client *client = NULL;
  CHECK(tpu_sync_client_new(NULL, 1, &client) == TPU_SYNC_OK, "client");
  int64_t dims[2] = {NB, LBB};
  uint8_t *host = malloc(NB * LBB), *back = malloc(NB * LBB), *src_b[2];
  tpu_sync_buffer *src[2] = {NULL, NULL}, *dst[2] = {NULL, NULL};
  for (int l = 0; l < 2; l++) {
    src_b[l] = malloc(NB * LBB);
    fill(src_b[l], NB * LBB, 40 + (uint32_t)l);
    CHECK(tpu_sync_buffer_from_host(client, 0, src_b[l], NB * LBB, dims, 2, TPU_SYNC_DTYPE_U8, &src[l]) ==
              TPU_SYNC_OK,
          "src %d", l);
    memset(host, 0, NB * LBB);
    CHECK(tpu_sync_buffer_from_host(client, 0, host, NB * LBB, dims, 2, TPU_SYNC_DTYPE_U8, &dst[l]) == TPU_SYNC_OK,
          "dst %d", l);
  }
  tpu_sync_store *s = NULL;
  CHECK(tpu_sync_store_new("{\"namespace\":\"groups\",\"block_bytes\":1024,\"capacity_bytes\":65536,"
                           "\"lock_memory\":false,\"populate\":false}",
                           client, &s) == TPU_SYNC_OK,
        "store: %s", last_error());
  tpu_sync_store_group groups[2] = {{TPU_SYNC_PART_WINDOW, 24, LBB}, {TPU_SYNC_PART_FULL, 0, LBB}};
  uint32_t tok[3 * BT];
  for (int i = 0; i < 3 * BT; i++) tok[i] = (uint32_t)(i * 17 + 3);
  tpu_sync_key keys[3];
  size_t n = 0;
  CHECK(tpu_sync_store_chain_keys(s, tok, 3 * BT, BT, NULL, keys, 3, &n) == TPU_SYNC_OK && n == 3, "keys");

  size_t blocks[6], per[6], missed = 99, hit = 99;
  uint32_t gs[6];
  tpu_sync_device_range pieces[6];
  const int src_ids[2][3] = {{1, 2, 3}, {4, 5, 6}};
  size_t np = parts(src, src_ids, 3, blocks, gs, pieces, per);
  tpu_sync_put_result pr;
  CHECK(tpu_sync_store_put_groups_from_device(s, groups, 2, BT, NULL, keys, 3, blocks, gs, np, pieces, np, per, &pr,
                                              &missed) == TPU_SYNC_OK &&
            pr.stored == 6 && pr.full_at == SIZE_MAX && missed == 0,
        "put: %s", last_error());
  CHECK(tpu_sync_store_lookup_groups(s, groups, 2, BT, keys, 3, &hit) == TPU_SYNC_OK && hit == 3, "hit %zu", hit);

  /* Bad input: an unknown role; a part of another size; a missing full part. */
  tpu_sync_store_group bad[1] = {{7, 0, LBB}};
  CHECK(tpu_sync_store_lookup_groups(s, bad, 1, BT, keys, 3, &hit) == TPU_SYNC_INVALID_ARGUMENT, "bad role");
  pieces[0].len = LBB - 1;
  CHECK(tpu_sync_store_put_groups_from_device(s, groups, 2, BT, NULL, keys, 3, blocks, gs, np, pieces, np, per, &pr,
                                              NULL) == TPU_SYNC_INVALID_ARGUMENT,
        "short part");
  pieces[0].len = LBB;
  CHECK(tpu_sync_store_put_groups_from_device(s, groups, 2, BT, NULL, keys, 3, blocks + 1, gs + 1, np - 1, pieces + 1,
                                              np - 1, per + 1, &pr, NULL) == TPU_SYNC_INVALID_ARGUMENT,
        "missing full part");

  /* The window group's part of block 2 (its key is the block key itself) goes: the hit is 2
   * blocks (window [9, 32): blocks 0, 1). */
  size_t removed = 0;
  CHECK(tpu_sync_store_remove(s, keys + 2, 1, &removed) == TPU_SYNC_OK && removed >= 1, "remove");
  CHECK(tpu_sync_store_lookup_groups(s, groups, 2, BT, keys, 3, &hit) == TPU_SYNC_OK && hit == 2, "hit %zu", hit);
  tpu_sync_lease *lease = (tpu_sync_lease *)1;
  CHECK(tpu_sync_store_pin_groups(s, groups, 2, BT, keys, 3, 3, &lease) == TPU_SYNC_OK && lease == NULL, "pin 3");
  CHECK(tpu_sync_store_pin_groups(s, groups, 2, BT, keys, 3, 2, &lease) == TPU_SYNC_OK && lease != NULL, "pin 2");

  /* Get all parts of 3 blocks into other blocks: full 0, 1, 2 then window 0, 1 arrive, the
   * window part of block 2 does not (the get stops there, its destination untouched). */
  const int dst_ids[2][3] = {{7, 6, 5}, {0, 1, 2}};
  np = parts(dst, dst_ids, 3, blocks, gs, pieces, per);
  tpu_sync_get_result gr;
  CHECK(tpu_sync_store_get_groups_to_device(s, groups, 2, BT, keys, 3, blocks, gs, np, pieces, np, per, &gr) ==
                TPU_SYNC_OK &&
            gr.delivered == 5 && gr.stop == TPU_SYNC_GET_MISSING,
        "get: delivered %zu stop %u: %s", gr.delivered, gr.stop, last_error());
  for (int l = 0; l < 2; l++) {
    CHECK(tpu_sync_buffer_read(dst[l], 0, back, NB * LBB) == TPU_SYNC_OK, "read %d", l);
    memset(host, 0, NB * LBB);
    for (int i = 0; i < (l == 1 ? 3 : 2); i++)
      memcpy(host + dst_ids[l][i] * LBB, src_b[l] + src_ids[l][i] * LBB, LBB);
    CHECK(memcmp(back, host, NB * LBB) == 0, "layer %d byte-exact, other blocks untouched", l);
  }
  CHECK(tpu_sync_lease_free(lease) == TPU_SYNC_OK, "unpin");
  tpu_sync_store_free(s);
  for (int l = 0; l < 2; l++) {
    tpu_sync_buffer_free(src[l]);
    tpu_sync_buffer_free(dst[l]);
    free(src_b[l]);
  }
  tpu_sync_client_free(client);
  free(host);
  free(back);
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles");
  if (failures) {
    fprintf(stderr, "%d store group checks FAILED\n", failures);
    return 1;
  }
  printf("C store group tests: all checks passed\n");
  return 0;
}
