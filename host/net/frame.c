/* frame.c: frame header coding and the incremental frame reader (see frame.h). */
#include "frame.h"

#include <stdlib.h>
#include <string.h>

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

void rh_frame_encode_header(uint8_t out[RH_FRAME_HDR], const rh_frame_hdr_t *h) {
  put32(out, RH_FRAME_MAGIC);
  out[4] = h->version;
  out[5] = h->type;
  out[6] = (uint8_t)h->flags;
  out[7] = (uint8_t)(h->flags >> 8);
  put64(out + 8, h->id);
  put32(out + 16, h->body_len);
  put32(out + 20, h->nseg);
  put64(out + 24, h->seg_bytes);
}

uint64_t rh_frame_total(const rh_frame_hdr_t *h) {
  return RH_FRAME_HDR + (uint64_t)h->body_len + 8ull * h->nseg + h->seg_bytes;
}

int rh_frame_decode_header(const uint8_t in[RH_FRAME_HDR], rh_frame_hdr_t *h, uint64_t max_frame,
                           uint8_t version) {
  if (get32(in) != RH_FRAME_MAGIC) return RH_EBADMAGIC;
  h->version = in[4];
  h->type = in[5];
  h->flags = (uint16_t)(in[6] | (in[7] << 8));
  h->id = get64(in + 8);
  h->body_len = get32(in + 16);
  h->nseg = get32(in + 20);
  h->seg_bytes = get64(in + 24);
  if (h->version != version && h->type != RH_FRAME_HELLO && h->type != RH_FRAME_HELLO_ACK) return RH_EVERSION;
  if (h->nseg > RH_FRAME_MAX_SEGS) return RH_EBADFRAME;
  if (h->nseg == 0 && h->seg_bytes != 0) return RH_EBADFRAME;
  /* Each term is bounded before the sum so the sum cannot wrap. */
  if (h->body_len > max_frame || h->seg_bytes > max_frame) return RH_ETOOBIG;
  if (rh_frame_total(h) > max_frame) return RH_ETOOBIG;
  return 0;
}

void rh_reader_init(rh_reader_t *r, uint64_t max_frame, uint8_t version) {
  memset(r, 0, sizeof *r);
  r->max_frame = max_frame;
  r->version = version;
}

void rh_reader_free(rh_reader_t *r) {
  free(r->buf);
  free(r->seglens_big);
  r->buf = NULL;
  r->seglens_big = NULL;
  r->len = r->off = r->cap = 0;
}

int rh_reader_space(rh_reader_t *r, size_t want, uint8_t **p, size_t *avail) {
  if (r->off > 0 && (r->off == r->len || r->cap - r->len < want)) {
    memmove(r->buf, r->buf + r->off, r->len - r->off);
    r->len -= r->off;
    r->off = 0;
  }
  /* If a frame header is buffered, make room for the whole frame at once. */
  if (r->len >= RH_FRAME_HDR) {
    rh_frame_hdr_t h;
    if (rh_frame_decode_header(r->buf, &h, r->max_frame, r->version) == 0) {
      uint64_t total = rh_frame_total(&h);
      if (total > r->len && total - r->len > want) want = (size_t)(total - r->len);
    }
  }
  if (r->cap - r->len < want) {
    size_t ncap = r->cap ? r->cap : 65536;
    while (ncap - r->len < want) ncap *= 2;
    uint8_t *nb = realloc(r->buf, ncap);
    if (!nb) return RH_ENOMEM;
    r->buf = nb;
    r->cap = ncap;
  }
  *p = r->buf + r->len;
  *avail = r->cap - r->len;
  return 0;
}

void rh_reader_commit(rh_reader_t *r, size_t n) { r->len += n; }

int rh_reader_next(rh_reader_t *r, rh_frame_t *f) {
  size_t have = r->len - r->off;
  if (have < RH_FRAME_HDR) return 0;
  const uint8_t *p = r->buf + r->off;
  int rc = rh_frame_decode_header(p, &f->hdr, r->max_frame, r->version);
  if (rc < 0) return rc;
  uint64_t total = rh_frame_total(&f->hdr);
  if (have < total) return 0;
  f->body = p + RH_FRAME_HDR;
  const uint8_t *tab = f->body + f->hdr.body_len;
  uint64_t *lens = r->seglens;
  if (f->hdr.nseg > 64) {
    free(r->seglens_big);
    r->seglens_big = malloc(8ull * f->hdr.nseg);
    if (!r->seglens_big) return RH_ENOMEM;
    lens = r->seglens_big;
  }
  uint64_t sum = 0;
  for (uint32_t i = 0; i < f->hdr.nseg; i++) {
    lens[i] = get64(tab + 8ull * i);
    if (lens[i] > f->hdr.seg_bytes) return RH_EBADFRAME;
    sum += lens[i];
  }
  if (sum != f->hdr.seg_bytes) return RH_EBADFRAME;
  f->seg_len = lens;
  f->segs = tab + 8ull * f->hdr.nseg;
  r->off += (size_t)total;
  return 1;
}
