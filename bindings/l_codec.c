/* l_codec.c: Lua values <-> MessagePack bytes (written with msgpack-c's packer,
 * read here straight into Lua values once rh_mp_check has bounded them).
 *
 * Plain values are coded here: nil, booleans, numbers (integral doubles as msgpack
 * integers, others as doubles), binary-safe strings, and tables without metatables
 * (a sequence 1..n as an array, anything else as a map). Everything else - functions,
 * userdata, cdata, tables with metatables - goes through an encode hook written in
 * Lua (lua/rpchost/wire/codec.lua), which returns a tag and the values that stand for it:
 *   tag < 16:  a leaf, coded as msgpack ext(tag, bytes)
 *   tag >= 16: a tagged array [ext(tag, ""), child values...]
 * The decoder calls the decode hook with the tag and the decoded children.
 *
 * One case skips the hooks both ways: a function known by a global name (what
 * nearly every call sends), tag FUNC_NAME with children "g" and the name. The
 * encode hook notes such functions in a weak table (set_codec_names); the
 * encoder writes the name of one found there that is still that global here,
 * and the decoder looks the name up in the globals, leaving only a name that
 * is not defined to the hook (its error names it). Each hook is a call from C
 * into Lua: a fifth of a small call's instructions went to those two.
 *
 * Errors name the path of the offending value (args[2].opts.cb). Cycles and
 * nesting deeper than the wire's limit (which rh_mp_check enforces on arrival)
 * are refused before anything is sent. */
#include <math.h>
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec/mpcheck.h"
#include "rh_lua.h"
#include "tensor/tensor.h"

#define MAX_DEPTH_LIMIT 30 /* the nesting a message may have (rh_mp_check refuses deeper on arrival) */
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
  /* which of l_encode's values this is (0-based) and how many it was given: the
   * value's name (l_encode's first argument) is looked up only for an error */
  int value_i, nvalues;
  path_elem_t path[MAX_DEPTH_LIMIT + 2];
  int depth;
  /* encode_in: the stack slot of the message's encode context, 0 for a bare
   * encode; plain tensors take the codec's own path only where it is not 0
   * (see enc_plain_tensor) */
  int ctx, plain_tensors;
  int in_autograd; /* the context carries a distributed autograd context */
  int indexed;     /* the context's index holds every segment (index_segments) */
  /* encode_in with plain tensors: a stack slot below everything the encode
   * pushes, holding the context's segment list once a plain tensor looked it
   * up (nil before): one lookup of ctx.segments per message, not per tensor */
  int segs_slot;
  /* the tensors this path made segments 1..nseen of, while it made them all
   * (no hook added one between): a tensor met again is found by its address,
   * not by a compare through the Lua stack per earlier segment */
  const void *seen[16];
  int nseen;
  /* the segments this path made and their bytes: when they are all of the
   * message's, encode_in returns the payload's bytes with the body (no walk
   * over the segments to count them again) */
  int made;
  double made_bytes;
} enc_t;

static int is_ident(const char *s) {
  if (!*s || (*s >= '0' && *s <= '9')) return 0;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_')) return 0;
  return 1;
}

