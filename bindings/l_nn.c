/* l_nn.c: the raw entry points of the nn kernels (host/tensor/nn/nn_conv.c,
 * nn_pool.c, nn_norm.c: batch and layer norm, nn_rnn.c: the LSTM cell,
 * nn_softmax.c, nn_act.c: ReLU's backward, nn_linear.c) for the lua/rpchost/nn files. Geometry arrives as flat numbers
 * (0-based nothing: these are sizes); the Lua side checks shapes and names the layer in its errors, the core's message
 * is raised for anything it refuses. Each entry point but linear sends a tensor on a CUDA device to the device's
 * kernels (host/tensor/nn/nn_cuda.c, nn_cuda_norm.c): on_dev() picks them by the
 * first tensor argument. */
#include "rh_lua.h"
#include "tensor/nn/nn.h"
#include "tensor/nn/nn_cuda.h"

static int check_rc(lua_State *L, int rc) {
  if (rc) return luaL_error(L, "%s", rh_tensor_errmsg());
  return 0;
}

static int push(lua_State *L, rh_tensor_t *t) {
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  return rh_lua_pushtensor(L, t);
}

/* three results (gradients: nil for those not asked for) */
static int push3(lua_State *L, rh_tensor_t *a, rh_tensor_t *b, rh_tensor_t *c) {
  rh_tensor_t *out[3] = {a, b, c};
  for (int i = 0; i < 3; i++) {
    if (out[i]) rh_lua_pushtensor(L, out[i]);
    else lua_pushnil(L);
  }
  return 3;
}

static int on_dev(lua_State *L, int i) { return rh_tensor_device(rh_lua_checktensor(L, i)) >= 0; }

/* reads stride, padding, dilation (pairs) and groups from stack slots i.. */
static void conv_params(lua_State *L, int i, rh_nn_conv_t *p) {
  for (int k = 0; k < 2; k++) {
    p->stride[k] = (int64_t)luaL_checknumber(L, i + k);
    p->pad[k] = (int64_t)luaL_checknumber(L, i + 2 + k);
    p->dil[k] = (int64_t)luaL_checknumber(L, i + 4 + k);
  }
  p->groups = (int64_t)luaL_checknumber(L, i + 6);
}

/* conv2d(x, w, b|nil, sh, sw, ph, pw, dh, dw, groups) */
static int l_conv2d(lua_State *L) {
  rh_nn_conv_t p;
  conv_params(L, 4, &p);
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_conv2d : rh_nn_conv2d)(rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2),
                                                                   rh_lua_totensor(L, 3), &p));
}

/* conv2d_backward(x, w, gy, sh, sw, ph, pw, dh, dw, groups, want_x, want_w, want_b) -> gx, gw, gb */
static int l_conv2d_backward(lua_State *L) {
  rh_nn_conv_t p;
  conv_params(L, 4, &p);
  rh_tensor_t *gx = NULL, *gw = NULL, *gb = NULL;
  check_rc(
      L, (on_dev(L, 1) ? rh_nn_cuda_conv2d_backward : rh_nn_conv2d_backward)(
             rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), rh_lua_checktensor(L, 3), &p,
             lua_toboolean(L, 11) ? &gx : NULL, lua_toboolean(L, 12) ? &gw : NULL, lua_toboolean(L, 13) ? &gb : NULL));
  return push3(L, gx, gw, gb);
}

/* pool params from slots i..: kh, kw, sh, sw, ph, pw, dh, dw, ceil_mode, count_include_pad, divisor */
static void pool_params(lua_State *L, int i, rh_nn_pool_t *p) {
  for (int k = 0; k < 2; k++) {
    p->k[k] = (int64_t)luaL_checknumber(L, i + k);
    p->stride[k] = (int64_t)luaL_checknumber(L, i + 2 + k);
    p->pad[k] = (int64_t)luaL_checknumber(L, i + 4 + k);
    p->dil[k] = (int64_t)luaL_optnumber(L, i + 6 + k, 1);
  }
  p->ceil_mode = lua_toboolean(L, i + 8);
  p->count_include_pad = lua_toboolean(L, i + 9);
  p->divisor = (int64_t)luaL_optnumber(L, i + 10, 0);
}

static int l_max_pool2d(lua_State *L) {
  rh_nn_pool_t p;
  pool_params(L, 2, &p);
  rh_tensor_t *y, *idx;
  check_rc(L, (on_dev(L, 1) ? rh_nn_cuda_max_pool2d : rh_nn_max_pool2d)(rh_lua_checktensor(L, 1), &p, &y, &idx));
  rh_lua_pushtensor(L, y);
  rh_lua_pushtensor(L, idx);
  return 2;
}

