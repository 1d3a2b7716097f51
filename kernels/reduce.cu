// reduce.cu: sum, mean, prod, max, min, argmax, argmin and softmax over
// contiguous rows (the host permutes the reduced dimension last and makes the
// rows contiguous). Accumulation is in double for floats and in int64 for
// integers, as on the host; max/min let NaN win and keep the first extreme
// index. A long row is split across blocks: pass one writes one partial per
// (row, chunk), pass two combines a row's partials in chunk order.
#include "common.cuh"

namespace rhc {

enum { R_SUM, R_MEAN, R_MAX, R_MIN, R_ARGMAX, R_ARGMIN, R_PROD };

struct Acc {
  double d;     // float accumulator / value
  int64_t i;    // integer accumulator / value (exact for int64)
  int64_t idx;  // position of the extreme, for arg*
  bool nan;
};

template <typename T>
__device__ inline Acc make(T x, int64_t idx) {
  Acc a;
  a.d = (double)x;
  a.i = std::is_floating_point<T>::value ? 0 : (int64_t)x;
  a.idx = idx;
  a.nan = x != x;
  return a;
}

__device__ inline Acc identity(int op) {
  Acc a;
  a.d = op == R_PROD ? 1.0 : 0.0;
  a.i = op == R_PROD ? 1 : 0;
  a.idx = -1;  // no element yet (max/min)
  a.nan = false;
  return a;
}

__device__ inline Acc combine(int op, bool integral, Acc l, Acc r) {
  switch (op) {
    case R_SUM:
    case R_MEAN:
      l.d += r.d;
      l.i += r.i;
      return l;
    case R_PROD:
      l.d *= r.d;
      l.i *= r.i;
      return l;
    default: {
      // max/min: NaN wins; among equals (or two NaNs) the earlier position, so
      // the result does not depend on how the tree paired the partials
      if (l.idx < 0) return r;
      if (r.idx < 0) return l;
      if (l.nan || r.nan) {
        if (l.nan && r.nan) return r.idx < l.idx ? r : l;
        return l.nan ? l : r;
      }
      bool want_max = op == R_MAX || op == R_ARGMAX;
      bool eq = integral ? r.i == l.i : r.d == l.d;
      if (eq) return r.idx < l.idx ? r : l;
      bool better = integral ? (want_max ? r.i > l.i : r.i < l.i) : (want_max ? r.d > l.d : r.d < l.d);
      return better ? r : l;
    }
  }
}

constexpr int kRedThreads = 256;

__device__ inline Acc block_combine(int op, bool integral, Acc v) {
  __shared__ Acc sh[kRedThreads];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = kRedThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] = combine(op, integral, sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  Acc r = sh[0];
  __syncthreads();
  return r;
}

// grid: (rows, chunks). Threads walk their chunk in coalesced steps of the block;
// combine() does not depend on the order for ties, so any pairing is right.
template <typename T>
__global__ void k_partials(int op, int64_t len, int64_t chunk, const T *in, Acc *part) {
  bool integral = !std::is_floating_point<T>::value;
  int64_t row = blockIdx.x, c = blockIdx.y;
  int64_t lo = c * chunk, hi = lo + chunk < len ? lo + chunk : len;
  Acc acc = identity(op);
  const T *p = in + row * len;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kRedThreads) acc = combine(op, integral, acc, make<T>(p[i], i));
  acc = block_combine(op, integral, acc);
  if (threadIdx.x == 0) part[row * gridDim.y + c] = acc;
}

template <typename O>
__device__ inline void store_result(int op, bool integral, Acc a, int64_t len, O *out) {
  switch (op) {
    case R_ARGMAX:
    case R_ARGMIN: *out = (O)a.idx; break;
    case R_MEAN: *out = from_double<O>(a.d / (double)len); break;
    default:
      if (integral) *out = (O)a.i;
      else *out = from_double<O>(a.d);
  }
}

template <typename O>
__global__ void k_finish(int op, bool integral, int64_t rows, int64_t nparts, int64_t len, const Acc *part, O *out) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    Acc acc = identity(op);
    int64_t per = (nparts + kRedThreads - 1) / kRedThreads;
    int64_t a = threadIdx.x * per, b = a + per < nparts ? a + per : nparts;
    for (int64_t i = a; i < b; i++) acc = combine(op, integral, acc, part[row * nparts + i]);
    acc = block_combine(op, integral, acc);
    if (threadIdx.x == 0) store_result<O>(op, integral, acc, len, out + row);
  }
}

struct FinishRun {
  template <typename O>
  static int run(int dev, cudaStream_t s, int op, bool integral, int64_t rows, int64_t nparts, int64_t len,
                 const Acc *part, void *out) {
    unsigned g = (unsigned)(rows < 65535 ? rows : 65535);
    k_finish<O><<<g, kRedThreads, 0, s>>>(op, integral, rows, nparts, len, part, (O *)out);
    return launch_check("reduction kernel (final pass)");
  }
};

