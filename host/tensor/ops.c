/* ops.c: elementwise ops (Torch7's THTensorMath's pointwise half): binary ops
 * with broadcasting and PyTorch's type promotion (a tensor and a tensor, a tensor
 * and a scalar, and flat kernels for callers that cut their own work: the
 * collectives), and unary ops. Inner loops are generated per dtype by macros (a
 * typed fast path for contiguous operands, a strided general path) and run under
 * the N-d iterator (iter.c), which merges dimensions and splits big jobs across
 * threads; on a device, the kernels library runs them.
 *
 * Depends on copy.c (casts, copies into `out`, moves of a 0-d operand), reduce.c
 * (one check: whether an integer divisor has a zero), tensor.c and device.c.
 * Nothing below it calls it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

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
/* bitwise ops exist for integers only (floats have none, as in PyTorch) */
#define BITWISE(T, SUF)              \
  BIN_KERNEL(band_##SUF, T, T, x &y) \
  BIN_KERNEL(bor_##SUF, T, T, x | y) \
  BIN_KERNEL(bxor_##SUF, T, T, x ^ y)

ARITH(float, f32, powf(x, y), frem_f(x, y))
ARITH(double, f64, pow(x, y), frem(x, y))
ARITH(int32_t, i32, (int32_t)ipow(x, y), IREM(int32_t, x, y))
ARITH(int64_t, i64, ipow(x, y), IREM(int64_t, x, y))
ARITH(uint8_t, u8, (uint8_t)ipow(x, y), (uint8_t)(x % y))
BITWISE(int32_t, i32)
BITWISE(int64_t, i64)
BITWISE(uint8_t, u8)
/* bool arithmetic as PyTorch: + is or, * is and */
BIN_KERNEL(add_b, uint8_t, uint8_t, (x | y) != 0)
BIN_KERNEL(mul_b, uint8_t, uint8_t, (x & y) != 0)
BIN_KERNEL(max_b, uint8_t, uint8_t, (x | y) != 0)
BIN_KERNEL(min_b, uint8_t, uint8_t, (x & y) != 0)
BIN_KERNEL(bxor_b, uint8_t, uint8_t, (x ^ y) != 0)

#define ROW(SUF, AND, OR, XOR)                                                                                 \
  {                                                                                                            \
    add_##SUF, sub_##SUF, mul_##SUF, div_##SUF, pow_##SUF, max_##SUF, min_##SUF, eq_##SUF, ne_##SUF, lt_##SUF, \
        le_##SUF, gt_##SUF, ge_##SUF, rem_##SUF, AND, OR, XOR                                                  \
  }

static const rh_loop_fn bin_kernels[RH_NDTYPES][RH_NBINOPS] = {
    ROW(f32, NULL, NULL, NULL),
    ROW(f64, NULL, NULL, NULL),
    ROW(i32, band_i32, bor_i32, bxor_i32),
    ROW(i64, band_i64, bor_i64, bxor_i64),
    ROW(u8, band_u8, bor_u8, bxor_u8),
    /* bool: and and or are min and max */
    {add_b, NULL, mul_b, NULL, NULL, max_b, min_b, eq_u8, ne_u8, lt_u8, le_u8, gt_u8, ge_u8, NULL, min_b, max_b,
     bxor_b},
};

static const char *binop_name[RH_NBINOPS] = {
    "add", "sub", "mul", "div", "pow",       "maximum",     "minimum",    "eq",         "ne",
    "lt",  "le",  "gt",  "ge",  "remainder", "bitwise_and", "bitwise_or", "bitwise_xor"};

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
  if (!bin_kernels[ct][op]) {
    rh_tensor_fail("%s: not supported for %s tensors (bitwise operations take integer and bool tensors)",
                   binop_name[op], rh_dtype_name(ct));
    return NULL;
  }
  if (op == RH_OP_POW && !rh_dtype_is_float(ct) && b->dtype != RH_BOOL) {
    /* integers to negative integer powers are refused, as in PyTorch */
    rh_tensor_t *bc = rh__as_dtype(b, RH_I64);
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
  rh_tensor_t *ac = rh__as_dtype(a, ct), *bc = ac ? rh__as_dtype(b, ct) : NULL;
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
  rh_tensor_t *ac = rh__as_dtype(a, ct);
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
