/* cma.h: cross-memory attach between ranks on one host (process_vm_readv and
 * process_vm_writev): large collectives read and write tensor bytes straight in a
 * peer's memory, without passing them through sockets or shared segments.
 *
 * The kernel lets a process do this to another of the same user when ptrace
 * would be allowed (Yama, seccomp); rpchost proves it per connection at the
 * handshake (rh_cma_probe) and never assumes it. Addresses come from the peers
 * themselves, inside the collective that uses them: a rank's tensor is written
 * only while that rank waits in the same collective for the writes to end. */
#ifndef RH_CMA_H
#define RH_CMA_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "tensor/tensor.h"

/* len bytes at addr in pid's memory into dst (split across the tensor thread
 * pool when large). 0 or a negative errno. */
int rh_cma_read(pid_t pid, void *dst, uintptr_t addr, size_t len);

/* len bytes from src into pid's memory at addr (one thread: the writer is a
 * rank that would otherwise wait). 0 or a negative errno. */
int rh_cma_write(pid_t pid, uintptr_t addr, const void *src, size_t len);

/* Whether `len` bytes at addr in pid read as `want` (*readable) and whether the
 * same bytes can be written back there (*writable: they are written unchanged,
 * so the peer sees nothing). */
void rh_cma_probe(pid_t pid, uintptr_t addr, const void *want, size_t len, int *readable, int *writable);

typedef struct {
  pid_t pid;      /* 0 for this rank itself */
  uintptr_t addr; /* the first byte of the rank's flat tensor in its memory */
} rh_cma_peer_t;

/* The reduce-scatter and all-gather of an all_reduce in one pass over this
 * rank's chunk. The n ranks each hold a contiguous tensor of `numel` elements of
 * dtype dt; ranks[i] says where rank i's is (ranks[me] is `flat`, this rank's
 * own). Chunk i (numel split as evenly as it goes, the first numel % n chunks one
 * element longer) is owned by rank i, which, piece by cache-sized piece, reads
 * the piece from every peer, folds it into its own tensor with op (operands of
 * lower ranks first, so every rank would compute the same bits), divides by
 * `divisor` when it is not 0 (AVG), and writes the result into every peer's
 * tensor. A piece stays in this core's cache from its read to its last write:
 * the chunk crosses memory once in each direction per peer. Every rank must call
 * this at once with the same arguments but `me`, and wait for all the others to
 * return before its tensor is used (the peers write into it until they do).
 * 0, or a negative errno of the first failed transfer (-ESRCH: a peer is gone),
 * with *failed set to the rank it was with, or RH_ENOMEM, or RH_ENOKERNEL (op,
 * or the division of AVG, has no kernel for dt: refused before anything moves). After a failure the
 * other ranks may still be writing into this rank's tensor: they must be heard
 * to stop before it is used or freed. */
int rh_cma_all_reduce(const rh_cma_peer_t *ranks, int n, int me, void *flat, rh_dtype_t dt, int64_t numel,
                      rh_binop_t op, double divisor, int *failed);

#endif
