/* C tests of the network endpoint over the ABI: configuration errors, registration errors,
 * transfers that fail (nothing listening, unknown request, a peer that never answers) end with
 * an error status within their limits, cancel and free of running transfers, callbacks,
 * shutdown, freed handles. Built and run by `make test-c`. */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define MODEL "{\"name\":\"toy\",\"num_layers\":1,\"num_kv_heads\":2,\"head_dim\":8,\"kv_planes\":2,\"dtype\":\"bf16\"}"
/* One layer, TP=1, 4 blocks of 16 tokens: 2 x 4 x 16 x 2 x 8 x 2 = 4096 bytes per buffer. */
static const char *PLACE =
    "{\"layout\":{\"model\":" MODEL ",\"spec\":{\"tp\":1,\"pcp\":1,\"dp\":1,\"block_size\":16,\"order\":\"nhd\"},"
    "\"num_blocks\":4},\"dp_rank\":0,\"block_ids\":[[2,0]]}";
static const char *BAD_BLOCK =
    "{\"layout\":{\"model\":" MODEL ",\"spec\":{\"tp\":1,\"pcp\":1,\"dp\":1,\"block_size\":16,\"order\":\"nhd\"},"
    "\"num_blocks\":4},\"dp_rank\":0,\"block_ids\":[[2,9]]}";

static atomic_int cb_status = -1;
static void on_done(void *user, tpu_sync_status s) {
  (void)user;
  atomic_store(&cb_status, (int)s);
}

/* Waits for a transfer to end, at most `limit_s`; returns its status (PENDING if it did not). */
static tpu_sync_status finish(tpu_sync_transfer *t, double limit_s, double *took) {
  double t0 = now();
  tpu_sync_status s = tpu_sync_transfer_wait(t, (int64_t)(limit_s * 1000), NULL);
  *took = now() - t0;
  return s;
}

