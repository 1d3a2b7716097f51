/* l_crypto.c: what the handshake needs from libsodium: fresh nonces, HMAC-SHA256
 * and a constant-time comparison. The token itself never leaves the process. */
#include <sodium.h>

#include "rh_lua.h"

static int l_random_bytes(lua_State *L) {
  int n = (int)luaL_checkinteger(L, 1);
  if (n < 0 || n > 4096) return luaL_error(L, "random_bytes: 0..4096 bytes");
  unsigned char buf[4096];
  randombytes_buf(buf, (size_t)n);
  lua_pushlstring(L, (const char *)buf, (size_t)n);
  return 1;
}

/* hmac_sha256(key, message) -> 32 bytes */
static int l_hmac(lua_State *L) {
  size_t klen, mlen;
  const char *key = luaL_checklstring(L, 1, &klen);
  const char *msg = luaL_checklstring(L, 2, &mlen);
  unsigned char out[crypto_auth_hmacsha256_BYTES];
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, (const unsigned char *)key, klen);
  crypto_auth_hmacsha256_update(&st, (const unsigned char *)msg, mlen);
  crypto_auth_hmacsha256_final(&st, out);
  sodium_memzero(&st, sizeof st);
  lua_pushlstring(L, (const char *)out, sizeof out);
  return 1;
}

/* const_eq(a, b) -> true when equal, in time independent of where they differ */
static int l_const_eq(lua_State *L) {
  size_t al, bl;
  const char *a = luaL_checklstring(L, 1, &al);
  const char *b = luaL_checklstring(L, 2, &bl);
  lua_pushboolean(L, al == bl && sodium_memcmp(a, b, al) == 0);
  return 1;
}

/* sha256_hex(data) -> 64 hex digits */
static int l_sha256(lua_State *L) {
  size_t len;
  const char *d = luaL_checklstring(L, 1, &len);
  unsigned char h[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(h, (const unsigned char *)d, len);
  char hex[2 * sizeof h + 1];
  sodium_bin2hex(hex, sizeof hex, h, sizeof h);
  lua_pushstring(L, hex);
  return 1;
}

int rh_open_crypto(lua_State *L) {
  if (sodium_init() < 0) return luaL_error(L, "libsodium could not be initialised");
  static const luaL_Reg fns[] = {{"random_bytes", l_random_bytes},
                                 {"hmac_sha256", l_hmac},
                                 {"const_eq", l_const_eq},
                                 {"sha256_hex", l_sha256},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
