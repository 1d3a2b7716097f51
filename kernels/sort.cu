// sort.cu: the device side of host/tensor/sort.c: sort of contiguous rows (a
// stable segmented radix sort from CUB on keys that order like the values, the
// same keys the host makes: NaN after +inf, -0 with 0, descending as the
// complement) and the scans cumsum / cumprod (one thread per row, accumulating
// in double, or exactly in int64 for integers, in the host's order, so both give
// the same bits). One template per family, instantiated per dtype by dispatch().
#include <cub/device/device_segmented_radix_sort.cuh>

#include "common.cuh"

namespace rhc {

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

template <typename T>
__device__ inline uint64_t key_of(T x) {
  if constexpr (std::is_same<T, float>::value) {
    if (x != x) return 0xFFFFFFFFull;
    if (x == 0) x = 0;
    uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? (uint32_t)~u : (u | 0x80000000u);
  } else if constexpr (std::is_same<T, double>::value) {
    if (x != x) return ~0ull;
    if (x == 0) x = 0;
    uint64_t u = (uint64_t)__double_as_longlong(x);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  } else if constexpr (std::is_same<T, int32_t>::value) {
    return (uint32_t)x ^ 0x80000000u;
  } else if constexpr (std::is_same<T, int64_t>::value) {
    return (uint64_t)x ^ 0x8000000000000000ull;
  } else {
    return (uint64_t)(uint8_t)x;
  }
}

template <typename T>
constexpr int key_bits() {
  return sizeof(T) * 8;
}

template <typename T>
__global__ void k_keys(int64_t n, int64_t len, const T *in, bool descending, uint64_t mask, uint64_t *keys,
                       int64_t *order, int64_t *offsets, int64_t rows) {
  GRID_STRIDE(i, n) {
    uint64_t k = key_of<T>(in[i]);
    keys[i] = descending ? (~k & mask) : k;
    order[i] = i % len;
  }
  GRID_STRIDE(r, rows + 1) { offsets[r] = r * len; }
}

template <typename T>
__global__ void k_take(int64_t n, int64_t len, const T *in, const int64_t *order, T *vals, int64_t *idx, int64_t base) {
  GRID_STRIDE(i, n) {
    int64_t row = i / len, o = order[i];
    vals[i] = in[row * len + o];
    idx[i] = o + base;
  }
}

struct SortRun {
  template <typename T>
  static int run(int dev, int descending, int64_t rows, int64_t len, const void *in, void *vals, int64_t *idx,
                 int64_t base) {
    cudaStream_t s = stream_for(dev);
    if (!s) return -1;
    int64_t n = rows * len;
    if (n == 0) return 0;
    if (n > INT32_MAX || rows > INT32_MAX)
      return fail("sort: %lld elements are more than one device sort takes", (long long)n);
    constexpr int bits = key_bits<T>();
    uint64_t mask = bits == 64 ? ~0ull : ((1ull << bits) - 1);
    uint64_t *keys = nullptr, *keys_out = nullptr;
    int64_t *order = nullptr, *offsets = nullptr;
    void *temp = nullptr;
    size_t temp_bytes = 0;
    int rc = -1;
    if (rhc_alloc(dev, n * sizeof(uint64_t), (void **)&keys) ||
        rhc_alloc(dev, n * sizeof(uint64_t), (void **)&keys_out) ||
        rhc_alloc(dev, n * sizeof(int64_t), (void **)&order) ||
        rhc_alloc(dev, (rows + 1) * sizeof(int64_t), (void **)&offsets))
      goto done;
    k_keys<T><<<grid_for(dev, n), kThreads, 0, s>>>(n, len, (const T *)in, descending != 0, mask, keys, order, offsets,
                                                    rows);
    if (launch_check("sort keys kernel")) goto done;
    // the sorted order lands in idx (int64, the caller's buffer), then values are taken by it
    if (cub::DeviceSegmentedRadixSort::SortPairs(nullptr, temp_bytes, keys, keys_out, order, idx, (int)n, (int)rows,
                                                 offsets, offsets + 1, 0, bits, s) != cudaSuccess) {
      fail("sort: CUB could not size its temporary storage");
      goto done;
    }
    if (rhc_alloc(dev, temp_bytes ? temp_bytes : 1, &temp)) goto done;
    if (cub::DeviceSegmentedRadixSort::SortPairs(temp, temp_bytes, keys, keys_out, order, idx, (int)n, (int)rows,
                                                 offsets, offsets + 1, 0, bits, s) != cudaSuccess) {
      fail("sort: the CUB segmented radix sort failed");
      goto done;
    }
    // order <- idx (positions within the row), then values and base-shifted indices
    if (cudaMemcpyAsync(order, idx, n * sizeof(int64_t), cudaMemcpyDeviceToDevice, s) != cudaSuccess) {
      fail("sort: cudaMemcpyAsync failed");
      goto done;
    }
    k_take<T><<<grid_for(dev, n), kThreads, 0, s>>>(n, len, (const T *)in, order, (T *)vals, idx, base);
    rc = launch_check("sort take kernel");
  done:
    // the stream orders these frees after the kernels (the caching allocator reuses per stream)
    if (keys) rhc_free(dev, keys);
    if (keys_out) rhc_free(dev, keys_out);
    if (order) rhc_free(dev, order);
    if (offsets) rhc_free(dev, offsets);
    if (temp) rhc_free(dev, temp);
    return rc;
  }
};

template <typename T, typename O>
__global__ void k_scan(int64_t rows, int64_t len, const T *in, O *out, bool prod) {
  GRID_STRIDE(r, rows) {
    const T *x = in + r * len;
    O *y = out + r * len;
    if constexpr (std::is_same<O, int64_t>::value) {
      uint64_t acc = prod ? 1 : 0;
      for (int64_t i = 0; i < len; i++) {
        uint64_t v = (uint64_t)(int64_t)x[i];
        acc = prod ? acc * v : acc + v;
        y[i] = (int64_t)acc;
      }
    } else {
      double acc = prod ? 1 : 0;
      for (int64_t i = 0; i < len; i++) {
        double v = (double)x[i];
        acc = prod ? acc * v : acc + v;
        y[i] = (O)acc;
      }
    }
  }
}

struct ScanRun {
  template <typename T>
  static int run(int dev, int out_dtype, int prod, int64_t rows, int64_t len, const void *in, void *out) {
    cudaStream_t s = stream_for(dev);
    if (!s) return -1;
    if (rows == 0 || len == 0) return 0;
    if (out_dtype == I64)
      k_scan<T, int64_t><<<grid_for(dev, rows), kThreads, 0, s>>>(rows, len, (const T *)in, (int64_t *)out, prod != 0);
    else if constexpr (std::is_floating_point<T>::value)
      k_scan<T, T><<<grid_for(dev, rows), kThreads, 0, s>>>(rows, len, (const T *)in, (T *)out, prod != 0);
    else return fail("scan: an integer input gives int64, not dtype %d", out_dtype);
    return launch_check("scan kernel");
  }
};

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_sort_rows(int dev, int dtype, int descending, int64_t rows, int64_t len, const void *in, void *vals,
                  int64_t *idx, int64_t base) {
  return dispatch<SortRun>(dtype, dev, descending, rows, len, in, vals, idx, base);
}

int rhc_scan_rows(int dev, int in_dtype, int out_dtype, int prod, int64_t rows, int64_t len, const void *in,
                  void *out) {
  return dispatch<ScanRun>(in_dtype, dev, out_dtype, prod, rows, len, in, out);
}

}  // extern "C"
