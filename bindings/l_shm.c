/* l_shm.c: shared-memory segments for Lua ("rpchost.Shm"): the transport's pool
 * of memfd segments (rpchost.shm) fills ours and reads the peers'. Every offset
 * and length is checked against the segment, since they come from the wire. */
#include <string.h>

#include "rh_lua.h"
#include "tensor/tensor.h"

#define SHM_MT "rpchost.Shm"

rh_shm_t *rh_lua_checkshm(lua_State *L, int i) { return luaL_checkudata(L, i, SHM_MT); }

void rh_lua_pushshm(lua_State *L, const rh_shm_t *s) {
  rh_shm_t *u = lua_newuserdata(L, sizeof *u);
  *u = *s;
  luaL_getmetatable(L, SHM_MT);
  lua_setmetatable(L, -2);
}

static rh_shm_t *check_open(lua_State *L) {
  rh_shm_t *s = rh_lua_checkshm(L, 1);
  if (!s->map && s->size > 0) luaL_error(L, "the shared-memory segment is closed");
  return s;
}

/* The byte span [off, off + len) of s, or an error naming what is out of range. */
static size_t check_span(lua_State *L, rh_shm_t *s, double off, double len) {
  if (off < 0 || len < 0 || off != (double)(size_t)off || len != (double)(size_t)len || off + len > (double)s->size)
    return (size_t)luaL_error(L, "shared-memory span [%f, %f) is outside the %f-byte segment", off, off + len,
                              (double)s->size);
  return (size_t)off;
}

/* shm_create(bytes) -> segment | nil, message */
static int l_create(lua_State *L) {
  double n = luaL_checknumber(L, 1);
  if (n < 0) return luaL_error(L, "shm_create: negative size");
  rh_shm_t s;
  int rc = rh_shm_create(&s, (size_t)n);
  if (rc) {
    lua_pushnil(L);
    lua_pushfstring(L, "cannot make a shared-memory segment: %s", strerror(-rc));
    return 2;
  }
  rh_lua_pushshm(L, &s);
  return 1;
}

/* shm_probe() -> true | nil, why: whether segments can be made here */
static int l_probe(lua_State *L) {
  int rc = rh_shm_probe();
  if (rc == 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushnil(L);
  lua_pushfstring(L, "memfd_create fails: %s", strerror(-rc));
  return 2;
}

static int l_size(lua_State *L) {
  lua_pushnumber(L, (double)rh_lua_checkshm(L, 1)->size);
  return 1;
}

/* seg:put(offset, tensor): the contiguous host tensor's bytes, copied in */
static int l_put(lua_State *L) {
  rh_shm_t *s = check_open(L);
  rh_tensor_t *t = rh_lua_checkhosttensor(L, 3, "shm put");
  if (!rh_tensor_is_contiguous(t)) return luaL_error(L, "shm put: the tensor is not contiguous");
  size_t len = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
  size_t off = check_span(L, s, luaL_checknumber(L, 2), (double)len);
  if (!s->writable) return luaL_error(L, "shm put: the segment is a peer's (read-only)");
  if (len) rh_copy_parallel((char *)s->map + off, rh_tensor_data(t), len);
  return 0;
}

/* seg:get(offset, len) -> a new 1-D uint8 tensor holding those bytes */
static int l_get(lua_State *L) {
  rh_shm_t *s = check_open(L);
  double len = luaL_checknumber(L, 3);
  size_t off = check_span(L, s, luaL_checknumber(L, 2), len);
  int64_t n = (int64_t)len;
  rh_tensor_t *t = rh_tensor_empty(RH_U8, 1, &n);
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  if (n) rh_copy_parallel(rh_tensor_data(t), (const char *)s->map + off, (size_t)n);
  return rh_lua_pushtensor(L, t);
}

static int l_close(lua_State *L) {
  rh_shm_free(rh_lua_checkshm(L, 1));
  return 0;
}

int rh_open_shm(lua_State *L) {
  static const luaL_Reg methods[] = {
      {"size", l_size}, {"put", l_put}, {"get", l_get}, {"close", l_close}, {NULL, NULL}};
  luaL_newmetatable(L, SHM_MT);
  lua_newtable(L);
  luaL_register(L, NULL, methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, l_close);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  static const luaL_Reg fns[] = {{"shm_create", l_create}, {"shm_probe", l_probe}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
