/* KV cache groups (hybrid models) through the C ABI: the groups form of the placement JSON is
 * accepted by tpu_sync_plan_new, the plan moves exactly the bytes the destination needs per
 * group, and two sides whose groups differ (another sliding window, a group missing, another
 * state shape) are refused with TPU_SYNC_MISMATCH naming the difference; a malformed groups
 * form is TPU_SYNC_INVALID_ARGUMENT. The published presets come from tpu_sync_model_preset and
 * plan their own bytes per group (gpt-oss-120b: the sliding layers move only their window). No
 * handle leaks. */
#include <stdio.h>
#include <string.h>

#include "check.h"

/* A sliding-window group (cache layers 0 and 2, window WIN), a full-attention layer (1) and a
 * linear-attention state (3); TP=1, 16-token blocks, different block counts per group. */
static void placement(char *out, size_t cap, int window, int with_state, int conv_rows,
                      const char *ids) {
  char state[512] = "";
  if (with_state)
    snprintf(state, sizeof state,
             ",{\"name\":\"linear\",\"layers\":[3],\"kind\":{\"type\":\"state\",\"components\":["
             "{\"name\":\"conv\",\"dtype\":\"bf16\",\"rows\":%d,\"segments\":[{\"heads\":2,"
             "\"head_elems\":4}]},{\"name\":\"ssm\",\"dtype\":\"f32\",\"segments\":[{\"heads\":2,"
             "\"head_elems\":16}]}]}}",
             conv_rows);
  snprintf(out, cap,
           "{\"layout\":{\"model\":{\"name\":\"tiny\",\"groups\":["
           "{\"name\":\"sliding\",\"layers\":[0,2],\"kind\":{\"type\":\"attention\","
           "\"num_kv_heads\":2,\"head_dim\":4,\"dtype\":\"bf16\",\"sliding_window\":%d}},"
           "{\"name\":\"full\",\"layers\":[1],\"kind\":{\"type\":\"attention\","
           "\"num_kv_heads\":2,\"head_dim\":4,\"dtype\":\"bf16\"}}%s]},"
           "\"spec\":{\"tp\":1,\"pcp\":1,\"dp\":1,\"block_size\":16,\"order\":\"nhd\"},"
           "\"groups\":[{\"num_blocks\":4},{\"num_blocks\":6}%s]},"
           "\"dp_rank\":0,\"block_ids\":%s}",
           window, state, with_state ? ",{\"num_blocks\":3}" : "", ids);
}

