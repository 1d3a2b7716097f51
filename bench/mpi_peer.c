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
 * usage: mpirun -np N mpi_peer MAX_SECONDS
 * output (rank 0): "RESULT <key> <value>" lines, keys as bench/collectives.lua's
 * (ar<BYTES>_med_s, bc<BYTES>_med_s, barrier_med_s, idle_cpu_ms_rank<r>) plus
 * pingpong_p50_us / pingpong_p99_us (8 bytes between ranks 0 and 1, one way
 * and back; the other ranks wait in MPI_Barrier meanwhile, as MPI ranks do). */
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

/* times op() up to reps times (bounded by max_s): the median of the per-rep max over ranks */
typedef void (*op_fn)(void *);
static double timed(op_fn op, void *ctx, int reps) {
  double *ts = malloc(sizeof(double) * reps);
  for (int i = 0; i < 3; i++) {
    MPI_Barrier(MPI_COMM_WORLD);
    op(ctx);
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

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  max_s = argc > 1 ? atof(argv[1]) : 2;
  if (rank == 0) printf("RESULT world_size %d\n", world);

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
