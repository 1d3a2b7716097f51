/* nn_rnn.c: the pointwise part of an LSTM cell (forward and backward) for
 * lua/rpchost/nn/rnn.lua, from the pre-activation gates [B, 4H] (i, f, g, o,
 * PyTorch's order) and c_prev [B, H] to h and c. As whole-tensor ops it was
 * four narrows, four activations and six products per step forward and twice
 * that backward, each a tensor of its own (half of the LSTM's peak memory);
 * here it is one pass each way, and what the backward needs is one saved
 * [B, 5H] block (the four activated gates and tanh(c)). */
#include "nn.h"

#include <string.h>
#include <tgmath.h> /* exp and tanh of a float are expf and tanhf */

#include "tensor/tensor_internal.h"

static int check_pair(const char *what, rh_tensor_t *a, int64_t cols_a, rh_tensor_t *b, int64_t cols_b) {
  if (a->dtype != RH_F32 && a->dtype != RH_F64)
    return rh_tensor_fail("%s: expected float32 or float64 tensors, got %s", what, rh_dtype_name(a->dtype));
  if (b->dtype != a->dtype) return rh_tensor_fail("%s: the tensors must have one dtype", what);
  if (RH_ON_DEVICE(a) || RH_ON_DEVICE(b)) return rh_tensor_fail("%s: the C kernel takes host tensors", what);
  if (a->ndim != 2 || b->ndim != 2 || a->size[1] != cols_a || b->size[1] != cols_b || a->size[0] != b->size[0])
    return rh_tensor_fail("%s: expected [B, %lld] and [B, %lld] tensors", what, (long long)cols_a, (long long)cols_b);
  return 0;
}

#define LSTM_FORWARD(T)                                                                           \
  do {                                                                                            \
    const T *gt = (const T *)rh_tensor_data(gc), *cp = (const T *)rh_tensor_data(cc);             \
    T *ho = (T *)rh_tensor_data(th), *co = (T *)rh_tensor_data(tc), *w = (T *)rh_tensor_data(tw); \
    for (int64_t r = 0; r < b; r++, gt += 4 * hs, cp += hs, ho += hs, co += hs, w += 5 * hs)      \
      for (int64_t k = 0; k < hs; k++) {                                                          \
        T i = (T)1 / ((T)1 + exp(-gt[k]));                                                        \
        T f = (T)1 / ((T)1 + exp(-gt[hs + k]));                                                   \
        T g = tanh(gt[2 * hs + k]);                                                               \
        T o = (T)1 / ((T)1 + exp(-gt[3 * hs + k]));                                               \
        T c = f * cp[k] + i * g, t = tanh(c);                                                     \
        co[k] = c, ho[k] = o * t;                                                                 \
        w[k] = i, w[hs + k] = f, w[2 * hs + k] = g, w[3 * hs + k] = o, w[4 * hs + k] = t;         \
      }                                                                                           \
  } while (0)

int rh_nn_lstm_cell(rh_tensor_t *gates, rh_tensor_t *c_prev, rh_tensor_t **h, rh_tensor_t **c, rh_tensor_t **ws) {
  *h = *c = *ws = NULL;
  int64_t hs = c_prev->ndim == 2 ? c_prev->size[1] : 0;
  if (check_pair("lstm_cell", gates, 4 * hs, c_prev, hs)) return -1;
  int64_t b = gates->size[0];
  rh_tensor_t *gc = rh_tensor_contiguous(gates), *cc = rh_tensor_contiguous(c_prev);
  rh_tensor_t *th = rh_tensor_empty(gates->dtype, 2, (int64_t[]){b, hs});
  rh_tensor_t *tc = rh_tensor_empty(gates->dtype, 2, (int64_t[]){b, hs});
  rh_tensor_t *tw = rh_tensor_empty(gates->dtype, 2, (int64_t[]){b, 5 * hs});
  if (!gc || !cc || !th || !tc || !tw) {
    rh_tensor_t *all[] = {gc, cc, th, tc, tw};
    for (int i = 0; i < 5; i++) rh_tensor_release(all[i]);
    return rh_tensor_fail("lstm_cell: out of memory");
  }
  if (gates->dtype == RH_F32) LSTM_FORWARD(float);
  else LSTM_FORWARD(double);
  rh_tensor_release(gc);
  rh_tensor_release(cc);
  *h = th, *c = tc, *ws = tw;
  return 0;
}

