/* rh_lua.c: what every binding shares (rh_lua.h): the per-process context,
 * registry references, class metatables and the error conventions. Its own
 * file, without the interpreter's start-up (l_main.c), so that a harness
 * (tests/fuzz/fuzz_codec.c) can link one binding with it alone. */
#include "rh_lua.h"

static rh_ctx_t rh__ctx;

rh_ctx_t *rh_ctx(void) { return &rh__ctx; }

void rh_pushref(lua_State *L, int ref) { lua_rawgeti(L, LUA_REGISTRYINDEX, ref); }

void rh_lua_class(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc, lua_CFunction tostring) {
  luaL_newmetatable(L, name);
  if (methods) {
    lua_newtable(L);
    luaL_register(L, NULL, methods);
    lua_setfield(L, -2, "__index");
  }
  if (gc) {
    lua_pushcfunction(L, gc);
    lua_setfield(L, -2, "__gc");
  }
  if (tostring) {
    lua_pushcfunction(L, tostring);
    lua_setfield(L, -2, "__tostring");
  }
  lua_pop(L, 1);
}

void rh_unref(lua_State *L, int *ref) {
  if (*ref != LUA_NOREF && *ref != LUA_REFNIL) luaL_unref(L, LUA_REGISTRYINDEX, *ref);
  *ref = LUA_NOREF;
}

int rh_error_code(lua_State *L, const char *what, int code) { return luaL_error(L, "%s: %s", what, rh_strerror(code)); }

int rh_lua_push_rc(lua_State *L, int rc) {
  if (rc) {
    lua_pushnil(L);
    lua_pushstring(L, rh_strerror(rc));
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}
