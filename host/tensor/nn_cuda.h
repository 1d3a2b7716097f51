/* nn_cuda.h: convolution and the 2-d poolings on a CUDA device (nn_cuda.c,
 * kernels/nn.cu): nn.h's contract for device tensors, results on the input's
 * device. bindings/l_nn.c picks these for a tensor on a device. */
#ifndef RH_NN_CUDA_H
#define RH_NN_CUDA_H

#include "nn.h"

rh_tensor_t *rh_nn_cuda_conv2d(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p);
int rh_nn_cuda_conv2d_backward(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *gy, const rh_nn_conv_t *p,
                               rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb);
int rh_nn_cuda_max_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p, rh_tensor_t **y, rh_tensor_t **idx);
rh_tensor_t *rh_nn_cuda_max_pool2d_backward(rh_tensor_t *gy, rh_tensor_t *idx, int64_t h, int64_t w);
rh_tensor_t *rh_nn_cuda_avg_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p);
rh_tensor_t *rh_nn_cuda_avg_pool2d_backward(rh_tensor_t *gy, const rh_nn_pool_t *p, int64_t h, int64_t w);
rh_tensor_t *rh_nn_cuda_adaptive_avg_pool2d(rh_tensor_t *x, int64_t oh, int64_t ow);
rh_tensor_t *rh_nn_cuda_adaptive_avg_pool2d_backward(rh_tensor_t *gy, int64_t h, int64_t w);

#endif
