// elementwise.cu: binary and unary ops, casts and fills: one templated kernel
// family per kind of op, instantiated per dtype by dispatch(); the op code is a
// uniform branch inside the kernel (these kernels are bound by memory, not by
// the switch). Each family has three paths: vectorised 16-byte loads for
// contiguous aligned operands, a linear strided loop, and the N-d indexer.
#include "common.cuh"

namespace rhc {

// op codes: rh_binop_t and rh_unop_t (host/tensor/tensor.h)
enum { ADD, SUB, MUL, DIV, POW, MAXIMUM, MINIMUM, EQ, NE, LT, LE, GT, GE, REM, BAND, BOR, BXOR };
enum { NEG, EXP, LOG, SQRT, RELU, TANH, SIGMOID, ABS, FLOOR, CEIL, ROUND, SIGN, SIN, COS, LOG1P, EXPM1, RSQRT };

template <typename T>
__device__ inline T ipow(T x, T y) {
  if constexpr (std::is_signed<T>::value) {
    if (y < 0) return x == 1 ? 1 : (x == -1 ? ((y % 2) ? -1 : 1) : 0);
  }
  uint64_t r = 1, b = (uint64_t)(int64_t)x;  // wraps on overflow, as on the host
  uint64_t e = (uint64_t)y;
  while (e) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return (T)r;
}

template <typename T>
__device__ inline T arith(int op, T x, T y) {
  if constexpr (std::is_same<T, bool>::value) {
    // bool arithmetic as PyTorch: + and max are or, * and min are and
    if (op == BXOR) return x != y;
    return (op == ADD || op == MAXIMUM || op == BOR) ? (x || y) : (x && y);
  } else {
    if constexpr (std::is_integral<T>::value) {
      // (the host refuses bitwise ops on floating point tensors)
      if (op == BAND) return x & y;
      if (op == BOR) return x | y;
      if (op == BXOR) return x ^ y;
    }
    switch (op) {
      case ADD: return x + y;
      case SUB: return x - y;
      case MUL: return x * y;
      case DIV: return x / y;  // the host makes integer division true (float) division
      case POW:
        if constexpr (std::is_floating_point<T>::value) return pow(x, y);
        else return ipow(x, y);
      case MAXIMUM: return (x > y || x != x) ? x : y;  // NaN wins, as in PyTorch
      case REM:
        // the divisor's sign, as Python's %; the host refuses integer zero divisors
        if constexpr (std::is_floating_point<T>::value) {
          T r = fmod(x, y);
          return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
        } else if constexpr (std::is_signed<T>::value) {
          if (y == (T)-1) return 0;
          T r = x % y;
          return (r != 0 && ((r < 0) != (y < 0))) ? (T)(r + y) : r;
        } else {
          return x % y;
        }
      default: return (x < y || x != x) ? x : y;
    }
  }
}

template <typename T>
__device__ inline bool compare(int op, T x, T y) {
  switch (op) {
    case EQ: return x == y;
    case NE: return x != y;
    case LT: return x < y;
    case LE: return x <= y;
    case GT: return x > y;
    default: return x >= y;
  }
}

template <typename T, typename OT>
__device__ inline OT binop(int op, T x, T y) {
  if constexpr (std::is_same<OT, bool>::value && !std::is_same<T, bool>::value) return compare(op, x, y);
  else if constexpr (std::is_same<T, bool>::value) return op >= EQ ? compare(op, x, y) : arith(op, x, y);
  else return arith(op, x, y);
}

template <typename T>
__device__ inline T unop(int op, T x) {
  if constexpr (std::is_floating_point<T>::value) {
    switch (op) {
      case NEG: return -x;
      case EXP: return exp(x);
      case LOG: return log(x);
      case SQRT: return sqrt(x);
      case RELU: return x > 0 ? x : (x != x ? x : (T)0);
      case TANH: return tanh(x);
      case SIGMOID: return (T)1 / ((T)1 + exp(-x));
      case FLOOR: return floor(x);
      case CEIL: return ceil(x);
      case ROUND: return rint(x);  // half to even, as the host's nearbyint
      case SIGN: return x != x ? x : (T)((x > 0) - (x < 0));
      case SIN: return sin(x);
      case COS: return cos(x);
      case LOG1P: return log1p(x);
      case EXPM1: return expm1(x);
      case RSQRT: return (T)1 / sqrt(x);
      default: return fabs(x);
    }
  } else if constexpr (std::is_same<T, bool>::value) {
    return x;  // relu, abs and sign of bool are the identity; the host refuses the rest
  } else {
    switch (op) {
      case NEG: return (T)(-x);
      case RELU: return x > 0 ? x : (T)0;
      case FLOOR:
      case CEIL:
      case ROUND: return x;
      case SIGN:
        if constexpr (std::is_signed<T>::value) return (T)((x > 0) - (x < 0));
        else return (T)(x > 0);
      default:
        if constexpr (std::is_signed<T>::value) return x < 0 ? (T)(-x) : x;
        else return x;
    }
  }
}

// ---- kernels, parameterised by a functor F: out = F(a[, b])
#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename OT, typename AT, typename BT, typename F, int V>
__global__ void k_vec(int64_t nvec, OT *o, const AT *a, const BT *b, bool b_scalar, F f) {
  GRID_STRIDE(i, nvec) {
    Vec<AT, V> va = reinterpret_cast<const Vec<AT, V> *>(a)[i];
    Vec<OT, V> vo;
    if (b_scalar) {
      BT y = b[0];
#pragma unroll
      for (int k = 0; k < V; k++) vo.v[k] = f(va.v[k], y);
    } else {
      Vec<BT, V> vb = reinterpret_cast<const Vec<BT, V> *>(b)[i];
#pragma unroll
      for (int k = 0; k < V; k++) vo.v[k] = f(va.v[k], vb.v[k]);
    }
    reinterpret_cast<Vec<OT, V> *>(o)[i] = vo;
  }
}

template <typename OT, typename AT, typename BT, typename F>
__global__ void k_linear(int64_t n, OT *o, int64_t os, const AT *a, int64_t as, const BT *b, int64_t bs, F f) {
  GRID_STRIDE(i, n) { o[i * os] = f(a[i * as], b[i * bs]); }
}

template <typename OT, typename AT, typename BT, typename F>
__global__ void k_strided(int64_t n, Indexer<3> ix, char *o, const char *a, const char *b, F f) {
  GRID_STRIDE(i, n) {
    int64_t off[3];
    ix.offsets(i, off);
    *(OT *)(o + off[0]) = f(*(const AT *)(a + off[1]), *(const BT *)(b + off[2]));
  }
}

// Launches the right path for out = f(a, b) over the host's broadcast shape.
// A unary op passes b = a with b's strides equal to a's.
template <typename OT, typename AT, typename BT, typename F>
int launch(int dev, const char *what, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
           const int64_t *ast, const void *b, const int64_t *bst, F f) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  Indexer<3> ix;
  const int64_t *sts[3] = {ost, ast, bst};
  int64_t n = ix.prepare(nd, size, sts);
  if (n == 0) return 0;
  const int es[3] = {(int)sizeof(OT), (int)sizeof(AT), (int)sizeof(BT)};
  if (ix.nd <= 1) {
    int64_t st[3];
    for (int k = 0; k < 3; k++) st[k] = ix.nd ? ix.st[k][0] : 0;
    bool elem = st[0] % es[0] == 0 && st[1] % es[1] == 0 && st[2] % es[2] == 0;
    if (elem) {
      int64_t os = st[0] / es[0], as = st[1] / es[1], bs = st[2] / es[2];
      int64_t head = 0;
      // vectorised: 16 bytes of the input type per load
      constexpr int V = 16 / sizeof(AT) > 0 ? 16 / sizeof(AT) : 1;
      if (V > 1 && os == 1 && as == 1 && (bs == 1 || bs == 0) && n >= V && ((uintptr_t)o % (sizeof(OT) * V)) == 0 &&
          ((uintptr_t)a % 16) == 0 && (bs == 0 || ((uintptr_t)b % (sizeof(BT) * V)) == 0)) {
        int64_t nvec = n / V;
        k_vec<OT, AT, BT, F, V>
            <<<grid_for(dev, nvec), kThreads, 0, s>>>(nvec, (OT *)o, (const AT *)a, (const BT *)b, bs == 0, f);
        head = nvec * V;
        if (launch_check(what)) return -1;
      }
      if (head < n) {
        k_linear<OT, AT, BT, F><<<grid_for(dev, n - head), kThreads, 0, s>>>(
            n - head, (OT *)o + head * os, os, (const AT *)a + head * as, as, (const BT *)b + head * bs, bs, f);
      }
      return launch_check(what);
    }
  }
  k_strided<OT, AT, BT, F><<<grid_for(dev, n), kThreads, 0, s>>>(n, ix, (char *)o, (const char *)a, (const char *)b, f);
  return launch_check(what);
}

