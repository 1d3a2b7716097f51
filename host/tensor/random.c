/* random.c: random tensors beyond rand/randn: randint, randperm, bernoulli and
 * multinomial, all from the one generator in tensor.c (so manual_seed makes
 * every one of them repeat). Drawn on the host, in order, then moved where the
 * caller wants them, as rand and randn are: a seed gives the same numbers on
 * every device. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

/* uniform in [0, n) without modulo bias (Lemire's method) */
static uint64_t below(uint64_t n) {
  if (n == 0) return 0;
  uint64_t x = rh__random_u64();
  __uint128_t m = (__uint128_t)x * n;
  uint64_t l = (uint64_t)m;
  if (l < n) {
    uint64_t t = -n % n;
    while (l < t) {
      x = rh__random_u64();
      m = (__uint128_t)x * n;
      l = (uint64_t)m;
    }
  }
  return (uint64_t)(m >> 64);
}

/* integers uniform in [low, high) */
rh_tensor_t *rh_tensor_randint(rh_dtype_t dt, int64_t low, int64_t high, int ndim, const int64_t *size) {
  if (high <= low) {
    rh_tensor_fail("randint: expected low < high, got low = %lld and high = %lld", (long long)low, (long long)high);
    return NULL;
  }
  if (dt == RH_BOOL && (low < 0 || high > 2)) {
    rh_tensor_fail("randint: a bool tensor holds only 0 and 1, the range [%lld, %lld) does not fit", (long long)low,
                   (long long)high);
    return NULL;
  }
  rh_tensor_t *t = rh_tensor_empty(dt, ndim, size);
  if (!t) return NULL;
  int64_t n = rh_tensor_numel(t);
  uint64_t span = (uint64_t)high - (uint64_t)low;
  char *p = rh_tensor_data(t);
  size_t es = rh_dtype_size(dt);
  for (int64_t i = 0; i < n; i++) {
    int64_t v = (int64_t)((uint64_t)low + below(span));
    if (dt == RH_I64) ((int64_t *)p)[i] = v;
    else rh__store(dt, p + i * es, (double)v);
  }
  return t;
}

/* a random permutation of base .. base + n - 1 (Fisher-Yates) */
rh_tensor_t *rh_tensor_randperm(rh_dtype_t dt, int64_t n, int64_t base) {
  if (n < 0) {
    rh_tensor_fail("randperm: n must be non-negative, got %lld", (long long)n);
    return NULL;
  }
  rh_tensor_t *t = rh_tensor_empty(RH_I64, 1, &n);
  if (!t) return NULL;
  int64_t *p = rh_tensor_data(t);
  for (int64_t i = 0; i < n; i++) p[i] = i + base;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t k = (int64_t)below((uint64_t)i + 1);
    int64_t x = p[i];
    p[i] = p[k];
    p[k] = x;
  }
  if (dt == RH_I64) return t;
  rh_tensor_t *c = rh_tensor_cast(t, dt);
  rh_tensor_release(t);
  return c;
}

/* 1 with probability p[i], else 0; p in [0, 1] (a host tensor of any float dtype) */
rh_tensor_t *rh_tensor_bernoulli(rh_tensor_t *p) {
  if (!rh_dtype_is_float(p->dtype)) {
    rh_tensor_fail("bernoulli: the probabilities must be a floating point tensor, got %s", rh_dtype_name(p->dtype));
    return NULL;
  }
  rh_tensor_t *h = rh_tensor_to_device(p, -1);
  rh_tensor_t *c = h ? rh_tensor_contiguous(h) : NULL;
  rh_tensor_release(h);
  if (!c) return NULL;
  rh_tensor_t *out = rh_tensor_empty(p->dtype, p->ndim, p->size);
  int64_t n = rh_tensor_numel(c);
  size_t es = rh_dtype_size(p->dtype);
  const char *src = rh_tensor_data(c);
  for (int64_t i = 0; out && i < n; i++) {
    double q = rh__load(p->dtype, src + i * es);
    if (!(q >= 0 && q <= 1)) {
      rh_tensor_fail("bernoulli: probability %g at element %lld is not in [0, 1]", q, (long long)i + 1);
      rh_tensor_release(out);
      out = NULL;
      break;
    }
    rh__store(p->dtype, (char *)rh_tensor_data(out) + i * es, rh__uniform01() < q ? 1 : 0);
  }
  rh_tensor_release(c);
  if (out && RH_ON_DEVICE(p)) {
    rh_tensor_t *d = rh_tensor_to_device(out, rh_tensor_device(p));
    rh_tensor_release(out);
    out = d;
  }
  return out;
}

