// norm_kernels.cuh: the bodies of kernels/norm.cu's kernels (batch and layer
// norm, softmax's backward, the LSTM cell's pointwise part), apart from their
// launchers so that kernels/emulated.cpp runs the same code on the host. A
// block owns a channel (batch norm) or a row (layer norm, softmax) and sums
// over it through shared memory; block_sum works for any power-of-two
// blockDim, 1 included (the emulation). Sums in double, as on the host
// (host/tensor/nn/nn_norm.c, nn_softmax.c, nn_rnn.c, whose formulas these follow).
#pragma once

#include <math.h>
#include <stdint.h>

namespace rhc {

constexpr int kNormThreads = 256;

// the sum of every thread's v over the block (all threads get it)
__device__ inline double block_sum(double v, double *sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  double r = sh[0];
  __syncthreads();
  return r;
}

// element e of channel ch in x [n][c][inner]
__device__ inline int64_t bn_at(int64_t e, int64_t ch, int64_t c, int64_t inner) {
  return ((e / inner) * c + ch) * inner + e % inner;
}

// per channel: training, the batch's mean and biased variance (two passes), the
// running statistics updated with the unbiased one; eval, the running ones
template <typename T>
__global__ void k_bn_stats(int64_t n, int64_t c, int64_t inner, const T *x, T *rm, T *rv, int training, double momentum,
                           double eps, double *mean, double *invstd) {
  __shared__ double sh[kNormThreads];
  const int64_t m = n * inner;
  for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    double mu, is;
    if (training) {
      double s = 0, q = 0;
      for (int64_t e = threadIdx.x; e < m; e += blockDim.x) s += (double)x[bn_at(e, ch, c, inner)];
      mu = block_sum(s, sh) / (double)m;
      for (int64_t e = threadIdx.x; e < m; e += blockDim.x) {
        double d = (double)x[bn_at(e, ch, c, inner)] - mu;
        q += d * d;
      }
      double var = block_sum(q, sh) / (double)m;
      is = 1.0 / sqrt(var + eps);
      if (threadIdx.x == 0 && rm) {
        double unbiased = m > 1 ? var * (double)m / (double)(m - 1) : var;
        rm[ch] = (T)((1 - momentum) * (double)rm[ch] + momentum * mu);
        rv[ch] = (T)((1 - momentum) * (double)rv[ch] + momentum * unbiased);
      }
    } else {
      mu = (double)rm[ch];
      is = 1.0 / sqrt((double)rv[ch] + eps);
    }
    if (threadIdx.x == 0) mean[ch] = mu, invstd[ch] = is;
  }
}

// y = (x - mean) * invstd * w + b, one thread per element
template <typename T>
__global__ void k_bn_apply(int64_t total, int64_t c, int64_t inner, const T *x, const T *w, const T *b,
                           const double *mean, const double *invstd, T *y) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t ch = (i / inner) % c;
    double scale = invstd[ch] * (w ? (double)w[ch] : 1.0);
    y[i] = (T)(((double)x[i] - mean[ch]) * scale + (b ? (double)b[ch] : 0.0));
  }
}

// per channel: sums[2 ch] = sum gy, sums[2 ch + 1] = sum gy * (x - mean); gw, gb from them
template <typename T>
__global__ void k_bn_grad_sums(int64_t n, int64_t c, int64_t inner, const T *gy, const T *x, const double *mean,
                               const double *invstd, double *sums, T *gw, T *gb) {
  __shared__ double sh[kNormThreads];
  const int64_t m = n * inner;
  for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    double sg = 0, sgx = 0;
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x) {
      int64_t at = bn_at(e, ch, c, inner);
      sg += (double)gy[at];
      sgx += (double)gy[at] * ((double)x[at] - mean[ch]);
    }
    sg = block_sum(sg, sh);
    sgx = block_sum(sgx, sh);
    if (threadIdx.x == 0) {
      sums[2 * ch] = sg, sums[2 * ch + 1] = sgx;
      if (gw) gw[ch] = (T)(sgx * invstd[ch]);
      if (gb) gb[ch] = (T)sg;
    }
  }
}

// gx = w * invstd * (gy - sum gy / m - (x - mean) * invstd^2 * sum gy (x - mean) / m)
// in training; w * invstd * gy in eval (the statistics are constants there)
template <typename T>
__global__ void k_bn_grad_x(int64_t total, int64_t c, int64_t inner, int64_t m, int training, const T *gy, const T *x,
                            const T *w, const double *mean, const double *invstd, const double *sums, T *gx) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t ch = (i / inner) % c;
    double is = invstd[ch], a = (w ? (double)w[ch] : 1.0) * is, g = (double)gy[i];
    if (training) g -= sums[2 * ch] / (double)m + ((double)x[i] - mean[ch]) * is * is * sums[2 * ch + 1] / (double)m;
    gx[i] = (T)(a * g);
  }
}

