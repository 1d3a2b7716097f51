/* reduce.c: reductions (Torch7's THTensorMath sum/mean/max/min/argmax/argmin/
 * prod, over one dimension or over everything, keepdim or not) and softmax, which
 * reduces each row twice (its max, then the sum of exps). Both move the reduced
 * dimension last and make rows contiguous (rows_of), then work row by row: sums
 * of floats with eight accumulators in double, long rows split over the thread
 * pool with the partial sums added in order (a given machine always gets the
 * same bits); integers sum exactly in int64; NaN wins max and min.
 *
 * Depends on copy.c (contiguous rows, casts), tensor.c (permuted views),
 * parallel.c and device.c (the kernels library's rows); ops.c uses it. */
#include <math.h>
#include <string.h>

#include "tensor_internal.h"

/* ---- fast sums of contiguous floats: eight independent accumulators (no
 * dependency chain), in double; long rows are split across the thread pool and
 * the partial sums added in order, so a given machine always gets the same bits */
/* built for AVX2 as well as the x86-64 baseline, picked at load time (the
 * baseline's 128-bit conversions to double halved the rate of a float32 sum) */
#define SUM_FN(NAME, T)                                                       \
  RH_VEC_CLONES_AVX2 static double NAME(const T *p, int64_t n) {              \
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                   \
    int64_t i = 0;                                                            \
    for (; i + 8 <= n; i += 8)                                                \
      for (int k = 0; k < 8; k++) a[k] += p[i + k];                           \
    for (; i < n; i++) a[0] += p[i];                                          \
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); \
  }
SUM_FN(sum_f32, float)
SUM_FN(sum_f64, double)

#define SUM_PARTS 16
typedef struct {
  const void *p;
  rh_dtype_t dt;
  int64_t n;
  double part[SUM_PARTS];
} sum_job_t;

static void sum_chunk(void *vctx, int64_t lo, int64_t hi) {
  sum_job_t *j = vctx;
  int64_t per = (j->n + SUM_PARTS - 1) / SUM_PARTS;
  for (int64_t k = lo; k < hi; k++) {
    int64_t a = k * per, b = a + per < j->n ? a + per : j->n;
    if (a >= b) {
      j->part[k] = 0;
      continue;
    }
    j->part[k] = j->dt == RH_F32 ? sum_f32((const float *)j->p + a, b - a) : sum_f64((const double *)j->p + a, b - a);
  }
}

static double fast_sum(const void *p, rh_dtype_t dt, int64_t n) {
  if (n < (1 << 18)) return dt == RH_F32 ? sum_f32(p, n) : sum_f64(p, n);
  sum_job_t j = {p, dt, n, {0}};
  rh_parallel_for(SUM_PARTS, 1, sum_chunk, &j);
  double acc = 0;
  for (int k = 0; k < SUM_PARTS; k++) acc += j.part[k];
  return acc;
}

/* ---- reductions: move the reduced dim last, make rows contiguous, reduce rows */
static rh_tensor_t *rows_of(rh_tensor_t *a, int dim, int64_t *rows, int64_t *len) {
  rh_tensor_t *p;
  if (dim < 0) {
    p = rh_tensor_contiguous(a);
    *len = rh_tensor_numel(a);
    *rows = 1;
    return p;
  }
  int perm[RH_MAXDIM], k = 0;
  for (int i = 0; i < a->ndim; i++)
    if (i != dim) perm[k++] = i;
  perm[k] = dim;
  rh_tensor_t *v = rh_tensor_permute(a, perm);
  if (!v) return NULL;
  p = rh_tensor_contiguous(v);
  rh_tensor_release(v);
  *len = a->size[dim];
  *rows = *len ? rh_tensor_numel(a) / *len : 0;
  if (*len == 0) {
    *rows = 1;
    for (int i = 0; i < a->ndim; i++)
      if (i != dim) *rows *= a->size[i];
  }
  return p;
}

static const char *redop_name(rh_redop_t op) {
  static const char *n[] = {"sum", "mean", "max", "min", "argmax", "argmin", "prod"};
  return n[op];
}

