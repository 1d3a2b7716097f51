/* nn_cuda.h: the nn kernels of nn.h for tensors on a CUDA device: convolution
 * and the 2-d poolings (nn_cuda.c, kernels/nn.cu), batch and layer norm,
 * softmax and the LSTM cell (nn_cuda_norm.c, kernels/norm.cu). nn.h's contract
 * for device tensors, results on the input's device. bindings/l_nn.c picks
 * these for a tensor on a device. */
#ifndef RH_NN_CUDA_H
#define RH_NN_CUDA_H

#include "nn.h"

rh_tensor_t *rh_nn_cuda_conv2d(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p);
int rh_nn_cuda_conv2d_backward(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *gy, const rh_nn_conv_t *p, rh_tensor_t **gx,
                               rh_tensor_t **gw, rh_tensor_t **gb);
int rh_nn_cuda_max_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p, rh_tensor_t **y, rh_tensor_t **idx);
rh_tensor_t *rh_nn_cuda_max_pool2d_backward(rh_tensor_t *gy, rh_tensor_t *idx, int64_t h, int64_t w);
rh_tensor_t *rh_nn_cuda_avg_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p);
rh_tensor_t *rh_nn_cuda_avg_pool2d_backward(rh_tensor_t *gy, const rh_nn_pool_t *p, int64_t h, int64_t w);
rh_tensor_t *rh_nn_cuda_adaptive_avg_pool2d(rh_tensor_t *x, int64_t oh, int64_t ow);
rh_tensor_t *rh_nn_cuda_adaptive_avg_pool2d_backward(rh_tensor_t *gy, int64_t h, int64_t w);

/* nn_cuda_norm.c: batch and layer norm, softmax, the LSTM cell on a device */
int rh_nn_cuda_batch_norm(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, rh_tensor_t *rm, rh_tensor_t *rv,
                          int training, double momentum, double eps, rh_tensor_t **y, rh_tensor_t **mean,
                          rh_tensor_t **invstd);
int rh_nn_cuda_batch_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *mean,
                                   rh_tensor_t *invstd, int training, rh_tensor_t **gx, rh_tensor_t **gw,
                                   rh_tensor_t **gb);
int rh_nn_cuda_layer_norm(rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *b, double eps, rh_tensor_t **y,
                          rh_tensor_t **mean, rh_tensor_t **rstd);
int rh_nn_cuda_layer_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *mean,
                                   rh_tensor_t *rstd, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb);
rh_tensor_t *rh_nn_cuda_softmax(rh_tensor_t *x, int log_);
rh_tensor_t *rh_nn_cuda_softmax_backward(rh_tensor_t *y, rh_tensor_t *g, int log_);
int rh_nn_cuda_lstm_cell(rh_tensor_t *gates, rh_tensor_t *c_prev, rh_tensor_t **h, rh_tensor_t **c, rh_tensor_t **ws);
int rh_nn_cuda_lstm_cell_backward(rh_tensor_t *gh, rh_tensor_t *gc, rh_tensor_t *c_prev, rh_tensor_t *ws,
                                  rh_tensor_t **ggates, rh_tensor_t **gc_prev);

/* internal: x a float tensor on a usable device, b (when given) on it in x's dtype */
int rh__nn_on_device(const char *what, rh_tensor_t *x, rh_tensor_t *b);

#endif
