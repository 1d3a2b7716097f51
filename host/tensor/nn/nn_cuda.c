/* nn_cuda.c: convolution and the 2-d poolings for tensors on a CUDA device,
 * the same contract as nn_conv.c and nn_pool.c (nn.h) but run by the kernels
 * library (kernels/nn.cu) and cuBLAS: nothing is copied through the host.
 * Convolution is im2col + one strided-batched GEMM per group over a chunk of
 * samples (the columns of a chunk stay under CHUNK_BYTES); the weight's gradient
 * is a batched GEMM per sample summed over the batch by the device's reduction,
 * the bias's a reduction of the output gradient. bindings/l_nn.c sends a device
 * tensor here; these refuse host tensors. */
#include <string.h>

#include "nn_cuda.h"
#include "nn_geom.h"
#include "tensor/tensor_internal.h"

#ifndef CHUNK_BYTES /* a test build may shrink it to cover the chunked path */
#define CHUNK_BYTES (256ll << 20)
#endif

static char *at(rh_tensor_t *t, int64_t elems) {
  return (char *)rh_tensor_data(t) + (size_t)elems * rh_dtype_size(t->dtype);
}

/* a float tensor on a usable device, and b (when given) beside it in its dtype */
int rh__nn_on_device(const char *what, rh_tensor_t *x, rh_tensor_t *b) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64)
    return rh_tensor_fail("%s: expected a float32 or float64 tensor, got %s", what, rh_dtype_name(x->dtype));
  if (!RH_ON_DEVICE(x)) return rh_tensor_fail("%s: the CUDA kernel takes device tensors", what);
  if (rh__check_device(rh_tensor_device(x))) return -1;
  if (!b) return 0;
  if (rh__same_device(what, x, b)) return -1;
  if (b->dtype != x->dtype)
    return rh_tensor_fail("%s: expected %s tensors throughout, got %s", what, rh_dtype_name(x->dtype),
                          rh_dtype_name(b->dtype));
  return 0;
}

/* ---- convolution */
typedef struct {
  int dev;
  rh_dtype_t dt;
  rh__nn_conv_geom_t s; /* the shapes (nn_geom.h) */
  int64_t K, nb;        /* K = c * kh * kw rows of columns, nb samples a chunk */
  rhc_window_t win;
} conv_t;

static int conv_geom(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p, conv_t *g) {
  memset(g, 0, sizeof *g);
  if (rh__nn_on_device("conv2d", x, w) || (b && rh__nn_on_device("conv2d", x, b))) return -1;
  const rh__nn_conv_geom_t *s = &g->s;
  if (rh__nn_conv_geom(x, w, b, p, &g->s)) return -1; /* (fills *s) */
  g->dev = rh_tensor_device(x), g->dt = x->dtype;
  g->K = s->c * s->kh * s->kw;
  rhc_window_t *wn = &g->win;
  wn->planes = s->c, wn->h = s->h, wn->w = s->w, wn->oh = s->oh, wn->ow = s->ow;
  wn->k[0] = s->kh, wn->k[1] = s->kw;
  for (int i = 0; i < 2; i++) wn->stride[i] = p->stride[i], wn->pad[i] = p->pad[i], wn->dil[i] = p->dil[i];
  /* a chunk's columns, and the weight gradient's per-sample products beside them */
  int64_t per = (g->K * s->l + s->o * s->kg) * (int64_t)rh_dtype_size(g->dt);
  g->nb = per > 0 ? CHUNK_BYTES / per : s->n;
  if (g->nb > s->n) g->nb = s->n;
  if (g->nb < 1) g->nb = 1;
  return 0;
}

/* the columns of samples [n0, n0 + nbk) of x into cols */
static int columns(const conv_t *g, rh_tensor_t *x, int64_t n0, int64_t nbk, rh_tensor_t *cols) {
  const rhc_api_t *api = rh_cuda_api();
  return rh__cuda_call(
      api->nn_im2col(g->dev, g->dt, &g->win, nbk, at(x, n0 * g->s.c * g->s.h * g->s.w), rh_tensor_data(cols), 0));
}

