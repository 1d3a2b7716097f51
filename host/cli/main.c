/* main.c: the rpchost executable's entry point. All command-line handling lives in
 * the Lua front end (lua/rpchost/tools/cli.lua) started by the binding layer; here only
 * what must come before anything else: the descriptor limit. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

int rh_lua_main(int argc, char **argv);

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
  raise_descriptor_limit();
  return rh_lua_main(argc, argv);
}