rh_tensor_t *rh_tensor_reduce(rh_redop_t op, rh_tensor_t *a, int dim, int keepdim) {
  if (dim >= 0 && rh__check_dim(redop_name(op), dim, a->ndim)) return NULL; /* (dim < 0: over all) */
  if (a->ndim == 0) dim = -1;
  rh_dtype_t rt = a->dtype;
  if (op == RH_RED_SUM || op == RH_RED_PROD) rt = rh_dtype_is_float(a->dtype) ? a->dtype : RH_I64;
  if (op == RH_RED_MEAN && !rh_dtype_is_float(a->dtype)) {
    rh_tensor_fail(
        "mean(): could not infer output dtype. Input dtype must be either a floating point or "
        "complex dtype. Got: %s (convert with to(tensor.float32))",
        rh_dtype_name(a->dtype));
    return NULL;
  }
  if (op == RH_RED_ARGMAX || op == RH_RED_ARGMIN) rt = RH_I64;
  int64_t rows, len;
  rh_tensor_t *src = rows_of(a, dim, &rows, &len);
  if (!src) return NULL;
  if (len == 0 && op != RH_RED_SUM && op != RH_RED_MEAN && op != RH_RED_PROD) {
    rh_tensor_release(src);
    rh_tensor_fail("%s(): cannot reduce an empty tensor (or an empty dimension): it has no identity", redop_name(op));
    return NULL;
  }
  int64_t osize[RH_MAXDIM];
  int ond = 0;
  if (dim >= 0) {
    for (int i = 0; i < a->ndim; i++) {
      if (i != dim) osize[ond++] = a->size[i];
      else if (keepdim) osize[ond++] = 1;
    }
  }
  rh_tensor_t *out = rh_tensor_empty_on(rh_tensor_device(a), rt, ond, osize);
  if (!out) {
    rh_tensor_release(src);
    return NULL;
  }
  if (RH_ON_DEVICE(a)) {
    int rc = rh__cuda_call(rh_cuda_api()->reduce_rows(rh_tensor_device(a), op, a->dtype, rt, rows, len,
                                                      rh_tensor_data(src), rh_tensor_data(out)));
    rh_tensor_release(src);
    if (rc) {
      rh_tensor_release(out);
      return NULL;
    }
    return out;
  }
  const char *base = rh_tensor_data(src);
  size_t es = rh_dtype_size(a->dtype);
  char *obase = rh_tensor_data(out);
  size_t oes = rh_dtype_size(rt);
  for (int64_t r = 0; r < rows; r++) {
    const char *row = base + (size_t)(r * len) * es;
    if (rt == RH_I64 && (op == RH_RED_SUM || op == RH_RED_PROD)) {
      /* integers sum and multiply exactly in int64 (wrapping like PyTorch; the
       * CUDA kernels do the same), not through a double that rounds past 2^53 */
      int64_t acc = op == RH_RED_SUM ? 0 : 1;
      for (int64_t i = 0; i < len; i++) {
        int64_t v = a->dtype == RH_I64 ? ((const int64_t *)row)[i] : (int64_t)rh__load(a->dtype, row + (size_t)i * es);
        acc = op == RH_RED_SUM ? (int64_t)((uint64_t)acc + (uint64_t)v) : (int64_t)((uint64_t)acc * (uint64_t)v);
      }
      ((int64_t *)obase)[r] = acc;
      continue;
    }
    double acc;
    int64_t best = 0;
    switch (op) {
      case RH_RED_SUM:
      case RH_RED_MEAN:
        acc = 0;
        if (a->dtype == RH_F32 || a->dtype == RH_F64) {
          acc = fast_sum(row, a->dtype, len);
        } else {
          for (int64_t i = 0; i < len; i++) acc += rh__load(a->dtype, row + (size_t)i * es);
        }
        if (op == RH_RED_MEAN) acc /= (double)len;
        break;
      case RH_RED_PROD:
        acc = 1;
        for (int64_t i = 0; i < len; i++) acc *= rh__load(a->dtype, row + (size_t)i * es);
        break;
      default: {
        /* max/min/argmax/argmin: NaN wins, as in PyTorch; the first extreme index */
        int want_max = op == RH_RED_MAX || op == RH_RED_ARGMAX;
        acc = rh__load(a->dtype, row);
        for (int64_t i = 1; i < len && acc == acc; i++) {
          double v = rh__load(a->dtype, row + (size_t)i * es);
          if (v != v || (want_max ? v > acc : v < acc)) {
            acc = v;
            best = i;
          }
        }
        if (op == RH_RED_ARGMAX || op == RH_RED_ARGMIN) acc = (double)best;
        if ((op == RH_RED_MAX || op == RH_RED_MIN) && a->dtype == RH_I64) {
          /* exact for big int64: copy the element itself */
          memcpy(obase + (size_t)r * oes, row + (size_t)best * es, 8);
          continue;
        }
      }
    }
    rh__store(rt, obase + (size_t)r * oes, acc);
  }
  rh_tensor_release(src);
  return out;
}

