/* test_cma.c: the one-pass cross-memory all_reduce between real processes (this
 * one and forked children): exact sums, maxima and averages over chunks of
 * several pieces that do not divide evenly, and a peer that is gone named as
 * the rank the pass failed with. Skipped (passing) where the kernel does not let
 * a process read its siblings' memory. */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "net/cma.h"
#include "rh.h"
#include "test_check.h"

#define RANKS 3
#define N 300007 /* float32: chunks of ~400 KB, two 256 KiB pieces each */

typedef struct {
  int arrived[4]; /* per barrier: how many ranks reached it */
  pid_t pid[RANKS];
  uintptr_t f32[RANKS], f64[RANKS];
  int bad[RANKS]; /* wrong elements each rank found */
} shared_t;

static shared_t *sh;

static void barrier(int k) {
  __atomic_add_fetch(&sh->arrived[k], 1, __ATOMIC_ACQ_REL);
  while (__atomic_load_n(&sh->arrived[k], __ATOMIC_ACQUIRE) < RANKS) sched_yield();
}

static float f32_in(int r, int64_t i) { return (float)((i + r) % 5 + 1); }
static double f64_in(int r, int64_t i) { return (double)((i * 7 + r * 3) % 11) - 5; }

static rh_cma_peer_t *peers(uintptr_t *addr, int me) {
  static rh_cma_peer_t p[RANKS];
  for (int i = 0; i < RANKS; i++) p[i] = (rh_cma_peer_t){i == me ? 0 : sh->pid[i], i == me ? 0 : addr[i]};
  return p;
}

static void rank_main(int me) {
  float *x = malloc(sizeof(float) * N);
  double *y = malloc(sizeof(double) * N);
  for (int64_t i = 0; i < N; i++) x[i] = f32_in(me, i), y[i] = f64_in(me, i);
  sh->pid[me] = getpid();
  sh->f32[me] = (uintptr_t)x;
  sh->f64[me] = (uintptr_t)y;
  barrier(0);
  int failed, bad = 0;
  int rc = rh_cma_all_reduce(peers(sh->f32, me), RANKS, me, x, RH_F32, N, RH_OP_ADD, RANKS, &failed);
  bad += rc != 0;
  rc = rh_cma_all_reduce(peers(sh->f64, me), RANKS, me, y, RH_F64, N, RH_OP_MAXIMUM, 0, &failed);
  bad += rc != 0;
  barrier(1); /* (the peers write into x and y until every rank is through) */
  for (int64_t i = 0; i < N; i++) {
    float sum = 0;
    double mx = -1e9;
    for (int r = 0; r < RANKS; r++) {
      sum += f32_in(r, i);
      if (f64_in(r, i) > mx) mx = f64_in(r, i);
    }
    if (x[i] != sum / RANKS || y[i] != mx) bad++;
  }
  sh->bad[me] = bad;
  free(x);
  free(y);
}

static void reduce_across_processes(void) {
  pid_t kids[RANKS];
  for (int r = 1; r < RANKS; r++) {
    kids[r] = fork();
    if (kids[r] == 0) {
      rank_main(r);
      _exit(0);
    }
  }
  rank_main(0);
  for (int r = 1; r < RANKS; r++) waitpid(kids[r], NULL, 0);
  for (int r = 0; r < RANKS; r++) CHECK(sh->bad[r] == 0);
}

/* a peer that has exited: its rank is named, nothing is written */
static void gone_peer(void) {
  pid_t kid = fork();
  if (kid == 0) _exit(0);
  waitpid(kid, NULL, 0);
  float *x = calloc(N, sizeof(float));
  rh_cma_peer_t p[2] = {{0, 0}, {kid, (uintptr_t)x}};
  int failed = -1;
  int rc = rh_cma_all_reduce(p, 2, 0, x, RH_F32, N, RH_OP_ADD, 0, &failed);
  CHECK(rc == -ESRCH && failed == 1);
  free(x);
}

/* an op with no kernel for the dtype (a comparison; AVG's division of bool) is
 * refused before any peer is read or written: the peer here is not even there */
static void no_kernel(void) {
  uint8_t x[4] = {1, 0, 1, 1};
  rh_cma_peer_t p[2] = {{0, 0}, {1, 4096}};
  int failed = 7;
  CHECK(rh_cma_all_reduce(p, 2, 0, x, RH_BOOL, 4, RH_OP_EQ, 0, &failed) == RH_ENOKERNEL && failed == -1);
  CHECK(rh_cma_all_reduce(p, 2, 0, x, RH_BOOL, 4, RH_OP_ADD, 2, &failed) == RH_ENOKERNEL && failed == -1);
  CHECK(x[0] == 1 && x[1] == 0 && x[2] == 1 && x[3] == 1);
}

int main(void) {
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(sh != MAP_FAILED);
  if (sh == MAP_FAILED) return TEST_RESULT();
  memset(sh, 0, sizeof *sh);
  no_kernel(); /* (needs no cross-memory attach) */
  /* can a sibling be read at all here? (a child reads its parent's token) */
  static char token[16] = "cma-probe-token";
  pid_t parent = getpid(), kid = fork();
  if (kid == 0) {
    int r, w;
    rh_cma_probe(parent, (uintptr_t)token, token, sizeof token, &r, &w);
    _exit(r && w ? 0 : 1);
  }
  int status = 0;
  waitpid(kid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    printf("skipped: cross-memory attach is not allowed here\n");
    return TEST_RESULT();
  }
  reduce_across_processes();
  gone_peer();
  return TEST_RESULT();
}
