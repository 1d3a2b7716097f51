/* nn_norm.c: batch normalisation (nn.BatchNorm1d/2d) and layer normalisation
 * (nn.LayerNorm), forward and backward, each in two passes over the data
 * instead of a dozen whole-tensor ops (and their saved intermediates).
 * Batch norm: x is [N, C, *] (contiguous here), statistics are per channel over
 * N and the trailing dims, channels are split over the thread pool. Training
 * mode uses the batch's mean and biased variance and updates the running
 * statistics (unbiased variance, PyTorch's momentum rule); eval mode uses the
 * running ones. The forward returns the per-channel mean and 1/sqrt(var + eps)
 * it used, which the backward takes back. Layer norm: x is [M, D] rows
 * normalised each over its D elements, rows split over the pool; the
 * per-row mean and 1/sqrt(var + eps) go to the backward likewise. Sums run
 * in vector lanes of the input's dtype, folded into double per block (below). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn.h"
#include "tensor/tensor_internal.h"

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

/* Channel sums. For each channel: s1 = sum(u - ku), s2 = sum((u - ku) * (v - kv))
 * over its N segments of `inner` elements (forward: u = v = x shifted by the
 * channel's first element; backward: u = g, v = x shifted by the mean). In the
 * input's dtype, in 16 independent lanes that vectorize, folded into double
 * every BN_BLOCK elements (a float lane sums at most BN_BLOCK / 16 terms), so
 * float32 statistics keep double accuracy at the block level. A channel whose
 * segments are short (ResNet's late stages: 2x2..8x8 maps) was per-call
 * overhead; there a chunk of channels is summed a whole row of the batch at a
 * time instead, lane j being element j of the chunk (rows: samples). */
#define BN_BLOCK 256
#define BN_ROW_INNER 16  /* segments shorter than this are summed by rows */
#define BN_ROW_WIDTH 512 /* elements of a row chunk */

/* out[i] = a * u[i] + b * v[i] + c over n contiguous elements (v may be NULL);
 * float32 in float32 arithmetic, which vectorises */
#define AXPBY(T)                                                         \
  do {                                                                   \
    T *o = (T *)op;                                                      \
    const T *u = (const T *)up, *v = (const T *)vp;                      \
    T ta = (T)a, tb = (T)b, tc = (T)c;                                   \
    if (v)                                                               \
      for (int64_t i = 0; i < n; i++) o[i] = ta * u[i] + tb * v[i] + tc; \
    else                                                                 \
      for (int64_t i = 0; i < n; i++) o[i] = ta * u[i] + tc;             \
  } while (0)
RH_VEC_CLONES static void axpby(rh_dtype_t dt, char *op, const char *up, const char *vp, int64_t n, double a, double b,
                                double c) {
  if (dt == RH_F32) AXPBY(float);
  else AXPBY(double);
}

/* the segment form: nseg segments of len elements `stride` apart, summed in
 * lanes (GCC vectors of 64 bytes: explicit, since the compiler leaves a lane
 * array in scalar registers) that run on across segments (a short segment is
 * not a fold of its own) */
