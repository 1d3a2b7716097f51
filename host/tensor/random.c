/* random.c: random tensors: rand, randn, randint, randperm, bernoulli and
 * multinomial, drawn from generator.c's generator (PyTorch 1.13's CPU one) in
 * the order and by the arithmetic of torch's CPU kernels, so that a seed gives
 * torch's numbers (spec/random_spec.lua checks them against fixtures that
 * scripts/gen_random_fixtures.py wrote with torch):
 *   rand      one draw per element: float32 the low 24 bits of a 32-bit draw
 *             over 2^24, float64 the low 53 bits of a 64-bit draw over 2^53;
 *   randint   low + draw mod (high - low), modulo bias and all: a 64-bit draw
 *             when the range is 2^32 or more (int64 and float dtypes), else 32;
 *   randperm  swaps i with i + (32-bit draw mod (n - i)), i = 0 .. n - 2;
 *   randn     Box-Muller. Below 16 elements one sample at a time from two
 *             53-bit uniforms, the pair's sine kept in the generator for the
 *             next sample (next call included). From 16 on, every uniform is
 *             drawn first and turned 16 at a time (u[j] with u[j + 8]), a
 *             ragged end by drawing 16 more over the last 16: float64 with
 *             libm's log, sin and cos, float32 as torch's AVX2 kernel does it
 *             (the kernel torch picks on x86-64 CPUs with AVX2), whose float
 *             log and sincos (avx_mathfun's, Cephes' polynomials) are written
 *             out below one lane at a time.
 * bernoulli and multinomial draw 53-bit uniforms from the default generator
 * but are rpchost's own algorithms, not torch's. Everything is drawn on the
 * host, in order, then moved where the caller wants it: a seed gives the same
 * numbers on every device. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

static rh_rng_t *gen_or_default(rh_rng_t *g) { return g ? g : rh_rng_default(); }

/* torch's uniform_real_distribution on [0, 1) */
static inline float uniform_f32(rh_rng_t *g) { return (float)(rh_rng_u32(g) & 0xFFFFFFu) * 0x1.0p-24f; }
static inline double uniform_f64(rh_rng_t *g) { return (double)(rh_rng_u64(g) & ((1ull << 53) - 1)) * 0x1.0p-53; }

