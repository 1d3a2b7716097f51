/* memcpy_tune.c: see memcpy_tune.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "memcpy_tune.h"

#include <gnu/libc-version.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#define KEY "glibc.cpu.x86_rep_movsb_threshold"
/* (past any copy: rep movsb is never chosen, and copies past the non-temporal
 * threshold keep their non-temporal loop) */
#define VALUE "1099511627776"
/* RPCHOST_MEMCPY_TUNE's value in the start again (and in the processes it starts) */
#define STARTED "started"

static rh_memcpy_state_t state = RH_MEMCPY_NOT_NEEDED;

rh_memcpy_state_t rh_memcpy_state(void) { return state; }

/* An AMD CPU with fast short rep movsb (CPUID 7.0:EDX bit 4): Zen 3 and later. */
static int affected(void) {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
  /* "AuthenticAMD", as EBX, EDX, ECX */
  if (b != 0x68747541u || d != 0x69746e65u || c != 0x444d4163u) return 0;
  if (a < 7 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  return (d >> 4) & 1;
#else
  return 0;
#endif
}

/* glibc before 2.39, which chose rep movsb there (2.39 stopped, BZ 30994) */
static int old_glibc(void) {
  int major = 0, minor = 0;
  return sscanf(gnu_get_libc_version(), "%d.%d", &major, &minor) == 2 && (major < 2 || (major == 2 && minor < 39));
}

/* Whether this process may start itself again through /proc/self/exe with
 * GLIBC_TUNABLES read: not in secure mode (setuid, file capabilities), where
 * glibc drops the tunable at the exec (and every start would start again); not
 * where no loader ran (a static build) or the loader was run as the program
 * (ld.so rpchost ...: /proc/self/exe is then ld.so); not under valgrind, whose
 * tool /proc/self/exe is and whose own copies replace glibc's. */
static int can_start_again(void) {
  const char *pre = getenv("LD_PRELOAD");
  return !getauxval(AT_SECURE) && getauxval(AT_BASE) != 0 && !(pre && strstr(pre, "vgpreload"));
}

void rh_memcpy_tune(char **argv) {
  const char *now = getenv("GLIBC_TUNABLES");
  if (now && strstr(now, KEY)) {
    /* (set by an earlier start of ours, passed on to the processes it started,
     * or set by the user: it stands, and it is what glibc reads, whatever
     * RPCHOST_MEMCPY_TUNE says) */
    state = RH_MEMCPY_TUNED;
    return;
  }
  const char *mode = getenv("RPCHOST_MEMCPY_TUNE");
  if (mode && strcmp(mode, "0") == 0) {
    state = RH_MEMCPY_OFF;
    return;
  }
  if (mode && strcmp(mode, STARTED) == 0) {
    /* (this is the start again, and the tunable did not come through: never a
     * third start) */
    state = RH_MEMCPY_FAILED;
    return;
  }
  if (!affected() || !old_glibc()) return;
  if (!can_start_again()) {
    state = RH_MEMCPY_FAILED;
    return;
  }
  size_t n = (now ? strlen(now) + 1 : 0) + sizeof KEY "=" VALUE;
  char *v = malloc(n);
  if (!v) {
    state = RH_MEMCPY_FAILED;
    return;
  }
  snprintf(v, n, "%s%s" KEY "=" VALUE, now ? now : "", now && *now ? ":" : "");
  if (setenv("RPCHOST_MEMCPY_TUNE", STARTED, 1) == 0 && setenv("GLIBC_TUNABLES", v, 1) == 0)
    execv("/proc/self/exe", argv);
  /* (no /proc, or the binary is gone: run as we are; the variables stay, so the
   * ranks this process starts are tuned all the same) */
  free(v);
  state = RH_MEMCPY_FAILED;
}
