/* l_munge.c: MUNGE credentials for Lua (rpchost.net.auth), a thin layer over
 * host/munge/munge.c. Failures are returned (nil and why), not raised: where
 * munged is missing a world falls back to what it would prove without it. */
#include <stdlib.h>

#include "munge/munge.h"
#include "rh_lua.h"

/* munge_available() -> true | nil, why (libmunge could not be loaded) */
static int l_available(lua_State *L) {
  if (rh_munge_load() != 0) {
    lua_pushnil(L);
    lua_pushstring(L, rh_munge_error());
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* munge_encode(payload, decoder_uid) -> credential | nil, why (decoder_uid
 * nil or -1: any user may decode it) */
static int l_encode(lua_State *L) {
  size_t len;
  const char *buf = luaL_checklstring(L, 1, &len);
  long decoder = (long)luaL_optinteger(L, 2, -1);
  if (len > 1 << 20) return luaL_argerror(L, 1, "a MUNGE payload is at most 1 MiB here");
  char *cred = NULL;
  if (rh_munge_encode(buf, (int)len, decoder, &cred) != 0) {
    lua_pushnil(L);
    lua_pushstring(L, rh_munge_error());
    return 2;
  }
  lua_pushstring(L, cred);
  free(cred);
  return 1;
}

/* munge_decode(credential) -> payload, uid, gid | nil, why */
static int l_decode(lua_State *L) {
  const char *cred = luaL_checkstring(L, 1);
  void *buf = NULL;
  int len = 0;
  long uid = -1, gid = -1;
  if (rh_munge_decode(cred, &buf, &len, &uid, &gid) != 0) {
    lua_pushnil(L);
    lua_pushstring(L, rh_munge_error());
    return 2;
  }
  lua_pushlstring(L, buf ? (const char *)buf : "", buf ? (size_t)len : 0);
  free(buf);
  lua_pushinteger(L, uid);
  lua_pushinteger(L, gid);
  return 3;
}

int rh_open_munge(lua_State *L) {
  static const luaL_Reg fns[] = {
      {"munge_available", l_available}, {"munge_encode", l_encode}, {"munge_decode", l_decode}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
