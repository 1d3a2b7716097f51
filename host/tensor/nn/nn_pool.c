/* nn_pool.c: 2-d max, average and adaptive average pooling (forward and
 * backward) for nn.MaxPool2d/AvgPool2d/AdaptiveAvgPool2d, PyTorch's window
 * rules (padding, dilation for max, ceil_mode, count_include_pad, divisor_override).
 * Each N*C plane is independent, so planes are split over the thread pool. Max
 * pooling keeps the argmax (an index into the plane) for its backward. */
#include <math.h>
#include <string.h>

#include "nn_geom.h"
#include "tensor/tensor_internal.h"

typedef struct {
  rh_dtype_t dt;
  const char *x;
  char *y;
  int64_t *idx;
  int64_t h, w, oh, ow;
  const rh_nn_pool_t *p;
} pool_job_t;

static int check_input(const char *what, rh_tensor_t *x) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("%s: expected a float32 or float64 tensor, got %s", what, rh_dtype_name(x->dtype));
  if (RH_ON_DEVICE(x)) return rh_tensor_fail("%s: the C kernel takes host tensors", what);
  if (x->ndim != 4) return rh_tensor_fail("%s: expected a 4-d tensor [N, C, H, W]", what);
  return 0;
}

static double ld(rh_dtype_t dt, const char *base, int64_t i) {
  return dt == RH_F32 ? (double)((const float *)base)[i] : ((const double *)base)[i];
}
static void st(rh_dtype_t dt, char *base, int64_t i, double v) {
  if (dt == RH_F32) ((float *)base)[i] = (float)v;
  else ((double *)base)[i] = v;
}
static void add(rh_dtype_t dt, char *base, int64_t i, double v) {
  if (dt == RH_F32) ((float *)base)[i] += (float)v;
  else ((double *)base)[i] += v;
}

/* the taps k in [0, kn) of output o whose input o * s - pad + k * d lies in
 * [0, n): [*lo, *hi) (the rest of the window is padding) */
static void taps(int64_t o, int64_t s, int64_t pad, int64_t d, int64_t kn, int64_t n, int64_t *lo, int64_t *hi) {
  int64_t start = o * s - pad;
  int64_t a = start >= 0 ? 0 : (-start + d - 1) / d;
  int64_t b = n - 1 - start < 0 ? 0 : (n - 1 - start) / d + 1;
  if (b > kn) b = kn;
  *lo = a, *hi = a > b ? a : b;
}

/* output ox of row oy by scanning its window (the edges, where part of it is padding) */
#define MAX_ONE(T, ox)                                           \
  do {                                                           \
    int64_t l0, l1, bi = -1;                                     \
    taps(ox, sx, p->pad[1], p->dil[1], p->k[1], j->w, &l0, &l1); \
    T best = (T)-INFINITY;                                       \
    for (int64_t ki = k0; ki < k1 && best == best; ki++) {       \
      int64_t iy = oy * sy - p->pad[0] + ki * p->dil[0];         \
      for (int64_t kj = l0; kj < l1; kj++) {                     \
        int64_t ix = (ox)*sx - p->pad[1] + kj * p->dil[1];       \
        T v = x[iy * j->w + ix];                                 \
        if (bi < 0 || v > best || v != v) {                      \
          best = v;                                              \
          bi = iy * j->w + ix;                                   \
          if (v != v) break;                                     \
        }                                                        \
      }                                                          \
    }                                                            \
    yr[ox] = best;                                               \
    ir[ox] = bi;                                                 \
  } while (0)

/* One pass per plane that keeps the argmax beside the value; the first of
 * equal maxima wins, and the first NaN beats everything (as PyTorch). Where
 * the whole row of a window is inside the input, each output runs its taps
 * in registers, branch-free (the maximum's place is random: a branch on it
 * mispredicts). */
