/* l_loop.c: the event loop as the Lua scheduler sees it: run one turn, read the
 * clock, and one timer armed for the earliest deadline (the scheduler in
 * lua/rpchost/sched.lua keeps the deadline heap; C keeps only this one timer). */
#include <time.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "rh_lua.h"

/* run([mode]) -> whether the loop is alive: one turn ("once", the default,
 * blocks until something happens; "nowait" does not block; "spin" is
 * "nowait" for the scheduler while it polls the same-host rings itself,
 * rh_net_ring_turn, between such turns: the turn leaves the rings to that
 * poll, where what a frame makes ready may run at once) or "default" */
static int l_run(lua_State *L) {
  const char *mode = luaL_optstring(L, 1, "once");
  uv_run_mode m = UV_RUN_ONCE;
  if (mode[0] == 'n' || mode[0] == 's') m = UV_RUN_NOWAIT;
  else if (mode[0] == 'd') m = UV_RUN_DEFAULT;
  /* (a task the scheduler started inside its poll of the rings runs within a
   * frame's callback: a turn of the loop there would read the same rings again
   * under the frame being handed out, and could free its connection) */
  if (rh_ctx()->net.in_ring_turn)
    return luaL_error(L,
                      "the event loop cannot run inside the rings' poll (a task started by a frame's callback, "
                      "rpchost.sched.frame_done): wait with the scheduler's calls instead");
  rh_ctx()->net.loop_turn_at = uv_hrtime();
  rh_ctx()->net.sched_polls = mode[0] == 's';
  int alive = uv_run(rh_ctx()->loop, m);
  lua_pushboolean(L, alive);
  return 1;
}

/* ring_turn() -> 1 when frames came through the rings (their callbacks ran),
 * -1 when a turn of the loop is due instead (host/net/conn.h) */
static int l_ring_turn(lua_State *L) {
  lua_pushinteger(L, rh_net_ring_turn(&rh_ctx()->net));
  return 1;
}

/* set_spin_window(seconds): how long the rings are polled after their last
 * traffic (host/net/conn_ring.c), as the scheduler's window changes
 * (rpchost.spin_window learns it from the answers) */
static int l_set_spin_window(lua_State *L) {
  double s = luaL_checknumber(L, 1);
  rh_ctx()->net.ring_spin_ns = s > 0 ? (uint64_t)(s * 1e9) : 0;
  return 0;
}

/* wake_ahead(at, spin) -> "timer" | "polling" | "past" | nil, why: the loop
 * polls the rings for spin seconds from the instant at (seconds on now()'s
 * clock), a timer waking it then ("timer"), or, where at has come, from now on
 * ("polling"; "past" where at + spin has come too); why is "busy" where others
 * want the cores. wake_ahead() ->
 * whether the timer was still armed, disarming it (host/net/wake_ahead.c).
 * ahead_late() -> how late, in seconds, the last firing woke the loop. */
static int l_wake_ahead(lua_State *L) {
  rh_net_t *net = &rh_ctx()->net;
  int rc;
  if (lua_isnoneornil(L, 1)) {
    int armed = net->ahead_at != 0;
    rh_net_wake_ahead(net, 0, 0);
    lua_pushboolean(L, armed);
    return 1;
  } else {
    double at = luaL_checknumber(L, 1), spin = luaL_checknumber(L, 2);
    rc = at > 0 && spin >= 0 ? rh_net_wake_ahead(net, (uint64_t)(at * 1e9), (uint64_t)(spin * 1e9)) : -EINVAL;
  }
  if (rc < 0) {
    lua_pushnil(L);
    /* ("busy": others want the cores, as rh_net_polite counts it) */
    lua_pushstring(L, rc == -EAGAIN ? "busy" : rh_strerror(rc));
    return 2;
  }
  lua_pushstring(L, rc == 0 ? "timer" : rc == 1 ? "polling" : "past");
  return 1;
}

static int l_ahead_late(lua_State *L) {
  lua_pushnumber(L, (double)rh_ctx()->net.ahead_late / 1e9);
  return 1;
}