/* max_pool2d_backward(gy, idx, h, w) */
static int l_max_pool2d_backward(lua_State *L) {
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_max_pool2d_backward : rh_nn_max_pool2d_backward)(
                     rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), (int64_t)luaL_checknumber(L, 3),
                     (int64_t)luaL_checknumber(L, 4)));
}

static int l_avg_pool2d(lua_State *L) {
  rh_nn_pool_t p;
  pool_params(L, 2, &p);
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_avg_pool2d : rh_nn_avg_pool2d)(rh_lua_checktensor(L, 1), &p));
}

/* avg_pool2d_backward(gy, params..., h, w) with h, w after the 11 params */
static int l_avg_pool2d_backward(lua_State *L) {
  rh_nn_pool_t p;
  pool_params(L, 2, &p);
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_avg_pool2d_backward : rh_nn_avg_pool2d_backward)(
                     rh_lua_checktensor(L, 1), &p, (int64_t)luaL_checknumber(L, 13), (int64_t)luaL_checknumber(L, 14)));
}

static int l_adaptive_avg_pool2d(lua_State *L) {
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_adaptive_avg_pool2d : rh_nn_adaptive_avg_pool2d)(
                     rh_lua_checktensor(L, 1), (int64_t)luaL_checknumber(L, 2), (int64_t)luaL_checknumber(L, 3)));
}

static int l_adaptive_avg_pool2d_backward(lua_State *L) {
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_adaptive_avg_pool2d_backward : rh_nn_adaptive_avg_pool2d_backward)(
                     rh_lua_checktensor(L, 1), (int64_t)luaL_checknumber(L, 2), (int64_t)luaL_checknumber(L, 3)));
}

/* batch_norm(x, w|nil, b|nil, rm|nil, rv|nil, training, momentum, eps) -> y, mean, invstd */
static int l_batch_norm(lua_State *L) {
  rh_tensor_t *y, *m, *s;
  check_rc(L,
           (on_dev(L, 1) ? rh_nn_cuda_batch_norm : rh_nn_batch_norm)(
               rh_lua_checktensor(L, 1), rh_lua_totensor(L, 2), rh_lua_totensor(L, 3), rh_lua_totensor(L, 4),
               rh_lua_totensor(L, 5), lua_toboolean(L, 6), luaL_checknumber(L, 7), luaL_checknumber(L, 8), &y, &m, &s));
  return push3(L, y, m, s);
}

/* batch_norm_backward(gy, x, w|nil, mean, invstd, training, want_x, want_w, want_b) -> gx, gw, gb */
static int l_batch_norm_backward(lua_State *L) {
  rh_tensor_t *gx = NULL, *gw = NULL, *gb = NULL;
  check_rc(L, (on_dev(L, 1) ? rh_nn_cuda_batch_norm_backward : rh_nn_batch_norm_backward)(
                  rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), rh_lua_totensor(L, 3), rh_lua_checktensor(L, 4),
                  rh_lua_checktensor(L, 5), lua_toboolean(L, 6), lua_toboolean(L, 7) ? &gx : NULL,
                  lua_toboolean(L, 8) ? &gw : NULL, lua_toboolean(L, 9) ? &gb : NULL));
  return push3(L, gx, gw, gb);
}

/* layer_norm(x, d, w|nil, b|nil, eps) -> y, mean, rstd */
static int l_layer_norm(lua_State *L) {
  rh_tensor_t *y, *m, *s;
  check_rc(L, (on_dev(L, 1) ? rh_nn_cuda_layer_norm : rh_nn_layer_norm)(
                  rh_lua_checktensor(L, 1), (int64_t)luaL_checknumber(L, 2), rh_lua_totensor(L, 3),
                  rh_lua_totensor(L, 4), luaL_checknumber(L, 5), &y, &m, &s));
  return push3(L, y, m, s);
}

/* layer_norm_backward(gy, x, d, w|nil, mean, rstd, want_x, want_w, want_b) -> gx, gw, gb */
static int l_layer_norm_backward(lua_State *L) {
  rh_tensor_t *gx = NULL, *gw = NULL, *gb = NULL;
  check_rc(
      L, (on_dev(L, 1) ? rh_nn_cuda_layer_norm_backward : rh_nn_layer_norm_backward)(
             rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), (int64_t)luaL_checknumber(L, 3), rh_lua_totensor(L, 4),
             rh_lua_checktensor(L, 5), rh_lua_checktensor(L, 6), lua_toboolean(L, 7) ? &gx : NULL,
             lua_toboolean(L, 8) ? &gw : NULL, lua_toboolean(L, 9) ? &gb : NULL));
  return push3(L, gx, gw, gb);
}

