/* nn_conv.c: 2-d convolution (forward and backward) for nn.Conv1d/Conv2d, as
 * im2col + OpenBLAS GEMMs per group (what PyTorch's CPU
 * slow_conv2d does), the batch split over the thread pool (see plan()). A
 * part's column buffer holds a few samples' worth at most, so memory stays near
 * the size of the output. A 1x1 kernel with stride 1 and no padding reads the
 * input itself as its columns. */
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

/* the output positions o in [0, nout) whose input index o * s + off falls in
 * [0, nin): [*lo, *hi). Outside it a window reads padding. */
static void valid_range(int64_t nin, int64_t nout, int64_t s, int64_t off, int64_t *lo, int64_t *hi) {
  int64_t a = off >= 0 ? 0 : (-off + s - 1) / s;
  int64_t b = nin - 1 - off < 0 ? 0 : (nin - 1 - off) / s + 1;
  if (b > nout) b = nout;
  if (a > b) a = b;
  *lo = a, *hi = b;
}

/* a kernel tap's output positions that read the input (not padding): rows
 * [y0, y1), columns [x0, x1); the same for every channel, so computed once per
 * sample rather than per column-matrix row (small maps made that the cost) */
typedef struct {
  int64_t y0, y1, x0, x1;
} tap_t;
#define CONV_TAPS 64 /* taps kept in a table; larger kernels compute them per row */

typedef struct {
  rh_dtype_t dt;
  const tap_t *taps; /* [kh * kw], or NULL */
  const char *x;     /* one sample [C,H,W] (col2im: written) */
  char *cols;    /* this sample's columns: row r at cols + r * ld elements, oh*ow of them */
  int64_t ld;
  int64_t c, h, w, kh, kw, oh, ow;
  const rh_nn_conv_t *p;
} cols_job_t;

static void tap_range(const cols_job_t *j, int64_t tap, int64_t offy, int64_t offx, int64_t *y0, int64_t *y1,
                      int64_t *x0, int64_t *x1) {
  if (j->taps) {
    const tap_t *t = &j->taps[tap];
    *y0 = t->y0, *y1 = t->y1, *x0 = t->x0, *x1 = t->x1;
    return;
  }
  valid_range(j->h, j->oh, j->p->stride[0], offy, y0, y1);
  valid_range(j->w, j->ow, j->p->stride[1], offx, x0, x1);
}

/* row r = (channel, ki, kj) of the column matrix: the rows of the padded input
 * the kernel tap reads; only the edges are padding, the middle is one copy */
