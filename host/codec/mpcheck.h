/* mpcheck.h: a bounds check for MessagePack bytes from the network.
 *
 * msgpack-c's decoder trusts container counts: a 5-byte message claiming an array
 * of 2^32 elements makes it allocate 100 GB before reading any. rh_mp_check walks
 * the bytes first, without allocating, and accepts only a sequence of complete
 * values whose every count fits in the bytes that remain and whose nesting stays
 * within max_depth. Only then does the decoder see them. The same walk can sum
 * what the values would cost a decoder, so that one whose bytes would become far
 * more than their size is refused before a single value is made. */
#ifndef RH_MPCHECK_H
#define RH_MPCHECK_H

#include <stddef.h>
#include <stdint.h>

enum {
  RH_MP_OK = 0,
  RH_MP_TRUNCATED = -1,
  RH_MP_BADTYPE = -2,
  RH_MP_TOODEEP = -3,
  RH_MP_TOOMANY = -4,
  RH_MP_TOOCOSTLY = -5
};

/* Checks that p[0..len) is a sequence of well-formed MessagePack values.
 * Returns RH_MP_OK or a negative RH_MP_* code; *nvalues gets the top-level count. */
int rh_mp_check(const uint8_t *p, size_t len, int max_depth, size_t *nvalues);
/* What the values would cost once decoded, for a decoder that refuses a message
 * before making any of them (its object sizes): a container, each element of an
 * array (n + 1 slots), each node of a map's hash (a power of two, at least 2 and
 * at least its entries), an extension value besides its bytes; a string costs its
 * bytes. A message whose values would cost more than limit is RH_MP_TOOCOSTLY. */
typedef struct {
  size_t table, slot, node, ext, limit;
} rh_mp_costs_t;
/* At least what any len bytes could cost (each byte charged the most it can
 * bring: as a container's or extension's header, as one of a container's
 * values, as a string's or extension's byte): where this is within the limit,
 * no message of len bytes can pass it, and a check without costs tells as much. */
uint64_t rh_mp_cost_bound(size_t len, const rh_mp_costs_t *costs);
/* Where a check failed, for the error message: for RH_MP_TOOMANY the container
 * that claimed too much (a map or an array, its count of entries or elements, the
 * bytes left after its header); for RH_MP_TOOCOSTLY the value that took the cost
 * past the limit ("an array of", count, "elements"). */
typedef struct {
  int is_map;
  uint64_t count;
  size_t left;
  const char *what, *unit;
  uint64_t cost; /* what the values cost (RH_MP_OK), or up to the one refused */
} rh_mp_where_t;
int rh_mp_check_where(const uint8_t *p, size_t len, int max_depth, size_t *nvalues, rh_mp_where_t *where);
/* The check, and with costs (may be NULL) what the values would cost as well. */
int rh_mp_measure(const uint8_t *p, size_t len, int max_depth, const rh_mp_costs_t *costs, size_t *nvalues,
                  rh_mp_where_t *where);
const char *rh_mp_strerror(int code);

#endif
