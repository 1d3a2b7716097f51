/* l_main.c: the rpchost executable's entry point. main raises the descriptor
 * limit, creates the one Lua state and the per-process context, finds the Lua
 * library, and hands the command line to lua/rpchost/tools/cli.lua, which
 * implements the interpreter front end, the launcher and the REPL. It lives with
 * the bindings because it starts the Lua state: host/ calls nothing up here. */
#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "proc/memcpy_tune.h"
#include "rh_lua.h"
#include "tensor/tensor.h"

int rh_callback(int nargs, int nresults) {
  lua_State *L = rh_ctx()->L;
  int base = lua_gettop(L) - nargs;
  rh_pushref(L, rh_ctx()->ref_traceback);
  lua_insert(L, base);
  int rc = lua_pcall(L, nargs, nresults, base);
  lua_remove(L, base);
  if (rc != 0) {
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, "rpchost: internal error in a callback: %s\n", msg ? msg : "(non-string error)");
    lua_pop(L, 1);
  }
  return rc;
}

/* How a rank that polls with nothing to do treats its core (host/net/conn.h,
 * conn_ring.c): RPCHOST_SPIN_YIELD=1 gives it away every empty turn, 0 only
 * while other processes switch this one out; unset or not a number (auto),
 * also while the machine has more runnable tasks than online CPUs
 * (/proc/loadavg counts the whole machine, whatever this rank's affinity).
 * Where that count cannot be read, whether this host's ranks (LOCAL_WORLD_SIZE
 * from `rpchost run`, Open MPI's local size under mpirun) may outnumber the
 * CPUs this rank may use decides. */
static void spin_policy(rh_net_t *net) {
  const char *y = getenv("RPCHOST_SPIN_YIELD");
  int cpus = rh_host_cpus(), local = rh_local_ranks();
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  net->host_cpus = online > 0 ? (int)online : cpus;
  net->ring_crowded = !local || local > cpus;
  int number = y && *y >= '0' && *y <= '9';
  net->ring_auto = !number;
  net->ring_yield = number && atoi(y) != 0;
}

/* Incoming frame segments are read straight into tensor storages. */
static void *seg_alloc(void *ctx, uint64_t len, uint8_t **data) {
  (void)ctx;
  /* every byte is about to be read into: no need to zero it */
  rh_storage_t *s = rh_storage_new_uninit((size_t)len);
  if (!s) return NULL;
  *data = s->data;
  return s;
}

static void seg_free(void *ctx, void *owner) {
  (void)ctx;
  rh_storage_release(owner);
}

static int file_exists(const char *p) {
  struct stat st;
  return stat(p, &st) == 0;
}

/* The Lua library: $RPCHOST_LUA_DIR, else <exe>/../<datadir>/rpchost/lua (installed,
 * relocatable), else the source tree this binary was built from. */
static void find_lua_dir(char *out, size_t outlen) {
  out[0] = 0;
  const char *env = getenv("RPCHOST_LUA_DIR");
  if (env && *env) {
    snprintf(out, outlen, "%s", env);
    return;
  }
  char exe[4096];
  size_t n = sizeof exe;
  if (uv_exepath(exe, &n) == 0) {
    char *slash = strrchr(exe, '/');
    if (slash) {
      *slash = 0;
      char probe[8192];
      snprintf(probe, sizeof probe, "%s/../%s/rpc.lua", exe, RPCHOST_INSTALL_LUA_REL);
      if (file_exists(probe)) {
        /* the probe path minus "/rpc.lua" */
        probe[strlen(probe) - strlen("/rpc.lua")] = 0;
        snprintf(out, outlen, "%.*s", (int)(outlen - 1), probe);
        return;
      }
    }
  }
  snprintf(out, outlen, "%s", RPCHOST_SOURCE_LUA_DIR);
}

/* core.parallel_hint(local_ranks, cpus_per_rank): what rpchost.env read from a
 * launcher whose variables C does not know (a Slurm step): the tensor pool's
 * size (if it has not started) and the rings' spin policy follow it. */
static int l_parallel_hint(lua_State *L) {
  rh_parallel_hint((int)luaL_optinteger(L, 1, 0), (int)luaL_optinteger(L, 2, 0));
  spin_policy(&rh_ctx()->net);
  return 0;
}