#define MAX_PLANES(T)                                                                                       \
  do {                                                                                                      \
    int64_t sy = p->stride[0], sx = p->stride[1], kw = p->k[1], dx = p->dil[1];                             \
    int64_t a = (p->pad[1] + sx - 1) / sx, b = j->w - 1 - (kw - 1) * dx + p->pad[1];                        \
    b = b < 0 ? 0 : b / sx + 1;                                                                             \
    if (b > j->ow) b = j->ow;                                                                               \
    if (a > b) a = b;                                                                                       \
    for (int64_t pl = lo; pl < hi; pl++) {                                                                  \
      const T *x = (const T *)j->x + pl * j->h * j->w;                                                      \
      for (int64_t oy = 0; oy < j->oh; oy++) {                                                              \
        T *yr = (T *)j->y + (pl * j->oh + oy) * j->ow;                                                      \
        int64_t *ir = j->idx + (pl * j->oh + oy) * j->ow, k0, k1;                                           \
        taps(oy, sy, p->pad[0], p->dil[0], p->k[0], j->h, &k0, &k1);                                        \
        for (int64_t ox = 0; ox < a; ox++) MAX_ONE(T, ox);                                                  \
        for (int64_t ox = b; ox < j->ow; ox++) MAX_ONE(T, ox);                                              \
        if (k0 == k1) { /* a window of padding only (then -inf, index -1) */                                \
          for (int64_t ox = a; ox < b; ox++) MAX_ONE(T, ox);                                                \
          continue;                                                                                         \
        }                                                                                                   \
        for (int64_t o0 = a; o0 < b; o0 += ROW_CHUNK) { /* ib holds ROW_CHUNK */                            \
          int64_t row0 = (oy * sy - p->pad[0] + k0 * p->dil[0]) * j->w - p->pad[1] + o0 * sx;               \
          max_row_##T(x + row0, yr + o0, ir + o0, ib, b - o0 < ROW_CHUNK ? b - o0 : ROW_CHUNK, sx, k1 - k0, \
                      p->dil[0] * j->w, kw, dx, row0);                                                      \
        }                                                                                                   \
      }                                                                                                     \
    }                                                                                                       \
  } while (0)

/* n outputs of a row whose windows are all inside the input: window o starts
 * at x + o * sx, its taps rows ky (dy apart) by kx (dx apart). The taps are the
 * outer loop and the outputs the inner one, with no branch on the data, so it
 * vectorises: the maximum's place is random, and a branch on it mispredicts.
 * ib holds the running argmax as int32 (the width of a float32 lane). */
#define MAX_ROW(T)                                                                                                    \
  static void max_row_##T(const T *restrict x, T *restrict y, int64_t *restrict idx, int32_t *restrict ib, int64_t n, \
                          int64_t sx, int64_t ky, int64_t dy, int64_t kx, int64_t dx, int64_t at) {                   \
    for (int64_t o = 0; o < n; o++) y[o] = x[o * sx], ib[o] = 0;                                                      \
    for (int64_t r = 0; r < ky; r++)                                                                                  \
      for (int64_t c = 0; c < kx; c++) {                                                                              \
        if (r == 0 && c == 0) continue;                                                                               \
        const T *src = x + r * dy + c * dx;                                                                           \
        int32_t off = (int32_t)(r * dy + c * dx);                                                                     \
        for (int64_t o = 0; o < n; o++) {                                                                             \
          T v = src[o * sx], b = y[o];                                                                                \
          int take = (v > b) | ((v != v) & (b == b));                                                                 \
          y[o] = take ? v : b;                                                                                        \
          ib[o] = take ? off : ib[o];                                                                                 \
        }                                                                                                             \
      }                                                                                                               \
    for (int64_t o = 0; o < n; o++) idx[o] = at + o * sx + ib[o];                                                     \
  }
MAX_ROW(float)
MAX_ROW(double)
#define ROW_CHUNK 1024

static void max_planes(void *ctx, int64_t lo, int64_t hi) {
  pool_job_t *j = ctx;
  const rh_nn_pool_t *p = j->p;
  int32_t ib[ROW_CHUNK];
  if (j->dt == RH_F32) MAX_PLANES(float);
  else MAX_PLANES(double);
}