int main(void) {
  char src[4096], dst[4096], bad[4096];
  /* 40 tokens: the window [33, 40) lies in block 2 (one block), the full layer 3 blocks. */
  placement(src, sizeof src, 8, 1, 3, "[[[3]],[[4,1,5]],[[2]]]");
  placement(dst, sizeof dst, 8, 1, 3, "[[[1]],[[2,0,3]],[[0]]]");
  const uint64_t needed = 2 * 7 * 2 * 2 * 4 * 2 /* window tokens, 2 layers */
                          + 40 * 2 * 2 * 4 * 2   /* full layer */
                          + 3 * 2 * 4 * 2 + 2 * 16 * 4; /* one state slot */
  tpu_sync_plan *plan = NULL;
  tpu_sync_status st = tpu_sync_plan_new(src, dst, 40, &plan);
  CHECK(st == TPU_SYNC_OK, "groups plan: %d %s", st, last_error());
  uint64_t bytes = 0;
  size_t spans = 0;
  CHECK(tpu_sync_plan_summary(plan, &bytes, &spans) == TPU_SYNC_OK, "%s", last_error());
  CHECK(bytes == needed, "moved %llu, needed %llu", (unsigned long long)bytes,
        (unsigned long long)needed);
  CHECK(spans > 0, "spans");
  /* Every span stays inside its own layer's buffer (bytes of that layer's group). */
  tpu_sync_span sp[256];
  size_t n = 0;
  CHECK(tpu_sync_plan_spans(plan, 0, sp, 256, &n) == TPU_SYNC_OK, "%s", last_error());
  const uint64_t buf_bytes[4] = {2 * 4 * 16 * 2 * 4 * 2, 2 * 6 * 16 * 2 * 4 * 2,
                                 2 * 4 * 16 * 2 * 4 * 2, 3 * 176};
  for (size_t i = 0; i < n; i++) {
    uint64_t end = sp[i].dst_offset + (sp[i].count - 1) * sp[i].dst_stride + sp[i].len;
    CHECK(sp[i].dst_buffer < 4 && end <= buf_bytes[sp[i].dst_buffer], "span %zu past layer %u",
          i, sp[i].dst_buffer);
  }
  CHECK(tpu_sync_plan_free(plan) == TPU_SYNC_OK, "%s", last_error());

  /* Another window on one side. */
  placement(bad, sizeof bad, 16, 1, 3, "[[[1]],[[2,0,3]],[[0]]]");
  plan = NULL;
  st = tpu_sync_plan_new(src, bad, 40, &plan);
  CHECK(st == TPU_SYNC_MISMATCH, "other window: %d", st);
  CHECK(strstr(last_error(), "sliding window") != NULL, "%s", last_error());
  CHECK(plan == NULL, "no handle on failure");
  /* A group missing. */
  placement(bad, sizeof bad, 8, 0, 3, "[[[1]],[[2,0,3]]]");
  st = tpu_sync_plan_new(src, bad, 40, &plan);
  CHECK(st == TPU_SYNC_MISMATCH, "missing group: %d", st);
  CHECK(strstr(last_error(), "groups differ") != NULL, "%s", last_error());
  /* Another state shape. */
  placement(bad, sizeof bad, 8, 1, 4, "[[[1]],[[2,0,3]],[[0]]]");
  st = tpu_sync_plan_new(src, bad, 40, &plan);
  CHECK(st == TPU_SYNC_MISMATCH, "state shape: %d", st);
  CHECK(strstr(last_error(), "state shapes differ") != NULL, "%s", last_error());
  /* Ids for the wrong number of groups; an unknown key in the groups form. */
  placement(bad, sizeof bad, 8, 1, 3, "[[[1]],[[2,0,3]]]");
  st = tpu_sync_plan_new(src, bad, 40, &plan);
  CHECK(st == TPU_SYNC_BLOCK_RANGE, "ids of 2 groups: %d %s", st, last_error());
  char *k = strstr(dst, "\"dp_rank\"");
  snprintf(bad, sizeof bad, "%.*s\"extra\":1,%s", (int)(k - dst), dst, k);
  st = tpu_sync_plan_new(src, bad, 40, &plan);
  CHECK(st == TPU_SYNC_INVALID_ARGUMENT, "unknown key: %d %s", st, last_error());

  /* Presets: the names, a hybrid preset's JSON dropped into a placement, an unknown name. */
  char names[1024], gptoss[4096], pl[8192], pl2[8192];
  size_t len = 0;
  CHECK(tpu_sync_model_presets(names, sizeof names, &len) == TPU_SYNC_OK, "%s", last_error());
  CHECK(strstr(names, "\"llama-3.1-8b\"") && strstr(names, "\"gemma-3-27b\"") &&
            strstr(names, "\"qwen3-next-80b\"") && strstr(names, "\"deepseek-v3.2\""),
        "preset names: %s", names);
  st = tpu_sync_model_preset("gpt-oss-120b", NULL, 0, &len);
  CHECK(st == TPU_SYNC_BUFFER_TOO_SMALL && len > 0, "size query: %d %zu", st, len);
  CHECK(tpu_sync_model_preset("gpt-oss-120b", gptoss, sizeof gptoss, &len) == TPU_SYNC_OK, "%s",
        last_error());
  CHECK(strlen(gptoss) == len && strstr(gptoss, "\"sliding_window\":128"), "%s", gptoss);
  /* 256 tokens, TP=1, 16-token blocks: 16 blocks of the full layers; the 127 tokens of the
   * 128-token window, [129, 256), lie in blocks 8..15. */
  const char *ids_a = "[[[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]],[[20,21,22,23,24,25,26,27]]]";
  const char *ids_b = "[[[31,30,29,28,27,26,25,24,23,22,21,20,19,18,17,16]],[[0,2,4,6,8,10,12,14]]]";
  const char *fmt = "{\"layout\":{\"model\":%s,\"spec\":{\"tp\":1,\"pcp\":1,\"dp\":1,"
                    "\"block_size\":16,\"order\":\"nhd\"},\"groups\":[{\"num_blocks\":32},"
                    "{\"num_blocks\":32}]},\"dp_rank\":0,\"block_ids\":%s}";
  snprintf(pl, sizeof pl, fmt, gptoss, ids_a);
  snprintf(pl2, sizeof pl2, fmt, gptoss, ids_b);
  plan = NULL;
  st = tpu_sync_plan_new(pl, pl2, 256, &plan);
  CHECK(st == TPU_SYNC_OK, "gpt-oss plan: %d %s", st, last_error());
  bytes = 0;
  CHECK(tpu_sync_plan_summary(plan, &bytes, NULL) == TPU_SYNC_OK, "%s", last_error());
  /* 18 full layers x 256 tokens + 18 sliding layers x 127 tokens, each token 2 planes x 8 heads
   * x 64 x 2 bytes (bf16). */
  const uint64_t per_token = 2 * 8 * 64 * 2;
  CHECK(bytes == 18 * 256 * per_token + 18 * 127 * per_token, "gpt-oss moved %llu",
        (unsigned long long)bytes);
  CHECK(tpu_sync_plan_free(plan) == TPU_SYNC_OK, "%s", last_error());
  char uni[512];
  CHECK(tpu_sync_model_preset("llama-3.1-8b", uni, sizeof uni, &len) == TPU_SYNC_OK, "%s",
        last_error());
  CHECK(strstr(uni, "\"num_layers\":32") && !strstr(uni, "groups"), "%s", uni);
  st = tpu_sync_model_preset("no-such-model", uni, sizeof uni, &len);
  CHECK(st == TPU_SYNC_LAYOUT && strstr(last_error(), "gemma-3-27b"), "unknown: %d %s", st,
        last_error());
  CHECK(tpu_sync_model_preset(NULL, uni, sizeof uni, &len) == TPU_SYNC_NULL_POINTER, "NULL");

  CHECK(live_handles(TPU_SYNC_HANDLE_ALL) == 0, "handles leaked");
  if (failures == 0) printf("test_groups: ok\n");
  return failures != 0;
}
