/* mpi.c: Open MPI for the "mpi" process-group backend, through dlopen.
 *
 * rpchost is built without MPI headers and runs without an MPI library; this
 * file finds the library when a process group first asks for it. Handles are
 * the library's own ABI: Open MPI's are pointers to exported globals
 * (MPI_COMM_WORLD is &ompi_mpi_comm_world, MPI_FLOAT &ompi_mpi_float, ...), so
 * the globals are looked up with dlsym like the functions. A library that is
 * not Open MPI (MPICH's handles are integers) is refused with that reason.
 *
 * The library is opened RTLD_GLOBAL: Open MPI loads its own components with
 * dlopen and they resolve libmpi's symbols globally. */
#include "mpi/mpi.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *H; /* any MPI handle (Open MPI: a pointer) */

static struct {
  void *h;
  int tried, inited, finalized;
  int (*Init_thread)(int *, char ***, int, int *);
  int (*Initialized)(int *);
  int (*Finalized)(int *);
  int (*Finalize)(void);
  int (*Abort)(H, int);
  int (*Comm_rank)(H, int *);
  int (*Comm_size)(H, int *);
  int (*Comm_split)(H, int, int, H *);
  int (*Comm_dup)(H, H *);
  int (*Comm_idup)(H, H *, H *);
  int (*Comm_free)(H *);
  int (*Comm_set_errhandler)(H, H);
  int (*Error_string)(int, char *, int *);
  int (*Get_processor_name)(char *, int *);
  int (*Iallreduce)(const void *, void *, int, H, H, H, H *);
  int (*Ireduce)(const void *, void *, int, H, H, int, H, H *);
  int (*Ibcast)(void *, int, H, int, H, H *);
  int (*Iallgather)(const void *, int, H, void *, int, H, H, H *);
  int (*Ireduce_scatter_block)(const void *, void *, int, H, H, H, H *);
  int (*Igather)(const void *, int, H, void *, int, H, int, H, H *);
  int (*Iscatter)(const void *, int, H, void *, int, H, int, H, H *);
  int (*Ialltoall)(const void *, int, H, void *, int, H, H, H *);
  int (*Ialltoallv)(const void *, const int *, const int *, H, void *, const int *, const int *, H, H, H *);
  int (*Ibarrier)(H, H *);
  int (*Isend)(const void *, int, H, int, int, H, H *);
  int (*Irecv)(void *, int, H, int, int, H, H *);
  int (*Test)(H *, int *, void *);
  int (*Get_count)(const void *, H, int *);
  /* predefined handles */
  H world, dtype[RH_NDTYPES], byte, op[RH_MPI_NOPS], lor, land, lxor, errors_return;
} mpi;

static _Thread_local char last[768] = "no error";

const char *rh_mpi_error(void) { return last; }

static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last, sizeof last, fmt, ap);
  va_end(ap);
  return RH_EMPI;
}

/* an MPI return code as an error naming the call */
static int check(int rc, const char *what) {
  if (rc == 0) return 0;
  char msg[512] = "";
  int n = sizeof msg - 1;
  if (!mpi.Error_string || mpi.Error_string(rc, msg, &n) != 0) snprintf(msg, sizeof msg, "error %d", rc);
  return fail("%s failed: %s", what, msg);
}

static int sym(void *dst, const char *name) {
  void *p = dlsym(mpi.h, name);
  if (!p) {
    fail(
        "the MPI library has no symbol %s (rpchost's mpi backend needs Open MPI 4 or newer: install the "
        "Debian packages openmpi-bin and libopenmpi-dev, or point RPCHOST_MPI_LIB at Open MPI's libmpi.so)",
        name);
    return 0;
  }
  memcpy(dst, &p, sizeof p);
  return 1;
}

/* a predefined handle: the address of the global */
static int global(H *dst, const char *name) {
  void *p = dlsym(mpi.h, name);
  if (!p) return sym(dst, name); /* (fails with the message) */
  *dst = p;
  return 1;
}