int rh_nn_max_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p, rh_tensor_t **y, rh_tensor_t **idx) {
  int64_t oh, ow;
  *y = *idx = NULL;
  if (check_input("max_pool2d", x) || rh__nn_pool_geom("max_pool2d", x->size[2], x->size[3], p, 1, &oh, &ow)) return -1;
  rh_tensor_t *xc = rh_tensor_contiguous(x);
  int64_t size[4] = {x->size[0], x->size[1], oh, ow};
  rh_tensor_t *ty = rh_tensor_empty(x->dtype, 4, size), *ti = rh_tensor_empty(RH_I64, 4, size);
  if (!xc || !ty || !ti) {
    rh__nn_release((rh_tensor_t *[]){xc, ty, ti}, 3);
    return rh_tensor_fail("max_pool2d: out of memory");
  }
  pool_job_t j = {x->dtype, rh_tensor_data(xc), rh_tensor_data(ty), rh_tensor_data(ti), x->size[2], x->size[3], oh, ow,
                  p};
  rh_parallel_for(x->size[0] * x->size[1], rh_parallel_grain(oh * ow * p->k[0] * p->k[1]), max_planes, &j);
  rh_tensor_release(xc);
  *y = ty;
  *idx = ti;
  return 0;
}

typedef struct {
  rh_dtype_t dt;
  const char *g;
  const int64_t *ix;
  char *d;
  int64_t per, hw;
} max_back_job_t;

/* each plane's indices point into its own plane of gx, which its task zeroes
 * first (warm in cache, and no calloc'd fresh pages for the whole tensor) */
#define MAX_BACK_PLANES(T)                                 \
  do {                                                     \
    for (int64_t pl = lo; pl < hi; pl++) {                 \
      const T *g = (const T *)j->g + pl * j->per;          \
      const int64_t *ix = j->ix + pl * j->per;             \
      T *d = (T *)j->d + pl * j->hw;                       \
      memset(d, 0, sizeof(T) * (size_t)j->hw);             \
      for (int64_t i = 0; i < j->per; i++)                 \
        if (ix[i] >= 0 && ix[i] < j->hw) d[ix[i]] += g[i]; \
    }                                                      \
  } while (0)

static void max_back_planes(void *ctx, int64_t lo, int64_t hi) {
  max_back_job_t *j = ctx;
  if (j->dt == RH_F32) MAX_BACK_PLANES(float);
  else MAX_BACK_PLANES(double);
}

rh_tensor_t *rh_nn_max_pool2d_backward(rh_tensor_t *gy, rh_tensor_t *idx, int64_t h, int64_t w) {
  if (check_input("max_pool2d backward", gy)) return NULL;
  if (idx->dtype != RH_I64 || idx->ndim != 4 || memcmp(idx->size, gy->size, 4 * sizeof(int64_t))) {
    rh_tensor_fail("max_pool2d backward: indices must be int64 of the gradient's shape");
    return NULL;
  }
  rh_tensor_t *gc = rh_tensor_contiguous(gy), *ic = rh_tensor_contiguous(idx);
  rh_tensor_t *gx = rh_tensor_empty(gy->dtype, 4, (int64_t[]){gy->size[0], gy->size[1], h, w});
  if (!gc || !ic || !gx) {
    rh__nn_release((rh_tensor_t *[]){gc, ic, gx}, 3);
    rh_tensor_fail("max_pool2d backward: out of memory");
    return NULL;
  }
  max_back_job_t j = {gy->dtype,          rh_tensor_data(gc),        rh_tensor_data(ic),
                      rh_tensor_data(gx), gy->size[2] * gy->size[3], h * w};
  rh_parallel_for(gy->size[0] * gy->size[1], rh_parallel_grain(h * w), max_back_planes, &j);
  rh_tensor_release(gc);
  rh_tensor_release(ic);
  return gx;
}

/* the window of output (oy, ox) for average pooling, clipped to the padded input,
 * and the divisor PyTorch uses for it */
