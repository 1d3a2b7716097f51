// nn.cu: the window kernels behind nn.Conv1d/Conv2d and the 2-d poolings on a
// device (host/tensor/nn_cuda.c calls them; cuDNN is not a dependency).
// Convolution is im2col + cuBLAS GEMM as on the host (host/tensor/nn_conv.c),
// so only the column moves live here: im2col writes one column element per
// thread, col2im gathers each image element from the columns that read it (no
// atomics, the sum in a fixed order). Pooling is one thread per output element
// forward; backward scatters each output's gradient into its window with
// atomicAdd (windows overlap when stride < kernel). float32 and float64 only,
// accumulation in double; the window rules are nn_pool.c's (PyTorch's).
#include "common.cuh"

namespace rhc {

// ---- convolution columns
// cols[s][r][l], r = (ci, ki, kj) and l = (oy, ox): the input element the tap reads, 0 in the padding
template <typename T>
__global__ void k_im2col(rhc_window_t g, int64_t c, int64_t total, const T *x, T *cols) {
  const int64_t L = g.oh * g.ow, K = c * g.k[0] * g.k[1];
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t l = i % L, r = (i / L) % K, s = i / (L * K);
    int64_t ox = l % g.ow, oy = l / g.ow;
    int64_t kj = r % g.k[1], ki = (r / g.k[1]) % g.k[0], ci = r / (g.k[0] * g.k[1]);
    int64_t iy = oy * g.stride[0] - g.pad[0] + ki * g.dil[0], ix = ox * g.stride[1] - g.pad[1] + kj * g.dil[1];
    bool in = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
    cols[i] = in ? x[((s * c + ci) * g.h + iy) * g.w + ix] : (T)0;
  }
}

// image element (s, ci, iy, ix) = the sum over the taps (ki, kj) of the column
// elements that read it: oy * stride - pad + ki * dil == iy, likewise for x
template <typename T>
__global__ void k_col2im(rhc_window_t g, int64_t c, int64_t total, const T *cols, T *x) {
  const int64_t L = g.oh * g.ow, K = c * g.k[0] * g.k[1];
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t ix = i % g.w, iy = (i / g.w) % g.h, ci = (i / (g.w * g.h)) % c, s = i / (g.w * g.h * c);
    const T *base = cols + s * K * L;
    double sum = 0;
    for (int64_t ki = 0; ki < g.k[0]; ki++) {
      int64_t ty = iy + g.pad[0] - ki * g.dil[0];  // = oy * stride[0]
      if (ty < 0) break;                           // falls as ki grows
      if (ty % g.stride[0]) continue;
      int64_t oy = ty / g.stride[0];
      if (oy >= g.oh) continue;
      for (int64_t kj = 0; kj < g.k[1]; kj++) {
        int64_t tx = ix + g.pad[1] - kj * g.dil[1];
        if (tx < 0) break;
        if (tx % g.stride[1]) continue;
        int64_t ox = tx / g.stride[1];
        if (ox >= g.ow) continue;
        int64_t r = (ci * g.k[0] + ki) * g.k[1] + kj;
        sum += (double)base[r * L + oy * g.ow + ox];
      }
    }
    x[i] = (T)sum;
  }
}

// ---- pooling
// the input window of output (oy, ox) clipped to the input, [y0, y1) x [x0, x1),
// and what its sum is divided by (avg and adaptive; max ignores it)
__device__ inline double window(const rhc_window_t &g, int op, int64_t oy, int64_t ox, int64_t *y0, int64_t *y1,
                                int64_t *x0, int64_t *x1) {
  if (op == RHC_POOL_ADAPTIVE || op == RHC_POOL_ADAPTIVE_BACK) {
    *y0 = (oy * g.h) / g.oh, *y1 = ((oy + 1) * g.h + g.oh - 1) / g.oh;
    *x0 = (ox * g.w) / g.ow, *x1 = ((ox + 1) * g.w + g.ow - 1) / g.ow;
    return (double)((*y1 - *y0) * (*x1 - *x0));
  }
  int64_t hs = oy * g.stride[0] - g.pad[0], ws = ox * g.stride[1] - g.pad[1];
  int64_t he = hs + g.k[0], we = ws + g.k[1];
  if (he > g.h + g.pad[0]) he = g.h + g.pad[0];
  if (we > g.w + g.pad[1]) we = g.w + g.pad[1];
  int64_t pool = (he - hs) * (we - ws);
  *y0 = hs < 0 ? 0 : hs, *x0 = ws < 0 ? 0 : ws;
  *y1 = he > g.h ? g.h : he, *x1 = we > g.w ? g.w : we;
  if (g.divisor) return (double)g.divisor;
  return g.count_include_pad ? (double)pool : (double)((*y1 - *y0) * (*x1 - *x0));
}

