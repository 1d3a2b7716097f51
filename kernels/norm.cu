// norm.cu: batch norm (training statistics, running statistics, eval, backward),
// layer norm, softmax's backward and the LSTM cell's pointwise part on a device,
// for host/tensor/nn/nn_cuda_norm.c. The kernels are in norm_kernels.cuh (shared
// with kernels/emulated.cpp); here are their launchers: a block per channel or
// row for the sums, a thread per element for the rest. float32 and float64.
#include "common.cuh"
#include "norm_kernels.cuh"

namespace rhc {

static int floats_only(int dtype, const char *what) {
  return fail("%s on CUDA: float32 or float64 only (dtype code %d)", what, dtype);
}

// blocks for per-channel / per-row work: one each, capped (grid-stride beyond)
static unsigned blocks_for(int64_t n) { return (unsigned)(n < 65535 ? (n > 0 ? n : 1) : 65535); }

template <typename T>
int bn_forward(cudaStream_t s, int dev, int64_t n, int64_t c, int64_t inner, const void *x, const void *w,
               const void *b, void *rm, void *rv, int training, double momentum, double eps, void *y, double *mean,
               double *invstd) {
  k_bn_stats<T><<<blocks_for(c), kNormThreads, 0, s>>>(n, c, inner, (const T *)x, (T *)rm, (T *)rv, training, momentum,
                                                       eps, mean, invstd);
  if (launch_check("batch norm statistics kernel")) return -1;
  int64_t total = n * c * inner;
  if (total == 0) return 0;
  k_bn_apply<T><<<grid_for(dev, total), kThreads, 0, s>>>(total, c, inner, (const T *)x, (const T *)w, (const T *)b,
                                                          mean, invstd, (T *)y);
  return launch_check("batch norm kernel");
}

template <typename T>
int bn_backward(cudaStream_t s, int dev, int64_t n, int64_t c, int64_t inner, const void *gy, const void *x,
                const void *w, const double *mean, const double *invstd, int training, void *gx, void *gw, void *gb) {
  double *sums = nullptr;
  if (rhc_alloc(dev, (size_t)(2 * c) * sizeof(double) + 1, (void **)&sums)) return -1;
  k_bn_grad_sums<T><<<blocks_for(c), kNormThreads, 0, s>>>(n, c, inner, (const T *)gy, (const T *)x, mean, invstd, sums,
                                                           (T *)gw, (T *)gb);
  int rc = launch_check("batch norm gradient sums kernel");
  int64_t total = n * c * inner;
  if (rc == 0 && gx && total > 0) {
    k_bn_grad_x<T><<<grid_for(dev, total), kThreads, 0, s>>>(total, c, inner, n * inner, training, (const T *)gy,
                                                             (const T *)x, (const T *)w, mean, invstd, sums, (T *)gx);
    rc = launch_check("batch norm input gradient kernel");
  }
  rhc_free(dev, sums);  // stream-ordered: the cache hands it out again only behind these kernels
  return rc;
}

template <typename T>
int ln_backward(cudaStream_t s, int dev, int64_t rows, int64_t d, const void *gy, const void *x, const void *w,
                const double *mean, const double *rstd, void *gx, void *gw, void *gb) {
  if (gx) {
    k_ln_grad_x<T><<<blocks_for(rows), kNormThreads, 0, s>>>(rows, d, (const T *)gy, (const T *)x, (const T *)w, mean,
                                                             rstd, (T *)gx);
    if (launch_check("layer norm input gradient kernel")) return -1;
  }
  if (gw || gb) {
    k_ln_grad_wb<T>
        <<<grid_for(dev, d), kThreads, 0, s>>>(rows, d, (const T *)gy, (const T *)x, mean, rstd, (T *)gw, (T *)gb);
    if (launch_check("layer norm weight gradient kernel")) return -1;
  }
  return 0;
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_nn_batch_norm(int dev, int dtype, int64_t n, int64_t c, int64_t inner, const void *x, const void *w,
                      const void *b, void *rm, void *rv, int training, double momentum, double eps, void *y,
                      double *mean, double *invstd) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (c == 0) return 0;
  if (dtype == F32)
    return bn_forward<float>(s, dev, n, c, inner, x, w, b, rm, rv, training, momentum, eps, y, mean, invstd);
  if (dtype == F64)
    return bn_forward<double>(s, dev, n, c, inner, x, w, b, rm, rv, training, momentum, eps, y, mean, invstd);
  return floats_only(dtype, "batch norm");
}

int rhc_nn_batch_norm_backward(int dev, int dtype, int64_t n, int64_t c, int64_t inner, const void *gy, const void *x,
                               const void *w, const double *mean, const double *invstd, int training, void *gx,
                               void *gw, void *gb) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (c == 0) return 0;
  if (dtype == F32) return bn_backward<float>(s, dev, n, c, inner, gy, x, w, mean, invstd, training, gx, gw, gb);
  if (dtype == F64) return bn_backward<double>(s, dev, n, c, inner, gy, x, w, mean, invstd, training, gx, gw, gb);
  return floats_only(dtype, "batch norm backward");
}