rh_tensor_t *rh_nn_cuda_conv2d(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b, const rh_nn_conv_t *p) {
  conv_t g;
  if (conv_geom(x, w, b, p, &g)) return NULL;
  const rhc_api_t *api = rh_cuda_api();
  rh_tensor_t *t[4] = {rh_tensor_contiguous(x), rh_tensor_contiguous(w),
                       rh_tensor_empty_on(g.dev, g.dt, 4, (int64_t[]){g.s.n, g.s.o, g.s.oh, g.s.ow}),
                       rh_tensor_empty_on(g.dev, g.dt, 1, (int64_t[]){g.nb * g.K * g.s.l})};
  rh_tensor_t *xc = t[0], *wc = t[1], *y = t[2], *cols = t[3];
  int rc = xc && wc && y && cols ? 0 : -1;
  for (int64_t n0 = 0; rc == 0 && n0 < g.s.n; n0 += g.nb) {
    int64_t nbk = g.s.n - n0 < g.nb ? g.s.n - n0 : g.nb;
    rc = columns(&g, xc, n0, nbk, cols);
    /* y[s]_g [og, L] = W_g [og, kg] @ cols[s]_g [kg, L], the weight shared by the batch */
    for (int64_t gi = 0; rc == 0 && gi < g.s.g; gi++)
      rc = rh__cuda_call(api->gemm(g.dev, g.dt, 0, 0, g.s.og, g.s.l, g.s.kg, at(wc, gi * g.s.og * g.s.kg), g.s.kg, 0,
                                   at(cols, gi * g.s.kg * g.s.l), g.s.l, g.K * g.s.l,
                                   at(y, (n0 * g.s.o + gi * g.s.og) * g.s.l), g.s.o * g.s.l, nbk));
  }
  if (rc == 0 && b) {
    rh_tensor_t *bv = rh_tensor_reshape(b, 4, (int64_t[]){1, g.s.o, 1, 1}); /* (a strided bias is copied) */
    rh_tensor_t *r = bv ? rh_tensor_binary(RH_OP_ADD, y, bv, y) : NULL;
    if (bv) rh_tensor_release(bv);
    if (r) rh_tensor_release(r);
    else rc = -1;
  }
  t[2] = rc == 0 ? NULL : y; /* kept: the result */
  rh__nn_release(t, 4);
  return rc == 0 ? y : NULL;
}

/* gy [n, o, L] summed over samples and positions: the bias's gradient [o] */
static rh_tensor_t *bias_grad(const conv_t *g, rh_tensor_t *gy) {
  rh_tensor_t *v = rh_tensor_view(gy, 3, (int64_t[]){g->s.n, g->s.o, g->s.l});
  rh_tensor_t *rows = v ? rh_tensor_reduce(RH_RED_SUM, v, 2, 0) : NULL;
  rh_tensor_t *sum = rows ? rh_tensor_reduce(RH_RED_SUM, rows, 0, 0) : NULL;
  if (v) rh_tensor_release(v);
  if (rows) rh_tensor_release(rows);
  return sum;
}

/* adds the per-sample weight products prod[0 .. nbk) ([nb, o * kg]) into *acc */
static int add_weight_grads(rh_tensor_t *prod, int64_t nbk, rh_tensor_t **acc) {
  rh_tensor_t *part = rh_tensor_narrow(prod, 0, 0, nbk);
  rh_tensor_t *sum = part ? rh_tensor_reduce(RH_RED_SUM, part, 0, 0) : NULL;
  if (part) rh_tensor_release(part);
  if (!sum) return -1;
  if (!*acc) {
    *acc = sum;
    return 0;
  }
  rh_tensor_t *r = rh_tensor_binary(RH_OP_ADD, *acc, sum, *acc);
  rh_tensor_release(sum);
  if (!r) return -1;
  rh_tensor_release(r);
  return 0;
}