typedef float bn_vf __attribute__((vector_size(64)));
typedef double bn_vd __attribute__((vector_size(64)));
#define SEG_SUMS_FN(NAME, T, VT)                                                                                \
  RH_VEC_CLONES static void NAME(const T *u, const T *v, int64_t nseg, int64_t len, int64_t stride, T ku, T kv, \
                                 double *s1, double *s2) {                                                      \
    enum { NL = sizeof(VT) / sizeof(T) };                                                                       \
    VT a = {0}, q = {0}, vku = a + ku, vkv = a + kv;                                                            \
    T ta = 0, tq = 0;                                                                                           \
    int64_t held = 0; /* terms in the lanes since the last fold */                                              \
    double sa = 0, sq = 0;                                                                                      \
    for (int64_t sg = 0; sg < nseg; sg++) {                                                                     \
      const T *us = u + sg * stride, *vs = v + sg * stride;                                                     \
      for (int64_t i0 = 0; i0 < len; i0 += BN_BLOCK) {                                                          \
        int64_t e = len - i0 < BN_BLOCK ? len : i0 + BN_BLOCK, i = i0;                                          \
        for (; i + NL <= e; i += NL) {                                                                          \
          VT x, y;                                                                                              \
          memcpy(&x, us + i, sizeof x);                                                                         \
          memcpy(&y, vs + i, sizeof y);                                                                         \
          x -= vku;                                                                                             \
          a += x, q += x * (y - vkv);                                                                           \
        }                                                                                                       \
        for (; i < e; i++) {                                                                                    \
          T du = us[i] - ku;                                                                                    \
          ta += du, tq += du * (vs[i] - kv);                                                                    \
        }                                                                                                       \
        held += e - i0;                                                                                         \
        if (held >= BN_BLOCK) {                                                                                 \
          for (int k = 0; k < NL; k++) sa += (double)a[k], sq += (double)q[k];                                  \
          sa += (double)ta, sq += (double)tq;                                                                   \
          a -= a, q -= q, ta = tq = 0;                                                                          \
          held = 0;                                                                                             \
        }                                                                                                       \
      }                                                                                                         \
    }                                                                                                           \
    for (int k = 0; k < NL; k++) sa += (double)a[k], sq += (double)q[k];                                        \
    *s1 = sa + (double)ta, *s2 = sq + (double)tq;                                                               \
  }
SEG_SUMS_FN(seg_sums_f32, float, bn_vf)
SEG_SUMS_FN(seg_sums_f64, double, bn_vd)

/* the row form: rows of w elements `stride` apart; ku, kv per element; the
 * per-element sums (double) into d1, d2 */
#define ROW_SUMS_FN(NAME, T)                                                                      \
  RH_VEC_CLONES static void NAME(const T *u, const T *v, int64_t rows, int64_t stride, int64_t w, \
                                 const T *restrict ku, const T *restrict kv, double *restrict d1, \
                                 double *restrict d2) {                                           \
    T a[BN_ROW_WIDTH], q[BN_ROW_WIDTH];                                                           \
    for (int64_t j = 0; j < w; j++) d1[j] = d2[j] = 0;                                            \
    for (int64_t r0 = 0; r0 < rows; r0 += BN_BLOCK / 16) {                                        \
      int64_t re = rows - r0 < BN_BLOCK / 16 ? rows : r0 + BN_BLOCK / 16;                         \
      for (int64_t j = 0; j < w; j++) a[j] = q[j] = 0;                                            \
      for (int64_t r = r0; r < re; r++) {                                                         \
        const T *restrict ur = u + r * stride, *restrict vr = v + r * stride;                     \
        for (int64_t j = 0; j < w; j++) {                                                         \
          T du = ur[j] - ku[j];                                                                   \
          a[j] += du, q[j] += du * (vr[j] - kv[j]);                                               \
        }                                                                                         \
      }                                                                                           \
      for (int64_t j = 0; j < w; j++) d1[j] += (double)a[j], d2[j] += (double)q[j];               \
    }                                                                                             \
  }
ROW_SUMS_FN(row_sums_f32, float)
ROW_SUMS_FN(row_sums_f64, double)

/* out = A * u + B * v + C elementwise over rows of w elements `stride` apart
 * (A, B, C per element; v may be NULL) */
#define ROW_AFFINE_FN(NAME, T)                                                                          \
  RH_VEC_CLONES static void NAME(T *o, const T *u, const T *v, int64_t rows, int64_t stride, int64_t w, \
                                 const T *restrict A, const T *restrict B, const T *restrict C) {       \
    for (int64_t r = 0; r < rows; r++) {                                                                \
      T *restrict orow = o + r * stride;                                                                \
      const T *restrict ur = u + r * stride;                                                            \
      if (v) {                                                                                          \
        const T *restrict vr = v + r * stride;                                                          \
        for (int64_t j = 0; j < w; j++) orow[j] = A[j] * ur[j] + B[j] * vr[j] + C[j];                   \
      } else                                                                                            \
        for (int64_t j = 0; j < w; j++) orow[j] = A[j] * ur[j] + C[j];                                  \
    }                                                                                                   \
  }
