/* mpi.h: the host's MPI library for the process group's "mpi" backend, loaded
 * with dlopen on first use so that rpchost neither links nor needs MPI to run.
 *
 * Only non-blocking operations are offered for collectives and point to point
 * (MPI_Iallreduce, MPI_Isend, ...): the caller polls rh_mpi_test from its event
 * loop, so a rank waiting for MPI still serves RPCs and can time out. Buffers
 * are borrowed: they must stay alive until the request completes.
 *
 *   int rank, size;
 *   if (rh_mpi_init(&rank, &size) != 0) puts(rh_mpi_error());
 *   rh_mpi_req_t r;
 *   rh_mpi_iallreduce(rh_mpi_world(), buf, n, RH_F32, RH_MPI_SUM, &r);
 *   int done = 0;
 *   while (!done && rh_mpi_test(&r, &done, NULL, NULL) == 0) poll_something_else();
 */
#ifndef RH_MPI_H
#define RH_MPI_H

#include <stddef.h>

#include "tensor/tensor.h"

#define RH_EMPI (-5101) /* the MPI library failed or is missing: rh_mpi_error() says why */

typedef void *rh_mpi_comm_t;
typedef void *rh_mpi_req_t;

/* Reduction ops. The bitwise ones take integer and bool tensors only (bool's are
 * MPI's logical LAND/LOR/LXOR); on a floating dtype they are refused by name. */
enum { RH_MPI_SUM, RH_MPI_PROD, RH_MPI_MIN, RH_MPI_MAX, RH_MPI_BAND, RH_MPI_BOR, RH_MPI_BXOR, RH_MPI_NOPS };

/* The message of the last failure on this thread; never NULL. */
const char *rh_mpi_error(void);

/* Loads the library ($RPCHOST_MPI_LIB, else libmpi.so.40 / libmpi.so). 0 or RH_EMPI. */
int rh_mpi_load(void);
/* MPI_Init_thread (FUNNELED: only the loop thread calls MPI) once per process,
 * then this process's rank and size in MPI_COMM_WORLD. */
int rh_mpi_init(int *rank, int *size);
int rh_mpi_initialized(void);
/* MPI_Finalize, once; later calls do nothing. */
int rh_mpi_finalize(void);
/* MPI_Abort(MPI_COMM_WORLD, code): the whole job stops. */
void rh_mpi_abort(int code);

rh_mpi_comm_t rh_mpi_world(void);
/* Blocking, collective over `comm`: call only once every member is known to be
 * there. Both give communicators that return errors instead of aborting. A
 * color < 0 leaves this rank out (*out is NULL). */
int rh_mpi_comm_split(rh_mpi_comm_t comm, int color, int key, rh_mpi_comm_t *out);
int rh_mpi_comm_dup(rh_mpi_comm_t comm, rh_mpi_comm_t *out);
/* MPI_Comm_idup: *out is set when the request completes (keep it in place) */
int rh_mpi_comm_idup(rh_mpi_comm_t comm, rh_mpi_comm_t *out, rh_mpi_req_t *r);
void rh_mpi_comm_free(rh_mpi_comm_t *comm);
/* The local host's name as MPI says (where rank 0's store is reached). */
int rh_mpi_processor_name(char *out, size_t n);

/* Counts are elements of dtype (bool is one byte). Every call checks that the
 * count fits MPI's int. In-place where the MPI call allows (MPI_IN_PLACE). */
int rh_mpi_iallreduce(rh_mpi_comm_t c, void *buf, size_t count, rh_dtype_t dt, int op, rh_mpi_req_t *r);
int rh_mpi_ireduce(rh_mpi_comm_t c, void *buf, size_t count, rh_dtype_t dt, int op, int root, int me, rh_mpi_req_t *r);
int rh_mpi_ibcast(rh_mpi_comm_t c, void *buf, size_t count, rh_dtype_t dt, int root, rh_mpi_req_t *r);
/* recv holds size x count elements, rank order */
int rh_mpi_iallgather(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, rh_mpi_req_t *r);
/* send holds size x count elements; each rank gets the reduction of its block */
int rh_mpi_ireduce_scatter(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, int op,
                           rh_mpi_req_t *r);
/* recv (size x count) matters only at root */
int rh_mpi_igather(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, int root,
                   rh_mpi_req_t *r);
/* send (size x count) matters only at root */
int rh_mpi_iscatter(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, int root,
                    rh_mpi_req_t *r);
/* send and recv each hold size x count elements: block i of send goes to rank i,
 * block i of recv comes from rank i */
int rh_mpi_ialltoall(rh_mpi_comm_t c, const void *send, void *recv, size_t count, rh_dtype_t dt, rh_mpi_req_t *r);
/* MPI_Ialltoallv with segments packed in rank order: scounts[i] elements of
 * send go to rank i, rcounts[i] elements of recv come from rank i (n = the
 * communicator's size, checked). MPI reads the int counts and displacements
 * while the request runs, so they are written into ints[4 * n], which the
 * caller keeps alive until the request completes. Every count and
 * displacement must fit MPI's int; the error names the rank and the limit. */
int rh_mpi_ialltoallv(rh_mpi_comm_t c, const void *send, const size_t *scounts, void *recv, const size_t *rcounts,
                      int n, rh_dtype_t dt, int *ints, rh_mpi_req_t *r);
int rh_mpi_ibarrier(rh_mpi_comm_t c, rh_mpi_req_t *r);
int rh_mpi_isend(rh_mpi_comm_t c, const void *buf, size_t bytes, int dst, int tag, rh_mpi_req_t *r);
/* src RH_MPI_ANY_SOURCE receives from whichever rank sends first; rh_mpi_test
 * says which */
#define RH_MPI_ANY_SOURCE (-1) /* Open MPI's MPI_ANY_SOURCE */
int rh_mpi_irecv(rh_mpi_comm_t c, void *buf, size_t bytes, int src, int tag, rh_mpi_req_t *r);

/* MPI_Test: *done becomes 1 when the request completed (it is then freed);
 * *got, when not NULL, the bytes a receive got; *source, when not NULL, the
 * rank (in the request's communicator) a receive got them from, else -1. A
 * failed request is RH_EMPI, with *source set when MPI said who sent (a
 * truncated receive from any rank). */
int rh_mpi_test(rh_mpi_req_t *r, int *done, size_t *got, int *source);

#endif