static inline uint32_t bits_f32(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}
static inline float f32_of(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* avx_mathfun's constants, float-rounded from the same decimals as there */
static const float LOG_SQRTHF = 0.707106781186547524, LOG_P0 = 7.0376836292E-2, LOG_P1 = -1.1514610310E-1,
                   LOG_P2 = 1.1676998740E-1, LOG_P3 = -1.2420140846E-1, LOG_P4 = 1.4249322787E-1,
                   LOG_P5 = -1.6668057665E-1, LOG_P6 = 2.0000714765E-1, LOG_P7 = -2.4999993993E-1,
                   LOG_P8 = 3.3333331174E-1, LOG_Q1 = -2.12194440e-4, LOG_Q2 = 0.693359375;
static const float TRIG_FOPI = 1.27323954473516, TRIG_MDP1 = -0.78515625, TRIG_MDP2 = -2.4187564849853515625e-4,
                   TRIG_MDP3 = -3.77489497744594108e-8, SIN_P0 = -1.9515295891E-4, SIN_P1 = 8.3321608736E-3,
                   SIN_P2 = -1.6666654611E-1, COS_P0 = 2.443315711809948E-005, COS_P1 = -1.388731625493765E-003,
                   COS_P2 = 4.166664568298827E-002;

/* log256_ps for one lane, x in [2^-24, 1] (1 - a uniform). The fmaf calls are
 * where GCC fused torch's multiply and add intrinsics into one rounding (it
 * compiles them as plain vector arithmetic and contracts them): a multiply
 * whose only use is an add, the first such in each add. This file is ISO C,
 * so GCC fuses nothing here by itself; z * 0.5f and e * LOG_Q2 are exact, so
 * fused or not they give the same. */
static inline __attribute__((always_inline)) float avx_log(float x) {
  uint32_t b = bits_f32(x);
  float e = (float)((int32_t)(b >> 23) - 0x7f) + 1.0f;
  float m = f32_of((b & ~0x7f800000u) | 0x3f000000u); /* the mantissa, in [0.5, 1) */
  uint32_t small = m < LOG_SQRTHF ? 0xffffffffu : 0;  /* then m doubles and e drops by one */
  float tmp = f32_of(bits_f32(m) & small);
  m = m - 1.0f;
  e = e - f32_of(0x3f800000u & small);
  m = m + tmp;
  float z = m * m;
  float y = fmaf(LOG_P0, m, LOG_P1);
  y = fmaf(y, m, LOG_P2);
  y = fmaf(y, m, LOG_P3);
  y = fmaf(y, m, LOG_P4);
  y = fmaf(y, m, LOG_P5);
  y = fmaf(y, m, LOG_P6);
  y = fmaf(y, m, LOG_P7);
  y = fmaf(y, m, LOG_P8);
  y = y * m;
  y = fmaf(y, z, e * LOG_Q1);
  y = y - z * 0.5f;
  m = m + y;
  return m + e * LOG_Q2;
}

/* sincos256_ps for one lane, x >= 0 (2 pi u; the sign handling of a negative x
 * is left out): reduced by multiples of pi/4 in three exact-ish parts, one
 * polynomial for the sine and one for the cosine, swapped and signed by the
 * octant. Fused as avx_log is. */
static inline __attribute__((always_inline)) void avx_sincos(float x, float *s_out, float *c_out) {
  int32_t j = (int32_t)(x * TRIG_FOPI);
  j = (j + 1) & ~1;
  float y = (float)j;
  uint32_t sign_sin = (uint32_t)(j & 4) << 29, sign_cos = (uint32_t)(~(j - 2) & 4) << 29;
  uint32_t sine_poly = (j & 2) == 0 ? 0xffffffffu : 0; /* where the sine's polynomial gives the sine */
  x = fmaf(y, TRIG_MDP1, x);
  x = fmaf(y, TRIG_MDP2, x);
  x = fmaf(y, TRIG_MDP3, x);
  float z = x * x;
  float yc = fmaf(COS_P0, z, COS_P1);
  yc = fmaf(yc, z, COS_P2);
  yc = yc * z;
  yc = fmaf(yc, z, -(z * 0.5f));
  yc = yc + 1.0f;
  float ys = fmaf(SIN_P0, z, SIN_P1);
  ys = fmaf(ys, z, SIN_P2);
  ys = ys * z;
  ys = fmaf(ys, x, x);
  float s2 = f32_of(bits_f32(ys) & sine_poly), s1 = f32_of(bits_f32(yc) & ~sine_poly);
  ys = ys - s2;
  yc = yc - s1;
  *s_out = f32_of(bits_f32(s1 + s2) ^ sign_sin);
  *c_out = f32_of(bits_f32(yc + ys) ^ sign_cos);
}

/* 16 uniforms to 16 normals as torch's normal_fill_16_AVX2: u[j] (as 1 - u,
 * in (0, 1]) gives the radius, u[j + 8] the angle. "+ 0.0f" is torch's + mean
 * (an fma with std 1), which makes a -0 +0. */
RH_VEC_CLONES_FMA static void normal16_f32(float *d) {
  const float two_pi = (float)6.283185307179586;
  for (int j = 0; j < 8; j++) {
    float radius = sqrtf(-2.0f * avx_log(1.0f - d[j])), s, c;
    avx_sincos(two_pi * d[j + 8], &s, &c);
    d[j] = radius * c + 0.0f;
    d[j + 8] = radius * s + 0.0f;
  }
}

/* torch's normal_fill_16 for double */
static void normal16_f64(double *d) {
  for (int j = 0; j < 8; j++) {
    double radius = sqrt(-2.0 * log(1.0 - d[j])), theta = 6.283185307179586 * d[j + 8];
    d[j] = radius * cos(theta) + 0.0;
    d[j + 8] = radius * sin(theta) + 0.0;
  }
}

/* torch's normal_fill: n >= 16 uniforms, turned 16 at a time; a ragged end
 * draws 16 new uniforms over the last 16 (turned ones included) and turns them */
static void normal_fill_f32(rh_rng_t *g, float *d, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = uniform_f32(g);
  for (int64_t i = 0; i + 16 <= n; i += 16) normal16_f32(d + i);
  if (n % 16) {
    float *t = d + n - 16;
    for (int j = 0; j < 16; j++) t[j] = uniform_f32(g);
    normal16_f32(t);
  }
}
static void normal_fill_f64(rh_rng_t *g, double *d, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = uniform_f64(g);
  for (int64_t i = 0; i + 16 <= n; i += 16) normal16_f64(d + i);
  if (n % 16) {
    double *t = d + n - 16;
    for (int j = 0; j < 16; j++) t[j] = uniform_f64(g);
    normal16_f64(t);
  }
}

/* torch's normal_distribution<double>: one sample; each pair's sine waits in
 * the generator for the next call */
static double normal_one(rh_rng_t *g) {
  if (g->has_normal) {
    g->has_normal = 0;
    return g->normal + 0.0;
  }
  double u1 = uniform_f64(g), u2 = uniform_f64(g);
  double r = sqrt(-2.0 * log(1.0 - u2)), theta = 6.283185307179586 * u1;
  g->normal = r * sin(theta);
  g->has_normal = 1;
  return r * cos(theta) + 0.0;
}

/* n standard normals into out (a host buffer of float dtype dt), as torch's
 * normal kernel draws them for a new (contiguous) tensor */
static void fill_normal(rh_rng_t *g, rh_dtype_t dt, char *out, int64_t n) {
  if (n >= 16 && dt == RH_F32) {
    normal_fill_f32(g, (float *)out, n);
  } else if (n >= 16 && dt == RH_F64) {
    normal_fill_f64(g, (double *)out, n);
  } else {
    size_t es = rh_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) {
      double v = normal_one(g);
      if (dt == RH_F32) ((float *)out)[i] = (float)v;
      else rh__store(dt, out + (size_t)i * es, v);
    }
  }
}

