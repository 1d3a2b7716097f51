// emulated.cpp: librpchost_emulated.so, a stand-in for the CUDA kernels
// library that keeps "device" memory on the host, so the suite can drive the
// device paths of the host (host/tensor/nn/nn_cuda.c's im2col + GEMM glue, the
// dispatch in bindings/l_nn.c, autograd over device tensors) on a machine
// without a GPU: RPCHOST_CUDA_LIB=<build>/librpchost_emulated.so (spec/cuda_spec.lua).
// The nn kernels are the real ones (nn_kernels.cuh) with one thread walking
// each grid-stride loop; the other entries are plain loops with just what those
// paths use (elementwise ops through double, float sums, a naive GEMM), and
// the rest of the table is NULL: it serves the suite's nn checks only (what
// they use and it lacks fails with a message naming it). Never installed.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct rhc_dim3 {
  unsigned x;
};
static const rhc_dim3 blockIdx = {0}, threadIdx = {0}, gridDim = {1}, blockDim = {1};
#define __global__ static
#define __device__ static
#define __shared__ static
static inline void __syncthreads() {}
template <class T>
static T atomicAdd(T *p, T v) {
  T old = *p;
  *p += v;
  return old;
}
#include "nn_kernels.cuh"
#include "norm_kernels.cuh"

using namespace rhc;

static char err[256];
static int fail(const char *what) {
  snprintf(err, sizeof err, "the emulated device has no %s", what);
  return -1;
}

// one element as a double, and back (dtype codes are rh_dtype_t's)
static double load(int dt, const char *p) {
  switch (dt) {
    case 0: return *(const float *)p;
    case 1: return *(const double *)p;
    case 2: return *(const int32_t *)p;
    case 3: return (double)*(const int64_t *)p;
    case 4: return *(const uint8_t *)p;
    default: return *(const bool *)p;
  }
}
static void store(int dt, char *p, double v) {
  switch (dt) {
    case 0: *(float *)p = (float)v; break;
    case 1: *(double *)p = v; break;
    case 2: *(int32_t *)p = (int32_t)v; break;
    case 3: *(int64_t *)p = (int64_t)v; break;
    case 4: *(uint8_t *)p = (uint8_t)v; break;
    default: *(bool *)p = v != 0;
  }
}
static size_t esize(int dt) { return dt == 1 || dt == 3 ? 8 : dt == 0 || dt == 2 ? 4 : 1; }
static int64_t numel(int nd, const int64_t *size) {
  int64_t n = 1;
  for (int d = 0; d < nd; d++) n *= size[d];
  return n;
}
// the byte offset of linear element i over `size` with byte strides st
static int64_t offset(int64_t i, int nd, const int64_t *size, const int64_t *st) {
  int64_t o = 0;
  for (int d = nd - 1; d >= 0; d--) {
    o += (i % size[d]) * st[d];
    i /= size[d];
  }
  return o;
}

