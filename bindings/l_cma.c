/* l_cma.c: cross-memory attach for Lua (host/net/cma.h): large collectives
 * between ranks on one host read and write tensor bytes straight in a peer's
 * memory, one copy instead of a pass through sockets. rpchost.net.cma proves per
 * connection that it works; rpchost.dist.collectives uses it. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "net/cma.h"
#include "rh_lua.h"

/* t_address(t) -> the address of a contiguous tensor's first byte, as a number */
static int l_address(lua_State *L) {
  rh_tensor_t *t = rh_lua_checkhostspan(L, 1, "address", NULL);
  lua_pushnumber(L, (double)(uintptr_t)rh_tensor_data(t));
  return 1;
}

/* a copy's outcome for Lua: true, or nil and what the kernel said */
static int push_outcome(lua_State *L, int rc) {
  if (rc) {
    lua_pushnil(L);
    lua_pushstring(L, strerror(-rc));
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* (pid, addr, tensor) -> true | nil, message: the contiguous tensor's bytes
 * copied from (write = 0) or into (write = 1) pid's memory at addr */
static int cma_copy(lua_State *L, int write, const char *what) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  uintptr_t addr = (uintptr_t)luaL_checknumber(L, 2);
  size_t len;
  rh_tensor_t *t = rh_lua_checkhostspan(L, 3, what, &len);
  int rc = write ? rh_cma_write(pid, addr, rh_tensor_data(t), len) : rh_cma_read(pid, rh_tensor_data(t), addr, len);
  if (!write) rh_tensor_bump_version(t);
  return push_outcome(L, rc);
}

/* cma_read_into(pid, addr, dst): fills the contiguous tensor dst with its byte
 * size read from pid's memory at addr */
static int l_cma_read_into(lua_State *L) { return cma_copy(L, 0, "cma_read_into"); }

/* cma_read_span(pid, addr, dst, offset, nbytes) -> true | nil, message: nbytes
 * read from pid's memory at addr into the contiguous tensor dst, `offset` bytes
 * into it (an all_to_all's pieces land in one output without a view each) */
static int l_cma_read_span(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  uintptr_t addr = (uintptr_t)luaL_checknumber(L, 2);
  size_t len;
  rh_tensor_t *t = rh_lua_checkhostspan(L, 3, "cma_read_span", &len);
  double off = luaL_checknumber(L, 4), n = luaL_checknumber(L, 5);
  if (off < 0 || n < 0 || off + n > (double)len || off != (double)(size_t)off || n != (double)(size_t)n) {
    char why[160];
    snprintf(why, sizeof why, "cma_read_span: %.0f bytes at offset %.0f do not fit in a tensor of %zu bytes", n, off,
             len);
    return luaL_error(L, "%s", why);
  }
  int rc = n > 0 ? rh_cma_read(pid, (char *)rh_tensor_data(t) + (size_t)off, addr, (size_t)n) : 0;
  rh_tensor_bump_version(t);
  return push_outcome(L, rc);
}

/* cma_write_from(pid, addr, src): writes the contiguous tensor src's bytes into
 * pid's memory at addr */
static int l_cma_write_from(lua_State *L) { return cma_copy(L, 1, "cma_write_from"); }

/* cma_probe(pid, addr, expected) -> readable, writable: whether `expected` can
 * be read at addr in pid, and written back there */
static int l_cma_probe(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  uintptr_t addr = (uintptr_t)luaL_checknumber(L, 2);
  size_t len;
  const char *want = luaL_checklstring(L, 3, &len);
  int readable = 0, writable = 0;
  if (pid != getpid()) rh_cma_probe(pid, addr, want, len, &readable, &writable);
  lua_pushboolean(L, readable);
  lua_pushboolean(L, writable);
  return 2;
}

/* cma_token() -> pid, address, bytes: something a peer can read (and write back
 * unchanged) to prove it may */
static int l_cma_token(lua_State *L) {
  static char token[33];
  if (!token[0]) {
    uint64_t a = uv_hrtime() ^ ((uint64_t)getpid() << 32), b = (uint64_t)(uintptr_t)&token * 2654435761u;
    snprintf(token, sizeof token, "%016llx%016llx", (unsigned long long)a, (unsigned long long)b);
  }
  lua_pushinteger(L, getpid());
  lua_pushnumber(L, (double)(uintptr_t)token);
  lua_pushlstring(L, token, 32);
  return 3;
}

/* cma_all_reduce(flat, me, pids, addrs, binop, divisor) -> true | nil, message,
 * group index of the rank it failed with (or nil), refused: rh_cma_all_reduce
 * over the group's ranks (pids[i], addrs[i] for group index i - 1; this rank's
 * own entries are ignored); divisor 0 for none. refused: no byte moved because
 * the op has no kernel for the dtype, a refusal every rank makes alike (unlike
 * a failed allocation, which is this rank's alone) */
static int l_cma_all_reduce(lua_State *L) {
  rh_tensor_t *t = rh_lua_checkhostspan(L, 1, "cma_all_reduce", NULL);
  int me = (int)luaL_checkinteger(L, 2);
  luaL_checktype(L, 3, LUA_TTABLE);
  luaL_checktype(L, 4, LUA_TTABLE);
  int op = (int)luaL_checkinteger(L, 5);
  double divisor = luaL_optnumber(L, 6, 0);
  int n = (int)lua_objlen(L, 3);
  if (n < 1 || (int)lua_objlen(L, 4) != n || me < 0 || me >= n)
    return luaL_error(L, "cma_all_reduce: %d pids, %d addresses, rank %d", n, (int)lua_objlen(L, 4), me);
  if (op < 0 || op >= RH_NBINOPS) return luaL_error(L, "cma_all_reduce: unknown op %d", op);
  rh_cma_peer_t *ranks = lua_newuserdata(L, sizeof *ranks * (size_t)n);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 3, i + 1);
    lua_rawgeti(L, 4, i + 1);
    ranks[i].pid = i == me ? 0 : (pid_t)lua_tointeger(L, -2);
    ranks[i].addr = i == me ? 0 : (uintptr_t)lua_tonumber(L, -1);
    lua_pop(L, 2);
    if (i != me && (ranks[i].pid <= 0 || ranks[i].addr == 0))
      return luaL_error(L, "cma_all_reduce: no process or address for rank %d", i);
  }
  int failed;
  int rc = rh_cma_all_reduce(ranks, n, me, rh_tensor_data(t), t->dtype, rh_tensor_numel(t), (rh_binop_t)op, divisor,
                             &failed);
  rh_tensor_bump_version(t);
  if (rc) {
    lua_pushnil(L);
    if (rc == RH_ENOKERNEL) lua_pushstring(L, rh_tensor_errmsg()); /* (which op, which dtype) */
    else lua_pushstring(L, rh_strerror(rc)); /* (a negated errno reads as libuv's message for it) */
    if (failed >= 0) lua_pushinteger(L, failed);
    else lua_pushnil(L);
    lua_pushboolean(L, rc == RH_ENOKERNEL);
    return 4;
  }
  lua_pushboolean(L, 1);
  return 1;
}

int rh_open_cma(lua_State *L) {
  static const luaL_Reg fns[] = {{"t_address", l_address},
                                 {"cma_read_into", l_cma_read_into},
                                 {"cma_read_span", l_cma_read_span},
                                 {"cma_write_from", l_cma_write_from},
                                 {"cma_probe", l_cma_probe},
                                 {"cma_token", l_cma_token},
                                 {"cma_all_reduce", l_cma_all_reduce},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
