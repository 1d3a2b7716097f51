/* nn_act.c: ReLU's backward as one pass. Composed, it was three whole-tensor
 * ops (a > 0, a cast of the mask to g's dtype, g * mask) and two temporaries,
 * once per ReLU of every block in ResNet's backward. Here gx = a > 0 ? g : 0,
 * a being ReLU's result (autograd.lua keeps that and not the input: it is > 0
 * exactly where the input is; PyTorch's threshold_backward: a NaN gradient
 * where a <= 0 gives 0), for contiguous host tensors of one float dtype and
 * shape; anything else is left to the composition (autograd.lua). */
#include "nn.h"
#include "tensor/tensor_internal.h"

typedef struct {
  const char *g, *a;
  char *out;
  rh_dtype_t dt;
} relu_job_t;

#define RELU_BACK(T)                                                            \
  do {                                                                          \
    const T *restrict g = (const T *)j->g, *restrict a = (const T *)j->a;       \
    T *restrict o = (T *)j->out;                                                \
    /* both loaded unconditionally: a select, which vectorizes, not a branch */ \
    for (int64_t i = lo; i < hi; i++) {                                         \
      T gv = g[i], av = a[i];                                                   \
      o[i] = av > 0 ? gv : (T)0;                                                \
    }                                                                           \
  } while (0)

static void relu_back_chunk(void *ctx, int64_t lo, int64_t hi) {
  relu_job_t *j = ctx;
  if (j->dt == RH_F32) RELU_BACK(float);
  else RELU_BACK(double);
}

int rh_nn_relu_backward(rh_tensor_t *g, rh_tensor_t *a, rh_tensor_t **out) {
  *out = NULL;
  if (g->dtype != a->dtype || (g->dtype != RH_F32 && g->dtype != RH_F64) || RH_ON_DEVICE(g) || RH_ON_DEVICE(a) ||
      g->ndim != a->ndim || !rh_tensor_is_contiguous(g) || !rh_tensor_is_contiguous(a))
    return 0;
  for (int d = 0; d < g->ndim; d++)
    if (g->size[d] != a->size[d]) return 0;
  rh_tensor_t *t = rh_tensor_empty(g->dtype, g->ndim, g->size);
  if (!t) return rh_tensor_fail("relu backward: out of memory");
  relu_job_t j = {rh_tensor_data(g), rh_tensor_data(a), rh_tensor_data(t), g->dtype};
  rh_parallel_for(rh_tensor_numel(g), RH_PARALLEL_MIN_WORK, relu_back_chunk, &j);
  *out = t;
  return 0;
}
