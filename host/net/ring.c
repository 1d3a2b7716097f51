/* ring.c: shared-memory SPSC byte rings (see ring.h for the layout and the
 * rules). Nothing here trusts a value the peer can write: counters are checked
 * against our own position and capacity each time they are read. */
#include "ring.h"

#include <string.h>

#define RING_STRIDE 256 /* one ring's counters: two 128-byte halves */
#define HALF 128

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

size_t rh_ring_file_size(uint64_t cap) { return RH_RING_DATA_OFF + 2 * (size_t)cap; }

void rh_ring_format(void *map, uint64_t cap) {
  uint8_t *m = map;
  memset(m, 0, RH_RING_DATA_OFF);
  put32(m, RH_RING_MAGIC);
  put32(m + 4, RH_RING_VERSION);
  memcpy(m + 8, &cap, 8);
}

static void view(uint8_t *m, int k, uint64_t cap, rh_ring_t *r) {
  uint8_t *base = m + 64 + RING_STRIDE * k;
  r->tail = (uint64_t *)base;
  r->want_space = (uint32_t *)(base + 8);
  r->jump_from = (uint64_t *)(base + 16);
  r->jump_to = (uint64_t *)(base + 24);
  r->head = (uint64_t *)(base + HALF);
  r->sleeping = (uint32_t *)(base + HALF + 8);
  r->data = m + RH_RING_DATA_OFF + (size_t)cap * k;
  r->cap = cap;
  r->pos = r->seen = r->jfrom = r->jto = 0;
}

int rh_ring_open(void *map, size_t size, int creator, rh_ring_t *tx, rh_ring_t *rx) {
  uint8_t *m = map;
  if (!m || size < RH_RING_DATA_OFF) return RH_ERING;
  uint64_t cap;
  memcpy(&cap, m + 8, 8);
  /* (read once: from here on only our copy of cap is used) */
  if (get32(m) != RH_RING_MAGIC || get32(m + 4) != RH_RING_VERSION || cap < 4096 || (cap & (cap - 1)) != 0 ||
      cap > (1ull << 32) || rh_ring_file_size(cap) > size)
    return RH_ERING;
  view(m, creator ? 0 : 1, cap, tx);
  view(m, creator ? 1 : 0, cap, rx);
  /* a ring starts empty at 0 (the creator formatted it; the attacher may see
   * bytes already written, which it reads from 0 on) */
  return 0;
}

/* Copies between our buffer and the ring at a position, in at most two pieces. */
static void copy_in(rh_ring_t *r, const uint8_t *src, size_t len) {
  size_t off = (size_t)(r->pos & (r->cap - 1));
  size_t first = len < r->cap - off ? len : (size_t)(r->cap - off);
  memcpy(r->data + off, src, first);
  memcpy(r->data, src + first, len - first);
}

static void copy_out(rh_ring_t *r, uint8_t *dst, size_t len) {
  size_t off = (size_t)(r->pos & (r->cap - 1));
  size_t first = len < r->cap - off ? len : (size_t)(r->cap - off);
  memcpy(dst, r->data + off, first);
  memcpy(dst + first, r->data, len - first);
}

/* Free bytes, from a fresh read of the consumer's head; RH_ERING if impossible
 * (ahead of what we wrote, or behind by more than the ring holds). Until the
 * consumer has skipped our last rewind (its head still at jump_from), the bytes
 * jumped over are not held: the whole buffer behind the jump is free. */
static int64_t space(rh_ring_t *r) {
  uint64_t head = __atomic_load_n(r->head, __ATOMIC_ACQUIRE);
  uint64_t used = r->pos - head;
  if (head == r->jfrom && r->jto > r->jfrom) used -= r->jto - r->jfrom;
  if (used > r->cap || head < r->seen) return RH_ERING;
  r->seen = head;
  return (int64_t)(r->cap - used);
}

