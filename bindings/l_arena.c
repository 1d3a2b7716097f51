/* l_arena.c: the same-host collective arena for Lua ("rpchost.Arena";
 * host/net/arena.h). The group's first rank makes the memory file; the others
 * take its descriptor out of that rank's process with pidfd_getfd (the same
 * permission as cross-memory attach, which ranks on one host already prove),
 * then check it is a sealed memory file of the inode they were told, and that
 * its header holds the group's random token, told only to the group's ranks
 * over their authenticated connections. So a process outside the world, or a
 * rank on another host (whose pid names something else here), gets no arena.
 *
 * A step is three parts, driven by lua/rpchost/net/arena.lua: start (copy in,
 * publish), spin / sleep until every rank is there, finish (reduce or copy
 * out). Its usual course, start and spin then finish, is two calls through the
 * FFI (rh_arena_ffi_step, rh_arena_ffi_reduce / _take); the methods below do
 * each part where that course does not apply, and say what is wrong. The
 * spin is bounded (the caller's budget, yielding the core while the host's
 * runnable tasks outnumber its cores: rh_net_polite), so the loop is never held for long: what
 * remains is a sleep in the loop, rung by the rank that completes the step. */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
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
  /* the fast path's (rh_arena_ffi_step) ranks to ring, and its last check
   * when that was not a wait: what ar:wakes() and ar:last() give Lua */
  uint8_t *wake;
  int rc, bad;
  rh_arena_sig_t other;
} larena_t;

static larena_t *check_arena(lua_State *L, int i) {
  larena_t *b = luaL_checkudata(L, i, ARENA_MT);
  if (!b->seg) luaL_error(L, "the collective arena is closed");
  return b;
}

