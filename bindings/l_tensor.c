/* l_tensor.c: the tensor core for Lua ("rpchost.Tensor"). A userdata holds exactly
 * one reference to a C tensor and drops it in __gc. These are the raw entry points
 * (0-based dimensions, dtype ids); lua/tensor.lua shapes the user API on top.
 *
 * The Lua GC does not see tensor memory (a userdata is a pointer box), so the
 * host's count of live tensor bytes drives it: a full collection runs when that
 * count has grown by an eighth of what survived the last one (at least
 * RH_GC_MIN, and RH_GC_HEAP = 8x the Lua heap), as Lua's own pause does for its heap. Garbage tensors, small ones
 * included, cannot pile up unseen: an eighth of the live set (or RH_GC_MIN)
 * waits for the GC at most. (Torch7 fed its heap size to the GC for the same
 * reason; counting only large allocations let a pipeline's many small
 * activations reach several times the live set.) The check looks one
 * allocation ahead: it collects when another allocation as large as the largest
 * since the last collection would cross the mark, so the garbage at a step's peak stays within the
 * allowance instead of the allowance plus the largest tensor (a 25 MiB
 * activation over a 16 MiB floor doubled what BatchNorm2d's step held). The
 * floor is small (4 MiB) because a collection walks only the Lua heap, which
 * the 4x term already pays for; a large floor was pure waiting garbage in every
 * model whose live set is tens of MiB (LSTM, embeddings, a transformer layer).
 * (A full collection of an nn program's 1 MiB heap takes about 0.2 ms; a 2 MiB
 * floor cost a transformer layer's step some 8% CPU, 4 MiB about 3%.)
 *
 * A tensor's autograd state (requires_grad, grad_fn, grad, hooks) is a Lua table
 * kept as the userdata's environment, so the tensor owns it: the graph behind a
 * tensor lives exactly as long as the tensor (a weak-keyed side table cannot do
 * that in LuaJIT, which has no ephemerons: a node that refers back to its output
 * would keep both alive forever). Tensors without state share one empty
 * sentinel environment. In-place entry points bump the storage's version. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "rh_lua.h"
#include "tensor/tensor.h"

#define TENSOR_MT "rpchost.Tensor"
#define RH_GC_MIN (4ll << 20)
#define RH_GC_GROWTH 8 /* an eighth of the live bytes */
#define RH_GC_HEAP 8   /* times the Lua heap (KiB) that a collection walks */

typedef struct {
  rh_tensor_t *t;
  int frame; /* a received frame's segment: the codec's alone (rh_lua_pushframetensor) */
} ltensor_t;

static int64_t gc_at = RH_GC_MIN;    /* live tensor bytes at which the next collection runs */
static int no_state_ref = LUA_NOREF; /* the shared environment of tensors without autograd state */
/* The tensor metatable and its address: every op checks its operands, and
 * luaL_checkudata looks the metatable up by name in the registry each time (a
 * tenth of a small collective step went to those lookups). The table is never
 * collected (the registry holds it) and LuaJIT does not move objects. */
static int mt_ref = LUA_NOREF;
static const void *tensor_mt;

/* The box at i when it is a tensor, else NULL. */
static ltensor_t *to_box(lua_State *L, int i) {
  void *u = lua_touserdata(L, i);
  if (!u) return NULL;
  if (lua_getmetatable(L, i)) {
    int same = lua_topointer(L, -1) == tensor_mt;
    lua_pop(L, 1);
    if (same) return u;
  }
  return luaL_testudata(L, i, TENSOR_MT); /* (another state's tensor, say) */
}

static ltensor_t *check_box(lua_State *L, int i) {
  ltensor_t *b = to_box(L, i);
  if (!b) luaL_typerror(L, i, TENSOR_MT);
  return b;
}

rh_tensor_t *rh_lua_checktensor(lua_State *L, int i) {
  ltensor_t *b = check_box(L, i);
  if (!b->t) luaL_error(L, "tensor already freed");
  return b->t;
}

rh_tensor_t *rh_lua_checkhosttensor(lua_State *L, int i, const char *what) {
  rh_tensor_t *t = rh_lua_checktensor(L, i);
  if (rh_tensor_device(t) >= 0)
    luaL_error(L, "%s: the tensor is on cuda:%d; this needs host memory (move it with :cpu())", what,
               rh_tensor_device(t));
  return t;
}

rh_tensor_t *rh_lua_checkhostspan(lua_State *L, int i, const char *what, size_t *nbytes) {
  rh_tensor_t *t = rh_lua_checkhosttensor(L, i, what);
  if (!rh_tensor_is_contiguous(t))
    luaL_error(L, "%s: the tensor is not contiguous (t:contiguous() is a copy that is)", what);
  if (nbytes) *nbytes = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
  return t;
}

