/* l_proc.c: child processes, their output pipes, and signal watchers for Lua.
 * The launcher (lua/rpchost/tools/launcher.lua) is built on these.
 *
 * A process box stays anchored until the child has exited and each of its pipes
 * has reached EOF (or DRAIN_MS have passed since the exit); then the exit
 * handler runs once with the status. Output is
 * handed to Lua in chunks as it arrives (the launcher splits lines). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#include <sys/stat.h>
#endif

#include "proc/memcpy_tune.h"
#include "rh_lua.h"

#define PROC_MT "rpchost.Process"
#define SIGNAL_MT "rpchost.Signal"

typedef struct proc_s proc_t;

typedef struct {
  uv_pipe_t pipe;
  proc_t *p;
  int fd; /* 1 or 2 */
  int open;
} out_pipe_t;

struct proc_s {
  uv_process_t proc;
  out_pipe_t out[2];
  int ref_self, ref_exit, ref_output;
  int exited, pending_handles;
  int64_t status;
  int term_signal;
  int pid;
  uv_timer_t drain; /* after the exit: how long its pipes may stay open */
};

/* A child that exited may have left its pipes to a process of its own (a
 * command started with `&`): its output is read for this long after the exit,
 * then the exit is reported anyway, so a launcher does not wait on a grandchild. */
#define DRAIN_MS 200

typedef struct {
  proc_t *p;
} lproc_t;

static void proc_maybe_done(proc_t *p);

static void handle_closed(uv_handle_t *h) {
  proc_t *p = h->data;
  p->pending_handles--;
  proc_maybe_done(p);
}

static void proc_maybe_done(proc_t *p) {
  if (!p->exited || p->out[0].open || p->out[1].open) return;
  lua_State *L = rh_ctx()->L;
  if (p->ref_exit != LUA_NOREF) {
    int ref = p->ref_exit;
    p->ref_exit = LUA_NOREF;
    rh_pushref(L, ref);
    luaL_unref(L, LUA_REGISTRYINDEX, ref);
    lua_pushinteger(L, (lua_Integer)p->status);
    lua_pushinteger(L, p->term_signal);
    rh_callback(2, 0);
  }
  if (p->pending_handles == 0) {
    rh_unref(L, &p->ref_output);
    if (p->ref_self != LUA_NOREF) {
      /* The box forgets us; free after the last handle closed. */
      rh_pushref(L, p->ref_self);
      lproc_t *b = lua_touserdata(L, -1);
      if (b) b->p = NULL;
      lua_pop(L, 1);
      rh_unref(L, &p->ref_self);
    }
    free(p);
  }
}

static void drain_cb(uv_timer_t *t);

static void exit_cb(uv_process_t *h, int64_t status, int term_signal) {
  proc_t *p = h->data;
  p->exited = 1;
  p->status = status;
  p->term_signal = term_signal;
  if (p->out[0].open || p->out[1].open) {
    uv_timer_init(h->loop, &p->drain);
    p->drain.data = p;
    p->pending_handles++;
    uv_timer_start(&p->drain, drain_cb, DRAIN_MS, 0);
  }
  uv_close((uv_handle_t *)h, handle_closed);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  buf->base = malloc(suggested);
  buf->len = buf->base ? suggested : 0;
}

/* The pipe's end: the output handler hears it (nil), then the handle closes. */
static void close_pipe(out_pipe_t *op) {
  proc_t *p = op->p;
  lua_State *L = rh_ctx()->L;
  op->open = 0;
  if (p->ref_output != LUA_NOREF) {
    rh_pushref(L, p->ref_output);
    lua_pushinteger(L, op->fd);
    lua_pushnil(L);
    rh_callback(2, 0);
  }
  op->pipe.data = p;
  uv_close((uv_handle_t *)&op->pipe, handle_closed);
}

static void read_cb(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  out_pipe_t *op = s->data;
  proc_t *p = op->p;
  lua_State *L = rh_ctx()->L;
  if (n > 0 && p->ref_output != LUA_NOREF) {
    rh_pushref(L, p->ref_output);
    lua_pushinteger(L, op->fd);
    lua_pushlstring(L, buf->base, (size_t)n);
    rh_callback(2, 0);
  }
  free(buf->base);
  if (n < 0) {
    close_pipe(op);
    proc_maybe_done(p);
  }
}

static void drain_cb(uv_timer_t *t) {
  proc_t *p = t->data;
  for (int i = 0; i < 2; i++)
    if (p->out[i].open) close_pipe(&p->out[i]);
  uv_close((uv_handle_t *)t, handle_closed);
  proc_maybe_done(p);
}

static int string_list(lua_State *L, int t, char ***out) {
  int n = (int)lua_objlen(L, t);
  char **v = calloc((size_t)n + 1, sizeof *v);
  if (!v) return -1;
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, t, i + 1);
    v[i] = (char *)lua_tostring(L, -1); /* the table keeps the string alive */
    lua_pop(L, 1);
  }
  *out = v;
  return n;
}

