/* ops.c: elementwise ops with broadcasting and PyTorch's type promotion, copies
 * between dtypes, reductions and softmax. Inner loops are generated per dtype by
 * macros (a typed fast path for contiguous operands, a strided general path);
 * the N-d iterator merges dimensions and splits big jobs across threads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

/* ---- the iterator */
typedef struct {
  int ndim;
  int64_t size[RH_MAXDIM];
  int64_t st[3][RH_MAXDIM];
  char *base[3];
  rh_loop_fn fn;
  void *ctx;
} iter_t;

static void iter_range(void *vit, int64_t lo, int64_t hi) {
  iter_t *it = vit;
  int nd = it->ndim, last = nd - 1;
  int64_t idx[RH_MAXDIM];
  int64_t rem = lo;
  for (int d = last; d >= 0; d--) {
    idx[d] = rem % it->size[d];
    rem /= it->size[d];
  }
  int64_t pos = lo;
  while (pos < hi) {
    char *p[3];
    for (int k = 0; k < 3; k++) {
      p[k] = it->base[k];
      if (!p[k]) continue;
      for (int d = 0; d < nd; d++) p[k] += idx[d] * it->st[k][d];
    }
    int64_t m = it->size[last] - idx[last];
    if (m > hi - pos) m = hi - pos;
    it->fn(m, p[0], it->st[0][last], p[1], it->st[1][last], p[2], it->st[2][last], it->ctx);
    pos += m;
    idx[last] += m;
    for (int d = last; d > 0 && idx[d] >= it->size[d]; d--) {
      idx[d] = 0;
      idx[d - 1]++;
    }
  }
}

static void iter_chunk(void *vit, int64_t lo, int64_t hi) { iter_range(vit, lo, hi); }

void rh__iterate(int ndim, const int64_t *size, char *o, const int64_t *ost, const char *a, const int64_t *ast,
                 const char *b, const int64_t *bst, rh_loop_fn fn, void *ctx) {
  iter_t it;
  const int64_t *sts[3] = {ost, ast, bst};
  it.base[0] = o;
  it.base[1] = (char *)a;
  it.base[2] = (char *)b;
  it.fn = fn;
  it.ctx = ctx;
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) numel *= size[d];
  if (numel == 0) return;
  /* drop size-1 dims, then merge dims that are contiguous for every operand */
  int n = 0;
  for (int d = 0; d < ndim; d++) {
    if (size[d] == 1) continue;
    it.size[n] = size[d];
    for (int k = 0; k < 3; k++) it.st[k][n] = sts[k] ? sts[k][d] : 0;
    if (n > 0) {
      int merge = 1;
      for (int k = 0; k < 3; k++)
        if (it.st[k][n - 1] != it.st[k][n] * it.size[n]) merge = 0;
      if (merge) {
        it.size[n - 1] *= it.size[n];
        for (int k = 0; k < 3; k++) it.st[k][n - 1] = it.st[k][n];
        continue;
      }
    }
    n++;
  }
  if (n == 0) {
    it.size[0] = 1;
    for (int k = 0; k < 3; k++) it.st[k][0] = 0;
    n = 1;
  }
  it.ndim = n;
  if (numel >= (1 << 16)) rh_parallel_for(numel, 1 << 15, iter_chunk, &it);
  else iter_range(&it, 0, numel);
}

void rh__bcast_strides(const rh_tensor_t *t, int ndim, const int64_t *size, int64_t *out) {
  int off = ndim - t->ndim;
  int64_t es = (int64_t)rh_dtype_size(t->dtype);
  for (int d = 0; d < ndim; d++) {
    if (d < off || t->size[d - off] == 1 || size[d] == 1) out[d] = 0;
    else out[d] = t->stride[d - off] * es;
  }
}

/* ---- copies between dtypes */
typedef struct {
  rh_dtype_t from, to;
} cast_ctx_t;

