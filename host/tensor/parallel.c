/* parallel.c: a small pool of threads for large elementwise work. The caller
 * takes a share too and waits for the rest; jobs smaller than two grains run
 * inline. Threads start on first use; RPCHOST_NUM_THREADS caps them. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "tensor.h"

#define MAX_THREADS 16

static struct {
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  pthread_t th[MAX_THREADS];
  int nthreads; /* workers, not counting the caller */
  int started;
  uint64_t gen;
  int pending;
  void (*fn)(void *, int64_t, int64_t);
  void *ctx;
  int64_t n, chunk;
} pool;

static pthread_mutex_t submit_mu = PTHREAD_MUTEX_INITIALIZER;

static void *worker(void *arg) {
  int id = (int)(intptr_t)arg;
  uint64_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&pool.mu);
    while (pool.gen == seen) pthread_cond_wait(&pool.go, &pool.mu);
    seen = pool.gen;
    int64_t lo = (id + 1) * pool.chunk, hi = lo + pool.chunk;
    if (hi > pool.n) hi = pool.n;
    void (*fn)(void *, int64_t, int64_t) = pool.fn;
    void *ctx = pool.ctx;
    pthread_mutex_unlock(&pool.mu);
    if (lo < hi) fn(ctx, lo, hi);
    pthread_mutex_lock(&pool.mu);
    if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    pthread_mutex_unlock(&pool.mu);
  }
  return NULL;
}

static void start_pool(void) {
  pthread_mutex_init(&pool.mu, NULL);
  pthread_cond_init(&pool.go, NULL);
  pthread_cond_init(&pool.done, NULL);
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  const char *env = getenv("RPCHOST_NUM_THREADS");
  long want = env && *env ? atol(env) : ncpu;
  if (want < 1) want = 1;
  if (want > MAX_THREADS) want = MAX_THREADS;
  pool.nthreads = 0;
  for (long i = 0; i < want - 1; i++) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&pool.th[i], &attr, worker, (void *)(intptr_t)i) == 0) pool.nthreads++;
    pthread_attr_destroy(&attr);
  }
  __atomic_store_n(&pool.started, 1, __ATOMIC_RELEASE);
}

static void ensure_started(void) {
  if (!__atomic_load_n(&pool.started, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&submit_mu);
    if (!pool.started) start_pool();
    pthread_mutex_unlock(&submit_mu);
  }
}

int rh_parallel_threads(void) {
  ensure_started();
  return pool.nthreads + 1;
}

void rh_parallel_for(int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t), void *ctx) {
  ensure_started();
  int parts = pool.nthreads + 1;
  if (pool.nthreads == 0 || n < 2 * grain) {
    fn(ctx, 0, n);
    return;
  }
  /* one job at a time; a job submitted from inside a job runs inline */
  if (pthread_mutex_trylock(&submit_mu) != 0) {
    fn(ctx, 0, n);
    return;
  }
  int64_t chunk = (n + parts - 1) / parts;
  pthread_mutex_lock(&pool.mu);
  pool.fn = fn;
  pool.ctx = ctx;
  pool.n = n;
  pool.chunk = chunk;
  pool.pending = pool.nthreads;
  pool.gen++;
  pthread_cond_broadcast(&pool.go);
  pthread_mutex_unlock(&pool.mu);
  fn(ctx, 0, chunk < n ? chunk : n);
  pthread_mutex_lock(&pool.mu);
  while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&submit_mu);
}