// layer norm: a block per row of d
template <typename T>
__global__ void k_ln_forward(int64_t rows, int64_t d, const T *x, const T *w, const T *b, double eps, T *y,
                             double *mean, double *rstd) {
  __shared__ double sh[kNormThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *xr = x + r * d;
    double s = 0, q = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) s += (double)xr[j];
    double mu = block_sum(s, sh) / (double)d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) q += ((double)xr[j] - mu) * ((double)xr[j] - mu);
    double rs = 1.0 / sqrt(block_sum(q, sh) / (double)d + eps);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
      y[r * d + j] = (T)(((double)xr[j] - mu) * rs * (w ? (double)w[j] : 1.0) + (b ? (double)b[j] : 0.0));
    if (threadIdx.x == 0) mean[r] = mu, rstd[r] = rs;
  }
}

// gx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)), gxhat = g * w
template <typename T>
__global__ void k_ln_grad_x(int64_t rows, int64_t d, const T *gy, const T *x, const T *w, const double *mean,
                            const double *rstd, T *gx) {
  __shared__ double sh[kNormThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *gr = gy + r * d, *xr = x + r * d;
    double mu = mean[r], rs = rstd[r], sa = 0, sb = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      double gh = (double)gr[j] * (w ? (double)w[j] : 1.0);
      sa += gh;
      sb += gh * ((double)xr[j] - mu) * rs;
    }
    double ma = block_sum(sa, sh) / (double)d, mb = block_sum(sb, sh) / (double)d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      double gh = (double)gr[j] * (w ? (double)w[j] : 1.0);
      gx[r * d + j] = (T)(rs * (gh - ma - ((double)xr[j] - mu) * rs * mb));
    }
  }
}

// gw[j] = sum over rows of g * xhat, gb[j] = sum of g: a thread per column
template <typename T>
__global__ void k_ln_grad_wb(int64_t rows, int64_t d, const T *gy, const T *x, const double *mean, const double *rstd,
                             T *gw, T *gb) {
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < d; j += (int64_t)gridDim.x * blockDim.x) {
    double sw = 0, sb = 0;
    for (int64_t r = 0; r < rows; r++) {
      double g = (double)gy[r * d + j];
      sw += g * ((double)x[r * d + j] - mean[r]) * rstd[r];
      sb += g;
    }
    if (gw) gw[j] = (T)sw;
    if (gb) gb[j] = (T)sb;
  }
}

// softmax's backward from its output y: y * (g - sum g y); log-softmax's: g - exp(y) * sum g
template <typename T>
__global__ void k_softmax_back(int log_, int64_t rows, int64_t len, const T *y, const T *g, T *gx) {
  __shared__ double sh[kNormThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *yr = y + r * len, *gr = g + r * len;
    double s = 0;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) s += (double)gr[j] * (log_ ? 1.0 : (double)yr[j]);
    s = block_sum(s, sh);
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
      gx[r * len + j] = (T)(log_ ? (double)gr[j] - exp((double)yr[j]) * s : (double)yr[j] * ((double)gr[j] - s));
  }
}

template <typename T>
__device__ inline T sigmoid_of(T v) {
  return (T)1 / ((T)1 + exp(-v));
}

// the LSTM cell from gates [b, 4h] (i, f, g, o) and c_prev [b, h]: h, c and ws
// [b, 5h] (the activated gates and tanh(c)), a thread per (row, unit)
template <typename T>
__global__ void k_lstm_cell(int64_t total, int64_t hs, const T *gates, const T *cp, T *ho, T *co, T *ws) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = e / hs, k = e % hs;
    const T *gt = gates + r * 4 * hs;
    T i = sigmoid_of(gt[k]), f = sigmoid_of(gt[hs + k]), g = tanh(gt[2 * hs + k]), o = sigmoid_of(gt[3 * hs + k]);
    T c = f * cp[e] + i * g, t = tanh(c);
    co[e] = c, ho[e] = o * t;
    T *w = ws + r * 5 * hs;
    w[k] = i, w[hs + k] = f, w[2 * hs + k] = g, w[3 * hs + k] = o, w[4 * hs + k] = t;
  }
}

// its gradients; gh or gc NULL is zero
template <typename T>
__global__ void k_lstm_cell_back(int64_t total, int64_t hs, const T *gh, const T *gc, const T *cp, const T *ws, T *gg,
                                 T *gp) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = e / hs, k = e % hs;
    const T *w = ws + r * 5 * hs;
    T i = w[k], f = w[hs + k], g = w[2 * hs + k], o = w[3 * hs + k], t = w[4 * hs + k];
    T h_ = gh ? gh[e] : (T)0, c_ = gc ? gc[e] : (T)0;
    T gct = c_ + h_ * o * ((T)1 - t * t);
    T *out = gg + r * 4 * hs;
    out[k] = gct * g * i * ((T)1 - i);
    out[hs + k] = gct * cp[e] * f * ((T)1 - f);
    out[2 * hs + k] = gct * i * ((T)1 - g * g);
    out[3 * hs + k] = h_ * t * o * ((T)1 - o);
    gp[e] = gct * f;
  }
}

}  // namespace rhc
