/* nn_conv.c: 2-d convolution (forward and backward) for nn.Conv1d/Conv2d, as
 * im2col + OpenBLAS GEMMs per group (what PyTorch's CPU
 * slow_conv2d does), the batch split over the thread pool (see plan()). A
 * part's column buffer holds a few samples' worth at most, so memory stays near
 * the size of the output. A 1x1 kernel with stride 1 and no padding reads the
 * input itself as its columns; other columns are read from a zero-padded copy
 * of each sample (see the column matrix below). float32 rows of 4..15 at
 * stride 1 are copied as masked vectors, and planes whose padded rows fit a
 * vector are summed back (col2im) a row per register, where the CPU has
 * AVX-512. */
#include <stdlib.h>
#include <string.h>

#include "nn_geom.h"
#include "tensor/tensor_internal.h"
#if RH_VEC_X86
#include <immintrin.h> /* the AVX-512 gathers of im2col and col2im (chosen at run time) */
#endif

/* The column matrix is built from a padded copy of each sample's planes
 * ([C, Hp, Wp], Hp = H + 2*pad: the zero border written once) instead of
 * finding each kernel tap's valid range row by row: with no edges left, row r
 * = (channel, ki, kj) of the columns reads the padded plane at a fixed offset
 * per tap plus, for output position l = (oy, ox), base[l] = oy*sy*Wp + ox*sx.
 * Narrow outputs (ResNet's late stages: rows of 2..8) gather through that
 * table in one flat loop over L (the per-row bookkeeping, not the copying,
 * was the cost: im2col took 13% of a ResNet shard's step); wide rows are row
 * copies. The table needs the padded plane under 2^31 elements; larger planes
 * take the row path. */
typedef struct {
  rh_dtype_t dt;
  const char *x; /* one sample [C, H, W] (col2im: written) */
  char *xp;      /* its padded planes [C, hp, wp], or x itself when there is no padding */
  char *cols;    /* this sample's columns: row r at cols + r * ld elements, oh*ow of them */
  int64_t ld;
  const int32_t *base; /* [oh * ow] or NULL: the row path */
  int64_t c, h, w, hp, wp, kh, kw, oh, ow;
  const rh_nn_conv_t *p;
} cols_job_t;

#define CONV_ROW_MIN 16 /* output rows at least this wide are copied row by row */

/* where row r's tap starts in its channel's padded plane */
static int64_t tap_offset(const cols_job_t *j, int64_t tap) {
  int64_t ki = tap / j->kw, kj = tap - ki * j->kw;
  return ki * j->p->dil[0] * j->wp + kj * j->p->dil[1];
}

/* the row copies' vector builds, with no loop turned back into a memcpy call
 * (GCC's loop distribution) */
#if RH_VEC_X86
#define ROWS_TARGETS RH_VEC_CLONES __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define ROWS_TARGETS
#endif

/* dst[i] = src[base[i]]: vector gathers where the CPU has them (chosen when
 * the program loads; the baseline's scalar loop ran at 2.6 cycles an element) */
#define GATHER_FN(NAME, T)                                                                                          \
  RH_VEC_CLONES static void NAME(T *restrict dst, const T *restrict src, const int32_t *restrict base, int64_t n) { \
    for (int64_t i = 0; i < n; i++) dst[i] = src[base[i]];                                                          \
  }
GATHER_FN(gather_f64, double)
#if RH_VEC_X86
/* float32 through the AVX-512 gather instruction (GCC's vectorizer emulates
 * gathers with inserts under its generic tuning: 2x slower), chosen at load time */
GATHER_FN(gather_f32_auto, float)
__attribute__((target("avx512f"))) static void gather_f32_avx512(float *restrict dst, const float *restrict src,
                                                                 const int32_t *restrict base, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_i32gather_ps(_mm512_loadu_si512(base + i), src, 4));
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    __m512i idx = _mm512_maskz_loadu_epi32(m, base + i);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, src, 4));
  }
}
static void gather_f32(float *restrict dst, const float *restrict src, const int32_t *restrict base, int64_t n) {
  if (__builtin_cpu_supports("avx512f")) gather_f32_avx512(dst, src, base, n);
  else gather_f32_auto(dst, src, base, n);
}
/* col2im's table rows: dst[base[i]] += src[i] (a row's positions are distinct,
 * so a gather, an add and a scatter of 16 at a time are exact) */
