/* nn_cuda_norm.c: batch norm, layer norm, last-dimension softmax and the LSTM
 * cell's pointwise part for tensors on a CUDA device: nn.h's contract (as
 * nn_norm.c, nn_softmax.c, nn_rnn.c on the host), run by kernels/norm.cu with
 * nothing copied through the host. Checks shapes, makes operands contiguous,
 * allocates the results on the input's device and calls one entry point each. */
#include <string.h>

#include "nn_cuda.h"
#include "tensor/tensor_internal.h"

static void *data_or_null(rh_tensor_t *t) { return t ? rh_tensor_data(t) : NULL; }

/* v (optional) a contiguous vector of n elements beside x, in x's dtype */
static int vec(const char *what, const char *name, rh_tensor_t *v, rh_tensor_t *x, int64_t n) {
  if (!v) return 0;
  if (rh__nn_on_device(what, x, v)) return -1;
  if (rh_tensor_numel(v) != n || !rh_tensor_is_contiguous(v))
    return rh_tensor_fail("%s: %s must be a contiguous tensor of %lld elements", what, name, (long long)n);
  return 0;
}

/* float64 statistics of n elements on x's device (the forward's mean and 1/std) */
static int stats(const char *what, rh_tensor_t *s, rh_tensor_t *x, int64_t n) {
  if (s->dtype != RH_F64 || rh_tensor_numel(s) != n || !rh_tensor_is_contiguous(s) ||
      rh_tensor_device(s) != rh_tensor_device(x))
    return rh_tensor_fail("%s: the saved statistics must be %lld float64 elements on the input's device", what,
                          (long long)n);
  return 0;
}

static int same_shape(const char *what, rh_tensor_t *a, rh_tensor_t *b) {
  if (rh__nn_on_device(what, a, b)) return -1;
  if (a->ndim != b->ndim || memcmp(a->size, b->size, sizeof(int64_t) * (size_t)a->ndim))
    return rh_tensor_fail("%s: the gradient must have the input's shape", what);
  return 0;
}

static int64_t inner_of(const rh_tensor_t *x) {
  int64_t inner = 1;
  for (int d = 2; d < x->ndim; d++) inner *= x->size[d];
  return inner;
}

/* a norm backward's buffers: t[0], t[1] gy and x made contiguous, t[2..4] the
 * wanted gradients gx (x's shape) and gw, gb (n elements); 0 when all are there */
static int grad_buffers(rh_tensor_t **t, rh_tensor_t *gy, rh_tensor_t *x, int64_t n, int want_x, int want_w,
                        int want_b) {
  int dev = rh_tensor_device(x);
  t[0] = rh_tensor_contiguous(gy), t[1] = rh_tensor_contiguous(x);
  t[2] = want_x ? rh_tensor_empty_on(dev, x->dtype, x->ndim, x->size) : NULL;
  t[3] = want_w ? rh_tensor_empty_on(dev, x->dtype, 1, &n) : NULL;
  t[4] = want_b ? rh_tensor_empty_on(dev, x->dtype, 1, &n) : NULL;
  return t[0] && t[1] && (!want_x || t[2]) && (!want_w || t[3]) && (!want_b || t[4]) ? 0 : -1;
}

/* hands t[2..4] to the wanted outputs after the kernel's rc, releases the rest */
static int grads_out(rh_tensor_t **t, int rc, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb) {
  if (rc) {
    rh__nn_release(t, 5);
    return -1;
  }
  if (gx) *gx = t[2];
  if (gw) *gw = t[3];
  if (gb) *gb = t[4];
  rh__nn_release(t, 2);
  return 0;
}

/* ---- batch norm */
int rh_nn_cuda_batch_norm(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, rh_tensor_t *rm, rh_tensor_t *rv,
                          int training, double momentum, double eps, rh_tensor_t **y, rh_tensor_t **mean,
                          rh_tensor_t **invstd) {
  const char *what = "batch_norm";
  *y = *mean = *invstd = NULL;
  if (rh__nn_on_device(what, x, NULL)) return -1;
  if (x->ndim < 2) return rh_tensor_fail("%s: expected a tensor [N, C, *]", what);
  int64_t c = x->size[1];
  if (vec(what, "weight", w, x, c) || vec(what, "bias", b, x, c) || vec(what, "running_mean", rm, x, c) ||
      vec(what, "running_var", rv, x, c))
    return -1;
  if ((rm == NULL) != (rv == NULL)) return rh_tensor_fail("%s: give both running statistics or neither", what);
  if (!training && !rm) return rh_tensor_fail("%s: evaluation needs the running statistics", what);
  int dev = rh_tensor_device(x);
  rh_tensor_t *t[4] = {rh_tensor_contiguous(x), rh_tensor_empty_on(dev, x->dtype, x->ndim, x->size),
                       rh_tensor_empty_on(dev, RH_F64, 1, &c), rh_tensor_empty_on(dev, RH_F64, 1, &c)};
  int rc = t[0] && t[1] && t[2] && t[3] ? 0 : -1;
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_batch_norm(dev, x->dtype, x->size[0], c, inner_of(x), rh_tensor_data(t[0]),
                                                    data_or_null(w), data_or_null(b), data_or_null(rm),
                                                    data_or_null(rv), training, momentum, eps, rh_tensor_data(t[1]),
                                                    rh_tensor_data(t[2]), rh_tensor_data(t[3])));
  if (rc) {
    rh__nn_release(t, 4);
    return -1;
  }
  if (training && rm) {
    rh_tensor_bump_version(rm);
    rh_tensor_bump_version(rv);
  }
  *y = t[1], *mean = t[2], *invstd = t[3];
  rh_tensor_release(t[0]);
  return 0;
}