static double avg_window(const pool_job_t *j, int64_t oy, int64_t ox, int64_t *y0, int64_t *y1, int64_t *x0,
                         int64_t *x1) {
  const rh_nn_pool_t *p = j->p;
  int64_t hs = oy * p->stride[0] - p->pad[0], ws = ox * p->stride[1] - p->pad[1];
  int64_t he = hs + p->k[0], we = ws + p->k[1];
  if (he > j->h + p->pad[0]) he = j->h + p->pad[0];
  if (we > j->w + p->pad[1]) we = j->w + p->pad[1];
  int64_t pool = (he - hs) * (we - ws);
  *y0 = hs < 0 ? 0 : hs, *x0 = ws < 0 ? 0 : ws;
  *y1 = he > j->h ? j->h : he, *x1 = we > j->w ? j->w : we;
  if (p->divisor) return (double)p->divisor;
  return p->count_include_pad ? (double)pool : (double)((*y1 - *y0) * (*x1 - *x0));
}

static void avg_planes(void *ctx, int64_t lo, int64_t hi) {
  pool_job_t *j = ctx;
  for (int64_t pl = lo; pl < hi; pl++) {
    const char *x = j->x + (size_t)(pl * j->h * j->w) * rh_dtype_size(j->dt);
    for (int64_t oy = 0; oy < j->oh; oy++)
      for (int64_t ox = 0; ox < j->ow; ox++) {
        int64_t y0, y1, x0, x1;
        double div = avg_window(j, oy, ox, &y0, &y1, &x0, &x1), s = 0;
        for (int64_t iy = y0; iy < y1; iy++)
          for (int64_t ix = x0; ix < x1; ix++) s += ld(j->dt, x, iy * j->w + ix);
        st(j->dt, j->y, (pl * j->oh + oy) * j->ow + ox, s / div);
      }
  }
}

static void avg_back_planes(void *ctx, int64_t lo, int64_t hi) {
  pool_job_t *j = ctx; /* x: the gradient of y, y: the gradient of x */
  for (int64_t pl = lo; pl < hi; pl++) {
    char *gx = j->y + (size_t)(pl * j->h * j->w) * rh_dtype_size(j->dt);
    for (int64_t oy = 0; oy < j->oh; oy++)
      for (int64_t ox = 0; ox < j->ow; ox++) {
        int64_t y0, y1, x0, x1;
        double div = avg_window(j, oy, ox, &y0, &y1, &x0, &x1);
        double g = ld(j->dt, j->x, (pl * j->oh + oy) * j->ow + ox) / div;
        for (int64_t iy = y0; iy < y1; iy++)
          for (int64_t ix = x0; ix < x1; ix++) add(j->dt, gx, iy * j->w + ix, g);
      }
  }
}

/* The average poolings' one way to run: fn over the planes of `in` (made
 * contiguous) into a new [n, c, h, w] result of in's dtype (zeroed
 * first for a backward, which adds into it), j holding the rest of the job;
 * NULL with "what: out of memory" */
static rh_tensor_t *run_planes(const char *what, rh_tensor_t *in, int64_t h, int64_t w, int zeroed, pool_job_t *j,
                               int64_t grain, void (*fn)(void *, int64_t, int64_t)) {
  int64_t size[4] = {in->size[0], in->size[1], h, w};
  rh_tensor_t *ic = rh_tensor_contiguous(in);
  rh_tensor_t *out = zeroed ? rh_tensor_full(in->dtype, 4, size, 0) : rh_tensor_empty(in->dtype, 4, size);
  if (!ic || !out) {
    rh__nn_release((rh_tensor_t *[]){ic, out}, 2);
    rh_tensor_fail("%s: out of memory", what);
    return NULL;
  }
  j->dt = in->dtype, j->x = rh_tensor_data(ic), j->y = rh_tensor_data(out);
  rh_parallel_for(size[0] * size[1], rh_parallel_grain(grain), fn, j);
  rh_tensor_release(ic);
  return out;
}

rh_tensor_t *rh_nn_avg_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p) {
  int64_t oh, ow;
  /* (avg pooling has no dilation: the geometry takes it as 1, avg_window never reads it) */
  if (check_input("avg_pool2d", x) || rh__nn_pool_geom("avg_pool2d", x->size[2], x->size[3], p, 0, &oh, &ow))
    return NULL;
  pool_job_t j = {.h = x->size[2], .w = x->size[3], .oh = oh, .ow = ow, .p = p};
  return run_planes("avg_pool2d", x, oh, ow, 0, &j, oh * ow * p->k[0] * p->k[1], avg_planes);
}

