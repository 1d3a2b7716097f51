// common.cuh: what every kernels/ file shares: the error slot, the per-device
// state (stream, cuBLAS handle), dtype dispatch, and the strided indexer that
// turns a linear element index into byte offsets of up to three operands.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdarg>
#include <cstdio>
#include <limits>
#include <type_traits>

extern "C" {
#include "tensor/cuda_api.h"
}

namespace rhc {

// dtype codes are rh_dtype_t's (host/tensor/tensor.h)
enum Dtype { F32 = 0, F64, I32, I64, U8, BOOL, NDTYPES };

int fail(const char *fmt, ...);                  // sets last_error, returns -1
int cuda_fail(cudaError_t e, const char *what);  // names the CUDA error
const char *last_error();

#define RHC_CHECK(call, what)                          \
  do {                                                 \
    cudaError_t e_ = (call);                           \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

// The device's stream (created on first use, non-blocking so the legacy default
// stream never serialises us) after making `dev` current. NULL with the error set.
cudaStream_t stream_for(int dev);
int sm_count(int dev);

// one thread block size for elementwise work; grids are capped and grid-stride
constexpr int kThreads = 256;
inline unsigned grid_for(int dev, int64_t n) {
  int64_t want = (n + kThreads - 1) / kThreads;
  int64_t cap = (int64_t)sm_count(dev) * 32;
  if (want > cap) want = cap;
  return (unsigned)(want > 0 ? want : 1);
}

// Operand offsets over an N-d shape. The host gives byte strides already
// broadcast (0 for a broadcast dim); prepare() drops size-1 dims and merges dims
// that are contiguous in every operand, so most jobs become 1-D.
template <int NOPS>
struct Indexer {
  int nd;
  int64_t size[RHC_MAXDIM];
  int64_t st[NOPS][RHC_MAXDIM];

  __host__ int64_t prepare(int nd_in, const int64_t *size_in, const int64_t *const *st_in) {
    nd = 0;
    int64_t n = 1;
    for (int d = 0; d < nd_in; d++) {
      n *= size_in[d];
      if (size_in[d] == 1) continue;
      if (nd > 0) {
        bool merge = true;
        for (int k = 0; k < NOPS; k++)
          if (st[k][nd - 1] != st_in[k][d] * size_in[d]) merge = false;
        if (merge) {
          size[nd - 1] *= size_in[d];
          for (int k = 0; k < NOPS; k++) st[k][nd - 1] = st_in[k][d];
          continue;
        }
      }
      size[nd] = size_in[d];
      for (int k = 0; k < NOPS; k++) st[k][nd] = st_in[k][d];
      nd++;
    }
    return n;
  }
  // all operands contiguous with these element sizes: one flat loop will do
  __host__ bool flat(const int *esize) const {
    if (nd == 0) return true;
    if (nd != 1) return false;
    for (int k = 0; k < NOPS; k++)
      if (st[k][0] != esize[k]) return false;
    return true;
  }
  __device__ void offsets(int64_t i, int64_t *off) const {
    for (int k = 0; k < NOPS; k++) off[k] = 0;
    for (int d = nd - 1; d >= 0; d--) {
      int64_t q = i / size[d], r = i - q * size[d];
      for (int k = 0; k < NOPS; k++) off[k] += r * st[k][d];
      i = q;
    }
  }
};

// Calls F::template run<T>(args...) with T the C++ type of dtype `dt`.
template <typename F, typename... A>
int dispatch(int dt, A... args) {
  switch (dt) {
    case F32: return F::template run<float>(args...);
    case F64: return F::template run<double>(args...);
    case I32: return F::template run<int32_t>(args...);
    case I64: return F::template run<int64_t>(args...);
    case U8: return F::template run<uint8_t>(args...);
    case BOOL: return F::template run<bool>(args...);
  }
  return fail("unknown dtype code %d", dt);
}

// A float64 value stored as T the way the host's rh_dtype_store does: NaN and
// out-of-range values clamp for integers (a plain cast is undefined there).
template <typename T>
__host__ __device__ inline T from_double(double v) {
  if constexpr (std::is_floating_point<T>::value) {
    return (T)v;
  } else if constexpr (std::is_same<T, bool>::value) {
    return v != 0;
  } else {
    if (v != v) return 0;
    const double lo = (double)std::numeric_limits<T>::lowest(), hi = (double)std::numeric_limits<T>::max();
    if (v <= lo) return std::numeric_limits<T>::lowest();
    if (v >= hi) return std::numeric_limits<T>::max();
    return (T)v;
  }
}

int launch_check(const char *what);  // cudaGetLastError after a launch

// nccl.cu: whether the last non-blocking NCCL call on `dev` has its kernels on
// the device's stream: 1 yes (or none pending), 0 still being enqueued, -1 it
// failed (message set). Events wait for it before they are recorded.
int nccl_enqueue_state(int dev);

}  // namespace rhc

// the library's own entry points that other kernels/ files call
extern "C" {
int rhc_alloc(int dev, size_t nbytes, void **ptr);
void rhc_free(int dev, void *ptr);
int rhc_d2h(int dev, void *dst, const void *src, size_t nbytes);
int rhc_synchronize(int dev);
}
