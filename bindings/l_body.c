/* l_body.c: a received frame's body lent to Lua for the frame's callback alone.
 *
 * Why: every request and reply reached Lua as a string made of its body's
 * bytes, only to be decoded at once. A Lua string is interned (hashed, looked
 * up, allocated) and is left for the collector: two per round trip on each
 * side, whose content changes from call to call. The collector's work on them
 * is what made most of rpc_sync's slow calls (bench/results: with the same
 * bytes every call, the calls slower than 3x the median halved). A lent body
 * is the bytes where the connection holds them: the decoder reads them there.
 *
 * What Lua gets is a light userdata naming the lend: the nesting depth of frame
 * callbacks it was made at and the lend's number at that depth. Nothing is
 * allocated, and a lend kept past its callback stays spent for good: a later
 * frame at the same depth is another lend, whose number the kept one does not
 * carry, so reading a kept one raises (naming what to do) instead of reading
 * memory the connection has reused or another frame's bytes. Whatever keeps a
 * body past its callback (frames held until this rank is ready) copies it
 * first: body_string(v). Past MAX_DEPTH nested callbacks the body is a string,
 * as before. */
#include <stdint.h>

#include "rh_lua.h"

#define MAX_DEPTH 16
#define DEPTH_BITS 4
/* lends numbered 1 .. LEND_MAX at each depth, then again from 1: a value stays
 * under 2^38, where LuaJIT keeps light userdata without a segment of its own */
#define LEND_MAX ((UINT64_C(1) << 34) - 1)
_Static_assert(MAX_DEPTH <= 1 << DEPTH_BITS, "a depth fits its bits");

typedef struct {
  const uint8_t *p;
  size_t len;
  uint64_t lend; /* the live lend's number, 0 when none is live */
} slot_t;

static slot_t slot[MAX_DEPTH];
static uint64_t lends[MAX_DEPTH];
static int depth;

/* the slot of a live lend at i, or NULL; *was_lend: whether i is a lend at all */
static slot_t *live_lend(lua_State *L, int i, int *was_lend) {
  *was_lend = 0;
  if (lua_type(L, i) != LUA_TLIGHTUSERDATA) return NULL;
  uint64_t v = (uint64_t)(uintptr_t)lua_touserdata(L, i);
  unsigned d = (unsigned)(v & ((1u << DEPTH_BITS) - 1));
  uint64_t n = v >> DEPTH_BITS;
  if (d >= MAX_DEPTH || n == 0 || n > LEND_MAX) return NULL;
  *was_lend = 1;
  return slot[d].lend == n ? &slot[d] : NULL;
}

static int spent(lua_State *L) {
  return luaL_error(L,
                    "a frame's body was read after its frame was handled (what keeps one must copy it first: "
                    "body_string)");
}

const char *rh_lua_tobody(lua_State *L, int i, size_t *len) {
  if (lua_type(L, i) == LUA_TSTRING) return lua_tolstring(L, i, len);
  int was_lend;
  slot_t *s = live_lend(L, i, &was_lend);
  if (!s) {
    if (was_lend) spent(L);
    return NULL;
  }
  *len = s->len;
  return (const char *)s->p;
}

int rh_lua_pushbody(lua_State *L, const uint8_t *p, size_t len) {
  if (depth >= MAX_DEPTH) {
    lua_pushlstring(L, (const char *)p, len);
    return 0;
  }
  uint64_t n = lends[depth] % LEND_MAX + 1;
  lends[depth] = n;
  slot[depth] = (slot_t){p, len, n};
  lua_pushlightuserdata(L, (void *)(uintptr_t)(n << DEPTH_BITS | (uint64_t)depth));
  depth++;
  return 1;
}

void rh_lua_endbody(lua_State *L) {
  (void)L;
  slot[--depth] = (slot_t){NULL, 0, 0};
}

/* body_string(v) -> the bytes of a body (a live lend, or a string) as a string */
static int l_body_string(lua_State *L) {
  size_t len;
  const char *s = rh_lua_tobody(L, 1, &len);
  if (!s) return luaL_typerror(L, 1, "a string or a frame's body");
  if (lua_type(L, 1) == LUA_TSTRING) lua_settop(L, 1);
  else lua_pushlstring(L, s, len);
  return 1;
}

/* body_len(v) -> the bytes of a body (a live lend, or a string) */
static int l_body_len(lua_State *L) {
  size_t len;
  if (!rh_lua_tobody(L, 1, &len)) return luaL_typerror(L, 1, "a string or a frame's body");
  lua_pushnumber(L, (double)len);
  return 1;
}

int rh_open_body(lua_State *L) {
  static const luaL_Reg fns[] = {{"body_string", l_body_string}, {"body_len", l_body_len}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