int rh_nn_cuda_batch_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *mean,
                                   rh_tensor_t *invstd, int training, rh_tensor_t **gx, rh_tensor_t **gw,
                                   rh_tensor_t **gb) {
  const char *what = "batch_norm backward";
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (same_shape(what, x, gy)) return -1;
  if (x->ndim < 2) return rh_tensor_fail("%s: expected a tensor [N, C, *]", what);
  int64_t c = x->size[1];
  if (vec(what, "weight", w, x, c) || stats(what, mean, x, c) || stats(what, invstd, x, c)) return -1;
  rh_tensor_t *t[5];
  int rc = grad_buffers(t, gy, x, c, gx != NULL, gw != NULL, gb != NULL);
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_batch_norm_backward(
        rh_tensor_device(x), x->dtype, x->size[0], c, inner_of(x), rh_tensor_data(t[0]), rh_tensor_data(t[1]),
        data_or_null(w), rh_tensor_data(mean), rh_tensor_data(invstd), training, data_or_null(t[2]), data_or_null(t[3]),
        data_or_null(t[4])));
  return grads_out(t, rc, gx, gw, gb);
}

/* ---- layer norm */
static int rows_of(const char *what, rh_tensor_t *x, int64_t d, int64_t *rows) {
  int64_t n = rh_tensor_numel(x);
  if (d < 1 || n % d) return rh_tensor_fail("%s: %lld elements are not rows of %lld", what, (long long)n, (long long)d);
  *rows = n / d;
  return 0;
}

int rh_nn_cuda_layer_norm(rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *b, double eps, rh_tensor_t **y,
                          rh_tensor_t **mean, rh_tensor_t **rstd) {
  const char *what = "layer_norm";
  int64_t rows = 0;
  *y = *mean = *rstd = NULL;
  if (rh__nn_on_device(what, x, NULL) || rows_of(what, x, d, &rows) || vec(what, "weight", w, x, d) ||
      vec(what, "bias", b, x, d))
    return -1;
  int dev = rh_tensor_device(x);
  rh_tensor_t *t[4] = {rh_tensor_contiguous(x), rh_tensor_empty_on(dev, x->dtype, x->ndim, x->size),
                       rh_tensor_empty_on(dev, RH_F64, 1, &rows), rh_tensor_empty_on(dev, RH_F64, 1, &rows)};
  int rc = t[0] && t[1] && t[2] && t[3] ? 0 : -1;
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_layer_norm(dev, x->dtype, rows, d, rh_tensor_data(t[0]), data_or_null(w),
                                                    data_or_null(b), eps, rh_tensor_data(t[1]), rh_tensor_data(t[2]),
                                                    rh_tensor_data(t[3])));
  if (rc) {
    rh__nn_release(t, 4);
    return -1;
  }
  *y = t[1], *mean = t[2], *rstd = t[3];
  rh_tensor_release(t[0]);
  return 0;
}

int rh_nn_cuda_layer_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *mean,
                                   rh_tensor_t *rstd, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb) {
  const char *what = "layer_norm backward";
  int64_t rows = 0;
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (same_shape(what, x, gy) || rows_of(what, x, d, &rows) || vec(what, "weight", w, x, d) ||
      stats(what, mean, x, rows) || stats(what, rstd, x, rows))
    return -1;
  rh_tensor_t *t[5];
  int rc = grad_buffers(t, gy, x, d, gx != NULL, gw != NULL, gb != NULL);
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_layer_norm_backward(
        rh_tensor_device(x), x->dtype, rows, d, rh_tensor_data(t[0]), rh_tensor_data(t[1]), data_or_null(w),
        rh_tensor_data(mean), rh_tensor_data(rstd), data_or_null(t[2]), data_or_null(t[3]), data_or_null(t[4])));
  return grads_out(t, rc, gx, gw, gb);
}

/* ---- softmax over the last dimension */
static int last_dim(const char *what, rh_tensor_t *x) {
  if (rh__nn_on_device(what, x, NULL)) return -1;
  if (x->ndim < 1 || x->size[x->ndim - 1] < 1) return rh_tensor_fail("%s: expected a non-empty last dimension", what);
  return 0;
}

/* the forward is the tensor core's (kernels/reduce.cu's softmax_rows) */
rh_tensor_t *rh_nn_cuda_softmax(rh_tensor_t *x, int log_) {
  if (last_dim(log_ ? "log_softmax" : "softmax", x)) return NULL;
  return rh_tensor_softmax(x, x->ndim - 1, log_);
}

