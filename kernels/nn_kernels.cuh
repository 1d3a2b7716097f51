// nn_kernels.cuh: the bodies of kernels/nn.cu's kernels (convolution columns
// and pooling), apart from their launchers so that kernels/emulated.cpp can
// run the very same code on the host, one thread walking each grid-stride loop
// (the suite's check of these kernels on a machine without a GPU). Needs
// blockIdx/threadIdx/gridDim/blockDim, atomicAdd and INFINITY from its includer.
#pragma once

#include <stdint.h>

extern "C" {
#include "tensor/cuda_api.h"
}

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

}  // namespace rhc