static const char *e_last_error(void) { return err; }
static int e_device_count(int *n) {
  *n = 1;
  return 0;
}
static int e_device_name(int, char *buf, size_t len) {
  snprintf(buf, len, "emulated (host memory)");
  return 0;
}
static int e_synchronize(int) { return 0; }
static int e_alloc(int, size_t n, void **p) {
  *p = malloc(n ? n : 1);
  return *p ? 0 : fail("memory left");
}
static void e_free(int, void *p) { free(p); }
static int e_copy(int, void *dst, const void *src, size_t n) {
  memcpy(dst, src, n);
  return 0;
}
static int e_d2d(int, void *dst, int, const void *src, size_t n) { return e_copy(0, dst, src, n); }
static int e_cast(int, int from, int to, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                  const int64_t *ast) {
  for (int64_t i = 0; i < numel(nd, size); i++)
    store(to, (char *)o + offset(i, nd, size, ost), load(from, (const char *)a + offset(i, nd, size, ast)));
  return 0;
}
static int e_fill(int, int dt, int nd, const int64_t *size, void *o, const int64_t *ost, double v) {
  for (int64_t i = 0; i < numel(nd, size); i++) store(dt, (char *)o + offset(i, nd, size, ost), v);
  return 0;
}
// rh_binop_t's order; comparisons write bool
static int e_binary(int, int op, int dt, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                    const int64_t *ast, const void *b, const int64_t *bst) {
  if (op > 12) return fail("remainder");
  for (int64_t i = 0; i < numel(nd, size); i++) {
    double x = load(dt, (const char *)a + offset(i, nd, size, ast)),
           y = load(dt, (const char *)b + offset(i, nd, size, bst));
    const double r[] = {x + y,
                        x - y,
                        x * y,
                        x / y,
                        pow(x, y),
                        fmax(x, y),
                        fmin(x, y),
                        (double)(x == y),
                        (double)(x != y),
                        (double)(x < y),
                        (double)(x <= y),
                        (double)(x > y),
                        (double)(x >= y)};
    store(op >= 7 ? 5 : dt, (char *)o + offset(i, nd, size, ost), r[op]);
  }
  return 0;
}
// rh_unop_t's first eight
static int e_unary(int, int op, int dt, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                   const int64_t *ast) {
  if (op > 7) return fail("unary op beyond abs");
  for (int64_t i = 0; i < numel(nd, size); i++) {
    double x = load(dt, (const char *)a + offset(i, nd, size, ast));
    const double r[] = {-x, exp(x), log(x), sqrt(x), x > 0 ? x : 0, tanh(x), 1 / (1 + exp(-x)), fabs(x)};
    store(dt, (char *)o + offset(i, nd, size, ost), r[op]);
  }
  return 0;
}
// sum (0) and mean (1) of float rows
static int e_reduce_rows(int, int op, int in, int out, int64_t rows, int64_t len, const void *a, void *o) {
  if (op > 1 || in > 1 || out != in) return fail("reduction but float sums and means");
  for (int64_t r = 0; r < rows; r++) {
    double s = 0;
    for (int64_t i = 0; i < len; i++) s += load(in, (const char *)a + (size_t)(r * len + i) * esize(in));
    store(out, (char *)o + (size_t)r * esize(out), op == 1 ? s / (double)len : s);
  }
  return 0;
}
static int e_softmax_rows(int, int dt, int log_, int64_t rows, int64_t len, const void *in, void *out) {
  size_t es = esize(dt);
  for (int64_t r = 0; r < rows; r++) {
    const char *x = (const char *)in + (size_t)(r * len) * es;
    char *y = (char *)out + (size_t)(r * len) * es;
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < len; i++) m = fmax(m, load(dt, x + i * es));
    for (int64_t i = 0; i < len; i++) s += exp(load(dt, x + i * es) - m);
    for (int64_t i = 0; i < len; i++)
      store(dt, y + i * es, log_ ? load(dt, x + i * es) - m - log(s) : exp(load(dt, x + i * es) - m) / s);
  }
  return 0;
}
// cuda_api.h's gemm: row-major, C's rows n apart
static int e_gemm(int, int dt, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, int64_t sa,
                  const void *b, int64_t ldb, int64_t sb, void *c, int64_t sc, int64_t batch) {
  if (dt > 1) return fail("integer GEMM");
  size_t es = esize(dt);
  for (int64_t z = 0; z < batch; z++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double s = 0;
        for (int64_t p = 0; p < k; p++)
          s += load(dt, (const char *)a + (size_t)(z * sa + (ta ? p * lda + i : i * lda + p)) * es) *
               load(dt, (const char *)b + (size_t)(z * sb + (tb ? j * ldb + p : p * ldb + j)) * es);
        store(dt, (char *)c + (size_t)(z * sc + i * n + j) * es, s);
      }
  return 0;
}

