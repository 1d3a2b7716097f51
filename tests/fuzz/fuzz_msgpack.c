/* fuzz_msgpack.c: libFuzzer harness for the bounds check of bytes from the
 * network (rh_mp_check), and msgpack-c's decoder on what passes it: whatever
 * the check lets through is well-formed MessagePack that a standard decoder
 * reads within bounds. (The codec's own decoder into Lua values, which runs
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
