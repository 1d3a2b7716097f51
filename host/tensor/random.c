/* random.c: random tensors: rand, randn, randint, randperm, bernoulli and
 * multinomial, and the one generator they all draw from (xoshiro256**;
 * manual_seed seeds it, so every one of them repeats). Drawn on the host, in
 * order, then moved where the caller wants them: a seed gives the same numbers
 * on every device.
 * randn is Box-Muller over blocks of pairs, both the cosine and the sine of each
 * pair kept, with its own log and sincos: straight-line polynomials the compiler
 * can vectorise, accurate to about an ulp (so the samples are as exactly normal
 * as libm's would be), instead of two libm calls per element. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

/* xoshiro256** with splitmix64 seeding: fast, good, seedable */
static uint64_t rng[4] = {0x9E3779B97F4A7C15ull, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull, 42};

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* inline: randn and rand draw in loops */
static inline uint64_t next_u64(void) {
  uint64_t r = rotl(rng[1] * 5, 7) * 9, t = rng[1] << 17;
  rng[2] ^= rng[0];
  rng[3] ^= rng[1];
  rng[1] ^= rng[2];
  rng[0] ^= rng[3];
  rng[2] ^= t;
  rng[3] = rotl(rng[3], 45);
  return r;
}

void rh_random_seed(uint64_t seed) {
  for (int i = 0; i < 4; i++) {
    uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    rng[i] = z ^ (z >> 31);
  }
}

static inline double uniform01(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; }

/* uniform in [0, n) without modulo bias (Lemire's method) */
static uint64_t below(uint64_t n) {
  if (n == 0) return 0;
  uint64_t x = next_u64();
  __uint128_t m = (__uint128_t)x * n;
  uint64_t l = (uint64_t)m;
  if (l < n) {
    uint64_t t = -n % n;
    while (l < t) {
      x = next_u64();
      m = (__uint128_t)x * n;
      l = (uint64_t)m;
    }
  }
  return (uint64_t)(m >> 64);
}

/* Bits as a double and back (integer operations on the bits vectorise where
 * double <-> int64 conversions do not, on plain x86-64). */
static inline uint64_t bits_of(double x) {
  uint64_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}
static inline double of_bits(uint64_t b) {
  double x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* log(u) for u in (0, 1] that are multiples of 2^-53 (so normal numbers): u =
 * m * 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) with s = (m-1)/(m+1),
 * |s| < 0.172, whose odd series to s^21 is below an ulp of the result. No
 * branches nor int64 conversions, so that a loop of it vectorises. */
static inline double log_unit(double u) {
  uint64_t b = bits_of(u), mant = b & 0x000FFFFFFFFFFFFFull;
  /* 1 where the mantissa is past sqrt(2): then m is halved and e one more */
  uint64_t big = (0x6A09E667F3BCCull - mant) >> 63;
  /* the exponent as a double: 2^52 + field, less 2^52 + the bias */
  double e = of_bits(((b >> 52) + big) | 0x4330000000000000ull) - (0x1.0p52 + 1023.0);
  double m = of_bits((mant | 0x3FF0000000000000ull) - (big << 52));
  double s = (m - 1.0) / (m + 1.0), z = s * s;
  double p = 1.0 / 21;
  p = p * z + 1.0 / 19;
  p = p * z + 1.0 / 17;
  p = p * z + 1.0 / 15;
  p = p * z + 1.0 / 13;
  p = p * z + 1.0 / 11;
  p = p * z + 1.0 / 9;
  p = p * z + 1.0 / 7;
  p = p * z + 1.0 / 5;
  p = p * z + 1.0 / 3;
  /* ln 2 split so that e * LN2_HI is exact */
  return e * 6.93147180369123816490e-01 + (2.0 * s + (2.0 * s * z * p + e * 1.90821492927058770002e-10));
}

/* cos and sin of 2 pi u for u in [0, 1): u = k/4 + r with |r| <= 1/8 (exact in
 * binary), Taylor series of the angle 2 pi r (|.| <= pi/4) to within an ulp, then
 * turned by k quarter turns, (cos, sin) -> (-sin, cos) each, by bit masks. */
