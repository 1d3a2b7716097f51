/* nn.h: the C kernels behind lua/rpchost/nn (convolution, pooling, batch and layer
 * norm, the LSTM cell, last-dimension softmax, linear), with no
 * Lua in them. Inputs are float32 or float64 tensors on the host in NCHW layout
 * (made contiguous here); every function checks shapes first and returns NULL /
 * a negative code with the message in rh_tensor_errmsg(). Returned tensors are
 * new references the caller owns.
 *
 * host/tensor/nn/ is the floor above the tensor core: its files call tensor.h's
 * functions and tensor_internal.h's helpers (rh__gemm, the pool), and nothing in
 * the core calls them. nn_cuda.h has the same kernels for device tensors.
 *
 *   rh_nn_conv_t p = {{1, 1}, {1, 1}, {1, 1}, 1};   // stride, padding, dilation, groups
 *   rh_tensor_t *y = rh_nn_conv2d(x, w, b, &p);      // x [N,C,H,W], w [O,C/g,kh,kw]
 */
#ifndef RH_NN_H
#define RH_NN_H

#include "tensor/tensor.h"

typedef struct {
  int64_t stride[2], pad[2], dil[2];
  int64_t groups;
} rh_nn_conv_t;

/* y[N,O,OH,OW] = conv(x, w) + b (b may be NULL) */
rh_tensor_t *rh_nn_conv2d(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p);
/* gradients of rh_nn_conv2d; each out pointer may be NULL (not wanted) */
int rh_nn_conv2d_backward(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *gy, const rh_nn_conv_t *p, rh_tensor_t **gx,
                          rh_tensor_t **gw, rh_tensor_t **gb);

typedef struct {
  int64_t k[2], stride[2], pad[2], dil[2];
  int ceil_mode;
  int count_include_pad; /* avg only */
  int64_t divisor;       /* avg only: 0 = the window's count */
} rh_nn_pool_t;

/* max pooling: values and int64 indices into each H*W plane (0-based) */
int rh_nn_max_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p, rh_tensor_t **y, rh_tensor_t **idx);
rh_tensor_t *rh_nn_max_pool2d_backward(rh_tensor_t *gy, rh_tensor_t *idx, int64_t h, int64_t w);
rh_tensor_t *rh_nn_avg_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p);
rh_tensor_t *rh_nn_avg_pool2d_backward(rh_tensor_t *gy, const rh_nn_pool_t *p, int64_t h, int64_t w);
/* adaptive average pooling to [oh, ow] (PyTorch's start/end rule) */
rh_tensor_t *rh_nn_adaptive_avg_pool2d(rh_tensor_t *x, int64_t oh, int64_t ow);
rh_tensor_t *rh_nn_adaptive_avg_pool2d_backward(rh_tensor_t *gy, int64_t h, int64_t w);

/* batch norm over [N, C, *]: y and the per-channel float64 mean and
 * 1/sqrt(var + eps) used; training updates running_mean/var in place when given */
int rh_nn_batch_norm(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, rh_tensor_t *rm, rh_tensor_t *rv, int training,
                     double momentum, double eps, rh_tensor_t **y, rh_tensor_t **mean, rh_tensor_t **invstd);
int rh_nn_batch_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *mean, rh_tensor_t *invstd,
                              int training, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb);

/* layer norm over rows of d elements (x's last dims): y and the float64
 * per-row mean and 1/sqrt(var + eps); w and b (d elements each) may be NULL */
int rh_nn_layer_norm(rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *b, double eps, rh_tensor_t **y,
                     rh_tensor_t **mean, rh_tensor_t **rstd);
/* gradients of rh_nn_layer_norm (gw, gb: d elements); out pointers may be NULL */
int rh_nn_layer_norm_backward(rh_tensor_t *gy, rh_tensor_t *x, int64_t d, rh_tensor_t *w, rh_tensor_t *mean,
                              rh_tensor_t *rstd, rh_tensor_t **gx, rh_tensor_t **gw, rh_tensor_t **gb);

/* an LSTM cell's pointwise part: gates [B, 4H] (i, f, g, o pre-activations) and
 * c_prev [B, H] to h, c [B, H] and ws [B, 5H] for the backward */
int rh_nn_lstm_cell(rh_tensor_t *gates, rh_tensor_t *c_prev, rh_tensor_t **h, rh_tensor_t **c, rh_tensor_t **ws);
/* its gradients: gh, gc (either may be NULL: zero) to ggates [B, 4H] and gc_prev [B, H] */
int rh_nn_lstm_cell_backward(rh_tensor_t *gh, rh_tensor_t *gc, rh_tensor_t *c_prev, rh_tensor_t *ws,
                             rh_tensor_t **ggates, rh_tensor_t **gc_prev);

/* softmax (log_: log-softmax) over the last dimension, in x's dtype; its
 * backward from the forward's result y and the gradient g */
/* nn_act.c: ReLU's input gradient (a > 0 ? g : 0) into *out, a new tensor; *out
 * stays NULL (and 0 is returned) when g and a are not contiguous host tensors
 * of one float dtype and shape, for the caller to compose instead */
int rh_nn_relu_backward(rh_tensor_t *g, rh_tensor_t *a, rh_tensor_t **out);

rh_tensor_t *rh_nn_softmax(rh_tensor_t *x, int log_);
rh_tensor_t *rh_nn_softmax_backward(rh_tensor_t *y, rh_tensor_t *g, int log_);

/* y [m, n] = x [m, k] @ w [n, k]^T + b (b [n] may be NULL), the bias under one GEMM */
rh_tensor_t *rh_nn_linear(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b);

/* the output length of a window sweep (ceil_mode as PyTorch's pooling) */
int64_t rh_nn_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil, int ceil_mode);

#endif
