/* fuzz_frame.c: libFuzzer harness for the frame reader. The input is split into
 * chunks (sizes taken from the data) and fed as the network would, with segment
 * buffers allocated as the real connection does; every frame handed out is
 * checked to lie inside what was fed, and everything is freed. Bit 6 of the
 * first byte keeps the gate closed (a stranger's stream) or opens it after the
 * first frame, as a handshake would. */
#include <stdlib.h>
#include <string.h>

#include "net/frame.h"

static void *seg_alloc(void *ctx, uint64_t len, uint8_t **data) {
  (void)ctx;
  *data = malloc(len ? len : 1);
  return *data;
}
static void seg_free(void *ctx, void *owner) {
  (void)ctx;
  free(owner);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  size_t chunk = (size_t)data[0] % 61 + 1;
  rh_reader_t r;
  rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
  if (data[0] & 0x80) rh_reader_set_alloc(&r, seg_alloc, seg_free, NULL);
  size_t off = 1;
  while (off < size) {
    uint8_t *dst;
    size_t avail;
    if (rh_reader_space(&r, chunk, &dst, &avail) != 0) break;
    size_t n = size - off < chunk ? size - off : chunk;
    if (n > avail) n = avail;
    memcpy(dst, data + off, n);
    rh_reader_commit(&r, n);
    off += n;
    rh_frame_t f;
    int rc;
    while ((rc = rh_reader_next(&r, &f)) == 1) {
      if (r.gated && (f.hdr.nseg != 0 || f.hdr.body_len > RH_FRAME_HANDSHAKE_MAX)) abort(); /* the gate leaked */
      if (r.gated && !(data[0] & 0x40)) rh_reader_open_gate(&r);
      volatile uint8_t sink = 0;
      for (uint32_t i = 0; i < f.hdr.body_len; i++) sink ^= f.body[i];
      for (uint32_t s = 0; s < f.hdr.nseg; s++) {
        if (f.seg_owner) {
          for (uint64_t i = 0; i < f.seg_len[s]; i++) sink ^= f.seg_data[s][i];
          free(f.seg_owner[s]);
        }
      }
      (void)sink;
    }
    if (rc < 0) break;
  }
  rh_reader_free(&r);
  return 0;
}