__attribute__((target("avx512f"))) static void scatter_add_f32_avx512(float *restrict dst, const float *restrict src,
                                                                      const int32_t *restrict base, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i idx = _mm512_loadu_si512(base + i);
    __m512 v = _mm512_add_ps(_mm512_i32gather_ps(idx, dst, 4), _mm512_loadu_ps(src + i));
    _mm512_i32scatter_ps(dst, idx, v, 4);
  }
  for (; i < n; i++) dst[base[i]] += src[i];
}
/* Stride-1 narrow rows (NARROW_MIN <= ow < 16: ResNet's 8x8 and 4x4 maps):
 * a tap's column row is oh rows of ow contiguous elements of the padded
 * plane, one masked 64-byte load and store each, where the gather loads
 * element by element (a 16-wide gather costs some 8 cycles; two 8-element rows
 * cost two). Lanes past ow are neither read nor written. */
__attribute__((target("avx512f"))) static void narrow_rows_f32_avx512(float *restrict dst, const float *restrict src,
                                                                      int64_t sld, int64_t rows, int64_t len) {
  __mmask16 m = (__mmask16)((1u << len) - 1);
  for (int64_t r = 0; r < rows; r++) _mm512_mask_storeu_ps(dst + r * len, m, _mm512_maskz_loadu_ps(m, src + r * sld));
}
#define SCATTER_ADD_AVX512 1
#else
GATHER_FN(gather_f32, float)
#define SCATTER_ADD_AVX512 0
#endif
static void scatter_add_f32(float *restrict dst, const float *restrict src, const int32_t *restrict base, int64_t n) {
#if SCATTER_ADD_AVX512
  if (__builtin_cpu_supports("avx512f")) {
    scatter_add_f32_avx512(dst, src, base, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; i++) dst[base[i]] += src[i];
}
static void scatter_add_f64(double *restrict dst, const double *restrict src, const int32_t *restrict base, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[base[i]] += src[i];
}
#define SCATTER_ADD_float scatter_add_f32
#define SCATTER_ADD_double scatter_add_f64

/* n rows of len elements from src (rows sld apart, elements sx apart) to dst
 * (rows dld apart): im2col's row path (the padded plane's rows into a column
 * row) and the GEMM blocks' copies. Stride 1 copies in 64-byte vectors
 * written out (a memcpy call per 16-element row was a third of the copy's
 * time) */
typedef float conv_vf __attribute__((vector_size(64)));
typedef double conv_vd __attribute__((vector_size(64)));
#define ROWS_FN(NAME, T, VT)                                                                                 \
  ROWS_TARGETS static void NAME(T *restrict dst, int64_t dld, const T *restrict src, int64_t sld, int64_t n, \
                                int64_t len, int64_t sx) {                                                   \
    enum { NL = sizeof(VT) / sizeof(T) };                                                                    \
    for (int64_t r = 0; r < n; r++) {                                                                        \
      const T *s = src + r * sld;                                                                            \
      T *d = dst + r * dld;                                                                                  \
      int64_t i = 0;                                                                                         \
      if (sx == 1) {                                                                                         \
        for (; i + NL <= len; i += NL) {                                                                     \
          VT v;                                                                                              \
          memcpy(&v, s + i, sizeof v);                                                                       \
          memcpy(d + i, &v, sizeof v);                                                                       \
        }                                                                                                    \
        for (; i < len; i++) d[i] = s[i];                                                                    \
      } else if (sx == 2)                                                                                    \
        for (; i < len; i++) d[i] = s[2 * i];                                                                \
      else                                                                                                   \
        for (; i < len; i++) d[i] = s[i * sx];                                                               \
    }                                                                                                        \
  }
ROWS_FN(rows_f32, float, conv_vf)
ROWS_FN(rows_f64, double, conv_vd)
#define ROWS_float rows_f32
#define ROWS_double rows_f64
#define GATHER_float gather_f32
#define GATHER_double gather_f64
#if SCATTER_ADD_AVX512
#define NARROW_ROWS_float narrow_rows_f32_avx512
#else /* never taken (narrow_rows() is 0): the names only have to compile */
#define NARROW_ROWS_float(d, s, sld, rows, len) ((void)0)
#endif
/* narrow_rows() is 0 for float64 */
#define NARROW_ROWS_double(d, s, sld, rows, len) ((void)0)

/* whether a tabled geometry's float32 rows take the masked row path (above)
 * instead of the gather: stride 1 along the row, rows of at least NARROW_MIN
 * (shorter ones, 2x2 maps, fill a gather better than a row each) */
#define NARROW_MIN 4
static int narrow_rows(const cols_job_t *j) {
#if SCATTER_ADD_AVX512
  return j->dt == RH_F32 && j->p->stride[1] == 1 && j->ow >= NARROW_MIN && j->ow < 16 &&
         __builtin_cpu_supports("avx512f");
#else
  (void)j;
  return 0;
#endif
}

#define IM2COL_ROWS(T)                                                                        \
  do {                                                                                        \
    const T *xp = (const T *)j->xp;                                                           \
    T *col = (T *)j->cols;                                                                    \
    int64_t taps = j->kh * j->kw, l = j->oh * j->ow;                                          \
    int narrow = narrow_rows(j);                                                              \
    for (int64_t r = lo; r < hi; r++) {                                                       \
      const T *src = xp + (r / taps) * j->hp * j->wp + tap_offset(j, r % taps);               \
      T *dst = col + r * j->ld;                                                               \
      if (narrow) NARROW_ROWS_##T(dst, src, j->p->stride[0] * j->wp, j->oh, j->ow);           \
      else if (j->base) GATHER_##T(dst, src, j->base, l);                                     \
      else ROWS_##T(dst, j->ow, src, j->p->stride[0] * j->wp, j->oh, j->ow, j->p->stride[1]); \
    }                                                                                         \
  } while (0)

static void im2col_rows(void *ctx, int64_t lo, int64_t hi) {
  cols_job_t *j = ctx;
  if (j->dt == RH_F32) IM2COL_ROWS(float);
  else IM2COL_ROWS(double);
}

/* adds the columns back into the padded planes, one channel per task (a
 * channel's rows only touch its own plane; within a row the positions are
 * distinct) */
#define COL2IM_CH(T)                                                                             \
  do {                                                                                           \
    T *xp = (T *)j->xp;                                                                          \
    const T *col = (const T *)j->cols;                                                           \
    int64_t taps = j->kh * j->kw, l = j->oh * j->ow, sy = j->p->stride[0], sx = j->p->stride[1]; \
    for (int64_t ci = lo; ci < hi; ci++)                                                         \
      for (int64_t tap = 0; tap < taps; tap++) {                                                 \
        T *dst = xp + ci * j->hp * j->wp + tap_offset(j, tap);                                   \
        const T *src = col + (ci * taps + tap) * j->ld;                                          \
        if (j->base) SCATTER_ADD_##T(dst, src, j->base, l);                                      \
        else                                                                                     \
          for (int64_t oy = 0; oy < j->oh; oy++) {                                               \
            T *restrict d = dst + oy * sy * j->wp;                                               \
            const T *restrict s = src + oy * j->ow;                                              \
            if (sx == 1) /* a loop of its own: it vectorizes */                                  \
              for (int64_t ox = 0; ox < j->ow; ox++) d[ox] += s[ox];                             \
            else                                                                                 \
              for (int64_t ox = 0; ox < j->ow; ox++) d[ox * sx] += s[ox];                        \
          }                                                                                      \
      }                                                                                          \
  } while (0)

/* col2im of one channel whose padded rows fit a vector (wp <= 16, stride 1
 * along the row; ResNet's 8x8 maps and smaller): each padded row is summed in
 * a register's worth of stack, a tap's column row added in shifted by its
 * column offset, and written once. Adding into the plane row by row instead
 * (masked loads and stores, or the scatter) read back what the previous tap
 * had just stored at an offset of one element, which the store buffer cannot
 * forward: each such add waited for the store to retire. The terms are added
 * in the same order (tap by tap, from zero) as the scalar loop: the same bits. */
#define NARROW_HP 64 /* padded rows at most (the stack buffer) */
static int narrow_planes(const cols_job_t *j) {
#if SCATTER_ADD_AVX512
  return j->dt == RH_F32 && j->p->stride[1] == 1 && j->wp <= 16 && j->hp <= NARROW_HP &&
         __builtin_cpu_supports("avx512f");
#else
  (void)j;
  return 0;
#endif
}
#if SCATTER_ADD_AVX512
__attribute__((target("avx512f"))) static void narrow_col2im_f32_avx512(const cols_job_t *j, int64_t ci) {
  __m512 acc[NARROW_HP];
  int64_t taps = j->kh * j->kw, sy = j->p->stride[0], dy = j->p->dil[0], dx = j->p->dil[1];
  const float *col = (const float *)j->cols + ci * taps * j->ld;
  __mmask16 m = (__mmask16)((1u << j->ow) - 1);
  for (int64_t py = 0; py < j->hp; py++) acc[py] = _mm512_setzero_ps();
  for (int64_t tap = 0; tap < taps; tap++) {
    int64_t ki = tap / j->kw, off = (tap - ki * j->kw) * dx;
    const float *src = col + tap * j->ld;
    /* lane off + i takes src[i]: a load from `off` elements before the row,
     * whose lanes below off are masked off (never read) */
    for (int64_t oy = 0; oy < j->oh; oy++) {
      const float *at = (const float *)((uintptr_t)(src + oy * j->ow) - (uintptr_t)off * sizeof(float));
      int64_t py = oy * sy + ki * dy;
      acc[py] = _mm512_add_ps(acc[py], _mm512_maskz_loadu_ps((__mmask16)(m << off), at));
    }
  }
  float *xp = (float *)j->xp + ci * j->hp * j->wp;
  __mmask16 mw = (__mmask16)((1u << j->wp) - 1);
  for (int64_t py = 0; py < j->hp; py++) _mm512_mask_storeu_ps(xp + py * j->wp, mw, acc[py]);
}
#endif

static void col2im_channels(void *ctx, int64_t lo, int64_t hi) {
  cols_job_t *j = ctx;
#if SCATTER_ADD_AVX512
  if (narrow_planes(j)) {
    for (int64_t ci = lo; ci < hi; ci++) narrow_col2im_f32_avx512(j, ci);
    return;
  }
#endif
  if (j->dt == RH_F32) COL2IM_CH(float);
  else COL2IM_CH(double);
}

/* between a sample's planes [C, H, W] and the interior of its padded ones:
 * to_padded writes the zero border too */
static void pad_channels(void *ctx, int64_t lo, int64_t hi, int to_padded) {
  cols_job_t *j = ctx;
  size_t es = rh_dtype_size(j->dt), row = (size_t)j->w * es;
  int64_t py = j->p->pad[0], px = j->p->pad[1];
  for (int64_t ci = lo; ci < hi; ci++) {
    char *pp = j->xp + (size_t)(ci * j->hp * j->wp) * es;
    char *x = (char *)j->x + (size_t)(ci * j->h * j->w) * es;
    if (!to_padded) {
      for (int64_t y = 0; y < j->h; y++) memcpy(x + y * row, pp + (size_t)((y + py) * j->wp + px) * es, row);
      continue;
    }
    size_t band = (size_t)(py * j->wp) * es, border = (size_t)px * es;
    memset(pp, 0, band);
    for (int64_t y = 0; y < j->h; y++) {
      char *d = pp + (size_t)((y + py) * j->wp) * es;
      memset(d, 0, border);
      memcpy(d + border, x + y * row, row);
      memset(d + border + row, 0, border);
    }
    memset(pp + (size_t)((j->h + py) * j->wp) * es, 0, band);
  }
}
static void pad_in(void *ctx, int64_t lo, int64_t hi) { pad_channels(ctx, lo, hi, 1); }
static void pad_out(void *ctx, int64_t lo, int64_t hi) { pad_channels(ctx, lo, hi, 0); }

typedef rh__nn_conv_geom_t geom_t;

/* whether the columns gather through base[] (narrow rows; the table's int32
 * offsets need the padded plane under 2^31 elements) */
static int tabled(const geom_t *g) { return g->ow < CONV_ROW_MIN && g->hp * g->wp < INT32_MAX; }

/* the host kernel's own rules (one float dtype, on the host), then the shapes */
static int check(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p, geom_t *g) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("conv2d: expected a float32 or float64 input, got %s", rh_dtype_name(x->dtype));
  if (w->dtype != x->dtype || (b && b->dtype != x->dtype))
    return rh_tensor_fail("conv2d: input, weight and bias must have one dtype (got %s, %s)", rh_dtype_name(x->dtype),
                          rh_dtype_name(w->dtype));
  if (RH_ON_DEVICE(x) || RH_ON_DEVICE(w) || (b && RH_ON_DEVICE(b)))
    return rh_tensor_fail("conv2d: the C kernel takes host tensors");
  return rh__nn_conv_geom(x, w, b, p, g);
}

