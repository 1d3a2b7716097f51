/* nn_conv.c: 2-d convolution (forward and backward) for nn.Conv1d/Conv2d, as
 * im2col + one OpenBLAS GEMM per sample and group (what PyTorch's CPU
 * slow_conv2d does): the column buffer is one sample's worth, so memory stays
 * at the size of the output, and im2col/col2im are split over the thread pool
 * while GEMM uses OpenBLAS's own threads. A 1x1 kernel with stride 1 and no
 * padding reads the input itself as its columns. */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "nn.h"
#include "tensor_internal.h"

int64_t rh_nn_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil, int ceil_mode) {
  int64_t num = in + 2 * pad - (dil * (k - 1) + 1);
  if (num < 0 || stride < 1) return 0;
  int64_t o = (ceil_mode ? (num + stride - 1) / stride : num / stride) + 1;
  /* as PyTorch: with ceil_mode the last window must start inside the input or the left padding */
  if (ceil_mode && (o - 1) * stride >= in + pad) o--;
  return o;
}

/* C[m,n] (+)= op(A) op(B), row-major, float or double */
static void gemm(rh_dtype_t dt, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda,
                 const void *b, int64_t ldb, double beta, void *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (dt == RH_F32)
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                1.0f, a, (int)lda, b, (int)ldb, (float)beta, c, (int)ldc);
  else
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                1.0, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

typedef struct {
  rh_dtype_t dt;
  const char *x; /* one sample [C,H,W] */
  char *cols;    /* [C*kh*kw, oh*ow] */
  int64_t c, h, w, kh, kw, oh, ow;
  const rh_nn_conv_t *p;
} cols_job_t;