rh_tensor_t *rh_lua_boxed_tensor(void *box) { return ((ltensor_t *)box)->t; }

int rh_tensor_ffi_facts(void *box, rh_tensor_facts_t *out) {
  const rh_tensor_t *t = ((ltensor_t *)box)->t;
  if (!t) return -1;
  int64_t n = rh_tensor_numel(t);
  *out = (rh_tensor_facts_t){.dtype = (int32_t)t->dtype,
                             .device = (int32_t)rh_tensor_device(t),
                             .contiguous = rh_tensor_is_contiguous(t),
                             .ndim = t->ndim,
                             .numel = (double)n,
                             .nbytes = (double)n * (double)rh_dtype_size(t->dtype)};
  return 0;
}

/* t itself (retained) on the host, else a host copy of it */
static rh_tensor_t *on_host(lua_State *L, rh_tensor_t *t) {
  rh_tensor_t *h = rh_tensor_to_device(t, -1);
  if (!h) luaL_error(L, "%s", rh_tensor_errmsg());
  return h;
}

rh_tensor_t *rh_lua_totensor(lua_State *L, int i) {
  ltensor_t *b = to_box(L, i);
  return b ? b->t : NULL;
}

/* Pushes a new userdata owning the reference t (NULL raises the core's message). */
static int push_box(lua_State *L, rh_tensor_t *t, int frame);
int rh_lua_pushtensor(lua_State *L, rh_tensor_t *t) { return push_box(L, t, 0); }
int rh_lua_pushframetensor(lua_State *L, rh_tensor_t *t) { return push_box(L, t, 1); }

static int push_box(lua_State *L, rh_tensor_t *t, int frame) {
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  if (rh_storage_live_bytes() + rh_storage_max_alloc(0) > gc_at) {
    lua_gc(L, LUA_GCCOLLECT, 0);
    rh_storage_max_alloc(1);
    /* the next one after an eighth of the live bytes, RH_GC_MIN, or 8x the Lua
     * heap (what a collection walks), whichever is most: collections stay a
     * small part of the work that allocates. (A collection's fixed part, the
     * mark of a ~1.4 MiB heap, is ~0.45 ms; a ResNet shard's step allocates
     * ~19 MiB of activations only the GC frees: at 4x its steps spent 13% of
     * their CPU in collections, at 8x 8%, for ~6 MiB more garbage at peak.) */
    int64_t live = rh_storage_live_bytes(), grow = live / RH_GC_GROWTH;
    int64_t heap = RH_GC_HEAP * ((int64_t)lua_gc(L, LUA_GCCOUNT, 0) << 10);
    if (grow < RH_GC_MIN) grow = RH_GC_MIN;
    if (grow < heap) grow = heap;
    gc_at = live + grow;
  }
  ltensor_t *b = lua_newuserdata(L, sizeof *b);
  b->t = t;
  b->frame = frame;
  lua_rawgeti(L, LUA_REGISTRYINDEX, mt_ref);
  lua_setmetatable(L, -2);
  lua_rawgeti(L, LUA_REGISTRYINDEX, no_state_ref);
  lua_setfenv(L, -2);
  return 1;
}

/* t_ag(t) -> t's autograd state table, or nil (also for a non-tensor) */
static int l_ag(lua_State *L) {
  if (!to_box(L, 1)) return 0;
  lua_getfenv(L, 1);
  lua_rawgeti(L, LUA_REGISTRYINDEX, no_state_ref);
  if (lua_rawequal(L, -1, -2)) return 0;
  lua_pop(L, 1);
  return 1;
}

/* t_set_ag(t, state|nil): the state becomes part of t (freed with it) */
static int l_set_ag(lua_State *L) {
  check_box(L, 1);
  lua_settop(L, 2);
  if (lua_isnil(L, 2)) {
    lua_pop(L, 1);
    lua_rawgeti(L, LUA_REGISTRYINDEX, no_state_ref);
  } else {
    luaL_checktype(L, 2, LUA_TTABLE);
  }
  lua_setfenv(L, 1);
  return 0;
}

/* t_version(t) -> the version counter t shares with its views */
static int l_version(lua_State *L) {
  lua_pushnumber(L, (double)rh_tensor_version(rh_lua_checktensor(L, 1)));
  return 1;
}

/* t_bump(t): records an in-place write made outside the C entry points */
static int l_bump(lua_State *L) {
  rh_tensor_bump_version(rh_lua_checktensor(L, 1));
  lua_settop(L, 1);
  return 1;
}

/* t_alias(t) -> a new tensor object over the same elements (same storage,
 * offset, sizes and strides) and so the same version counter: detach() */
