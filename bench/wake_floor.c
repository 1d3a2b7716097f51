/* bench/wake_floor.c: the floors under a small message's round trip on this
 * machine, for bench/limit.py (issue 38): what no runtime between two processes
 * can beat.
 *   wake  two processes ping-pong through a pair of eventfds: each side sleeps
 *         in read() until the other writes: the kernel's wake-up round trip,
 *         the floor for a rank that sleeps while it waits (as rpchost's idle
 *         ranks do once their short spin ends);
 *   spin  the same over one shared cache line, each side polling it: the
 *         floor for a rank that busy-polls (Open MPI's shared-memory path).
 * Prints "RESULT wake_p50_us X", "RESULT spin_p50_us X" (and _p99_).
 * usage: wake_floor [ROUNDS]   (build: cc -O2 -o wake_floor bench/wake_floor.c) */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void report(const char *name, double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp);
  printf("RESULT %s_p50_us %.3f\nRESULT %s_p99_us %.3f\n", name, t[n / 2], name, t[(int)(n * 0.99)]);
}

static void must(int ok, const char *what) {
  if (!ok) {
    perror(what);
    exit(1);
  }
}

static void wake(int rounds, double *t) {
  int ping = eventfd(0, 0), pong = eventfd(0, 0);
  must(ping >= 0 && pong >= 0, "eventfd");
  pid_t pid = fork();
  must(pid >= 0, "fork");
  uint64_t v = 1;
  if (pid == 0) {
    for (int i = 0; i < rounds; i++) {
      must(read(ping, &v, 8) == 8, "read");
      must(write(pong, &v, 8) == 8, "write");
    }
    _exit(0);
  }
  for (int i = 0; i < rounds; i++) {
    double t0 = now_us();
    must(write(ping, &v, 8) == 8, "write");
    must(read(pong, &v, 8) == 8, "read");
    t[i] = now_us() - t0;
  }
  waitpid(pid, NULL, 0);
}

static void spin(int rounds, double *t) {
  _Atomic int64_t *line = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  must(line != MAP_FAILED, "mmap");
  atomic_store(line, 0);
  pid_t pid = fork();
  must(pid >= 0, "fork");
  if (pid == 0) {
    for (int64_t i = 0; i < rounds; i++) {
      while (atomic_load_explicit(line, memory_order_acquire) != 2 * i + 1) {}
      atomic_store_explicit(line, 2 * i + 2, memory_order_release);
    }
    _exit(0);
  }
  for (int64_t i = 0; i < rounds; i++) {
    double t0 = now_us();
    atomic_store_explicit(line, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(line, memory_order_acquire) != 2 * i + 2) {}
    t[i] = now_us() - t0;
  }
  waitpid(pid, NULL, 0);
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 20000;
  if (rounds < 100) rounds = 100;
  double *t = malloc(sizeof *t * (size_t)rounds);
  must(t != NULL, "malloc");
  wake(rounds, t);
  report("wake", t, rounds);
  spin(rounds, t);
  report("spin", t, rounds);
  free(t);
  return 0;
}