ROW_AFFINE_FN(row_affine_f32, float)
ROW_AFFINE_FN(row_affine_f64, double)

/* channels [c0, c1) of u, v ([N, C, inner]): s1, s2 per channel (indexed from c0) */
static void channel_sums(const bn_job_t *j, const char *u, const char *v, int64_t c0, int64_t c1, const double *ku,
                         const double *kv, double *s1, double *s2) {
  size_t es = rh_dtype_size(j->dt);
  int64_t inner = j->inner, w = (c1 - c0) * inner, stride = j->c * inner;
  if (inner >= BN_ROW_INNER || c1 - c0 == 1) {
    for (int64_t ch = c0; ch < c1; ch++) {
      size_t base = (size_t)(ch * inner) * es;
      if (j->dt == RH_F32)
        seg_sums_f32((const float *)(u + base), (const float *)(v + base), j->n, inner, stride, (float)ku[ch - c0],
                     (float)kv[ch - c0], &s1[ch - c0], &s2[ch - c0]);
      else
        seg_sums_f64((const double *)(u + base), (const double *)(v + base), j->n, inner, stride, ku[ch - c0],
                     kv[ch - c0], &s1[ch - c0], &s2[ch - c0]);
    }
    return;
  }
  double d1[BN_ROW_WIDTH], d2[BN_ROW_WIDTH];
  union {
    float f[2][BN_ROW_WIDTH];
    double d[2][BN_ROW_WIDTH];
  } k;
  for (int64_t e = 0; e < w; e++) {
    if (j->dt == RH_F32) k.f[0][e] = (float)ku[e / inner], k.f[1][e] = (float)kv[e / inner];
    else k.d[0][e] = ku[e / inner], k.d[1][e] = kv[e / inner];
  }
  size_t off = (size_t)(c0 * inner) * es;
  if (j->dt == RH_F32)
    row_sums_f32((const float *)(u + off), (const float *)(v + off), j->n, stride, w, k.f[0], k.f[1], d1, d2);
  else row_sums_f64((const double *)(u + off), (const double *)(v + off), j->n, stride, w, k.d[0], k.d[1], d1, d2);
  for (int64_t ch = c0; ch < c1; ch++) {
    double a = 0, q = 0;
    for (int64_t i = 0; i < inner; i++) a += d1[(ch - c0) * inner + i], q += d2[(ch - c0) * inner + i];
    s1[ch - c0] = a, s2[ch - c0] = q;
  }
}

/* out = a[ch] * u + b[ch] * v + c[ch] over channels [c0, c1) (v may be NULL) */
static void channel_affine(const bn_job_t *j, char *o, const char *u, const char *v, int64_t c0, int64_t c1,
                           const double *a, const double *b, const double *c) {
  size_t es = rh_dtype_size(j->dt);
  int64_t inner = j->inner, stride = j->c * inner;
  if (inner >= BN_ROW_INNER || c1 - c0 == 1) { /* long segments: one channel's at a time */
    for (int64_t ch = c0; ch < c1; ch++)
      for (int64_t n = 0; n < j->n; n++) {
        size_t base = (size_t)((n * j->c + ch) * inner) * es;
        axpby(j->dt, o + base, u + base, v ? v + base : NULL, inner, a[ch - c0], b[ch - c0], c[ch - c0]);
      }
    return;
  }
  int64_t w = (c1 - c0) * inner; /* short: the chunk's rows, coefficients per element */
  union {
    float f[3][BN_ROW_WIDTH];
    double d[3][BN_ROW_WIDTH];
  } k;
  for (int64_t e = 0; e < w; e++) {
    int64_t q = e / inner;
    if (j->dt == RH_F32) k.f[0][e] = (float)a[q], k.f[1][e] = (float)b[q], k.f[2][e] = (float)c[q];
    else k.d[0][e] = a[q], k.d[1][e] = b[q], k.d[2][e] = c[q];
  }
  size_t off = (size_t)(c0 * inner) * es;
  if (j->dt == RH_F32)
    row_affine_f32((float *)(o + off), (const float *)(u + off), v ? (const float *)(v + off) : NULL, j->n, stride, w,
                   k.f[0], k.f[1], k.f[2]);
  else
    row_affine_f64((double *)(o + off), (const double *)(u + off), v ? (const double *)(v + off) : NULL, j->n, stride,
                   w, k.d[0], k.d[1], k.d[2]);
}