static int l_alias(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  return rh_lua_pushtensor(L, rh_tensor_on_storage(t->storage, t->dtype, t->offset, t->ndim, t->size, t->stride));
}

/* __gc, and t_free(t): releases t's C tensor now instead of at collection (t
 * is unusable after: "tensor already freed"). t_free is only for a tensor its
 * caller proves nothing else refers to: the autograd engine's own gradients
 * (autograd.lua), whose memory would otherwise wait for a full collection. */
static int l_gc(lua_State *L) {
  ltensor_t *b = check_box(L, 1);
  if (b->t) rh_tensor_release(b->t);
  b->t = NULL;
  return 0;
}

int rh_lua_checkdtype(lua_State *L, int i) {
  int d = (int)luaL_checkinteger(L, i);
  if (d < 0 || d >= RH_NDTYPES) luaL_error(L, "unknown dtype id %d", d);
  return d;
}

/* a device number at index i (see rh_lua.h): checked as a number, before the
 * cast to int (2^32 - 2 would become -2, 0.5 or NaN would become 0) */
int rh_lua_checkdevice(lua_State *L, int i) {
  lua_Number d = luaL_checknumber(L, i);
  if (!(d >= RH_CPU && d <= INT_MAX && d == floor(d)))
    luaL_error(L, "device must be -1 (the CPU) or the index of a CUDA device (0, 1, ...), got %f", d);
  return (int)d;
}

int rh_lua_optdevice(lua_State *L, int i) { return lua_isnoneornil(L, i) ? RH_CPU : rh_lua_checkdevice(L, i); }

/* sizes from a Lua sequence at index i (see rh_lua.h) */
int rh_lua_checksizes(lua_State *L, int i, int64_t *size) {
  luaL_checktype(L, i, LUA_TTABLE);
  int n = (int)lua_objlen(L, i);
  if (n > RH_MAXDIM) luaL_error(L, "a tensor has at most %d dimensions, got %d", RH_MAXDIM, n);
  for (int k = 0; k < n; k++) {
    lua_rawgeti(L, i, k + 1);
    if (!lua_isnumber(L, -1)) luaL_error(L, "sizes must be integers, got %s", luaL_typename(L, -1));
    /* converting a double outside int64 is undefined: a size past 2^62 (or NaN)
     * from a script or the network is refused before it becomes an integer */
    double v = lua_tonumber(L, -1);
    if (!(v >= -0x1p62 && v <= 0x1p62) || v != floor(v))
      luaL_error(L, "sizes must be integers of magnitude below 2^62, got %s in dimension %d", lua_tostring(L, -1),
                 k + 1);
    size[k] = (int64_t)v;
    lua_pop(L, 1);
  }
  return n;
}

static int l_full(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_dtype_t dt = rh_lua_checkdtype(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  double v = luaL_optnumber(L, 3, 0);
  int device = rh_lua_optdevice(L, 4);
  if (device == RH_CPU) return rh_lua_pushtensor(L, rh_tensor_full(dt, n, size, v));
  /* on a device: filled there, nothing crosses the bus */
  rh_tensor_t *t = rh_tensor_empty_on(device, dt, n, size);
  if (t && rh_tensor_fill_(t, v)) {
    rh_tensor_release(t);
    t = NULL;
  }
  return rh_lua_pushtensor(L, t);
}

static int l_arange(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_arange(rh_lua_checkdtype(L, 1), luaL_checknumber(L, 2), luaL_checknumber(L, 3),
                                               luaL_checknumber(L, 4)));
}