template <typename T, typename OT>
struct BinF {
  int op;
  __device__ OT operator()(T x, T y) const { return binop<T, OT>(op, x, y); }
};

template <typename T>
struct UnF {
  int op;
  __device__ T operator()(T x, T) const { return unop<T>(op, x); }
};

template <typename From, typename To>
struct CastF {
  __device__ To operator()(From x, From) const {
    if constexpr (std::is_same<From, To>::value) return x;
    else if constexpr (std::is_same<To, bool>::value) return x != (From)0;
    // the host's cast_loop wraps only from int64 (a plain C cast); every other
    // integer pair goes through rh_dtype_store, which clamps (int32 300 -> uint8
    // 255, int32 -1 -> uint8 0); do the same here
    else if constexpr (std::is_same<From, int64_t>::value && std::is_integral<To>::value) return (To)x;
    else return from_double<To>((double)x);
  }
};

template <typename T>
struct FillF {
  T v;
  __device__ T operator()(T, T) const { return v; }
};

struct BinaryRun {
  template <typename T>
  static int run(int dev, int op, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                 const int64_t *ast, const void *b, const int64_t *bst) {
    if (op >= EQ && op <= GE)
      return launch<bool, T, T>(dev, "binary op kernel", nd, size, o, ost, a, ast, b, bst, BinF<T, bool>{op});
    return launch<T, T, T>(dev, "binary op kernel", nd, size, o, ost, a, ast, b, bst, BinF<T, T>{op});
  }
};

