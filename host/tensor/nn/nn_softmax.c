/* nn_softmax.c: softmax and log-softmax over the last dimension (forward and
 * backward) for nn.functional, in the input's float dtype, rows split over the
 * thread pool. The tensor method (reduce.c) takes any dimension and computes in
 * float64 (a cast in, exp twice per element, a cast back); attention's scores
 * ([N*h, T, S], softmax over S) spent a fifth of a TransformerEncoderLayer's
 * non-GEMM time there, and its backward was four whole-tensor ops. */
#include <string.h>
#include <tgmath.h> /* exp and log of a float are expf and logf */

#include "nn.h"
#include "tensor/tensor_internal.h"

typedef struct {
  rh_dtype_t dt;
  const char *x, *g; /* forward: x; backward: y (the forward's result) and g */
  char *y;
  int64_t len;
  int log_;
} sm_job_t;

#define SOFTMAX_ROWS(T)                                                             \
  do {                                                                              \
    for (int64_t r = lo; r < hi; r++) {                                             \
      const T *x = (const T *)j->x + r * j->len;                                    \
      T *y = (T *)j->y + r * j->len, m = x[0];                                      \
      for (int64_t i = 1; i < j->len; i++) m = x[i] > m || x[i] != x[i] ? x[i] : m; \
      double s = 0;                                                                 \
      if (j->log_) {                                                                \
        for (int64_t i = 0; i < j->len; i++) s += (double)exp(x[i] - m);            \
        T ls = (T)log(s);                                                           \
        for (int64_t i = 0; i < j->len; i++) y[i] = x[i] - m - ls;                  \
      } else {                                                                      \
        for (int64_t i = 0; i < j->len; i++) {                                      \
          y[i] = exp(x[i] - m);                                                     \
          s += (double)y[i];                                                        \
        }                                                                           \
        T inv = (T)(1.0 / s);                                                       \
        for (int64_t i = 0; i < j->len; i++) y[i] *= inv;                           \
      }                                                                             \
    }                                                                               \
  } while (0)

static void softmax_rows(void *ctx, int64_t lo, int64_t hi) {
  sm_job_t *j = ctx;
  if (j->dt == RH_F32) SOFTMAX_ROWS(float);
  else SOFTMAX_ROWS(double);
}

/* softmax: gx = y * (g - sum(g * y)); log-softmax: gx = g - exp(y) * sum(g) */
#define SOFTMAX_BACK_ROWS(T)                                                        \
  do {                                                                              \
    for (int64_t r = lo; r < hi; r++) {                                             \
      const T *y = (const T *)j->x + r * j->len, *g = (const T *)j->g + r * j->len; \
      T *o = (T *)j->y + r * j->len;                                                \
      double s = 0;                                                                 \
      if (j->log_) {                                                                \
        for (int64_t i = 0; i < j->len; i++) s += (double)g[i];                     \
        T ts = (T)s;                                                                \
        for (int64_t i = 0; i < j->len; i++) o[i] = g[i] - exp(y[i]) * ts;          \
      } else {                                                                      \
        for (int64_t i = 0; i < j->len; i++) s += (double)g[i] * (double)y[i];      \
        T ts = (T)s;                                                                \
        for (int64_t i = 0; i < j->len; i++) o[i] = y[i] * (g[i] - ts);             \
      }                                                                             \
    }                                                                               \
  } while (0)

static void softmax_back_rows(void *ctx, int64_t lo, int64_t hi) {
  sm_job_t *j = ctx;
  if (j->dt == RH_F32) SOFTMAX_BACK_ROWS(float);
  else SOFTMAX_BACK_ROWS(double);
}

static int check(const char *what, rh_tensor_t *x) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("%s: expected a float32 or float64 tensor, got %s", what, rh_dtype_name(x->dtype));
  if (RH_ON_DEVICE(x)) return rh_tensor_fail("%s: the C kernel takes host tensors", what);
  if (x->ndim < 1 || x->size[x->ndim - 1] < 1) return rh_tensor_fail("%s: expected a non-empty last dimension", what);
  return 0;
}

/* runs a job over x's rows: out is a new tensor of x's shape */
static rh_tensor_t *run(const char *what, rh_tensor_t *x, rh_tensor_t *g, int log_,
                        void (*fn)(void *, int64_t, int64_t)) {
  if (check(what, x) || (g && check(what, g))) return NULL;
  if (g && (g->dtype != x->dtype || rh_tensor_numel(g) != rh_tensor_numel(x))) {
    rh_tensor_fail("%s: the gradient must match the output", what);
    return NULL;
  }
  rh_tensor_t *xc = rh_tensor_contiguous(x), *gc = g ? rh_tensor_contiguous(g) : NULL;
  rh_tensor_t *y = rh_tensor_empty(x->dtype, x->ndim, x->size);
  if (!xc || (g && !gc) || !y) {
    rh_tensor_release(xc);
    rh_tensor_release(gc);
    rh_tensor_release(y);
    rh_tensor_fail("%s: out of memory", what);
    return NULL;
  }
  int64_t len = x->size[x->ndim - 1];
  sm_job_t j = {x->dtype, rh_tensor_data(xc), gc ? rh_tensor_data(gc) : NULL, rh_tensor_data(y), len, log_};
  rh_parallel_for(rh_tensor_numel(x) / len, 1 + 4096 / len, fn, &j);
  rh_tensor_release(xc);
  rh_tensor_release(gc);
  return y;
}

rh_tensor_t *rh_nn_softmax(rh_tensor_t *x, int log_) {
  return run(log_ ? "log_softmax" : "softmax", x, NULL, log_, softmax_rows);
}

rh_tensor_t *rh_nn_softmax_backward(rh_tensor_t *y, rh_tensor_t *g, int log_) {
  return run(log_ ? "log_softmax backward" : "softmax backward", y, g, log_, softmax_back_rows);
}