/* one sample's columns (or its image, for col2im: written whole) at column
 * offset `at` of a block whose rows are ld long, through the part's scratch
 * (padded planes, the offset table); rows (channels) split over the pool,
 * which runs them inline when this is already inside a pool job */
typedef struct {
  char *padded;        /* [C, hp, wp] when the geometry pads */
  const int32_t *base; /* [L] when it gathers: the call's table, shared */
} scratch_t;

static void sample_cols(const geom_t *g, const rh_nn_conv_t *p, rh_dtype_t dt, const char *xn, const scratch_t *s,
                        char *cols, int64_t ld, int to_image) {
  size_t es = rh_dtype_size(dt);
  cols_job_t j = {dt,    xn,    g->padded ? s->padded : (char *)xn,
                  cols,  ld,    s->base,
                  g->c,  g->h,  g->w,
                  g->hp, g->wp, g->kh,
                  g->kw, g->oh, g->ow,
                  p};
  if (to_image) {
    /* (the narrow planes' kernel writes every element of each plane itself) */
    if (!narrow_planes(&j)) memset(j.xp, 0, (size_t)(g->c * g->hp * g->wp) * es);
    rh_parallel_for(g->c, rh_parallel_grain(g->kh * g->kw * g->l), col2im_channels, &j);
    if (g->padded) rh_parallel_for(g->c, rh_parallel_grain(g->h * g->w), pad_out, &j);
    return;
  }
  if (g->padded) rh_parallel_for(g->c, rh_parallel_grain(g->hp * g->wp), pad_in, &j);
  rh_parallel_for(g->c * g->kh * g->kw, rh_parallel_grain(g->l), im2col_rows, &j);
}