struct UnaryRun {
  template <typename T>
  static int run(int dev, int op, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                 const int64_t *ast) {
    return launch<T, T, T>(dev, "unary op kernel", nd, size, o, ost, a, ast, a, ast, UnF<T>{op});
  }
};

template <typename From>
struct CastTo {
  template <typename To>
  static int run(int dev, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a, const int64_t *ast) {
    return launch<To, From, From>(dev, "copy kernel", nd, size, o, ost, a, ast, a, ast, CastF<From, To>{});
  }
};

struct CastRun {
  template <typename From>
  static int run(int to, int dev, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                 const int64_t *ast) {
    return dispatch<CastTo<From>>(to, dev, nd, size, o, ost, a, ast);
  }
};

struct FillRun {
  template <typename T>
  static int run(int dev, int nd, const int64_t *size, void *o, const int64_t *ost, double v) {
    // the output is also passed as the (unread) inputs so every pointer is valid
    return launch<T, T, T>(dev, "fill kernel", nd, size, o, ost, o, ost, o, ost, FillF<T>{from_double<T>(v)});
  }
};

__global__ void k_any_negative(const int64_t *a, int64_t n, int *flag) {
  GRID_STRIDE(i, n) {
    if (a[i] < 0) *flag = 1;
  }
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_binary(int dev, int op, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
               const int64_t *ast, const void *b, const int64_t *bst) {
  return dispatch<BinaryRun>(dtype, dev, op, nd, size, o, ost, a, ast, b, bst);
}

int rhc_unary(int dev, int op, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
              const int64_t *ast) {
  return dispatch<UnaryRun>(dtype, dev, op, nd, size, o, ost, a, ast);
}

int rhc_cast(int dev, int from, int to, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
             const int64_t *ast) {
  if (to < 0 || to >= NDTYPES) return fail("unknown dtype code %d", to);
  return dispatch<CastRun>(from, to, dev, nd, size, o, ost, a, ast);
}

int rhc_fill(int dev, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, double value) {
  return dispatch<FillRun>(dtype, dev, nd, size, o, ost, value);
}

int rhc_any_negative_i64(int dev, const int64_t *a, int64_t n, int *out) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  *out = 0;
  if (n == 0) return 0;
  int *flag = nullptr;
  if (rhc_alloc(dev, sizeof(int), (void **)&flag)) return -1;
  int rc = -1;
  if (cudaMemsetAsync(flag, 0, sizeof(int), s) == cudaSuccess) {
    k_any_negative<<<grid_for(dev, n), kThreads, 0, s>>>(a, n, flag);
    rc = launch_check("negative-exponent check");
    if (!rc) rc = rhc_d2h(dev, out, flag, sizeof(int));
  } else {
    rc = fail("cudaMemsetAsync failed");
  }
  rhc_free(dev, flag);
  return rc;
}

}  // extern "C"
