/* nn_norm.c: batch normalisation (forward and backward) for nn.BatchNorm1d/2d
 * in one pass per channel instead of a dozen whole-tensor ops: x is
 * [N, C, *] (contiguous here), statistics are per channel over N and the
 * trailing dims, channels are split over the thread pool. Training mode uses
 * the batch's mean and biased variance and updates the running statistics
 * (unbiased variance, PyTorch's momentum rule); eval mode uses the running ones.
 * The forward returns the per-channel mean and 1/sqrt(var + eps) it used, which
 * the backward takes back. */
#include <math.h>

#include "nn.h"
#include "tensor_internal.h"

typedef struct {
  rh_dtype_t dt;
  const char *x;
  char *y;
  const char *w, *b; /* may be NULL */
  char *rm, *rv;     /* running stats, may be NULL */
  double *mean, *invstd;
  int64_t n, c, inner;
  int training;
  double momentum, eps;
  /* backward */
  const char *gy;
  char *gx;
  double *gw, *gb;
} bn_job_t;

static double ld(rh_dtype_t dt, const char *p, int64_t i) {
  return dt == RH_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}
static void st(rh_dtype_t dt, char *p, int64_t i, double v) {
  if (dt == RH_F32) ((float *)p)[i] = (float)v;
  else ((double *)p)[i] = v;
}

static void bn_forward_channels(void *ctx, int64_t lo, int64_t hi) {
  bn_job_t *j = ctx;
  int64_t m = j->n * j->inner;
  for (int64_t ch = lo; ch < hi; ch++) {
    double mean, invstd;
    if (j->training) {
      double s = 0, ss = 0;
      for (int64_t k = 0; k < j->n; k++) {
        int64_t base = (k * j->c + ch) * j->inner;
        for (int64_t i = 0; i < j->inner; i++) s += ld(j->dt, j->x, base + i);
      }
      mean = s / (double)m;
      for (int64_t k = 0; k < j->n; k++) {
        int64_t base = (k * j->c + ch) * j->inner;
        for (int64_t i = 0; i < j->inner; i++) {
          double d = ld(j->dt, j->x, base + i) - mean;
          ss += d * d;
        }
      }
      double var = ss / (double)m;
      invstd = 1.0 / sqrt(var + j->eps);
      if (j->rm) {
        st(j->dt, j->rm, ch, (1 - j->momentum) * ld(j->dt, j->rm, ch) + j->momentum * mean);
        double unbiased = m > 1 ? ss / (double)(m - 1) : var;
        st(j->dt, j->rv, ch, (1 - j->momentum) * ld(j->dt, j->rv, ch) + j->momentum * unbiased);
      }
    } else {
      mean = ld(j->dt, j->rm, ch);
      invstd = 1.0 / sqrt(ld(j->dt, j->rv, ch) + j->eps);
    }
    j->mean[ch] = mean;
    j->invstd[ch] = invstd;
    double w = j->w ? ld(j->dt, j->w, ch) : 1, b = j->b ? ld(j->dt, j->b, ch) : 0;
    double scale = w * invstd, shift = b - mean * scale;
    for (int64_t k = 0; k < j->n; k++) {
      int64_t base = (k * j->c + ch) * j->inner;
      if (j->dt == RH_F32) {
        const float *xs = (const float *)j->x + base;
        float *ys = (float *)j->y + base;
        for (int64_t i = 0; i < j->inner; i++) ys[i] = (float)(xs[i] * scale + shift);
      } else {
        const double *xs = (const double *)j->x + base;
        double *ys = (double *)j->y + base;
        for (int64_t i = 0; i < j->inner; i++) ys[i] = xs[i] * scale + shift;
      }
    }
  }
}

static int64_t inner_of(const rh_tensor_t *x) {
  int64_t inner = 1;
  for (int d = 2; d < x->ndim; d++) inner *= x->size[d];
  return inner;
}

static int check_vec(const char *what, rh_tensor_t *v, rh_tensor_t *x) {
  if (!v) return 0;
  if (v->ndim != 1 || v->size[0] != x->size[1] || v->dtype != x->dtype || !rh_tensor_is_contiguous(v) ||
      RH_ON_DEVICE(v))
    return rh_tensor_fail("batch_norm: %s must be a contiguous host %s vector of %lld elements", what,
                          rh_dtype_name(x->dtype), (long long)x->size[1]);
  return 0;
}

