/* parallel.c: a small pool of threads for large elementwise work. Threads start
 * on first use; RPCHOST_NUM_THREADS sets how many. By default a process takes
 * its share of the cores it may run on: all of them alone, cores / N when it is
 * one of N ranks on this host (LOCAL_WORLD_SIZE, which `rpchost run` sets, or
 * Open MPI's local size, or under srun the step's tasks on this node), at least
 * one; under srun -c C, the C CPUs Slurm gave the task (a task bound to its own
 * CPUs sees only those: dividing them again would leave it one thread). N ranks
 * each with a pool as large as the
 * host oversubscribed the cores: a pipeline's two stages computing at once each
 * waited on parts whose threads the other stage's had preempted (torchrun sets
 * OMP_NUM_THREADS=1 for its ranks for the same reason).
 *
 * A job is cut into pieces of at least `grain` items, a few per thread, and the
 * caller and the workers claim pieces from one atomic counter until none is
 * left. Nobody owns a fixed share: a worker the scheduler has parked (several
 * ranks share the cores) is not waited for, the caller or an awake worker takes
 * its pieces, and a worker that wakes after the job was drained finds nothing
 * and sleeps again. Jobs smaller than two grains run inline and wake nobody.
 *
 * Job lifetime: the job (fn, ctx, counter) lives on the caller's stack. A worker
 * joins a job only under pool.mu while pool.job points at it, and the caller,
 * once every piece is claimed, clears pool.job under pool.mu and then waits for
 * the joined workers to leave: no worker touches a job after its caller returns.
 * Which thread runs a piece never changes a result: each piece's output depends
 * only on its range, so callers that sum do so over fixed parts. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT (builds that do not define it, as the fuzzers') */
#endif
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "tensor.h"

#define MAX_THREADS 16
#define PIECES_PER_THREAD 4 /* enough to even out a slow thread, few enough to stay cheap */

typedef struct {
  void (*fn)(void *, int64_t, int64_t);
  void *ctx;
  int64_t n, piece, pieces;
  int64_t next; /* the next piece to claim (atomic) */
} job_t;

static struct {
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  pthread_t th[MAX_THREADS];
  int nthreads; /* workers, not counting the caller */
  int started;
  uint64_t gen; /* bumped per job, so a worker joins each job at most once */
  job_t *job;   /* the job open for joining, or NULL */
  int joined;   /* workers inside the current job */
} pool;

static pthread_mutex_t submit_mu = PTHREAD_MUTEX_INITIALIZER;

/* runs pieces of j until the counter passes the end */
static void drain(job_t *j) {
  for (;;) {
    int64_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (k >= j->pieces) return;
    int64_t lo = k * j->piece, hi = lo + j->piece;
    j->fn(j->ctx, lo, hi < j->n ? hi : j->n);
  }
}

static void *worker(void *arg) {
  (void)arg;
  uint64_t seen = 0;
  pthread_mutex_lock(&pool.mu);
  for (;;) {
    while (pool.gen == seen || !pool.job) {
      seen = pool.gen; /* a job closed before this worker woke: skip it */
      pthread_cond_wait(&pool.go, &pool.mu);
    }
    seen = pool.gen;
    job_t *j = pool.job;
    pool.joined++;
    pthread_mutex_unlock(&pool.mu);
    drain(j);
    pthread_mutex_lock(&pool.mu);
    if (--pool.joined == 0 && !pool.job) pthread_cond_signal(&pool.done);
  }
  return NULL;
}

int rh_host_cpus(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
}

static int hint_local, hint_cpus; /* rh_parallel_hint's */

void rh_parallel_hint(int local_ranks, int cpus_per_rank) {
  hint_local = local_ranks > 0 ? local_ranks : 0;
  hint_cpus = cpus_per_rank > 0 ? cpus_per_rank : 0;
}

int rh_local_ranks(void) {
  const char *lws = getenv("LOCAL_WORLD_SIZE");
  if (!lws || !*lws) lws = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  int n = lws && *lws ? atoi(lws) : 0;
  return n > 0 ? n : hint_local;
}

static long default_threads(void) {
  int cpus = rh_host_cpus();
  if (hint_cpus) return hint_cpus < cpus ? hint_cpus : cpus;
  int local = rh_local_ranks();
  return cpus / (local ? local : 1);
}

static void start_pool(void) {
  pthread_mutex_init(&pool.mu, NULL);
  pthread_cond_init(&pool.go, NULL);
  pthread_cond_init(&pool.done, NULL);
  const char *env = getenv("RPCHOST_NUM_THREADS");
  long want = env && *env ? atol(env) : default_threads();
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

int64_t rh_parallel_grain(int64_t item_work) {
  if (item_work < 1) item_work = 1;
  return item_work >= RH_PARALLEL_MIN_WORK ? 1 : (RH_PARALLEL_MIN_WORK + item_work - 1) / item_work;
}

void rh_parallel_for(int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t), void *ctx) {
  ensure_started();
  if (grain < 1) grain = 1;
  if (pool.nthreads == 0 || n < 2 * grain) {
    fn(ctx, 0, n);
    return;
  }
  /* one job at a time; a job submitted from inside a job runs inline */
  if (pthread_mutex_trylock(&submit_mu) != 0) {
    fn(ctx, 0, n);
    return;
  }
  int64_t parts = pool.nthreads + 1, piece = (n + parts * PIECES_PER_THREAD - 1) / (parts * PIECES_PER_THREAD);
  if (piece < grain) piece = grain;
  job_t j = {fn, ctx, n, piece, (n + piece - 1) / piece, 0};
  /* wake only as many workers as there are pieces beyond the caller's first */
  int64_t helpers = j.pieces - 1 < pool.nthreads ? j.pieces - 1 : pool.nthreads;
  pthread_mutex_lock(&pool.mu);
  pool.job = &j;
  pool.gen++;
  if (helpers >= pool.nthreads) pthread_cond_broadcast(&pool.go);
  else
    for (int64_t i = 0; i < helpers; i++) pthread_cond_signal(&pool.go);
  pthread_mutex_unlock(&pool.mu);
  drain(&j);
  pthread_mutex_lock(&pool.mu);
  pool.job = NULL; /* every piece is claimed: late workers must not join */
  while (pool.joined > 0) pthread_cond_wait(&pool.done, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&submit_mu);
}