int rh_nn_cuda_conv2d_backward(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *gy, const rh_nn_conv_t *p, rh_tensor_t **gx,
                               rh_tensor_t **gw, rh_tensor_t **gb) {
  conv_t g;
  if (gx) *gx = NULL;
  if (gw) *gw = NULL;
  if (gb) *gb = NULL;
  if (conv_geom(x, w, NULL, p, &g) || rh__nn_on_device("conv2d backward", x, gy)) return -1;
  if (gy->ndim != 4 || gy->size[0] != g.s.n || gy->size[1] != g.s.o || gy->size[2] != g.s.oh || gy->size[3] != g.s.ow)
    return rh_tensor_fail("conv2d backward: the gradient must be [%lld, %lld, %lld, %lld]", (long long)g.s.n,
                          (long long)g.s.o, (long long)g.s.oh, (long long)g.s.ow);
  const rhc_api_t *api = rh_cuda_api();
  /* xc, wc, gyc, cols, the per-sample weight products, gx, the weight gradient's sum, gb */
  rh_tensor_t *t[8] = {rh_tensor_contiguous(x), rh_tensor_contiguous(w), rh_tensor_contiguous(gy), NULL};
  rh_tensor_t *xc = t[0], *wc = t[1], *gyc = t[2];
  int rc = xc && wc && gyc ? 0 : -1;
  if (rc == 0 && (gx || gw) && g.s.n > 0 &&
      !(t[3] = rh_tensor_empty_on(g.dev, g.dt, 1, (int64_t[]){g.nb * g.K * g.s.l})))
    rc = -1;
  if (rc == 0 && gw && g.s.n > 0 && !(t[4] = rh_tensor_empty_on(g.dev, g.dt, 2, (int64_t[]){g.nb, g.s.o * g.s.kg})))
    rc = -1;
  if (rc == 0 && gx && !(t[5] = rh_tensor_empty_on(g.dev, g.dt, 4, x->size))) rc = -1;
  rh_tensor_t *cols = t[3], *prod = t[4], *tx = t[5];
  for (int64_t n0 = 0; rc == 0 && n0 < g.s.n; n0 += g.nb) {
    int64_t nbk = g.s.n - n0 < g.nb ? g.s.n - n0 : g.nb;
    if (gw) {
      /* prod[s]_g [og, kg] = gY[s]_g [og, L] @ cols[s]_g^T [L, kg] */
      rc = columns(&g, xc, n0, nbk, cols);
      for (int64_t gi = 0; rc == 0 && gi < g.s.g; gi++)
        rc = rh__cuda_call(api->gemm(
            g.dev, g.dt, 0, 1, g.s.og, g.s.kg, g.s.l, at(gyc, (n0 * g.s.o + gi * g.s.og) * g.s.l), g.s.l, g.s.o * g.s.l,
            at(cols, gi * g.s.kg * g.s.l), g.s.l, g.K * g.s.l, at(prod, gi * g.s.og * g.s.kg), g.s.o * g.s.kg, nbk));
      if (rc == 0) rc = add_weight_grads(prod, nbk, &t[6]);
    }
    if (rc == 0 && gx) {
      /* gcols[s]_g [kg, L] = W_g^T [kg, og] @ gY[s]_g [og, L], then summed back into the images */
      for (int64_t gi = 0; rc == 0 && gi < g.s.g; gi++)
        rc = rh__cuda_call(api->gemm(g.dev, g.dt, 1, 0, g.s.kg, g.s.l, g.s.og, at(wc, gi * g.s.og * g.s.kg), g.s.kg, 0,
                                     at(gyc, (n0 * g.s.o + gi * g.s.og) * g.s.l), g.s.l, g.s.o * g.s.l,
                                     at(cols, gi * g.s.kg * g.s.l), g.K * g.s.l, nbk));
      if (rc == 0)
        rc = rh__cuda_call(
            api->nn_im2col(g.dev, g.dt, &g.win, nbk, at(tx, n0 * g.s.c * g.s.h * g.s.w), rh_tensor_data(cols), 1));
    }
  }
  rh_tensor_t *tw = NULL;
  if (rc == 0 && gw) {
    if (!t[6]) { /* an empty batch: no product */
      t[6] = rh_tensor_empty_on(g.dev, g.dt, 1, (int64_t[]){g.s.o * g.s.kg});
      if (!t[6] || rh_tensor_fill_(t[6], 0)) rc = -1;
    }
    if (rc == 0 && !(tw = rh_tensor_view(t[6], 4, w->size))) rc = -1;
  }
  if (rc == 0 && gb && !(t[7] = bias_grad(&g, gyc))) rc = -1;
  if (rc) {
    if (tw) rh_tensor_release(tw);
    rh__nn_release(t, 8);
    return -1;
  }
  if (gx) *gx = tx, t[5] = NULL;
  if (gw) *gw = tw;
  if (gb) *gb = t[7], t[7] = NULL;
  rh__nn_release(t, 8);
  return 0;
}