/* multinomial(probs, k, replacement): for each row of weights (1-D or 2-D), k
 * category indices (plus base) drawn in proportion to the weights */
rh_tensor_t *rh_tensor_multinomial(rh_tensor_t *w, int64_t k, int replacement, int64_t base) {
  if (w->ndim < 1 || w->ndim > 2) {
    rh_tensor_fail("multinomial: the weights must be 1- or 2-dimensional, got %d dimensions", w->ndim);
    return NULL;
  }
  int64_t rows = w->ndim == 2 ? w->size[0] : 1, n = w->size[w->ndim - 1];
  if (k <= 0) {
    rh_tensor_fail("multinomial: the number of samples must be positive, got %lld", (long long)k);
    return NULL;
  }
  if (!replacement && k > n) {
    rh_tensor_fail("multinomial: cannot draw %lld samples from %lld categories without replacement", (long long)k,
                   (long long)n);
    return NULL;
  }
  rh_tensor_t *h = rh_tensor_to_device(w, -1);
  rh_tensor_t *c = h ? rh_tensor_cast(h, RH_F64) : NULL;
  rh_tensor_release(h);
  if (!c) return NULL;
  int64_t osize[2] = {rows, k};
  rh_tensor_t *out = rh_tensor_empty(RH_I64, w->ndim, w->ndim == 2 ? osize : osize + 1);
  double *cum = out ? malloc((size_t)(n ? n : 1) * sizeof(double)) : NULL;
  double *wr = cum ? malloc((size_t)(n ? n : 1) * sizeof(double)) : NULL;
  int ok = wr != NULL;
  if (out && !ok) rh_tensor_fail("multinomial: out of memory");
  for (int64_t r = 0; ok && r < rows; r++) {
    memcpy(wr, (double *)rh_tensor_data(c) + r * n, (size_t)n * sizeof(double));
    int64_t positive = 0;
    for (int64_t i = 0; i < n; i++) {
      if (!(wr[i] >= 0) || isinf(wr[i])) {
        rh_tensor_fail("multinomial: the weights must be finite and non-negative (row %lld, element %lld is %g)",
                       (long long)r + 1, (long long)i + 1, wr[i]);
        ok = 0;
        break;
      }
      positive += wr[i] > 0;
    }
    if (ok && (positive == 0 || (!replacement && positive < k))) {
      rh_tensor_fail("multinomial: row %lld has %lld categories of non-zero weight, too few to draw %lld%s",
                     (long long)r + 1, (long long)positive, (long long)k, replacement ? "" : " without replacement");
      ok = 0;
    }
    int64_t *o = (int64_t *)rh_tensor_data(out) + r * k;
    for (int64_t s = 0; ok && s < k; s++) {
      double total = 0;
      for (int64_t i = 0; i < n; i++) cum[i] = (total += wr[i]);
      double u = rh__uniform01() * total;
      int64_t lo = 0, hi = n - 1;
      while (lo < hi) { /* the first category whose running total exceeds u */
        int64_t mid = (lo + hi) / 2;
        if (cum[mid] > u) hi = mid;
        else lo = mid + 1;
      }
      o[s] = lo + base;
      if (!replacement) wr[lo] = 0;
    }
  }
  free(cum);
  free(wr);
  rh_tensor_release(c);
  if (!ok) {
    rh_tensor_release(out);
    return NULL;
  }
  if (RH_ON_DEVICE(w)) {
    rh_tensor_t *d = rh_tensor_to_device(out, rh_tensor_device(w));
    rh_tensor_release(out);
    out = d;
  }
  return out;
}