#define IM2COL_ROW(T)                                                                                  \
  do {                                                                                                 \
    const T *x = (const T *)j->x;                                                                      \
    T *col = (T *)j->cols;                                                                             \
    for (int64_t r = lo; r < hi; r++) {                                                                \
      int64_t ci = r / (j->kh * j->kw), ki = (r / j->kw) % j->kh, kj = r % j->kw;                      \
      const T *plane = x + ci * j->h * j->w;                                                           \
      T *dst = col + r * j->oh * j->ow;                                                                \
      for (int64_t oy = 0; oy < j->oh; oy++) {                                                         \
        int64_t iy = oy * p->stride[0] - p->pad[0] + ki * p->dil[0];                                   \
        T *d = dst + oy * j->ow;                                                                       \
        if (iy < 0 || iy >= j->h) {                                                                    \
          memset(d, 0, sizeof(T) * (size_t)j->ow);                                                     \
          continue;                                                                                    \
        }                                                                                              \
        const T *srow = plane + iy * j->w;                                                             \
        for (int64_t ox = 0; ox < j->ow; ox++) {                                                       \
          int64_t ix = ox * p->stride[1] - p->pad[1] + kj * p->dil[1];                                 \
          d[ox] = (ix >= 0 && ix < j->w) ? srow[ix] : (T)0;                                            \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
  } while (0)

static void im2col_rows(void *ctx, int64_t lo, int64_t hi) {
  cols_job_t *j = ctx;
  const rh_nn_conv_t *p = j->p;
  if (j->dt == RH_F32) IM2COL_ROW(float);
  else IM2COL_ROW(double);
}

/* adds the columns back into the image, one channel per task (a channel's rows
 * only touch its own plane, so tasks never write the same element) */
#define COL2IM_CH(T)                                                                                   \
  do {                                                                                                 \
    T *x = (T *)j->x;                                                                                  \
    const T *col = (const T *)j->cols;                                                                 \
    for (int64_t ci = lo; ci < hi; ci++) {                                                             \
      T *plane = x + ci * j->h * j->w;                                                                 \
      for (int64_t ki = 0; ki < j->kh; ki++)                                                           \
        for (int64_t kj = 0; kj < j->kw; kj++) {                                                       \
          const T *src = col + ((ci * j->kh + ki) * j->kw + kj) * j->oh * j->ow;                       \
          for (int64_t oy = 0; oy < j->oh; oy++) {                                                     \
            int64_t iy = oy * p->stride[0] - p->pad[0] + ki * p->dil[0];                               \
            if (iy < 0 || iy >= j->h) continue;                                                        \
            T *drow = plane + iy * j->w;                                                               \
            const T *s = src + oy * j->ow;                                                             \
            for (int64_t ox = 0; ox < j->ow; ox++) {                                                   \
              int64_t ix = ox * p->stride[1] - p->pad[1] + kj * p->dil[1];                             \
              if (ix >= 0 && ix < j->w) drow[ix] += s[ox];                                             \
            }                                                                                          \
          }                                                                                            \
        }                                                                                              \
    }                                                                                                  \
  } while (0)

static void col2im_channels(void *ctx, int64_t lo, int64_t hi) {
  cols_job_t *j = ctx;
  const rh_nn_conv_t *p = j->p;
  if (j->dt == RH_F32) COL2IM_CH(float);
  else COL2IM_CH(double);
}

typedef struct {
  int64_t n, c, h, w, o, kh, kw, oh, ow, g, cg, og, kg, l;
  int direct; /* 1x1, stride 1, no padding: the input is its own column matrix */
} geom_t;

static int check(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p, geom_t *g) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("conv2d: expected a float32 or float64 input, got %s", rh_dtype_name(x->dtype));
  if (w->dtype != x->dtype || (b && b->dtype != x->dtype))
    return rh_tensor_fail("conv2d: input, weight and bias must have one dtype (got %s, %s)", rh_dtype_name(x->dtype),
                          rh_dtype_name(w->dtype));
  if (RH_ON_DEVICE(x) || RH_ON_DEVICE(w) || (b && RH_ON_DEVICE(b)))
    return rh_tensor_fail("conv2d: the C kernel takes host tensors");
  if (x->ndim != 4 || w->ndim != 4) return rh_tensor_fail("conv2d: expected 4-d input and weight");
  if (p->groups < 1) return rh_tensor_fail("conv2d: groups must be positive, got %lld", (long long)p->groups);
  for (int i = 0; i < 2; i++)
    if (p->stride[i] < 1 || p->dil[i] < 1 || p->pad[i] < 0)
      return rh_tensor_fail("conv2d: stride and dilation must be positive and padding non-negative");
  g->n = x->size[0], g->c = x->size[1], g->h = x->size[2], g->w = x->size[3];
  g->o = w->size[0], g->kh = w->size[2], g->kw = w->size[3], g->g = p->groups;
  if (g->c % g->g || g->o % g->g)
    return rh_tensor_fail("conv2d: in_channels %lld and out_channels %lld must be divisible by groups %lld",
                          (long long)g->c, (long long)g->o, (long long)g->g);
  g->cg = g->c / g->g, g->og = g->o / g->g;
  if (w->size[1] != g->cg)
    return rh_tensor_fail("conv2d: weight has %lld input channels per group, the input %lld", (long long)w->size[1],
                          (long long)g->cg);
  if (b && (b->ndim != 1 || b->size[0] != g->o))
    return rh_tensor_fail("conv2d: bias must have %lld elements", (long long)g->o);
  g->oh = rh_nn_out_size(g->h, g->kh, p->stride[0], p->pad[0], p->dil[0], 0);
  g->ow = rh_nn_out_size(g->w, g->kw, p->stride[1], p->pad[1], p->dil[1], 0);
  if (g->oh < 1 || g->ow < 1)
    return rh_tensor_fail("conv2d: the kernel (%lld x %lld, dilated) is larger than the padded input (%lld x %lld)",
                          (long long)g->kh, (long long)g->kw, (long long)(g->h + 2 * p->pad[0]),
                          (long long)(g->w + 2 * p->pad[1]));
  g->kg = g->cg * g->kh * g->kw;
  g->l = g->oh * g->ow;
  g->direct = g->kh == 1 && g->kw == 1 && p->stride[0] == 1 && p->stride[1] == 1 && p->pad[0] == 0 &&
              p->pad[1] == 0;
  return 0;
}

static void make_cols(const geom_t *g, const rh_nn_conv_t *p, rh_dtype_t dt, const char *xn, char *cols) {
  cols_job_t j = {dt, xn, cols, g->c, g->h, g->w, g->kh, g->kw, g->oh, g->ow, p};
  rh_parallel_for(g->c * g->kh * g->kw, 4, im2col_rows, &j);
}

rh_tensor_t *rh_nn_conv2d(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p) {
  geom_t g = {0};
  if (check(x, w, b, p, &g)) return NULL;
  rh_dtype_t dt = x->dtype;
  size_t es = rh_dtype_size(dt);
  rh_tensor_t *xc = rh_tensor_contiguous(x), *wc = rh_tensor_contiguous(w);
  rh_tensor_t *y = rh_tensor_empty(dt, 4, (int64_t[]){g.n, g.o, g.oh, g.ow});
  char *cols = g.direct ? NULL : malloc((size_t)(g.c * g.kh * g.kw * g.l) * es);
  if (!xc || !wc || !y || (!g.direct && !cols)) {
    free(cols);
    if (xc) rh_tensor_release(xc);
    if (wc) rh_tensor_release(wc);
    if (y) rh_tensor_release(y);
    rh_tensor_fail("conv2d: out of memory");
    return NULL;
  }
  const char *xd = rh_tensor_data(xc), *wd = rh_tensor_data(wc);
  char *yd = rh_tensor_data(y);
  for (int64_t n = 0; n < g.n; n++) {
    const char *xn = xd + (size_t)(n * g.c * g.h * g.w) * es;
    const char *cn = xn;
    if (!g.direct) {
      make_cols(&g, p, dt, xn, cols);
      cn = cols;
    }
    char *yn = yd + (size_t)(n * g.o * g.l) * es;
    for (int64_t gi = 0; gi < g.g; gi++)
      gemm(dt, 0, 0, g.og, g.l, g.kg, wd + (size_t)(gi * g.og * g.kg) * es, g.kg, cn + (size_t)(gi * g.kg * g.l) * es,
           g.l, 0.0, yn + (size_t)(gi * g.og * g.l) * es, g.l);
    if (b) {
      for (int64_t o = 0; o < g.o; o++) {
        double bv = rh__load(dt, (const char *)rh_tensor_data(b) + (size_t)o * (size_t)b->stride[0] * es);
        if (dt == RH_F32) {
          float *r = (float *)yn + o * g.l;
          for (int64_t i = 0; i < g.l; i++) r[i] += (float)bv;
        } else {
          double *r = (double *)yn + o * g.l;
          for (int64_t i = 0; i < g.l; i++) r[i] += bv;
        }
      }
    }
  }
  free(cols);
  rh_tensor_release(xc);
  rh_tensor_release(wc);
  return y;
}

int rh_nn_conv2d_backward(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *gy, const rh_nn_conv_t *p, rh_tensor_t **gx,
                          rh_tensor_t **gw, rh_tensor_t **gb) {
  geom_t g = {0};
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (check(x, w, NULL, p, &g)) return -1;
  if (gy->dtype != x->dtype || gy->ndim != 4 || gy->size[0] != g.n || gy->size[1] != g.o || gy->size[2] != g.oh ||
      gy->size[3] != g.ow || RH_ON_DEVICE(gy))
    return rh_tensor_fail("conv2d backward: the gradient must be [%lld, %lld, %lld, %lld] %s on the host",
                          (long long)g.n, (long long)g.o, (long long)g.oh, (long long)g.ow, rh_dtype_name(x->dtype));
  rh_dtype_t dt = x->dtype;
  size_t es = rh_dtype_size(dt);
  int64_t kk = g.c * g.kh * g.kw;
  rh_tensor_t *xc = rh_tensor_contiguous(x), *wc = rh_tensor_contiguous(w), *gyc = rh_tensor_contiguous(gy);
  rh_tensor_t *tx = gx ? rh_tensor_full(dt, 4, x->size, 0) : NULL;
  rh_tensor_t *tw = gw ? rh_tensor_full(dt, 4, w->size, 0) : NULL;
  rh_tensor_t *tb = gb ? rh_tensor_full(dt, 1, (int64_t[]){g.o}, 0) : NULL;
  char *cols = malloc((size_t)(kk * g.l) * es + 1);
  if (!xc || !wc || !gyc || (gx && !tx) || (gw && !tw) || (gb && !tb) || !cols) {
    free(cols);
    rh_tensor_t *all[] = {xc, wc, gyc, tx, tw, tb};
    for (int i = 0; i < 6; i++)
      if (all[i]) rh_tensor_release(all[i]);
    return rh_tensor_fail("conv2d backward: out of memory");
  }
  const char *xd = rh_tensor_data(xc), *wd = rh_tensor_data(wc), *gyd = rh_tensor_data(gyc);
  for (int64_t n = 0; n < g.n; n++) {
    const char *gyn = gyd + (size_t)(n * g.o * g.l) * es;
    if (tw) {
      const char *xn = xd + (size_t)(n * g.c * g.h * g.w) * es;
      const char *cn = xn;
      if (!g.direct) {
        make_cols(&g, p, dt, xn, cols);
        cn = cols;
      }
      /* gW_g += gY_g [og, l] @ cols_g^T [l, kg] */
      for (int64_t gi = 0; gi < g.g; gi++)
        gemm(dt, 0, 1, g.og, g.kg, g.l, gyn + (size_t)(gi * g.og * g.l) * es, g.l,
             cn + (size_t)(gi * g.kg * g.l) * es, g.l, 1.0, (char *)rh_tensor_data(tw) + (size_t)(gi * g.og * g.kg) * es,
             g.kg);
    }
    if (tx) {
      char *gxn = (char *)rh_tensor_data(tx) + (size_t)(n * g.c * g.h * g.w) * es;
      /* gcols_g = W_g^T [kg, og] @ gY_g [og, l]; the direct case writes the image */
      char *dst = g.direct ? gxn : cols;
      for (int64_t gi = 0; gi < g.g; gi++)
        gemm(dt, 1, 0, g.kg, g.l, g.og, wd + (size_t)(gi * g.og * g.kg) * es, g.kg,
             gyn + (size_t)(gi * g.og * g.l) * es, g.l, 0.0, dst + (size_t)(gi * g.kg * g.l) * es, g.l);
      if (!g.direct) {
        cols_job_t j = {dt, gxn, cols, g.c, g.h, g.w, g.kh, g.kw, g.oh, g.ow, p};
        rh_parallel_for(g.c, 1, col2im_channels, &j);
      }
    }
    if (tb) {
      char *bd = rh_tensor_data(tb);
      for (int64_t o = 0; o < g.o; o++) {
        double s = 0;
        if (dt == RH_F32) {
          const float *r = (const float *)gyn + o * g.l;
          for (int64_t i = 0; i < g.l; i++) s += r[i];
          ((float *)bd)[o] += (float)s;
        } else {
          const double *r = (const double *)gyn + o * g.l;
          for (int64_t i = 0; i < g.l; i++) s += r[i];
          ((double *)bd)[o] += s;
        }
      }
    }
  }
  free(cols);
  rh_tensor_release(xc);
  rh_tensor_release(wc);
  rh_tensor_release(gyc);
  if (gx) *gx = tx;
  if (gw) *gw = tw;
  if (gb) *gb = tb;
  return 0;
}
