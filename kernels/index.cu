// index.cu: the device side of host/tensor/index.c: index_select, gather,
// scatter / scatter_add (and with them index_add and t[idx] = v) and masked
// fill / where. The host has checked every index and made it 0-based int64
// before it calls here, so kernels never read out of bounds. One template per
// family, instantiated per dtype by dispatch() (index_select by element size
// alone); scatter_add adds with atomics, and types without a native atomic add
// (uint8, bool) fall back to one thread, in order: correct, and rare.
#include "common.cuh"

namespace rhc {

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

template <typename E>
__global__ void k_index_select(int64_t total, int64_t m, int64_t n, int64_t inner, const E *src, const int64_t *idx,
                               E *out) {
  GRID_STRIDE(w, total) {
    int64_t k = w % inner, rest = w / inner;
    int64_t i = rest % m, o = rest / m;
    out[w] = src[(o * n + idx[i]) * inner + k];
  }
}

template <typename E>
int index_select_as(int dev, int64_t outer, int64_t n, int64_t inner, const void *src, const int64_t *idx, int64_t m,
                    void *out) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  int64_t total = outer * m * inner;
  if (total == 0) return 0;
  k_index_select<E><<<grid_for(dev, total), kThreads, 0, s>>>(total, m, n, inner, (const E *)src, idx, (E *)out);
  return launch_check("index_select kernel");
}

// offsets of position w of idx's shape in a (along dim: the index) and in o
struct GsShape {
  int nd, dim;
  int64_t size[RHC_MAXDIM], ast[RHC_MAXDIM], ost[RHC_MAXDIM];
  __device__ void offsets(int64_t w, int64_t i, int64_t *ao, int64_t *oo) const {
    int64_t a = 0, o = 0;
    for (int d = nd - 1; d >= 0; d--) {
      int64_t q = w / size[d], r = w - q * size[d];
      if (d != dim) a += r * ast[d];
      o += r * ost[d];
      w = q;
    }
    *ao = a + i * ast[dim];
    *oo = o;
  }
};

template <int ES>
struct Bytes {
  unsigned char b[ES];
};

template <typename E>
__global__ void k_gather_scatter(int64_t total, int mode, GsShape sh, const int64_t *idx, char *a, char *o, E value) {
  GRID_STRIDE(w, total) {
    int64_t ao, oo;
    sh.offsets(w, idx[w], &ao, &oo);
    if (mode == 0) *(E *)(o + oo) = *(const E *)(a + ao);
    else if (mode == 1) *(E *)(a + ao) = *(const E *)(o + oo);
    else *(E *)(a + ao) = value;
  }
}

template <typename T>
__device__ inline void atomic_add_to(T *p, T v) {
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) atomicAdd(p, v);
  else if constexpr (std::is_same<T, int32_t>::value) atomicAdd((int *)p, (int)v);
  else atomicAdd((unsigned long long *)p, (unsigned long long)v);  // int64: two's complement wraps
}

template <typename T>
__global__ void k_scatter_add(int64_t total, GsShape sh, const int64_t *idx, char *a, const char *o, bool serial) {
  if (serial) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (int64_t w = 0; w < total; w++) {
      int64_t ao, oo;
      sh.offsets(w, idx[w], &ao, &oo);
      T *p = (T *)(a + ao);
      if constexpr (std::is_same<T, bool>::value) *p = *p || *(const T *)(o + oo);
      else *p = (T)(*p + *(const T *)(o + oo));
    }
    return;
  }
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value ||
                std::is_same<T, int32_t>::value || std::is_same<T, int64_t>::value) {
    GRID_STRIDE(w, total) {
      int64_t ao, oo;
      sh.offsets(w, idx[w], &ao, &oo);
      atomic_add_to((T *)(a + ao), *(const T *)(o + oo));
    }
  }
}