int rh_nn_batch_norm(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, rh_tensor_t *rm, rh_tensor_t *rv, int training,
                     double momentum, double eps, rh_tensor_t **y, rh_tensor_t **mean, rh_tensor_t **invstd) {
  *y = *mean = *invstd = NULL;
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("batch_norm: expected a float32 or float64 input, got %s", rh_dtype_name(x->dtype));
  if (x->ndim < 2 || RH_ON_DEVICE(x)) return rh_tensor_fail("batch_norm: expected a host tensor [N, C, *]");
  if (check_vec("weight", w, x) || check_vec("bias", b, x) || check_vec("running_mean", rm, x) ||
      check_vec("running_var", rv, x))
    return -1;
  if ((rm == NULL) != (rv == NULL)) return rh_tensor_fail("batch_norm: give both running statistics or neither");
  if (!training && !rm) return rh_tensor_fail("batch_norm: evaluation needs the running statistics");
  int64_t c = x->size[1];
  rh_tensor_t *xc = rh_tensor_contiguous(x);
  rh_tensor_t *ty = rh_tensor_empty(x->dtype, x->ndim, x->size);
  rh_tensor_t *tm = rh_tensor_empty(RH_F64, 1, &c), *ti = rh_tensor_empty(RH_F64, 1, &c);
  if (!xc || !ty || !tm || !ti) {
    rh_tensor_t *all[] = {xc, ty, tm, ti};
    for (int i = 0; i < 4; i++)
      if (all[i]) rh_tensor_release(all[i]);
    return rh_tensor_fail("batch_norm: out of memory");
  }
  bn_job_t j = {x->dtype, rh_tensor_data(xc), rh_tensor_data(ty), w ? rh_tensor_data(w) : NULL,
                b ? rh_tensor_data(b) : NULL, rm ? rh_tensor_data(rm) : NULL, rv ? rh_tensor_data(rv) : NULL,
                rh_tensor_data(tm), rh_tensor_data(ti), x->size[0], c, inner_of(x), training, momentum, eps,
                NULL, NULL, NULL, NULL};
  rh_parallel_for(c, 1, bn_forward_channels, &j);
  if (training && rm) {
    rh_tensor_bump_version(rm);
    rh_tensor_bump_version(rv);
  }
  rh_tensor_release(xc);
  *y = ty;
  *mean = tm;
  *invstd = ti;
  return 0;
}

static void bn_backward_channels(void *ctx, int64_t lo, int64_t hi) {
  bn_job_t *j = ctx;
  int64_t m = j->n * j->inner;
  for (int64_t ch = lo; ch < hi; ch++) {
    double mean = j->mean[ch], invstd = j->invstd[ch];
    double w = j->w ? ld(j->dt, j->w, ch) : 1;
    double sg = 0, sgx = 0; /* sum gy, sum gy * xhat */
    for (int64_t k = 0; k < j->n; k++) {
      int64_t base = (k * j->c + ch) * j->inner;
      for (int64_t i = 0; i < j->inner; i++) {
        double g = ld(j->dt, j->gy, base + i);
        sg += g;
        sgx += g * (ld(j->dt, j->x, base + i) - mean) * invstd;
      }
    }
    if (j->gw) j->gw[ch] = sgx;
    if (j->gb) j->gb[ch] = sg;
    if (!j->gx) continue;
    for (int64_t k = 0; k < j->n; k++) {
      int64_t base = (k * j->c + ch) * j->inner;
      for (int64_t i = 0; i < j->inner; i++) {
        double g = ld(j->dt, j->gy, base + i);
        double v;
        if (j->training) {
          double xhat = (ld(j->dt, j->x, base + i) - mean) * invstd;
          v = w * invstd * (g - sg / (double)m - xhat * sgx / (double)m);
        } else {
          v = w * invstd * g;
        }
        st(j->dt, j->gx, base + i, v);
      }
    }
  }
}

int rh_nn_batch_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *mean,
                              rh_tensor_t *invstd, int training, rh_tensor_t **gx, rh_tensor_t **gw,
                              rh_tensor_t **gb) {
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (gy->dtype != x->dtype || gy->ndim != x->ndim || RH_ON_DEVICE(gy))
    return rh_tensor_fail("batch_norm backward: the gradient must match the input");
  for (int d = 0; d < x->ndim; d++)
    if (gy->size[d] != x->size[d]) return rh_tensor_fail("batch_norm backward: the gradient must match the input");
  if (check_vec("weight", w, x)) return -1;
  int64_t c = x->size[1];
  if (mean->dtype != RH_F64 || invstd->dtype != RH_F64 || mean->ndim != 1 || mean->size[0] != c ||
      invstd->ndim != 1 || invstd->size[0] != c)
    return rh_tensor_fail("batch_norm backward: the saved statistics do not match the input");
  rh_tensor_t *xc = rh_tensor_contiguous(x), *gc = rh_tensor_contiguous(gy);
  rh_tensor_t *tx = gx ? rh_tensor_empty(x->dtype, x->ndim, x->size) : NULL;
  rh_tensor_t *tw = gw ? rh_tensor_empty(RH_F64, 1, &c) : NULL, *tb = gb ? rh_tensor_empty(RH_F64, 1, &c) : NULL;
  if (!xc || !gc || (gx && !tx) || (gw && !tw) || (gb && !tb)) {
    rh_tensor_t *all[] = {xc, gc, tx, tw, tb};
    for (int i = 0; i < 5; i++)
      if (all[i]) rh_tensor_release(all[i]);
    return rh_tensor_fail("batch_norm backward: out of memory");
  }
  bn_job_t j = {x->dtype, rh_tensor_data(xc), NULL, w ? rh_tensor_data(w) : NULL, NULL, NULL, NULL,
                rh_tensor_data(mean), rh_tensor_data(invstd), x->size[0], c, inner_of(x), training, 0, 0,
                rh_tensor_data(gc), tx ? rh_tensor_data(tx) : NULL, tw ? rh_tensor_data(tw) : NULL,
                tb ? rh_tensor_data(tb) : NULL};
  rh_parallel_for(c, 1, bn_backward_channels, &j);
  rh_tensor_release(xc);
  rh_tensor_release(gc);
  /* parameter gradients in the input's dtype */
  if (tw) {
    *gw = rh_tensor_cast(tw, x->dtype);
    rh_tensor_release(tw);
  }
  if (tb) {
    *gb = rh_tensor_cast(tb, x->dtype);
    rh_tensor_release(tb);
  }
  if (gx) *gx = tx;
  return 0;
}