template <typename T>
static int columns(const rhc_window_t *g, int64_t n, void *image, void *cols, int to_image) {
  int64_t c = g->planes;
  if (to_image) k_col2im<T>(*g, c, n * c * g->h * g->w, (const T *)cols, (T *)image);
  else k_im2col<T>(*g, c, n * c * g->k[0] * g->k[1] * g->oh * g->ow, (const T *)image, (T *)cols);
  return 0;
}
static int e_nn_im2col(int, int dt, const rhc_window_t *g, int64_t n, void *image, void *cols, int to_image) {
  if (dt > 1) return fail("integer convolution");
  return dt == 0 ? columns<float>(g, n, image, cols, to_image) : columns<double>(g, n, image, cols, to_image);
}
template <typename T>
static int pooling(int op, const rhc_window_t *g, const void *in, void *out, int64_t *idx) {
  int64_t outputs = g->planes * g->oh * g->ow;
  if (op >= RHC_POOL_MAX_BACK) memset(out, 0, (size_t)(g->planes * g->h * g->w) * sizeof(T));
  if ((op == RHC_POOL_MAX || op == RHC_POOL_MAX_BACK) && !idx) return fail("max pooling without indices");
  if (op == RHC_POOL_MAX) k_max_pool<T>(*g, outputs, (const T *)in, (T *)out, idx);
  else if (op == RHC_POOL_MAX_BACK) k_max_pool_back<T>(*g, outputs, (const T *)in, idx, (T *)out);
  else k_avg_pool<T>(*g, op, outputs, (const T *)in, (T *)out);
  return 0;
}
static int e_nn_pool(int, int dt, int op, const rhc_window_t *g, const void *in, void *out, int64_t *idx) {
  if (dt > 1) return fail("integer pooling");
  return dt == 0 ? pooling<float>(op, g, in, out, idx) : pooling<double>(op, g, in, out, idx);
}

// kernels/norm.cu's entries, the same kernels on a one-thread grid
static int e_nn_batch_norm(int, int dt, int64_t n, int64_t c, int64_t inner, const void *x, const void *w,
                           const void *b, void *rm, void *rv, int training, double momentum, double eps, void *y,
                           double *mean, double *invstd) {
  if (dt > 1) return fail("integer batch norm");
  if (dt == 0) {
    k_bn_stats<float>(n, c, inner, (const float *)x, (float *)rm, (float *)rv, training, momentum, eps, mean, invstd);
    k_bn_apply<float>(n * c * inner, c, inner, (const float *)x, (const float *)w, (const float *)b, mean, invstd,
                      (float *)y);
  } else {
    k_bn_stats<double>(n, c, inner, (const double *)x, (double *)rm, (double *)rv, training, momentum, eps, mean,
                       invstd);
    k_bn_apply<double>(n * c * inner, c, inner, (const double *)x, (const double *)w, (const double *)b, mean, invstd,
                       (double *)y);
  }
  return 0;
}
template <typename T>
static int bn_back(int64_t n, int64_t c, int64_t inner, const void *gy, const void *x, const void *w,
                   const double *mean, const double *invstd, int training, void *gx, void *gw, void *gb) {
  double *sums = (double *)malloc((size_t)(2 * c + 1) * sizeof(double));
  if (!sums) return fail("memory left");
  k_bn_grad_sums<T>(n, c, inner, (const T *)gy, (const T *)x, mean, invstd, sums, (T *)gw, (T *)gb);
  if (gx)
    k_bn_grad_x<T>(n * c * inner, c, inner, n * inner, training, (const T *)gy, (const T *)x, (const T *)w, mean,
                   invstd, sums, (T *)gx);
  free(sums);
  return 0;
}
static int e_nn_batch_norm_backward(int, int dt, int64_t n, int64_t c, int64_t inner, const void *gy, const void *x,
                                    const void *w, const double *mean, const double *invstd, int training, void *gx,
                                    void *gw, void *gb) {
  if (dt > 1) return fail("integer batch norm");
  return dt == 0 ? bn_back<float>(n, c, inner, gy, x, w, mean, invstd, training, gx, gw, gb)
                 : bn_back<double>(n, c, inner, gy, x, w, mean, invstd, training, gx, gw, gb);
}
static int e_nn_layer_norm(int, int dt, int64_t rows, int64_t d, const void *x, const void *w, const void *b,
                           double eps, void *y, double *mean, double *rstd) {
  if (dt == 0)
    k_ln_forward<float>(rows, d, (const float *)x, (const float *)w, (const float *)b, eps, (float *)y, mean, rstd);
  else if (dt == 1)
    k_ln_forward<double>(rows, d, (const double *)x, (const double *)w, (const double *)b, eps, (double *)y, mean,
                         rstd);
  else return fail("integer layer norm");
  return 0;
}
template <typename T>
static int ln_back(int64_t rows, int64_t d, const void *gy, const void *x, const void *w, const double *mean,
                   const double *rstd, void *gx, void *gw, void *gb) {
  if (gx) k_ln_grad_x<T>(rows, d, (const T *)gy, (const T *)x, (const T *)w, mean, rstd, (T *)gx);
  if (gw || gb) k_ln_grad_wb<T>(rows, d, (const T *)gy, (const T *)x, mean, rstd, (T *)gw, (T *)gb);
  return 0;
}
static int e_nn_layer_norm_backward(int, int dt, int64_t rows, int64_t d, const void *gy, const void *x, const void *w,
                                    const double *mean, const double *rstd, void *gx, void *gw, void *gb) {
  if (dt > 1) return fail("integer layer norm");
  return dt == 0 ? ln_back<float>(rows, d, gy, x, w, mean, rstd, gx, gw, gb)
                 : ln_back<double>(rows, d, gy, x, w, mean, rstd, gx, gw, gb);
}
template <typename T>
static int sm_back(int log_, int64_t rows, int64_t len, const void *y, const void *g, void *gx) {
  k_softmax_back<T>(log_, rows, len, (const T *)y, (const T *)g, (T *)gx);
  return 0;
}
static int e_nn_softmax_backward(int, int dt, int log_, int64_t rows, int64_t len, const void *y, const void *g,
                                 void *gx) {
  if (dt > 1) return fail("integer softmax");
  return dt == 0 ? sm_back<float>(log_, rows, len, y, g, gx) : sm_back<double>(log_, rows, len, y, g, gx);
}
template <typename T>
static int lstm(int64_t b, int64_t hs, const void *gates, const void *cp, void *h, void *c, void *ws) {
  k_lstm_cell<T>(b * hs, hs, (const T *)gates, (const T *)cp, (T *)h, (T *)c, (T *)ws);
  return 0;
}
static int e_nn_lstm_cell(int, int dt, int64_t b, int64_t hs, const void *gates, const void *cp, void *h, void *c,
                          void *ws) {
  if (dt > 1) return fail("integer LSTM cell");
  return dt == 0 ? lstm<float>(b, hs, gates, cp, h, c, ws) : lstm<double>(b, hs, gates, cp, h, c, ws);
}
template <typename T>
static int lstm_back(int64_t b, int64_t hs, const void *gh, const void *gc, const void *cp, const void *ws, void *gg,
                     void *gp) {
  k_lstm_cell_back<T>(b * hs, hs, (const T *)gh, (const T *)gc, (const T *)cp, (const T *)ws, (T *)gg, (T *)gp);
  return 0;
}
static int e_nn_lstm_cell_backward(int, int dt, int64_t b, int64_t hs, const void *gh, const void *gc, const void *cp,
                                   const void *ws, void *gg, void *gp) {
  if (dt > 1) return fail("integer LSTM cell");
  return dt == 0 ? lstm_back<float>(b, hs, gh, gc, cp, ws, gg, gp) : lstm_back<double>(b, hs, gh, gc, cp, ws, gg, gp);
}