/* lstm_cell(gates, c_prev) -> h, c, ws */
static int l_lstm_cell(lua_State *L) {
  rh_tensor_t *h, *c, *ws;
  check_rc(L, (on_dev(L, 1) ? rh_nn_cuda_lstm_cell : rh_nn_lstm_cell)(rh_lua_checktensor(L, 1),
                                                                      rh_lua_checktensor(L, 2), &h, &c, &ws));
  return push3(L, h, c, ws);
}

/* lstm_cell_backward(gh|nil, gc|nil, c_prev, ws) -> ggates, gc_prev */
static int l_lstm_cell_backward(lua_State *L) {
  rh_tensor_t *gg, *gp;
  check_rc(L, (on_dev(L, 3) ? rh_nn_cuda_lstm_cell_backward : rh_nn_lstm_cell_backward)(
                  rh_lua_totensor(L, 1), rh_lua_totensor(L, 2), rh_lua_checktensor(L, 3), rh_lua_checktensor(L, 4), &gg,
                  &gp));
  rh_lua_pushtensor(L, gg);
  rh_lua_pushtensor(L, gp);
  return 2;
}

/* softmax(x, log) -> y; softmax_backward(y, g, log) -> gx (over the last dimension) */
static int l_softmax(lua_State *L) {
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_softmax : rh_nn_softmax)(rh_lua_checktensor(L, 1), lua_toboolean(L, 2)));
}
static int l_softmax_backward(lua_State *L) {
  return push(L, (on_dev(L, 1) ? rh_nn_cuda_softmax_backward : rh_nn_softmax_backward)(
                     rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), lua_toboolean(L, 3)));
}

/* relu_backward(g, a) -> a > 0 ? g : 0, or nil where the kernel does not take
 * these tensors (the caller composes the gradient then) */
static int l_relu_backward(lua_State *L) {
  rh_tensor_t *out;
  check_rc(L, rh_nn_relu_backward(rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), &out));
  if (!out) return 0;
  return rh_lua_pushtensor(L, out);
}

/* linear(x, w, b|nil) -> x @ w^T + b */
static int l_linear(lua_State *L) {
  return push(L, rh_nn_linear(rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), rh_lua_totensor(L, 3)));
}

/* out_size(in, k, stride, pad, dil, ceil_mode) */
static int l_out_size(lua_State *L) {
  lua_pushnumber(L, (lua_Number)rh_nn_out_size((int64_t)luaL_checknumber(L, 1), (int64_t)luaL_checknumber(L, 2),
                                               (int64_t)luaL_checknumber(L, 3), (int64_t)luaL_checknumber(L, 4),
                                               (int64_t)luaL_checknumber(L, 5), lua_toboolean(L, 6)));
  return 1;
}

int rh_open_nn(lua_State *L) {
  static const luaL_Reg fns[] = {{"nn_conv2d", l_conv2d},
                                 {"nn_conv2d_backward", l_conv2d_backward},
                                 {"nn_max_pool2d", l_max_pool2d},
                                 {"nn_max_pool2d_backward", l_max_pool2d_backward},
                                 {"nn_avg_pool2d", l_avg_pool2d},
                                 {"nn_avg_pool2d_backward", l_avg_pool2d_backward},
                                 {"nn_adaptive_avg_pool2d", l_adaptive_avg_pool2d},
                                 {"nn_adaptive_avg_pool2d_backward", l_adaptive_avg_pool2d_backward},
                                 {"nn_out_size", l_out_size},
                                 {"nn_batch_norm", l_batch_norm},
                                 {"nn_batch_norm_backward", l_batch_norm_backward},
                                 {"nn_layer_norm", l_layer_norm},
                                 {"nn_layer_norm_backward", l_layer_norm_backward},
                                 {"nn_lstm_cell", l_lstm_cell},
                                 {"nn_lstm_cell_backward", l_lstm_cell_backward},
                                 {"nn_softmax", l_softmax},
                                 {"nn_relu_backward", l_relu_backward},
                                 {"nn_softmax_backward", l_softmax_backward},
                                 {"nn_linear", l_linear},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
