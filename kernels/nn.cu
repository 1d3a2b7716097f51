// nn.cu: the window kernels behind nn.Conv1d/Conv2d and the 2-d poolings on a
// device (host/tensor/nn/nn_cuda.c calls them; cuDNN is not a dependency).
// Convolution is im2col + cuBLAS GEMM as on the host (host/tensor/nn/nn_conv.c),
// so only the column moves live here: im2col writes one column element per
// thread, col2im gathers each image element from the columns that read it (no
// atomics, the sum in a fixed order). Pooling is one thread per output element
// forward; backward scatters each output's gradient into its window with
// atomicAdd (windows overlap when stride < kernel). float32 and float64 only,
// accumulation in double; the window rules are nn_pool.c's (PyTorch's). The
// kernels themselves are in nn_kernels.cuh (shared with kernels/emulated.cpp),
// their launchers and entry points here.
#include "common.cuh"
#include "nn_kernels.cuh"

namespace rhc {

template <typename T>
int im2col_t(int dev, const rhc_window_t *g, int64_t n, void *image, void *cols, int to_image) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  int64_t c = g->planes;
  int64_t total = to_image ? n * c * g->h * g->w : n * c * g->k[0] * g->k[1] * g->oh * g->ow;
  if (total == 0) return 0;
  if (to_image) k_col2im<T><<<grid_for(dev, total), kThreads, 0, s>>>(*g, c, total, (const T *)cols, (T *)image);
  else k_im2col<T><<<grid_for(dev, total), kThreads, 0, s>>>(*g, c, total, (const T *)image, (T *)cols);
  return launch_check(to_image ? "col2im kernel" : "im2col kernel");
}

template <typename T>
int pool_t(int dev, int op, const rhc_window_t *g, const void *in, void *out, int64_t *idx) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  int64_t outputs = g->planes * g->oh * g->ow;
  bool back = op >= RHC_POOL_MAX_BACK;
  if (back)
    RHC_CHECK(cudaMemsetAsync(out, 0, (size_t)(g->planes * g->h * g->w) * sizeof(T), s), "zeroing a pooling gradient");
  if (outputs == 0) return 0;
  unsigned grid = grid_for(dev, outputs);
  switch (op) {
    case RHC_POOL_MAX:
      if (!idx) return fail("max pooling on CUDA needs an index buffer");
      k_max_pool<T><<<grid, kThreads, 0, s>>>(*g, outputs, (const T *)in, (T *)out, idx);
      break;
    case RHC_POOL_MAX_BACK:
      if (!idx) return fail("max pooling backward on CUDA needs the forward's indices");
      k_max_pool_back<T><<<grid, kThreads, 0, s>>>(*g, outputs, (const T *)in, idx, (T *)out);
      break;
    case RHC_POOL_AVG:
    case RHC_POOL_ADAPTIVE:
    case RHC_POOL_AVG_BACK:
    case RHC_POOL_ADAPTIVE_BACK:
      k_avg_pool<T><<<grid, kThreads, 0, s>>>(*g, op, outputs, (const T *)in, (T *)out);
      break;
    default: return fail("unknown pooling op %d", op);
  }
  return launch_check("pooling kernel");
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_nn_im2col(int dev, int dtype, const rhc_window_t *g, int64_t n, void *image, void *cols, int to_image) {
  if (dtype == F32) return im2col_t<float>(dev, g, n, image, cols, to_image);
  if (dtype == F64) return im2col_t<double>(dev, g, n, image, cols, to_image);
  return fail("convolution on CUDA: float32 or float64 only (dtype code %d)", dtype);
}

int rhc_nn_pool(int dev, int dtype, int op, const rhc_window_t *g, const void *in, void *out, int64_t *idx) {
  if (dtype == F32) return pool_t<float>(dev, op, g, in, out, idx);
  if (dtype == F64) return pool_t<double>(dev, op, g, in, out, idx);
  return fail("pooling on CUDA: float32 or float64 only (dtype code %d)", dtype);
}

}  // extern "C"