static rhc_api_t api;

extern "C" __attribute__((visibility("default"))) const rhc_api_t *rhc_get_api(int abi_version) {
  if (abi_version != RHC_ABI_VERSION) return nullptr;
  api.abi_version = RHC_ABI_VERSION;
  api.last_error = e_last_error;
  api.device_count = e_device_count;
  api.device_name = e_device_name;
  api.synchronize = e_synchronize;
  api.alloc = e_alloc;
  api.free = e_free;
  api.h2d = e_copy;
  api.d2h = e_copy;
  api.d2d = e_d2d;
  api.cast = e_cast;
  api.fill = e_fill;
  api.binary = e_binary;
  api.unary = e_unary;
  api.reduce_rows = e_reduce_rows;
  api.softmax_rows = e_softmax_rows;
  api.gemm = e_gemm;
  api.nn_im2col = e_nn_im2col;
  api.nn_pool = e_nn_pool;
  api.nn_batch_norm = e_nn_batch_norm;
  api.nn_batch_norm_backward = e_nn_batch_norm_backward;
  api.nn_layer_norm = e_nn_layer_norm;
  api.nn_layer_norm_backward = e_nn_layer_norm_backward;
  api.nn_softmax_backward = e_nn_softmax_backward;
  api.nn_lstm_cell = e_nn_lstm_cell;
  api.nn_lstm_cell_backward = e_nn_lstm_cell_backward;
  return &api;
}