/* core.parallel_threads(): the threads a large elementwise job runs on (the
 * pool starts here if it has not) */
static int l_parallel_threads(lua_State *L) {
  lua_pushinteger(L, rh_parallel_threads());
  return 1;
}

static int open_core(lua_State *L) {
  lua_newtable(L);
  int (*openers[])(lua_State *) = {rh_open_loop,        rh_open_conn,  rh_open_proc, rh_open_codec,  rh_open_tensor,
                                   rh_open_tensor_ops,  rh_open_nn,    rh_open_cuda, rh_open_crypto, rh_open_repl,
                                   rh_open_shm,         rh_open_cma,   rh_open_mpi,  rh_open_arena,  rh_open_generator,
                                   rh_open_atomic_file, rh_open_munge, rh_open_body};
  for (size_t i = 0; i < sizeof openers / sizeof openers[0]; i++) {
    openers[i](L); /* pushes a table of functions */
    lua_pushnil(L);
    while (lua_next(L, -2)) {
      lua_pushvalue(L, -2);
      lua_insert(L, -2);
      lua_settable(L, -5);
    }
    lua_pop(L, 1);
  }
  lua_pushcfunction(L, l_parallel_hint);
  lua_setfield(L, -2, "parallel_hint");
  lua_pushcfunction(L, l_parallel_threads);
  lua_setfield(L, -2, "parallel_threads");
  lua_pushliteral(L, RPCHOST_VERSION);
  lua_setfield(L, -2, "version");
  lua_pushinteger(L, rh_ctx()->net.version);
  lua_setfield(L, -2, "protocol_version");
  return 1;
}

/* A rank holds a descriptor per connection: a world of hundreds of ranks, or
 * strangers' idle connections (host/net/conn.c caps those), do not fit in the
 * usual soft limit of 1,024. The hard limit is ours to use: raise the soft one
 * to it (an unlimited hard limit: to what the kernel allows a process,
 * fs.nr_open). Says nothing unless that fails. */
static void raise_descriptor_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == rl.rlim_max) return;
  rlim_t want = rl.rlim_max;
  if (want == RLIM_INFINITY) {
    unsigned long nr_open = 1u << 20;
    FILE *f = fopen("/proc/sys/fs/nr_open", "r");
    if (f) {
      if (fscanf(f, "%lu", &nr_open) != 1) nr_open = 1u << 20;
      fclose(f);
    }
    want = (rlim_t)nr_open;
  }
  rlim_t was = rl.rlim_cur;
  if (want <= was) return;
  rl.rlim_cur = want;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
    fprintf(stderr, "rpchost: cannot raise the descriptor limit from %lu to %lu: %s\n", (unsigned long)was,
            (unsigned long)want, strerror(errno));
}