/* ---- pooling */
/* the window of a pooling over planes of `size` [n, c, h, w]; dilated: max
 * pooling's dilation (avg has none) */
static int pool_geom(const char *what, const int64_t *size, const rh_nn_pool_t *p, int dilated, rhc_window_t *wn) {
  memset(wn, 0, sizeof *wn);
  if (rh__nn_pool_geom(what, size[2], size[3], p, dilated, &wn->oh, &wn->ow)) return -1;
  wn->planes = size[0] * size[1], wn->h = size[2], wn->w = size[3];
  for (int i = 0; i < 2; i++)
    wn->k[i] = p->k[i], wn->stride[i] = p->stride[i], wn->pad[i] = p->pad[i], wn->dil[i] = dilated ? p->dil[i] : 1;
  wn->count_include_pad = p->count_include_pad;
  wn->divisor = p->divisor;
  return 0;
}

/* a pooling's 4-d float input on a device */
static int pool_input(const char *what, rh_tensor_t *x) {
  if (rh__nn_on_device(what, x, NULL)) return -1;
  if (x->ndim != 4) return rh_tensor_fail("%s: expected a 4-d tensor [N, C, H, W]", what);
  return 0;
}

/* runs one pooling op from `in` (contiguous'd here) to a new [n, c, oh, ow] or
 * [n, c, h, w] result (backward) of in's dtype; idx (int64, on in's device) read
 * or, for max forward, made */
static rh_tensor_t *pool_run(int op, rh_tensor_t *in, const rhc_window_t *wn, rh_tensor_t *idx, rh_tensor_t **idx_out) {
  int back = op >= RHC_POOL_MAX_BACK, dev = rh_tensor_device(in);
  int64_t size[4] = {in->size[0], in->size[1], back ? wn->h : wn->oh, back ? wn->w : wn->ow};
  rh_tensor_t *t[4] = {rh_tensor_contiguous(in), rh_tensor_empty_on(dev, in->dtype, 4, size),
                       idx ? rh_tensor_contiguous(idx) : NULL,
                       idx_out ? rh_tensor_empty_on(dev, RH_I64, 4, size) : NULL};
  rh_tensor_t *ix = idx ? t[2] : t[3];
  int rc = t[0] && t[1] && (!idx || t[2]) && (!idx_out || t[3]) ? 0 : -1;
  if (rc == 0)
    rc = rh__cuda_call(rh_cuda_api()->nn_pool(dev, in->dtype, op, wn, rh_tensor_data(t[0]), rh_tensor_data(t[1]),
                                              ix ? (int64_t *)rh_tensor_data(ix) : NULL));
  rh_tensor_t *out = rc == 0 ? t[1] : NULL;
  if (rc == 0) t[1] = NULL;
  if (rc == 0 && idx_out) *idx_out = t[3], t[3] = NULL;
  rh__nn_release(t, 4);
  return out;
}

/* the window of a backward, from the forward's params (NULL: max and adaptive,
 * whose windows the kernels do not need to recompute from them) and the input's h, w */