/* spawn{file=, args={...}, env={"K=V",...}, cwd=, stdio={"inherit"|"pipe"|"ignore" x3},
 *       exit=fn(status, signal), output=fn(fd, chunk|nil)} -> proc | nil, message */
static int l_spawn(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_getfield(L, 1, "file");
  const char *file = luaL_checkstring(L, -1);
  lua_getfield(L, 1, "args");
  luaL_checktype(L, -1, LUA_TTABLE);
  char **args = NULL, **env = NULL;
  string_list(L, lua_gettop(L), &args);
  lua_getfield(L, 1, "env");
  if (lua_istable(L, -1)) string_list(L, lua_gettop(L), &env);
  lua_getfield(L, 1, "cwd");
  const char *cwd = lua_tostring(L, -1);

  proc_t *p = calloc(1, sizeof *p);
  p->ref_self = p->ref_exit = p->ref_output = LUA_NOREF;
  uv_stdio_container_t stdio[3];
  memset(stdio, 0, sizeof stdio);
  stdio[0].flags = UV_INHERIT_FD;
  stdio[0].data.fd = 0;
  lua_getfield(L, 1, "stdio");
  for (int fd = 1; fd <= 2; fd++) {
    const char *mode = "inherit";
    if (lua_istable(L, -1)) {
      lua_rawgeti(L, -1, fd + 1);
      if (lua_isstring(L, -1)) mode = lua_tostring(L, -1);
      lua_pop(L, 1);
    }
    out_pipe_t *op = &p->out[fd - 1];
    op->p = p;
    op->fd = fd;
    if (strcmp(mode, "pipe") == 0) {
      uv_pipe_init(rh_ctx()->loop, &op->pipe, 0);
      op->pipe.data = op;
      op->open = 1;
      p->pending_handles++;
      stdio[fd].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
      stdio[fd].data.stream = (uv_stream_t *)&op->pipe;
    } else if (strcmp(mode, "ignore") == 0) {
      stdio[fd].flags = UV_IGNORE;
    } else {
      stdio[fd].flags = UV_INHERIT_FD;
      stdio[fd].data.fd = fd;
    }
  }
  uv_process_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.file = file;
  opts.args = args;
  opts.env = env;
  opts.cwd = cwd;
  opts.stdio_count = 3;
  opts.stdio = stdio;
  opts.exit_cb = exit_cb;
  p->proc.data = p;
  p->pending_handles++;
  int rc = uv_spawn(rh_ctx()->loop, &p->proc, &opts);
  free(args);
  free(env);
  if (rc) {
    /* uv_spawn leaves the process handle initialised: close everything. */
    p->exited = 1;
    p->status = -1;
    uv_close((uv_handle_t *)&p->proc, handle_closed);
    for (int i = 0; i < 2; i++)
      if (p->out[i].open) {
        p->out[i].open = 0;
        p->out[i].pipe.data = p;
        uv_close((uv_handle_t *)&p->out[i].pipe, handle_closed);
      }
    lua_pushnil(L);
    lua_pushfstring(L, "cannot start %s: %s", file, uv_strerror(rc));
    return 2;
  }
  p->pid = p->proc.pid;
  for (int i = 0; i < 2; i++)
    if (p->out[i].open) uv_read_start((uv_stream_t *)&p->out[i].pipe, alloc_cb, read_cb);
  lua_getfield(L, 1, "exit");
  p->ref_exit = lua_isfunction(L, -1) ? luaL_ref(L, LUA_REGISTRYINDEX) : (lua_pop(L, 1), LUA_NOREF);
  lua_getfield(L, 1, "output");
  p->ref_output = lua_isfunction(L, -1) ? luaL_ref(L, LUA_REGISTRYINDEX) : (lua_pop(L, 1), LUA_NOREF);
  lproc_t *b = lua_newuserdata(L, sizeof *b);
  b->p = p;
  luaL_getmetatable(L, PROC_MT);
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  p->ref_self = luaL_ref(L, LUA_REGISTRYINDEX);
  return 1;
}

static int l_proc_pid(lua_State *L) {
  lproc_t *b = luaL_checkudata(L, 1, PROC_MT);
  if (!b->p) return 0;
  lua_pushinteger(L, b->p->pid);
  return 1;
}

/* kill(pid, signum) -> true | nil, message */
static int l_kill(lua_State *L) {
  int pid = (int)luaL_checkinteger(L, 1);
  int sig = (int)luaL_checkinteger(L, 2);
  return rh_lua_push_rc(L, uv_kill(pid, sig));
}

/* die_with_parent(pid) -> true | nil, why: this process gets SIGTERM when its
 * parent (the launcher, pid) dies, even by SIGKILL; if the parent is already
 * gone, it is sent at once. Linux only. */
static int l_die_with_parent(lua_State *L) {
  pid_t want = (pid_t)luaL_checkinteger(L, 1);
#ifdef __linux__
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
    lua_pushnil(L);
    lua_pushstring(L, strerror(errno));
    return 2;
  }
  /* (the parent may have died before the call: then nobody would signal us) */
  if (getppid() != want) kill(getpid(), SIGTERM);
  lua_pushboolean(L, 1);
  return 1;