int main(void) {
  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  tpu_sync_endpoint *ep = NULL;
  /* Configuration errors. */
  CHECK(tpu_sync_endpoint_new("{\"listen\":", &ep) == TPU_SYNC_INVALID_ARGUMENT, "bad JSON");
  CHECK(tpu_sync_endpoint_new("{\"colour\":1}", &ep) == TPU_SYNC_INVALID_ARGUMENT, "unknown key");
  CHECK(tpu_sync_endpoint_new("{\"transport\":\"pigeon\"}", &ep) == TPU_SYNC_INVALID_ARGUMENT, "transport");
  CHECK(tpu_sync_endpoint_new("{\"transport\":\"quic\",\"listen\":\"127.0.0.1:0\"}", &ep) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "quic without credentials: %s", last_error());
  CHECK(tpu_sync_endpoint_new("{\"listen\":\"nowhere\"}", &ep) == TPU_SYNC_INVALID_ARGUMENT, "bad address");
  CHECK(tpu_sync_endpoint_new("{\"psk_hex\":\"abc\"}", &ep) == TPU_SYNC_INVALID_ARGUMENT, "odd hex");
  CHECK(tpu_sync_endpoint_new("{\"timeout_s\":-1}", &ep) == TPU_SYNC_INVALID_ARGUMENT, "negative timeout");
  CHECK(tpu_sync_endpoint_new(NULL, &ep) == TPU_SYNC_NULL_POINTER, "NULL config");

  tpu_sync_endpoint *prefill = NULL, *decode = NULL;
  CHECK(tpu_sync_endpoint_new("{\"listen\":\"127.0.0.1:0\",\"timeout_s\":3,\"heartbeat_timeout_s\":3}", &prefill) ==
            TPU_SYNC_OK,
        "prefill: %s", last_error());
  char addr[64];
  CHECK(tpu_sync_endpoint_address(prefill, addr, sizeof addr, NULL) == TPU_SYNC_OK, "address");
  char cfg[160];
  snprintf(cfg, sizeof cfg, "{\"listen\":\"%s\"}", addr);
  CHECK(tpu_sync_endpoint_new(cfg, &ep) == TPU_SYNC_IO, "address in use: %s", last_error());
  CHECK(tpu_sync_endpoint_new("{\"timeout_s\":3,\"heartbeat_timeout_s\":3}", &decode) == TPU_SYNC_OK, "decode");
  size_t n = 0;
  CHECK(tpu_sync_endpoint_address(decode, addr, sizeof addr, &n) == TPU_SYNC_OK && n == 0, "client-only: no address");
  tpu_sync_endpoint_address(prefill, addr, sizeof addr, NULL);

  tpu_sync_client *client = NULL;
  CHECK(tpu_sync_client_new(NULL, 1, &client) == TPU_SYNC_OK, "client");
  uint8_t data[4096];
  for (int i = 0; i < 4096; i++) data[i] = (uint8_t)(i * 7 + 1);
  /* The layout's buffer exactly: bf16 [planes, blocks, tokens, heads, head_dim]. */
  int64_t dims[5] = {2, 4, 16, 2, 8};
  tpu_sync_buffer *buf = NULL, *gone = NULL;
  tpu_sync_buffer_from_host(client, 0, data, 4096, dims, 5, TPU_SYNC_DTYPE_BF16, &buf);
  tpu_sync_buffer_from_host(client, 0, data, 4096, dims, 5, TPU_SYNC_DTYPE_BF16, &gone);
  tpu_sync_buffer_free(gone);
  const tpu_sync_buffer *bufs[1] = {buf}, *gones[1] = {gone};
  uint32_t rank0[1] = {0}, rank5[1] = {5};

  /* Registration errors. */
  CHECK(tpu_sync_endpoint_register(prefill, 0, PLACE, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_INVALID_ARGUMENT, "id 0");
  CHECK(tpu_sync_endpoint_register(prefill, (uint64_t)1 << 53, PLACE, 20, rank0, 1, bufs, 1, 1) ==
            TPU_SYNC_INVALID_ARGUMENT,
        "id 2^53");
  CHECK(tpu_sync_endpoint_register(prefill, 1, PLACE, 20, rank5, 1, bufs, 1, 1) == TPU_SYNC_INVALID_ARGUMENT,
        "rank outside the replica");
  CHECK(tpu_sync_endpoint_register(prefill, 1, BAD_BLOCK, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_BLOCK_RANGE,
        "block out of range: %s", last_error());
  CHECK(tpu_sync_endpoint_register(prefill, 1, PLACE, 20, rank0, 1, gones, 1, 1) == TPU_SYNC_INVALID_HANDLE,
        "freed buffer");
  CHECK(tpu_sync_endpoint_register(prefill, 1, PLACE, 20, rank0, 1, NULL, 1, 1) == TPU_SYNC_NULL_POINTER,
        "NULL buffers");
  CHECK(tpu_sync_endpoint_register(prefill, 1, "{}", 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_INVALID_ARGUMENT,
        "bad placement");
  CHECK(tpu_sync_endpoint_register(prefill, 1, PLACE, 20, rank0, 1, bufs, 1, 0) == TPU_SYNC_INVALID_ARGUMENT,
        "zero releases");
  CHECK(tpu_sync_endpoint_register(prefill, 1, PLACE, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_OK,
        "register: %s", last_error());
  CHECK(tpu_sync_endpoint_register(prefill, 1, PLACE, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_INVALID_ARGUMENT,
        "registered twice");
  uint32_t state = 99;
  CHECK(tpu_sync_endpoint_source_state(prefill, 1, &state) == TPU_SYNC_OK && state == TPU_SYNC_SOURCE_ACTIVE, "active");
  CHECK(tpu_sync_endpoint_source_state(prefill, 12345, &state) == TPU_SYNC_OK && state == TPU_SYNC_SOURCE_UNKNOWN,
        "unknown");

  /* Describe: the producer's placement and token count of a registered request (the consumer
   * of a router that sends a prompt to both sides at once pulls with it). */
  char desc[1024];
  size_t need = 0;
  CHECK(tpu_sync_endpoint_describe(decode, 12345, addr, desc, sizeof desc, &need) == TPU_SYNC_UNKNOWN_REQUEST,
        "describe unknown: %s", last_error());
  CHECK(tpu_sync_endpoint_describe(decode, 0, addr, desc, sizeof desc, &need) == TPU_SYNC_INVALID_ARGUMENT, "id 0");
  CHECK(tpu_sync_endpoint_describe(decode, 1, NULL, desc, sizeof desc, &need) == TPU_SYNC_NULL_POINTER, "NULL addr");
  CHECK(tpu_sync_endpoint_describe(decode, 1, addr, desc, 8, &need) == TPU_SYNC_BUFFER_TOO_SMALL && need > 8,
        "small buffer: %zu", need);
  CHECK(tpu_sync_endpoint_describe(decode, 1, addr, desc, sizeof desc, &need) == TPU_SYNC_OK && need == strlen(desc),
        "describe: %s", last_error());
  CHECK(strstr(desc, "\"num_tokens\":20") && strstr(desc, "\"block_ids\":[[2,0]]") && strstr(desc, "\"order\":\"nhd\""),
        "description: %s", desc);

  /* Pull errors found before anything is sent. */
  tpu_sync_transfer *t = NULL;
  CHECK(tpu_sync_endpoint_pull(decode, 1, "", PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_INVALID_ARGUMENT,
        "empty peer map");
  CHECK(tpu_sync_endpoint_pull(decode, 1, addr, PLACE, BAD_BLOCK, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_BLOCK_RANGE,
        "bad destination block: %s", last_error());
  CHECK(tpu_sync_endpoint_pull(decode, 1, addr, PLACE, PLACE, 20, rank0, 1, bufs, 1, NULL) == TPU_SYNC_NULL_POINTER,
        "NULL transfer_out");

  /* A pull of a request the producer does not have fails (not reported as done). */
  double took = 0;
  CHECK(tpu_sync_endpoint_pull(decode, 99, addr, PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_OK, "pull 99");
  tpu_sync_status s = finish(t, 20, &took);
  CHECK(s != TPU_SYNC_OK && s != TPU_SYNC_PENDING, "unknown request fails: %s (%s)", tpu_sync_status_name(s),
        last_error());
  CHECK(strstr(last_error(), "99") != NULL, "names the request: %s", last_error());
  tpu_sync_transfer_free(t);

  /* Nothing listening: fails within the connect limit. */
  CHECK(tpu_sync_endpoint_pull(decode, 1, "127.0.0.1:1", PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_OK,
        "pull from nowhere");
  s = finish(t, 20, &took);
  CHECK(s != TPU_SYNC_OK && s != TPU_SYNC_PENDING && took < 15, "nowhere fails in %.1f s: %s", took,
        tpu_sync_status_name(s));
  tpu_sync_transfer_free(t);

  /* A peer that accepts but never answers: the pull is pending; cancel ends it at once with
   * CANCELLED and the callback sees it; a second one is freed while running. */
  int hole = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  CHECK(bind(hole, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(hole, 16) == 0 &&
            getsockname(hole, (struct sockaddr *)&sa, &sl) == 0,
        "black hole socket");
  char hole_addr[64];
  snprintf(hole_addr, sizeof hole_addr, "127.0.0.1:%d", ntohs(sa.sin_port));
  CHECK(tpu_sync_endpoint_pull(decode, 2, hole_addr, PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_OK, "pull");
  CHECK(tpu_sync_transfer_set_callback(t, on_done, NULL) == TPU_SYNC_OK, "callback");
  CHECK(tpu_sync_transfer_wait(t, 300, NULL) == TPU_SYNC_PENDING, "pending: %s", last_error());
  bool done = true;
  CHECK(tpu_sync_transfer_poll(t, &done, NULL) == TPU_SYNC_OK && !done, "poll: not done");
  CHECK(tpu_sync_transfer_cancel(t) == TPU_SYNC_OK, "cancel");
  s = finish(t, 10, &took);
  CHECK(s == TPU_SYNC_CANCELLED && took < 5, "cancelled in %.2f s: %s", took, tpu_sync_status_name(s));
  for (int i = 0; i < 500 && atomic_load(&cb_status) < 0; i++) sleep_ms(10);
  CHECK(atomic_load(&cb_status) == TPU_SYNC_CANCELLED, "callback saw %d", atomic_load(&cb_status));
  CHECK(tpu_sync_transfer_free(t) == TPU_SYNC_OK, "free");
  CHECK(tpu_sync_transfer_free(t) == TPU_SYNC_INVALID_HANDLE, "double free");
  CHECK(tpu_sync_endpoint_pull(decode, 3, hole_addr, PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_OK, "pull");
  double t0 = now();
  CHECK(tpu_sync_transfer_free(t) == TPU_SYNC_OK && now() - t0 < 5, "free while running");
  close(hole);

  /* The real request still works after all that, and is released by the puller. */
  CHECK(tpu_sync_endpoint_pull(decode, 1, addr, PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) == TPU_SYNC_OK, "pull 1");
  tpu_sync_transfer_stats st;
  CHECK(tpu_sync_transfer_wait(t, 20000, &st) == TPU_SYNC_OK && st.bytes == 20 * 2 * 2 * 8 * 2,
        "pulled %llu: %s", (unsigned long long)st.bytes, last_error());
  tpu_sync_transfer_free(t);

  for (int i = 0; i < 500 && state != TPU_SYNC_SOURCE_RELEASED; i++) {
    tpu_sync_endpoint_source_state(prefill, 1, &state);
    sleep_ms(10);
  }
  CHECK(state == TPU_SYNC_SOURCE_RELEASED, "the pull released request 1: state %u", state);

  bool existed = true;
  CHECK(tpu_sync_endpoint_unregister(prefill, 4242, &existed) == TPU_SYNC_OK && !existed, "unregister unknown");
  CHECK(tpu_sync_endpoint_register(prefill, 6, PLACE, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_OK, "register 6");
  CHECK(tpu_sync_endpoint_unregister(prefill, 6, &existed) == TPU_SYNC_OK && existed, "unregister 6");
  CHECK(tpu_sync_endpoint_source_state(prefill, 6, &state) == TPU_SYNC_OK && state == TPU_SYNC_SOURCE_UNREGISTERED,
        "state after unregister: %u", state);
  /* An id may be registered again once its registration ended. */
  CHECK(tpu_sync_endpoint_register(prefill, 6, PLACE, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_OK, "register 6 again");
  CHECK(tpu_sync_endpoint_source_state(prefill, 6, &state) == TPU_SYNC_OK && state == TPU_SYNC_SOURCE_ACTIVE,
        "active again");

  /* Shutdown: later work is refused; freed handles are invalid. */
  CHECK(tpu_sync_endpoint_shutdown(prefill, 500) == TPU_SYNC_OK, "shutdown");
  CHECK(tpu_sync_endpoint_shutdown(prefill, 0) == TPU_SYNC_OK, "shutdown twice");
  CHECK(tpu_sync_endpoint_source_state(prefill, 6, &state) == TPU_SYNC_OK && state == TPU_SYNC_SOURCE_SHUTDOWN,
        "shutdown ends registrations: %u", state);
  CHECK(tpu_sync_endpoint_register(prefill, 5, PLACE, 20, rank0, 1, bufs, 1, 1) == TPU_SYNC_INVALID_ARGUMENT,
        "register after shutdown");
  CHECK(tpu_sync_endpoint_free(prefill) == TPU_SYNC_OK, "free prefill");
  CHECK(tpu_sync_endpoint_free(prefill) == TPU_SYNC_INVALID_HANDLE, "double free");
  CHECK(tpu_sync_endpoint_stats(prefill, NULL, 0, &n) == TPU_SYNC_INVALID_HANDLE, "stats of freed");
  CHECK(tpu_sync_endpoint_free(decode) == TPU_SYNC_OK, "free decode without shutdown");
  CHECK(tpu_sync_endpoint_pull((tpu_sync_endpoint *)buf, 1, addr, PLACE, PLACE, 20, rank0, 1, bufs, 1, &t) ==
            TPU_SYNC_INVALID_HANDLE,
        "a buffer is not an endpoint");
  tpu_sync_buffer_free(buf);
  tpu_sync_client_free(client);
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles: %llu vs %llu", (unsigned long long)live_handles(TPU_SYNC_HANDLE_ALL), (unsigned long long)before);
  if (failures) {
    fprintf(stderr, "%d endpoint checks FAILED\n", failures);
    return 1;
  }
  printf("C endpoint tests: all checks passed\n");
  return 0;
}
