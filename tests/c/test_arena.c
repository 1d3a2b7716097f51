/* test_arena.c: the same-host collective arena's layout and checks (arena.c),
 * two ranks in one mapping: a step completes only when both published it with
 * the same signature, data of a step survives the peer's next one (parity),
 * the sleeping flag is seen by the publisher once; and what a hostile or
 * corrupt peer can write (an epoch out of range, another signature, a header
 * of another shape or token) is RH_EARENA or a named mismatch, never a read
 * outside the mapping. */
#include <stdlib.h>
#include <string.h>

#include "net/arena.h"
#include "test_check.h"

#define SLOT 256

int main(void) {
  uint8_t token[RH_ARENA_TOKEN] = {1, 2, 3}, other[RH_ARENA_TOKEN] = {9};
  size_t size = rh_arena_size(2, SLOT);
  uint8_t *m = calloc(1, size);
  rh_arena_format(m, 2, SLOT, token);
  rh_arena_t a, b, x;
  CHECK(rh_arena_open(&a, m, size, 2, 0, SLOT, token) == 0);
  CHECK(rh_arena_open(&b, m, size, 2, 1, SLOT, token) == 0);
  /* another token, shape or a mapping too small for the header's claim */
  CHECK(rh_arena_open(&x, m, size, 2, 0, SLOT, other) == RH_EARENA);
  CHECK(rh_arena_open(&x, m, size, 3, 0, SLOT, token) == RH_EARENA);
  CHECK(rh_arena_open(&x, m, size, 2, 0, SLOT * 2, token) == RH_EARENA);
  CHECK(rh_arena_open(&x, m, size - 1, 2, 0, SLOT, token) == RH_EARENA);
  CHECK(rh_arena_open(&x, m, size, 2, 2, SLOT, token) == RH_EARENA);

  rh_arena_sig_t s = {2, 1, 1, 0, 4}, o;
  uint8_t wake[2];
  int bad = -1;
  memset(rh_arena_my_data(&a, 1), 0xa1, SLOT);
  uint64_t e = rh_arena_publish(&a, &s, wake);
  CHECK(e == 1 && !wake[0] && !wake[1]);
  CHECK(rh_arena_check(&a, 1, &o, &bad) == 2); /* rank 1 is not there yet */
  /* rank 0 sleeps; rank 1's publish sees it once */
  CHECK(rh_arena_sleep(&a, 1, &o, &bad) == 2);
  memset(rh_arena_my_data(&b, 1), 0xb1, SLOT);
  CHECK(rh_arena_publish(&b, &s, wake) == 1 && wake[0] == 1 && wake[1] == 0);
  CHECK(rh_arena_check(&a, 1, &o, &bad) == 0 && rh_arena_check(&b, 1, &o, &bad) == 0);
  CHECK(rh_arena_data(&a, 1, 1)[0] == 0xb1 && rh_arena_data(&b, 0, 1)[SLOT - 1] == 0xa1);
  /* rank 1 runs one step ahead: step 1's data and signature stay intact */
  rh_arena_sig_t s2 = {1, 0, 0, 0, 0};
  memset(rh_arena_my_data(&b, 2), 0xb2, SLOT);
  CHECK(rh_arena_publish(&b, &s2, wake) == 2 && !wake[0]);
  CHECK(rh_arena_check(&a, 1, &o, &bad) == 0);
  CHECK(rh_arena_data(&a, 1, 1)[0] == 0xb1);
  /* rank 0's step 2 is another call: named, with rank 1's signature */
  CHECK(rh_arena_publish(&a, &s, wake) == 2);
  CHECK(rh_arena_check(&a, 2, &o, &bad) == -(1 + 1) - 0x10000 && o.kind == 1 && o.numel == 0);
  /* forged epochs: far ahead, and behind by more than one step */
  uint64_t *peer_epoch = (uint64_t *)(m + RH_ARENA_HEADER + RH_ARENA_STRIDE(SLOT));
  *peer_epoch = 1000;
  CHECK(rh_arena_check(&a, 2, &o, &bad) == RH_EARENA && bad == 1);
  *peer_epoch = UINT64_MAX;
  CHECK(rh_arena_check(&a, 2, &o, &bad) == RH_EARENA);
  *peer_epoch = 0;
  CHECK(rh_arena_check(&a, 2, &o, &bad) == RH_EARENA);
  free(m);
  return TEST_RESULT();
}