static void cast_loop(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                      void *vctx) {
  cast_ctx_t *c = vctx;
  (void)b;
  (void)bs;
  if (c->from == c->to) {
    size_t es = rh_dtype_size(c->to);
    if (os == (int64_t)es && as == (int64_t)es) {
      memcpy(o, a, (size_t)n * es);
      return;
    }
    /* strided copies element by element, typed */
    switch (es) {
      case 8:
        for (int64_t i = 0; i < n; i++) *(uint64_t *)(o + i * os) = *(const uint64_t *)(a + i * as);
        break;
      case 4:
        for (int64_t i = 0; i < n; i++) *(uint32_t *)(o + i * os) = *(const uint32_t *)(a + i * as);
        break;
      default:
        for (int64_t i = 0; i < n; i++) o[i * os] = a[i * as];
        break;
    }
    return;
  }
  if (c->from == RH_I64 && c->to != RH_F32 && c->to != RH_F64) {
    /* integer to integer without going through double */
    for (int64_t i = 0; i < n; i++) {
      int64_t v = *(const int64_t *)(a + i * as);
      char *p = o + i * os;
      switch (c->to) {
        case RH_I32: *(int32_t *)p = (int32_t)v; break;
        case RH_U8: *(uint8_t *)p = (uint8_t)v; break;
        case RH_BOOL: *(uint8_t *)p = v != 0; break;
        default: break;
      }
    }
    return;
  }
  /* every (from, to) pair as its own inlined loop: a load and a store call per
   * element made casts (relu's backward, masks) several times slower than a copy */
#define LD_F32(p) ((double)*(const float *)(p))
#define LD_F64(p) (*(const double *)(p))
#define LD_I32(p) ((double)*(const int32_t *)(p))
#define LD_I64(p) ((double)*(const int64_t *)(p))
#define LD_U8(p) ((double)*(const uint8_t *)(p))
#define LD_BOOL(p) ((double)(*(const uint8_t *)(p) != 0))
#define ST_F32(p, v) (*(float *)(p) = (float)(v))
#define ST_F64(p, v) (*(double *)(p) = (v))
#define ST_ANY(p, v) rh__store(c->to, (p), (v)) /* integers: clamped as rh_dtype_store does */
#define ST_BOOL(p, v) (*(uint8_t *)(p) = (v) != 0)
/* dense runs with constant strides, so the compiler vectorizes them */
#define CAST_LOOP(LD, ST, FS, TS)                                       \
  if (as == (FS) && os == (TS)) {                                       \
    for (int64_t i = 0; i < n; i++) ST(o + i * (TS), LD(a + i * (FS))); \
  } else {                                                              \
    for (int64_t i = 0; i < n; i++) ST(o + i * os, LD(a + i * as));     \
  }
#define CAST_TO(LD, FS)                                 \
  switch (c->to) {                                      \
    case RH_F32: CAST_LOOP(LD, ST_F32, FS, 4); break;   \
    case RH_F64: CAST_LOOP(LD, ST_F64, FS, 8); break;   \
    case RH_BOOL: CAST_LOOP(LD, ST_BOOL, FS, 1); break; \
    default: CAST_LOOP(LD, ST_ANY, FS, os); break;      \
  }
  switch (c->from) {
    case RH_F32: CAST_TO(LD_F32, 4); break;
    case RH_F64: CAST_TO(LD_F64, 8); break;
    case RH_I32: CAST_TO(LD_I32, 4); break;
    case RH_I64: CAST_TO(LD_I64, 8); break;
    case RH_U8: CAST_TO(LD_U8, 1); break;
    case RH_BOOL: CAST_TO(LD_BOOL, 1); break;
    default:
      for (int64_t i = 0; i < n; i++) rh__store(c->to, o + i * os, rh__load(c->from, a + i * as));
      break;
  }
#undef CAST_TO
#undef CAST_LOOP
#undef ST_BOOL
#undef ST_ANY
#undef ST_F64
#undef ST_F32
#undef LD_BOOL
#undef LD_U8
#undef LD_I64
#undef LD_I32
#undef LD_F64
#undef LD_F32
}

int rh_tensor_copy_(rh_tensor_t *dst, rh_tensor_t *src) {
  int nd;
  int64_t shape[RH_MAXDIM];
  if (rh__broadcast_shape(dst->ndim, dst->size, src->ndim, src->size, &nd, shape)) return -1;
  if (nd != dst->ndim || memcmp(shape, dst->size, sizeof(int64_t) * (size_t)nd) != 0) {
    char a[256], b[256];
    rh_shape_str(src->ndim, src->size, a, sizeof a);
    rh_shape_str(dst->ndim, dst->size, b, sizeof b);
    return rh_tensor_fail("cannot copy a tensor of shape %s into one of shape %s", a, b);
  }
  if (rh_tensor_device(src) != rh_tensor_device(dst)) {
    /* across devices: a contiguous copy of src where dst lives, then a local copy */
    rh_tensor_t *moved = rh_tensor_to_device(src, rh_tensor_device(dst));
    if (!moved) return -1;
    int rc = rh_tensor_copy_(dst, moved);
    rh_tensor_release(moved);
    return rc;
  }
  int64_t ost[RH_MAXDIM], ast[RH_MAXDIM];
  rh__bcast_strides(dst, nd, shape, ost);
  for (int d = 0; d < nd; d++) ost[d] = dst->stride[d] * (int64_t)rh_dtype_size(dst->dtype);
  rh__bcast_strides(src, nd, shape, ast);
  if (RH_ON_DEVICE(dst))
    return rh__cuda_call(rh_cuda_api()->cast(rh_tensor_device(dst), src->dtype, dst->dtype, nd, shape,
                                             rh_tensor_data(dst), ost, rh_tensor_data(src), ast));
  if (src->dtype == dst->dtype &&
      rh__copy_tiled(nd, shape, rh_tensor_data(dst), ost, rh_tensor_data(src), ast, rh_dtype_size(dst->dtype)))
    return 0;
  cast_ctx_t c = {src->dtype, dst->dtype};
  rh__iterate(nd, shape, rh_tensor_data(dst), ost, rh_tensor_data(src), ast, NULL, NULL, cast_loop, &c);
  return 0;
}