/* softmax's result in the (rest..., dim) layout of rows_of, permuted back */
static rh_tensor_t *unpermute_rows(rh_tensor_t *res, int ndim, int dim) {
  if (ndim <= 1) return res;
  int inv[RH_MAXDIM], k = 0;
  for (int i = 0; i < ndim; i++) inv[i] = i == dim ? ndim - 1 : k++;
  rh_tensor_t *back = rh_tensor_permute(res, inv);
  rh_tensor_release(res);
  return back;
}

/* on a device the rows are computed in the result's dtype (accumulating in
 * double inside the kernel) */
static rh_tensor_t *softmax_on_device(rh_tensor_t *a, int dim, int log_, rh_dtype_t ct) {
  rh_tensor_t *ac = rh__as_dtype(a, ct);
  if (!ac) return NULL;
  int64_t rows, len;
  rh_tensor_t *src = rows_of(ac, a->ndim ? dim : -1, &rows, &len);
  rh_tensor_release(ac);
  if (!src) return NULL;
  rh_tensor_t *res = rh_tensor_empty_on(rh_tensor_device(a), ct, src->ndim, src->size);
  int rc = res ? rh__cuda_call(rh_cuda_api()->softmax_rows(rh_tensor_device(a), ct, log_, rows, len,
                                                           rh_tensor_data(src), rh_tensor_data(res)))
               : -1;
  rh_tensor_release(src);
  if (rc) {
    rh_tensor_release(res);
    return NULL;
  }
  rh_tensor_t *back = unpermute_rows(res, a->ndim, dim);
  if (!back) return NULL;
  rh_tensor_t *out = rh_tensor_contiguous(back);
  rh_tensor_release(back);
  return out;
}

rh_tensor_t *rh_tensor_softmax(rh_tensor_t *a, int dim, int log_) {
  if (a->ndim > 0 && rh__check_dim(log_ ? "log_softmax" : "softmax", dim, a->ndim)) return NULL;
  rh_dtype_t ct = rh_dtype_is_float(a->dtype) ? a->dtype : RH_F32;
  if (RH_ON_DEVICE(a)) return softmax_on_device(a, dim, log_, ct);
  rh_tensor_t *ac = rh__as_dtype(a, RH_F64);
  if (!ac) return NULL;
  int64_t rows, len;
  rh_tensor_t *src = rows_of(ac, a->ndim ? dim : -1, &rows, &len);
  rh_tensor_release(ac);
  if (!src) return NULL;
  /* result in the permuted layout, then permuted back */
  rh_tensor_t *res = rh_tensor_empty(RH_F64, src->ndim, src->size);
  if (!res) {
    rh_tensor_release(src);
    return NULL;
  }
  const double *in = rh_tensor_data(src);
  double *o = rh_tensor_data(res);
  for (int64_t r = 0; r < rows; r++) {
    const double *x = in + r * len;
    double *y = o + r * len;
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < len; i++) m = x[i] > m ? x[i] : m;
    for (int64_t i = 0; i < len; i++) s += exp(x[i] - m);
    for (int64_t i = 0; i < len; i++) y[i] = log_ ? x[i] - m - log(s) : exp(x[i] - m) / s;
  }
  rh_tensor_release(src);
  rh_tensor_t *back = unpermute_rows(res, a->ndim, dim);
  if (!back) return NULL;
  rh_tensor_t *out = rh_tensor_cast(back, ct);
  rh_tensor_release(back);
  return out;
}