#else
  (void)want;
  lua_pushnil(L);
  lua_pushliteral(L, "not supported on this system");
  return 2;
#endif
}

/* ---- signals ---- */

typedef struct {
  uv_signal_t sig;
  int ref_fn;
  int fallback;
  int signum;
} lsignal_t;

/* Watchers that are not fallbacks, per signal: a fallback (rpchost's own "clean
 * up and exit" for a script) stands aside while a script watches the signal. */
#define NSIG_COUNTED 65
static int own_watchers[NSIG_COUNTED];

static void signal_closed(uv_handle_t *h) { free(h->data); }

static void signal_cb(uv_signal_t *h, int signum) {
  lsignal_t *s = h->data;
  if (s->fallback && signum < NSIG_COUNTED && own_watchers[signum] > 0) return;
  lua_State *L = rh_ctx()->L;
  rh_pushref(L, s->ref_fn);
  lua_pushinteger(L, signum);
  rh_callback(1, 0);
}

typedef struct {
  lsignal_t *s;
} lsigbox_t;

/* signal(signum, fn [, fallback]) -> watcher with :close(). Does not keep the
 * loop alive. A fallback watcher's fn runs only while no other watcher of the
 * signal is open. */
static int l_signal(lua_State *L) {
  int signum = (int)luaL_checkinteger(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  int fallback = lua_toboolean(L, 3);
  if (signum <= 0 || signum >= NSIG_COUNTED) return luaL_error(L, "signal: %d is not a signal number", signum);
  lsignal_t *s = calloc(1, sizeof *s);
  if (!s) return luaL_error(L, "out of memory");
  s->fallback = fallback;
  s->signum = signum;
  if (!fallback) own_watchers[signum]++;
  uv_signal_init(rh_ctx()->loop, &s->sig);
  s->sig.data = s;
  lua_pushvalue(L, 2);
  s->ref_fn = luaL_ref(L, LUA_REGISTRYINDEX);
  uv_signal_start(&s->sig, signal_cb, signum);
  uv_unref((uv_handle_t *)&s->sig);
  lsigbox_t *b = lua_newuserdata(L, sizeof *b);
  b->s = s;
  luaL_getmetatable(L, SIGNAL_MT);
  lua_setmetatable(L, -2);
  return 1;
}

static int l_signal_close(lua_State *L) {
  lsigbox_t *b = luaL_checkudata(L, 1, SIGNAL_MT);
  if (!b->s) return 0;
  if (!b->s->fallback) own_watchers[b->s->signum]--;
  rh_unref(L, &b->s->ref_fn);
  uv_close((uv_handle_t *)&b->s->sig, signal_closed);
  b->s = NULL;
  return 0;
}

/* file_stamp(path) -> "size:inode:mtime" of a regular file, or nil: what the
 * bytecode cache compares instead of hashing every source at every start */
static int l_file_stamp(lua_State *L) {
  struct stat st;
  if (stat(luaL_checkstring(L, 1), &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  char buf[96];
  snprintf(buf, sizeof buf, "%lld:%llu:%lld.%09ld", (long long)st.st_size, (unsigned long long)st.st_ino,
           (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec);
  lua_pushstring(L, buf);
  return 1;
}

/* memcpy_tune() -> "tuned" | "not needed" | "off" | "failed": whether this
 * process runs with glibc's copies tuned for this CPU (host/proc/memcpy_tune.h) */
static int l_memcpy_tune(lua_State *L) {
  static const char *const names[] = {"not needed", "tuned", "off", "failed"};
  lua_pushstring(L, names[rh_memcpy_state()]);
  return 1;
}

int rh_open_proc(lua_State *L) {
  static const luaL_Reg proc_methods[] = {{"pid", l_proc_pid}, {NULL, NULL}};
  static const luaL_Reg signal_methods[] = {{"close", l_signal_close}, {NULL, NULL}};
  rh_lua_class(L, PROC_MT, proc_methods, NULL, NULL);
  rh_lua_class(L, SIGNAL_MT, signal_methods, NULL, NULL);

  static const luaL_Reg fns[] = {{"spawn", l_spawn},
                                 {"kill", l_kill},
                                 {"signal", l_signal},
                                 {"die_with_parent", l_die_with_parent},
                                 {"file_stamp", l_file_stamp},
                                 {"memcpy_tune", l_memcpy_tune},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  static const struct {
    const char *name;
    int num;
  } sigs[] = {{"SIGINT", SIGINT},   {"SIGTERM", SIGTERM}, {"SIGKILL", SIGKILL},
              {"SIGSTOP", SIGSTOP}, {"SIGCONT", SIGCONT}, {"SIGHUP", SIGHUP}};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
    lua_pushinteger(L, sigs[i].num);
    lua_setfield(L, -2, sigs[i].name);
  }
  return 1;
}
