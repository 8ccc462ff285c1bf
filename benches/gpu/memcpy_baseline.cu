// Native cudaMemcpy baseline for the GPU check: the same 4096 pieces of 32 KiB as
// benches/gpu/gpu_copy.rs (32 layers x 2 planes x 64 blocks, every other block id reversed),
// issued from a C loop with cudaMemcpyAsync on one stream between cudaMalloc'd device memory and
// cudaHostAlloc'd (pinned) host memory; plus one contiguous 128 MiB copy each way.
// Median of ITERS after 2 warm-ups; prints one line: NATIVE {json}.
// Build: nvcc -O2 -o memcpy_baseline memcpy_baseline.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      printf("NATIVE {\"error\": \"%s\"}\n", cudaGetErrorString(e_));               \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

enum { LAYERS = 32, PLANES = 2, NUM_BLOCKS = 128, REQ = 64, BLOCK = 16 * 8 * 128 * 2 };
enum { PIECES = LAYERS * PLANES * REQ };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static size_t src_off[PIECES], dst_off[PIECES];
static int layer_of[PIECES];

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 10;
  if (iters < 1) iters = 1;
  size_t layer_bytes = (size_t)PLANES * NUM_BLOCKS * BLOCK, total = (size_t)PIECES * BLOCK;
  unsigned char* dev[LAYERS];
  unsigned char *host, *contig, *init;
  init = (unsigned char*)malloc(layer_bytes);
  for (int l = 0; l < LAYERS; l++) {
    CHECK(cudaMalloc(&dev[l], layer_bytes));
    for (size_t i = 0; i < layer_bytes; i++) init[i] = (unsigned char)((i * 131 + l * 7) | 1);
    CHECK(cudaMemcpy(dev[l], init, layer_bytes, cudaMemcpyHostToDevice));
  }
  CHECK(cudaHostAlloc((void**)&host, total, cudaHostAllocDefault));
  CHECK(cudaMalloc(&contig, total));
  int k = 0;
  for (int l = 0; l < LAYERS; l++)
    for (int p = 0; p < PLANES; p++)
      for (int i = REQ - 1; i >= 0; i--, k++) {
        layer_of[k] = l;
        src_off[k] = (size_t)p * NUM_BLOCKS * BLOCK + (size_t)(2 * i) * BLOCK;
        dst_off[k] = (size_t)k * BLOCK;
      }
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double t_pd[64], t_ph[64], t_cd[64], t_ch[64];
  if (iters > 60) iters = 60;
  for (int it = 0; it < iters + 2; it++) {
    double t = now();
    for (int j = 0; j < PIECES; j++)
      CHECK(cudaMemcpyAsync(host + dst_off[j], dev[layer_of[j]] + src_off[j], BLOCK,
                            cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    double pd = now() - t;
    t = now();
    for (int j = 0; j < PIECES; j++)
      CHECK(cudaMemcpyAsync(dev[layer_of[j]] + src_off[j], host + dst_off[j], BLOCK,
                            cudaMemcpyHostToDevice, s));
    CHECK(cudaStreamSynchronize(s));
    double ph = now() - t;
    t = now();
    CHECK(cudaMemcpyAsync(host, contig, total, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    double cd = now() - t;
    t = now();
    CHECK(cudaMemcpyAsync(contig, host, total, cudaMemcpyHostToDevice, s));
    CHECK(cudaStreamSynchronize(s));
    double ch = now() - t;
    if (it >= 2) {
      t_pd[it - 2] = pd;
      t_ph[it - 2] = ph;
      t_cd[it - 2] = cd;
      t_ch[it - 2] = ch;
    }
  }
  // The pieces really arrived (checked on a fresh D2H).
  for (int j = 0; j < PIECES; j++)
    CHECK(cudaMemcpyAsync(host + dst_off[j], dev[layer_of[j]] + src_off[j], BLOCK,
                          cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  for (int j = 0; j < PIECES; j += 97) {
    int l = layer_of[j];
    for (size_t b = 0; b < BLOCK; b += 61) {
      size_t i = src_off[j] + b;
      if (host[dst_off[j] + b] != (unsigned char)((i * 131 + l * 7) | 1)) {
        printf("NATIVE {\"error\": \"piece %d differs\"}\n", j);
        return 1;
      }
    }
  }
  qsort(t_pd, iters, sizeof(double), cmp);
  qsort(t_ph, iters, sizeof(double), cmp);
  qsort(t_cd, iters, sizeof(double), cmp);
  qsort(t_ch, iters, sizeof(double), cmp);
  int rv;
  CHECK(cudaRuntimeGetVersion(&rv));
  printf("NATIVE {\"library\": \"cudart %d\", \"bytes\": %zu, \"pieces\": %d, \"pieces_d2h_s\": %.9f, "
         "\"pieces_h2d_s\": %.9f, \"contiguous_d2h_s\": %.9f, \"contiguous_h2d_s\": %.9f}\n",
         rv, total, PIECES, t_pd[iters / 2], t_ph[iters / 2], t_cd[iters / 2], t_ch[iters / 2]);
  return 0;
}
