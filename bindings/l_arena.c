/* l_arena.c: the same-host collective arena for Lua ("rpchost.Arena";
 * host/net/arena.h). The group's first rank makes the memory file; the others
 * take its descriptor out of that rank's process with pidfd_getfd (the same
 * permission as cross-memory attach, which ranks on one host already prove),
 * then check it is a sealed memory file of the inode they were told, and that
 * its header holds the group's random token, told only to the group's ranks
 * over their authenticated connections. So a process outside the world, or a
 * rank on another host (whose pid names something else here), gets no arena.
 *
 * A step is three calls from lua/rpchost/net/arena.lua: start (copy in, publish),
 * spin / sleep until every rank is there, finish (reduce or copy out). The
 * spin is bounded (the caller's budget, yielding the core while the host's
 * runnable tasks outnumber its cores: rh_net_polite), so the loop is never held for long: what
 * remains is a sleep in the loop, rung by the rank that completes the step. */
#include <errno.h>
#include <sched.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "net/arena.h"
#include "rh_lua.h"
#include "tensor/tensor.h"

#define ARENA_MT "rpchost.Arena"
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

typedef struct {
  rh_arena_t a;
  rh_shm_t *seg; /* NULL once closed */
} larena_t;

static larena_t *check_arena(lua_State *L, int i) {
  larena_t *b = luaL_checkudata(L, i, ARENA_MT);
  if (!b->seg) luaL_error(L, "the collective arena is closed");
  return b;
}

static int push_new(lua_State *L, rh_shm_t *seg, uint32_t n, uint32_t me, uint32_t slot, const uint8_t *token) {
  larena_t *b = lua_newuserdata(L, sizeof *b);
  b->seg = NULL;
  luaL_getmetatable(L, ARENA_MT);
  lua_setmetatable(L, -2);
  if (rh_arena_open(&b->a, seg->map, seg->size, n, me, slot, token) != 0) {
    rh_shm_release(seg);
    lua_pushnil(L);
    lua_pushliteral(L, "the memory file is not this group's arena (wrong header, size or token)");
    return 2;
  }
  b->seg = seg;
  return 1;
}

static void check_shape(lua_State *L, int *n, int *me, int *slot) {
  *n = (int)luaL_checkinteger(L, 1);
  *me = (int)luaL_checkinteger(L, 2);
  *slot = (int)luaL_checkinteger(L, 3);
  if (*n < 1 || *n > 4096 || *me < 0 || *me >= *n || *slot < 64 || *slot > (1 << 24) || *slot % 64)
    luaL_error(L, "arena: %d ranks, rank %d, slot %d bytes is not a valid shape", *n, *me, *slot);
}

/* arena_create(n, me, slot) -> arena, token, fd, inode | nil, message */
static int l_create(lua_State *L) {
  int n, me, slot;
  check_shape(L, &n, &me, &slot);
  uint8_t token[RH_ARENA_TOKEN];
  if (getrandom(token, sizeof token, 0) != (ssize_t)sizeof token) {
    lua_pushnil(L);
    lua_pushfstring(L, "no random token for the arena: %s", strerror(errno));
    return 2;
  }
  int err = 0;
  /* sparse: a rank's pages are made as it first writes them (most steps use a
   * few lines of a slot) */
  rh_shm_t *seg = rh_shm_create_sparse(rh_arena_size((uint32_t)n, (uint32_t)slot), &err);
  if (!seg) {
    lua_pushnil(L);
    lua_pushfstring(L, "cannot make the collective arena: %s", strerror(-err));
    return 2;
  }
  rh_arena_format(seg->map, (uint32_t)n, (uint32_t)slot, token);
  int fd = seg->fd;
  uint64_t ino = rh_shm_inode(seg);
  if (push_new(L, seg, (uint32_t)n, (uint32_t)me, (uint32_t)slot, token) != 1) return 2;
  lua_pushlstring(L, (const char *)token, sizeof token);
  lua_pushinteger(L, fd);
  lua_pushnumber(L, (double)ino);
  return 4;
}