#define IM2COL_ROW(T)                                                                                  \
  do {                                                                                                 \
    const T *x = (const T *)j->x;                                                                      \
    T *col = (T *)j->cols;                                                                             \
    int64_t sy = p->stride[0], sx = p->stride[1], taps = j->kh * j->kw;                                \
    int64_t ci = lo / taps, tap = lo % taps; /* advanced per row: no divisions in the loop */          \
    for (int64_t r = lo; r < hi; r++) {                                                                \
      int64_t ki = tap / j->kw, kj = tap - ki * j->kw;                                                 \
      int64_t offy = ki * p->dil[0] - p->pad[0], offx = kj * p->dil[1] - p->pad[1], y0, y1, x0, x1;    \
      tap_range(j, tap, offy, offx, &y0, &y1, &x0, &x1);                                               \
      const T *plane = x + ci * j->h * j->w;                                                           \
      T *dst = col + r * j->ld;                                                                        \
      if (y0 > 0) memset(dst, 0, sizeof(T) * (size_t)(y0 * j->ow));                                    \
      for (int64_t oy = y0; oy < y1; oy++) {                                                           \
        T *d = dst + oy * j->ow;                                                                       \
        const T *srow = plane + (oy * sy + offy) * j->w + offx;                                        \
        for (int64_t ox = 0; ox < x0; ox++) d[ox] = 0;                                                 \
        /* small maps (ResNet's late stages: rows of 2..8) copy in the loop, not a call */            \
        if (sx == 1 && x1 - x0 >= 16) memcpy(d + x0, srow + x0, sizeof(T) * (size_t)(x1 - x0));       \
        else if (sx == 1)                                                                              \
          for (int64_t ox = x0; ox < x1; ox++) d[ox] = srow[ox];                                       \
        else                                                                                           \
          for (int64_t ox = x0; ox < x1; ox++) d[ox] = srow[ox * sx];                                  \
        for (int64_t ox = x1; ox < j->ow; ox++) d[ox] = 0;                                             \
      }                                                                                                \
      if (y1 < j->oh) memset(dst + y1 * j->ow, 0, sizeof(T) * (size_t)((j->oh - y1) * j->ow));          \
      if (++tap == taps) tap = 0, ci++;                                                                \
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
    int64_t sy = p->stride[0], sx = p->stride[1];                                                      \
    for (int64_t ci = lo; ci < hi; ci++) {                                                             \
      T *plane = x + ci * j->h * j->w;                                                                 \
      for (int64_t ki = 0; ki < j->kh; ki++)                                                           \
        for (int64_t kj = 0; kj < j->kw; kj++) {                                                       \
          const T *src = col + ((ci * j->kh + ki) * j->kw + kj) * j->ld;                               \
          int64_t offy = ki * p->dil[0] - p->pad[0], offx = kj * p->dil[1] - p->pad[1], y0, y1, x0, x1; \
          tap_range(j, ki * j->kw + kj, offy, offx, &y0, &y1, &x0, &x1);                               \
          for (int64_t oy = y0; oy < y1; oy++) {                                                       \
            T *drow = plane + (oy * sy + offy) * j->w + offx;                                          \
            const T *s = src + oy * j->ow;                                                             \
            if (sx == 1)                                                                               \
              for (int64_t ox = x0; ox < x1; ox++) drow[ox] += s[ox];                                  \
            else                                                                                       \
              for (int64_t ox = x0; ox < x1; ox++) drow[ox * sx] += s[ox];                             \
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

/* one sample's columns (or its image, for col2im) at column offset `at` of a block
 * whose rows are ld long; rows (channels) split over the pool, which runs them
 * inline when this is already inside a pool job */
static void sample_cols(const geom_t *g, const rh_nn_conv_t *p, rh_dtype_t dt, const char *xn, char *cols, int64_t ld,
                        int to_image) {
  tap_t taps[CONV_TAPS];
  int tabled = g->kh * g->kw <= CONV_TAPS;
  for (int64_t t = 0; tabled && t < g->kh * g->kw; t++) {
    int64_t offy = (t / g->kw) * p->dil[0] - p->pad[0], offx = (t % g->kw) * p->dil[1] - p->pad[1];
    valid_range(g->h, g->oh, p->stride[0], offy, &taps[t].y0, &taps[t].y1);
    valid_range(g->w, g->ow, p->stride[1], offx, &taps[t].x0, &taps[t].x1);
  }
  cols_job_t j = {dt, tabled ? taps : NULL, xn, cols, ld, g->c, g->h, g->w, g->kh, g->kw, g->oh, g->ow, p};
  if (to_image) rh_parallel_for(g->c, rh_parallel_grain(g->kh * g->kw * g->l), col2im_channels, &j);
  else rh_parallel_for(g->c * g->kh * g->kw, rh_parallel_grain(g->l), im2col_rows, &j);
}

/* How the batch is split. The samples go to `parts` contiguous ranges, one per
 * pool thread, each running im2col and single-threaded GEMMs on its own
 * buffers: nothing waits on another pool (OpenBLAS's threads spin-yielding
 * while ours did im2col, and ours while it did GEMM, wasted both cores). Within
 * a range, `nb` samples at a time share one GEMM ([og, kg] x [kg, nb*L]): small
 * feature maps (ResNet's later stages, L = 4..64) make one sample's product
 * too thin for BLAS to run well. One part (a batch of one, or one thread)
 * splits each product over the pool instead (rh__gemm). */
#define CONV_BLOCK_COLS 1024         /* nb*L this wide is enough for GEMM */
#define CONV_BLOCK_BYTES (8ll << 20) /* a part's column buffer beyond one sample */

typedef struct conv_job conv_job_t;
/* one GEMM block of a part: samples [n0, n0 + nbk), with the part's scratch */
typedef void (*conv_block_fn)(conv_job_t *j, int64_t part, int64_t n0, int64_t nbk, char *cols, char *blk);

struct conv_job {
  geom_t g;
  const rh_nn_conv_t *p;
  rh_dtype_t dt;
  size_t es;
  int64_t parts, per, nb; /* parts of `per` samples, GEMM blocks of nb */
  const char *x, *w, *b, *gy;
  char *y, *gx;
  char *gw;      /* part 0's weight-gradient sum: the result tensor's data */
  char *gw_more; /* [parts - 1][O * kg]: the other parts' sums, added to it after */
  double *gb;    /* [parts][O] */
  int failed;    /* a part's buffer could not be allocated */
  conv_block_fn block;
};

static void plan(conv_job_t *j) {
  const geom_t *g = &j->g;
  int64_t threads = rh_parallel_threads();
  j->parts = g->n < threads ? g->n : threads;
  if (j->parts < 1) j->parts = 1;
  j->per = (g->n + j->parts - 1) / j->parts;
  if (j->per < 1) j->per = 1; /* an empty batch: one part with nothing to do */
  j->parts = g->n ? (g->n + j->per - 1) / j->per : 1;
  int64_t nb = (CONV_BLOCK_COLS + g->l - 1) / g->l;
  int64_t fit = CONV_BLOCK_BYTES / ((g->c * g->kh * g->kw + g->o + 1) * g->l * (int64_t)j->es);
  if (nb > fit) nb = fit;
  if (nb > j->per) nb = j->per;
  j->nb = nb < 1 ? 1 : nb;
}

/* between a block [rows, nb*L] (row o: the block's samples side by side) and
 * the samples [n][rows][L]: outputs (rows = O), or a direct convolution's
 * inputs (rows = C, where the columns are the image) */
static void block_copy(const conv_job_t *j, char *block, char *samples, int64_t nbk, int64_t rows, int to_block) {
  int64_t l = j->g.l, ld = nbk * l;
  size_t row = (size_t)l * j->es;
  for (int64_t s = 0; s < nbk; s++)
    for (int64_t o = 0; o < rows; o++) {
      char *bp = block + (size_t)(o * ld + s * l) * j->es, *sp = samples + (size_t)((s * rows + o) * l) * j->es;
      if (to_block) memcpy(bp, sp, row);
      else memcpy(sp, bp, row);
    }
}

/* a part's scratch: columns for nb samples, and a block of outputs / output
 * gradients when nb > 1 (one sample's GEMM reads and writes it in place) */
static int part_buffers(conv_job_t *j, char **cols, char **blk) {
  const geom_t *g = &j->g;
  int64_t ld = j->nb * g->l;
  int in_place = g->direct && j->nb == 1;
  *cols = in_place ? NULL : malloc((size_t)(g->c * g->kh * g->kw * ld) * j->es);
  *blk = j->nb > 1 ? malloc((size_t)(g->o * ld) * j->es) : NULL;
  if ((!in_place && !*cols) || (j->nb > 1 && !*blk)) {
    free(*cols);
    free(*blk);
    __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
    return -1;
  }
  return 0;
}

/* the columns of samples [n0, n0 + nbk) side by side, or the input itself */
static const char *block_cols(conv_job_t *j, int64_t n0, int64_t nbk, char *cols) {
  const geom_t *g = &j->g;
  const char *x0 = j->x + (size_t)(n0 * g->c * g->h * g->w) * j->es;
  if (g->direct && nbk == 1) return x0;
  if (g->direct) { /* the columns are the samples' channels side by side */
    block_copy(j, cols, (char *)x0, nbk, g->c, 1);
    return cols;
  }
  for (int64_t s = 0; s < nbk; s++)
    sample_cols(g, j->p, j->dt, x0 + (size_t)(s * g->c * g->h * g->w) * j->es, cols + (size_t)(s * g->l) * j->es,
                nbk * g->l, 0);
  return cols;
}

/* the batch's parts, each with its own scratch, block by block through j->block */
static void run_parts(void *ctx, int64_t lo, int64_t hi) {
  conv_job_t *j = ctx;
  for (int64_t part = lo; part < hi; part++) {
    char *cols, *blk;
    if (part_buffers(j, &cols, &blk)) return;
    int64_t end = (part + 1) * j->per < j->g.n ? (part + 1) * j->per : j->g.n;
    for (int64_t n0 = part * j->per; n0 < end; n0 += j->nb)
      j->block(j, part, n0, end - n0 < j->nb ? end - n0 : j->nb, cols, blk);
    free(cols);
    free(blk);
  }
}

/* y of samples [n0, n0 + nbk) */
static void forward_block(conv_job_t *j, int64_t part, int64_t n0, int64_t nbk, char *cols, char *blk) {
  const geom_t *g = &j->g;
  size_t es = j->es;
  int64_t ld = nbk * g->l;
  (void)part;
  const char *cn = block_cols(j, n0, nbk, cols);
  char *yn = j->y + (size_t)(n0 * g->o * g->l) * es, *out = nbk > 1 ? blk : yn;
  for (int64_t gi = 0; gi < g->g; gi++)
    rh__gemm(j->dt, 0, 0, g->og, ld, g->kg, j->w + (size_t)(gi * g->og * g->kg) * es, g->kg,
             cn + (size_t)(gi * g->kg * ld) * es, ld, 0.0, out + (size_t)(gi * g->og * ld) * es, ld);
  for (int64_t o = 0; j->b && o < g->o; o++) {
    double bv = rh__load(j->dt, j->b + (size_t)o * es);
    if (j->dt == RH_F32) {
      float *r = (float *)out + o * ld;
      for (int64_t i = 0; i < ld; i++) r[i] += (float)bv;
    } else {
      double *r = (double *)out + o * ld;
      for (int64_t i = 0; i < ld; i++) r[i] += bv;
    }
  }
  if (nbk > 1) block_copy(j, blk, yn, nbk, g->o, 0);
}

rh_tensor_t *rh_nn_conv2d(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p) {
  conv_job_t j = {0};
  if (check(x, w, b, p, &j.g)) return NULL;
  j.p = p, j.dt = x->dtype, j.es = rh_dtype_size(x->dtype);
  rh_tensor_t *xc = rh_tensor_contiguous(x), *wc = rh_tensor_contiguous(w), *bc = b ? rh_tensor_contiguous(b) : NULL;
  rh_tensor_t *y = rh_tensor_empty(j.dt, 4, (int64_t[]){j.g.n, j.g.o, j.g.oh, j.g.ow});
  if (xc && wc && y && (!b || bc)) {
    j.x = rh_tensor_data(xc), j.w = rh_tensor_data(wc), j.b = bc ? rh_tensor_data(bc) : NULL;
    j.y = rh_tensor_data(y);
    plan(&j);
    j.block = forward_block;
    rh_parallel_for(j.parts, 1, run_parts, &j);
  }
  int failed = !xc || !wc || !y || (b && !bc) || j.failed;
  rh_tensor_release(xc);
  rh_tensor_release(wc);
  rh_tensor_release(bc);
  if (failed) {
    rh_tensor_release(y);
    rh_tensor_fail("conv2d: out of memory");
    return NULL;
  }
  return y;
}

/* the gradients from samples [n0, n0 + nbk): gx written, the part's gw and gb added to */
static void backward_block(conv_job_t *j, int64_t part, int64_t n0, int64_t nbk, char *cols, char *blk) {
  const geom_t *g = &j->g;
  size_t es = j->es;
  int64_t ld = nbk * g->l;
  char *gw = part == 0 ? j->gw : j->gw_more ? j->gw_more + (size_t)((part - 1) * g->o * g->kg) * es : NULL;
  double beta = n0 == part * j->per ? 0.0 : 1.0; /* a part's first block writes its sum, the rest add */
  double *gb = j->gb ? j->gb + part * g->o : NULL;
  char *gyn = (char *)j->gy + (size_t)(n0 * g->o * g->l) * es, *gyb = gyn;
  if (nbk > 1) {
    block_copy(j, blk, gyn, nbk, g->o, 1);
    gyb = blk;
  }
  if (gw) {
    /* gW_g += gY_g [og, ld] @ cols_g^T [ld, kg] */
    const char *cn = block_cols(j, n0, nbk, cols);
    for (int64_t gi = 0; gi < g->g; gi++)
      rh__gemm(j->dt, 0, 1, g->og, g->kg, ld, gyb + (size_t)(gi * g->og * ld) * es, ld,
               cn + (size_t)(gi * g->kg * ld) * es, ld, beta, gw + (size_t)(gi * g->og * g->kg) * es, g->kg);
  }
  for (int64_t o = 0; gb && o < g->o; o++) {
    double sum = 0;
    if (j->dt == RH_F32) {
      const float *r = (const float *)gyb + o * ld;
      for (int64_t i = 0; i < ld; i++) sum += r[i];
    } else {
      const double *r = (const double *)gyb + o * ld;
      for (int64_t i = 0; i < ld; i++) sum += r[i];
    }
    gb[o] += sum;
  }
  if (j->gx) {
    /* gcols_g = W_g^T [kg, og] @ gY_g [og, ld], added back into each image
     * (the direct case's columns are the image: the product writes it) */
    char *gxn = j->gx + (size_t)(n0 * g->c * g->h * g->w) * es;
    int direct = g->direct && nbk == 1;
    char *dst = direct ? gxn : cols;
    for (int64_t gi = 0; gi < g->g; gi++)
      rh__gemm(j->dt, 1, 0, g->kg, ld, g->og, j->w + (size_t)(gi * g->og * g->kg) * es, g->kg,
               gyb + (size_t)(gi * g->og * ld) * es, ld, 0.0, dst + (size_t)(gi * g->kg * ld) * es, ld);
    if (g->direct && nbk > 1) block_copy(j, cols, gxn, nbk, g->c, 0); /* each pixel has one column entry */
    else if (!direct) {
      memset(gxn, 0, (size_t)(nbk * g->c * g->h * g->w) * es);
      for (int64_t s = 0; s < nbk; s++)
        sample_cols(g, j->p, j->dt, gxn + (size_t)(s * g->c * g->h * g->w) * es, cols + (size_t)(s * g->l) * es,
                    ld, 1);
    }
  }
}

int rh_nn_conv2d_backward(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *gy, const rh_nn_conv_t *p, rh_tensor_t **gx,
                          rh_tensor_t **gw, rh_tensor_t **gb) {
  conv_job_t j = {0};
  geom_t *g = &j.g;
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (check(x, w, NULL, p, g)) return -1;
  if (gy->dtype != x->dtype || gy->ndim != 4 || gy->size[0] != g->n || gy->size[1] != g->o || gy->size[2] != g->oh ||
      gy->size[3] != g->ow || RH_ON_DEVICE(gy))
    return rh_tensor_fail("conv2d backward: the gradient must be [%lld, %lld, %lld, %lld] %s on the host",
                          (long long)g->n, (long long)g->o, (long long)g->oh, (long long)g->ow,
                          rh_dtype_name(x->dtype));
  j.p = p, j.dt = x->dtype, j.es = rh_dtype_size(x->dtype);
  rh_tensor_t *xc = rh_tensor_contiguous(x), *wc = rh_tensor_contiguous(w), *gyc = rh_tensor_contiguous(gy);
  /* every output is written whole (gx: each part zeroes its samples first; gw:
   * the first block's GEMM overwrites), so none is calloc'd fresh pages */
  rh_tensor_t *tx = gx ? rh_tensor_empty(j.dt, 4, x->size) : NULL;
  rh_tensor_t *tw = gw ? rh_tensor_empty(j.dt, 4, w->size) : NULL;
  rh_tensor_t *tb = gb ? rh_tensor_empty(j.dt, 1, (int64_t[]){g->o}) : NULL;
  rh_tensor_t *more = NULL;
  int ok = xc && wc && gyc && (!gx || tx) && (!gw || tw) && (!gb || tb);
  if (ok) {
    j.x = rh_tensor_data(xc), j.w = rh_tensor_data(wc), j.gy = rh_tensor_data(gyc);
    j.gx = tx ? rh_tensor_data(tx) : NULL;
    plan(&j);
    /* part 0 sums into the result, the others each into their own slot, added
     * in part order after (the sum does not depend on timing) */
    if (tw && j.parts > 1) more = rh_tensor_empty(j.dt, 1, (int64_t[]){(j.parts - 1) * g->o * g->kg});
    j.gw = tw ? rh_tensor_data(tw) : NULL;
    j.gw_more = more ? rh_tensor_data(more) : NULL;
    j.gb = tb ? calloc((size_t)(j.parts * g->o), sizeof(double)) : NULL;
    ok = (!tw || j.parts == 1 || more) && (!tb || j.gb);
    j.block = backward_block;
    if (ok) rh_parallel_for(j.parts, 1, run_parts, &j);
    ok = ok && !j.failed;
  }
  if (ok && tw && g->n == 0) ok = rh_tensor_fill_(tw, 0) == 0; /* an empty batch: no block wrote it */
  if (ok && more) {
    int64_t nw = g->o * g->kg;
    char *dst = rh_tensor_data(tw);
    for (int64_t part = 1; part < j.parts; part++)
      for (int64_t i = 0; i < nw; i++) {
        if (j.dt == RH_F32) ((float *)dst)[i] += ((float *)j.gw_more)[(part - 1) * nw + i];
        else ((double *)dst)[i] += ((double *)j.gw_more)[(part - 1) * nw + i];
      }
  }
  if (ok && tb) {
    for (int64_t o = 0; o < g->o; o++) {
      double sum = 0;
      for (int64_t part = 0; part < j.parts; part++) sum += j.gb[part * g->o + o];
      rh__store(j.dt, (char *)rh_tensor_data(tb) + (size_t)o * j.es, sum);
    }
  }
  rh_tensor_release(more);
  free(j.gb);
  rh_tensor_release(xc);
  rh_tensor_release(wc);
  rh_tensor_release(gyc);
  if (!ok) {
    rh_tensor_release(tx);
    rh_tensor_release(tw);
    rh_tensor_release(tb);
    return rh_tensor_fail("conv2d backward: out of memory");
  }
  if (gx) *gx = tx;
  if (gw) *gw = tw;
  if (gb) *gb = tb;
  return 0;
}