int rhc_nn_layer_norm(int dev, int dtype, int64_t rows, int64_t d, const void *x, const void *w, const void *b,
                      double eps, void *y, double *mean, double *rstd) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (rows == 0) return 0;
  if (dtype == F32)
    k_ln_forward<float><<<blocks_for(rows), kNormThreads, 0, s>>>(rows, d, (const float *)x, (const float *)w,
                                                                  (const float *)b, eps, (float *)y, mean, rstd);
  else if (dtype == F64)
    k_ln_forward<double><<<blocks_for(rows), kNormThreads, 0, s>>>(rows, d, (const double *)x, (const double *)w,
                                                                   (const double *)b, eps, (double *)y, mean, rstd);
  else return floats_only(dtype, "layer norm");
  return launch_check("layer norm kernel");
}

int rhc_nn_layer_norm_backward(int dev, int dtype, int64_t rows, int64_t d, const void *gy, const void *x,
                               const void *w, const double *mean, const double *rstd, void *gx, void *gw, void *gb) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (dtype == F32) return ln_backward<float>(s, dev, rows, d, gy, x, w, mean, rstd, gx, gw, gb);
  if (dtype == F64) return ln_backward<double>(s, dev, rows, d, gy, x, w, mean, rstd, gx, gw, gb);
  return floats_only(dtype, "layer norm backward");
}

int rhc_nn_softmax_backward(int dev, int dtype, int log_, int64_t rows, int64_t len, const void *y, const void *g,
                            void *gx) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  if (rows == 0) return 0;
  if (dtype == F32)
    k_softmax_back<float>
        <<<blocks_for(rows), kNormThreads, 0, s>>>(log_, rows, len, (const float *)y, (const float *)g, (float *)gx);
  else if (dtype == F64)
    k_softmax_back<double>
        <<<blocks_for(rows), kNormThreads, 0, s>>>(log_, rows, len, (const double *)y, (const double *)g, (double *)gx);
  else return floats_only(dtype, "softmax backward");
  return launch_check("softmax backward kernel");
}

int rhc_nn_lstm_cell(int dev, int dtype, int64_t b, int64_t hs, const void *gates, const void *c_prev, void *h, void *c,
                     void *ws) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  int64_t total = b * hs;
  if (total == 0) return 0;
  if (dtype == F32)
    k_lstm_cell<float><<<grid_for(dev, total), kThreads, 0, s>>>(total, hs, (const float *)gates, (const float *)c_prev,
                                                                 (float *)h, (float *)c, (float *)ws);
  else if (dtype == F64)
    k_lstm_cell<double><<<grid_for(dev, total), kThreads, 0, s>>>(
        total, hs, (const double *)gates, (const double *)c_prev, (double *)h, (double *)c, (double *)ws);
  else return floats_only(dtype, "LSTM cell");
  return launch_check("LSTM cell kernel");
}

int rhc_nn_lstm_cell_backward(int dev, int dtype, int64_t b, int64_t hs, const void *gh, const void *gc,
                              const void *c_prev, const void *ws, void *ggates, void *gc_prev) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  int64_t total = b * hs;
  if (total == 0) return 0;
  if (dtype == F32)
    k_lstm_cell_back<float><<<grid_for(dev, total), kThreads, 0, s>>>(total, hs, (const float *)gh, (const float *)gc,
                                                                      (const float *)c_prev, (const float *)ws,
                                                                      (float *)ggates, (float *)gc_prev);
  else if (dtype == F64)
    k_lstm_cell_back<double><<<grid_for(dev, total), kThreads, 0, s>>>(
        total, hs, (const double *)gh, (const double *)gc, (const double *)c_prev, (const double *)ws, (double *)ggates,
        (double *)gc_prev);
  else return floats_only(dtype, "LSTM cell backward");
  return launch_check("LSTM cell backward kernel");
}

}  // extern "C"
