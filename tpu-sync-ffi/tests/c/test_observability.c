/* Observability through the C ABI: the metrics text (buffer sizing, a put counted), the HTTP
 * endpoint's start (address bound, bad addresses), the recording switch, and the store's KV
 * events configuration, endpoints and block descriptions (with their argument errors). */
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* The value of the sample line starting with `series ` in the metrics text (-1 if absent). */
static double sample(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
    if (strncmp(p, series, n) == 0 && p[n] == ' ') return atof(p + n + 1);
  }
  return -1;
}

static char *metrics(void) {
  size_t need = 0;
  CHECK(tpu_sync_metrics_text(NULL, 0, &need) == TPU_SYNC_BUFFER_TOO_SMALL && need > 0, "size: %s", last_error());
  size_t cap = need + 65536;
  char *buf = malloc(cap);
  CHECK(tpu_sync_metrics_text(buf, cap, &need) == TPU_SYNC_OK, "text: %s", last_error());
  return buf;
}

#define STORED "tpu_sync_store_put_blocks_total{result=\"stored\"}"

int main(void) {
  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  char *t0 = metrics();
  CHECK(strstr(t0, "# TYPE tpu_sync_store_put_blocks_total counter") != NULL, "listed");
  double stored0 = sample(t0, STORED);
  CHECK(stored0 >= 0, "stored series present");
  free(t0);

  char addr[128];
  size_t len = 0;
  CHECK(tpu_sync_metrics_serve("127.0.0.1:0", 0, addr, sizeof addr, &len) == TPU_SYNC_OK &&
            strncmp(addr, "127.0.0.1:", 10) == 0 && len == strlen(addr),
        "serve: %s", last_error());
  char again[128];
  CHECK(tpu_sync_metrics_serve("127.0.0.1:0", 0, again, sizeof again, NULL) == TPU_SYNC_OK && strcmp(addr, again) == 0,
        "second serve finds the first");
  CHECK(tpu_sync_metrics_serve("off", 0, again, sizeof again, NULL) == TPU_SYNC_INVALID_ARGUMENT, "off");
  CHECK(tpu_sync_metrics_serve("nope:x", 0, again, sizeof again, NULL) == TPU_SYNC_INVALID_ARGUMENT, "bad");
  CHECK(tpu_sync_metrics_serve(NULL, 0, again, sizeof again, NULL) == TPU_SYNC_NULL_POINTER, "NULL");

  tpu_sync_store *s = NULL;
  CHECK(tpu_sync_store_new("{\"namespace\":\"c-obs\",\"block_bytes\":4096,\"capacity_bytes\":65536,"
                           "\"lock_memory\":false,\"populate\":false,"
                           "\"kv_events\":{\"endpoint\":\"tcp://127.0.0.1:0\",\"replay_endpoint\":\"tcp://127.0.0.1:0\","
                           "\"block_size\":16}}",
                           NULL, &s) == TPU_SYNC_OK,
        "store with events: %s", last_error());
  char ev[512];
  CHECK(tpu_sync_store_kv_events(s, ev, sizeof ev, NULL) == TPU_SYNC_OK && strstr(ev, "\"endpoint\":\"tcp://127.0.0.1:") &&
            strstr(ev, "\"replay_endpoint\":\"tcp://127.0.0.1:"),
        "events endpoints: %s", ev);
  CHECK(tpu_sync_store_new("{\"namespace\":\"c-obs\",\"block_bytes\":4096,\"capacity_bytes\":65536,"
                           "\"kv_events\":{\"colour\":1}}",
                           NULL, &(tpu_sync_store *){NULL}) == TPU_SYNC_INVALID_ARGUMENT,
        "unknown kv_events key");

  uint32_t tokens[32];
  for (uint32_t i = 0; i < 32; i++) tokens[i] = 1000 + i;
  tpu_sync_key keys[2];
  size_t nkeys = 0;
  CHECK(tpu_sync_store_chain_keys(s, tokens, 32, 16, NULL, keys, 2, &nkeys) == TPU_SYNC_OK && nkeys == 2, "keys");
  uint8_t hashes[64];
  fill(hashes, sizeof hashes, 7);
  CHECK(tpu_sync_store_describe_blocks(s, keys, 2, hashes, 0, NULL, 0) == TPU_SYNC_INVALID_ARGUMENT, "hash_len 0");
  CHECK(tpu_sync_store_describe_blocks(s, keys, 2, NULL, 32, NULL, 0) == TPU_SYNC_NULL_POINTER, "NULL hashes");
  CHECK(tpu_sync_store_describe_blocks(NULL, keys, 2, hashes, 32, NULL, 0) == TPU_SYNC_INVALID_HANDLE, "NULL store");
  CHECK(tpu_sync_store_describe_blocks(s, keys, 2, hashes, 32, tokens, 16) == TPU_SYNC_OK, "describe: %s", last_error());

  static uint8_t b0[4096], b1[4096];
  fill(b0, sizeof b0, 1);
  fill(b1, sizeof b1, 2);
  const void *blocks[2] = {b0, b1};
  size_t lens[2] = {4096, 4096};
  tpu_sync_put_result r;
  CHECK(tpu_sync_store_put(s, NULL, keys, 2, blocks, lens, &r) == TPU_SYNC_OK && r.stored == 2, "put: %s", last_error());
  char *t1 = metrics();
  CHECK(sample(t1, STORED) == stored0 + 2, "stored +2: %f -> %f", stored0, sample(t1, STORED));
  CHECK(sample(t1, "tpu_sync_store_blocks{tier=\"dram\"}") >= 2, "resident");
  free(t1);

  CHECK(tpu_sync_metrics_set_enabled(0) == TPU_SYNC_OK, "off");
  CHECK(tpu_sync_store_put(s, NULL, keys, 2, blocks, lens, &r) == TPU_SYNC_OK && r.present == 2, "put again");
  char *t2 = metrics();
  CHECK(sample(t2, STORED) == stored0 + 2, "nothing recorded while off");
  free(t2);
  CHECK(tpu_sync_metrics_set_enabled(1) == TPU_SYNC_OK, "on");

  tpu_sync_store *plain = NULL;
  CHECK(tpu_sync_store_new("{\"namespace\":\"c-obs2\",\"block_bytes\":4096,\"capacity_bytes\":65536,"
                           "\"lock_memory\":false}",
                           NULL, &plain) == TPU_SYNC_OK,
        "plain store");
  CHECK(tpu_sync_store_kv_events(plain, ev, sizeof ev, NULL) == TPU_SYNC_OK && strcmp(ev, "null") == 0, "no events: %s",
        ev);
  CHECK(tpu_sync_store_describe_blocks(plain, keys, 2, hashes, 32, NULL, 0) == TPU_SYNC_OK, "no-op describe");
  tpu_sync_store_free(plain);
  tpu_sync_store_free(s);
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles");
  if (failures) {
    fprintf(stderr, "%d observability checks FAILED\n", failures);
    return 1;
  }
  printf("C observability tests: all checks passed\n");
  return 0;
}