/* How the batch is split. The samples go to `parts` contiguous ranges, one per
 * pool thread, each running im2col and single-threaded GEMMs on its own
 * buffers: nothing waits on another pool (OpenBLAS's threads spin-yielding
 * while ours did im2col, and ours while it did GEMM, wasted both cores). Within
 * a range, `nb` samples at a time share one GEMM ([og, kg] x [kg, nb*L]): small
 * feature maps (ResNet's later stages, L = 4..64) make one sample's product
 * too thin for BLAS to run well. From L = 256 on (16x16 maps) a sample is
 * its own product: the copies into and out of a block cost more than the
 * wider GEMM saved (a ResNet shard at 16x16: 7.8 -> 6.5 ms with 1024 -> 256;
 * 128 made the 8x8 stage's products too thin). One part (a batch of one, or
 * one thread) splits each product over the pool instead (rh__gemm). A 1x1
 * convolution at stride 1 is a product of its own per sample, reading the input
 * and writing the output in place: blocking it copied the inputs into a block
 * and the outputs out of one (and in backward the output gradients, the inputs
 * again and the input gradients), which cost more than the wider product
 * saved (a ResNet shard's 8x8..2x2 stages: 5% of its step, 8% of its forward). */
#define CONV_BLOCK_COLS 256          /* nb*L this wide is enough for GEMM */
#define CONV_BLOCK_BYTES (8ll << 20) /* a part's column buffer beyond one sample */

