/* ring.h: single-producer/single-consumer byte rings in shared memory.
 *
 * Two ranks on one host that share a connection also share one memory file
 * holding two rings, one per direction. A ring is a byte stream: the producer
 * copies frames (as they would go on the socket) in at its tail, the consumer
 * copies them out at its head and hands them to an ordinary frame reader, so
 * the framing, its limits and the handshake gate are the socket's own
 * (frame.c's decode_checked), and a frame may wrap around the end of the buffer.
 *
 * Layout of the memory file (little-endian, each counter on its own cache line
 * so that the two processes do not write the same line):
 *
 *   0     u32 magic "RHR1", u32 version, u64 cap (bytes of each ring's data)
 *   64    ring 0 (creator -> attacher): tail, want_space, jump_from, jump_to
 *         | head, sleeping
 *   320   ring 1 (attacher -> creator): the same
 *   576   ring 0's data (cap bytes), then ring 1's data (cap bytes)
 *
 * tail and head count bytes ever written / read (u64, never wrap in practice);
 * tail - head is what the ring holds. Each side keeps its own position locally
 * and reads only the other side's counter from shared memory, which it never
 * trusts: a peer that is buggy or hostile can write anything there, so every
 * value read back is checked (0 <= tail - head <= cap) and a violation is
 * RH_ERING, which closes that connection; offsets into the data are always
 * our position modulo our own cap, never a value read from the peer.
 *
 * Rewinding: a producer that finds the ring empty (the consumer has read all it
 * wrote) past 16 KiB (a quarter of a smaller ring) may start its next write at
 * offset 0 instead (rh_ring_rewind): it records the jump (jump_from = its
 * position, jump_to = the next multiple of cap) before publishing the tail, and
 * the consumer, finding itself at jump_from with jump_to within what it may
 * read, skips to jump_to. A stream of
 * small frames then stays in the first pages of the buffer, warm in the cache,
 * instead of walking through all of it and making every page of the memory file
 * resident in both processes (2 MiB a connection). The jumped-over bytes count
 * as written and read, and never as held: until the consumer has skipped, the
 * producer leaves them out of what the ring holds, and the consumer checks what
 * it holds after its skip. A jump record that does not describe a skip of at
 * most cap from where the consumer stands, to an offset 0 at most the tail, is
 * ignored (the bytes are then read as they are). conn_ring.c rewinds before a
 * small frame only: a large one written over the lines the consumer's core has
 * just read pays for taking them back from that core (a 64 KiB echo measured
 * 27 us walking the ring, 35 us rewound) more than it saves.
 *
 * Sleeping (a consumer with nothing to do blocks in the loop instead of
 * polling): the consumer sets `sleeping`, then looks at tail again; the producer
 * publishes tail, then looks at `sleeping`. With a full fence between each
 * store and load (Dekker), at least one of them sees the other's store, so either
 * the consumer stays awake or the producer wakes it (conn_ring.c rings a
 * doorbell on the socket). `want_space` is the same handshake in the other
 * direction: a producer with bytes that do not fit waits for the consumer to
 * free space. */
#ifndef RH_RING_H
#define RH_RING_H

#include <stddef.h>
#include <stdint.h>

#include "rh.h"

#define RH_RING_MAGIC 0x31524852u /* "RHR1" */
#define RH_RING_VERSION 2
#define RH_RING_DATA_OFF 576

/* One direction as one side sees it (local state + pointers into the mapping). */
typedef struct {
  uint64_t *tail, *head;           /* shared counters */
  uint64_t *jump_from, *jump_to;   /* the producer's last rewind (shared) */
  uint32_t *want_space, *sleeping; /* shared flags */
  uint8_t *data;
  uint64_t cap;        /* a power of two, ours (checked against the file once) */
  uint64_t pos;        /* producer: our tail; consumer: our head */
  uint64_t seen;       /* producer: the last head read; consumer: the last tail read */
  uint64_t jfrom, jto; /* producer: our last rewind (what we wrote to jump_from/to) */
} rh_ring_t;

/* Bytes of a memory file holding two rings of `cap` bytes (a power of two). */
size_t rh_ring_file_size(uint64_t cap);
/* Writes an empty pair of rings into a fresh mapping of rh_ring_file_size(cap). */
void rh_ring_format(void *map, uint64_t cap);
/* The two directions of a mapping of `size` bytes, for its creator (creator=1)
 * or the peer it was passed to: tx is the one this side writes. RH_ERING when
 * the header does not describe a ring pair that fits in it (a memory file is
 * rounded up to pages, so it may be longer). */
int rh_ring_open(void *map, size_t size, int creator, rh_ring_t *tx, rh_ring_t *rx);

/* Producer. rh_ring_rewind: where the ring is empty, past 16 KiB (a quarter of
 * a smaller ring), the next write starts at offset 0 (see "Rewinding"); 0, or
 * RH_ERING if the consumer's head is impossible. rh_ring_write copies as much of src as fits (*put says how much)
 * and publishes it; RH_ERING if the consumer's head is impossible. */
int rh_ring_rewind(rh_ring_t *r);
int rh_ring_write(rh_ring_t *r, const void *src, size_t len, size_t *put);
/* After publishing: 1 when the consumer sleeps and must be woken (the flag is
 * cleared, so one wake-up per sleep), 0 otherwise. */
int rh_ring_wake_needed(rh_ring_t *r);
/* The producer has bytes that do not fit: asks to be woken when space frees.
 * Returns 1 when it may wait (the flag is set), 0 when space is there already. */
int rh_ring_wait_space(rh_ring_t *r);

/* Consumer. Bytes ready to read (0 when empty); RH_ERING if the producer's tail
 * is impossible. */
int64_t rh_ring_avail(rh_ring_t *r);
/* Copies len bytes out (len <= what rh_ring_avail said) and frees their space. */
void rh_ring_read(rh_ring_t *r, void *dst, size_t len);
/* After reading: 1 when the producer waits for space and must be woken. */
int rh_ring_space_wanted(rh_ring_t *r);
/* About to block: 1 when the flag is set and the ring is still empty (a
 * producer will wake us), 0 when bytes arrived meanwhile (flag cleared), or
 * RH_ERING. */
int rh_ring_sleep(rh_ring_t *r);
/* Awake again: the producer need not wake us. */
void rh_ring_awake(rh_ring_t *r);

#endif
