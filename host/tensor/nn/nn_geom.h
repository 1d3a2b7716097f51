/* nn_geom.h: the shape rules of convolution and the 2-d poolings, shared by
 * the host kernels (nn_conv.c, nn_pool.c) and the device ones (nn_cuda.c) so
 * both refuse the same arguments with the same words and size their outputs
 * alike. Only shapes and parameters are checked here: dtype and which device
 * a tensor lives on are each path's own rule. Internal to host/tensor. */
#ifndef RH_NN_GEOM_H
#define RH_NN_GEOM_H

#include "nn.h"

/* a convolution's sizes: x [n, c, h, w], w [o, cg, kh, kw] in g groups (cg =
 * c / g, og = o / g, kg = cg * kh * kw rows of a group's columns), output [n,
 * o, oh, ow] (l = oh * ow positions), the zero-padded planes hp x wp */
typedef struct {
  int64_t n, c, h, w, o, kh, kw, oh, ow, g, cg, og, kg, l;
  int64_t hp, wp;
  int padded; /* padding > 0 */
  int direct; /* 1x1, stride 1, no padding: the input is its own column matrix */
} rh__nn_conv_geom_t;

/* checks 4-d x and w, p and b (may be NULL) against each other and fills *g;
 * -1 with the message set when they do not fit */
int rh__nn_conv_geom(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p, rh__nn_conv_geom_t *g);

/* checks a pooling's window p over h x w planes and gives its output size
 * (dilated 0: avg pooling, whose dilation is 1 whatever p says); -1 with the
 * message (naming `what`) when p is out of range or the output would be empty */
int rh__nn_pool_geom(const char *what, int64_t h, int64_t w, const rh_nn_pool_t *p, int dilated, int64_t *oh,
                     int64_t *ow);

#endif
