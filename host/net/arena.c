/* arena.c: the same-host collective arena (see arena.h). Only the layout, the
 * publishing and the checks live here; who maps it and how a rank waits (spin,
 * then sleep in the loop) is bindings/l_arena.c and lua/rpchost/net/arena.lua. */
#include "arena.h"

#include <string.h>

#define OFF_EPOCH 0
#define OFF_SIG 64 /* + 64 * parity */
#define OFF_SLEEP 192
#define OFF_DATA 256

typedef struct {
  uint32_t magic, version, n, slot;
  uint8_t token[RH_ARENA_TOKEN];
} header_t;

size_t rh_arena_size(uint32_t n, uint32_t slot) { return RH_ARENA_HEADER + (size_t)n * RH_ARENA_STRIDE(slot); }

void rh_arena_format(void *map, uint32_t n, uint32_t slot, const uint8_t token[RH_ARENA_TOKEN]) {
  header_t h = {RH_ARENA_MAGIC, RH_ARENA_VERSION, n, slot, {0}};
  memcpy(h.token, token, RH_ARENA_TOKEN);
  memcpy(map, &h, sizeof h);
}

int rh_arena_open(rh_arena_t *a, void *map, size_t size, uint32_t n, uint32_t me, uint32_t slot,
                  const uint8_t token[RH_ARENA_TOKEN]) {
  header_t h;
  if (!map || n == 0 || me >= n || size < rh_arena_size(n, slot)) return RH_EARENA;
  memcpy(&h, map, sizeof h);
  if (h.magic != RH_ARENA_MAGIC || h.version != RH_ARENA_VERSION || h.n != n || h.slot != slot ||
      memcmp(h.token, token, RH_ARENA_TOKEN) != 0)
    return RH_EARENA;
  *a = (rh_arena_t){.map = map, .size = size, .n = n, .me = me, .slot = slot, .epoch = 0};
  /* (a rank that maps the arena late starts from what it last published: 0) */
  return 0;
}

static uint8_t *slot_of(rh_arena_t *a, uint32_t i) {
  return a->map + RH_ARENA_HEADER + (size_t)i * RH_ARENA_STRIDE(a->slot);
}
static uint64_t *epoch_of(rh_arena_t *a, uint32_t i) { return (uint64_t *)(slot_of(a, i) + OFF_EPOCH); }
static uint32_t *sleep_of(rh_arena_t *a, uint32_t i) { return (uint32_t *)(slot_of(a, i) + OFF_SLEEP); }
static rh_arena_sig_t *sig_of(rh_arena_t *a, uint32_t i, uint64_t e) {
  return (rh_arena_sig_t *)(slot_of(a, i) + OFF_SIG + 64 * (e & 1));
}

/* rank i's data for step e (even and odd steps alternate halves) */
static uint8_t *data_of(rh_arena_t *a, uint32_t i, uint64_t e) {
  return slot_of(a, i) + OFF_DATA + (size_t)a->slot * (e & 1);
}

uint8_t *rh_arena_my_data(rh_arena_t *a, uint64_t e) { return data_of(a, a->me, e); }

const uint8_t *rh_arena_data(rh_arena_t *a, uint32_t i, uint64_t e) { return data_of(a, i, e); }

uint64_t rh_arena_publish(rh_arena_t *a, const rh_arena_sig_t *s, uint8_t *wake) {
  uint64_t e = a->epoch + 1;
  *sig_of(a, a->me, e) = *s;
  /* the signature and data before the epoch; then (Dekker, with sleep below)
   * a full fence between the epoch's store and the loads of the flags */
  __atomic_store_n(epoch_of(a, a->me), e, __ATOMIC_SEQ_CST);
  a->epoch = e;
  for (uint32_t i = 0; i < a->n; i++) {
    wake[i] = 0;
    if (i == a->me) continue;
    uint32_t *f = sleep_of(a, i);
    if (__atomic_load_n(f, __ATOMIC_SEQ_CST) && __atomic_exchange_n(f, 0, __ATOMIC_SEQ_CST)) wake[i] = 1;
  }
  return e;
}

int rh_arena_check(rh_arena_t *a, uint64_t e, rh_arena_sig_t *other, int *bad) {
  const rh_arena_sig_t *mine = sig_of(a, a->me, e);
  int first = 0;
  for (uint32_t i = 0; i < a->n; i++) {
    if (i == a->me) continue;
    uint64_t pe = __atomic_load_n(epoch_of(a, i), __ATOMIC_ACQUIRE);
    /* a peer is one step behind, here, or one ahead; anything else is forged */
    if (pe + 1 < e || pe > e + 1) {
      *bad = (int)i;
      return RH_EARENA;
    }
    if (pe < e) {
      if (!first) first = (int)i + 1;
      continue;
    }
    rh_arena_sig_t s;
    memcpy(&s, sig_of(a, i, e), sizeof s);
    if (memcmp(&s, mine, sizeof s) != 0) {
      *other = s;
      return -((int)i + 1) - 0x10000;
    }
  }
  return first;
}

int rh_arena_sleep(rh_arena_t *a, uint64_t e, rh_arena_sig_t *other, int *bad) {
  __atomic_store_n(sleep_of(a, a->me), 1, __ATOMIC_SEQ_CST);
  int rc = rh_arena_check(a, e, other, bad);
  if (rc <= 0) rh_arena_awake(a);
  return rc;
}

void rh_arena_awake(rh_arena_t *a) { __atomic_store_n(sleep_of(a, a->me), 0, __ATOMIC_SEQ_CST); }