rh_tensor_t *rh_nn_avg_pool2d_backward(rh_tensor_t *gy, const rh_nn_pool_t *p, int64_t h, int64_t w) {
  if (check_input("avg_pool2d backward", gy)) return NULL;
  pool_job_t j = {.h = h, .w = w, .oh = gy->size[2], .ow = gy->size[3], .p = p};
  return run_planes("avg_pool2d backward", gy, h, w, 1, &j, h * w * p->k[0] * p->k[1], avg_back_planes);
}

/* PyTorch's adaptive windows: [floor(i*in/out), ceil((i+1)*in/out)) */
static int64_t a_start(int64_t i, int64_t in, int64_t out) { return (i * in) / out; }
static int64_t a_end(int64_t i, int64_t in, int64_t out) { return ((i + 1) * in + out - 1) / out; }

static void adaptive_planes(void *ctx, int64_t lo, int64_t hi) {
  pool_job_t *j = ctx;
  for (int64_t pl = lo; pl < hi; pl++) {
    const char *x = j->x + (size_t)(pl * j->h * j->w) * rh_dtype_size(j->dt);
    for (int64_t oy = 0; oy < j->oh; oy++)
      for (int64_t ox = 0; ox < j->ow; ox++) {
        int64_t y0 = a_start(oy, j->h, j->oh), y1 = a_end(oy, j->h, j->oh);
        int64_t x0 = a_start(ox, j->w, j->ow), x1 = a_end(ox, j->w, j->ow);
        double s = 0;
        for (int64_t iy = y0; iy < y1; iy++)
          for (int64_t ix = x0; ix < x1; ix++) s += ld(j->dt, x, iy * j->w + ix);
        st(j->dt, j->y, (pl * j->oh + oy) * j->ow + ox, s / (double)((y1 - y0) * (x1 - x0)));
      }
  }
}

static void adaptive_back_planes(void *ctx, int64_t lo, int64_t hi) {
  pool_job_t *j = ctx;
  for (int64_t pl = lo; pl < hi; pl++) {
    char *gx = j->y + (size_t)(pl * j->h * j->w) * rh_dtype_size(j->dt);
    for (int64_t oy = 0; oy < j->oh; oy++)
      for (int64_t ox = 0; ox < j->ow; ox++) {
        int64_t y0 = a_start(oy, j->h, j->oh), y1 = a_end(oy, j->h, j->oh);
        int64_t x0 = a_start(ox, j->w, j->ow), x1 = a_end(ox, j->w, j->ow);
        double g = ld(j->dt, j->x, (pl * j->oh + oy) * j->ow + ox) / (double)((y1 - y0) * (x1 - x0));
        for (int64_t iy = y0; iy < y1; iy++)
          for (int64_t ix = x0; ix < x1; ix++) add(j->dt, gx, iy * j->w + ix, g);
      }
  }
}

rh_tensor_t *rh_nn_adaptive_avg_pool2d(rh_tensor_t *x, int64_t oh, int64_t ow) {
  if (check_input("adaptive_avg_pool2d", x)) return NULL;
  if (oh < 1 || ow < 1) {
    rh_tensor_fail("adaptive_avg_pool2d: output_size must be positive, got (%lld, %lld)", (long long)oh, (long long)ow);
    return NULL;
  }
  pool_job_t j = {.h = x->size[2], .w = x->size[3], .oh = oh, .ow = ow};
  return run_planes("adaptive_avg_pool2d", x, oh, ow, 0, &j, x->size[2] * x->size[3], adaptive_planes);
}

rh_tensor_t *rh_nn_adaptive_avg_pool2d_backward(rh_tensor_t *gy, int64_t h, int64_t w) {
  if (check_input("adaptive_avg_pool2d backward", gy)) return NULL;
  pool_job_t j = {.h = h, .w = w, .oh = gy->size[2], .ow = gy->size[3]};
  return run_planes("adaptive_avg_pool2d backward", gy, h, w, 1, &j, h * w, adaptive_back_planes);
}