static int l_rand(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_dtype_t dt = rh_lua_checkdtype(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  return rh_lua_pushtensor(L, rh_tensor_rand(dt, n, size, lua_toboolean(L, 3), rh_lua_optgenerator(L, 4)));
}

/* from_flat(dtype, sizes, values) : values a flat Lua sequence of numbers/booleans */
static int l_from_flat(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_dtype_t dt = rh_lua_checkdtype(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  luaL_checktype(L, 3, LUA_TTABLE);
  rh_tensor_t *t = rh_tensor_empty(dt, n, size);
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  int64_t numel = rh_tensor_numel(t);
  if ((int64_t)lua_objlen(L, 3) != numel) {
    rh_tensor_release(t);
    return luaL_error(L, "expected %d values, got %d", (int)numel, (int)lua_objlen(L, 3));
  }
  char *p = rh_tensor_data(t);
  size_t es = rh_dtype_size(dt);
  for (int64_t i = 0; i < numel; i++) {
    lua_rawgeti(L, 3, (int)i + 1);
    double v = lua_isboolean(L, -1) ? lua_toboolean(L, -1) : lua_tonumber(L, -1);
    lua_pop(L, 1);
    rh_dtype_store(dt, p + (size_t)i * es, v);
  }
  return rh_lua_pushtensor(L, t);
}

/* from_bytes(dtype, sizes, bytes [, swap]) : raw little-endian element bytes */
static int l_from_bytes(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_dtype_t dt = rh_lua_checkdtype(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  size_t len;
  const char *s = luaL_checklstring(L, 3, &len);
  rh_tensor_t *t = rh_tensor_empty(dt, n, size);
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  size_t need = (size_t)rh_tensor_numel(t) * rh_dtype_size(dt);
  if (len != need) {
    rh_tensor_release(t);
    char why[128]; /* (lua_pushfstring has no 64-bit formats) */
    snprintf(why, sizeof why, "expected %lld bytes of data for this shape and dtype, got %lld", (long long)need,
             (long long)len);
    return luaL_error(L, "%s", why);
  }
  memcpy(rh_tensor_data(t), s, len);
  if (lua_toboolean(L, 4)) { /* big-endian source */
    size_t es = rh_dtype_size(dt);
    unsigned char *p = rh_tensor_data(t);
    for (size_t i = 0; i < len; i += es)
      for (size_t a = 0, b = es - 1; a < b; a++, b--) {
        unsigned char c = p[i + a];
        p[i + a] = p[i + b];
        p[i + b] = c;
      }
  }
  return rh_lua_pushtensor(L, t);
}

/* bytes(t) : the elements in logical order as a string */
static int l_bytes(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  rh_tensor_t *h = on_host(L, t);
  rh_tensor_t *c = rh_tensor_contiguous(h);
  rh_tensor_release(h);
  if (!c) return luaL_error(L, "%s", rh_tensor_errmsg());
  lua_pushlstring(L, rh_tensor_data(c), (size_t)rh_tensor_numel(c) * rh_dtype_size(c->dtype));
  rh_tensor_release(c);
  return 1;
}

/* info(t) -> dtype id, ndim, {sizes}, {strides}, offset, contiguous */
static int l_info(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  lua_pushinteger(L, t->dtype);
  lua_pushinteger(L, t->ndim);
  lua_createtable(L, t->ndim, 0);
  for (int i = 0; i < t->ndim; i++) {
    lua_pushnumber(L, (double)t->size[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_createtable(L, t->ndim, 0);
  for (int i = 0; i < t->ndim; i++) {
    lua_pushnumber(L, (double)t->stride[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_pushnumber(L, (double)t->offset);
  lua_pushboolean(L, rh_tensor_is_contiguous(t));
  return 6;
}

static int l_is_contiguous(lua_State *L) {
  lua_pushboolean(L, rh_tensor_is_contiguous(rh_lua_checktensor(L, 1)));
  return 1;
}

static int l_dtype(lua_State *L) {
  lua_pushinteger(L, rh_lua_checktensor(L, 1)->dtype);
  return 1;
}

static int l_ndim(lua_State *L) {
  lua_pushinteger(L, rh_lua_checktensor(L, 1)->ndim);
  return 1;
}

static int l_size(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  if (lua_isnoneornil(L, 2)) {
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
      lua_pushnumber(L, (double)t->size[i]);
      lua_rawseti(L, -2, i + 1);
    }
    return 1;
  }
  int d = (int)luaL_checkinteger(L, 2);
  if (d < 0 || d >= t->ndim)
    return luaL_error(L, "size: dimension %d out of range (the tensor has %d)", d + 1, t->ndim);
  lua_pushnumber(L, (double)t->size[d]);
  return 1;
}

static int l_numel(lua_State *L) {
  lua_pushnumber(L, (double)rh_tensor_numel(rh_lua_checktensor(L, 1)));
  return 1;
}

/* t_nbytes(t): the bytes of its elements (numel x element size) */
static int l_nbytes(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  lua_pushnumber(L, (double)(rh_tensor_numel(t) * rh_dtype_size(t->dtype)));
  return 1;
}

/* dtype_size(code): bytes per element of a dtype code */
static int l_dtype_size(lua_State *L) {
  lua_Integer code = luaL_checkinteger(L, 1);
  if (code < 0 || code >= RH_NDTYPES) return luaL_error(L, "dtype_size: no dtype %d", (int)code);
  lua_pushinteger(L, (lua_Integer)rh_dtype_size((rh_dtype_t)code));
  return 1;
}

static int get_index(lua_State *L, rh_tensor_t *t, int first, int64_t *idx) {
  int n = lua_gettop(L) - first + 1;
  if (n != t->ndim) return luaL_error(L, "expected %d indices, got %d", t->ndim, n);
  for (int i = 0; i < n; i++) {
    int64_t v = (int64_t)luaL_checknumber(L, first + i);
    if (v < 0 || v >= t->size[i])
      return luaL_error(L, "index %d is out of bounds for dimension %d with size %d", (int)v + 1, i + 1,
                        (int)t->size[i]);
    idx[i] = v;
  }
  return 0;
}

/* get(t, i0, i1, ...) -> number (0-based indices) */
static int l_get(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  int64_t idx[RH_MAXDIM];
  get_index(L, t, 2, idx);
  double v = rh_tensor_get(t, idx);
  if (t->dtype == RH_BOOL) lua_pushboolean(L, v != 0);
  else lua_pushnumber(L, v);
  return 1;
}

/* set(t, v, i0, i1, ...) */
static int l_set(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  double v = lua_isboolean(L, 2) ? lua_toboolean(L, 2) : luaL_checknumber(L, 2);
  int64_t idx[RH_MAXDIM];
  get_index(L, t, 3, idx);
  rh_tensor_set(t, idx, v);
  rh_tensor_bump_version(t);
  return 0;
}

static void push_elem(lua_State *L, rh_tensor_t *t, const char *p) {
  double v = rh_dtype_load(t->dtype, p);
  if (t->dtype == RH_BOOL) lua_pushboolean(L, v != 0);
  else lua_pushnumber(L, v);
}

static void totable_rec(lua_State *L, rh_tensor_t *t, int d, const char *p) {
  size_t es = rh_dtype_size(t->dtype);
  lua_createtable(L, (int)t->size[d], 0);
  for (int64_t i = 0; i < t->size[d]; i++) {
    const char *q = p + (int64_t)es * t->stride[d] * i;
    if (d == t->ndim - 1) push_elem(L, t, q);
    else totable_rec(L, t, d + 1, q);
    lua_rawseti(L, -2, (int)i + 1);
  }
}

static int l_totable(lua_State *L) {
  rh_tensor_t *t = on_host(L, rh_lua_checktensor(L, 1));
  luaL_checkstack(L, t->ndim + 4, "totable");
  if (t->ndim == 0) push_elem(L, t, rh_tensor_data(t));
  else totable_rec(L, t, 0, rh_tensor_data(t));
  rh_tensor_release(t);
  return 1;
}

static int l_item(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  if (rh_tensor_numel(t) != 1)
    return luaL_error(L, "item(): a Tensor with %d elements cannot be converted to a number (only 1 element)",
                      (int)rh_tensor_numel(t));
  int64_t idx[RH_MAXDIM] = {0};
  double v = rh_tensor_get(t, idx);
  if (t->dtype == RH_BOOL) lua_pushboolean(L, v != 0);
  else lua_pushnumber(L, v);
  return 1;
}

/* ---- views and copies */
static int l_view(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  return rh_lua_pushtensor(L, lua_toboolean(L, 3) ? rh_tensor_reshape(t, n, size) : rh_tensor_view(t, n, size));
}

static int l_expand(lua_State *L) {
  int64_t size[RH_MAXDIM];
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  int n = rh_lua_checksizes(L, 2, size);
  return rh_lua_pushtensor(L, rh_tensor_expand(t, n, size));
}

static int l_transpose(lua_State *L) {
  return rh_lua_pushtensor(
      L, rh_tensor_transpose(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2), (int)luaL_checkinteger(L, 3)));
}

static int l_permute(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  int64_t d[RH_MAXDIM];
  int n = rh_lua_checksizes(L, 2, d);
  if (n != t->ndim) return luaL_error(L, "permute: expected %d dimensions, got %d", t->ndim, n);
  int dims[RH_MAXDIM];
  for (int i = 0; i < n; i++) dims[i] = (int)d[i];
  return rh_lua_pushtensor(L, rh_tensor_permute(t, dims));
}

static int l_slice(lua_State *L) {
  return rh_lua_pushtensor(
      L, rh_tensor_slice(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2), (int64_t)luaL_checknumber(L, 3),
                         (int64_t)luaL_checknumber(L, 4), (int64_t)luaL_optnumber(L, 5, 1)));
}

static int l_narrow(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_narrow(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2),
                                               (int64_t)luaL_checknumber(L, 3), (int64_t)luaL_checknumber(L, 4)));
}

static int l_select(lua_State *L) {
  return rh_lua_pushtensor(
      L, rh_tensor_select(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2), (int64_t)luaL_checknumber(L, 3)));
}

static int l_squeeze(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_squeeze(rh_lua_checktensor(L, 1), (int)luaL_optinteger(L, 2, -1)));
}

static int l_unsqueeze(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_unsqueeze(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2)));
}