typedef struct conv_job conv_job_t;
/* one GEMM block of a part: samples [n0, n0 + nbk), with the part's scratch */
typedef void (*conv_block_fn)(conv_job_t *j, int64_t part, int64_t n0, int64_t nbk, char *cols, char *blk,
                              const scratch_t *s);

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
  int32_t *base; /* the gather table (the column matrix above), or NULL: one per call, read by every part */
  int failed;    /* a part's buffer could not be allocated */
  conv_block_fn block;
};

/* plan() and the offset table every part gathers through (it depends on the
 * geometry only); -1 when the table cannot be allocated */
static int plan(conv_job_t *j) {
  const geom_t *g = &j->g;
  int64_t threads = rh_parallel_threads();
  j->parts = g->n < threads ? g->n : threads;
  if (j->parts < 1) j->parts = 1;
  j->per = (g->n + j->parts - 1) / j->parts;
  if (j->per < 1) j->per = 1; /* an empty batch: one part with nothing to do */
  j->parts = g->n ? (g->n + j->per - 1) / j->per : 1;
  int64_t nb = g->direct ? 1 : (CONV_BLOCK_COLS + g->l - 1) / g->l;
  int64_t fit = CONV_BLOCK_BYTES / ((g->c * g->kh * g->kw + g->o + 1) * g->l * (int64_t)j->es);
  if (nb > fit) nb = fit;
  if (nb > j->per) nb = j->per;
  j->nb = nb < 1 ? 1 : nb;
  if (!tabled(g) || g->direct) return 0;
  if (!(j->base = malloc((size_t)g->l * sizeof(int32_t)))) return -1;
  for (int64_t oy = 0; oy < g->oh; oy++)
    for (int64_t ox = 0; ox < g->ow; ox++)
      j->base[oy * g->ow + ox] = (int32_t)(oy * j->p->stride[0] * g->wp + ox * j->p->stride[1]);
  return 0;
}