int rh_mpi_load(void) {
  if (mpi.tried) return mpi.h ? 0 : RH_EMPI;
  mpi.tried = 1;
  const char *env = getenv("RPCHOST_MPI_LIB");
  const char *names[] = {"libmpi.so.40", "libmpi.so", "libmpi.so.12"};
  if (env && *env) {
    mpi.h = dlopen(env, RTLD_NOW | RTLD_GLOBAL);
    if (!mpi.h)
      return fail(
          "cannot load $RPCHOST_MPI_LIB (%s): %s; install the Debian packages openmpi-bin and "
          "libopenmpi-dev, or point RPCHOST_MPI_LIB at Open MPI's libmpi.so",
          env, dlerror());
  } else {
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !mpi.h; i++)
      mpi.h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
    if (!mpi.h)
      return fail(
          "cannot load an MPI library (libmpi.so.40): %s; install the Debian packages openmpi-bin "
          "and libopenmpi-dev (scripts/setup.sh does), or set RPCHOST_MPI_LIB to the path of "
          "libmpi.so",
          dlerror());
  }
  if (!dlsym(mpi.h, "ompi_mpi_comm_world")) {
    dlclose(mpi.h);
    mpi.h = NULL;
    return fail(
        "the MPI library found is not Open MPI (no ompi_mpi_comm_world): rpchost's mpi backend "
        "speaks Open MPI's ABI; install openmpi-bin and libopenmpi-dev or set RPCHOST_MPI_LIB");
  }
  static const char *dt[RH_NDTYPES] = {"ompi_mpi_float",   "ompi_mpi_double",  "ompi_mpi_int32_t",
                                       "ompi_mpi_int64_t", "ompi_mpi_uint8_t", "ompi_mpi_c_bool"};
  int ok = sym(&mpi.Init_thread, "MPI_Init_thread") && sym(&mpi.Initialized, "MPI_Initialized") &&
           sym(&mpi.Finalized, "MPI_Finalized") && sym(&mpi.Finalize, "MPI_Finalize") && sym(&mpi.Abort, "MPI_Abort") &&
           sym(&mpi.Comm_rank, "MPI_Comm_rank") && sym(&mpi.Comm_size, "MPI_Comm_size") &&
           sym(&mpi.Comm_split, "MPI_Comm_split") && sym(&mpi.Comm_dup, "MPI_Comm_dup") &&
           sym(&mpi.Comm_idup, "MPI_Comm_idup") && sym(&mpi.Comm_free, "MPI_Comm_free") &&
           sym(&mpi.Comm_set_errhandler, "MPI_Comm_set_errhandler") && sym(&mpi.Error_string, "MPI_Error_string") &&
           sym(&mpi.Get_processor_name, "MPI_Get_processor_name") && sym(&mpi.Iallreduce, "MPI_Iallreduce") &&
           sym(&mpi.Ireduce, "MPI_Ireduce") && sym(&mpi.Ibcast, "MPI_Ibcast") &&
           sym(&mpi.Iallgather, "MPI_Iallgather") && sym(&mpi.Ireduce_scatter_block, "MPI_Ireduce_scatter_block") &&
           sym(&mpi.Igather, "MPI_Igather") && sym(&mpi.Iscatter, "MPI_Iscatter") &&
           sym(&mpi.Ialltoall, "MPI_Ialltoall") && sym(&mpi.Ialltoallv, "MPI_Ialltoallv") &&
           sym(&mpi.Ibarrier, "MPI_Ibarrier") && sym(&mpi.Isend, "MPI_Isend") && sym(&mpi.Irecv, "MPI_Irecv") &&
           sym(&mpi.Test, "MPI_Test") && sym(&mpi.Get_count, "MPI_Get_count") &&
           global(&mpi.world, "ompi_mpi_comm_world") && global(&mpi.byte, "ompi_mpi_byte") &&
           global(&mpi.op[RH_MPI_SUM], "ompi_mpi_op_sum") && global(&mpi.op[RH_MPI_PROD], "ompi_mpi_op_prod") &&
           global(&mpi.op[RH_MPI_MIN], "ompi_mpi_op_min") && global(&mpi.op[RH_MPI_MAX], "ompi_mpi_op_max") &&
           global(&mpi.op[RH_MPI_BAND], "ompi_mpi_op_band") && global(&mpi.op[RH_MPI_BOR], "ompi_mpi_op_bor") &&
           global(&mpi.op[RH_MPI_BXOR], "ompi_mpi_op_bxor") && global(&mpi.lor, "ompi_mpi_op_lor") &&
           global(&mpi.land, "ompi_mpi_op_land") && global(&mpi.lxor, "ompi_mpi_op_lxor") &&
           global(&mpi.errors_return, "ompi_mpi_errors_return");
  for (int i = 0; ok && i < RH_NDTYPES; i++) ok = global(&mpi.dtype[i], dt[i]);
  if (!ok) {
    dlclose(mpi.h);
    mpi.h = NULL;
    return RH_EMPI;
  }
  return 0;
}