static int l_contiguous(lua_State *L) { return rh_lua_pushtensor(L, rh_tensor_contiguous(rh_lua_checktensor(L, 1))); }
static int l_clone(lua_State *L) { return rh_lua_pushtensor(L, rh_tensor_clone(rh_lua_checktensor(L, 1))); }

static int l_cast(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_cast(rh_lua_checktensor(L, 1), rh_lua_checkdtype(L, 2)));
}

static int l_copy_(lua_State *L) {
  rh_tensor_t *dst = rh_lua_checktensor(L, 1);
  if (rh_tensor_copy_(dst, rh_lua_checktensor(L, 2))) return luaL_error(L, "%s", rh_tensor_errmsg());
  rh_tensor_bump_version(dst);
  lua_settop(L, 1);
  return 1;
}

static int l_fill_(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  if (rh_tensor_fill_(t, lua_isboolean(L, 2) ? lua_toboolean(L, 2) : luaL_checknumber(L, 2)))
    return luaL_error(L, "%s", rh_tensor_errmsg());
  rh_tensor_bump_version(t);
  lua_settop(L, 1);
  return 1;
}

/* ---- ops */
static int is_integral(double v) { return v == (double)(int64_t)v; }

/* binary(op, a, b, out|nil): a or b may be a number (not both) */
static int l_binary(lua_State *L) {
  int op = (int)luaL_checkinteger(L, 1);
  if (op < 0 || op >= RH_NBINOPS) return luaL_error(L, "bad op");
  rh_tensor_t *out = lua_isnoneornil(L, 4) ? NULL : rh_lua_checktensor(L, 4);
  rh_tensor_t *a = rh_lua_totensor(L, 2), *b = rh_lua_totensor(L, 3);
  rh_tensor_t *r;
  if (a && b) r = rh_tensor_binary((rh_binop_t)op, a, b, out);
  else if (a && (lua_isnumber(L, 3) || lua_isboolean(L, 3))) {
    double s = lua_isboolean(L, 3) ? lua_toboolean(L, 3) : lua_tonumber(L, 3);
    r = rh_tensor_binary_scalar((rh_binop_t)op, a, s, !lua_isboolean(L, 3) && !is_integral(s), 0, out);
  } else if (b && (lua_isnumber(L, 2) || lua_isboolean(L, 2))) {
    double s = lua_isboolean(L, 2) ? lua_toboolean(L, 2) : lua_tonumber(L, 2);
    r = rh_tensor_binary_scalar((rh_binop_t)op, b, s, !lua_isboolean(L, 2) && !is_integral(s), 1, out);
  } else {
    return luaL_error(L, "expected tensors or numbers, got %s and %s", luaL_typename(L, 2), luaL_typename(L, 3));
  }
  if (r && r == out) {
    rh_tensor_bump_version(out);
    rh_tensor_release(r);
    lua_pushvalue(L, 4);
    return 1;
  }
  return rh_lua_pushtensor(L, r);
}

