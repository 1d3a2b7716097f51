/* l_body.c: a received frame's body lent to Lua for the frame's callback alone.
 *
 * Why: every request and reply reached Lua as a string made of its body's
 * bytes, only to be decoded at once. A Lua string is interned (hashed, looked
 * up, allocated) and is left for the collector: two per round trip on each
 * side, whose content changes from call to call. The collector's work on them
 * is what made most of rpc_sync's slow calls (bench/results: with the same
 * bytes every call, the calls slower than 3x the median halved). A body view is
 * the bytes where the connection holds them: the decoder reads them there.
 *
 * A view is live only while the callback that got it runs (rh_lua_pushbody ..
 * rh_lua_endbody); afterwards it reads as spent, never as memory the
 * connection has since reused. Whatever keeps a body past its callback (frames
 * held until this rank is ready) copies it first: body_string(v). Views are
 * few objects reused callback after callback, one per nesting depth of frame
 * callbacks; past MAX_DEPTH the body is a string as before. */
#include <string.h>

#include "rh_lua.h"

#define BODY_MT "rpchost.Body"
#define MAX_DEPTH 16

typedef struct {
  const uint8_t *p;
  size_t len;
  int live;
} body_t;

/* the views, one per depth (made when first needed), and their blocks: a view
 * is known by its address, without a metatable lookup on a call's path */
static int view_ref[MAX_DEPTH];
static body_t *view[MAX_DEPTH];
static int depth, made;

static body_t *to_body(lua_State *L, int i) {
  void *u = lua_touserdata(L, i);
  for (int d = 0; d < made; d++)
    if (u == view[d]) return view[d];
  return NULL;
}

const char *rh_lua_tobody(lua_State *L, int i, size_t *len) {
  int type = lua_type(L, i);
  if (type == LUA_TSTRING) return lua_tolstring(L, i, len);
  body_t *b = type == LUA_TUSERDATA ? to_body(L, i) : NULL;
  if (!b) return NULL;
  if (!b->live)
    luaL_error(L,
               "a frame's body was read after its frame was handled (what keeps one must copy it first: "
               "body_string)");
  *len = b->len;
  return (const char *)b->p;
}

int rh_lua_pushbody(lua_State *L, const uint8_t *p, size_t len) {
  if (depth >= MAX_DEPTH) {
    lua_pushlstring(L, (const char *)p, len);
    return 0;
  }
  if (depth == made) {
    body_t *b = lua_newuserdata(L, sizeof *b);
    memset(b, 0, sizeof *b);
    luaL_getmetatable(L, BODY_MT);
    lua_setmetatable(L, -2);
    view[made] = b;
    view_ref[made++] = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  lua_rawgeti(L, LUA_REGISTRYINDEX, view_ref[depth]);
  *view[depth++] = (body_t){p, len, 1};
  return 1;
}

void rh_lua_endbody(lua_State *L) {
  (void)L;
  body_t *b = view[--depth];
  *b = (body_t){NULL, b->len, 0}; /* (its length stays readable: a byte counter may ask later) */
}

/* body_string(v) -> the bytes of a body (a live view, or a string) as a string */
static int l_body_string(lua_State *L) {
  size_t len;
  const char *s = rh_lua_tobody(L, 1, &len);
  if (!s) return luaL_typerror(L, 1, "a string or a frame's body");
  if (lua_type(L, 1) == LUA_TSTRING) lua_settop(L, 1);
  else lua_pushlstring(L, s, len);
  return 1;
}

/* #v: its bytes */
static int l_len(lua_State *L) {
  body_t *b = to_body(L, 1);
  if (!b) return luaL_typerror(L, 1, BODY_MT);
  lua_pushnumber(L, (double)b->len);
  return 1;
}

static int l_tostring(lua_State *L) {
  body_t *b = to_body(L, 1);
  if (!b) return luaL_typerror(L, 1, BODY_MT);
  lua_pushfstring(L, "%s of %d bytes%s", BODY_MT, (int)b->len, b->live ? "" : " (spent)");
  return 1;
}

int rh_open_body(lua_State *L) {
  rh_lua_class(L, BODY_MT, NULL, NULL, l_tostring);
  luaL_getmetatable(L, BODY_MT);
  lua_pushcfunction(L, l_len);
  lua_setfield(L, -2, "__len");
  lua_pop(L, 1);
  static const luaL_Reg fns[] = {{"body_string", l_body_string}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