/* the channels of a chunk: all of [lo, hi) when segments are short, else one */
static int64_t chunk_end(const bn_job_t *j, int64_t c0, int64_t hi) {
  int64_t per = j->inner >= BN_ROW_INNER ? 1 : BN_ROW_WIDTH / j->inner;
  return c0 + per < hi ? c0 + per : hi;
}

static void bn_forward_channels(void *ctx, int64_t lo, int64_t hi) {
  bn_job_t *j = ctx;
  int64_t m = j->n * j->inner;
  double k[BN_ROW_WIDTH], s[BN_ROW_WIDTH], ss[BN_ROW_WIDTH], sc[BN_ROW_WIDTH], sh[BN_ROW_WIDTH];
  for (int64_t c0 = lo; c0 < hi;) {
    int64_t c1 = chunk_end(j, c0, hi);
    /* shifted by the channel's first element: no cancellation in ss - s*s/m */
    for (int64_t ch = c0; ch < c1 && j->training; ch++) k[ch - c0] = ld(j->dt, j->x, ch * j->inner);
    if (j->training) channel_sums(j, j->x, j->x, c0, c1, k, k, s, ss);
    for (int64_t ch = c0; ch < c1; ch++) {
      double mean, invstd;
      if (j->training) {
        double s1 = s[ch - c0], s2 = ss[ch - c0];
        mean = k[ch - c0] + s1 / (double)m;
        s2 -= s1 * s1 / (double)m;
        if (s2 < 0) s2 = 0;
        double var = s2 / (double)m;
        invstd = 1.0 / sqrt(var + j->eps);
        if (j->rm) {
          st(j->dt, j->rm, ch, (1 - j->momentum) * ld(j->dt, j->rm, ch) + j->momentum * mean);
          double unbiased = m > 1 ? s2 / (double)(m - 1) : var;
          st(j->dt, j->rv, ch, (1 - j->momentum) * ld(j->dt, j->rv, ch) + j->momentum * unbiased);
        }
      } else {
        mean = ld(j->dt, j->rm, ch);
        invstd = 1.0 / sqrt(ld(j->dt, j->rv, ch) + j->eps);
      }
      j->mean[ch] = mean;
      j->invstd[ch] = invstd;
      double w = j->w ? ld(j->dt, j->w, ch) : 1, b = j->b ? ld(j->dt, j->b, ch) : 0;
      sc[ch - c0] = w * invstd, sh[ch - c0] = b - mean * sc[ch - c0];
    }
    channel_affine(j, j->y, j->x, NULL, c0, c1, sc, sc, sh);
    c0 = c1;
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
  bn_job_t j = {x->dtype,
                rh_tensor_data(xc),
                rh_tensor_data(ty),
                w ? rh_tensor_data(w) : NULL,
                b ? rh_tensor_data(b) : NULL,
                rm ? rh_tensor_data(rm) : NULL,
                rv ? rh_tensor_data(rv) : NULL,
                rh_tensor_data(tm),
                rh_tensor_data(ti),
                x->size[0],
                c,
                inner_of(x),
                training,
                momentum,
                eps,
                NULL,
                NULL,
                NULL,
                NULL};
  rh_parallel_for(c, rh_parallel_grain(2 * x->size[0] * j.inner), bn_forward_channels, &j);
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
  double zero[BN_ROW_WIDTH] = {0}, s[BN_ROW_WIDTH], sx[BN_ROW_WIDTH], a[BN_ROW_WIDTH], b[BN_ROW_WIDTH], c[BN_ROW_WIDTH];
  for (int64_t c0 = lo; c0 < hi;) {
    int64_t c1 = chunk_end(j, c0, hi);
    /* sum gy, sum gy * (x - mean): the lanes shift x by the mean in x's dtype,
     * the difference to the double mean is added back in double */
    channel_sums(j, j->gy, j->x, c0, c1, zero, j->mean + c0, s, sx);
    for (int64_t ch = c0; ch < c1; ch++) {
      double mean = j->mean[ch], invstd = j->invstd[ch], sg = s[ch - c0];
      double kv = j->dt == RH_F32 ? (double)(float)mean : mean, sgx = sx[ch - c0] + (kv - mean) * sg;
      double w = j->w ? ld(j->dt, j->w, ch) : 1;
      if (j->gw) j->gw[ch] = sgx * invstd;
      if (j->gb) j->gb[ch] = sg;
      /* gx = w*invstd * (g - sg/m - xhat * sum(g*xhat)/m), as a*g + b*x + c */
      double ai = w * invstd, bi = 0, ci = 0;
      if (j->training) {
        bi = -ai * invstd * invstd * sgx / (double)m;
        ci = -ai * sg / (double)m - bi * mean;
      }
      a[ch - c0] = ai, b[ch - c0] = bi, c[ch - c0] = ci;
    }
    if (j->gx) channel_affine(j, j->gx, j->gy, j->training ? j->x : NULL, c0, c1, a, b, c);
    c0 = c1;
  }
}

int rh_nn_batch_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *mean, rh_tensor_t *invstd,
                              int training, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb) {
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (gy->dtype != x->dtype || gy->ndim != x->ndim || RH_ON_DEVICE(gy))
    return rh_tensor_fail("batch_norm backward: the gradient must match the input");
  for (int d = 0; d < x->ndim; d++)
    if (gy->size[d] != x->size[d]) return rh_tensor_fail("batch_norm backward: the gradient must match the input");
  if (check_vec("weight", w, x)) return -1;
  int64_t c = x->size[1];
  if (mean->dtype != RH_F64 || invstd->dtype != RH_F64 || mean->ndim != 1 || mean->size[0] != c || invstd->ndim != 1 ||
      invstd->size[0] != c)
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
  bn_job_t j = {x->dtype,
                rh_tensor_data(xc),
                NULL,
                w ? rh_tensor_data(w) : NULL,
                NULL,
                NULL,
                NULL,
                rh_tensor_data(mean),
                rh_tensor_data(invstd),
                x->size[0],
                c,
                inner_of(x),
                training,
                0,
                0,
                rh_tensor_data(gc),
                tx ? rh_tensor_data(tx) : NULL,
                tw ? rh_tensor_data(tw) : NULL,
                tb ? rh_tensor_data(tb) : NULL};
  rh_parallel_for(c, rh_parallel_grain(2 * x->size[0] * j.inner), bn_backward_channels, &j);
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

/* ---- layer norm */

typedef struct {
  rh_dtype_t dt;
  const char *x, *w, *b, *gy; /* w, b: d elements or NULL */
  char *y, *gx;
  double *mean, *rstd;
  double *gw, *gb; /* backward: [parts][d] accumulators, NULL when not wanted */
  int64_t m, d, per;
  double eps;
} ln_job_t;

#define LN_FORWARD_ROW(T)                                                                \
  do {                                                                                   \
    const T *x = (const T *)j->x + r * j->d, *w = (const T *)j->w, *b = (const T *)j->b; \
    T *y = (T *)j->y + r * j->d;                                                         \
    T tm = (T)mean, tr = (T)rstd;                                                        \
    for (int64_t i = 0; i < j->d; i++) {                                                 \
      T v = (x[i] - tm) * tr;                                                            \
      if (w) v *= w[i];                                                                  \
      if (b) v += b[i];                                                                  \
      y[i] = v;                                                                          \
    }                                                                                    \
  } while (0)

static void ln_forward_rows(void *ctx, int64_t lo, int64_t hi) {
  ln_job_t *j = ctx;
  size_t es = rh_dtype_size(j->dt);
  for (int64_t r = lo; r < hi; r++) {
    const char *row = j->x + (size_t)(r * j->d) * es;
    double k = ld(j->dt, row, 0), s = 0, ss = 0;
    if (j->dt == RH_F32) seg_sums_f32((const float *)row, (const float *)row, 1, j->d, 0, (float)k, (float)k, &s, &ss);
    else seg_sums_f64((const double *)row, (const double *)row, 1, j->d, 0, k, k, &s, &ss);
    double mean = k + s / (double)j->d, var = (ss - s * s / (double)j->d) / (double)j->d;
    double rstd = 1.0 / sqrt((var > 0 ? var : 0) + j->eps);
    j->mean[r] = mean;
    j->rstd[r] = rstd;
    if (j->dt == RH_F32) LN_FORWARD_ROW(float);
    else LN_FORWARD_ROW(double);
  }
}

static int ln_check(const char *what, rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *b) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("%s: expected a float32 or float64 input, got %s", what, rh_dtype_name(x->dtype));
  if (RH_ON_DEVICE(x)) return rh_tensor_fail("%s: the C kernel takes host tensors", what);
  int64_t n = rh_tensor_numel(x);
  if (d < 1 || n % d) return rh_tensor_fail("%s: %lld elements are not rows of %lld", what, (long long)n, (long long)d);
  rh_tensor_t *v[2] = {w, b};
  for (int i = 0; i < 2; i++)
    if (v[i] &&
        (rh_tensor_numel(v[i]) != d || v[i]->dtype != x->dtype || !rh_tensor_is_contiguous(v[i]) || RH_ON_DEVICE(v[i])))
      return rh_tensor_fail("%s: %s must be a contiguous host %s tensor of %lld elements", what, i ? "bias" : "weight",
                            rh_dtype_name(x->dtype), (long long)d);
  return 0;
}

