// index.cu: the device side of host/tensor/index.c: index_select, gather,
// scatter / scatter_add (and with them index_add and t[idx] = v) and masked
// fill / where, and the mask ops whose result size depends on the data
// (masked_select, masked_scatter, nonzero: a CUB prefix sum places each set
// element). The host has checked every index and made it 0-based int64
// before it calls here, so kernels never read out of bounds. One template per
// family, instantiated per dtype by dispatch() (index_select by element size
// alone); scatter_add adds with atomics, and types without a native atomic add
// (uint8, bool) fall back to one thread, in order: correct, and rare.
#include <cub/device/device_scan.cuh>

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
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value || std::is_same<T, int32_t>::value ||
                std::is_same<T, int64_t>::value) {
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
    bool atomic = std::is_same<T, float>::value || std::is_same<T, double>::value || std::is_same<T, int32_t>::value ||
                  std::is_same<T, int64_t>::value;
    k_scatter_add<T><<<atomic ? grid_for(dev, total) : 1, atomic ? kThreads : 1, 0, s>>>(total, sh, idx, (char *)a,
                                                                                         (const char *)o, !atomic);
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
    k_gather_scatter<T>
        <<<grid_for(dev, total), kThreads, 0, s>>>(total, mode, sh, idx, (char *)a, (char *)o, ValueOf<T>::of(value));
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

__global__ void k_mask_flags(int64_t n, const unsigned char *mask, int64_t *flags) {
  GRID_STRIDE(i, n) { flags[i] = mask[i] != 0; }
}

template <typename E>
__global__ void k_compact(int64_t n, const unsigned char *mask, const int64_t *pos, const E *src, E *dst) {
  GRID_STRIDE(i, n) {
    if (mask[i]) dst[pos[i]] = src[i];
  }
}

template <typename E>
__global__ void k_expand(int64_t n, const unsigned char *mask, const int64_t *pos, const E *src, E *dst) {
  GRID_STRIDE(i, n) {
    if (mask[i]) dst[i] = src[pos[i]];
  }
}

struct NzShape {
  int nd;
  int64_t size[RHC_MAXDIM];
};

__global__ void k_nonzero(int64_t n, NzShape sh, const unsigned char *mask, const int64_t *pos, int64_t *out,
                          int64_t base) {
  GRID_STRIDE(i, n) {
    if (!mask[i]) continue;
    int64_t rem = i, *o = out + pos[i] * sh.nd;
    for (int d = sh.nd - 1; d >= 0; d--) {
      o[d] = rem % sh.size[d] + base;
      rem /= sh.size[d];
    }
  }
}

template <template <typename> class K, typename... A>
int by_size(int dev, int esize, int64_t n, const char *what, A... args) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (n == 0) return 0;
  switch (esize) {
    case 1: K<uint8_t>::launch(grid_for(dev, n), s, n, args...); break;
    case 4: K<uint32_t>::launch(grid_for(dev, n), s, n, args...); break;
    case 8: K<uint64_t>::launch(grid_for(dev, n), s, n, args...); break;
    default: return fail("%s: no kernel for %d-byte elements", what, esize);
  }
  return launch_check(what);
}

template <typename E>
struct Compact {
  static void launch(unsigned g, cudaStream_t s, int64_t n, const void *mask, const int64_t *pos, const void *src,
                     void *dst) {
    k_compact<E><<<g, kThreads, 0, s>>>(n, (const unsigned char *)mask, pos, (const E *)src, (E *)dst);
  }
};

template <typename E>
struct Expand {
  static void launch(unsigned g, cudaStream_t s, int64_t n, const void *mask, const int64_t *pos, const void *src,
                     void *dst) {
    k_expand<E><<<g, kThreads, 0, s>>>(n, (const unsigned char *)mask, pos, (const E *)src, (E *)dst);
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

int rhc_mask_scan(int dev, int64_t n, const void *mask, int64_t *pos, int64_t *count) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  *count = 0;
  if (n == 0) return 0;
  int64_t *flags = nullptr;
  void *temp = nullptr;
  size_t temp_bytes = 0;
  int rc = -1;
  int64_t tail[2] = {0, 0};
  if (rhc_alloc(dev, n * sizeof(int64_t), (void **)&flags)) return -1;
  k_mask_flags<<<grid_for(dev, n), kThreads, 0, s>>>(n, (const unsigned char *)mask, flags);
  if (launch_check("mask flags kernel")) goto done;
  if (cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, flags, pos, n, s) != cudaSuccess) {
    fail("mask scan: CUB could not size its temporary storage");
    goto done;
  }
  if (rhc_alloc(dev, temp_bytes ? temp_bytes : 1, &temp)) goto done;
  if (cub::DeviceScan::ExclusiveSum(temp, temp_bytes, flags, pos, n, s) != cudaSuccess) {
    fail("mask scan: the CUB prefix sum failed");
    goto done;
  }
  // the count: the last element's place plus whether it is set
  if (rhc_d2h(dev, &tail[0], pos + n - 1, sizeof(int64_t)) || rhc_d2h(dev, &tail[1], flags + n - 1, sizeof(int64_t)))
    goto done;
  *count = tail[0] + tail[1];
  rc = 0;
done:
  rhc_free(dev, flags);
  if (temp) rhc_free(dev, temp);
  return rc;
}

int rhc_mask_compact(int dev, int esize, int64_t n, const void *mask, const int64_t *pos, const void *src, void *dst) {
  return by_size<Compact>(dev, esize, n, "masked_select kernel", mask, pos, src, dst);
}

int rhc_mask_expand(int dev, int esize, int64_t n, const void *mask, const int64_t *pos, const void *src, void *dst) {
  return by_size<Expand>(dev, esize, n, "masked_scatter kernel", mask, pos, src, dst);
}

int rhc_nonzero_write(int dev, int64_t n, int nd, const int64_t *size, const void *mask, const int64_t *pos,
                      int64_t *out, int64_t base) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (n == 0 || nd == 0) {
    // a 0-d tensor: one row of no coordinates; nothing to write
    return 0;
  }
  NzShape sh;
  sh.nd = nd;
  for (int d = 0; d < nd; d++) sh.size[d] = size[d];
  k_nonzero<<<grid_for(dev, n), kThreads, 0, s>>>(n, sh, (const unsigned char *)mask, pos, out, base);
  return launch_check("nonzero kernel");
}

}  // extern "C"