int rh_mpi_initialized(void) { return mpi.inited && !mpi.finalized; }

int rh_mpi_init(int *rank, int *size) {
  int rc = rh_mpi_load();
  if (rc) return rc;
  if (mpi.finalized) return fail("MPI was finalised in this process already; it cannot start again");
  if (!mpi.inited) {
    int already = 0, provided = 0;
    mpi.Initialized(&already);
    if (!already &&
        (rc = check(mpi.Init_thread(NULL, NULL, 1 /* MPI_THREAD_FUNNELED */, &provided), "MPI_Init_thread")))
      return rc;
    mpi.inited = 1;
    if ((rc = check(mpi.Comm_set_errhandler(mpi.world, mpi.errors_return), "MPI_Comm_set_errhandler"))) return rc;
  }
  if ((rc = check(mpi.Comm_rank(mpi.world, rank), "MPI_Comm_rank"))) return rc;
  return check(mpi.Comm_size(mpi.world, size), "MPI_Comm_size");
}

int rh_mpi_finalize(void) {
  if (!mpi.inited || mpi.finalized) return 0;
  mpi.finalized = 1;
  return check(mpi.Finalize(), "MPI_Finalize");
}

void rh_mpi_abort(int code) {
  if (mpi.inited && !mpi.finalized) mpi.Abort(mpi.world, code);
}

rh_mpi_comm_t rh_mpi_world(void) { return mpi.world; }

static int need(void) {
  if (!rh_mpi_initialized()) return fail("MPI is not initialised in this process (or was finalised)");
  return 0;
}

int rh_mpi_comm_split(rh_mpi_comm_t comm, int color, int key, rh_mpi_comm_t *out) {
  int rc = need();
  if (rc) return rc;
  H c = NULL;
  if ((rc = check(mpi.Comm_split(comm, color < 0 ? -32766 /* MPI_UNDEFINED */ : color, key, &c), "MPI_Comm_split")))
    return rc;
  *out = NULL;
  if (color < 0) return 0; /* (c is MPI_COMM_NULL) */
  *out = c;
  return check(mpi.Comm_set_errhandler(c, mpi.errors_return), "MPI_Comm_set_errhandler");
}

int rh_mpi_comm_dup(rh_mpi_comm_t comm, rh_mpi_comm_t *out) {
  int rc = need();
  if (rc) return rc;
  if ((rc = check(mpi.Comm_dup(comm, out), "MPI_Comm_dup"))) return rc;
  return check(mpi.Comm_set_errhandler(*out, mpi.errors_return), "MPI_Comm_set_errhandler");
}

int rh_mpi_comm_idup(rh_mpi_comm_t comm, rh_mpi_comm_t *out, rh_mpi_req_t *r) {
  int rc = need();
  if (rc) return rc;
  /* (the copy has its parent's error handler: errors return) */
  return check(mpi.Comm_idup(comm, out, r), "MPI_Comm_idup");
}

void rh_mpi_comm_free(rh_mpi_comm_t *comm) {
  if (*comm && *comm != mpi.world && rh_mpi_initialized()) mpi.Comm_free(comm);
  *comm = NULL;
}

int rh_mpi_processor_name(char *out, size_t n) {
  int rc = need();
  if (rc) return rc;
  char buf[512]; /* MPI_MAX_PROCESSOR_NAME is 256 in Open MPI */
  int len = 0;
  if ((rc = check(mpi.Get_processor_name(buf, &len), "MPI_Get_processor_name"))) return rc;
  snprintf(out, n, "%.*s", len, buf);
  return 0;
}

static int count_of(size_t count, const char *what, int *out) {
  if (count > INT_MAX)
    return fail("%s: %zu elements is more than MPI's int count (2^31 - 1); split the tensor", what, count);
  *out = (int)count;
  return 0;
}