/* gct = gc + gh * o * (1 - t^2); gates' gradients through each activation;
 * gc_prev = gct * f. A missing gh or gc is zero. */
#define LSTM_BACKWARD(T)                                                                                          \
  do {                                                                                                            \
    const T *dh = ghc ? (const T *)rh_tensor_data(ghc) : NULL, *dc = gcc ? (const T *)rh_tensor_data(gcc) : NULL; \
    const T *cp = (const T *)rh_tensor_data(cc), *w = (const T *)rh_tensor_data(wc);                              \
    T *gg = (T *)rh_tensor_data(tg), *gp = (T *)rh_tensor_data(tp);                                               \
    for (int64_t r = 0; r < b; r++) {                                                                             \
      for (int64_t k = 0; k < hs; k++) {                                                                          \
        T i = w[k], f = w[hs + k], g = w[2 * hs + k], o = w[3 * hs + k], t = w[4 * hs + k];                       \
        T h_ = dh ? dh[k] : (T)0, c_ = dc ? dc[k] : (T)0;                                                         \
        T gct = c_ + h_ * o * ((T)1 - t * t);                                                                     \
        gg[k] = gct * g * i * ((T)1 - i);                                                                         \
        gg[hs + k] = gct * cp[k] * f * ((T)1 - f);                                                                \
        gg[2 * hs + k] = gct * i * ((T)1 - g * g);                                                                \
        gg[3 * hs + k] = h_ * t * o * ((T)1 - o);                                                                 \
        gp[k] = gct * f;                                                                                          \
      }                                                                                                           \
      if (dh) dh += hs;                                                                                           \
      if (dc) dc += hs;                                                                                           \
      cp += hs, w += 5 * hs, gg += 4 * hs, gp += hs;                                                              \
    }                                                                                                             \
  } while (0)

int rh_nn_lstm_cell_backward(rh_tensor_t *gh, rh_tensor_t *gc, rh_tensor_t *c_prev, rh_tensor_t *ws,
                             rh_tensor_t **ggates, rh_tensor_t **gc_prev) {
  *ggates = *gc_prev = NULL;
  int64_t hs = c_prev->ndim == 2 ? c_prev->size[1] : 0;
  if (check_pair("lstm_cell backward", ws, 5 * hs, c_prev, hs) ||
      (gh && check_pair("lstm_cell backward", gh, hs, c_prev, hs)) ||
      (gc && check_pair("lstm_cell backward", gc, hs, c_prev, hs)))
    return -1;
  int64_t b = c_prev->size[0];
  rh_tensor_t *ghc = gh ? rh_tensor_contiguous(gh) : NULL, *gcc = gc ? rh_tensor_contiguous(gc) : NULL;
  rh_tensor_t *cc = rh_tensor_contiguous(c_prev), *wc = rh_tensor_contiguous(ws);
  rh_tensor_t *tg = rh_tensor_empty(ws->dtype, 2, (int64_t[]){b, 4 * hs});
  rh_tensor_t *tp = rh_tensor_empty(ws->dtype, 2, (int64_t[]){b, hs});
  if ((gh && !ghc) || (gc && !gcc) || !cc || !wc || !tg || !tp) {
    rh_tensor_t *all[] = {ghc, gcc, cc, wc, tg, tp};
    for (int i = 0; i < 6; i++) rh_tensor_release(all[i]);
    return rh_tensor_fail("lstm_cell backward: out of memory");
  }
  if (ws->dtype == RH_F32) LSTM_BACKWARD(float);
  else LSTM_BACKWARD(double);
  rh_tensor_t *all[] = {ghc, gcc, cc, wc};
  for (int i = 0; i < 4; i++) rh_tensor_release(all[i]);
  *ggates = tg, *gc_prev = tp;
  return 0;
}
