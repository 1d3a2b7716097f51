// blas.cu: matrix products. float32/float64 go to cuBLAS (row-major C = A B is
// column-major C^T = B^T A^T, so the operands swap and the transpose flags stay);
// integer dtypes, which cuBLAS has no GEMM for, use a shared-memory tiled kernel.
#include <cublas_v2.h>

#include "common.cuh"

namespace rhc {

static cublasHandle_t handles[64];

static const char *cublas_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

static cublasHandle_t handle_for(int dev) {
  cudaStream_t s = stream_for(dev);
  if (!s) return nullptr;
  if (dev >= 64) {
    fail("device index %d out of range", dev);
    return nullptr;
  }
  if (!handles[dev]) {
    cublasStatus_t st = cublasCreate(&handles[dev]);
    if (st != CUBLAS_STATUS_SUCCESS) {
      fail("cublasCreate: %s", cublas_name(st));
      handles[dev] = nullptr;
      return nullptr;
    }
    cublasSetStream(handles[dev], s);
  }
  return handles[dev];
}

constexpr int kTile = 16;

// grid: (column tiles, row tiles, batch). The row tiles are walked with a
// grid stride: gridDim.y is capped at 65535, i.e. m below ~1M rows otherwise.
template <typename T>
__global__ void k_int_gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const T *A, int64_t lda, int64_t sa,
                           const T *B, int64_t ldb, int64_t sb, T *C, int64_t sc) {
  __shared__ int64_t As[kTile][kTile], Bs[kTile][kTile];
  const T *a = A + blockIdx.z * sa, *b = B + blockIdx.z * sb;
  T *c = C + blockIdx.z * sc;
  int64_t col = blockIdx.x * kTile + threadIdx.x;
  for (int64_t rt = blockIdx.y; rt * kTile < m; rt += gridDim.y) {  // uniform per block
    int64_t row = rt * kTile + threadIdx.y;
    int64_t acc = 0;
    for (int64_t p0 = 0; p0 < k; p0 += kTile) {
      int64_t pa = p0 + threadIdx.x, pb = p0 + threadIdx.y;
      // element (i, p) of op(A): A[i*lda + p] as stored, or A[p*lda + i] when transposed
      As[threadIdx.y][threadIdx.x] = (row < m && pa < k) ? (int64_t)(ta ? a[pa * lda + row] : a[row * lda + pa]) : 0;
      Bs[threadIdx.y][threadIdx.x] = (pb < k && col < n) ? (int64_t)(tb ? b[col * ldb + pb] : b[pb * ldb + col]) : 0;
      __syncthreads();
#pragma unroll
      for (int q = 0; q < kTile; q++) acc += As[threadIdx.y][q] * Bs[q][threadIdx.x];
      __syncthreads();
    }
    // the host's integer gemm stores the int64 sum through rh_dtype_store, which
    // clamps to the dtype's range (uint8: 400 -> 255), it does not wrap
    if (row < m && col < n) c[row * n + col] = from_double<T>((double)acc);
  }
}

template <typename T>
int int_gemm(cudaStream_t s, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, int64_t sa,
             const void *b, int64_t ldb, int64_t sb, void *c, int64_t sc, int64_t batch) {
  int64_t row_tiles = (m + kTile - 1) / kTile;
  dim3 block(kTile, kTile),
      grid((unsigned)((n + kTile - 1) / kTile), (unsigned)(row_tiles < 65535 ? row_tiles : 65535), (unsigned)batch);
  k_int_gemm<T><<<grid, block, 0, s>>>(ta, tb, m, n, k, (const T *)a, lda, sa, (const T *)b, ldb, sb, (T *)c, sc);
  return launch_check("integer matmul kernel");
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_gemm(int dev, int dtype, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda,
             int64_t sa, const void *b, int64_t ldb, int64_t sb, void *c, int64_t sc, int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return 0;
  if (batch > 65535 && (dtype != F32 && dtype != F64))
    return fail("integer matmul on CUDA: at most 65535 matrices per batch, got %lld", (long long)batch);
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || batch > INT32_MAX)
    return fail("matmul on CUDA: a dimension above 2^31-1");
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (dtype == I32) return int_gemm<int32_t>(s, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, sc, batch);
  if (dtype == I64) return int_gemm<int64_t>(s, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, sc, batch);
  if (dtype == U8) return int_gemm<uint8_t>(s, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, sc, batch);
  if (dtype != F32 && dtype != F64) return fail("matmul on CUDA: dtype code %d is not supported", dtype);
  cublasHandle_t h = handle_for(dev);
  if (!h) return -1;
  cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasStatus_t st;
  if (dtype == F32) {
    const float one = 1, zero = 0;
    st = cublasSgemmStridedBatched(h, ob, oa, (int)n, (int)m, (int)k, &one, (const float *)b, (int)ldb, sb,
                                   (const float *)a, (int)lda, sa, &zero, (float *)c, (int)n, sc, (int)batch);
  } else {
    const double one = 1, zero = 0;
    st = cublasDgemmStridedBatched(h, ob, oa, (int)n, (int)m, (int)k, &one, (const double *)b, (int)ldb, sb,
                                   (const double *)a, (int)lda, sa, &zero, (double *)c, (int)n, sc, (int)batch);
  }
  if (st != CUBLAS_STATUS_SUCCESS)
    return fail("cuBLAS GEMM (%lldx%lldx%lld): %s", (long long)m, (long long)n, (long long)k, cublas_name(st));
  return 0;
}

int rhc_bench_cublas_gemm(int dev, int n, int iters, double *ms) {
  cublasHandle_t h = handle_for(dev);
  if (!h) return -1;
  size_t bytes = (size_t)n * n * sizeof(float);
  float *a = nullptr, *b = nullptr, *c = nullptr;
  int rc = -1;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (rhc_alloc(dev, bytes, (void **)&a) || rhc_alloc(dev, bytes, (void **)&b) || rhc_alloc(dev, bytes, (void **)&c))
    goto out;
  cudaMemsetAsync(a, 0, bytes, stream_for(dev));
  cudaMemsetAsync(b, 0, bytes, stream_for(dev));
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  {
    const float one = 1, zero = 0;
    cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b, n, a, n, &zero, c, n);  // warm up
    cudaEventRecord(e0, stream_for(dev));
    for (int i = 0; i < iters; i++) cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b, n, a, n, &zero, c, n);
    cudaEventRecord(e1, stream_for(dev));
    if (cudaEventSynchronize(e1) != cudaSuccess) {
      rc = fail("cuBLAS benchmark failed: %s", cudaGetErrorString(cudaGetLastError()));
      goto out;
    }
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    *ms = (double)t / iters;
    rc = 0;
  }
out:
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  rhc_free(dev, a);
  rhc_free(dev, b);
  rhc_free(dev, c);
  return rc;
}

}  // extern "C"