static inline void sincos_turn(double u, double *c_out, double *s_out) {
  /* k = u * 4 rounded, in the low bits of 1.5 * 2^52 + u * 4 */
  double kr = u * 4.0 + 0x1.8p52;
  uint64_t k = bits_of(kr);
  double r = u - (kr - 0x1.8p52) * 0.25, t = 6.283185307179586 * r, z = t * t;
  double s = -1.0 / 1307674368000.0;
  s = s * z + 1.0 / 6227020800.0;
  s = s * z - 1.0 / 39916800.0;
  s = s * z + 1.0 / 362880.0;
  s = s * z - 1.0 / 5040.0;
  s = s * z + 1.0 / 120.0;
  s = s * z - 1.0 / 6.0;
  s = t + t * z * s;
  double c = 1.0 / 20922789888000.0;
  c = c * z - 1.0 / 87178291200.0;
  c = c * z + 1.0 / 479001600.0;
  c = c * z - 1.0 / 3628800.0;
  c = c * z + 1.0 / 40320.0;
  c = c * z - 1.0 / 720.0;
  c = c * z + 1.0 / 24.0;
  c = 1.0 - 0.5 * z + z * z * c;
  /* odd k swaps the two; k = 1, 2 negate the cosine, k = 2, 3 the sine */
  uint64_t swap = 0 - (k & 1), cb = bits_of(c), sb = bits_of(s);
  uint64_t x = (sb & swap) | (cb & ~swap), y = (cb & swap) | (sb & ~swap);
  *c_out = of_bits(x ^ ((((k + 1) >> 1) & 1) << 63));
  *s_out = of_bits(y ^ (((k >> 1) & 1) << 63));
}

enum { PAIRS = 128 };

/* PAIRS pairs of uniforms to 2 PAIRS normals: the cosines, then the sines. Made
 * for the widest vectors the CPU has (chosen when the program loads). */
RH_VEC_CLONES static void box_muller(const double *u1, const double *u2, double *v) {
  for (int i = 0; i < PAIRS; i++) {
    double rad = sqrt(-2.0 * log_unit(u1[i])), c, s;
    sincos_turn(u2[i], &c, &s);
    v[i] = rad * c;
    v[PAIRS + i] = rad * s;
  }
}

/* n standard normals into out (a host buffer of dtype dt): Box-Muller on
 * blocks of PAIRS uniform pairs, the cosine and the sine of each pair both used,
 * so one log, one sincos and two draws give two samples. */
static void fill_normal(rh_dtype_t dt, char *out, int64_t n) {
  double u1[PAIRS], u2[PAIRS], v[2 * PAIRS];
  size_t es = rh_dtype_size(dt);
  for (int64_t at = 0; at < n; at += 2 * PAIRS) {
    for (int i = 0; i < PAIRS; i++) {
      u1[i] = 1.0 - uniform01(); /* (0, 1]: the log is finite */
      u2[i] = uniform01();
    }
    box_muller(u1, u2, v);
    int64_t m = n - at < 2 * PAIRS ? n - at : 2 * PAIRS;
    if (dt == RH_F32) {
      float *o = (float *)out + at;
      for (int64_t i = 0; i < m; i++) o[i] = (float)v[i];
    } else if (dt == RH_F64) {
      memcpy((double *)out + at, v, (size_t)m * sizeof(double));
    } else {
      for (int64_t i = 0; i < m; i++) rh__store(dt, out + (size_t)(at + i) * es, v[i]);
    }
  }
}

/* uniform in [0, 1) (normal = 0) or standard normal (normal = 1) */
rh_tensor_t *rh_tensor_rand(rh_dtype_t dt, int ndim, const int64_t *size, int normal) {
  if (!rh_dtype_is_float(dt)) {
    rh_tensor_fail("%s: expected a floating point dtype, got %s", normal ? "randn" : "rand", rh_dtype_name(dt));
    return NULL;
  }
  rh_tensor_t *t = rh_tensor_empty(dt, ndim, size);
  if (!t) return NULL;
  int64_t n = rh_tensor_numel(t);
  char *p = rh_tensor_data(t);
  if (normal) {
    fill_normal(dt, p, n);
    return t;
  }
  size_t es = rh_dtype_size(dt);
  if (dt == RH_F32) {
    /* 24 bits: a 53-bit draw rounded to float could round up to 1 */
    for (int64_t i = 0; i < n; i++) ((float *)p)[i] = (float)(next_u64() >> 40) * 0x1.0p-24f;
  } else {
    for (int64_t i = 0; i < n; i++) rh__store(dt, p + (size_t)i * es, uniform01());
  }
  return t;
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
    rh__store(p->dtype, (char *)rh_tensor_data(out) + i * es, uniform01() < q ? 1 : 0);
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
      double u = uniform01() * total;
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