/* arena_attach(n, me, slot, pid, fd, inode, token) -> arena | nil, message */
static int l_attach(lua_State *L) {
  int n, me, slot;
  check_shape(L, &n, &me, &slot);
  pid_t pid = (pid_t)luaL_checkinteger(L, 4);
  int rfd = (int)luaL_checkinteger(L, 5);
  double ino = luaL_checknumber(L, 6);
  size_t tlen;
  const char *token = luaL_checklstring(L, 7, &tlen);
  if (pid <= 0 || rfd < 0 || ino < 0 || tlen != RH_ARENA_TOKEN) {
    lua_pushnil(L);
    lua_pushliteral(L, "the arena's offer is malformed");
    return 2;
  }
  int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
  int fd = pfd < 0 ? -1 : (int)syscall(SYS_pidfd_getfd, pfd, rfd, 0);
  int e = errno;
  if (pfd >= 0) close(pfd);
  if (fd < 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "cannot take the arena's descriptor from process %d: %s", (int)pid, strerror(e));
    return 2;
  }
  char why[160] = "";
  int err = 0;
  rh_shm_t *seg = rh_shm_attach(fd, rh_arena_size((uint32_t)n, (uint32_t)slot), (uint64_t)ino, why, sizeof why, &err);
  if (!seg) {
    lua_pushnil(L);
    lua_pushstring(L, why);
    return 2;
  }
  return push_new(L, seg, (uint32_t)n, (uint32_t)me, (uint32_t)slot, (const uint8_t *)token);
}

/* The contiguous host tensor at i, whose *nbytes fit in a slot. */
static rh_tensor_t *slot_tensor(lua_State *L, larena_t *b, int i, size_t *nbytes) {
  rh_tensor_t *t = rh_lua_checkhostspan(L, i, "arena", nbytes);
  if (*nbytes > b->a.slot) luaL_error(L, "arena: the tensor does not fit in a slot");
  return t;
}

static void push_wakes(lua_State *L, larena_t *b, const uint8_t *wake) {
  int k = 0;
  for (uint32_t i = 0; i < b->a.n; i++)
    if (wake[i]) {
      if (!k) lua_createtable(L, 2, 0);
      lua_pushinteger(L, (lua_Integer)i);
      lua_rawseti(L, -2, ++k);
    }
  if (!k) lua_pushnil(L);
}

/* arena:start(kind, dtype, redop, root, numel [, tensor]) -> epoch, ranks to
 * ring (a list of group indices) or nil. The tensor's bytes go into our slot. */
static int l_start(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  rh_arena_sig_t s = {(uint32_t)luaL_checkinteger(L, 2), (uint32_t)luaL_checkinteger(L, 3),
                      (uint32_t)luaL_checkinteger(L, 4), (uint32_t)luaL_checkinteger(L, 5),
                      (uint64_t)luaL_checknumber(L, 6)};
  if (!lua_isnoneornil(L, 7)) {
    size_t len;
    rh_tensor_t *t = slot_tensor(L, b, 7, &len);
    memcpy(rh_arena_my_data(&b->a, b->a.epoch + 1), rh_tensor_data(t), len);
  }
  uint8_t wake[b->a.n];
  uint64_t e = rh_arena_publish(&b->a, &s, wake);
  lua_pushnumber(L, (double)e);
  push_wakes(L, b, wake);
  return 2;
}

/* What rh_arena_check said, for Lua: 0 (done) | group index + 1 of a rank not
 * there yet | -1, index, kind, dtype, redop, root, numel (another call) |
 * nil, index (an impossible epoch). */
static int push_check(lua_State *L, int rc, const rh_arena_sig_t *o, int bad) {
  if (rc >= 0) {
    lua_pushinteger(L, rc);
    return 1;
  }
  if (rc == RH_EARENA) {
    lua_pushnil(L);
    lua_pushinteger(L, bad);
    return 2;
  }
  lua_pushinteger(L, -1);
  lua_pushinteger(L, -(rc + 0x10000) - 1);
  lua_pushinteger(L, o->kind);
  lua_pushinteger(L, o->dtype);
  lua_pushinteger(L, o->redop);
  lua_pushinteger(L, o->root);
  lua_pushnumber(L, (double)o->numel);
  return 7;
}

/* arena:spin(epoch, ns) -> as push_check: polls for up to ns nanoseconds,
 * giving the core away between looks where the rings would (rh_net_polite:
 * the host's runnable tasks outnumber its cores, or others contend for ours) */
