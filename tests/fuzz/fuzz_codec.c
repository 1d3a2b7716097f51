/* fuzz_codec.c: libFuzzer harness for l_codec.c's decoder, which turns bytes
 * from the network into Lua values once rh_mp_check has bounded them. Every
 * input is decoded; whatever decodes is encoded again, and what was encoded
 * must decode (a value the codec writes, it reads). The hooks stand in for lua/rpchost/wire/codec.lua's: tagged
 * values come back as tables of their parts, one tag is refused with an error
 * and one decodes to nil, and functions are named through the globals as the
 * real codec names them. Nothing may crash, leak or read past the input.
 * Built and run by scripts/fuzz.sh. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rh_lua.h"

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
    "table.pack = table.pack or function(...) return {n = select('#', ...), ...} end\n"
    "table.unpack = table.unpack or unpack\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!L) {
    L = luaL_newstate();
    luaL_openlibs(L);
    if (luaL_loadstring(L, SETUP)) abort();
    rh_open_codec(L);
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
  static unsigned n;
  if (++n % 1024 == 0) lua_gc(L, LUA_GCCOLLECT, 0);
  return 0;
}