/* yield_cpu(): gives the core to another runnable process (sched_yield): a
 * rank that polls with nothing to do steps aside for the rank it waits for,
 * which may share its core (when it may: rh_net_polite) */
static int l_yield_cpu(lua_State *L) {
  (void)L;
  rh_net_t *net = &rh_ctx()->net;
  /* (once per turn: the rings' poll may have stepped aside in this turn already) */
  if (net->ring_yielded) net->ring_yielded = 0;
  else if (rh_net_polite(net, uv_hrtime())) sched_yield();
  return 0;
}

/* stop(): the loop's current (or next) uv_run returns at the end of its turn
 * without blocking for I/O (uv_stop). The scheduler calls it when a callback
 * makes a task runnable: a callback run before the poll phase (a timer already
 * due when the turn began, a prepare hook) would otherwise be followed by a
 * blocking poll, and the woken task would wait for unrelated I/O or the next
 * deadline. */
static int l_stop(lua_State *L) {
  (void)L;
  uv_stop(rh_ctx()->loop);
  return 0;
}

/* Through the FFI (rpchost.sched.frame_done asks it for every frame the
 * scheduler's poll hands out): whether more frames came in the same look at
 * the rings, rh_net_rings_buffered. */
int rh_rings_buffered(void) { return rh_net_rings_buffered(&rh_ctx()->net); }

double rh_clock_coarse(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0) return (double)uv_hrtime() / 1e9;
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double rh_clock_wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int l_now(lua_State *L) {
  lua_pushnumber(L, (double)uv_hrtime() / 1e9);
  return 1;
}

static void deadline_cb(uv_timer_t *t) {
  (void)t;
  lua_State *L = rh_ctx()->L;
  rh_pushref(L, rh_ctx()->deadline_ref);
  rh_callback(0, 0);
}