// max over the dilated window in row-major tap order: the first of equal
// maxima wins, the first NaN beats everything; a window of padding only gives
// -inf and index -1 (as nn_pool.c)
template <typename T>
__global__ void k_max_pool(rhc_window_t g, int64_t total, const T *x, T *y, int64_t *idx) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t ox = i % g.ow, oy = (i / g.ow) % g.oh, pl = i / (g.ow * g.oh);
    const T *plane = x + pl * g.h * g.w;
    T best = (T)-INFINITY;
    int64_t bi = -1;
    bool nan = false;
    for (int64_t ki = 0; ki < g.k[0] && !nan; ki++) {
      int64_t iy = oy * g.stride[0] - g.pad[0] + ki * g.dil[0];
      if (iy < 0 || iy >= g.h) continue;
      for (int64_t kj = 0; kj < g.k[1]; kj++) {
        int64_t ix = ox * g.stride[1] - g.pad[1] + kj * g.dil[1];
        if (ix < 0 || ix >= g.w) continue;
        T v = plane[iy * g.w + ix];
        if (bi < 0 || v > best || v != v) {
          best = v, bi = iy * g.w + ix;
          if (v != v) {
            nan = true;
            break;
          }
        }
      }
    }
    y[i] = best;
    idx[i] = bi;
  }
}

template <typename T>
__global__ void k_max_pool_back(rhc_window_t g, int64_t total, const T *gy, const int64_t *idx, T *gx) {
  const int64_t hw = g.h * g.w, per = g.oh * g.ow;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t at = idx[i];
    if (at >= 0 && at < hw) atomicAdd(gx + (i / per) * hw + at, gy[i]);
  }
}

// avg / adaptive: forward sums the window, backward spreads g / divisor over it
template <typename T>
__global__ void k_avg_pool(rhc_window_t g, int op, int64_t total, const T *in, T *out) {
  const bool back = op == RHC_POOL_AVG_BACK || op == RHC_POOL_ADAPTIVE_BACK;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t ox = i % g.ow, oy = (i / g.ow) % g.oh, pl = i / (g.ow * g.oh), y0, y1, x0, x1;
    double div = window(g, op, oy, ox, &y0, &y1, &x0, &x1);
    if (back) {
      T v = (T)((double)in[i] / div);
      T *plane = out + pl * g.h * g.w;
      for (int64_t iy = y0; iy < y1; iy++)
        for (int64_t ix = x0; ix < x1; ix++) atomicAdd(plane + iy * g.w + ix, v);
    } else {
      const T *plane = in + pl * g.h * g.w;
      double s = 0;
      for (int64_t iy = y0; iy < y1; iy++)
        for (int64_t ix = x0; ix < x1; ix++) s += (double)plane[iy * g.w + ix];
      out[i] = (T)(s / div);
    }
  }
}

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
  if (back) RHC_CHECK(cudaMemsetAsync(out, 0, (size_t)(g->planes * g->h * g->w) * sizeof(T), s), "zeroing a pooling gradient");
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
    case RHC_POOL_ADAPTIVE_BACK: k_avg_pool<T><<<grid, kThreads, 0, s>>>(*g, op, outputs, (const T *)in, (T *)out); break;
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