static const char *const op_names[RH_MPI_NOPS] = {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};

/* The MPI op for a dtype. Bool has only the logical ops in MPI (SUM and MAX
 * are "or", PRODUCT and MIN "and", the bitwise ones their logical twins); the
 * bitwise ops are not defined on floating types, which MPI would only report
 * as MPI_ERR_OP, so they are refused here by name (PyTorch's wording). */
static int op_of(int op, rh_dtype_t dt, const char *what, H *out) {
  if (op < 0 || op >= RH_MPI_NOPS) return fail("%s: unknown reduction op %d", what, op);
  if (op >= RH_MPI_BAND && rh_dtype_is_float(dt))
    return fail("%s: Cannot use ReduceOp.%s with non-integral dtype %s (bitwise ops take integer and bool tensors)",
                what, op_names[op], rh_dtype_name(dt));
  if (dt != RH_BOOL) *out = mpi.op[op];
  else if (op == RH_MPI_BXOR) *out = mpi.lxor;
  else *out = (op == RH_MPI_SUM || op == RH_MPI_MAX || op == RH_MPI_BOR) ? mpi.lor : mpi.land;
  return 0;
}

#define PRE(what)                                                                     \
  int n = 0, rc = need();                                                             \
  if (rc) return rc;                                                                  \
  if ((unsigned)dt >= RH_NDTYPES) return fail("%s: unknown dtype %d", what, (int)dt); \
  if ((rc = count_of(count, what, &n))) return rc

int rh_mpi_iallreduce(rh_mpi_comm_t c, void *buf, size_t count, rh_dtype_t dt, int op, rh_mpi_req_t *r) {
  PRE("MPI_Iallreduce");
  H o;
  if ((rc = op_of(op, dt, "MPI_Iallreduce", &o))) return rc;
  return check(mpi.Iallreduce((void *)1 /* MPI_IN_PLACE */, buf, n, mpi.dtype[dt], o, c, r), "MPI_Iallreduce");
}

int rh_mpi_ireduce(rh_mpi_comm_t c, void *buf, size_t count, rh_dtype_t dt, int op, int root, int me, rh_mpi_req_t *r) {
  PRE("MPI_Ireduce");
  H o;
  if ((rc = op_of(op, dt, "MPI_Ireduce", &o))) return rc;
  const void *send = me == root ? (void *)1 : buf;
  return check(mpi.Ireduce(send, me == root ? buf : NULL, n, mpi.dtype[dt], o, root, c, r), "MPI_Ireduce");
}

int rh_mpi_ibcast(rh_mpi_comm_t c, void *buf, size_t count, rh_dtype_t dt, int root, rh_mpi_req_t *r) {
  PRE("MPI_Ibcast");
  return check(mpi.Ibcast(buf, n, mpi.dtype[dt], root, c, r), "MPI_Ibcast");
}

int rh_mpi_iallgather(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, rh_mpi_req_t *r) {
  PRE("MPI_Iallgather");
  return check(mpi.Iallgather(send, n, mpi.dtype[dt], recv, n, mpi.dtype[dt], c, r), "MPI_Iallgather");
}

int rh_mpi_ireduce_scatter(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, int op,
                           rh_mpi_req_t *r) {
  PRE("MPI_Ireduce_scatter_block");
  H o;
  if ((rc = op_of(op, dt, "MPI_Ireduce_scatter_block", &o))) return rc;
  return check(mpi.Ireduce_scatter_block(send, recv, n, mpi.dtype[dt], o, c, r), "MPI_Ireduce_scatter_block");
}

int rh_mpi_igather(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, int root,
                   rh_mpi_req_t *r) {
  PRE("MPI_Igather");
  return check(mpi.Igather(send, n, mpi.dtype[dt], recv, n, mpi.dtype[dt], root, c, r), "MPI_Igather");
}

int rh_mpi_iscatter(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, int root,
                    rh_mpi_req_t *r) {
  PRE("MPI_Iscatter");
  return check(mpi.Iscatter(send, n, mpi.dtype[dt], recv, n, mpi.dtype[dt], root, c, r), "MPI_Iscatter");
}

