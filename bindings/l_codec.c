/* l_codec.c: Lua values <-> MessagePack bytes (msgpack-c).
 *
 * Plain values are coded here: nil, booleans, numbers (integral doubles as msgpack
 * integers, others as doubles), binary-safe strings, and tables without metatables
 * (a sequence 1..n as an array, anything else as a map). Everything else - functions,
 * userdata, cdata, tables with metatables - goes through an encode hook written in
 * Lua (lua/rpchost/codec.lua), which returns a tag and the values that stand for it:
 *   tag < 16:  a leaf, coded as msgpack ext(tag, bytes)
 *   tag >= 16: a tagged array [ext(tag, ""), child values...]
 * The decoder calls the decode hook with the tag and the decoded children.
 *
 * Errors name the path of the offending value (args[2].opts.cb). Cycles and
 * nesting deeper than msgpack-c's decoder supports are refused before anything is
 * sent. */
#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "codec/mpcheck.h"
#include "rh_lua.h"

#define MAX_DEPTH_LIMIT 30 /* msgpack-c's C unpacker nests at most 32 levels */
/* RPCHOST_MAX_DEPTH lowers the nesting accepted (and sent), never above the limit */
static int max_depth(void) {
  static int d = 0;
  if (!d) {
    const char *e = getenv("RPCHOST_MAX_DEPTH");
    d = e && atoi(e) > 0 && atoi(e) < MAX_DEPTH_LIMIT ? atoi(e) : MAX_DEPTH_LIMIT;
  }
  return d;
}
#define MAX_DEPTH (max_depth())
#define TAG_LEAF_MAX 16

#define ref_enc_hook (rh_ctx()->ref_enc_hook)
#define ref_dec_hook (rh_ctx()->ref_dec_hook)

typedef struct {
  int is_key; /* 1: string key, 0: integer index, 2: tagged child */
  const char *key;
  double idx;
  const void *table; /* for cycle detection */
} path_elem_t;

typedef struct {
  lua_State *L;
  msgpack_sbuffer buf;
  msgpack_packer pk;
  const char *root;
  int root_index; /* > 0: the value is root[root_index] (one of several under one name) */
  path_elem_t path[MAX_DEPTH_LIMIT + 2];
  int depth;
} enc_t;

static int is_ident(const char *s) {
  if (!*s || (*s >= '0' && *s <= '9')) return 0;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_'))
      return 0;
  return 1;
}

/* Pushes the path of the value being encoded, e.g. args[2].cb */
static void push_path(enc_t *e) {
  lua_State *L = e->L;
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, e->root);
  char tmp[64];
  if (e->root_index > 0) {
    snprintf(tmp, sizeof tmp, "[%d]", e->root_index);
    luaL_addstring(&b, tmp);
  }
  for (int i = 0; i < e->depth; i++) {
    path_elem_t *p = &e->path[i];
    if (p->is_key == 1) {
      if (is_ident(p->key)) {
        luaL_addchar(&b, '.');
        luaL_addstring(&b, p->key);
      } else {
        luaL_addstring(&b, "[\"");
        luaL_addstring(&b, p->key);
        luaL_addstring(&b, "\"]");
      }
    } else if (p->is_key == 2) {
      /* a part of a value a codec hook encoded (an object's fields, say): its
       * place in the hook's list means nothing to the user, the value's path
       * already reads right (args[2].layer.weight) */
      continue;
    } else {
      snprintf(tmp, sizeof tmp, "[%.14g]", p->idx);
      luaL_addstring(&b, tmp);
    }
  }
  luaL_pushresult(&b);
}

/* Encoders and decoders are reused, not made per message: each is a userdata
 * (so an error that abandons one mid-way leaves it to the GC, whose __gc frees
 * its buffer) kept in a small registry stack between uses. A nested use (a codec
 * hook that encodes) simply takes another. */
#define ENC_MT "rpchost.Encoder"
#define DEC_MT "rpchost.Decoder"
#define POOL_MAX 8
#define KEEP_BYTES (64u << 10) /* a buffer grown past this is not kept */
static int ref_enc_pool = LUA_NOREF, ref_dec_pool = LUA_NOREF;

/* Pushes a userdata from the pool, or a new zeroed one of `size` bytes with
 * metatable mt when the pool is empty. */
static void *pool_take(lua_State *L, int ref, size_t size, const char *mt) {
  rh_pushref(L, ref);
  int n = (int)lua_objlen(L, -1);
  if (n == 0) {
    lua_pop(L, 1);
    void *u = lua_newuserdata(L, size);
    memset(u, 0, size); /* (a zeroed msgpack_sbuffer is an initialised one) */
    luaL_getmetatable(L, mt);
    lua_setmetatable(L, -2);
    return u;
  }
  lua_rawgeti(L, -1, n);
  lua_pushnil(L);
  lua_rawseti(L, -3, n);
  lua_remove(L, -2);
  return lua_touserdata(L, -1);
}

