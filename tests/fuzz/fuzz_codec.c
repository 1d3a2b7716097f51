/* fuzz_codec.c: libFuzzer harness for l_codec.c's decoder, which turns bytes
 * from the network into Lua values once rh_mp_check has bounded them. Every
 * input is decoded; whatever decodes is encoded again, and what was encoded
 * must decode (a value the codec writes, it reads). The hooks stand in for
 * lua/rpchost/wire/codec.lua's: tagged values come back as tables of their
 * parts, one tag is refused with an error and one decodes to nil, and functions
 * are named through the globals as the real codec names them. Each input is
 * also decoded as a message with payload segments (three received frame
 * segments of 0, 16 and 64 bytes, made afresh for it) and tag 23 as the
 * tensors' tag, so the codec's own path for plain tensors (dec_plain_tensor,
 * and a segment retyped in place) meets every mutation too; what decodes is
 * encoded as a message again and must decode with its segments. Nothing may
 * crash, leak or read past the input. Built and run by scripts/fuzz.sh. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rh_lua.h"
#include "tensor/tensor.h"

static lua_State *L;

static const char *SETUP =
    "local c = ...\n"
    "local enc = function(v) return 20, tostring(v) end\n"
    "local dec = function(tag, ...)\n"
    "  if tag == 17 then error('refused', 0) end\n"
    "  if tag == 5 then return nil end\n"
    "  return {tag, ...}\n"
    "end\n"
    "c.set_codec_hooks(enc, dec)\n"
    "c.set_codec_names(setmetatable({}, {__mode = 'k'}), _G, 16)\n"
    "function ROUND(s)\n"
    "  local v = table.pack(pcall(c.decode, s))\n"
    "  if not v[1] then return end\n"
    "  local ok, once = pcall(c.encode, 'v', table.unpack(v, 2, v.n))\n"
    "  if not ok then return end\n"
    "  local back, e = pcall(c.decode, once)\n"
    "  if not back then error('what the codec encoded does not decode: ' .. tostring(e), 0) end\n"
    "end\n"
    "c.set_codec_tensor(23)\n"
    "function ROUND_SEGS(s, segs)\n"
    "  local v = table.pack(pcall(c.decode_in, {segments = segs, cache = {}}, s))\n"
    "  if not v[1] then return end\n"
    "  local e = {segments = false, index = false, ag = false}\n"
    "  local ok, once = pcall(c.encode_in, e, 'v', table.unpack(v, 2, v.n))\n"
    "  if not ok then return end\n"
    "  local back, err = pcall(c.decode_in, {segments = e.segments or {}, cache = {}}, once)\n"
    "  if not back then error('what the codec encoded with segments does not decode: ' .. tostring(err), 0) end\n"
    "end\n"
    "table.pack = table.pack or function(...) return {n = select('#', ...), ...} end\n"
    "table.unpack = table.unpack or unpack\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!L) {
    L = luaL_newstate();
    luaL_openlibs(L);
    if (luaL_loadstring(L, SETUP)) abort();
    rh_open_codec(L);
    rh_open_tensor(L); /* (the tensor metatable the codec's tensor path checks) */
    lua_pop(L, 1);
    if (lua_pcall(L, 1, 0, 0)) {
      fprintf(stderr, "fuzz_codec: %s\n", lua_tostring(L, -1));
      abort();
    }
  }
  lua_getglobal(L, "ROUND");
  lua_pushlstring(L, (const char *)data, size);
  if (lua_pcall(L, 1, 0, 0)) {
    /* only the round trip's own check fails a run: decoding errors are answers */
    fprintf(stderr, "fuzz_codec: %s\n", lua_tostring(L, -1));
    abort();
  }
  lua_settop(L, 0);
  lua_getglobal(L, "ROUND_SEGS");
  lua_pushlstring(L, (const char *)data, size);
  lua_createtable(L, 3, 0);
  static const int64_t lens[3] = {0, 16, 64};
  for (int i = 0; i < 3; i++) {
    int64_t len = lens[i], one = 1;
    rh_storage_t *st = rh_storage_new_uninit((size_t)len);
    if (!st) abort();
    if (len) memset(st->data, 0x41, (size_t)len);
    rh_tensor_t *t = rh_tensor_on_storage(st, RH_U8, 0, 1, &len, &one);
    rh_storage_release(st);
    rh_lua_pushframetensor(L, t);
    lua_rawseti(L, -2, i + 1);
  }
  if (lua_pcall(L, 2, 0, 0)) {
    fprintf(stderr, "fuzz_codec: %s\n", lua_tostring(L, -1));
    abort();
  }
  lua_settop(L, 0);
  /* (the segments' tensors are held by userdata in LuaJIT's own heap, which the
   * leak checker does not scan: they are collected before the input ends) */
  lua_gc(L, LUA_GCCOLLECT, 0);
  static unsigned n;
  if (++n % 1024 == 0) lua_gc(L, LUA_GCCOLLECT, 0);
  return 0;
}