static int l_unary(lua_State *L) {
  int op = (int)luaL_checkinteger(L, 1);
  if (op < 0 || op >= RH_NUNOPS) return luaL_error(L, "bad op");
  rh_tensor_t *out = lua_isnoneornil(L, 3) ? NULL : rh_lua_checktensor(L, 3);
  rh_tensor_t *r = rh_tensor_unary((rh_unop_t)op, rh_lua_checktensor(L, 2), out);
  if (r && r == out) {
    rh_tensor_bump_version(out);
    rh_tensor_release(r);
    lua_pushvalue(L, 3);
    return 1;
  }
  return rh_lua_pushtensor(L, r);
}

/* reduce(op, t, dim|-1, keepdim) */
static int l_reduce(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_reduce((rh_redop_t)luaL_checkinteger(L, 1), rh_lua_checktensor(L, 2),
                                               (int)luaL_checkinteger(L, 3), lua_toboolean(L, 4)));
}

static int l_softmax(lua_State *L) {
  return rh_lua_pushtensor(
      L, rh_tensor_softmax(rh_lua_checktensor(L, 1), (int)luaL_checkinteger(L, 2), lua_toboolean(L, 3)));
}

static int l_matmul(lua_State *L) {
  return rh_lua_pushtensor(L, rh_tensor_matmul(rh_lua_checktensor(L, 1), rh_lua_checktensor(L, 2)));
}

/* Raises "malformed message: <why>" with no position: the words are the same
 * whether the codec's C path or its Lua hook (t_reinterpret) met the bytes. */
static int malformed(lua_State *L, const char *why) {
  lua_pushfstring(L, "malformed message: %s", why);
  return lua_error(L);
}

/* reinterpret(bytes_tensor, dtype, sizes): the bytes of a contiguous tensor (a
 * received segment) viewed as dtype/sizes, sharing its storage; the sizes must
 * cover exactly all the bytes. A message to this worker itself carries the
 * sender's tensors as its segments, and a contiguous view (a row block of a
 * batch) starts inside its storage: the view keeps that start. */
