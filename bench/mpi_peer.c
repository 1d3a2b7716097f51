/* bench/mpi_peer.c: Open MPI's side of bench/mpi_bench.sh, the yardstick for
 * rpchost's small messages and collectives on one host.
 *
 * Why: Open MPI polls shared memory with a busy core per rank; it is the
 * fastest thing a user could pick on one machine, so rpchost's numbers are
 * printed as ratios to it, measured in the same run. Timing follows
 * bench/collectives.lua: every timed repetition starts from an untimed
 * barrier, each rank times its own op, and a repetition's time is the largest
 * over the ranks. Each step stops after MAX_SECONDS or REPS repetitions.
 *
 * usage: mpirun -np N mpi_peer MAX_SECONDS [STEP...]
 * output (rank 0): "RESULT <key> <value>" lines, keys as bench/collectives.lua's
 * (ar<BYTES>_med_s, bc<BYTES>_med_s, barrier_med_s, idle_cpu_ms_rank<r>) plus
 * pingpong_p50_us / pingpong_p99_us (8 bytes between ranks 0 and 1, one way
 * and back; the other ranks wait in MPI_Barrier meanwhile, as MPI ranks do).
 *
 * With STEPs (bench/flat_collectives_bench.py), only those run, in order, with
 * collectives.lua's syntax and sizes: a2a:BYTES:REPS (MPI_Alltoall; BYTES = each
 * rank's send and receive buffer, BYTES / N to each rank), ag:BYTES:REPS
 * (MPI_Allgather; BYTES = the output, BYTES / N from each rank), rs:BYTES:REPS
 * (MPI_Reduce_scatter_block SUM; BYTES = the input, BYTES / N out), all float.
 * Each is checked once (the values collectives.lua checks) before it is timed;
 * keys a2a<BYTES>_med_s, ag<BYTES>_med_s, rs<BYTES>_med_s. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int rank, world;
static double max_s;

static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
  qsort(v, n, sizeof *v, cmp);
  int i = (int)(p * n + 0.999999) - 1;
  if (i < 0) i = 0;
  if (i >= n) i = n - 1;
  return v[i];
}

/* seconds of untimed repetitions before a step's timed ones */
#define WARM_S 0.5

/* times op() up to reps times (bounded by max_s): the median of the per-rep max over ranks */
typedef void (*op_fn)(void *);
static double timed(op_fn op, void *ctx, int reps) {
  double *ts = malloc(sizeof(double) * reps);
  /* untimed: 3 repetitions, then on until WARM_S passed on every rank, as
   * bench/collectives.lua warms up (a VM's idle cores wake slowly at first) */
  double w0 = MPI_Wtime();
  for (int i = 0;; i++) {
    MPI_Barrier(MPI_COMM_WORLD);
    op(ctx);
    int done = i >= 2 && MPI_Wtime() - w0 >= WARM_S, all;
    MPI_Allreduce(&done, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all) break;
  }
  double start = MPI_Wtime();
  int n = 0;
  for (; n < reps; n++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    op(ctx);
    double dt = MPI_Wtime() - t0, mx;
    MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    ts[n] = mx;
    int stop = MPI_Wtime() - start > max_s, any;
    MPI_Allreduce(&stop, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any) {
      n++;
      break;
    }
  }
  double med = pct(ts, n, 0.5);
  free(ts);
  return med;
}

