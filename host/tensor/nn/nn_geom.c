/* nn_geom.c: the shape rules of convolution and pooling (nn_geom.h), one copy
 * for the host and the device kernels, and the output-size rule (nn.h) they
 * both size their results by. */
#include "nn_geom.h"

#include "tensor/tensor_internal.h"

int64_t rh_nn_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil, int ceil_mode) {
  int64_t num = in + 2 * pad - (dil * (k - 1) + 1);
  if (num < 0 || stride < 1) return 0;
  int64_t o = (ceil_mode ? (num + stride - 1) / stride : num / stride) + 1;
  /* as PyTorch: with ceil_mode the last window must start inside the input or the left padding */
  if (ceil_mode && (o - 1) * stride >= in + pad) o--;
  return o;
}

int rh__nn_conv_geom(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p, rh__nn_conv_geom_t *g) {
  if (x->ndim != 4 || w->ndim != 4) return rh_tensor_fail("conv2d: expected 4-d input and weight");
  if (p->groups < 1) return rh_tensor_fail("conv2d: groups must be positive, got %lld", (long long)p->groups);
  for (int i = 0; i < 2; i++)
    if (p->stride[i] < 1 || p->dil[i] < 1 || p->pad[i] < 0)
      return rh_tensor_fail("conv2d: stride and dilation must be positive and padding non-negative");
  g->n = x->size[0], g->c = x->size[1], g->h = x->size[2], g->w = x->size[3];
  g->o = w->size[0], g->kh = w->size[2], g->kw = w->size[3], g->g = p->groups;
  if (g->c % g->g || g->o % g->g)
    return rh_tensor_fail("conv2d: in_channels %lld and out_channels %lld must be divisible by groups %lld",
                          (long long)g->c, (long long)g->o, (long long)g->g);
  g->cg = g->c / g->g, g->og = g->o / g->g;
  if (w->size[1] != g->cg)
    return rh_tensor_fail("conv2d: weight has %lld input channels per group, the input %lld", (long long)w->size[1],
                          (long long)g->cg);
  if (b && (b->ndim != 1 || b->size[0] != g->o))
    return rh_tensor_fail("conv2d: bias must have %lld elements", (long long)g->o);
  g->oh = rh_nn_out_size(g->h, g->kh, p->stride[0], p->pad[0], p->dil[0], 0);
  g->ow = rh_nn_out_size(g->w, g->kw, p->stride[1], p->pad[1], p->dil[1], 0);
  if (g->oh < 1 || g->ow < 1)
    return rh_tensor_fail("conv2d: the kernel (%lld x %lld, dilated) is larger than the padded input (%lld x %lld)",
                          (long long)g->kh, (long long)g->kw, (long long)(g->h + 2 * p->pad[0]),
                          (long long)(g->w + 2 * p->pad[1]));
  g->kg = g->cg * g->kh * g->kw;
  g->l = g->oh * g->ow;
  g->padded = p->pad[0] > 0 || p->pad[1] > 0;
  g->hp = g->h + 2 * p->pad[0], g->wp = g->w + 2 * p->pad[1];
  g->direct = g->kh == 1 && g->kw == 1 && p->stride[0] == 1 && p->stride[1] == 1 && !g->padded;
  return 0;
}

int rh__nn_pool_geom(const char *what, int64_t h, int64_t w, const rh_nn_pool_t *p, int dilated, int64_t *oh,
                     int64_t *ow) {
  int64_t dil[2] = {dilated ? p->dil[0] : 1, dilated ? p->dil[1] : 1};
  for (int i = 0; i < 2; i++) {
    if (p->k[i] < 1 || p->stride[i] < 1 || dil[i] < 1 || p->pad[i] < 0)
      return rh_tensor_fail("%s: kernel_size, stride and dilation must be positive, padding non-negative", what);
    if (p->pad[i] * 2 > p->k[i])
      return rh_tensor_fail(
          "%s: pad should be at most half of effective kernel size, but got pad=%lld, "
          "kernel_size=%lld",
          what, (long long)p->pad[i], (long long)p->k[i]);
  }
  *oh = rh_nn_out_size(h, p->k[0], p->stride[0], p->pad[0], dil[0], p->ceil_mode);
  *ow = rh_nn_out_size(w, p->k[1], p->stride[1], p->pad[1], dil[1], p->ceil_mode);
  if (*oh < 1 || *ow < 1)
    return rh_tensor_fail("%s: output size is too small (input %lld x %lld, kernel %lld x %lld)", what, (long long)h,
                          (long long)w, (long long)p->k[0], (long long)p->k[1]);
  return 0;
}