int rh_nn_layer_norm(rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *b, double eps, rh_tensor_t **y,
                     rh_tensor_t **mean, rh_tensor_t **rstd) {
  *y = *mean = *rstd = NULL;
  if (ln_check("layer_norm", x, d, w, b)) return -1;
  int64_t m = rh_tensor_numel(x) / d;
  rh_tensor_t *xc = rh_tensor_contiguous(x);
  rh_tensor_t *ty = rh_tensor_empty(x->dtype, x->ndim, x->size);
  rh_tensor_t *tm = rh_tensor_empty(RH_F64, 1, &m), *tr = rh_tensor_empty(RH_F64, 1, &m);
  if (!xc || !ty || !tm || !tr) {
    rh_tensor_t *all[] = {xc, ty, tm, tr};
    for (int i = 0; i < 4; i++) rh_tensor_release(all[i]);
    return rh_tensor_fail("layer_norm: out of memory");
  }
  ln_job_t j = {x->dtype,
                rh_tensor_data(xc),
                w ? rh_tensor_data(w) : NULL,
                b ? rh_tensor_data(b) : NULL,
                NULL,
                rh_tensor_data(ty),
                NULL,
                rh_tensor_data(tm),
                rh_tensor_data(tr),
                NULL,
                NULL,
                m,
                d,
                0,
                eps};
  rh_parallel_for(m, rh_parallel_grain(2 * d), ln_forward_rows, &j);
  rh_tensor_release(xc);
  *y = ty;
  *mean = tm;
  *rstd = tr;
  return 0;
}

