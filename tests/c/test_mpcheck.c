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
  /* costs: [1, "ab", {nil: true}] is an array of 3 (table + 4 slots), a string of 2,
   * a map of 1 (table + 2 nodes); 7 costs nothing */
  rh_mp_costs_t c = {.table = 64, .slot = 8, .node = 24, .ext = 24, .limit = 1000};
  CHECK(rh_mp_measure((const uint8_t *)ok, sizeof ok - 1, 32, &c, &n, &w) == RH_MP_OK && n == 2);
  CHECK(w.cost == 64 + 4 * 8 + 2 + 64 + 2 * 24);
  /* fixext1 and ext8 of 3 bytes: 24 besides each payload */
  CHECK(rh_mp_measure((const uint8_t *)"\xd4\x01\x02\xc7\x03\x05xyz", 9, 32, &c, &n, &w) == RH_MP_OK);
  CHECK(w.cost == 24 + 1 + 24 + 3);
  /* 100 empty arrays in one: refused at the third (64 + 101 * 8 = 872, then 64 each),
   * before anything was made of them, naming the value */
  char empties[106];
  memcpy(empties, "\xdc\x00\x64", 3);
  memset(empties + 3, 0x90, 100);
  CHECK(rh_mp_measure((const uint8_t *)empties, 103, 32, &c, &n, &w) == RH_MP_TOOCOSTLY);
  CHECK(strcmp(w.what, "an array of") == 0 && strcmp(w.unit, "elements") == 0 && w.count == 0);
  CHECK(w.cost == 872 + 2 * 64);
  /* a map of 5 entries: 8 nodes */
  CHECK(rh_mp_measure((const uint8_t *)"\x85\x01\xc0\x02\xc0\x03\xc0\x04\xc0\x05\xc0", 11, 32, &c, &n, &w) == RH_MP_OK);
  CHECK(w.cost == 64 + 8 * 24);
  c.limit = 64 + 8 * 24 - 1;
  CHECK(rh_mp_measure((const uint8_t *)"\x85\x01\xc0\x02\xc0\x03\xc0\x04\xc0\x05\xc0", 11, 32, &c, &n, &w) ==
        RH_MP_TOOCOSTLY);
  CHECK(strcmp(w.what, "a map of") == 0 && w.count == 5 && w.cost == 0);
  /* a count the bytes cannot back stays RH_MP_TOOMANY (that message names it) */
  CHECK(rh_mp_measure((const uint8_t *)"\xdd\xff\xff\xff\xff", 5, 32, &c, &n, &w) == RH_MP_TOOMANY);
  /* the bound on what any bytes cost holds for the costliest shapes per byte:
   * empty arrays and maps, maps of one entry, arrays of one element, nested
   * full fixarrays, one-byte extensions */
  {
    rh_mp_costs_t big = c;
    big.limit = SIZE_MAX;
    static uint8_t buf[4096];
    const struct {
      const char *unit;
      size_t len;
    } shapes[] = {{"\x90", 1}, {"\x80", 1}, {"\x81\x90\x90", 3}, {"\x91\x90", 2}, {"\xd4\x01\x02", 3}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
      size_t len = 0;
      memcpy(buf, "\xdc\x04\x00", 3); /* an array of 1,024 of them */
      len = 3;
      for (int i = 0; i < 1024 && len + shapes[k].len <= sizeof buf; i++, len += shapes[k].len)
        memcpy(buf + len, shapes[k].unit, shapes[k].len);
      if (len < 3 + 1024 * shapes[k].len) continue;
      CHECK(rh_mp_measure(buf, len, 32, &big, &n, &w) == RH_MP_OK);
      CHECK(w.cost <= rh_mp_cost_bound(len, &big));
    }
    /* fixarrays of 15 in fixarrays of 15, three deep, around empty arrays */
    {
      size_t len = 0;
      buf[len++] = 0x9f;
      for (int i = 0; i < 15; i++) {
        buf[len++] = 0x9f;
        for (int j = 0; j < 15; j++) {
          buf[len++] = 0x9f;
          memset(buf + len, 0x90, 15);
          len += 15;
        }
      }
      CHECK(rh_mp_measure(buf, len, 32, &big, &n, &w) == RH_MP_OK);
      CHECK(w.cost <= rh_mp_cost_bound(len, &big));
    }
  }
  /* no costs: the plain check */
  CHECK(rh_mp_measure((const uint8_t *)empties, 103, 32, NULL, &n, &w) == RH_MP_OK);
  return TEST_RESULT();
}
