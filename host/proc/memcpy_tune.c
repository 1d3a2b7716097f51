/* memcpy_tune.c: see memcpy_tune.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "memcpy_tune.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#define KEY "glibc.cpu.x86_rep_movsb_threshold"
/* (past any copy: rep movsb is never chosen, and copies past the non-temporal
 * threshold keep their non-temporal loop) */
#define VALUE "1099511627776"

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

void rh_memcpy_tune(char **argv) {
  const char *off = getenv("RPCHOST_MEMCPY_TUNE");
  if (off && strcmp(off, "0") == 0) {
    state = RH_MEMCPY_OFF;
    return;
  }
  const char *now = getenv("GLIBC_TUNABLES");
  if (now && strstr(now, KEY)) {
    state = RH_MEMCPY_TUNED; /* (set by a previous start of ours, or by the user: theirs stands) */
    return;
  }
  /* (under valgrind, /proc/self/exe is valgrind's tool, and its own copies
   * replace glibc's: nothing to tune) */
  const char *pre = getenv("LD_PRELOAD");
  if (!affected() || (pre && strstr(pre, "vgpreload"))) return;
  size_t n = (now ? strlen(now) + 1 : 0) + sizeof KEY "=" VALUE;
  char *v = malloc(n);
  if (!v) {
    state = RH_MEMCPY_FAILED;
    return;
  }
  snprintf(v, n, "%s%s" KEY "=" VALUE, now ? now : "", now && *now ? ":" : "");
  if (setenv("GLIBC_TUNABLES", v, 1) == 0) execv("/proc/self/exe", argv);
  /* (no /proc, or the binary is gone: run as we are; the variable stays, so the
   * ranks this process starts are tuned all the same) */
  free(v);
  state = RH_MEMCPY_FAILED;
}