/* uniform in [0, 1) (normal = 0) or standard normal (normal = 1) */
rh_tensor_t *rh_tensor_rand(rh_dtype_t dt, int ndim, const int64_t *size, int normal, rh_rng_t *g) {
  if (!rh_dtype_is_float(dt)) {
    rh_tensor_fail("%s: expected a floating point dtype, got %s", normal ? "randn" : "rand", rh_dtype_name(dt));
    return NULL;
  }
  rh_tensor_t *t = rh_tensor_empty(dt, ndim, size);
  if (!t) return NULL;
  g = gen_or_default(g);
  int64_t n = rh_tensor_numel(t);
  char *p = rh_tensor_data(t);
  if (normal) {
    fill_normal(g, dt, p, n);
    return t;
  }
  size_t es = rh_dtype_size(dt);
  if (dt == RH_F32) {
    for (int64_t i = 0; i < n; i++) ((float *)p)[i] = uniform_f32(g);
  } else {
    for (int64_t i = 0; i < n; i++) rh__store(dt, p + (size_t)i * es, uniform_f64(g));
  }
  return t;
}

/* integers uniform in [low, high), as torch's random_from_to kernel: the
 * 64-bit draw only for the dtypes torch gives it (int64, float, double) */
rh_tensor_t *rh_tensor_randint(rh_dtype_t dt, int64_t low, int64_t high, int ndim, const int64_t *size, rh_rng_t *g) {
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
  g = gen_or_default(g);
  int64_t n = rh_tensor_numel(t);
  uint64_t range = (uint64_t)high - (uint64_t)low;
  int wide = range >= (1ull << 32) && (dt == RH_I64 || dt == RH_F32 || dt == RH_F64);
  char *p = rh_tensor_data(t);
  size_t es = rh_dtype_size(dt);
  for (int64_t i = 0; i < n; i++) {
    uint64_t draw = wide ? rh_rng_u64(g) : rh_rng_u32(g);
    int64_t v = (int64_t)(draw % range + (uint64_t)low);
    if (dt == RH_I64) ((int64_t *)p)[i] = v;
    else if (dt == RH_F32) ((float *)p)[i] = (float)v; /* one rounding, as torch's cast */
    else rh__store(dt, p + i * es, (double)v);
  }
  return t;
}

/* a random permutation of base .. base + n - 1, torch's randperm_cpu: a
 * forward Fisher-Yates whose swap partner is a 32-bit draw mod what is left */
rh_tensor_t *rh_tensor_randperm(rh_dtype_t dt, int64_t n, int64_t base, rh_rng_t *g) {
  if (n < 0) {
    rh_tensor_fail("randperm: n must be non-negative, got %lld", (long long)n);
    return NULL;
  }
  rh_tensor_t *t = rh_tensor_empty(RH_I64, 1, &n);
  if (!t) return NULL;
  g = gen_or_default(g);
  int64_t *p = rh_tensor_data(t);
  for (int64_t i = 0; i < n; i++) p[i] = i + base;
  for (int64_t i = 0; i < n - 1; i++) {
    int64_t z = (int64_t)(rh_rng_u32(g) % (uint64_t)(n - i));
    int64_t x = p[i];
    p[i] = p[i + z];
    p[i + z] = x;
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
    rh__store(p->dtype, (char *)rh_tensor_data(out) + i * es, uniform_f64(rh_rng_default()) < q ? 1 : 0);
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
      double u = uniform_f64(rh_rng_default()) * total;
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
