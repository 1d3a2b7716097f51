/* l_generator.c: random generators (host/tensor/generator.c) as userdata for
 * lua/rpchost/tensor/random.lua, which gives them torch.Generator's methods
 * through the metatable gen_metatable returns. A userdata holds a pointer to
 * its generator: its own, kept inline (the generator is plain data, so the
 * GC owns it whole), or the process's default one. Seeds cross as two 32-bit
 * halves (high, low), so that every 64-bit seed is exact in Lua numbers. */
#include "rh_lua.h"
#include "tensor/tensor.h"

#define GEN_MT "rpchost.Generator"

typedef struct {
  rh_rng_t *g; /* &own, or the default generator */
  rh_rng_t own;
} lgen_t;

static lgen_t *push_gen(lua_State *L) {
  lgen_t *u = lua_newuserdata(L, sizeof *u);
  luaL_getmetatable(L, GEN_MT);
  lua_setmetatable(L, -2);
  return u;
}

rh_rng_t *rh_lua_optgenerator(lua_State *L, int i) {
  if (lua_isnoneornil(L, i)) return NULL;
  return ((lgen_t *)luaL_checkudata(L, i, GEN_MT))->g;
}

static rh_rng_t *check_gen(lua_State *L, int i) { return ((lgen_t *)luaL_checkudata(L, i, GEN_MT))->g; }

/* a 32-bit half of a seed at index i: a whole number in [0, 2^32) */
static uint32_t check_half(lua_State *L, int i) {
  lua_Number v = luaL_checknumber(L, i);
  if (!(v >= 0 && v < 4294967296.0) || v != (lua_Number)(uint32_t)v)
    return (uint32_t)luaL_error(L, "generator: a seed half must be a whole number in [0, 2^32), got %f", v);
  return (uint32_t)v;
}

static int push_seed(lua_State *L, uint64_t s) {
  lua_pushnumber(L, (lua_Number)(s >> 32));
  lua_pushnumber(L, (lua_Number)(s & 0xffffffffu));
  return 2;
}

/* gen_new() -> a generator seeded as a new torch.Generator() is */
static int l_new(lua_State *L) {
  lgen_t *u = push_gen(L);
  u->g = &u->own;
  rh_rng_seed(u->g, RH_RNG_DEFAULT_SEED);
  return 1;
}

/* gen_default() -> the default generator (every call a new box for it) */
static int l_default(lua_State *L) {
  push_gen(L)->g = rh_rng_default();
  return 1;
}

/* gen_manual_seed(g, high, low) */
static int l_manual_seed(lua_State *L) {
  rh_rng_t *g = check_gen(L, 1);
  uint64_t hi = check_half(L, 2), lo = check_half(L, 3);
  rh_rng_seed(g, hi << 32 | lo);
  return 0;
}

/* gen_initial_seed(g) -> high, low */
static int l_initial_seed(lua_State *L) { return push_seed(L, check_gen(L, 1)->seed); }

/* gen_seed(g) -> high, low: reseeded from the OS */
static int l_seed(lua_State *L) {
  uint64_t s;
  if (rh_rng_seed_random(check_gen(L, 1), &s)) return luaL_error(L, "%s", rh_tensor_errmsg());
  return push_seed(L, s);
}

/* gen_get_state(g) -> a uint8 tensor of RH_RNG_STATE_BYTES */
static int l_get_state(lua_State *L) {
  rh_rng_t *g = check_gen(L, 1);
  int64_t n = RH_RNG_STATE_BYTES;
  rh_tensor_t *t = rh_tensor_empty(RH_U8, 1, &n);
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  rh_rng_get_state(g, rh_tensor_data(t));
  return rh_lua_pushtensor(L, t);
}

/* gen_set_state(g, t): t a host uint8 tensor from get_state */
static int l_set_state(lua_State *L) {
  rh_rng_t *g = check_gen(L, 1);
  size_t n;
  rh_tensor_t *t = rh_lua_checkhostspan(L, 2, "set_state", &n);
  if (t->dtype != RH_U8) return luaL_error(L, "set_state: expected a uint8 tensor, got %s", rh_dtype_name(t->dtype));
  if (rh_rng_set_state(g, rh_tensor_data(t), n)) return luaL_error(L, "%s", rh_tensor_errmsg());
  return 0;
}

static int l_metatable(lua_State *L) {
  luaL_getmetatable(L, GEN_MT);
  return 1;
}

int rh_open_generator(lua_State *L) {
  rh_lua_class(L, GEN_MT, NULL, NULL, NULL);
  static const luaL_Reg fns[] = {{"gen_new", l_new},
                                 {"gen_default", l_default},
                                 {"gen_manual_seed", l_manual_seed},
                                 {"gen_initial_seed", l_initial_seed},
                                 {"gen_seed", l_seed},
                                 {"gen_get_state", l_get_state},
                                 {"gen_set_state", l_set_state},
                                 {"gen_metatable", l_metatable},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
