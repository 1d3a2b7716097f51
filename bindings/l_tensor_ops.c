/* l_tensor_ops.c: the raw entry points of the indexing, ordering, scan and
 * random ops (host/tensor/index.c, sort.c, random.c) for lua/rpchost/tensor/ops.lua.
 * Like l_tensor.c: 0-based dimensions, dtype ids, and a `base` the Lua face sets
 * to 1 so that index tensors are 1-based there. Errors from the core are raised
 * with its message. In-place entry points bump the tensor's version after the
 * write, as l_tensor.c's do (autograd compares versions at backward). */
#include "rh_lua.h"
#include "tensor/tensor.h"

static int push_or_raise(lua_State *L, rh_tensor_t *t) { return rh_lua_pushtensor(L, t); }

static int check_rc(lua_State *L, int rc) {
  if (rc) return luaL_error(L, "%s", rh_tensor_errmsg());
  return 0;
}

/* index_select(t, dim0, idx, base) */
static int l_index_select(lua_State *L) {
  return push_or_raise(L, rh_tensor_index_select(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2),
                                                 rh_lua_checktensor(L, 3), (int64_t)luaL_optnumber(L, 4, 0)));
}

/* gather(t, dim0, idx, base) */
static int l_gather(lua_State *L) {
  return push_or_raise(L, rh_tensor_gather(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2),
                                           rh_lua_checktensor(L, 3), (int64_t)luaL_optnumber(L, 4, 0)));
}

/* scatter_(t, dim0, idx, src_tensor | value, accumulate, base) -> t */
static int l_scatter_(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  rh_tensor_t *src = rh_lua_totensor(L, 4);
  double v = src ? 0 : (lua_isboolean(L, 4) ? lua_toboolean(L, 4) : luaL_checknumber(L, 4));
  check_rc(L, rh_tensor_scatter_(t, (int)luaL_checkinteger(L, 2), rh_lua_checktensor(L, 3), src, v, lua_toboolean(L, 5),
                                 (int64_t)luaL_optnumber(L, 6, 0)));
  rh_tensor_bump_version(t);
  lua_settop(L, 1);
  return 1;
}

/* index_put_(t, dim0, idx, src, accumulate, base) -> t */
static int l_index_put_(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  check_rc(L, rh_tensor_index_put_(t, (int)luaL_checkinteger(L, 2), rh_lua_checktensor(L, 3), rh_lua_checktensor(L, 4),
                                   lua_toboolean(L, 5), (int64_t)luaL_optnumber(L, 6, 0)));
  rh_tensor_bump_version(t);
  lua_settop(L, 1);
  return 1;
}

/* masked_fill_(t, mask, value) -> t */
static int l_masked_fill_(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  double v = lua_isboolean(L, 3) ? lua_toboolean(L, 3) : luaL_checknumber(L, 3);
  check_rc(L, rh_tensor_masked_fill_(t, rh_lua_checktensor(L, 2), v));
  rh_tensor_bump_version(t);
  lua_settop(L, 1);
  return 1;
}

static int l_where(lua_State *L) {
  return push_or_raise(L,
                       rh_tensor_where(rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2), rh_lua_checktensor(L, 3)));
}

static int l_masked_select(lua_State *L) {
  return push_or_raise(L, rh_tensor_masked_select(rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2)));
}

/* masked_scatter_(t, mask, src) -> t */
static int l_masked_scatter_(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  check_rc(L, rh_tensor_masked_scatter_(t, rh_lua_checktensor(L, 2), rh_lua_checktensor(L, 3)));
  rh_tensor_bump_version(t);
  lua_settop(L, 1);
  return 1;
}

static int l_nonzero(lua_State *L) {
  return push_or_raise(L, rh_tensor_nonzero(rh_lua_checktensor(L, 1), (int64_t)luaL_optnumber(L, 2, 0)));
}

/* sort(t, dim0, descending, base) -> values, indices */
static int l_sort(lua_State *L) {
  rh_tensor_t *v, *ix;
  check_rc(L, rh_tensor_sort(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2), lua_toboolean(L, 3),
                             (int64_t)luaL_optnumber(L, 4, 0), &v, &ix));
  rh_lua_pushtensor(L, v);
  rh_lua_pushtensor(L, ix);
  return 2;
}

/* scan(t, dim0, prod) */
static int l_scan(lua_State *L) {
  return push_or_raise(L, rh_tensor_scan(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2), lua_toboolean(L, 3)));
}

/* randint(dtype, low, high, sizes, generator) */
static int l_randint(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_dtype_t dt = rh_lua_checkdtype(L, 1);
  int64_t low = (int64_t)luaL_checknumber(L, 2), high = (int64_t)luaL_checknumber(L, 3);
  int n = rh_lua_checksizes(L, 4, size);
  return push_or_raise(L, rh_tensor_randint(dt, low, high, n, size, rh_lua_optgenerator(L, 5)));
}

/* randperm(dtype, n, base, generator) */
static int l_randperm(lua_State *L) {
  return push_or_raise(L, rh_tensor_randperm(rh_lua_checkdtype(L, 1), (int64_t)luaL_checknumber(L, 2),
                                             (int64_t)luaL_optnumber(L, 3, 0), rh_lua_optgenerator(L, 4)));
}

static int l_bernoulli(lua_State *L) { return push_or_raise(L, rh_tensor_bernoulli(rh_lua_checktensor(L, 1))); }

/* multinomial(w, k, replacement, base) */
static int l_multinomial(lua_State *L) {
  return push_or_raise(L, rh_tensor_multinomial(rh_lua_checktensor(L, 1), (int64_t)luaL_checknumber(L, 2),
                                                lua_toboolean(L, 3), (int64_t)luaL_optnumber(L, 4, 0)));
}

/* as_strided(t, sizes, strides, offset): a view of t's storage (elements); the
 * core refuses one that reaches outside the storage */
static int l_as_strided(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  int n = rh_lua_checksizes(L, 2, size);
  if (rh_lua_checksizes(L, 3, stride) != n)
    return luaL_error(L, "as_strided: %d sizes but a different number of strides", n);
  return push_or_raise(L, rh_tensor_on_storage(t->storage, t->dtype, (int64_t)luaL_checknumber(L, 4), n, size, stride));
}

/* empty(dtype, sizes, device): uninitialised, for results about to be written
 * whole (large ones reuse freed buffers instead of faulting in fresh pages) */
static int l_empty(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_dtype_t dt = rh_lua_checkdtype(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  return push_or_raise(L, rh_tensor_empty_on(rh_lua_optdevice(L, 3), dt, n, size));
}

int rh_open_tensor_ops(lua_State *L) {
  static const luaL_Reg fns[] = {{"t_index_select", l_index_select},
                                 {"t_gather", l_gather},
                                 {"t_scatter_", l_scatter_},
                                 {"t_index_put_", l_index_put_},
                                 {"t_masked_fill_", l_masked_fill_},
                                 {"t_where", l_where},
                                 {"t_masked_select", l_masked_select},
                                 {"t_masked_scatter_", l_masked_scatter_},
                                 {"t_nonzero", l_nonzero},
                                 {"t_sort", l_sort},
                                 {"t_scan", l_scan},
                                 {"t_randint", l_randint},
                                 {"t_randperm", l_randperm},
                                 {"t_bernoulli", l_bernoulli},
                                 {"t_multinomial", l_multinomial},
                                 {"t_as_strided", l_as_strided},
                                 {"t_empty", l_empty},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