/* between a block [rows, nb*L] (row o: the block's samples side by side) and
 * the samples [n][rows][L]: outputs and their gradients (rows = O). Rows of L elements are
 * short where blocks are used at all (L = 4..64: a memcpy call per row cost
 * more than the copy), so they are copied by rows_f32/f64 without calls. */
static void block_copy(const conv_job_t *j, char *block, char *samples, int64_t nbk, int64_t rows, int to_block) {
  int64_t l = j->g.l, ld = nbk * l;
  for (int64_t s = 0; s < nbk; s++) {
    char *bp = block + (size_t)(s * l) * j->es, *sp = samples + (size_t)(s * rows * l) * j->es;
    if (j->dt == RH_F32) {
      if (to_block) rows_f32((float *)bp, ld, (const float *)sp, l, rows, l, 1);
      else rows_f32((float *)sp, l, (const float *)bp, ld, rows, l, 1);
    } else {
      if (to_block) rows_f64((double *)bp, ld, (const double *)sp, l, rows, l, 1);
      else rows_f64((double *)sp, l, (const double *)bp, ld, rows, l, 1);
    }
  }
}

/* a part's scratch: columns for nb samples, a block of outputs / output
 * gradients when nb > 1 (one sample's GEMM reads and writes it in place), one
 * sample's padded planes when the geometry pads; the gather table is the
 * call's (plan()) */
static int part_buffers(conv_job_t *j, char **cols, char **blk, scratch_t *s) {
  const geom_t *g = &j->g;
  int64_t ld = j->nb * g->l;
  int in_place = g->direct; /* one sample at a time (plan()): the input is its columns */
  *cols = in_place ? NULL : malloc((size_t)(g->c * g->kh * g->kw * ld) * j->es);
  *blk = j->nb > 1 ? malloc((size_t)(g->o * ld) * j->es) : NULL;
  s->padded = g->padded && !g->direct ? malloc((size_t)(g->c * g->hp * g->wp) * j->es) : NULL;
  s->base = j->base;
  if ((!in_place && !*cols) || (j->nb > 1 && !*blk) || (g->padded && !g->direct && !s->padded)) {
    free(*cols);
    free(*blk);
    free(s->padded);
    __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
    return -1;
  }
  return 0;
}