/* per row: gxhat = g*w, gx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat*xhat));
 * the part's gw += g*xhat, gb += g */
#define LN_BACKWARD_ROW(T)                                                                           \
  do {                                                                                               \
    const T *x = (const T *)j->x + r * j->d, *g = (const T *)j->gy + r * j->d, *w = (const T *)j->w; \
    double mean = j->mean[r], rstd = j->rstd[r], sa = 0, sb = 0;                                     \
    for (int64_t i = 0; i < j->d; i++) {                                                             \
      double xh = ((double)x[i] - mean) * rstd, gh = (double)g[i] * (w ? (double)w[i] : 1.0);        \
      sa += gh, sb += gh * xh;                                                                       \
      if (gw) gw[i] += (double)g[i] * xh;                                                            \
      if (gb) gb[i] += (double)g[i];                                                                 \
    }                                                                                                \
    if (j->gx) {                                                                                     \
      T *o = (T *)j->gx + r * j->d;                                                                  \
      double ma = sa / (double)j->d, mb = sb / (double)j->d;                                         \
      for (int64_t i = 0; i < j->d; i++) {                                                           \
        double xh = ((double)x[i] - mean) * rstd, gh = (double)g[i] * (w ? (double)w[i] : 1.0);      \
        o[i] = (T)(rstd * (gh - ma - xh * mb));                                                      \
      }                                                                                              \
    }                                                                                                \
  } while (0)

