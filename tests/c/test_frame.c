/* test_frame.c: the frame reader against whole, split, hostile and oversized input. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/frame.h"
#include "test_check.h"

static size_t make_frame(uint8_t *out, uint64_t id, const char *body, const char *seg) {
  rh_frame_hdr_t h = {RH_PROTOCOL_VERSION, 3, 7, id, (uint32_t)strlen(body), seg ? 1 : 0, seg ? strlen(seg) : 0};
  rh_frame_encode_header(out, &h);
  size_t n = RH_FRAME_HDR;
  memcpy(out + n, body, strlen(body));
  n += strlen(body);
  if (seg) {
    uint64_t l = strlen(seg);
    for (int i = 0; i < 8; i++) out[n + i] = (uint8_t)(l >> (8 * i));
    n += 8;
    memcpy(out + n, seg, l);
    n += l;
  }
  return n;
}

static int live_allocs;
static void *test_alloc(void *ctx, uint64_t len, uint8_t **data) {
  (void)ctx;
  live_allocs++;
  *data = malloc(len ? len : 1);
  return *data;
}
static void test_free(void *ctx, void *owner) {
  (void)ctx;
  live_allocs--;
  free(owner);
}

static void feed(rh_reader_t *r, const uint8_t *p, size_t n) {
  uint8_t *dst;
  size_t avail;
  CHECK(rh_reader_space(r, n, &dst, &avail) == 0);
  CHECK(avail >= n);
  memcpy(dst, p, n);
  rh_reader_commit(r, n);
}

int main(void) {
  uint8_t buf[1024];
  size_t n1 = make_frame(buf, 42, "hello", NULL);
  size_t n2 = make_frame(buf + n1, 43, "x", "segment!");
  rh_reader_t r;
  rh_frame_t f;

  /* byte by byte: no frame until the last byte of each */
  rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  int got = 0;
  for (size_t i = 0; i < n1 + n2; i++) {
    feed(&r, buf + i, 1);
    while (rh_reader_next(&r, &f) == 1) {
      got++;
      if (got == 1) {
        CHECK(f.hdr.id == 42 && f.hdr.type == 3 && f.hdr.flags == 7);
        CHECK(f.hdr.body_len == 5 && memcmp(f.body, "hello", 5) == 0);
        CHECK(i == n1 - 1);
      } else {
        CHECK(f.hdr.id == 43 && f.hdr.nseg == 1 && f.seg_len[0] == 8);
        CHECK(memcmp(f.segs, "segment!", 8) == 0);
      }
    }
  }
  CHECK(got == 2);
  rh_reader_free(&r);

  /* garbage: bad magic */
  rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  feed(&r, (const uint8_t *)"GET / HTTP/1.1\r\nHost: x\r\n\r\n.....", 32);
  CHECK(rh_reader_next(&r, &f) == RH_EBADMAGIC);
  rh_reader_free(&r);

  /* other protocol version: reported with the peer's version */
  rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  uint8_t v[64];
  make_frame(v, 1, "a", NULL);
  v[4] = 9;
  v[5] = 3; /* not a handshake frame */
  feed(&r, v, RH_FRAME_HDR + 1);
  CHECK(rh_reader_next(&r, &f) == RH_EVERSION && f.hdr.version == 9);
  rh_reader_free(&r);

  /* oversized and inconsistent lengths are refused before any allocation */
  rh_reader_init(&r, 1024, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  rh_frame_hdr_t h = {RH_PROTOCOL_VERSION, 1, 0, 1, 4000, 0, 0};
  rh_frame_encode_header(v, &h);
  feed(&r, v, RH_FRAME_HDR);
  CHECK(rh_reader_next(&r, &f) == RH_ETOOBIG);
  rh_reader_free(&r);
  rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  h = (rh_frame_hdr_t){RH_PROTOCOL_VERSION, 1, 0, 1, 0, 0, 5};
  rh_frame_encode_header(v, &h);
  feed(&r, v, RH_FRAME_HDR);
  CHECK(rh_reader_next(&r, &f) == RH_EBADFRAME);
  rh_reader_free(&r);
  rh_reader_init(&r, ~0ull, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  h = (rh_frame_hdr_t){RH_PROTOCOL_VERSION, 1, 0, 1, 0, 2, ~0ull - 8};
  rh_frame_encode_header(v, &h);
  feed(&r, v, RH_FRAME_HDR);
  CHECK(rh_reader_next(&r, &f) <= 0);
  rh_reader_free(&r);

  /* segment lengths that do not add up */
  rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
  rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
  size_t n = make_frame(v, 5, "", "abcd");
  v[RH_FRAME_HDR] = 3; /* claims 3, header says 4 */
  feed(&r, v, n);
  CHECK(rh_reader_next(&r, &f) == RH_EBADFRAME);
  rh_reader_free(&r);

  /* segment mode: segments land in their own buffers whatever the chunking */
  for (size_t chunk = 1; chunk <= 64; chunk = chunk * 2 + 1) {
    uint8_t wire[256];
    size_t w1 = make_frame(wire, 7, "body", "0123456789abcdef");
    size_t w2 = make_frame(wire + w1, 8, "next", NULL);
    rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
    rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
    rh_reader_set_alloc(&r, test_alloc, test_free, NULL);
    size_t fed = 0;
    int frames = 0;
    while (fed < w1 + w2) {
      uint8_t *dst;
      size_t avail;
      CHECK(rh_reader_space(&r, 1, &dst, &avail) == 0);
      size_t n = chunk < avail ? chunk : avail;
      if (n > w1 + w2 - fed) n = w1 + w2 - fed;
      memcpy(dst, wire + fed, n);
      fed += n;
      rh_reader_commit(&r, n);
      int rc;
      while ((rc = rh_reader_next(&r, &f)) == 1) {
        frames++;
        if (f.hdr.id == 7) {
          CHECK(f.hdr.nseg == 1 && f.seg_owner && f.seg_len[0] == 16);
          CHECK(memcmp(f.seg_data[0], "0123456789abcdef", 16) == 0);
          CHECK(memcmp(f.body, "body", 4) == 0);
          test_free(NULL, f.seg_owner[0]);
        } else {
          CHECK(f.hdr.id == 8 && memcmp(f.body, "next", 4) == 0);
        }
      }
      CHECK(rc == 0);
    }
    CHECK(frames == 2);
    rh_reader_free(&r);
  }
  /* an empty segment completes at once */
  {
    uint8_t wire[256];
    size_t w1 = make_frame(wire, 10, "e", "");
    rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
    rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
    rh_reader_set_alloc(&r, test_alloc, test_free, NULL);
    feed(&r, wire, w1);
    CHECK(rh_reader_next(&r, &f) == 1 && f.hdr.id == 10 && f.hdr.nseg == 1 && f.seg_len[0] == 0);
    if (f.seg_owner) test_free(NULL, f.seg_owner[0]);
    rh_reader_free(&r);
  }
  /* a connection that dies mid-segment frees what was allocated */
  {
    uint8_t wire[256];
    size_t w1 = make_frame(wire, 9, "b", "segment-bytes");
    rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
    rh_reader_open_gate(&r); /* (these frames come from a proven peer) */
    rh_reader_set_alloc(&r, test_alloc, test_free, NULL);
    feed(&r, wire, w1 - 4);
    CHECK(rh_reader_next(&r, &f) == 0);
    rh_reader_free(&r);
    CHECK(live_allocs == 0);
  }
  /* the gate: before the proof only small handshake frames pass, each checked
   * from its header alone (nothing of its body is buffered or allocated) */
  {
    static const struct {
      uint8_t type;
      uint32_t body_len, nseg;
      uint64_t seg_bytes;
      int ok;
    } cases[] = {
        {RH_FRAME_HELLO, 100, 0, 0, 1},
        {RH_FRAME_HELLO_ACK, 100, 0, 0, 1},
        {RH_FRAME_AUTH, 100, 0, 0, 1},
        {RH_FRAME_READY, RH_FRAME_HANDSHAKE_MAX, 0, 0, 1},
        {RH_FRAME_HELLO, RH_FRAME_HANDSHAKE_MAX + 1, 0, 0, 0},
        {RH_FRAME_HELLO, 256u << 20, 0, 0, 0},
        {RH_FRAME_HELLO, 10, 1, 64, 0},
        {3 /* request */, 10, 0, 0, 0},
        {4 /* response */, 10, 0, 0, 0},
        {3, 0, 1, 64ull << 20, 0},
        {10 /* store */, 10, 0, 0, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
      rh_frame_hdr_t h = {RH_PROTOCOL_VERSION, cases[k].type,     0, 1, cases[k].body_len,
                          cases[k].nseg,       cases[k].seg_bytes};
      uint8_t hdr[RH_FRAME_HDR];
      rh_frame_encode_header(hdr, &h);
      rh_reader_init(&r, 8ull << 30, RH_PROTOCOL_VERSION);
      rh_reader_set_alloc(&r, test_alloc, test_free, NULL);
      feed(&r, hdr, sizeof hdr);
      int rc = rh_reader_next(&r, &f);
      CHECK(cases[k].ok ? rc == 0 : rc == RH_EUNPROVEN);
      CHECK(r.cap <= 2 * (RH_FRAME_HDR + RH_FRAME_HANDSHAKE_MAX)); /* a stranger's buffer stays small */
      CHECK(live_allocs == 0);
      rh_reader_free(&r);
    }
    /* once open, the same request frame passes */
    size_t w = make_frame(buf, 5, "req", NULL);
    rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
    feed(&r, buf, w);
    CHECK(rh_reader_next(&r, &f) == RH_EUNPROVEN);
    rh_reader_free(&r);
    rh_reader_init(&r, 1 << 20, RH_PROTOCOL_VERSION);
    feed(&r, buf, w);
    rh_reader_open_gate(&r);
    CHECK(rh_reader_next(&r, &f) == 1 && f.hdr.id == 5);
    rh_reader_free(&r);
  }

  return TEST_RESULT();
}