struct ScatterAddRun {
  template <typename T>
  static int run(int dev, int64_t total, GsShape sh, const int64_t *idx, void *a, const void *o) {
    cudaStream_t s = stream_for(dev);
    if (!s) return -1;
    bool atomic = std::is_same<T, float>::value || std::is_same<T, double>::value ||
                  std::is_same<T, int32_t>::value || std::is_same<T, int64_t>::value;
    k_scatter_add<T><<<atomic ? grid_for(dev, total) : 1, atomic ? kThreads : 1, 0, s>>>(
        total, sh, idx, (char *)a, (const char *)o, !atomic);
    return launch_check("scatter_add kernel");
  }
};

template <typename T>
struct ValueOf {
  static T of(double v) { return from_double<T>(v); }
};

struct GatherScatterRun {
  template <typename T>
  static int run(int dev, int mode, int64_t total, GsShape sh, const int64_t *idx, void *a, void *o, double value) {
    cudaStream_t s = stream_for(dev);
    if (!s) return -1;
    // moves are by size: T only decides the width and the value's bits
    k_gather_scatter<T><<<grid_for(dev, total), kThreads, 0, s>>>(total, mode, sh, idx, (char *)a, (char *)o,
                                                                  ValueOf<T>::of(value));
    return launch_check(mode == 0 ? "gather kernel" : "scatter kernel");
  }
};

template <typename E>
__global__ void k_masked(int64_t n, Indexer<3> ix, char *o, const char *mask, const char *src, E value) {
  GRID_STRIDE(i, n) {
    int64_t off[3];
    ix.offsets(i, off);
    if (*(const unsigned char *)(mask + off[1])) *(E *)(o + off[0]) = src ? *(const E *)(src + off[2]) : value;
  }
}

struct MaskedRun {
  template <typename T>
  static int run(int dev, int nd, const int64_t *size, void *o, const int64_t *ost, const void *mask,
                 const int64_t *mst, const void *src, const int64_t *sst, double value) {
    cudaStream_t s = stream_for(dev);
    if (!s) return -1;
    Indexer<3> ix;
    const int64_t *sts[3] = {ost, mst, src ? sst : mst};
    int64_t n = ix.prepare(nd, size, sts);
    if (n == 0) return 0;
    k_masked<T><<<grid_for(dev, n), kThreads, 0, s>>>(n, ix, (char *)o, (const char *)mask, (const char *)src,
                                                      from_double<T>(value));
    return launch_check("masked fill kernel");
  }
};

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_index_select(int dev, int esize, int64_t outer, int64_t n, int64_t inner, const void *src, const int64_t *idx,
                     int64_t m, void *out) {
  switch (esize) {
    case 1: return index_select_as<uint8_t>(dev, outer, n, inner, src, idx, m, out);
    case 4: return index_select_as<uint32_t>(dev, outer, n, inner, src, idx, m, out);
    case 8: return index_select_as<uint64_t>(dev, outer, n, inner, src, idx, m, out);
  }
  return fail("index_select: no kernel for %d-byte elements", esize);
}

int rhc_gather_scatter(int dev, int mode, int dtype, int nd, int dim, const int64_t *size, const int64_t *idx, void *a,
                       const int64_t *ast, void *o, const int64_t *ost, double value) {
  GsShape sh;
  sh.nd = nd > 0 ? nd : 1;
  sh.dim = dim;
  int64_t total = 1;
  for (int d = 0; d < sh.nd; d++) {
    sh.size[d] = nd > 0 ? size[d] : 1;
    sh.ast[d] = nd > 0 ? ast[d] : 0;
    sh.ost[d] = nd > 0 ? ost[d] : 0;
    total *= sh.size[d];
  }
  if (total == 0) return 0;
  if (mode == 2) return dispatch<ScatterAddRun>(dtype, dev, total, sh, idx, a, (const void *)o);
  return dispatch<GatherScatterRun>(dtype, dev, mode, total, sh, idx, a, o, value);
}

int rhc_masked_fill(int dev, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, const void *mask,
                    const int64_t *mst, const void *src, const int64_t *sst, double value) {
  return dispatch<MaskedRun>(dtype, dev, nd, size, o, ost, mask, mst, src, sst, value);
}

}  // extern "C"