int main(int argc, char **argv) {
  /* (before anything else: it may start this program again, tuned) */
  rh_memcpy_tune(argv);
  raise_descriptor_limit(); /* before anything opens a descriptor */
  rh_blas_quiet();
  signal(SIGPIPE, SIG_IGN);
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* stderr too, and with room for a long line: ranks of one world share their
   * launcher's terminal, and an unbuffered stderr writes a message in pieces
   * ("rpchost: ", then the text), which the ranks' pieces tore apart
   * ("rpchost: rpchost: config error ..."). Line-buffered, each line leaves in
   * one write. */
  static char stderr_buf[1 << 16];
  setvbuf(stderr, stderr_buf, _IOLBF, sizeof stderr_buf);
  /* Buffers up to 512 MiB (zeroed tensors, workspaces, tensors under 4 MiB)
   * come from the heap and freed ones stay mapped for the next: a fresh mmap per
   * message costs a page fault per 4 KiB, which dominated large transfers.
   * (Uninitialised tensors of 4 MiB and more are mappings of their own with a
   * bounded cache: host/tensor/storage.c.) RPCHOST_MALLOC_TUNE=0 keeps glibc's defaults. */
  const char *tune = getenv("RPCHOST_MALLOC_TUNE");
  if (!tune || strcmp(tune, "0") != 0) {
    mallopt(M_MMAP_THRESHOLD, 512 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  rh_ctx_t *ctx = rh_ctx();
  ctx->loop = uv_default_loop();
  ctx->ref_enc_hook = ctx->ref_dec_hook = ctx->deadline_ref = LUA_NOREF;
  uint64_t max_frame = 8ull << 30;
  const char *mf = getenv("RPCHOST_MAX_FRAME");
  if (mf && *mf) max_frame = strtoull(mf, NULL, 10);
  /* RPCHOST_PROTOCOL_VERSION exists to test the version check between ranks. */
  int version = RH_PROTOCOL_VERSION;
  const char *pv = getenv("RPCHOST_PROTOCOL_VERSION");
  if (pv && *pv) version = atoi(pv);
  if (rh_net_init(&ctx->net, ctx->loop, max_frame, (uint8_t)version) != 0) {
    fprintf(stderr, "rpchost: cannot initialise the event loop\n");
    return 1;
  }
  /* seconds a connection has to complete its handshake (proof included) */
  const char *hs = getenv("RPCHOST_HANDSHAKE_TIMEOUT");
  if (hs && *hs && strtod(hs, NULL) > 0) ctx->net.handshake_ms = (uint64_t)(strtod(hs, NULL) * 1000);
  /* seconds after which a TCP peer whose host acknowledges nothing is gone (0:
   * the kernel's defaults; host/net/conn.h, liveness_s) */
  const char *hb = getenv("RPCHOST_HEARTBEAT");
  char *hb_end = NULL;
  double hb_s = hb ? strtod(hb, &hb_end) : -1;
  if (hb && *hb && hb_end && *hb_end == '\0' && hb_s >= 0) /* (anything else: the Lua side says what is wrong) */
    ctx->net.liveness_s = hb_s == 0 ? 0 : hb_s < 1 ? 1 : hb_s > 32767 ? 32767 : (unsigned)(hb_s + 0.5);
  /* how many connections one listener holds before they prove themselves (the
   * oldest goes past it; 0: no cap; default: host/net/conn.c) */
  const char *mu = getenv("RPCHOST_MAX_UNPROVEN");
  if (mu && *mu >= '0' && *mu <= '9') ctx->net.max_unproven = (int)strtol(mu, NULL, 10);
  /* how long a rank keeps polling its shared-memory rings after their last
   * traffic before it sleeps (host/net/conn_ring.c): the scheduler's spin window */
  const char *spin = getenv("RPCHOST_SPIN_US");
  if (spin && *spin && strtod(spin, NULL) >= 0) ctx->net.ring_spin_ns = (uint64_t)(strtod(spin, NULL) * 1000);
  spin_policy(&ctx->net);
  ctx->net.seg_alloc = seg_alloc;
  ctx->net.seg_free = seg_free;
  lua_State *L = luaL_newstate();
  if (!L) {
    fprintf(stderr, "rpchost: cannot create the Lua state (out of memory)\n");
    return 1;
  }
  ctx->L = L;
  luaL_openlibs(L);

  lua_getglobal(L, "debug");
  lua_getfield(L, -1, "traceback");
  ctx->ref_traceback = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pop(L, 1);

  char dir[4096];
  find_lua_dir(dir, sizeof dir);
  lua_getglobal(L, "package");
  lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;", dir, dir);
  lua_getfield(L, -2, "path");
  lua_concat(L, 2);
  lua_setfield(L, -2, "path");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, open_core);
  lua_setfield(L, -2, "rpchost.core");
  lua_pop(L, 2);

  /* cli.main(argv) returns the exit status. */
  rh_pushref(L, ctx->ref_traceback);
  lua_getglobal(L, "require");
  lua_pushliteral(L, "rpchost.tools.cli");
  int status = 1;
  if (lua_pcall(L, 1, 1, -3) != 0) {
    fprintf(stderr, "rpchost: cannot load its Lua library from %s: %s\n", dir, lua_tostring(L, -1));
    return 1;
  }
  lua_getfield(L, -1, "main");
  lua_newtable(L);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i);
  }
  if (lua_pcall(L, 1, 1, -4) != 0) {
    fprintf(stderr, "rpchost: %s\n", lua_tostring(L, -1));
  } else {
    status = (int)lua_tointeger(L, -1);
  }
  fflush(stdout);
  fflush(stderr);
  /* Close the Lua state so every userdata's __gc runs (tensors give back their
   * storage; leak checkers see a clean exit). Sockets and child processes are
   * the OS's to close: a rank must not wait on anything after its script. */
  lua_close(L);
  ctx->L = NULL;
  return status;
}