static void ln_backward_parts(void *ctx, int64_t lo, int64_t hi) {
  ln_job_t *j = ctx;
  for (int64_t part = lo; part < hi; part++) {
    double *gw = j->gw ? j->gw + part * j->d : NULL, *gb = j->gb ? j->gb + part * j->d : NULL;
    int64_t end = (part + 1) * j->per < j->m ? (part + 1) * j->per : j->m;
    for (int64_t r = part * j->per; r < end; r++) {
      if (j->dt == RH_F32) LN_BACKWARD_ROW(float);
      else LN_BACKWARD_ROW(double);
    }
  }
}

int rh_nn_layer_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *mean,
                              rh_tensor_t *rstd, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb) {
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (ln_check("layer_norm backward", x, d, w, NULL)) return -1;
  int64_t m = rh_tensor_numel(x) / d;
  if (gy->dtype != x->dtype || rh_tensor_numel(gy) != m * d || RH_ON_DEVICE(gy))
    return rh_tensor_fail("layer_norm backward: the gradient must match the input");
  if (mean->dtype != RH_F64 || rstd->dtype != RH_F64 || rh_tensor_numel(mean) != m || rh_tensor_numel(rstd) != m ||
      !rh_tensor_is_contiguous(mean) || !rh_tensor_is_contiguous(rstd))
    return rh_tensor_fail("layer_norm backward: the saved statistics do not match the input");
  /* rows split in one contiguous range per thread, each with its own
   * parameter-gradient sums, added in part order after (timing-independent) */
  int64_t parts = rh_parallel_threads();
  if (parts > m) parts = m > 0 ? m : 1;
  int64_t per = m > 0 ? (m + parts - 1) / parts : 1;
  parts = m > 0 ? (m + per - 1) / per : 1;
  rh_tensor_t *xc = rh_tensor_contiguous(x), *gc = rh_tensor_contiguous(gy);
  rh_tensor_t *tx = gx ? rh_tensor_empty(x->dtype, x->ndim, x->size) : NULL;
  rh_tensor_t *tw = gw ? rh_tensor_empty(x->dtype, 1, &d) : NULL, *tb = gb ? rh_tensor_empty(x->dtype, 1, &d) : NULL;
  double *aw = gw ? calloc((size_t)(parts * d), sizeof(double)) : NULL;
  double *ab = gb ? calloc((size_t)(parts * d), sizeof(double)) : NULL;
  if (!xc || !gc || (gx && !tx) || (gw && (!tw || !aw)) || (gb && (!tb || !ab))) {
    rh_tensor_t *all[] = {xc, gc, tx, tw, tb};
    for (int i = 0; i < 5; i++) rh_tensor_release(all[i]);
    free(aw);
    free(ab);
    return rh_tensor_fail("layer_norm backward: out of memory");
  }
  ln_job_t j = {x->dtype,
                rh_tensor_data(xc),
                w ? rh_tensor_data(w) : NULL,
                NULL,
                rh_tensor_data(gc),
                NULL,
                tx ? rh_tensor_data(tx) : NULL,
                rh_tensor_data(mean),
                rh_tensor_data(rstd),
                aw,
                ab,
                m,
                d,
                per,
                0};
  rh_parallel_for(parts, 1, ln_backward_parts, &j);
  rh_tensor_t *outs[2] = {tw, tb};
  double *acc[2] = {aw, ab};
  for (int o = 0; o < 2; o++) {
    if (!outs[o]) continue;
    for (int64_t i = 0; i < d; i++) {
      double sum = 0;
      for (int64_t part = 0; part < parts; part++) sum += acc[o][part * d + i];
      st(x->dtype, rh_tensor_data(outs[o]), i, sum);
    }
  }
  free(aw);
  free(ab);
  rh_tensor_release(xc);
  rh_tensor_release(gc);
  if (gx) *gx = tx;
  if (gw) *gw = tw;
  if (gb) *gb = tb;
  return 0;
}
