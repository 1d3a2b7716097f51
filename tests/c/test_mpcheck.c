/* test_mpcheck.c: the MessagePack bounds check against valid, truncated, deep and
 * count-inflated input. */
#include <stdio.h>
#include <string.h>

#include "codec/mpcheck.h"
#include "test_check.h"

static int check(const char *bytes, size_t n, size_t *count) {
  return rh_mp_check((const uint8_t *)bytes, n, 32, count);
}

int main(void) {
  size_t n = 0;
  /* [1, "ab", {nil: true}], 7 */
  const char ok[] = "\x93\x01\xa2\x61\x62\x81\xc0\xc3\x07";
  CHECK(check(ok, sizeof ok - 1, &n) == RH_MP_OK && n == 2);
  CHECK(check("", 0, &n) == RH_MP_OK && n == 0);
  /* every proper prefix is truncated */
  for (size_t cut = 1; cut < sizeof ok - 2; cut++) { /* the last cut ends after a whole value */
    int rc = check(ok, cut, &n);
    CHECK(rc == RH_MP_TRUNCATED || rc == RH_MP_TOOMANY);
  }
  /* array32 claiming 2^32-1 elements in 5 bytes */
  CHECK(check("\xdd\xff\xff\xff\xff", 5, &n) == RH_MP_TOOMANY);
  /* map32 claiming 2^31 pairs */
  CHECK(check("\xdf\x80\x00\x00\x00\x01", 6, &n) == RH_MP_TOOMANY);
  /* ... and where: the claimed count, the bytes that follow the header */
  rh_mp_where_t w = {0};
  CHECK(rh_mp_check_where((const uint8_t *)"\xdf\x80\x00\x00\x00\x01", 6, 32, &n, &w) == RH_MP_TOOMANY);
  CHECK(w.is_map == 1 && w.count == UINT64_C(1) << 31 && w.left == 1);
  /* an inner array claiming more than the bytes left after it: [[ 3 elements ], 1] in 4 bytes */
  CHECK(rh_mp_check_where((const uint8_t *)"\x92\x93\x01\x02", 4, 32, &n, &w) == RH_MP_TOOMANY);
  CHECK(w.is_map == 0 && w.count == 3 && w.left == 2);
  /* str32 longer than the message */
  CHECK(check("\xdb\x00\x00\x10\x00xyz", 8, &n) == RH_MP_TRUNCATED);
  /* ext32 longer than the message */
  CHECK(check("\xc9\xff\xff\xff\xf0\x01", 6, &n) == RH_MP_TRUNCATED);
  /* the reserved byte */
  CHECK(check("\xc1", 1, &n) == RH_MP_BADTYPE);
  /* nesting: 40 one-element arrays around nil */
  char deep[64];
  memset(deep, 0x91, 40);
  deep[40] = (char)0xc0;
  CHECK(check(deep, 41, &n) == RH_MP_TOODEEP);
  CHECK(check(deep + 10, 31, &n) == RH_MP_OK); /* 30 levels are fine */
  /* fixext and floats */
  CHECK(check("\xd4\x01\x02\xcb\x00\x00\x00\x00\x00\x00\xf0\x3f", 12, &n) == RH_MP_OK && n == 2);
  return TEST_RESULT();
}