int rh_ring_rewind(rh_ring_t *r) {
  int64_t free_ = space(r);
  if (free_ < 0) return (int)free_;
  uint64_t off = r->pos & (r->cap - 1);
  if ((uint64_t)free_ != r->cap || off < (r->cap / 4 < 16384 ? r->cap / 4 : 16384)) return 0;
  /* empty: skip the rest of the buffer (the consumer skips it too) */
  r->jfrom = r->pos;
  r->jto = r->pos + (r->cap - off);
  __atomic_store_n(r->jump_from, r->jfrom, __ATOMIC_RELAXED);
  __atomic_store_n(r->jump_to, r->jto, __ATOMIC_RELAXED);
  r->pos = r->jto;
  return 0;
}

int rh_ring_write(rh_ring_t *r, const void *src, size_t len, size_t *put) {
  *put = 0;
  int64_t free_ = space(r);
  if (free_ < 0) return (int)free_;
  size_t n = len < (uint64_t)free_ ? len : (size_t)free_;
  if (n == 0) return 0;
  copy_in(r, src, n);
  r->pos += n;
  /* the bytes (and a jump record) before the counter that says they are there */
  __atomic_store_n(r->tail, r->pos, __ATOMIC_RELEASE);
  *put = n;
  return 0;
}

int rh_ring_wake_needed(rh_ring_t *r) {
  /* (the full fence orders our tail store before the load of the flag: see ring.h) */
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(r->sleeping, __ATOMIC_RELAXED) == 0) return 0;
  return __atomic_exchange_n(r->sleeping, 0, __ATOMIC_ACQ_REL) != 0;
}

int rh_ring_wait_space(rh_ring_t *r) {
  __atomic_store_n(r->want_space, 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  int64_t s = space(r);
  if (s != 0) {
    /* space freed meanwhile (or the ring is corrupt: the caller finds out on
     * its next write) */
    __atomic_store_n(r->want_space, 0, __ATOMIC_RELAXED);
    return 0;
  }
  return 1;
}

int64_t rh_ring_avail(rh_ring_t *r) {
  uint64_t tail = __atomic_load_n(r->tail, __ATOMIC_ACQUIRE);
  if (tail != r->pos && __atomic_load_n(r->jump_from, __ATOMIC_RELAXED) == r->pos) {
    /* the producer rewound from here: skip to its jump_to, when that is the
     * next offset 0 at most one buffer on and no further than what it has
     * published (a record being written for a tail we have not seen yet waits
     * for our next look) */
    uint64_t to = __atomic_load_n(r->jump_to, __ATOMIC_RELAXED);
    if (to > r->pos && to - r->pos <= r->cap && (to & (r->cap - 1)) == 0 && to <= tail) {
      r->pos = to;
      __atomic_store_n(r->head, r->pos, __ATOMIC_RELEASE);
    }
  }
  uint64_t held = tail - r->pos;
  if (held > r->cap || tail < r->seen) return RH_ERING;
  r->seen = tail;
  return (int64_t)held;
}

void rh_ring_read(rh_ring_t *r, void *dst, size_t len) {
  copy_out(r, dst, len);
  r->pos += len;
  /* our reads of the bytes before the store that lets the producer reuse them */
  __atomic_store_n(r->head, r->pos, __ATOMIC_RELEASE);
}

int rh_ring_space_wanted(rh_ring_t *r) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(r->want_space, __ATOMIC_RELAXED) == 0) return 0;
  return __atomic_exchange_n(r->want_space, 0, __ATOMIC_ACQ_REL) != 0;
}

int rh_ring_sleep(rh_ring_t *r) {
  __atomic_store_n(r->sleeping, 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  int64_t n = rh_ring_avail(r);
  if (n == 0) return 1;
  __atomic_store_n(r->sleeping, 0, __ATOMIC_RELAXED);
  return n < 0 ? (int)n : 0;
}

void rh_ring_awake(rh_ring_t *r) {
  if (__atomic_load_n(r->sleeping, __ATOMIC_RELAXED)) __atomic_store_n(r->sleeping, 0, __ATOMIC_RELAXED);
}