int rh_lua_pushsegmenttensor(lua_State *L, int seg, int dt_id, int n, const int64_t *size, int become) {
  ltensor_t *b = check_box(L, seg); /* (once: a decoded message makes one per tensor) */
  rh_tensor_t *t = b->t;
  if (!t) return luaL_error(L, "tensor already freed");
  rh_dtype_t dt = (rh_dtype_t)dt_id;
  int64_t stride[RH_MAXDIM];
  /* the sizes come from the network: their product is checked before any stride
   * is computed from it */
  int64_t numel = 0;
  if (rh_shape_numel(n, size, &numel)) return malformed(L, rh_tensor_errmsg());
  int64_t st = 1;
  for (int i = n - 1; i >= 0; i--) {
    stride[i] = st;
    st *= size[i] > 0 ? size[i] : 1;
  }
  size_t have = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
  size_t start = (size_t)t->offset * rh_dtype_size(t->dtype); /* in bytes */
  if (!rh_tensor_is_contiguous(t) || start % rh_dtype_size(dt) != 0 || (size_t)numel * rh_dtype_size(dt) != have) {
    char why[160]; /* (lua_pushfstring has no 64-bit formats) */
    snprintf(why, sizeof why, "a tensor of %lld %s elements does not match its %lld payload bytes", (long long)numel,
             rh_dtype_name(dt), (long long)have);
    return malformed(L, why);
  }
  if (become && b->frame && t->refcount == 1) {
    /* the segment's own box and tensor, retyped: nothing else holds them */
    t->dtype = dt;
    t->ndim = n;
    t->offset = (int64_t)(start / rh_dtype_size(dt));
    for (int i = 0; i < n; i++) t->size[i] = size[i], t->stride[i] = stride[i];
    b->frame = 0;
    lua_pushvalue(L, seg);
    return 1;
  }
  rh_tensor_t *r = rh_tensor_on_storage(t->storage, dt, (int64_t)(start / rh_dtype_size(dt)), n, size, stride);
  if (r && b->frame) {
    /* a received segment becomes the value it carries: its bytes belong to that
     * tensor alone from now on, so a collective that is done with a piece frees
     * its memory at once (t_free) instead of leaving it to a full collection */
    rh_tensor_release(b->t);
    b->t = NULL;
  }
  return rh_lua_pushtensor(L, r);
}
static int l_reinterpret(lua_State *L) {
  rh_lua_checktensor(L, 1);
  rh_dtype_t dt = rh_lua_checkdtype(L, 2);
  int64_t size[RH_MAXDIM];
  int n = rh_lua_checksizes(L, 3, size);
  return rh_lua_pushsegmenttensor(L, 1, dt, n, size, 0);
}

rh_tensor_t *rh_lua_plaintensor(lua_State *L, int i, int *requires_grad) {
  ltensor_t *b = to_box(L, i);
  if (!b || !b->t || rh_tensor_device(b->t) >= 0 || !rh_tensor_is_contiguous(b->t)) return NULL;
  lua_getfenv(L, i);
  lua_rawgeti(L, LUA_REGISTRYINDEX, no_state_ref);
  *requires_grad = 0;
  if (!lua_rawequal(L, -1, -2) && lua_istable(L, -2)) {
    /* autograd state (rpchost.autograd.engine's table): what travels of it is
     * whether the tensor requires gradients, exactly true */
    lua_getfield(L, -2, "requires_grad");
    *requires_grad = lua_type(L, -1) == LUA_TBOOLEAN && lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  lua_pop(L, 2);
  return b->t;
}

int rh_lua_setrequiresgrad(lua_State *L, int i) {
  rh_tensor_t *t = rh_lua_checktensor(L, i);
  if (t->dtype != RH_F32 && t->dtype != RH_F64) return 0;
  lua_getfenv(L, i);
  lua_rawgeti(L, LUA_REGISTRYINDEX, no_state_ref);
  int stateless = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  if (!stateless) return 0;
  lua_createtable(L, 0, 1);
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "requires_grad");
  lua_setfenv(L, i < 0 ? i - 1 : i);
  return 1;
}

/* ---- devices */
static int l_device(lua_State *L) {
  lua_pushinteger(L, rh_tensor_device(rh_lua_checktensor(L, 1)));
  return 1;
}

/* t_to_device(t, dev): a contiguous copy on dev (-1: the host), or t's own
 * reference when it is there already */
static int l_to_device(lua_State *L) {
  rh_tensor_t *t = rh_lua_checktensor(L, 1);
  return rh_lua_pushtensor(L, rh_tensor_to_device(t, rh_lua_checkdevice(L, 2)));
}