/* Gives the userdata at idx back to its pool (dropped when the pool is full). */
static void pool_give(lua_State *L, int ref, int idx) {
  idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
  rh_pushref(L, ref);
  int n = (int)lua_objlen(L, -1);
  if (n < POOL_MAX) {
    lua_pushvalue(L, idx);
    lua_rawseti(L, -2, n + 1);
  }
  lua_pop(L, 1);
}

static void enc_gc_buffer(enc_t *e) {
  msgpack_sbuffer_destroy(&e->buf);
  msgpack_sbuffer_init(&e->buf);
}

static int enc_gc(lua_State *L) {
  enc_gc_buffer(luaL_checkudata(L, 1, ENC_MT));
  return 0;
}

/* An encoder ready for a message, pushed on the stack. */
static enc_t *enc_take(lua_State *L) {
  enc_t *e = pool_take(L, ref_enc_pool, sizeof *e, ENC_MT);
  e->L = L;
  e->buf.size = 0;
  e->depth = 0;
  msgpack_packer_init(&e->pk, &e->buf, msgpack_sbuffer_write);
  return e;
}

static int enc_fail(enc_t *e, const char *why) {
  push_path(e);
  lua_pushfstring(e->L, ": %s", why);
  lua_concat(e->L, 2);
  return lua_error(e->L);
}

static void enc_value(enc_t *e, int idx);

static void enc_number(enc_t *e, double d) {
  if (d == floor(d) && fabs(d) < 9.2e18 && !(d == 0 && signbit(d))) msgpack_pack_int64(&e->pk, (int64_t)d);
  else msgpack_pack_double(&e->pk, d);
}

static void enc_string(enc_t *e, int idx) {
  size_t len;
  const char *s = lua_tolstring(e->L, idx, &len);
  msgpack_pack_str(&e->pk, len);
  msgpack_pack_str_body(&e->pk, s, len);
}

static void enter(enc_t *e, int is_key, const char *key, double i, const void *t) {
  if (e->depth >= MAX_DEPTH) {
    char why[128];
    snprintf(why, sizeof why, "nested more than %d levels deep (flatten it, or send it as a string)", MAX_DEPTH);
    enc_fail(e, why);
  }
  e->path[e->depth++] = (path_elem_t){is_key, key, i, t};
}

/* Calls the encode hook for the value at idx and encodes what it returns. */
static void enc_hook(enc_t *e, int idx) {
  lua_State *L = e->L;
  int top = lua_gettop(L);
  if (ref_enc_hook == LUA_NOREF) enc_fail(e, "cannot be sent (no codec hook installed)");
  rh_pushref(L, ref_enc_hook);
  lua_pushvalue(L, idx);
  if (lua_pcall(L, 1, LUA_MULTRET, 0) != 0) {
    const char *msg = lua_tostring(L, -1);
    enc_fail(e, msg ? msg : "cannot be sent");
  }
  int n = lua_gettop(L) - top;
  if (n < 1 || !lua_isnumber(L, top + 1)) enc_fail(e, "codec hook returned no tag");
  int tag = (int)lua_tointeger(L, top + 1);
  if (tag < TAG_LEAF_MAX) {
    size_t len = 0;
    const char *s = n >= 2 ? lua_tolstring(L, top + 2, &len) : NULL;
    if (!s) enc_fail(e, "codec hook returned a leaf without bytes");
    msgpack_pack_ext(&e->pk, len, (int8_t)tag);
    msgpack_pack_ext_body(&e->pk, s, len);
  } else {
    msgpack_pack_array(&e->pk, (size_t)n);
    msgpack_pack_ext(&e->pk, 0, (int8_t)tag);
    for (int i = 2; i <= n; i++) {
      enter(e, 2, NULL, i - 1, NULL);
      enc_value(e, top + i);
      e->depth--;
    }
  }
  lua_settop(L, top);
}

