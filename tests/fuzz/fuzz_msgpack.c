/* fuzz_msgpack.c: libFuzzer harness for the bounds check of bytes from the
 * network (rh_mp_check), and msgpack-c's decoder on what passes it: whatever
 * the check lets through is well-formed MessagePack that a standard decoder
 * reads within bounds, and what it would cost stays within rh_mp_cost_bound.
 * (The codec's own decoder into Lua values, which runs
 * after the check, has its harness in fuzz_codec.c.) Nothing may
 * crash, leak or allocate without bound. */
#include <msgpack.h>

#include "codec/mpcheck.h"

static int depth_walk(const msgpack_object *o, int depth) {
  if (depth > 40) return -1;
  if (o->type == MSGPACK_OBJECT_ARRAY)
    for (uint32_t i = 0; i < o->via.array.size; i++) depth_walk(&o->via.array.ptr[i], depth + 1);
  if (o->type == MSGPACK_OBJECT_MAP)
    for (uint32_t i = 0; i < o->via.map.size; i++) {
      depth_walk(&o->via.map.ptr[i].key, depth + 1);
      depth_walk(&o->via.map.ptr[i].val, depth + 1);
    }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  size_t n;
  if (rh_mp_check(data, size, 32, &n) != RH_MP_OK) return 0;
  /* what any bytes cost stays within the bound that lets the decoder skip the
   * sum for short messages */
  rh_mp_costs_t costs = {.table = 64, .slot = 8, .node = 24, .ext = 24, .limit = SIZE_MAX};
  rh_mp_where_t w = {0};
  if (rh_mp_measure(data, size, 32, &costs, NULL, &w) != RH_MP_OK || w.cost > rh_mp_cost_bound(size, &costs))
    __builtin_trap();
  msgpack_unpacked u;
  msgpack_unpacked_init(&u);
  size_t off = 0;
  while (off < size) {
    msgpack_unpack_return rc = msgpack_unpack_next(&u, (const char *)data, size, &off);
    if (rc != MSGPACK_UNPACK_SUCCESS && rc != MSGPACK_UNPACK_EXTRA_BYTES) break;
    depth_walk(&u.data, 0);
  }
  msgpack_unpacked_destroy(&u);
  return 0;
}