static int back_geom(const char *what, rh_tensor_t *gy, const rh_nn_pool_t *p, int64_t h, int64_t w, rhc_window_t *wn) {
  if (pool_input(what, gy)) return -1;
  if (h < 1 || w < 1)
    return rh_tensor_fail("%s: the input size must be positive, got %lld x %lld", what, (long long)h, (long long)w);
  int64_t size[4] = {gy->size[0], gy->size[1], h, w};
  if (p && pool_geom(what, size, p, 0, wn)) return -1;
  if (p && (wn->oh != gy->size[2] || wn->ow != gy->size[3]))
    return rh_tensor_fail("%s: the gradient is %lld x %lld, the forward gave %lld x %lld", what, (long long)gy->size[2],
                          (long long)gy->size[3], (long long)wn->oh, (long long)wn->ow);
  if (!p) {
    memset(wn, 0, sizeof *wn);
    wn->planes = size[0] * size[1], wn->h = h, wn->w = w;
  }
  wn->oh = gy->size[2], wn->ow = gy->size[3];
  return 0;
}

int rh_nn_cuda_max_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p, rh_tensor_t **y, rh_tensor_t **idx) {
  rhc_window_t wn;
  *y = *idx = NULL;
  if (pool_input("max_pool2d", x) || pool_geom("max_pool2d", x->size, p, 1, &wn)) return -1;
  *y = pool_run(RHC_POOL_MAX, x, &wn, NULL, idx);
  return *y ? 0 : -1;
}

rh_tensor_t *rh_nn_cuda_max_pool2d_backward(rh_tensor_t *gy, rh_tensor_t *idx, int64_t h, int64_t w) {
  rhc_window_t wn;
  if (back_geom("max_pool2d backward", gy, NULL, h, w, &wn)) return NULL;
  if (idx->dtype != RH_I64 || idx->ndim != 4 || memcmp(idx->size, gy->size, 4 * sizeof(int64_t)) ||
      rh_tensor_device(idx) != rh_tensor_device(gy)) {
    rh_tensor_fail("max_pool2d backward: indices must be int64 of the gradient's shape, on its device");
    return NULL;
  }
  return pool_run(RHC_POOL_MAX_BACK, gy, &wn, idx, NULL);
}

rh_tensor_t *rh_nn_cuda_avg_pool2d(rh_tensor_t *x, const rh_nn_pool_t *p) {
  rhc_window_t wn;
  if (pool_input("avg_pool2d", x) || pool_geom("avg_pool2d", x->size, p, 0, &wn)) return NULL;
  return pool_run(RHC_POOL_AVG, x, &wn, NULL, NULL);
}

rh_tensor_t *rh_nn_cuda_avg_pool2d_backward(rh_tensor_t *gy, const rh_nn_pool_t *p, int64_t h, int64_t w) {
  rhc_window_t wn;
  if (back_geom("avg_pool2d backward", gy, p, h, w, &wn)) return NULL;
  return pool_run(RHC_POOL_AVG_BACK, gy, &wn, NULL, NULL);
}

rh_tensor_t *rh_nn_cuda_adaptive_avg_pool2d(rh_tensor_t *x, int64_t oh, int64_t ow) {
  rhc_window_t wn;
  if (pool_input("adaptive_avg_pool2d", x)) return NULL;
  if (oh < 1 || ow < 1) {
    rh_tensor_fail("adaptive_avg_pool2d: output_size must be positive, got (%lld, %lld)", (long long)oh, (long long)ow);
    return NULL;
  }
  memset(&wn, 0, sizeof wn);
  wn.planes = x->size[0] * x->size[1], wn.h = x->size[2], wn.w = x->size[3], wn.oh = oh, wn.ow = ow;
  return pool_run(RHC_POOL_ADAPTIVE, x, &wn, NULL, NULL);
}

rh_tensor_t *rh_nn_cuda_adaptive_avg_pool2d_backward(rh_tensor_t *gy, int64_t h, int64_t w) {
  rhc_window_t wn;
  if (back_geom("adaptive_avg_pool2d backward", gy, NULL, h, w, &wn)) return NULL;
  return pool_run(RHC_POOL_ADAPTIVE_BACK, gy, &wn, NULL, NULL);
}