static int push_new(lua_State *L, rh_shm_t *seg, uint32_t n, uint32_t me, uint32_t slot, const uint8_t *token) {
  larena_t *b = lua_newuserdata(L, sizeof *b);
  memset(b, 0, sizeof *b);
  luaL_getmetatable(L, ARENA_MT);
  lua_setmetatable(L, -2);
  if (rh_arena_open(&b->a, seg->map, seg->size, n, me, slot, token) != 0) {
    rh_shm_release(seg);
    lua_pushnil(L);
    lua_pushliteral(L, "the memory file is not this group's arena (wrong header, size or token)");
    return 2;
  }
  b->wake = calloc(n, 1);
  if (!b->wake) {
    rh_shm_release(seg);
    return luaL_error(L, "arena: out of memory");
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
static int spin(larena_t *b, uint64_t e, uint64_t ns, rh_arena_sig_t *o, int *bad) {
  uint64_t now = uv_hrtime(), until = now + ns;
  int yield = rh_net_polite(&rh_ctx()->net, now);
  int rc;
  /* (no pause instruction between looks: a look reads the peers' lines, which
   * stay in this core's cache until a peer writes them, so looking again costs
   * the bus nothing; a pause only delays seeing the write. Sixteen of them,
   * 24 ns each on this VM's AMD EPYC, put 0.4 us between looks, and a 2-rank
   * barrier took 0.86 us (median of 12 runs) against 0.54 without them. Under
   * a hypervisor, pause loops may also be taken for a spinning lock and the
   * vCPU descheduled. Where others want the core, it is yielded instead.) */
  for (;;) {
    rc = rh_arena_check(&b->a, e, o, bad);
    if (rc <= 0 || uv_hrtime() >= until) break;
    if (yield) sched_yield();
  }
  return rc;
}

static int l_spin(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  uint64_t e = (uint64_t)luaL_checknumber(L, 2);
  uint64_t ns = (uint64_t)luaL_checknumber(L, 3);
  rh_arena_sig_t o;
  int bad = -1;
  int rc = spin(b, e, ns, &o, &bad);
  return push_check(L, rc, &o, bad);
}

/* For the FFI functions: the tensor in a tensor userdata's block (see
 * rh_lua_boxed_tensor) when it is one span of host memory that fits a slot,
 * else NULL (Lua then takes the lua_CFunction, which says what is wrong). */
static rh_tensor_t *ffi_span(larena_t *b, void *box, size_t *len) {
  rh_tensor_t *t = rh_lua_boxed_tensor(box);
  if (!t || rh_tensor_device(t) >= 0 || !rh_tensor_is_contiguous(t)) return NULL;
  *len = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
  return *len <= b->a.slot ? t : NULL;
}

/* The fast path of a step, for LuaJIT's FFI (lua/rpchost/net/arena.lua): a
 * call through the Lua C API ends the compiler's trace, and what follows it in
 * a nested function then runs interpreted (the JIT cannot return to a lower
 * frame from the trace it starts after the call), which cost a small
 * collective more than its shared-memory work. What rpchost queued leaves
 * first (a peer may need it to reach this step), the tensor's bytes (when
 * tensor is not NULL) go into this rank's slot, the step is published, and then, unless a
 * peer sleeps and must be rung first, every rank is polled for up to spin_ns.
 * arena: the arena userdata (its block, as the FFI passes a userdata to a
 * void *), only ever this file's; *epoch: the step's number. Returns what
 * arena:spin would (0 done; index + 1 of a rank not there), or
 * RH_ARENA_FFI_WAKE (ar:wakes() lists the ranks to ring; nothing polled),
 * RH_ARENA_FFI_OTHER (ar:last() says what the check found),
 * RH_ARENA_FFI_CLOSED, RH_ARENA_FFI_TENSOR (not a span of host memory that
 * fits a slot: nothing done). */
#define RH_ARENA_FFI_WAKE (-1)
#define RH_ARENA_FFI_OTHER (-2)
#define RH_ARENA_FFI_CLOSED (-3)
#define RH_ARENA_FFI_TENSOR (-4)
int rh_arena_ffi_step(void *arena, uint32_t kind, uint32_t dtype, uint32_t redop, uint32_t root, double numel,
                      void *tensor, uint64_t spin_ns, double *epoch);
int rh_arena_ffi_step(void *arena, uint32_t kind, uint32_t dtype, uint32_t redop, uint32_t root, double numel,
                      void *tensor, uint64_t spin_ns, double *epoch) {
  larena_t *b = arena;
  if (!b->seg) return RH_ARENA_FFI_CLOSED;
  size_t len = 0;
  const rh_tensor_t *t = tensor ? ffi_span(b, tensor, &len) : NULL;
  if (tensor && !t) return RH_ARENA_FFI_TENSOR;
  rh_net_flush_now(&rh_ctx()->net);
  if (t) memcpy(rh_arena_my_data(&b->a, b->a.epoch + 1), rh_tensor_data(t), len);
  rh_arena_sig_t s = {kind, dtype, redop, root, (uint64_t)numel};
  uint64_t e = rh_arena_publish(&b->a, &s, b->wake);
  *epoch = (double)e;
  for (uint32_t i = 0; i < b->a.n; i++)
    if (b->wake[i]) return RH_ARENA_FFI_WAKE;
  b->bad = -1;
  int rc = spin(b, e, spin_ns, &b->other, &b->bad);
  if (rc < 0) {
    b->rc = rc;
    return RH_ARENA_FFI_OTHER;
  }
  return rc;
}

/* arena:wakes() -> the ranks the fast path's step left to ring, or nil */
static int l_wakes(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  push_wakes(L, b, b->wake);
  memset(b->wake, 0, b->a.n);
  return 1;
}

/* arena:last() -> as push_check, what the fast path's last check found */
static int l_last(lua_State *L) {
  larena_t *b = check_arena(L, 1);
  return push_check(L, b->rc, &b->other, b->bad);
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
/* t (len bytes, a slot's span) becomes every rank's data of step e combined
 * in rank order, then divided by divisor when not 0; op and dtype checked */
static void reduce(larena_t *b, uint64_t e, rh_tensor_t *t, size_t len, int op, double divisor) {
  int64_t numel = rh_tensor_numel(t);
  uint8_t *out = rh_tensor_data(t);
  memcpy(out, rh_arena_data(&b->a, 0, e), len);
  /* (the kernels were checked by the caller: these calls cannot fail) */
  for (uint32_t i = 1; i < b->a.n; i++)
    rh_binary_flat((rh_binop_t)op, t->dtype, numel, out, out, rh_arena_data(&b->a, i, e), 0);
  if (divisor != 0) {
    char d[8];
    rh_dtype_store(t->dtype, d, divisor);
    rh_binary_flat(RH_OP_DIV, t->dtype, numel, out, out, d, 1);
  }
  rh_tensor_bump_version(t);
}

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
  reduce(b, e, t, len, op, divisor);
  return 0;
}

/* arena:reduce for the FFI (see rh_arena_ffi_step): 0, or -1 when the tensor
 * or op is not one it takes (nothing done: Lua takes arena:reduce, which says
 * what is wrong) */
int rh_arena_ffi_reduce(void *arena, double epoch, void *tensor, int op, double divisor);
int rh_arena_ffi_reduce(void *arena, double epoch, void *tensor, int op, double divisor) {
  larena_t *b = arena;
  size_t len;
  rh_tensor_t *t = b->seg ? ffi_span(b, tensor, &len) : NULL;
  if (!t || op < 0 || op >= RH_NBINOPS || rh_reduce_flat_check((rh_binop_t)op, t->dtype, divisor != 0)) return -1;
  reduce(b, (uint64_t)epoch, t, len, op, divisor);
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

/* arena:take for the FFI (see rh_arena_ffi_reduce): 0, or -1 (nothing done) */
int rh_arena_ffi_take(void *arena, double epoch, int root, void *tensor);
int rh_arena_ffi_take(void *arena, double epoch, int root, void *tensor) {
  larena_t *b = arena;
  size_t len;
  rh_tensor_t *t = b->seg ? ffi_span(b, tensor, &len) : NULL;
  if (!t || root < 0 || (uint32_t)root >= b->a.n) return -1;
  memcpy(rh_tensor_data(t), rh_arena_data(&b->a, (uint32_t)root, (uint64_t)epoch), len);
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
  free(b->wake);
  b->wake = NULL;
  return 0;
}

static int l_slot(lua_State *L) {
  lua_pushinteger(L, check_arena(L, 1)->a.slot);
  return 1;
}

int rh_open_arena(lua_State *L) {
  static const luaL_Reg methods[] = {{"start", l_start},       {"spin", l_spin},     {"sleep", l_sleep},
                                     {"awake", l_awake},       {"reduce", l_reduce}, {"take", l_take},
                                     {"close_fd", l_close_fd}, {"close", l_close},   {"slot", l_slot},
                                     {"wakes", l_wakes},       {"last", l_last},     {NULL, NULL}};
  rh_lua_class(L, ARENA_MT, methods, l_close, NULL);
  static const luaL_Reg fns[] = {{"arena_create", l_create}, {"arena_attach", l_attach}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