typedef struct {
  rh_dtype_t dt;
  union { /* aligned for any element type */
    char bytes[8];
    int64_t i;
    double d;
  } v;
} fill_ctx_t;

/* one store per element, typed (a memcpy call per element was the slow part) */
#define FILL_AS(T)                                            \
  do {                                                        \
    T v;                                                      \
    memcpy(&v, f->v.bytes, sizeof v);                         \
    if (os == (int64_t)sizeof(T)) {                           \
      T *O = (T *)o;                                          \
      for (int64_t i = 0; i < n; i++) O[i] = v;               \
    } else {                                                  \
      for (int64_t i = 0; i < n; i++) *(T *)(o + i * os) = v; \
    }                                                         \
  } while (0)

static void fill_loop(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                      void *vctx) {
  fill_ctx_t *f = vctx;
  (void)a, (void)as, (void)b, (void)bs;
  switch (rh_dtype_size(f->dt)) {
    case 8: FILL_AS(uint64_t); break;
    case 4: FILL_AS(uint32_t); break;
    default: FILL_AS(uint8_t); break;
  }
}

int rh_tensor_fill_(rh_tensor_t *t, double v) {
  if (RH_ON_DEVICE(t)) {
    int64_t ost[RH_MAXDIM];
    for (int d = 0; d < t->ndim; d++) ost[d] = t->stride[d] * (int64_t)rh_dtype_size(t->dtype);
    return rh__cuda_call(
        rh_cuda_api()->fill(rh_tensor_device(t), t->dtype, t->ndim, t->size, rh_tensor_data(t), ost, v));
  }
  if (v == 0 && rh_tensor_is_contiguous(t)) {
    memset(rh_tensor_data(t), 0, (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype));
    return 0;
  }
  fill_ctx_t f;
  f.dt = t->dtype;
  rh__store(t->dtype, f.v.bytes, v);
  int64_t ost[RH_MAXDIM];
  for (int d = 0; d < t->ndim; d++) ost[d] = t->stride[d] * (int64_t)rh_dtype_size(t->dtype);
  rh__iterate(t->ndim, t->size, rh_tensor_data(t), ost, NULL, NULL, NULL, NULL, fill_loop, &f);
  return 0;
}

/* ---- binary kernels */
/* Elementwise kernels are built for AVX-512 and AVX2 as well as the x86-64
 * baseline, picked when the program loads: the baseline's 16-byte SSE loads
 * held a ResNet block's adds and ReLUs (tensors of 64..256 KiB, in L2 cache) to
 * half the rate of 64-byte ones. Each element is still the one IEEE operation
 * the expression names (no reassociation, nothing to contract into an FMA), so
 * every clone gives the same bits. */
#define BIN_KERNEL(NAME, T, OT, EXPR)                                                                                  \
  RH_VEC_CLONES static void NAME(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs, \
                                 void *ctx) {                                                                          \
    (void)ctx;                                                                                                         \
    if (os == sizeof(OT) && as == sizeof(T) && bs == sizeof(T)) {                                                      \
      OT *O = (OT *)o;                                                                                                 \
      const T *A = (const T *)a, *B = (const T *)b;                                                                    \
      for (int64_t i = 0; i < n; i++) {                                                                                \
        T x = A[i], y = B[i];                                                                                          \
        O[i] = (OT)(EXPR);                                                                                             \
      }                                                                                                                \
    } else if (os == sizeof(OT) && as == sizeof(T) && bs == 0) {                                                       \
      OT *O = (OT *)o;                                                                                                 \
      const T *A = (const T *)a;                                                                                       \
      const T y = *(const T *)b;                                                                                       \
      for (int64_t i = 0; i < n; i++) {                                                                                \
        T x = A[i];                                                                                                    \
        O[i] = (OT)(EXPR);                                                                                             \
      }                                                                                                                \
    } else {                                                                                                           \
      for (int64_t i = 0; i < n; i++) {                                                                                \
        T x = *(const T *)(a + i * as), y = *(const T *)(b + i * bs);                                                  \
        *(OT *)(o + i * os) = (OT)(EXPR);                                                                              \
      }                                                                                                                \
    }                                                                                                                  \
  }