/* t_memstats(reset) -> live bytes, their high-water mark (then reset to live when
 * reset is true), bytes of freed buffers the allocator keeps for reuse */
static int l_memstats(lua_State *L) {
  lua_pushnumber(L, (double)rh_storage_live_bytes());
  lua_pushnumber(L, (double)rh_storage_peak_bytes());
  lua_pushnumber(L, (double)rh_storage_cached_bytes());
  if (lua_toboolean(L, 1)) rh_storage_reset_peak();
  return 3;
}

static int l_live_bytes(lua_State *L) {
  lua_pushnumber(L, (double)rh_storage_live_bytes());
  return 1;
}

static int l_same_storage(lua_State *L) {
  lua_pushboolean(L, rh_lua_checktensor(L, 1)->storage == rh_lua_checktensor(L, 2)->storage);
  return 1;
}

/* storage(t) -> a key for t's storage (equal for every view of it, a light
 * userdata no longer meaningful once the storage is freed), its size in bytes:
 * for grouping tensors by storage in one pass (a .pt save) */
static int l_storage(lua_State *L) {
  rh_storage_t *s = rh_lua_checktensor(L, 1)->storage;
  lua_pushlightuserdata(L, s);
  lua_pushnumber(L, (double)s->nbytes);
  return 2;
}

static int l_metatable(lua_State *L) {
  luaL_getmetatable(L, TENSOR_MT);
  return 1;
}

int rh_open_tensor(lua_State *L) {
  rh_lua_class(L, TENSOR_MT, NULL, l_gc, NULL);
  if (mt_ref == LUA_NOREF) {
    luaL_getmetatable(L, TENSOR_MT);
    tensor_mt = lua_topointer(L, -1);
    mt_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  if (no_state_ref == LUA_NOREF) {
    lua_newtable(L);
    no_state_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  static const luaL_Reg fns[] = {{"t_full", l_full},
                                 {"t_arange", l_arange},
                                 {"t_rand", l_rand},
                                 {"t_from_flat", l_from_flat},
                                 {"t_from_bytes", l_from_bytes},
                                 {"t_bytes", l_bytes},
                                 {"t_info", l_info},
                                 {"t_dtype", l_dtype},
                                 {"t_ndim", l_ndim},
                                 {"t_size", l_size},
                                 {"t_numel", l_numel},
                                 {"t_nbytes", l_nbytes},
                                 {"dtype_size", l_dtype_size},
                                 {"t_get", l_get},
                                 {"t_set", l_set},
                                 {"t_totable", l_totable},
                                 {"t_item", l_item},
                                 {"t_view", l_view},
                                 {"t_expand", l_expand},
                                 {"t_transpose", l_transpose},
                                 {"t_permute", l_permute},
                                 {"t_slice", l_slice},
                                 {"t_narrow", l_narrow},
                                 {"t_select", l_select},
                                 {"t_squeeze", l_squeeze},
                                 {"t_unsqueeze", l_unsqueeze},
                                 {"t_contiguous", l_contiguous},
                                 {"t_clone", l_clone},
                                 {"t_cast", l_cast},
                                 {"t_copy_", l_copy_},
                                 {"t_fill_", l_fill_},
                                 {"t_binary", l_binary},
                                 {"t_unary", l_unary},
                                 {"t_reduce", l_reduce},
                                 {"t_softmax", l_softmax},
                                 {"t_matmul", l_matmul},
                                 {"t_live_bytes", l_live_bytes},
                                 {"t_memstats", l_memstats},
                                 {"t_reinterpret", l_reinterpret},
                                 {"t_device", l_device},
                                 {"t_is_contiguous", l_is_contiguous},
                                 {"t_to_device", l_to_device},
                                 {"t_same_storage", l_same_storage},
                                 {"t_storage", l_storage},
                                 {"t_ag", l_ag},
                                 {"t_set_ag", l_set_ag},
                                 {"t_version", l_version},
                                 {"t_bump", l_bump},
                                 {"t_free", l_gc},
                                 {"t_alias", l_alias},
                                 {"t_metatable", l_metatable},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  /* t_is_tensor in Lua: the autograd and nn paths ask it of every operand, and
   * LuaJIT compiles a call to a C function only by ending the trace there and
   * starting another after it (stitching); the accessors' calls made a pipeline
   * shard's traces slower than the interpreter. type() and getmetatable() of a
   * userdata compile inline. (The same test as to_box: this state's tensors
   * are the userdata with the registry's metatable.) */
  if (luaL_loadstring(
          L, "local T = ... return function(v) return type(v) == 'userdata' and getmetatable(v) == T end") != 0)
    return lua_error(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, mt_ref);
  lua_call(L, 1, 1);
  lua_setfield(L, -2, "t_is_tensor");
  return 1;
}
