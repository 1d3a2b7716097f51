/* arena.h: the same-host collective arena: one shared memory file that every
 * rank of a process group on this host maps, through which small collectives
 * (barrier, all_reduce and broadcast up to a slot's size) run without a
 * message: each rank publishes its step in its own slot and reads the others'.
 *
 * Layout (little-endian; every line written by one process only, apart from
 * `sleeping`, which is on a line of its own):
 *
 *   0      u32 magic "RHA1", u32 version, u32 nranks, u32 slot bytes,
 *          16 bytes token (random, known only to the group's ranks)
 *   64     rank 0's slot, then rank 1's, ... each RH_ARENA_STRIDE(slot) bytes:
 *     +0   u64 epoch (the number of this rank's last published step)
 *     +64  signature of an even step: u32 kind, dtype, redop, root; u64 numel
 *     +128 the same for an odd step
 *     +192 u32 sleeping (its owner is about to sleep: whoever publishes rings)
 *     +256 data of an even step (slot bytes), then of an odd step
 *
 * A step: write the signature and data of its parity, then the epoch (release).
 * A rank at step e reads a peer's slot of step e once that peer's epoch is >= e.
 * A peer can be at most one step ahead (step e + 1 needs everyone at e), and
 * its step e + 1 writes the other parity, so step e's data stays intact until
 * every rank has left step e. Epochs and signatures come from other processes
 * and are checked like network bytes: an epoch outside [e - 1, e + 1] is
 * RH_EARENA; every offset is computed from our own step and our own sizes. */
#ifndef RH_ARENA_H
#define RH_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "rh.h"

#define RH_ARENA_MAGIC 0x31414852u /* "RHA1" */
#define RH_ARENA_VERSION 1
#define RH_ARENA_HEADER 64
#define RH_ARENA_TOKEN 16
#define RH_ARENA_STRIDE(slot) (256u + 2u * (uint64_t)(slot))

typedef struct {
  uint32_t kind, dtype, redop, root;
  uint64_t numel;
} rh_arena_sig_t;

typedef struct {
  uint8_t *map;
  size_t size;
  uint32_t n, me, slot;
  uint64_t epoch; /* our last published step */
} rh_arena_t;

/* Bytes of an arena for n ranks with slots of `slot` bytes. */
size_t rh_arena_size(uint32_t n, uint32_t slot);
/* Writes an empty arena into a fresh (zeroed) mapping of rh_arena_size bytes. */
void rh_arena_format(void *map, uint32_t n, uint32_t slot, const uint8_t token[RH_ARENA_TOKEN]);
/* Checks a mapping's header against what this rank expects; RH_EARENA if it
 * does not describe such an arena or fit in `size`. */
int rh_arena_open(rh_arena_t *a, void *map, size_t size, uint32_t n, uint32_t me, uint32_t slot,
                  const uint8_t token[RH_ARENA_TOKEN]);

/* Where our data of step e goes (slot bytes). */
uint8_t *rh_arena_my_data(rh_arena_t *a, uint64_t e);
/* Publishes step a->epoch + 1 with signature s (its data already written) and
 * returns it. Then, for each peer that sleeps, clears its flag and sets
 * wake[i] = 1 (the caller rings it); wake has n entries. */
uint64_t rh_arena_publish(rh_arena_t *a, const rh_arena_sig_t *s, uint8_t *wake);
/* Looks at every peer for step e: 0 when all are there (with the same
 * signature as ours), else the index + 1 of the first that is not; -(index + 1)
 * - 0x10000 when one published step e with another signature (*other set);
 * RH_EARENA - with *bad set - for an impossible epoch. */
int rh_arena_check(rh_arena_t *a, uint64_t e, rh_arena_sig_t *other, int *bad);
/* Peer i's data of step e (which check found complete). */
const uint8_t *rh_arena_data(rh_arena_t *a, uint32_t i, uint64_t e);
/* About to sleep waiting for step e: sets our flag, then checks once more
 * (rh_arena_check's result; on anything but "not all there" the flag is
 * cleared again). */
int rh_arena_sleep(rh_arena_t *a, uint64_t e, rh_arena_sig_t *other, int *bad);
void rh_arena_awake(rh_arena_t *a);

#endif