static int l_spin(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  uint64_t e = (uint64_t)luaL_checknumber(L, 2);
  uint64_t ns = (uint64_t)luaL_checknumber(L, 3);
  rh_arena_sig_t o;
  int bad = -1;
  uint64_t now = uv_hrtime(), until = now + ns;
  int yield = rh_net_polite(&rh_ctx()->net, now);
  int rc;
  for (;;) {
    rc = rh_arena_check(&b->a, e, &o, &bad);
    if (rc <= 0 || uv_hrtime() >= until) break;
    if (yield) sched_yield();
    else {
#if defined(__x86_64__) || defined(__i386__)
      for (int k = 0; k < 16; k++) __builtin_ia32_pause();
#endif
    }
  }
  return push_check(L, rc, &o, bad);
}

/* arena:sleep(epoch) -> as push_check, after setting our flag (a result other
 * than a rank not there leaves the flag cleared) */
static int l_sleep(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  rh_arena_sig_t o;
  int bad = -1;
  int rc = rh_arena_sleep(&b->a, (uint64_t)luaL_checknumber(L, 2), &o, &bad);
  return push_check(L, rc, &o, bad);
}

static int l_awake(lua_State *L) {
  rh_arena_awake(&check_arena(L, 1)->a);
  return 0;
}

/* arena:reduce(epoch, tensor, binop [, divisor]): the tensor becomes every
 * rank's data of the step combined in rank order (so the same bits on every
 * rank), divided by divisor when given (AVG) */
static int l_reduce(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  uint64_t e = (uint64_t)luaL_checknumber(L, 2);
  size_t len;
  rh_tensor_t *t = slot_tensor(L, b, 3, &len);
  int op = (int)luaL_checkinteger(L, 4);
  double divisor = luaL_optnumber(L, 5, 0);
  if (op < 0 || op >= RH_NBINOPS) return luaL_error(L, "arena:reduce: unknown op %d", op);
  if (rh_reduce_flat_check((rh_binop_t)op, t->dtype, divisor != 0))
    return luaL_error(L, "arena:reduce: %s", rh_tensor_errmsg());
  int64_t numel = rh_tensor_numel(t);
  uint8_t *out = rh_tensor_data(t);
  memcpy(out, rh_arena_data(&b->a, 0, e), len);
  /* (the kernels were checked above: these calls cannot fail) */
  for (uint32_t i = 1; i < b->a.n; i++)
    rh_binary_flat((rh_binop_t)op, t->dtype, numel, out, out, rh_arena_data(&b->a, i, e), 0);
  if (divisor != 0) {
    char d[8];
    rh_dtype_store(t->dtype, d, divisor);
    rh_binary_flat(RH_OP_DIV, t->dtype, numel, out, out, d, 1);
  }
  rh_tensor_bump_version(t);
  return 0;
}

/* arena:take(epoch, root, tensor): the tensor becomes the root's data of the step */
static int l_take(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  uint64_t e = (uint64_t)luaL_checknumber(L, 2);
  int root = (int)luaL_checkinteger(L, 3);
  size_t len;
  rh_tensor_t *t = slot_tensor(L, b, 4, &len);
  if (root < 0 || (uint32_t)root >= b->a.n) return luaL_error(L, "arena:take: no rank %d", root);
  memcpy(rh_tensor_data(t), rh_arena_data(&b->a, (uint32_t)root, e), len);
  rh_tensor_bump_version(t);
  return 0;
}

/* arena:close_fd(): the creator's descriptor, once every rank has its own */
static int l_close_fd(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  if (b->seg->fd >= 0) {
    close(b->seg->fd);
    b->seg->fd = -1;
  }
  return 0;
}

static int l_close(lua_State *L) {
  larena_t *b = luaL_checkudata(L, 1, ARENA_MT);
  if (b->seg) rh_shm_release(b->seg);
  b->seg = NULL;
  return 0;
}

static int l_slot(lua_State *L) {
  lua_pushinteger(L, check_arena(L, 1)->a.slot);
  return 1;
}

int rh_open_arena(lua_State *L) {
  static const luaL_Reg methods[] = {
      {"start", l_start}, {"spin", l_spin},         {"sleep", l_sleep}, {"awake", l_awake}, {"reduce", l_reduce},
      {"take", l_take},   {"close_fd", l_close_fd}, {"close", l_close}, {"slot", l_slot},   {NULL, NULL}};
  rh_lua_class(L, ARENA_MT, methods, l_close, NULL);
  static const luaL_Reg fns[] = {{"arena_create", l_create}, {"arena_attach", l_attach}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