int rh_mpi_ialltoall(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, rh_mpi_req_t *r) {
  PRE("MPI_Ialltoall");
  return check(mpi.Ialltoall(send, n, mpi.dtype[dt], recv, n, mpi.dtype[dt], c, r), "MPI_Ialltoall");
}

/* counts -> ints[0..n) and their running sums (the segments lie back to back in
 * rank order) -> ints[n..2n); each must fit MPI's int */
static int counts_displs(const size_t *counts, int n, int *ints, const char *dir) {
  size_t at = 0;
  for (int i = 0; i < n; i++) {
    if (counts[i] > INT_MAX)
      return fail(
          "MPI_Ialltoallv: %zu elements %s rank %d is more than MPI's int count (2^31 - 1); split the tensor "
          "or the exchange",
          counts[i], dir, i);
    if (at > INT_MAX)
      return fail(
          "MPI_Ialltoallv: the elements %s rank %d start at element %zu, past MPI's int displacements "
          "(2^31 - 1); split the tensor or the exchange",
          dir, i, at);
    ints[i] = (int)counts[i];
    ints[n + i] = (int)at;
    at += counts[i];
  }
  return 0;
}

int rh_mpi_ialltoallv(rh_mpi_comm_t c, const void *send, const size_t *scounts, void *recv, const size_t *rcounts,
                      int n, rh_dtype_t dt, int *ints, rh_mpi_req_t *r) {
  int size = 0, rc = need();
  if (rc) return rc;
  if ((unsigned)dt >= RH_NDTYPES) return fail("MPI_Ialltoallv: unknown dtype %d", (int)dt);
  if ((rc = check(mpi.Comm_size(c, &size), "MPI_Comm_size"))) return rc;
  if (n != size) return fail("MPI_Ialltoallv: %d counts given for a communicator of %d ranks (one per rank)", n, size);
  if ((rc = counts_displs(scounts, n, ints, "for")) || (rc = counts_displs(rcounts, n, ints + 2 * n, "from")))
    return rc;
  return check(
      mpi.Ialltoallv(send, ints, ints + n, mpi.dtype[dt], recv, ints + 2 * n, ints + 3 * n, mpi.dtype[dt], c, r),
      "MPI_Ialltoallv");
}

int rh_mpi_ibarrier(rh_mpi_comm_t c, rh_mpi_req_t *r) {
  int rc = need();
  if (rc) return rc;
  return check(mpi.Ibarrier(c, r), "MPI_Ibarrier");
}

int rh_mpi_isend(rh_mpi_comm_t c, const void *buf, size_t bytes, int dst, int tag, rh_mpi_req_t *r) {
  int n = 0, rc = need();
  if (rc) return rc;
  if ((rc = count_of(bytes, "MPI_Isend", &n))) return rc;
  return check(mpi.Isend(buf, n, mpi.byte, dst, tag, c, r), "MPI_Isend");
}

int rh_mpi_irecv(rh_mpi_comm_t c, void *buf, size_t bytes, int src, int tag, rh_mpi_req_t *r) {
  int n = 0, rc = need();
  if (rc) return rc;
  if ((rc = count_of(bytes, "MPI_Irecv", &n))) return rc;
  return check(mpi.Irecv(buf, n, mpi.byte, src, tag, c, r), "MPI_Irecv");
}

int rh_mpi_test(rh_mpi_req_t *r, int *done, size_t *got, int *source) {
  int rc = need();
  if (rc) return rc;
  /* MPI_Status: Open MPI's is 24 bytes and opens with int MPI_SOURCE, MPI_TAG,
   * MPI_ERROR; room to spare. MPI_SOURCE starts at -1: MPI writes it only for a
   * completed receive. */
  _Alignas(8) unsigned char status[64];
  memset(status, 0, sizeof status);
  int unknown = -1;
  memcpy(status, &unknown, sizeof unknown);
  int flag = 0;
  rc = check(mpi.Test(r, &flag, status), "MPI_Test");
  if (source) memcpy(source, status, sizeof *source);
  if (rc) return rc;
  *done = flag;
  if (flag && got) {
    int n = 0;
    mpi.Get_count(status, mpi.byte, &n);
    *got = n < 0 ? 0 : (size_t)n;
  }
  return 0;
}