// one pass when a row is one chunk: a block reduces a row and stores the
// result, with no partials buffer (that buffer is 32 bytes per row, several
// times the input itself for short rows: a (1e8, 4) float32 sum would need
// 3.2 GB of it)
template <typename T, typename O>
__global__ void k_direct(int op, int64_t rows, int64_t len, const T *in, O *out) {
  bool integral = !std::is_floating_point<T>::value;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {  // uniform per block
    Acc acc = identity(op);
    const T *p = in + row * len;
    for (int64_t i = threadIdx.x; i < len; i += kRedThreads) acc = combine(op, integral, acc, make<T>(p[i], i));
    acc = block_combine(op, integral, acc);
    if (threadIdx.x == 0) store_result<O>(op, integral, acc, len, out + row);
  }
}

template <typename T>
struct DirectRun {
  template <typename O>
  static int run(cudaStream_t s, int op, int64_t rows, int64_t len, const void *in, void *out) {
    unsigned g = (unsigned)(rows < 65535 ? rows : 65535);
    k_direct<T, O><<<g, kRedThreads, 0, s>>>(op, rows, len, (const T *)in, (O *)out);
    return launch_check("reduction kernel");
  }
};

struct ReduceRun {
  template <typename T>
  static int run(int dev, int op, int out_dtype, int64_t rows, int64_t len, const void *in, void *out) {
    cudaStream_t s = stream_for(dev);
    if (!s) return -1;
    if (rows == 0) return 0;
    // enough chunks per row to fill the device, none shorter than 4096 elements
    int64_t want = (int64_t)sm_count(dev) * 4 / (rows > 0 ? rows : 1);
    int64_t chunks = len / 4096;
    if (chunks > want) chunks = want;
    if (chunks < 1) chunks = 1;
    if (chunks > 1024) chunks = 1024;
    int64_t chunk = len ? (len + chunks - 1) / chunks : 0;
    if (chunks == 1) return dispatch<DirectRun<T>>(out_dtype, s, op, rows, len, in, out);
    if (rows > 0x7fffffff) return fail("reduction over %lld rows: too many for one grid", (long long)rows);
    Acc *part = nullptr;
    if (rhc_alloc(dev, sizeof(Acc) * (size_t)(rows * chunks), (void **)&part)) return -1;
    dim3 grid((unsigned)rows, (unsigned)chunks);
    k_partials<T><<<grid, kRedThreads, 0, s>>>(op, len, chunk, (const T *)in, part);
    int rc = launch_check("reduction kernel");
    bool integral = !std::is_floating_point<T>::value;
    if (!rc) rc = dispatch<FinishRun>(out_dtype, dev, s, op, integral, rows, chunks, len, part, out);
    rhc_free(dev, part);  // stream-ordered: the next user of the block queues after us
    return rc;
  }
};

// ---- softmax: one block per row, three sweeps (max, sum of exp, write)
template <typename T>
__global__ void k_softmax(int log_, int64_t rows, int64_t len, const T *in, T *out) {
  __shared__ double sh[kRedThreads];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T *x = in + row * len;
    T *y = out + row * len;
    double m = -INFINITY;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) m = fmax(m, (double)x[i]);
    sh[threadIdx.x] = m;
    __syncthreads();
    for (int w = kRedThreads / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) sh[threadIdx.x] = fmax(sh[threadIdx.x], sh[threadIdx.x + w]);
      __syncthreads();
    }
    m = sh[0];
    __syncthreads();
    double s = 0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) s += exp((double)x[i] - m);
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = kRedThreads / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
      __syncthreads();
    }
    s = sh[0];
    __syncthreads();
    double ls = log(s);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
      y[i] = (T)(log_ ? (double)x[i] - m - ls : exp((double)x[i] - m) / s);
  }
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_reduce_rows(int dev, int op, int in_dtype, int out_dtype, int64_t rows, int64_t len, const void *in,
                    void *out) {
  return dispatch<ReduceRun>(in_dtype, dev, op, out_dtype, rows, len, in, out);
}

int rhc_softmax_rows(int dev, int dtype, int log_, int64_t rows, int64_t len, const void *in, void *out) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (rows == 0 || len == 0) return 0;
  unsigned g = (unsigned)(rows < 65535 ? rows : 65535);
  if (dtype == F32) k_softmax<float><<<g, kRedThreads, 0, s>>>(log_, rows, len, (const float *)in, (float *)out);
  else if (dtype == F64)
    k_softmax<double><<<g, kRedThreads, 0, s>>>(log_, rows, len, (const double *)in, (double *)out);
  else return fail("softmax on CUDA needs float32 or float64, got dtype code %d", dtype);
  return launch_check("softmax kernel");
}

}  // extern "C"