rh_tensor_t *rh_nn_cuda_softmax_backward(rh_tensor_t *y, rh_tensor_t *g, int log_) {
  const char *what = log_ ? "log_softmax backward" : "softmax backward";
  if (last_dim(what, y) || same_shape(what, y, g)) return NULL;
  int dev = rh_tensor_device(y);
  int64_t len = y->size[y->ndim - 1];
  rh_tensor_t *t[3] = {rh_tensor_contiguous(y), rh_tensor_contiguous(g),
                       rh_tensor_empty_on(dev, y->dtype, y->ndim, y->size)};
  int rc = t[0] && t[1] && t[2] ? 0 : -1;
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_softmax_backward(dev, y->dtype, log_, rh_tensor_numel(y) / len, len,
                                                          rh_tensor_data(t[0]), rh_tensor_data(t[1]),
                                                          rh_tensor_data(t[2])));
  rh_tensor_t *gx = rc == 0 ? t[2] : NULL;
  if (rc == 0) t[2] = NULL;
  rh__nn_release(t, 3);
  return gx;
}

/* ---- the LSTM cell */
/* a [B, cols_a] and b [B, cols_b] on one device, in one float dtype */
static int pair(const char *what, rh_tensor_t *a, int64_t cols_a, rh_tensor_t *b, int64_t cols_b) {
  if (rh__nn_on_device(what, a, b)) return -1;
  if (a->ndim != 2 || b->ndim != 2 || a->size[1] != cols_a || b->size[1] != cols_b || a->size[0] != b->size[0])
    return rh_tensor_fail("%s: expected [B, %lld] and [B, %lld] tensors", what, (long long)cols_a, (long long)cols_b);
  return 0;
}

int rh_nn_cuda_lstm_cell(rh_tensor_t *gates, rh_tensor_t *c_prev, rh_tensor_t **h, rh_tensor_t **c, rh_tensor_t **ws) {
  *h = *c = *ws = NULL;
  int64_t hs = c_prev->ndim == 2 ? c_prev->size[1] : 0;
  if (pair("lstm_cell", gates, 4 * hs, c_prev, hs)) return -1;
  int dev = rh_tensor_device(gates);
  int64_t b = c_prev->size[0];
  rh_tensor_t *t[5] = {rh_tensor_contiguous(gates), rh_tensor_contiguous(c_prev),
                       rh_tensor_empty_on(dev, gates->dtype, 2, (int64_t[]){b, hs}),
                       rh_tensor_empty_on(dev, gates->dtype, 2, (int64_t[]){b, hs}),
                       rh_tensor_empty_on(dev, gates->dtype, 2, (int64_t[]){b, 5 * hs})};
  int rc = t[0] && t[1] && t[2] && t[3] && t[4] ? 0 : -1;
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_lstm_cell(dev, gates->dtype, b, hs, rh_tensor_data(t[0]), rh_tensor_data(t[1]),
                                                   rh_tensor_data(t[2]), rh_tensor_data(t[3]), rh_tensor_data(t[4])));
  if (rc) {
    rh__nn_release(t, 5);
    return -1;
  }
  *h = t[2], *c = t[3], *ws = t[4];
  rh__nn_release(t, 2);
  return 0;
}

int rh_nn_cuda_lstm_cell_backward(rh_tensor_t *gh, rh_tensor_t *gc, rh_tensor_t *c_prev, rh_tensor_t *ws,
                                  rh_tensor_t **ggates, rh_tensor_t **gc_prev) {
  const char *what = "lstm_cell backward";
  *ggates = *gc_prev = NULL;
  int64_t hs = c_prev->ndim == 2 ? c_prev->size[1] : 0;
  if (pair(what, ws, 5 * hs, c_prev, hs) || (gh && pair(what, gh, hs, c_prev, hs)) ||
      (gc && pair(what, gc, hs, c_prev, hs)))
    return -1;
  int dev = rh_tensor_device(ws);
  int64_t b = c_prev->size[0];
  rh_tensor_t *t[6] = {gh ? rh_tensor_contiguous(gh) : NULL,
                       gc ? rh_tensor_contiguous(gc) : NULL,
                       rh_tensor_contiguous(c_prev),
                       rh_tensor_contiguous(ws),
                       rh_tensor_empty_on(dev, ws->dtype, 2, (int64_t[]){b, 4 * hs}),
                       rh_tensor_empty_on(dev, ws->dtype, 2, (int64_t[]){b, hs})};
  int rc = (!gh || t[0]) && (!gc || t[1]) && t[2] && t[3] && t[4] && t[5] ? 0 : -1;
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_lstm_cell_backward(
        dev, ws->dtype, b, hs, data_or_null(t[0]), data_or_null(t[1]), rh_tensor_data(t[2]), rh_tensor_data(t[3]),
        rh_tensor_data(t[4]), rh_tensor_data(t[5])));
  if (rc) {
    rh__nn_release(t, 6);
    return -1;
  }
  *ggates = t[4], *gc_prev = t[5];
  rh__nn_release(t, 4);
  return 0;
}