static void enc_table(enc_t *e, int idx) {
  lua_State *L = e->L;
  const void *p = lua_topointer(L, idx);
  for (int i = 0; i < e->depth; i++)
    if (e->path[i].table == p) enc_fail(e, "is a cycle (a table that contains itself cannot be sent)");
  /* Sequence 1..n with no other keys -> array; anything else -> map. */
  size_t n = lua_objlen(L, idx);
  size_t count = 0;
  int seq = 1;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    count++;
    if (seq) {
      if (lua_type(L, -2) != LUA_TNUMBER) seq = 0;
      else {
        double k = lua_tonumber(L, -2);
        if (k != floor(k) || k < 1 || k > (double)n) seq = 0;
      }
    }
    lua_pop(L, 1);
  }
  if (seq && count == n) {
    msgpack_pack_array(&e->pk, n);
    for (size_t i = 1; i <= n; i++) {
      enter(e, 0, NULL, (double)i, p);
      lua_rawgeti(L, idx, (int)i);
      enc_value(e, lua_gettop(L));
      lua_pop(L, 1);
      e->depth--;
    }
    return;
  }
  msgpack_pack_map(&e->pk, count);
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    int kt = lua_type(L, -2);
    if (kt == LUA_TSTRING) enter(e, 1, lua_tostring(L, -2), 0, p);
    else if (kt == LUA_TNUMBER) enter(e, 0, NULL, lua_tonumber(L, -2), p);
    else enter(e, 1, "<key>", 0, p);
    enc_value(e, lua_gettop(L) - 1); /* the key */
    enc_value(e, lua_gettop(L));     /* the value */
    e->depth--;
    lua_pop(L, 1);
  }
}

static void enc_value(enc_t *e, int idx) {
  lua_State *L = e->L;
  luaL_checkstack(L, 8, "codec");
  switch (lua_type(L, idx)) {
    case LUA_TNIL: msgpack_pack_nil(&e->pk); break;
    case LUA_TBOOLEAN:
      if (lua_toboolean(L, idx)) msgpack_pack_true(&e->pk);
      else msgpack_pack_false(&e->pk);
      break;
    case LUA_TNUMBER: enc_number(e, lua_tonumber(L, idx)); break;
    case LUA_TSTRING: enc_string(e, idx); break;
    case LUA_TTABLE:
      if (lua_getmetatable(L, idx)) {
        lua_pop(L, 1);
        enc_hook(e, idx);
      } else {
        enc_table(e, idx);
      }
      break;
    default: enc_hook(e, idx); break;
  }
}

/* encode(names, v1, v2, ...) -> bytes. names: a root name for all values (string)
 * or a table of one name per value; used only in error messages. */
static int l_encode(lua_State *L) {
  int n = lua_gettop(L) - 1;
  enc_t *e = enc_take(L);
  for (int i = 0; i < n; i++) {
    e->root = "value";
    e->root_index = 0;
    if (lua_type(L, 1) == LUA_TSTRING) {
      e->root = lua_tostring(L, 1);
      /* several values under one name: result[1], result[2]... (the index is
       * written into the path only if an error needs it: a formatted name per
       * value was a tenth of a collective step's instructions) */
      if (n > 1) e->root_index = i + 1;
    }
    else if (lua_type(L, 1) == LUA_TTABLE) {
      lua_rawgeti(L, 1, i + 1);
      if (lua_type(L, -1) == LUA_TSTRING) e->root = lua_tostring(L, -1); /* anchored by names */
      lua_pop(L, 1);
    }
    e->depth = 0;
    enc_value(e, i + 2);
  }
  lua_pushlstring(L, e->buf.data ? e->buf.data : "", e->buf.size);
  if (e->buf.alloc > KEEP_BYTES) enc_gc_buffer(e);
  pool_give(L, ref_enc_pool, -2);
  return 1;
}

/* ---- decoding ---- */

typedef struct {
  lua_State *L;
  int depth;
  int ready;         /* the zone is initialised */
  msgpack_zone zone; /* where msgpack-c puts a message's objects; cleared per use */
} dec_t;

static int dec_gc(lua_State *L) {
  dec_t *d = luaL_checkudata(L, 1, DEC_MT);
  if (d->ready) msgpack_zone_destroy(&d->zone);
  d->ready = 0;
  return 0;
}

static dec_t *dec_take(lua_State *L) {
  dec_t *d = pool_take(L, ref_dec_pool, sizeof *d, DEC_MT);
  if (!d->ready) d->ready = msgpack_zone_init(&d->zone, 8192);
  if (!d->ready) luaL_error(L, "out of memory");
  d->L = L;
  d->depth = 0;
  return d;
}

static int dec_fail(dec_t *d, const char *why) {
  return luaL_error(d->L, "malformed message: %s", why);
}

static void dec_obj(dec_t *d, const msgpack_object *o);

static void dec_call_hook(dec_t *d, int tag, int nargs) {
  lua_State *L = d->L;
  /* stack: ...args; put hook and tag below them */
  rh_pushref(L, ref_dec_hook);
  lua_insert(L, -nargs - 1);
  lua_pushinteger(L, tag);
  lua_insert(L, -nargs - 1);
  if (lua_pcall(L, nargs + 1, 1, 0) != 0) {
    /* keep the hook's message: it says what is wrong (e.g. a refused function) */
    lua_error(L);
  }
}

