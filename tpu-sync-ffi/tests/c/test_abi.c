/* C tests of libtpu_sync's ABI contract: handles, errors, panics, sizes, a device round trip.
 * Built and run by `make test-c` with: cc -std=c11 -Wall -Wextra -Werror -pedantic. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

int main(void) {
  CHECK(tpu_sync_abi_version() == TPU_SYNC_ABI_VERSION, "abi %u", tpu_sync_abi_version());
  CHECK(strlen(tpu_sync_version()) > 0, "version");
  CHECK(strcmp(tpu_sync_status_name(TPU_SYNC_TIMEOUT), "TPU_SYNC_TIMEOUT") == 0, "name");
  CHECK(strcmp(tpu_sync_status_name(12345), "TPU_SYNC_UNKNOWN_STATUS") == 0, "unknown name");

  /* A panic inside the library comes back as a status, with a message. */
  CHECK(tpu_sync_debug_panic() == TPU_SYNC_PANIC, "panic status");
  CHECK(strstr(last_error(), "panic") != NULL, "panic message: %s", last_error());

  /* NULL, forged and wrong-type handles are errors, not crashes. */
  size_t n = 0;
  CHECK(tpu_sync_client_device_count(NULL, &n) == TPU_SYNC_INVALID_HANDLE, "null handle");
  CHECK(tpu_sync_client_device_count((const tpu_sync_client *)(uintptr_t)0xdeadbeef0, &n) == TPU_SYNC_INVALID_HANDLE,
        "forged handle");
  CHECK(tpu_sync_client_free(NULL) == TPU_SYNC_INVALID_HANDLE, "free null");

  uint64_t before = live_handles(TPU_SYNC_HANDLE_ALL);
  tpu_sync_client *client = NULL;
  tpu_sync_status st = tpu_sync_client_new(NULL, 2, &client);
  CHECK(st == TPU_SYNC_OK, "client_new: %s", last_error());
  if (st != TPU_SYNC_OK) return 1;
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before + 1, "one more live handle");
  CHECK(tpu_sync_client_device_count(client, &n) == TPU_SYNC_OK && n == 2, "2 devices, got %zu", n);
  CHECK(tpu_sync_client_device_count(client, NULL) == TPU_SYNC_NULL_POINTER, "null out-pointer");

  /* The JSON info: size query, too-small buffer, then the real copy. */
  size_t need = 0;
  CHECK(tpu_sync_client_info(client, NULL, 0, &need) == TPU_SYNC_BUFFER_TOO_SMALL && need > 10, "size query");
  char *info = malloc(need + 1);
  CHECK(tpu_sync_client_info(client, info, need + 1, &need) == TPU_SYNC_OK, "info: %s", last_error());
  CHECK(strstr(info, "\"platform\":\"cpu\"") != NULL, "info json: %s", info);
  free(info);

  /* Device buffer round trip with non-zero, non-repeating bytes. */
  enum { N = 1 << 16 };
  uint8_t *src = malloc(N), *back = malloc(N);
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)((i * 2654435761u) >> 13) | 1u;
  int64_t dims[1] = {N};
  tpu_sync_buffer *buf = NULL;
  CHECK(tpu_sync_buffer_from_host(client, 1, src, N, dims, 1, TPU_SYNC_DTYPE_U8, &buf) == TPU_SYNC_OK, "from_host: %s",
        last_error());
  CHECK(tpu_sync_buffer_from_host(client, 7, src, N, dims, 1, TPU_SYNC_DTYPE_U8, &buf) == TPU_SYNC_INVALID_ARGUMENT,
        "device 7 does not exist");
  CHECK(tpu_sync_buffer_from_host(client, 0, src, N - 1, dims, 1, TPU_SYNC_DTYPE_U8, &buf) == TPU_SYNC_INVALID_ARGUMENT,
        "size does not match shape");
  CHECK(tpu_sync_buffer_from_host(client, 0, src, N, dims, 1, 999, &buf) == TPU_SYNC_INVALID_ARGUMENT, "bad dtype");
  uint64_t size = 0;
  CHECK(tpu_sync_buffer_size(buf, &size) == TPU_SYNC_OK && size == N, "size %llu", (unsigned long long)size);
  CHECK(tpu_sync_buffer_read(buf, 0, back, N) == TPU_SYNC_OK && memcmp(src, back, N) == 0, "read back");
  /* In-place write of a window, then read everything again. */
  uint8_t patch[1000];
  for (size_t i = 0; i < sizeof patch; i++) patch[i] = (uint8_t)(i * 7 + 3) | 0x80u;
  CHECK(tpu_sync_buffer_write(buf, 12345, patch, sizeof patch) == TPU_SYNC_OK, "write: %s", last_error());
  memcpy(src + 12345, patch, sizeof patch);
  CHECK(tpu_sync_buffer_read(buf, 0, back, N) == TPU_SYNC_OK && memcmp(src, back, N) == 0, "read after write");
  /* Out-of-range sizes are refused before reaching the plugin. */
  CHECK(tpu_sync_buffer_read(buf, N - 10, back, 11) == TPU_SYNC_INVALID_ARGUMENT, "read past end");
  CHECK(tpu_sync_buffer_write(buf, UINT64_MAX - 5, patch, 10) == TPU_SYNC_INVALID_ARGUMENT, "offset overflow");
  CHECK(tpu_sync_buffer_read(buf, 0, NULL, 10) == TPU_SYNC_NULL_POINTER, "null dst");

  /* A buffer handle is not a client handle. */
  CHECK(tpu_sync_client_device_count((const tpu_sync_client *)buf, &n) == TPU_SYNC_INVALID_HANDLE, "type confusion");

  /* Freed handles are detected; double free is an error. */
  CHECK(tpu_sync_buffer_free(buf) == TPU_SYNC_OK, "free buffer");
  CHECK(tpu_sync_buffer_read(buf, 0, back, 16) == TPU_SYNC_INVALID_HANDLE, "use after free");
  CHECK(tpu_sync_buffer_free(buf) == TPU_SYNC_INVALID_HANDLE, "double free");
  CHECK(tpu_sync_client_free(client) == TPU_SYNC_OK, "free client");
  CHECK(tpu_sync_client_free(client) == TPU_SYNC_INVALID_HANDLE, "double free client");
  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == before, "no leaked handles");

  /* A plugin that cannot be loaded. */
  CHECK(tpu_sync_client_new("/nonexistent/plugin.so", 1, &client) == TPU_SYNC_PLUGIN_LOAD, "bad plugin");
  CHECK(strstr(last_error(), "cannot load PJRT plugin") != NULL, "message: %s", last_error());

  free(src);
  free(back);
  if (failures) {
    fprintf(stderr, "%d C ABI checks FAILED\n", failures);
    return 1;
  }
  printf("C ABI tests: all checks passed\n");
  return 0;
}