/* Pushes the path of the value being encoded, e.g. args[2].cb */
static void push_path(enc_t *e) {
  lua_State *L = e->L;
  /* the root name: a string for all values (result[1], result[2]... when
   * several), or a table of one name per value (anchored by it) */
  const char *root = "value";
  int root_index = 0;
  if (lua_type(L, 1) == LUA_TSTRING) {
    root = lua_tostring(L, 1);
    if (e->nvalues > 1) root_index = e->value_i + 1;
  } else if (lua_type(L, 1) == LUA_TTABLE) {
    lua_rawgeti(L, 1, e->value_i + 1);
    if (lua_type(L, -1) == LUA_TSTRING) root = lua_tostring(L, -1);
    lua_pop(L, 1);
  }
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, root);
  char tmp[64];
  if (root_index > 0) {
    snprintf(tmp, sizeof tmp, "[%d]", root_index);
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

/* Encoders are reused, not made per message: each is a userdata (so an error
 * that abandons one mid-way leaves it to the GC, whose __gc frees its buffer)
 * kept in a small registry stack between uses. A nested use (a codec hook that
 * encodes) simply takes another. (Decoding needs no state of its own.) */
#define ENC_MT "rpchost.Encoder"
#define POOL_MAX 8
#define KEEP_BYTES (64u << 10) /* a buffer grown past this is not kept */
static int ref_enc_pool = LUA_NOREF;
/* the fast path for functions known by a global name (see the top) */
static int ref_fn_names = LUA_NOREF, ref_globals = LUA_NOREF, tag_func_name = -1;
/* the tensors' tag, once rpchost.tensor.wire installed their codec (set_codec_tensor) */
static int tag_tensor = -1;

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

/* The encoder of an encode that no other encode is using (the usual case):
 * plain static memory, no userdata to take from the pool and give back (a
 * tenth of a small call's encoding). Busy from its take to its last byte's
 * copy, and freed by an error that enc_fail raises (every error the encoder
 * raises itself, the Lua stack's limit included); a nested encode (a codec
 * hook's, a finaliser's during an allocation) takes one from the pool. (An
 * error the encoder does not raise, running out of memory or a finaliser's
 * error rethrown from an allocation, leaves it busy: every encode then takes
 * from the pool, as all did before, correct but slower.) */
static enc_t enc_hot;
static int enc_hot_busy;

/* An encoder ready for a message (one from the pool is pushed on the stack). */
static enc_t *enc_take(lua_State *L) {
  enc_t *e;
  if (!enc_hot_busy) {
    enc_hot_busy = 1;
    e = &enc_hot;
  } else {
    e = pool_take(L, ref_enc_pool, sizeof *e, ENC_MT);
  }
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
  if (e == &enc_hot) enc_hot_busy = 0; /* (its message is made: nothing reads the encoder now) */
  return lua_error(e->L);
}

static void enc_value(enc_t *e, int idx);

/* Appends n bytes the encoder formed itself: straight into the buffer while it
 * has room, not through msgpack-c's write callback (a call per nil, header and
 * small number: a tenth of a tensor's encoding). The bytes are the ones
 * msgpack-c's packer writes for the same value (codec_spec pins them). */
static void put(enc_t *e, const void *p, size_t n) {
  if (e->buf.alloc - e->buf.size >= n) {
    memcpy(e->buf.data + e->buf.size, p, n);
    e->buf.size += n;
  } else if (msgpack_sbuffer_write(&e->buf, p, n) != 0) {
    enc_fail(e, "does not fit in memory");
  }
}

static void put_byte(enc_t *e, uint8_t b) { put(e, &b, 1); }

/* an array's header: a fixarray up to 15 elements */
static void enc_array_head(enc_t *e, size_t n) {
  if (n < 16) put_byte(e, (uint8_t)(0x90 | n));
  else msgpack_pack_array(&e->pk, n);
}

static void enc_number(enc_t *e, double d) {
  /* 0..127, the common case (a dtype, a size, a segment number, a count), is
   * one byte, a positive fixint, as msgpack_pack_int64 writes it: written here
   * while the buffer has room, not through msgpack-c's write callback */
  if (d >= 0 && d < 128 && e->buf.size < e->buf.alloc) {
    int i = (int)d;
    if ((double)i == d && !(i == 0 && signbit(d))) {
      e->buf.data[e->buf.size++] = (char)i;
      return;
    }
  }
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

/* A function the encode hook found as the global of the same name, and that
 * still is: its name, written as the hook would write it. 1 when written. */
static int enc_global_function(enc_t *e, int idx) {
  lua_State *L = e->L;
  /* (at the depth limit the hook's path raises the limit's error: a message
   * must not pass or fail by whether its function was sent before) */
  if (ref_fn_names == LUA_NOREF || e->depth >= MAX_DEPTH) return 0;
  int top = lua_gettop(L);
  rh_pushref(L, ref_fn_names);
  lua_pushvalue(L, idx);
  lua_rawget(L, -2);
  int ok = 0;
  if (lua_type(L, -1) == LUA_TSTRING) {
    rh_pushref(L, ref_globals);
    lua_pushvalue(L, -2);
    lua_rawget(L, -2);
    if (lua_rawequal(L, -1, idx)) {
      size_t len;
      const char *name = lua_tolstring(L, top + 2, &len);
      msgpack_pack_array(&e->pk, 3);
      msgpack_pack_ext(&e->pk, 0, (int8_t)tag_func_name);
      msgpack_pack_str(&e->pk, 1);
      msgpack_pack_str_body(&e->pk, "g", 1);
      msgpack_pack_str(&e->pk, len);
      msgpack_pack_str_body(&e->pk, name, len);
      ok = 1;
    }
  }
  lua_settop(L, top);
  return ok;
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
    enc_array_head(e, n);
    for (size_t i = 1; i <= n; i++) {
      enter(e, 0, NULL, (double)i, p);
      lua_rawgeti(L, idx, (int)i);
      enc_value(e, lua_gettop(L));
      lua_pop(L, 1);
      e->depth--;
    }
    return;
  }
  if (count < 16) put_byte(e, (uint8_t)(0x80 | count));
  else msgpack_pack_map(&e->pk, count);
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

/* ---- plain tensors, without the hooks ----
 *
 * A CPU tensor that is contiguous is nothing but its dtype, sizes and bytes,
 * and whether it requires gradients: rpchost.tensor.wire's hook would return
 * (TENSOR, dtype, sizes, its segment number, nil, nil, nil, rg), rg true for a
 * tensor that requires gradients, else nil. That holds in a distributed
 * autograd context too for a tensor that needs no gradient (it gets no send
 * there); one that does gets a send id there, from the hook. Such a tensor is
 * written here with those same bytes, and its segment registered in the
 * context's own list (ctx.segments, ctx.index: the list the hook fills, so a
 * message may mix both paths); the decoder below makes one back the same way
 * (a leaf that requires gradients where rg is true). Everything else (CUDA,
 * strided, a tensor that requires gradients inside an autograd context, bare
 * encodes) goes through the hooks. (Each hook was a call from C into Lua that
 * called back into C five times: a table of 8 tensors of 512 bytes took 3.2x
 * the round trip of one 4 KiB tensor.) */

/* ctx[key] at the top of the stack, made a table there first if it is not one
 * (the Lua half's contexts hold false until a message needs them), sized for a
 * few entries of the array or hash part */
static void ctx_table(lua_State *L, int ctx, const char *key, int narr, int nrec) {
  lua_getfield(L, ctx, key);
  if (lua_type(L, -1) == LUA_TTABLE) return;
  lua_pop(L, 1);
  lua_createtable(L, narr, nrec);
  lua_pushvalue(L, -1);
  lua_setfield(L, ctx, key);
}

/* A plain tensor is its own payload: in a short segment list it is found by
 * looking (no table per message for the usual few tensors); from SCAN_SEGS on,
 * in the context's index (payload -> number, no quadratic search for a model's
 * hundreds), which this fills once per encode with every segment it lacks (the
 * hook's path indexes what it adds by the value it was given). Leaves the index
 * at the top of the stack. */
#define SCAN_SEGS 16
_Static_assert(SCAN_SEGS <= sizeof((enc_t *)0)->seen / sizeof(void *), "enc_t.seen holds a short list");
static void index_segments(enc_t *e, int segs, int n) {
  lua_State *L = e->L;
  ctx_table(L, e->ctx, "index", 0, n + 1);
  if (e->indexed) return;
  for (int k = 1; k <= n; k++) {
    lua_rawgeti(L, segs, k);
    lua_pushvalue(L, -1);
    lua_rawget(L, -3);
    if (lua_isnil(L, -1)) {
      lua_pop(L, 1);
      lua_pushinteger(L, k);
      lua_rawset(L, -3);
    } else {
      lua_pop(L, 2);
    }
  }
  e->indexed = 1;
}

/* Writes the value at idx when it is a plain tensor this path may take: 1, else 0. */
static int enc_plain_tensor(enc_t *e, int idx) {
  lua_State *L = e->L;
  if (!e->plain_tensors) return 0;
  int rg;
  rh_tensor_t *t = rh_lua_plaintensor(L, idx, &rg);
  if (!t || (rg && e->in_autograd)) return 0;
  /* where the hook's path would pass the depth limit (its children one level
   * down, the sizes' elements two), it raises the limit's error, as for
   * functions: exactly there, so that every tensor it writes is one this path
   * would not (a 0-dim tensor's empty sizes go no deeper) */
  if (e->depth >= MAX_DEPTH || (t->ndim > 0 && e->depth + 1 >= MAX_DEPTH)) return 0;
  if (!lua_checkstack(L, 8)) enc_fail(e, "has too many values for the Lua stack");
  /* its segment: the one it has in this message already (sent once, arrives
   * as one), else a new one */
  int top = lua_gettop(L), segs = e->segs_slot;
  if (lua_type(L, segs) != LUA_TTABLE) {
    ctx_table(L, e->ctx, "segments", 4, 0);
    lua_replace(L, segs);
  }
  int n = (int)lua_objlen(L, segs), seg = 0;
  const void *box = lua_touserdata(L, idx);
  if (n < SCAN_SEGS && e->nseen == n) {
    for (int k = 0; k < n && !seg; k++)
      if (e->seen[k] == box) seg = k + 1;
  } else if (n < SCAN_SEGS) {
    for (int k = 1; k <= n && !seg; k++) {
      lua_rawgeti(L, segs, k);
      if (lua_rawequal(L, -1, idx)) seg = k;
      lua_pop(L, 1);
    }
  } else {
    index_segments(e, segs, n);
    lua_pushvalue(L, idx);
    lua_rawget(L, -2);
    seg = lua_isnumber(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    lua_pop(L, 1);
  }
  if (!seg) {
    seg = n + 1;
    lua_pushvalue(L, idx);
    lua_rawseti(L, segs, seg);
    e->made++;
    e->made_bytes += (double)rh_tensor_numel(t) * (double)rh_dtype_size(t->dtype);
    if (e->nseen == n && n < SCAN_SEGS) e->seen[e->nseen++] = box;
    if (n >= SCAN_SEGS) {
      lua_pushvalue(L, idx);
      lua_pushinteger(L, seg);
      lua_rawset(L, -3);
    }
  }
  lua_settop(L, top);
  /* [ext8 of no bytes with the tag, dtype, [sizes...], segment, nil, nil, nil,
   * true | nil] */
  const uint8_t head[4] = {0x98, 0xc7, 0x00, (uint8_t)(int8_t)tag_tensor};
  put(e, head, sizeof head);
  enc_number(e, (double)t->dtype);
  enc_array_head(e, (size_t)t->ndim);
  for (int k = 0; k < t->ndim; k++) enc_number(e, (double)t->size[k]);
  enc_number(e, seg);
  const uint8_t tail[4] = {0xc0, 0xc0, 0xc0, rg ? 0xc3 : 0xc0};
  put(e, tail, sizeof tail);
  return 1;
}

static void enc_value(enc_t *e, int idx) {
  lua_State *L = e->L;
  /* (through enc_fail, which frees the static encoder, as every error an
   * encode raises itself does) */
  if (!lua_checkstack(L, 8)) enc_fail(e, "has too many values for the Lua stack");
  switch (lua_type(L, idx)) {
    case LUA_TNIL: put_byte(e, 0xc0); break;
    case LUA_TBOOLEAN: put_byte(e, lua_toboolean(L, idx) ? 0xc3 : 0xc2); break;
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
    case LUA_TFUNCTION:
      if (!enc_global_function(e, idx)) enc_hook(e, idx);
      break;
    case LUA_TUSERDATA:
      if (!enc_plain_tensor(e, idx)) enc_hook(e, idx);
      break;
    default: enc_hook(e, idx); break;
  }
}

/* Encodes the n values at 2..n+1 (1: their names) into the string it pushes;
 * ctx: the stack slot of their message's encode context, or 0. */
static int encode_values(lua_State *L, int n, int ctx) {
  int plain = ctx && tag_tensor >= 0, segs_slot = 0;
  if (plain) {
    /* (below the encoder enc_take may push: what the end gives back to the pool) */
    lua_pushnil(L);
    segs_slot = lua_gettop(L);
  }
  enc_t *e = enc_take(L);
  e->nvalues = n;
  e->ctx = ctx;
  e->plain_tensors = plain;
  e->segs_slot = segs_slot;
  e->nseen = 0;
  e->in_autograd = 0;
  if (e->plain_tensors) {
    lua_getfield(L, ctx, "ag");
    e->in_autograd = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  e->indexed = 0;
  e->made = 0;
  e->made_bytes = 0;
  for (int i = 0; i < n; i++) {
    /* (the name is looked up only if an error needs it: push_path; a formatted
     * name per value was a tenth of a collective step's instructions, a name
     * read per value a tenth of a call's encoding) */
    e->value_i = i;
    e->depth = 0;
    enc_value(e, i + 2);
  }
  /* the payload's bytes, where this path made every segment (a hook's segments
   * it does not know: nil then, and the caller counts them) */
  int counted = 0;
  double payload = e->made_bytes;
  if (ctx) {
    lua_getfield(L, ctx, "segments");
    counted = (lua_istable(L, -1) ? (int)lua_objlen(L, -1) : 0) == e->made;
    lua_pop(L, 1);
  }
  lua_pushlstring(L, e->buf.data ? e->buf.data : "", e->buf.size);
  if (e->buf.alloc > KEEP_BYTES) enc_gc_buffer(e);
  if (e == &enc_hot) enc_hot_busy = 0;
  else pool_give(L, ref_enc_pool, -2);
  if (!ctx) return 1;
  if (counted) lua_pushnumber(L, payload);
  else lua_pushnil(L);
  return 2;
}

/* encode(names, v1, v2, ...) -> bytes. names: a root name for all values (string)
 * or a table of one name per value; used only in error messages. */
static int l_encode(lua_State *L) { return encode_values(L, lua_gettop(L) - 1, 0); }

/* encode_in(ctx, names, v1, v2, ...) -> bytes, payload's bytes | nil: encode,
 * for the message whose encode context is ctx (rpchost.wire.codec's
 * encode_message); nil where a hook made segments this path did not count */
static int l_encode_in(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_pushvalue(L, 1);
  lua_remove(L, 1);
  int ctx = lua_gettop(L);
  return encode_values(L, ctx - 2, ctx);
}

/* ---- decoding ----
 *
 * Straight from the bytes to Lua values, in one pass: rh_mp_measure has walked
 * them first (every count fits the bytes left, nesting bounded, the cost within
 * the allowance below), and each read here is bounds-checked again all the
 * same. (msgpack-c's unpacker built a tree of objects in a zone first, and the
 * zone was a pooled userdata: together three quarters of a small request's
 * decoding.) */

/* What a message may cost to decode. Every value takes at least one byte of
 * it (rh_mp_check refuses a count the bytes cannot back, and the tables are
 * never made larger than the bytes left could fill), but one byte can still
 * become far more in Lua: an empty table is 1 byte on the wire and 72 in Lua, a
 * map of 2^25 repeated keys pre-sizes 768 MiB for one key, a 64 MiB array of
 * 2^26 small integers 512 MiB and seconds of the loop, 4 MiB of empty arrays
 * 288 MiB. So each message may decode to DEC_RATIO bytes of Lua values per byte
 * of it, plus DEC_FLOOR_MIB. rh_mp_measure sums what its values would cost in the
 * walk that checks its counts, before any is made, and a message past its
 * allowance is refused then, naming the value that took it there: a sender
 * cannot make this rank build 80 MiB of tables, and stall its loop doing so, for
 * a message that then fails. The costs follow LuaJIT's object sizes (GC64): a
 * table 64 bytes, an array slot 8, a hash node 24, an extension value three slots
 * (the object a hook makes of it) besides its bytes; a string its bytes (keys
 * repeat, and Lua keeps one copy of each). A tagged value is costed as the array
 * it travels in and its tag as an extension value: more than the decoder makes. */
#define DEC_RATIO 4
#define DEC_FLOOR_MIB 64
static const rh_mp_costs_t dec_costs = {.table = 64, .slot = 8, .node = 24, .ext = 3 * 8};

typedef struct {
  lua_State *L;
  const uint8_t *p, *end;
  int depth;
  /* decode_in: the stack slots of the message's segments and of its cache
   * (segment number -> the value made of it), 0 when there are none */
  int segs, cache;
} dec_t;

static int dec_fail(dec_t *d, const char *why) { return luaL_error(d->L, "malformed message: %s", why); }

static const uint8_t *dec_take(dec_t *d, size_t n) {
  if ((size_t)(d->end - d->p) < n) dec_fail(d, "truncated");
  const uint8_t *q = d->p;
  d->p += n;
  return q;
}

static uint64_t dec_be(dec_t *d, int n) {
  const uint8_t *q = dec_take(d, (size_t)n);
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v = v << 8 | q[i];
  return v;
}

/* The header of an extension value at d->p (b its first byte, already taken):
 * its type and payload length. 0 when b starts no extension. */
static int dec_ext_head(dec_t *d, uint8_t b, int *type, size_t *len) {
  switch (b) {
    case 0xd4: *len = 1; break;
    case 0xd5: *len = 2; break;
    case 0xd6: *len = 4; break;
    case 0xd7: *len = 8; break;
    case 0xd8: *len = 16; break;
    case 0xc7: *len = (size_t)dec_be(d, 1); break;
    case 0xc8: *len = (size_t)dec_be(d, 2); break;
    case 0xc9: *len = (size_t)dec_be(d, 4); break;
    default: return 0;
  }
  *type = (int)(int8_t)*dec_take(d, 1);
  return 1;
}

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

static void dec_value(dec_t *d);

/* [FUNC_NAME, "g", name] with the header and "g" read (d->p at the name):
 * pushes the global of that name, or, where it is not defined, what the hook
 * makes of ("g", name) (its error names it). */
static void dec_global_function(dec_t *d, int tag) {
  lua_State *L = d->L;
  dec_value(d); /* the name */
  if (lua_type(L, -1) == LUA_TSTRING) {
    rh_pushref(L, ref_globals);
    lua_pushvalue(L, -2);
    lua_rawget(L, -2);
    if (!lua_isnil(L, -1)) {
      lua_replace(L, -3);
      lua_pop(L, 1);
      return;
    }
    lua_pop(L, 2);
  }
  lua_pushlstring(L, "g", 1);
  lua_insert(L, -2);
  dec_call_hook(d, tag, 2);
}

/* A whole number at *p below 2^62, as msgpack-c writes one (fixint, uint 8-64),
 * into *v: the bytes it took, 0 for anything else. */
static size_t peek_count(const uint8_t *p, const uint8_t *end, int64_t *v) {
  if (p >= end) return 0;
  int w = *p <= 0x7f ? 0 : *p == 0xcc ? 1 : *p == 0xcd ? 2 : *p == 0xce ? 4 : *p == 0xcf ? 8 : -1;
  if (w < 0 || end - p < 1 + w) return 0;
  uint64_t u = w ? 0 : *p;
  for (int i = 1; i <= w; i++) u = u << 8 | p[i];
  if (u > ((uint64_t)1 << 62)) return 0;
  *v = (int64_t)u;
  return (size_t)(1 + w);
}

/* A tensor's children at d->p (dtype, sizes, segment number, three nils, then
 * nil or true: requires gradients), read straight into the tensor its segment
 * carries when that is all they say (see enc_plain_tensor): 1, with the tensor
 * pushed. 0, with nothing read, for anything else: the hook makes that (and
 * names what is wrong). */
static int dec_plain_tensor(dec_t *d) {
  lua_State *L = d->L;
  const uint8_t *p = d->p, *end = d->end;
  int64_t dt, size[RH_MAXDIM], seg;
  size_t k = peek_count(p, end, &dt);
  if (!k || dt >= RH_NDTYPES || (p += k) >= end || (*p & 0xf0) != 0x90) return 0;
  int n = *p++ & 0x0f;
  /* (as deep as dec_value would let the children and the sizes' elements go) */
  if (d->depth + (n > 0 ? 2 : 1) > MAX_DEPTH + 2) return 0;
  for (int i = 0; i < n; i++) {
    if (!(k = peek_count(p, end, &size[i]))) return 0;
    p += k;
  }
  if (!(k = peek_count(p, end, &seg)) || seg < 1 || seg > INT32_MAX || end - (p += k) < 4) return 0;
  if (p[0] != 0xc0 || p[1] != 0xc0 || p[2] != 0xc0 || (p[3] != 0xc0 && p[3] != 0xc3)) return 0;
  int rg = p[3] == 0xc3;
  lua_rawgeti(L, d->cache, (int)seg);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_rawgeti(L, d->segs, (int)seg);
    if (!rh_lua_totensor(L, -1)) {
      lua_pop(L, 1);
      return 0;
    }
    /* (a tensor that requires gradients is a float one: anything else is the
     * hook's to refuse, before this path changes a segment) */
    if (rg && dt != RH_F32 && dt != RH_F64) {
      lua_pop(L, 1);
      return 0;
    }
    rh_lua_pushsegmenttensor(L, lua_gettop(L), (int)dt, n, size, 1);
    lua_replace(L, -2);
    if (rg) rh_lua_setrequiresgrad(L, -1);
    lua_pushvalue(L, -1);
    lua_rawseti(L, d->cache, (int)seg);
  } else if (rg) {
    /* (a segment met again with the flag: the hook's, which knows what the
     * value made of it the first time may and may not become) */
    lua_pop(L, 1);
    return 0;
  }
  d->p = p + 4;
  return 1;
}

static void dec_array(dec_t *d, uint32_t n) {
  lua_State *L = d->L;
  if (n > 0) {
    /* [ext(tag >= TAG_LEAF_MAX), children...]: a tagged value */
    const uint8_t *at = d->p;
    int type;
    size_t len;
    uint8_t b = *dec_take(d, 1);
    if (dec_ext_head(d, b, &type, &len) && type >= TAG_LEAF_MAX) {
      dec_take(d, len);
      if (ref_dec_hook == LUA_NOREF) dec_fail(d, "tagged value without a codec hook");
      luaL_checkstack(L, (int)n + 8, "codec: too many values");
      /* (a function by a global name: "g" as the encoder writes it, a fixstr) */
      if (n == 3 && type == tag_func_name && ref_globals != LUA_NOREF && d->end - d->p >= 2 && d->p[0] == 0xa1 &&
          d->p[1] == 'g') {
        d->p += 2;
        dec_global_function(d, type);
        return;
      }
      if (type == tag_tensor && n == 8 && d->segs && dec_plain_tensor(d)) return;
      for (uint32_t i = 1; i < n; i++) dec_value(d);
      dec_call_hook(d, type, (int)n - 1);
      return;
    }
    d->p = at;
  }
  /* (never pre-sized past the elements the bytes left could hold, one byte each) */
  size_t left = (size_t)(d->end - d->p);
  lua_createtable(L, (int)(n <= left ? n : left), 0);
  for (uint32_t i = 0; i < n; i++) {
    dec_value(d);
    lua_rawseti(L, -2, (int)i + 1);
  }
}

static void dec_map(dec_t *d, uint32_t n) {
  lua_State *L = d->L;
  /* (never pre-sized past the entries the bytes left could hold, two bytes each) */
  size_t left = (size_t)(d->end - d->p) / 2;
  lua_createtable(L, 0, (int)(n <= left ? n : left));
  for (uint32_t i = 0; i < n; i++) {
    dec_value(d);
    if (lua_isnil(L, -1) || (lua_isnumber(L, -1) && isnan(lua_tonumber(L, -1))))
      dec_fail(d, "a table key is nil or NaN");
    dec_value(d);
    lua_rawset(L, -3);
  }
}

static void dec_string(dec_t *d, size_t n) {
  const uint8_t *q = dec_take(d, n);
  lua_pushlstring(d->L, (const char *)q, n);
}

static void dec_value(dec_t *d) {
  lua_State *L = d->L;
  if (++d->depth > MAX_DEPTH + 2) dec_fail(d, "nested too deeply");
  luaL_checkstack(L, 8, "codec");
  uint8_t b = *dec_take(d, 1);
  int type;
  size_t len;
  if (b <= 0x7f) lua_pushnumber(L, (lua_Number)b);
  else if (b >= 0xe0) lua_pushnumber(L, (lua_Number)(int8_t)b);
  else if (b <= 0x8f) dec_map(d, b & 0x0f);
  else if (b <= 0x9f) dec_array(d, b & 0x0f);
  else if (b <= 0xbf) dec_string(d, b & 0x1f);
  else if (dec_ext_head(d, b, &type, &len)) {
    /* a leaf: the hook makes the value of its bytes */
    if (ref_dec_hook == LUA_NOREF) dec_fail(d, "extension value without a codec hook");
    dec_string(d, len);
    dec_call_hook(d, type, 1);
  } else {
    switch (b) {
      case 0xc0: lua_pushnil(L); break;
      case 0xc2: lua_pushboolean(L, 0); break;
      case 0xc3: lua_pushboolean(L, 1); break;
      case 0xc4:
      case 0xd9: dec_string(d, (size_t)dec_be(d, 1)); break; /* bin8, str8 */
      case 0xc5:
      case 0xda: dec_string(d, (size_t)dec_be(d, 2)); break;
      case 0xc6:
      case 0xdb: dec_string(d, (size_t)dec_be(d, 4)); break;
      case 0xca: {
        uint32_t u = (uint32_t)dec_be(d, 4);
        float f;
        memcpy(&f, &u, 4);
        lua_pushnumber(L, (lua_Number)f);
        break;
      }
      case 0xcb: {
        uint64_t u = dec_be(d, 8);
        double f;
        memcpy(&f, &u, 8);
        lua_pushnumber(L, f);
        break;
      }
      case 0xcc: lua_pushnumber(L, (lua_Number)dec_be(d, 1)); break;
      case 0xcd: lua_pushnumber(L, (lua_Number)dec_be(d, 2)); break;
      case 0xce: lua_pushnumber(L, (lua_Number)dec_be(d, 4)); break;
      case 0xcf: lua_pushnumber(L, (lua_Number)dec_be(d, 8)); break;
      case 0xd0: lua_pushnumber(L, (lua_Number)(int8_t)dec_be(d, 1)); break;
      case 0xd1: lua_pushnumber(L, (lua_Number)(int16_t)dec_be(d, 2)); break;
      case 0xd2: lua_pushnumber(L, (lua_Number)(int32_t)dec_be(d, 4)); break;
      case 0xd3: lua_pushnumber(L, (lua_Number)(int64_t)dec_be(d, 8)); break;
      case 0xdc: dec_array(d, (uint32_t)dec_be(d, 2)); break;
      case 0xdd: dec_array(d, (uint32_t)dec_be(d, 4)); break;
      case 0xde: dec_map(d, (uint32_t)dec_be(d, 2)); break;
      case 0xdf: dec_map(d, (uint32_t)dec_be(d, 4)); break;
      default: dec_fail(d, "not MessagePack"); /* 0xc1 */
    }
  }
  d->depth--;
}

/* Pushes the values in the string s; segs and cache: decode_in's slots, or 0. */
static int decode_values(lua_State *L, const char *s, size_t len, int segs, int cache) {
  int base = lua_gettop(L);
  /* the counts come from the network: check them against the bytes first, and
   * what their values would cost in Lua against the message's allowance */
  rh_mp_costs_t costs = dec_costs;
  costs.limit = ((size_t)DEC_FLOOR_MIB << 20) + (len < SIZE_MAX / (2 * DEC_RATIO) ? DEC_RATIO * len : SIZE_MAX / 2);
  rh_mp_where_t where = {0};
  /* (a message too short to reach its allowance, as nearly all are, is only
   * checked: the costs' sum was a sixth of the walk) */
  const rh_mp_costs_t *counted = rh_mp_cost_bound(len, &costs) <= costs.limit ? NULL : &costs;
  int chk = rh_mp_measure((const uint8_t *)s, len, MAX_DEPTH + 2, counted, NULL, &where);
  if (chk == RH_MP_TOOMANY) {
    char msg[200];
    snprintf(msg, sizeof msg,
             "malformed message: %s claims %llu %s, but only %zu bytes follow it (each takes at least %s)",
             where.is_map ? "a map" : "an array", (unsigned long long)where.count,
             where.is_map ? "entries" : "elements", where.left, where.is_map ? "two" : "one");
    return luaL_error(L, "%s", msg);
  }
  if (chk == RH_MP_TOOCOSTLY) {
    char msg[400];
    snprintf(msg, sizeof msg,
             "cannot decode a message of %zu bytes: %s %llu %s would take its values past %zu MiB (a message "
             "decodes to at most %d times its size plus %d MiB of Lua values); send bulk data as a tensor, or in "
             "several messages",
             len, where.what, (unsigned long long)where.count, where.unit, (costs.limit + (1u << 19)) >> 20, DEC_RATIO,
             DEC_FLOOR_MIB);
    return luaL_error(L, "%s", msg);
  }
  if (chk != RH_MP_OK) return luaL_error(L, "malformed message: %s", rh_mp_strerror(chk));
  dec_t d = {L, (const uint8_t *)s, (const uint8_t *)s + len, 0, segs, cache};
  while (d.p < d.end) {
    luaL_checkstack(L, 4, "codec: too many values");
    d.depth = 0;
    dec_value(&d);
  }
  return lua_gettop(L) - base;
}

/* decode(bytes) -> v1, v2, ... (all values in the string) */
static int l_decode(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  lua_settop(L, 1);
  return decode_values(L, s, len, 0, 0);
}

/* decode_in(ctx, bytes) -> v1, v2, ...: decode, for the message whose decode
 * context is ctx (rpchost.wire.codec's decode_message: its segments and cache) */
static int l_decode_in(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  size_t len;
  /* (a received request's or reply's body is lent: the frame's own bytes) */
  const char *s = rh_lua_tobody(L, 2, &len);
  if (!s) return luaL_typerror(L, 2, "a message's bytes (a string or a frame's body)");
  lua_settop(L, 2);
  lua_getfield(L, 1, "segments");
  lua_getfield(L, 1, "cache");
  int plain = tag_tensor >= 0 && lua_type(L, 3) == LUA_TTABLE && lua_type(L, 4) == LUA_TTABLE;
  return decode_values(L, s, len, plain ? 3 : 0, plain ? 4 : 0);
}

/* *ref now holds the value at idx (any it held before let go). */
static void set_ref(lua_State *L, int *ref, int idx) {
  rh_unref(L, ref);
  lua_pushvalue(L, idx);
  *ref = luaL_ref(L, LUA_REGISTRYINDEX);
}

static int l_set_hooks(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  set_ref(L, &ref_enc_hook, 1);
  set_ref(L, &ref_dec_hook, 2);
  return 0;
}

/* set_codec_names(names, globals, tag): names is a weak table function ->
 * global name (the encode hook fills it), globals the table those names are
 * looked up in, tag FUNC_NAME's number. */
static int l_set_names(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TTABLE);
  int tag = (int)luaL_checkinteger(L, 3);
  luaL_argcheck(L, tag >= TAG_LEAF_MAX && tag <= 127, 3, "not a tagged value's tag");
  set_ref(L, &ref_fn_names, 1);
  set_ref(L, &ref_globals, 2);
  tag_func_name = tag;
  return 0;
}

/* set_codec_tensor(tag): tensors' codec is installed (rpchost.tensor.wire),
 * with that tag: plain tensors may now take the codec's own path.
 * set_codec_tensor(false): every tensor takes the hooks again (a spec compares
 * the two paths' bytes). */
static int l_set_tensor(lua_State *L) {
  if (lua_type(L, 1) == LUA_TBOOLEAN && !lua_toboolean(L, 1)) {
    tag_tensor = -1;
    return 0;
  }
  int tag = (int)luaL_checkinteger(L, 1);
  luaL_argcheck(L, tag >= TAG_LEAF_MAX && tag <= 127, 1, "not a tagged value's tag");
  tag_tensor = tag;
  return 0;
}

int rh_open_codec(lua_State *L) {
  rh_lua_class(L, ENC_MT, NULL, enc_gc, NULL);
  lua_newtable(L);
  ref_enc_pool = luaL_ref(L, LUA_REGISTRYINDEX);
  static const luaL_Reg fns[] = {{"encode", l_encode},
                                 {"decode", l_decode},
                                 {"encode_in", l_encode_in},
                                 {"decode_in", l_decode_in},
                                 {"set_codec_tensor", l_set_tensor},
                                 {"set_codec_hooks", l_set_hooks},
                                 {"set_codec_names", l_set_names},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