/* integer power wrapping on overflow like PyTorch (in unsigned arithmetic: a
 * signed overflow would be undefined behaviour) */
static int64_t ipow(int64_t x, int64_t y) {
  if (y < 0) return x == 1 ? 1 : (x == -1 ? (y % 2 ? -1 : 1) : 0);
  uint64_t r = 1, b = (uint64_t)x;
  while (y) {
    if (y & 1) r *= b;
    b *= b;
    y >>= 1;
  }
  return (int64_t)r;
}

/* remainder with the sign of the divisor, as Python's % and torch.remainder */
static inline double frem(double x, double y) {
  double r = fmod(x, y);
  return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
}
static inline float frem_f(float x, float y) {
  float r = fmodf(x, y);
  return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
}
/* integers: the divisor is checked for zeros first; x % -1 is 0 (INT_MIN % -1 would trap) */
#define IREM(T, x, y) \
  ((y) == -1 ? (T)0 : (T)(((x) % (y) != 0 && (((x) % (y) < 0) != ((y) < 0))) ? (x) % (y) + (y) : (x) % (y)))

#define ARITH(T, SUF, POWEXPR, REMEXPR)                  \
  BIN_KERNEL(add_##SUF, T, T, x + y)                     \
  BIN_KERNEL(sub_##SUF, T, T, x - y)                     \
  BIN_KERNEL(mul_##SUF, T, T, x *y)                      \
  BIN_KERNEL(div_##SUF, T, T, x / y)                     \
  BIN_KERNEL(pow_##SUF, T, T, POWEXPR)                   \
  BIN_KERNEL(max_##SUF, T, T, (x > y || x != x) ? x : y) \
  BIN_KERNEL(min_##SUF, T, T, (x < y || x != x) ? x : y) \
  BIN_KERNEL(eq_##SUF, T, uint8_t, x == y)               \
  BIN_KERNEL(ne_##SUF, T, uint8_t, x != y)               \
  BIN_KERNEL(lt_##SUF, T, uint8_t, x < y)                \
  BIN_KERNEL(le_##SUF, T, uint8_t, x <= y)               \
  BIN_KERNEL(gt_##SUF, T, uint8_t, x > y)                \
  BIN_KERNEL(ge_##SUF, T, uint8_t, x >= y)               \
  BIN_KERNEL(rem_##SUF, T, T, REMEXPR)

ARITH(float, f32, powf(x, y), frem_f(x, y))
ARITH(double, f64, pow(x, y), frem(x, y))
ARITH(int32_t, i32, (int32_t)ipow(x, y), IREM(int32_t, x, y))
ARITH(int64_t, i64, ipow(x, y), IREM(int64_t, x, y))
ARITH(uint8_t, u8, (uint8_t)ipow(x, y), (uint8_t)(x % y))
/* bool arithmetic as PyTorch: + is or, * is and */
BIN_KERNEL(add_b, uint8_t, uint8_t, (x | y) != 0)
BIN_KERNEL(mul_b, uint8_t, uint8_t, (x & y) != 0)
BIN_KERNEL(max_b, uint8_t, uint8_t, (x | y) != 0)
BIN_KERNEL(min_b, uint8_t, uint8_t, (x & y) != 0)

#define ROW(SUF)                                                                                               \
  {                                                                                                            \
    add_##SUF, sub_##SUF, mul_##SUF, div_##SUF, pow_##SUF, max_##SUF, min_##SUF, eq_##SUF, ne_##SUF, lt_##SUF, \
        le_##SUF, gt_##SUF, ge_##SUF, rem_##SUF                                                                \
  }

static const rh_loop_fn bin_kernels[RH_NDTYPES][RH_NBINOPS] = {
    ROW(f32), ROW(f64), ROW(i32),
    ROW(i64), ROW(u8),  {add_b, NULL, mul_b, NULL, NULL, max_b, min_b, eq_u8, ne_u8, lt_u8, le_u8, gt_u8, ge_u8, NULL},
};

static const char *binop_name[RH_NBINOPS] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum",
                                             "eq",  "ne",  "lt",  "le",  "gt",  "ge",      "remainder"};

static int is_compare(rh_binop_t op) { return op >= RH_OP_EQ && op <= RH_OP_GE; }

/* op over n contiguous elements of dtype dt: out[i] = a[i] op b[i] (b[0] for
 * every i when b_scalar), on the calling thread. For callers that cut their own
 * work into cache-sized pieces (the cross-memory all_reduce, host/net/cma.c). */
int rh_binary_flat_check(rh_binop_t op, rh_dtype_t dt) {
  if ((unsigned)dt >= RH_NDTYPES || (unsigned)op >= RH_NBINOPS || !bin_kernels[dt][op] || is_compare(op))
    return rh_tensor_fail("binary_flat: no %s kernel for %s", (unsigned)op < RH_NBINOPS ? binop_name[op] : "?",
                          (unsigned)dt < RH_NDTYPES ? rh_dtype_name(dt) : "?");
  return 0;
}

int rh_reduce_flat_check(rh_binop_t op, rh_dtype_t dt, int divided) {
  return rh_binary_flat_check(op, dt) || (divided && rh_binary_flat_check(RH_OP_DIV, dt)) ? -1 : 0;
}

int rh_binary_flat(rh_binop_t op, rh_dtype_t dt, int64_t n, void *out, const void *a, const void *b, int b_scalar) {
  if (rh_binary_flat_check(op, dt)) return -1;
  int64_t es = (int64_t)rh_dtype_size(dt);
  bin_kernels[dt][op](n, out, es, a, es, b, b_scalar ? 0 : es, NULL);
  return 0;
}

/* Runs op over a and b (same dtype `ct`, already broadcastable, on out's
 * device) into out. */
static int run_binary(rh_binop_t op, rh_tensor_t *a, rh_tensor_t *b, rh_tensor_t *out) {
  int nd = out->ndim;
  int64_t ost[RH_MAXDIM], ast[RH_MAXDIM], bst[RH_MAXDIM];
  for (int d = 0; d < nd; d++) ost[d] = out->stride[d] * (int64_t)rh_dtype_size(out->dtype);
  rh__bcast_strides(a, nd, out->size, ast);
  rh__bcast_strides(b, nd, out->size, bst);
  if (RH_ON_DEVICE(out))
    return rh__cuda_call(rh_cuda_api()->binary(rh_tensor_device(out), op, a->dtype, nd, out->size, rh_tensor_data(out),
                                               ost, rh_tensor_data(a), ast, rh_tensor_data(b), bst));
  rh__iterate(nd, out->size, rh_tensor_data(out), ost, rh_tensor_data(a), ast, rh_tensor_data(b), bst,
              bin_kernels[a->dtype][op], NULL);
  return 0;
}

static rh_tensor_t *as_dtype(rh_tensor_t *t, rh_dtype_t dt) {
  if (t->dtype == dt) {
    rh_tensor_retain(t);
    return t;
  }
  return rh_tensor_cast(t, dt);
}

/* PyTorch lets a 0-dim CPU tensor (a Python scalar's stand-in) meet a tensor
 * on any device; it moves to that device. Other mixes are errors. */
static rh_tensor_t *binary_on_devices(rh_binop_t op, rh_tensor_t *a, rh_tensor_t *b, rh_tensor_t *out) {
  int da = rh_tensor_device(a), db = rh_tensor_device(b);
  int dev = out ? rh_tensor_device(out) : (da >= 0 ? da : db);
  rh_tensor_t *ma = NULL, *mb = NULL, *r = NULL;
  if (da != dev && a->ndim == 0 && da < 0) a = ma = rh_tensor_to_device(a, dev);
  if (db != dev && b->ndim == 0 && db < 0) b = mb = rh_tensor_to_device(b, dev);
  if (!a || !b) goto done;
  if (rh__same_device(binop_name[op], a, b)) goto done;
  if (out && rh__same_device(binop_name[op], out, a)) goto done;
  r = rh_tensor_binary(op, a, b, out);
done:
  rh_tensor_release(ma);
  rh_tensor_release(mb);
  return r;
}

/* any negative element in an int64 tensor, wherever it lives */
static int any_negative(rh_tensor_t *t, int *neg) {
  rh_tensor_t *c = rh_tensor_contiguous(t);
  if (!c) return -1;
  int64_t n = rh_tensor_numel(c);
  int rc = 0;
  *neg = 0;
  if (RH_ON_DEVICE(c)) {
    rc = rh__cuda_call(rh_cuda_api()->any_negative_i64(rh_tensor_device(c), rh_tensor_data(c), n, neg));
  } else {
    const int64_t *p = rh_tensor_data(c);
    for (int64_t i = 0; i < n && !*neg; i++) *neg = p[i] < 0;
  }
  rh_tensor_release(c);
  return rc;
}

/* any element equal to 0, wherever t lives (through ops that have kernels everywhere) */
static int any_zero(rh_tensor_t *t, int *zero) {
  *zero = 0;
  if (rh_tensor_numel(t) == 0) return 0;
  rh_tensor_t *z = rh_tensor_binary_scalar(RH_OP_EQ, t, 0, 0, 0, NULL);
  rh_tensor_t *m = z ? rh_tensor_reduce(RH_RED_MAX, z, -1, 0) : NULL;
  rh_tensor_release(z);
  if (!m) return -1;
  int64_t idx[1] = {0};
  *zero = rh_tensor_get(m, idx) != 0;
  rh_tensor_release(m);
  return 0;
}

rh_tensor_t *rh_tensor_binary(rh_binop_t op, rh_tensor_t *a, rh_tensor_t *b, rh_tensor_t *out) {
  if (rh_tensor_device(a) != rh_tensor_device(b) || (out && rh_tensor_device(out) != rh_tensor_device(a)))
    return binary_on_devices(op, a, b, out);
  int nd;
  int64_t shape[RH_MAXDIM];
  if (rh__broadcast_shape(a->ndim, a->size, b->ndim, b->size, &nd, shape)) return NULL;
  rh_dtype_t ct = rh_dtype_promote(a->dtype, b->dtype);
  rh_dtype_t rt = ct;
  if (op == RH_OP_DIV && !rh_dtype_is_float(ct)) ct = rt = RH_F32; /* true division */
  if (is_compare(op)) rt = RH_BOOL;
  if (ct == RH_BOOL && !bin_kernels[RH_BOOL][op]) {
    rh_tensor_fail("%s: not supported for bool tensors (use logical operations, or convert with to())", binop_name[op]);
    return NULL;
  }
  if (op == RH_OP_POW && !rh_dtype_is_float(ct) && b->dtype != RH_BOOL) {
    /* integers to negative integer powers are refused, as in PyTorch */
    rh_tensor_t *bc = as_dtype(b, RH_I64);
    if (!bc) return NULL;
    int neg = 0, rc = any_negative(bc, &neg);
    rh_tensor_release(bc);
    if (rc) return NULL;
    if (neg) {
      rh_tensor_fail("pow: integers to negative integer powers are not allowed");
      return NULL;
    }
  }
  if (op == RH_OP_REM && !rh_dtype_is_float(ct)) {
    /* an integer remainder by zero has no value: refused, as PyTorch does */
    int zero = 0;
    if (any_zero(b, &zero)) return NULL;
    if (zero) {
      rh_tensor_fail("remainder: integer division by zero (a divisor element is 0)");
      return NULL;
    }
  }
  if (out) {
    if (out->ndim != nd || memcmp(out->size, shape, sizeof(int64_t) * (size_t)nd) != 0) {
      char so[256], sb[256];
      rh_shape_str(out->ndim, out->size, so, sizeof so);
      rh_shape_str(nd, shape, sb, sizeof sb);
      rh_tensor_fail("%s_: output with shape %s doesn't match the broadcast shape %s", binop_name[op], so, sb);
      return NULL;
    }
    if (rh_dtype_is_float(rt) && !rh_dtype_is_float(out->dtype)) {
      rh_tensor_fail("%s_: result type %s can't be cast to the desired output type %s", binop_name[op],
                     rh_dtype_name(rt), rh_dtype_name(out->dtype));
      return NULL;
    }
  }
  rh_tensor_t *ac = as_dtype(a, ct), *bc = ac ? as_dtype(b, ct) : NULL;
  rh_tensor_t *res = NULL;
  if (!ac || !bc) goto done;
  if (out && out->dtype == rt) {
    if (run_binary(op, ac, bc, out)) goto done;
    rh_tensor_retain(out);
    res = out;
  } else {
    res = rh_tensor_empty_on(rh_tensor_device(a), rt, nd, shape);
    if (!res) goto done;
    if (run_binary(op, ac, bc, res) || (out && rh_tensor_copy_(out, res))) {
      rh_tensor_release(res);
      res = NULL;
      goto done;
    }
    if (out) {
      rh_tensor_release(res);
      rh_tensor_retain(out);
      res = out;
    }
  }
done:
  rh_tensor_release(ac);
  rh_tensor_release(bc);
  return res;
}

/* PyTorch's rule for a Python scalar: it does not widen the tensor's dtype within
 * its category; a float scalar with an integer tensor gives float32, an integer
 * scalar with a bool tensor gives int64. */
rh_tensor_t *rh_tensor_binary_scalar(rh_binop_t op, rh_tensor_t *a, double s, int s_is_float, int scalar_first,
                                     rh_tensor_t *out) {
  rh_dtype_t sd = a->dtype;
  if (s_is_float && !rh_dtype_is_float(a->dtype)) sd = RH_F32;
  else if (!s_is_float && a->dtype == RH_BOOL) sd = RH_I64;
  /* the scalar is made where `a` lives (a fill there, no transfer) */
  rh_tensor_t *st = rh_tensor_empty_on(rh_tensor_device(a), sd, 0, NULL);
  if (!st) return NULL;
  if (rh_tensor_fill_(st, s)) {
    rh_tensor_release(st);
    return NULL;
  }
  rh_tensor_t *r = scalar_first ? rh_tensor_binary(op, st, a, out) : rh_tensor_binary(op, a, st, out);
  rh_tensor_release(st);
  return r;
}

/* ---- unary kernels */
#define UN_KERNEL(NAME, T, EXPR)                                                                                       \
  RH_VEC_CLONES static void NAME(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs, \
                                 void *ctx) {                                                                          \
    (void)ctx, (void)b, (void)bs;                                                                                      \
    if (os == sizeof(T) && as == sizeof(T)) {                                                                          \
      T *O = (T *)o;                                                                                                   \
      const T *A = (const T *)a;                                                                                       \
      for (int64_t i = 0; i < n; i++) {                                                                                \
        T x = A[i];                                                                                                    \
        O[i] = (T)(EXPR);                                                                                              \
      }                                                                                                                \
    } else {                                                                                                           \
      for (int64_t i = 0; i < n; i++) {                                                                                \
        T x = *(const T *)(a + i * as);                                                                                \
        *(T *)(o + i * os) = (T)(EXPR);                                                                                \
      }                                                                                                                \
    }                                                                                                                  \
  }

#define FLOAT_UN(T, SUF, F)                                      \
  UN_KERNEL(neg_##SUF, T, -x)                                    \
  UN_KERNEL(exp_##SUF, T, exp##F(x))                             \
  UN_KERNEL(log_##SUF, T, log##F(x))                             \
  UN_KERNEL(sqrt_##SUF, T, sqrt##F(x))                           \
  UN_KERNEL(relu_##SUF, T, x > 0 ? x : (x != x ? x : 0))         \
  UN_KERNEL(tanh_##SUF, T, tanh##F(x))                           \
  UN_KERNEL(sigmoid_##SUF, T, 1 / (1 + exp##F(-x)))              \
  UN_KERNEL(abs_##SUF, T, fabs##F(x))                            \
  UN_KERNEL(floor_##SUF, T, floor##F(x))                         \
  UN_KERNEL(ceil_##SUF, T, ceil##F(x))                           \
  UN_KERNEL(round_##SUF, T, nearbyint##F(x))                     \
  UN_KERNEL(sign_##SUF, T, (x > 0) - (x < 0) + (x != x ? x : 0)) \
  UN_KERNEL(sin_##SUF, T, sin##F(x))                             \
  UN_KERNEL(cos_##SUF, T, cos##F(x))                             \
  UN_KERNEL(log1p_##SUF, T, log1p##F(x))                         \
  UN_KERNEL(expm1_##SUF, T, expm1##F(x))                         \
  UN_KERNEL(rsqrt_##SUF, T, 1 / sqrt##F(x))
FLOAT_UN(float, f32, f)
FLOAT_UN(double, f64, )

#define INT_UN(T, SUF)                    \
  UN_KERNEL(neg_##SUF, T, -x)             \
  UN_KERNEL(relu_##SUF, T, x > 0 ? x : 0) \
  UN_KERNEL(abs_##SUF, T, x < 0 ? -x : x) \
  UN_KERNEL(same_##SUF, T, x)             \
  UN_KERNEL(sign_##SUF, T, (x > 0) - (x < 0))
INT_UN(int32_t, i32)
INT_UN(int64_t, i64)
UN_KERNEL(neg_u8, uint8_t, -x)
UN_KERNEL(relu_u8, uint8_t, x)
UN_KERNEL(abs_u8, uint8_t, x)
UN_KERNEL(same_u8, uint8_t, x)
UN_KERNEL(sign_u8, uint8_t, x > 0)

/* floor, ceil and round of integers are the integers themselves; sin, cos, ...
 * of integers (NULL) are computed in float32 */
#define FLOAT_ROW(SUF)                                                                                          \
  {                                                                                                             \
    neg_##SUF, exp_##SUF, log_##SUF, sqrt_##SUF, relu_##SUF, tanh_##SUF, sigmoid_##SUF, abs_##SUF, floor_##SUF, \
        ceil_##SUF, round_##SUF, sign_##SUF, sin_##SUF, cos_##SUF, log1p_##SUF, expm1_##SUF, rsqrt_##SUF        \
  }
#define INT_ROW(SUF)                                                                                                \
  {                                                                                                                 \
    neg_##SUF, NULL, NULL, NULL, relu_##SUF, NULL, NULL, abs_##SUF, same_##SUF, same_##SUF, same_##SUF, sign_##SUF, \
        NULL, NULL, NULL, NULL, NULL                                                                                \
  }
static const rh_loop_fn un_kernels[RH_NDTYPES][RH_NUNOPS] = {
    FLOAT_ROW(f32),
    FLOAT_ROW(f64),
    INT_ROW(i32),
    INT_ROW(i64),
    INT_ROW(u8),
    {NULL, NULL, NULL, NULL, relu_u8, NULL, NULL, abs_u8, NULL, NULL, NULL, sign_u8, NULL, NULL, NULL, NULL, NULL},
};
static const char *unop_name[RH_NUNOPS] = {"neg",  "exp",   "log",  "sqrt", "relu", "tanh",  "sigmoid", "abs",  "floor",
                                           "ceil", "round", "sign", "sin",  "cos",  "log1p", "expm1",   "rsqrt"};

rh_tensor_t *rh_tensor_unary(rh_unop_t op, rh_tensor_t *a, rh_tensor_t *out) {
  if (out && rh__same_device(unop_name[op], out, a)) return NULL;
  rh_dtype_t ct = a->dtype;
  if (!un_kernels[ct][op]) {
    if (op == RH_OP_NEG && ct == RH_BOOL) {
      rh_tensor_fail("neg: negation of a bool tensor is not supported (use logical_not)");
      return NULL;
    }
    ct = RH_F32; /* exp, log, ... of integers give float32 */
  }
  if (out && rh_dtype_is_float(ct) && !rh_dtype_is_float(out->dtype)) {
    rh_tensor_fail("%s_: result type %s can't be cast to the desired output type %s", unop_name[op], rh_dtype_name(ct),
                   rh_dtype_name(out->dtype));
    return NULL;
  }
  rh_tensor_t *ac = as_dtype(a, ct);
  if (!ac) return NULL;
  rh_tensor_t *res = (out && out->dtype == ct) ? out : rh_tensor_empty_on(rh_tensor_device(a), ct, a->ndim, a->size);
  if (!res) {
    rh_tensor_release(ac);
    return NULL;
  }
  int64_t ost[RH_MAXDIM], ast[RH_MAXDIM];
  for (int d = 0; d < res->ndim; d++) ost[d] = res->stride[d] * (int64_t)rh_dtype_size(ct);
  rh__bcast_strides(ac, res->ndim, res->size, ast);
  int rc = 0;
  if (RH_ON_DEVICE(a))
    rc = rh__cuda_call(rh_cuda_api()->unary(rh_tensor_device(a), op, ct, res->ndim, res->size, rh_tensor_data(res), ost,
                                            rh_tensor_data(ac), ast));
  else
    rh__iterate(res->ndim, res->size, rh_tensor_data(res), ost, rh_tensor_data(ac), ast, NULL, NULL, un_kernels[ct][op],
                NULL);
  rh_tensor_release(ac);
  if (res == out) {
    if (rc) return NULL;
    rh_tensor_retain(out);
    return out;
  }
  if (!rc && out) rc = rh_tensor_copy_(out, res);
  if (rc || out) rh_tensor_release(res);
  if (rc) return NULL;
  if (out) {
    rh_tensor_retain(out);
    return out;
  }
  return res;
}

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
  rh_tensor_t *ac = as_dtype(a, ct);
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
  rh_tensor_t *ac = as_dtype(a, RH_F64);
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