/* the columns of samples [n0, n0 + nbk) side by side, or the input itself */
static const char *block_cols(conv_job_t *j, int64_t n0, int64_t nbk, char *cols, const scratch_t *sc) {
  const geom_t *g = &j->g;
  const char *x0 = j->x + (size_t)(n0 * g->c * g->h * g->w) * j->es;
  if (g->direct) return x0; /* nbk is 1 (plan()) */
  for (int64_t s = 0; s < nbk; s++)
    sample_cols(g, j->p, j->dt, x0 + (size_t)(s * g->c * g->h * g->w) * j->es, sc, cols + (size_t)(s * g->l) * j->es,
                nbk * g->l, 0);
  return cols;
}

/* the batch's parts, each with its own scratch, block by block through j->block */
static void run_parts(void *ctx, int64_t lo, int64_t hi) {
  conv_job_t *j = ctx;
  for (int64_t part = lo; part < hi; part++) {
    char *cols, *blk;
    scratch_t s;
    if (part_buffers(j, &cols, &blk, &s)) return;
    int64_t end = (part + 1) * j->per < j->g.n ? (part + 1) * j->per : j->g.n;
    for (int64_t n0 = part * j->per; n0 < end; n0 += j->nb)
      j->block(j, part, n0, end - n0 < j->nb ? end - n0 : j->nb, cols, blk, &s);
    free(cols);
    free(blk);
    free(s.padded);
  }
}

/* y of samples [n0, n0 + nbk) */
static void forward_block(conv_job_t *j, int64_t part, int64_t n0, int64_t nbk, char *cols, char *blk,
                          const scratch_t *s) {
  const geom_t *g = &j->g;
  size_t es = j->es;
  int64_t ld = nbk * g->l;
  (void)part;
  const char *cn = block_cols(j, n0, nbk, cols, s);
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
    j.block = forward_block;
    if (plan(&j)) j.failed = 1;
    else rh_parallel_for(j.parts, 1, run_parts, &j);
  }
  free(j.base);
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
static void backward_block(conv_job_t *j, int64_t part, int64_t n0, int64_t nbk, char *cols, char *blk,
                           const scratch_t *sc) {
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
    const char *cn = block_cols(j, n0, nbk, cols, sc);
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
    char *dst = g->direct ? gxn : cols; /* direct: one sample (plan()) */
    for (int64_t gi = 0; gi < g->g; gi++)
      rh__gemm(j->dt, 1, 0, g->kg, ld, g->og, j->w + (size_t)(gi * g->og * g->kg) * es, g->kg,
               gyb + (size_t)(gi * g->og * ld) * es, ld, 0.0, dst + (size_t)(gi * g->kg * ld) * es, ld);
    if (!g->direct)
      for (int64_t s = 0; s < nbk; s++)
        sample_cols(g, j->p, j->dt, gxn + (size_t)(s * g->c * g->h * g->w) * es, sc, cols + (size_t)(s * g->l) * es, ld,
                    1);
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
  /* every output is written whole (gx: col2im writes each sample whole; gw:
   * the first block's GEMM overwrites), so none is calloc'd fresh pages */
  rh_tensor_t *tx = gx ? rh_tensor_empty(j.dt, 4, x->size) : NULL;
  rh_tensor_t *tw = gw ? rh_tensor_empty(j.dt, 4, w->size) : NULL;
  rh_tensor_t *tb = gb ? rh_tensor_empty(j.dt, 1, (int64_t[]){g->o}) : NULL;
  rh_tensor_t *more = NULL;
  int ok = xc && wc && gyc && (!gx || tx) && (!gw || tw) && (!gb || tb);
  if (ok) {
    j.x = rh_tensor_data(xc), j.w = rh_tensor_data(wc), j.gy = rh_tensor_data(gyc);
    j.gx = tx ? rh_tensor_data(tx) : NULL;
    int planned = plan(&j) == 0;
    /* part 0 sums into the result, the others each into their own slot, added
     * in part order after (the sum does not depend on timing) */
    if (tw && j.parts > 1) more = rh_tensor_empty(j.dt, 1, (int64_t[]){(j.parts - 1) * g->o * g->kg});
    j.gw = tw ? rh_tensor_data(tw) : NULL;
    j.gw_more = more ? rh_tensor_data(more) : NULL;
    j.gb = tb ? calloc((size_t)(j.parts * g->o), sizeof(double)) : NULL;
    ok = planned && (!tw || j.parts == 1 || more) && (!tb || j.gb);
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
  free(j.base);
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
