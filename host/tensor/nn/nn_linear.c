/* nn_linear.c: y = x @ w^T + b for nn.Linear / F.linear on host floats, the
 * bias written into y first and the product added onto it by one GEMM
 * (beta = 1, as PyTorch's addmm): one tensor and one pass over it fewer than a
 * matmul followed by a broadcast add. x [m, k] and w [n, k] are read in place
 * when BLAS can (matmul.c's rule), else made contiguous. */
#include <string.h>

#include "nn.h"
#include "tensor/tensor_internal.h"

/* BLAS's view of a rows x cols matrix: 0 (row-major, ld), 1 (transposed), or -1 */
static int layout(const rh_tensor_t *t, int *ld) {
  int64_t rows = t->size[0], cols = t->size[1];
  if (t->stride[1] == 1 && (rows == 1 || t->stride[0] >= cols)) {
    *ld = (int)(rows == 1 ? (cols > 0 ? cols : 1) : t->stride[0]);
    return 0;
  }
  if (t->stride[0] == 1 && (cols == 1 || t->stride[1] >= rows)) {
    *ld = (int)(cols == 1 ? (rows > 0 ? rows : 1) : t->stride[1]);
    return 1;
  }
  return -1;
}

rh_tensor_t *rh_nn_linear(rh_tensor_t *x, rh_tensor_t *w, rh_tensor_t *b) {
  if (x->dtype != RH_F32 && x->dtype != RH_F64) {
    rh_tensor_fail("linear: expected a float32 or float64 input, got %s", rh_dtype_name(x->dtype));
    return NULL;
  }
  if (w->dtype != x->dtype || (b && b->dtype != x->dtype)) {
    rh_tensor_fail("linear: input, weight and bias must have one dtype");
    return NULL;
  }
  if (RH_ON_DEVICE(x) || RH_ON_DEVICE(w) || (b && RH_ON_DEVICE(b))) {
    rh_tensor_fail("linear: the C kernel takes host tensors");
    return NULL;
  }
  if (x->ndim != 2 || w->ndim != 2 || x->size[1] != w->size[1] || (b && (b->ndim != 1 || b->size[0] != w->size[0]))) {
    rh_tensor_fail("linear: expected x [m, k], weight [n, k] and bias [n]");
    return NULL;
  }
  int64_t m = x->size[0], k = x->size[1], n = w->size[0];
  size_t es = rh_dtype_size(x->dtype);
  int lx, lw;
  int tx = layout(x, &lx), tw = layout(w, &lw);
  rh_tensor_t *xc = tx < 0 ? rh_tensor_contiguous(x) : (rh_tensor_retain(x), x);
  rh_tensor_t *wc = tw < 0 ? rh_tensor_contiguous(w) : (rh_tensor_retain(w), w);
  rh_tensor_t *bc = b ? rh_tensor_contiguous(b) : NULL;
  rh_tensor_t *y = rh_tensor_empty(x->dtype, 2, (int64_t[]){m, n});
  if (!xc || !wc || (b && !bc) || !y) {
    rh_tensor_t *all[] = {xc, wc, bc, y};
    for (int i = 0; i < 4; i++) rh_tensor_release(all[i]);
    rh_tensor_fail("linear: out of memory");
    return NULL;
  }
  if (tx < 0) tx = 0, lx = (int)(k > 0 ? k : 1);
  if (tw < 0) tw = 0, lw = (int)(k > 0 ? k : 1);
  char *yd = rh_tensor_data(y);
  if (bc)
    for (int64_t r = 0; r < m; r++) memcpy(yd + (size_t)(r * n) * es, rh_tensor_data(bc), (size_t)n * es);
  else memset(yd, 0, (size_t)(m * n) * es);
  /* y [m, n] += x [m, k] @ (w [n, k])^T: w read transposed (or as is when it is a transposed view) */
  if (k > 0) rh__gemm(x->dtype, tx, !tw, m, n, k, rh_tensor_data(xc), lx, rh_tensor_data(wc), lw, 1.0, yd, n);
  rh_tensor_release(xc);
  rh_tensor_release(wc);
  rh_tensor_release(bc);
  return y;
}