typedef struct {
  float *buf;
  int count;
} arg_t;
static void ar(void *p) {
  arg_t *a = p;
  MPI_Allreduce(MPI_IN_PLACE, a->buf, a->count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}
static void bc(void *p) {
  arg_t *a = p;
  MPI_Bcast(a->buf, a->count, MPI_FLOAT, 0, MPI_COMM_WORLD);
}
static void bar(void *p) {
  (void)p;
  MPI_Barrier(MPI_COMM_WORLD);
}

/* the flat forms: big holds world blocks of n floats, small one block */
typedef struct {
  float *big, *big2, *small;
  int n;
} flat_t;
static void a2a(void *p) {
  flat_t *f = p;
  MPI_Alltoall(f->big, f->n, MPI_FLOAT, f->big2, f->n, MPI_FLOAT, MPI_COMM_WORLD);
}
static void ag(void *p) {
  flat_t *f = p;
  MPI_Allgather(f->small, f->n, MPI_FLOAT, f->big, f->n, MPI_FLOAT, MPI_COMM_WORLD);
}
static void rs(void *p) {
  flat_t *f = p;
  MPI_Reduce_scatter_block(f->big, f->small, f->n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

/* block j of buf (blocks of n) holds want(j) at its first, middle and last element */
static void expect(const float *buf, int blocks, int n, const char *what, long bytes, float (*want)(int)) {
  for (int j = 0; j < blocks; j++) {
    int at[3] = {0, n / 2, n - 1};
    for (int k = 0; k < 3; k++)
      if (buf[(size_t)j * n + at[k]] != want(j)) {
        fprintf(stderr, "mpi_peer: rank %d: %s %ld bytes: block %d element %d is %g, want %g\n", rank, what, bytes, j,
                at[k], buf[(size_t)j * n + at[k]], want(j));
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
  }
}
static float want_a2a(int j) { return (float)(j * world + rank); }
static float want_ag(int j) { return (float)(j + 1); }
static float want_rs(int j) {
  (void)j;
  return (float)((rank + 1) * world * (world + 1) / 2);
}

/* one STEP (kind:BYTES:REPS), checked, then timed */
static void flat_step(const char *step) {
  char kind[8];
  long bytes;
  int reps;
  if (sscanf(step, "%7[a-z0-9]:%ld:%d", kind, &bytes, &reps) != 3 ||
      (strcmp(kind, "a2a") && strcmp(kind, "ag") && strcmp(kind, "rs"))) {
    if (rank == 0) fprintf(stderr, "mpi_peer: expected a2a|ag|rs:BYTES:REPS, got %s\n", step);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int n = (int)(bytes / 4 / world);
  size_t nb = (size_t)n * world;
  flat_t f = {malloc(nb * 4), malloc(nb * 4), malloc((size_t)n * 4), n};
  if (!f.big || !f.big2 || !f.small) MPI_Abort(MPI_COMM_WORLD, 4);
  op_fn op;
  if (!strcmp(kind, "a2a")) {
    for (int j = 0; j < world; j++)
      for (int i = 0; i < n; i++) f.big[(size_t)j * n + i] = (float)(rank * world + j);
    a2a(&f);
    expect(f.big2, world, n, "MPI_Alltoall", bytes, want_a2a);
    op = a2a;
  } else if (!strcmp(kind, "ag")) {
    for (int i = 0; i < n; i++) f.small[i] = (float)(rank + 1);
    ag(&f);
    expect(f.big, world, n, "MPI_Allgather", bytes, want_ag);
    op = ag;
  } else {
    for (int j = 0; j < world; j++)
      for (int i = 0; i < n; i++) f.big[(size_t)j * n + i] = (float)((rank + 1) * (j + 1));
    rs(&f);
    expect(f.small, 1, n, "MPI_Reduce_scatter_block", bytes, want_rs);
    op = rs;
  }
  /* timed on zeros, as the other sides are */
  memset(f.big, 0, nb * 4);
  memset(f.big2, 0, nb * 4);
  memset(f.small, 0, (size_t)n * 4);
  double med = timed(op, &f, reps);
  if (rank == 0) printf("RESULT %s%ld_med_s %.9f\n", kind, bytes, med);
  free(f.big);
  free(f.big2);
  free(f.small);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  max_s = argc > 1 ? atof(argv[1]) : 2;
  if (rank == 0) printf("RESULT world_size %d\n", world);
  if (argc > 2) {
    for (int i = 2; i < argc; i++) flat_step(argv[i]);
    fflush(stdout);
    MPI_Finalize();
    return 0;
  }

  /* ping-pong, 8 bytes */
  {
    enum { WARM = 1000, N = 20000 };
    char b[8] = {0};
    double *lat = malloc(sizeof(double) * N);
    int n = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank <= 1) {
      double start = MPI_Wtime();
      for (int i = 0; i < WARM + N; i++) {
        /* both ranks stop at the same i: rank 0 decides, by a flag in the
         * payload it is about to send (set after its send, the flag never
         * reached rank 1, which then waited in MPI_Recv for ever, a core
         * busy: whenever the time cap came before the last repetition) */
        if (rank == 0 && i > WARM && MPI_Wtime() - start > max_s) b[0] = 1; /* (one sample at least) */
        double t0 = MPI_Wtime();
        if (rank == 0) {
          MPI_Send(b, 8, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
          MPI_Recv(b, 8, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
          MPI_Recv(b, 8, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          MPI_Send(b, 8, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
        }
        if (i >= WARM) lat[n++] = MPI_Wtime() - t0;
        if (b[0]) break;
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
      printf("RESULT pingpong_p50_us %.3f\n", pct(lat, n, 0.5) * 1e6);
      printf("RESULT pingpong_p99_us %.3f\n", pct(lat, n, 0.99) * 1e6);
    }
    free(lat);
  }

  int sizes[] = {4096, 1 << 20, 16 << 20, 64 << 20};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    arg_t a = {calloc(sizes[i] / 4, 4), sizes[i] / 4};
    double med = timed(ar, &a, sizes[i] <= 4096 ? 5000 : 200);
    if (rank == 0) printf("RESULT ar%d_med_s %.9f\n", sizes[i], med);
    free(a.buf);
  }
  {
    arg_t a = {calloc(4 << 20, 4), 4 << 20};
    double med = timed(bc, &a, 200);
    if (rank == 0) printf("RESULT bc%d_med_s %.9f\n", 16 << 20, med);
    free(a.buf);
  }
  {
    double med = timed(bar, NULL, 5000);
    if (rank == 0) printf("RESULT barrier_med_s %.9f\n", med);
  }
  /* idle: rank 0 sleeps while the others wait for it in MPI_Barrier */
  {
    double secs = max_s < 1 ? max_s : 1;
    MPI_Barrier(MPI_COMM_WORLD);
    double c0 = cpu_s(), w0 = MPI_Wtime();
    if (rank == 0) usleep((useconds_t)(secs * 1e6));
    MPI_Barrier(MPI_COMM_WORLD);
    double ms = (cpu_s() - c0) * 1e3, wall = (MPI_Wtime() - w0) * 1e3;
    double *all = rank == 0 ? malloc(sizeof(double) * world) : NULL;
    MPI_Gather(&ms, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      for (int r = 0; r < world; r++) printf("RESULT idle_cpu_ms_rank%d %.3f\n", r, all[r]);
      printf("RESULT idle_wall_ms %.3f\n", wall);
      free(all);
    }
  }
  fflush(stdout);
  MPI_Finalize();
  return 0;
}