static void dec_obj(dec_t *d, const msgpack_object *o) {
  lua_State *L = d->L;
  if (++d->depth > MAX_DEPTH + 2) dec_fail(d, "nested too deeply");
  luaL_checkstack(L, 8, "codec");
  switch (o->type) {
    case MSGPACK_OBJECT_NIL: lua_pushnil(L); break;
    case MSGPACK_OBJECT_BOOLEAN: lua_pushboolean(L, o->via.boolean); break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: lua_pushnumber(L, (lua_Number)o->via.u64); break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: lua_pushnumber(L, (lua_Number)o->via.i64); break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: lua_pushnumber(L, o->via.f64); break;
    case MSGPACK_OBJECT_STR: lua_pushlstring(L, o->via.str.ptr, o->via.str.size); break;
    case MSGPACK_OBJECT_BIN: lua_pushlstring(L, o->via.bin.ptr, o->via.bin.size); break;
    case MSGPACK_OBJECT_EXT:
      if (ref_dec_hook == LUA_NOREF) dec_fail(d, "extension value without a codec hook");
      lua_pushlstring(L, o->via.ext.ptr, o->via.ext.size);
      dec_call_hook(d, o->via.ext.type, 1);
      break;
    case MSGPACK_OBJECT_ARRAY: {
      uint32_t n = o->via.array.size;
      const msgpack_object *a = o->via.array.ptr;
      if (n > 0 && a[0].type == MSGPACK_OBJECT_EXT && a[0].via.ext.type >= TAG_LEAF_MAX) {
        if (ref_dec_hook == LUA_NOREF) dec_fail(d, "tagged value without a codec hook");
        luaL_checkstack(L, (int)n + 8, "codec: too many values");
        for (uint32_t i = 1; i < n; i++) dec_obj(d, &a[i]);
        dec_call_hook(d, a[0].via.ext.type, (int)n - 1);
        break;
      }
      lua_createtable(L, (int)n, 0);
      for (uint32_t i = 0; i < n; i++) {
        dec_obj(d, &a[i]);
        lua_rawseti(L, -2, (int)i + 1);
      }
      break;
    }
    case MSGPACK_OBJECT_MAP: {
      uint32_t n = o->via.map.size;
      lua_createtable(L, 0, (int)n);
      for (uint32_t i = 0; i < n; i++) {
        dec_obj(d, &o->via.map.ptr[i].key);
        if (lua_isnil(L, -1) || (lua_isnumber(L, -1) && isnan(lua_tonumber(L, -1))))
          dec_fail(d, "a table key is nil or NaN");
        dec_obj(d, &o->via.map.ptr[i].val);
        lua_rawset(L, -3);
      }
      break;
    }
    default: dec_fail(d, "unknown value type");
  }
  d->depth--;
}

/* decode(bytes [, max_values]) -> v1, v2, ... (all values in the string) */
static int l_decode(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  int base = lua_gettop(L);
  /* msgpack-c trusts counts: check the bytes before it allocates for them */
  int chk = rh_mp_check((const uint8_t *)s, len, MAX_DEPTH + 2, NULL);
  if (chk != RH_MP_OK) return luaL_error(L, "malformed message: %s", rh_mp_strerror(chk));
  dec_t *d = dec_take(L);
  int dpos = lua_gettop(L);
  size_t off = 0;
  while (off < len) {
    msgpack_object obj;
    msgpack_zone_clear(&d->zone);
    msgpack_unpack_return rc = msgpack_unpack(s, len, &off, &d->zone, &obj);
    if (rc == MSGPACK_UNPACK_CONTINUE) dec_fail(d, "truncated");
    if (rc != MSGPACK_UNPACK_SUCCESS && rc != MSGPACK_UNPACK_EXTRA_BYTES) dec_fail(d, "not MessagePack");
    luaL_checkstack(L, 4, "codec: too many values");
    d->depth = 0;
    dec_obj(d, &obj);
  }
  /* the values sit above the decoder: give it back, then take it off the stack */
  pool_give(L, ref_dec_pool, dpos);
  lua_remove(L, dpos);
  return lua_gettop(L) - base;
}

static int l_set_hooks(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  rh_unref(L, &ref_enc_hook);
  rh_unref(L, &ref_dec_hook);
  lua_pushvalue(L, 1);
  ref_enc_hook = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pushvalue(L, 2);
  ref_dec_hook = luaL_ref(L, LUA_REGISTRYINDEX);
  return 0;
}

int rh_open_codec(lua_State *L) {
  rh_lua_class(L, ENC_MT, NULL, enc_gc, NULL);
  rh_lua_class(L, DEC_MT, NULL, dec_gc, NULL);
  lua_newtable(L);
  ref_enc_pool = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_newtable(L);
  ref_dec_pool = luaL_ref(L, LUA_REGISTRYINDEX);
  static const luaL_Reg fns[] = {
      {"encode", l_encode}, {"decode", l_decode}, {"set_codec_hooks", l_set_hooks}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
