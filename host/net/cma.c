/* cma.c: cross-memory transfers and the one-pass all_reduce (see cma.h). */
#include "cma.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "rh.h"

static int copy_serial(pid_t pid, void *local, uintptr_t addr, size_t len, int write) {
  size_t done = 0;
  while (done < len) {
    struct iovec l = {(char *)local + done, len - done};
    struct iovec r = {(void *)(addr + done), len - done};
    ssize_t n = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) return -EIO;
    done += (size_t)n;
  }
  return 0;
}

/* A large read is split across the tensor thread pool: process_vm_readv copies
 * page by page (it pins and walks the sender's pages), so one thread reaches
 * about a third of memcpy's bandwidth, and the sender is idle while it waits. */
#define READ_PIECE (4u << 20)
typedef struct {
  pid_t pid;
  char *dst;
  uintptr_t addr;
  size_t len;
  int err; /* first failure, as -errno */
} read_job_t;

static void read_chunk(void *vctx, int64_t lo, int64_t hi) {
  read_job_t *j = vctx;
  for (int64_t k = lo; k < hi; k++) {
    size_t off = (size_t)k * READ_PIECE, n = j->len - off < READ_PIECE ? j->len - off : READ_PIECE;
    int rc = copy_serial(j->pid, j->dst + off, j->addr + off, n, 0);
    if (rc) __atomic_store_n(&j->err, rc, __ATOMIC_RELAXED);
  }
}

int rh_cma_read(pid_t pid, void *dst, uintptr_t addr, size_t len) {
  if (len < 2 * READ_PIECE) return copy_serial(pid, dst, addr, len, 0);
  read_job_t j = {pid, dst, addr, len, 0};
  rh_parallel_for((int64_t)((len + READ_PIECE - 1) / READ_PIECE), 1, read_chunk, &j);
  return j.err;
}

int rh_cma_write(pid_t pid, uintptr_t addr, const void *src, size_t len) {
  return copy_serial(pid, (void *)src, addr, len, 1);
}

void rh_cma_probe(pid_t pid, uintptr_t addr, const void *want, size_t len, int *readable, int *writable) {
  char buf[64];
  *readable = *writable = 0;
  if (len > sizeof buf) return;
  *readable = copy_serial(pid, buf, addr, len, 0) == 0 && memcmp(buf, want, len) == 0;
  /* (the bytes just read go back unchanged: the peer's token stays what it is) */
  *writable = *readable && copy_serial(pid, buf, addr, len, 1) == 0;
}

/* ---- the one-pass all_reduce */

/* A piece: small enough that it and its incoming copy stay in this core's L2
 * cache (2 MiB here) from the first read to the last write, large enough that
 * the two system calls per peer and piece cost little next to its bytes (16 MiB
 * between 2 ranks: 64 KiB 1.40 ms, 256 KiB 1.33, 1 MiB 1.88). */
#define PIECE_BYTES ((size_t)256 << 10)

/* each thread's landing buffer for a peer's piece, made on first use and kept
 * (the pool's threads live as long as the process) */
static __thread char *scratch;

typedef struct {
  const rh_cma_peer_t *ranks;
  int n, me;
  char *flat;
  rh_dtype_t dt;
  size_t es;
  int64_t start, len, piece; /* this rank's chunk and the piece size, in elements */
  rh_binop_t op;
  int avg;
  char divisor[8]; /* as a dt value */
  int err;         /* first failure (atomic) */
  int failed;      /* the rank it was with, -1 for none or this one */
} ar_job_t;

static void fail(ar_job_t *j, int rc, int rank) {
  int zero = 0;
  if (__atomic_compare_exchange_n(&j->err, &zero, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    __atomic_store_n(&j->failed, rank, __ATOMIC_RELAXED);
}

static void ar_pieces(void *vctx, int64_t lo, int64_t hi) {
  ar_job_t *j = vctx;
  if (!scratch && !(scratch = aligned_alloc(64, PIECE_BYTES))) {
    fail(j, RH_ENOMEM, -1);
    return;
  }
  for (int64_t k = lo; k < hi; k++) {
    if (__atomic_load_n(&j->err, __ATOMIC_RELAXED)) return;
    int64_t e0 = j->start + k * j->piece, ne = j->start + j->len - e0;
    if (ne > j->piece) ne = j->piece;
    size_t off = (size_t)e0 * j->es, bytes = (size_t)ne * j->es;
    char *mine = j->flat + off;
    for (int i = 0; i < j->n; i++) {
      if (i == j->me) continue;
      int rc = copy_serial(j->ranks[i].pid, scratch, j->ranks[i].addr + off, bytes, 0);
      if (rc) return fail(j, rc, i);
      /* a fixed order of operands, lower ranks' on the left (as the socket
       * algorithms do); one rank computes each element, so all get its bits */
      if (i < j->me ? rh_binary_flat(j->op, j->dt, ne, mine, scratch, mine, 0)
                    : rh_binary_flat(j->op, j->dt, ne, mine, mine, scratch, 0))
        return fail(j, RH_ENOKERNEL, -1); /* (rh_cma_all_reduce checked: not expected) */
    }
    if (j->avg && rh_binary_flat(RH_OP_DIV, j->dt, ne, mine, mine, j->divisor, 1)) return fail(j, RH_ENOKERNEL, -1);
    for (int i = 0; i < j->n; i++) {
      if (i == j->me) continue;
      int rc = copy_serial(j->ranks[i].pid, mine, j->ranks[i].addr + off, bytes, 1);
      if (rc) return fail(j, rc, i);
    }
  }
}

int rh_cma_all_reduce(const rh_cma_peer_t *ranks, int n, int me, void *flat, rh_dtype_t dt, int64_t numel,
                      rh_binop_t op, double divisor, int *failed) {
  *failed = -1;
  if (n < 1 || me < 0 || me >= n || numel < 0 || (unsigned)dt >= RH_NDTYPES) return -EINVAL;
  /* the kernels the pass runs, refused before any byte moves: every rank gets
   * the same arguments, so all refuse alike and none writes into a peer */
  if (rh_reduce_flat_check(op, dt, divisor != 0)) return RH_ENOKERNEL;
  ar_job_t j = {
      .ranks = ranks, .n = n, .me = me, .flat = flat, .dt = dt, .es = rh_dtype_size(dt), .op = op, .failed = -1};
  int64_t base = numel / n, rem = numel % n;
  j.start = me * base + (me < rem ? me : rem);
  j.len = base + (me < rem ? 1 : 0);
  j.piece = (int64_t)(PIECE_BYTES / j.es);
  if (divisor != 0) {
    j.avg = 1;
    rh_dtype_store(dt, j.divisor, divisor);
  }
  if (j.len == 0) return 0;
  rh_parallel_for((j.len + j.piece - 1) / j.piece, 1, ar_pieces, &j);
  *failed = j.failed;
  return j.err;
}
