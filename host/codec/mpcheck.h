/* mpcheck.h: a bounds check for MessagePack bytes from the network.
 *
 * msgpack-c's decoder trusts container counts: a 5-byte message claiming an array
 * of 2^32 elements makes it allocate 100 GB before reading any. rh_mp_check walks
 * the bytes first, without allocating, and accepts only a sequence of complete
 * values whose every count fits in the bytes that remain and whose nesting stays
 * within max_depth. Only then does the decoder see them. */
#ifndef RH_MPCHECK_H
#define RH_MPCHECK_H

#include <stddef.h>
#include <stdint.h>

enum { RH_MP_OK = 0, RH_MP_TRUNCATED = -1, RH_MP_BADTYPE = -2, RH_MP_TOODEEP = -3, RH_MP_TOOMANY = -4 };

/* Checks that p[0..len) is a sequence of well-formed MessagePack values.
 * Returns RH_MP_OK or a negative RH_MP_* code; *nvalues gets the top-level count. */
int rh_mp_check(const uint8_t *p, size_t len, int max_depth, size_t *nvalues);
/* The same, and for RH_MP_TOOMANY, in *where (may be NULL), the container that
 * claimed too much: a map or an array, its count (entries or elements) and the
 * bytes left after its header (what an error message names). */
typedef struct {
  int is_map;
  uint64_t count;
  size_t left;
} rh_mp_where_t;
int rh_mp_check_where(const uint8_t *p, size_t len, int max_depth, size_t *nvalues, rh_mp_where_t *where);
const char *rh_mp_strerror(int code);

#endif