/* timer_set(seconds, fn): (re)arm the scheduler's timer. */
static int l_timer_set(lua_State *L) {
  double s = luaL_checknumber(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  rh_ctx_t *ctx = rh_ctx();
  if (!ctx->timer_ready) {
    uv_timer_init(ctx->loop, &ctx->deadline_timer);
    ctx->deadline_ref = LUA_NOREF;
    ctx->timer_ready = 1;
  }
  rh_unref(L, &ctx->deadline_ref);
  lua_pushvalue(L, 2);
  ctx->deadline_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  /* (NaN fires now; a deadline past ~285 000 years, math.huge included, is
   * clamped: converting a double too big for uint64_t is undefined) */
  uint64_t ms = !(s > 0) ? 0 : s >= 9e12 ? (uint64_t)9e15 : (uint64_t)(s * 1000.0 + 0.999);
  uv_timer_start(&ctx->deadline_timer, deadline_cb, ms, 0);
  return 0;
}

static int l_timer_stop(lua_State *L) {
  (void)L;
  if (rh_ctx()->timer_ready) uv_timer_stop(&rh_ctx()->deadline_timer);
  return 0;
}

/* core.flush(): queued frames out now, from a task. A connection that fails
 * meanwhile reports its end from the loop, not inside this call. */
static int l_flush(lua_State *L) {
  (void)L;
  rh_net_flush_now(&rh_ctx()->net);
  return 0;
}

static int l_sleep_ms(lua_State *L) {
  uv_sleep((unsigned)luaL_checkinteger(L, 1));
  return 0;
}

static int l_net_busy(lua_State *L) {
  lua_pushinteger(L, rh_net_busy(&rh_ctx()->net));
  return 1;
}

static int l_net_stats(lua_State *L) {
  lua_createtable(L, 0, 2);
  lua_pushnumber(L, (double)rh_ctx()->net.bytes_in);
  lua_setfield(L, -2, "bytes_in");
  lua_pushnumber(L, (double)rh_ctx()->net.bytes_out);
  lua_setfield(L, -2, "bytes_out");
  lua_pushnumber(L, (double)rh_ctx()->net.writes);
  lua_setfield(L, -2, "writes");
  /* the largest frame sent or accepted (RPCHOST_MAX_FRAME), and what a frame
   * adds to its body and segments: its header, and 8 bytes per segment */
  lua_pushnumber(L, (double)rh_ctx()->net.max_frame);
  lua_setfield(L, -2, "max_frame");
  lua_pushnumber(L, (double)RH_FRAME_HDR);
  lua_setfield(L, -2, "frame_header");
  /* seconds after which a TCP peer whose host acknowledges nothing is gone
   * (RPCHOST_HEARTBEAT; 0: the kernel's defaults) */
  lua_pushinteger(L, (lua_Integer)rh_ctx()->net.liveness_s);
  lua_setfield(L, -2, "liveness_s");
  return 1;
}

static int l_exepath(lua_State *L) {
  char buf[4096];
  size_t n = sizeof buf;
  if (uv_exepath(buf, &n) != 0) return 0;
  lua_pushlstring(L, buf, n);
  return 1;
}

static int l_getpid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

static int l_hostname(lua_State *L) {
  char buf[256];
  size_t n = sizeof buf;
  if (uv_os_gethostname(buf, &n) != 0) return 0;
  lua_pushlstring(L, buf, n);
  return 1;
}

static int l_setenv(lua_State *L) {
  const char *k = luaL_checkstring(L, 1);
  if (lua_isnoneornil(L, 2)) unsetenv(k);
  else setenv(k, luaL_checkstring(L, 2), 1);
  return 0;
}

static int l_environ(lua_State *L) {
  uv_env_item_t *items;
  int n;
  if (uv_os_environ(&items, &n) != 0) return 0;
  lua_createtable(L, 0, n);
  for (int i = 0; i < n; i++) {
    lua_pushstring(L, items[i].value);
    lua_setfield(L, -2, items[i].name);
  }
  uv_os_free_environ(items, n);
  return 1;
}

/* Peak resident set size in KiB (for benchmarks and memory checks). */
static int l_maxrss(lua_State *L) {
  uv_rusage_t ru;
  if (uv_getrusage(&ru) != 0) return 0;
  lua_pushnumber(L, (double)ru.ru_maxrss);
  return 1;
}

/* mkdtemp(template ending in XXXXXX) -> path | nil, message */
static int l_mkdtemp(lua_State *L) {
  uv_fs_t req;
  int rc = uv_fs_mkdtemp(rh_ctx()->loop, &req, luaL_checkstring(L, 1), NULL);
  if (rc < 0) {
    uv_fs_req_cleanup(&req);
    lua_pushnil(L);
    lua_pushstring(L, uv_strerror(rc));
    return 2;
  }
  lua_pushstring(L, req.path);
  uv_fs_req_cleanup(&req);
  return 1;
}

static int l_rmdir(lua_State *L) {
  uv_fs_t req;
  int rc = uv_fs_rmdir(rh_ctx()->loop, &req, luaL_checkstring(L, 1), NULL);
  uv_fs_req_cleanup(&req);
  lua_pushboolean(L, rc == 0);
  return 1;
}

static int l_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)));
  return 1;
}

int rh_open_loop(lua_State *L) {
  static const luaL_Reg fns[] = {{"run", l_run},
                                 {"stop", l_stop},
                                 {"now", l_now},
                                 {"timer_set", l_timer_set},
                                 {"timer_stop", l_timer_stop},
                                 {"flush", l_flush},
                                 {"net_stats", l_net_stats},
                                 {"net_busy", l_net_busy},
                                 {"sleep_ms", l_sleep_ms},
                                 {"yield_cpu", l_yield_cpu},
                                 {"ring_turn", l_ring_turn},
                                 {"set_spin_window", l_set_spin_window},
                                 {"wake_ahead", l_wake_ahead},
                                 {"ahead_late", l_ahead_late},
                                 {"exepath", l_exepath},
                                 {"getpid", l_getpid},
                                 {"hostname", l_hostname},
                                 {"setenv", l_setenv},
                                 {"environ", l_environ},
                                 {"maxrss", l_maxrss},
                                 {"isatty", l_isatty},
                                 {"mkdtemp", l_mkdtemp},
                                 {"rmdir", l_rmdir},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
