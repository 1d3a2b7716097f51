/* frame.c: frame header coding and the incremental frame reader (see frame.h). */
#include "frame.h"

#include <endian.h>
#include <stdlib.h>
#include <string.h>

/* Little-endian fields, each one load or store (and a byte swap on a big-endian
 * host): a header is read several times per frame (peeked, then read), and
 * byte-at-a-time loops made each read about 230 instructions. */
static void put32(uint8_t *p, uint32_t v) {
  v = htole32(v);
  memcpy(p, &v, sizeof v);
}
static void put64(uint8_t *p, uint64_t v) {
  v = htole64(v);
  memcpy(p, &v, sizeof v);
}
static uint32_t get32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return le32toh(v);
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return le64toh(v);
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

int rh_frame_decode_header(const uint8_t in[RH_FRAME_HDR], rh_frame_hdr_t *h, uint64_t max_frame, uint8_t version) {
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
  r->gated = 1;
}

void rh_reader_open_gate(rh_reader_t *r) { r->gated = 0; }

/* The one check every frame passes before its body is looked at: a header, and
 * while gated the handshake rule (see RH_FRAME_HANDSHAKE_MAX). */
static int decode_checked(const rh_reader_t *r, const uint8_t *p, rh_frame_hdr_t *h) {
  int rc = rh_frame_decode_header(p, h, r->max_frame, r->version);
  if (!r->gated || (rc != 0 && rc != RH_EVERSION)) return rc;
  int handshake = h->type == RH_FRAME_HELLO || h->type == RH_FRAME_HELLO_ACK || h->type == RH_FRAME_AUTH ||
                  h->type == RH_FRAME_READY;
  if (!handshake || h->nseg != 0 || h->body_len > RH_FRAME_HANDSHAKE_MAX) return RH_EUNPROVEN;
  return rc;
}

void rh_reader_set_alloc(rh_reader_t *r, rh_seg_alloc_fn alloc, rh_seg_free_fn free_fn, void *ctx) {
  r->alloc = alloc;
  r->free = free_fn;
  r->alloc_ctx = ctx;
}

static void drop_segments(rh_reader_t *r) {
  if (r->owners) {
    for (uint32_t i = 0; i < r->cur.nseg; i++)
      if (r->owners[i] && r->free) r->free(r->alloc_ctx, r->owners[i]);
  }
  free(r->owners);
  free(r->datas);
  r->owners = NULL;
  r->datas = NULL;
  r->in_segs = 0;
}

void rh_reader_free(rh_reader_t *r) {
  drop_segments(r);
  free(r->handed_owners);
  free(r->handed_datas);
  r->handed_owners = NULL;
  r->handed_datas = NULL;
  free(r->buf);
  free(r->seglens_big);
  r->buf = NULL;
  r->seglens_big = NULL;
  r->len = r->off = r->cap = 0;
}

static uint64_t *seglens(rh_reader_t *r, uint32_t nseg) {
  if (nseg <= 64) return r->seglens;
  free(r->seglens_big);
  r->seglens_big = malloc(8ull * nseg);
  return r->seglens_big;
}

int rh_reader_space(rh_reader_t *r, size_t want, uint8_t **p, size_t *avail) {
  if (r->in_segs) {
    /* exactly the rest of the current segment: bytes never cross into the next */
    *p = r->datas[r->seg_i] + r->seg_filled;
    const uint64_t *lens = r->cur.nseg <= 64 ? r->seglens : r->seglens_big;
    *avail = (size_t)(lens[r->seg_i] - r->seg_filled);
    return 0;
  }
  if (r->off > 0 && (r->off == r->len || r->cap - r->len < want)) {
    memmove(r->buf, r->buf + r->off, r->len - r->off);
    r->len -= r->off;
    r->off = 0;
  }
  /* If a frame header is buffered, make room for the whole frame at once (with an
   * allocator, only for its prefix: the segments get buffers of their own). */
  if (r->len - r->off >= RH_FRAME_HDR) {
    rh_frame_hdr_t h;
    if (decode_checked(r, r->buf + r->off, &h) == 0) {
      uint64_t total = rh_frame_total(&h);
      if (r->alloc && h.nseg > 0) total -= h.seg_bytes;
      size_t have = r->len - r->off;
      if (total > have && total - have > want) want = (size_t)(total - have);
    }
  }
  if (r->cap - r->len < want) {
    /* (a stranger gets a buffer for its handshake, not for bulk data) */
    size_t ncap = r->cap ? r->cap : r->gated ? 2 * (RH_FRAME_HDR + RH_FRAME_HANDSHAKE_MAX) : 65536;
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

static void advance_segments(rh_reader_t *r) {
  const uint64_t *lens = r->cur.nseg <= 64 ? r->seglens : r->seglens_big;
  while (r->seg_i < r->cur.nseg && r->seg_filled == lens[r->seg_i]) {
    r->seg_i++;
    r->seg_filled = 0;
  }
}

void rh_reader_commit(rh_reader_t *r, size_t n) {
  if (r->in_segs) {
    r->seg_filled += n;
    advance_segments(r);
    return;
  }
  r->len += n;
}

/* Parses the segment length table of the frame at p; 0 or RH_EBADFRAME/ENOMEM. */
static int read_table(rh_reader_t *r, const rh_frame_hdr_t *h, const uint8_t *p, uint64_t **out) {
  uint64_t *lens = seglens(r, h->nseg);
  if (!lens) return RH_ENOMEM;
  const uint8_t *tab = p + RH_FRAME_HDR + h->body_len;
  uint64_t sum = 0;
  for (uint32_t i = 0; i < h->nseg; i++) {
    lens[i] = get64(tab + 8ull * i);
    if (lens[i] > h->seg_bytes) return RH_EBADFRAME;
    sum += lens[i];
  }
  if (sum != h->seg_bytes) return RH_EBADFRAME;
  *out = lens;
  return 0;
}

static void fill_frame(rh_reader_t *r, rh_frame_t *f, const rh_frame_hdr_t *h, const uint8_t *p, uint64_t *lens) {
  f->hdr = *h;
  f->body = p + RH_FRAME_HDR;
  f->seg_len = lens;
  f->segs = f->body + h->body_len + 8ull * h->nseg;
  f->seg_owner = NULL;
  f->seg_data = NULL;
  (void)r;
}

int rh_reader_peek(const rh_reader_t *r, rh_frame_hdr_t *h) {
  if (r->in_segs || r->len - r->off < RH_FRAME_HDR) return 0;
  return decode_checked(r, r->buf + r->off, h) == 0;
}

int rh_reader_next(rh_reader_t *r, rh_frame_t *f) {
  if (r->in_segs) {
    if (r->seg_i < r->cur.nseg) return 0;
    /* every segment is in: hand the frame out with its owners */
    const uint8_t *p = r->buf + r->off;
    fill_frame(r, f, &r->cur, p, r->cur.nseg <= 64 ? r->seglens : r->seglens_big);
    f->seg_owner = r->owners;
    f->seg_data = r->datas;
    f->segs = NULL;
    /* the owners are the consumer's now; the arrays go at the next call */
    r->handed_owners = r->owners;
    r->handed_datas = r->datas;
    r->owners = NULL;
    r->datas = NULL;
    r->in_segs = 0;
    r->off += r->prefix;
    return 1;
  }
  free(r->handed_owners);
  free(r->handed_datas);
  r->handed_owners = NULL;
  r->handed_datas = NULL;
  size_t have = r->len - r->off;
  if (have < RH_FRAME_HDR) return 0;
  const uint8_t *p = r->buf + r->off;
  rh_frame_hdr_t h;
  int rc = decode_checked(r, p, &h);
  if (rc < 0) {
    f->hdr = h;
    return rc;
  }
  uint64_t total = rh_frame_total(&h);
  size_t prefix = (size_t)(RH_FRAME_HDR + (uint64_t)h.body_len + 8ull * h.nseg);
  if (h.nseg == 0 || !r->alloc) {
    if (have < total) return 0;
    uint64_t *lens = NULL;
    if (h.nseg && (rc = read_table(r, &h, p, &lens)) != 0) return rc;
    fill_frame(r, f, &h, p, lens);
    r->off += (size_t)total;
    return 1;
  }
  if (have < prefix) return 0;
  uint64_t *lens;
  if ((rc = read_table(r, &h, p, &lens)) != 0) return rc;
  /* allocate every segment, move in what is already buffered, read the rest
   * straight into them */
  r->owners = calloc(h.nseg, sizeof(void *));
  r->datas = calloc(h.nseg, sizeof(uint8_t *));
  if (!r->owners || !r->datas) return RH_ENOMEM;
  r->cur = h;
  for (uint32_t i = 0; i < h.nseg; i++) {
    r->owners[i] = r->alloc(r->alloc_ctx, lens[i], &r->datas[i]);
    if (!r->owners[i]) {
      drop_segments(r);
      return RH_ENOMEM;
    }
  }
  size_t extra = have - prefix;
  if (extra > h.seg_bytes) extra = (size_t)h.seg_bytes;
  const uint8_t *src = p + prefix;
  r->seg_i = 0;
  r->seg_filled = 0;
  advance_segments(r); /* empty segments are complete at once */
  size_t left = extra;
  while (left > 0) {
    uint64_t room = lens[r->seg_i] - r->seg_filled;
    size_t n = left < room ? left : (size_t)room;
    memcpy(r->datas[r->seg_i] + r->seg_filled, src, n);
    src += n;
    left -= n;
    r->seg_filled += n;
    advance_segments(r);
  }
  r->in_segs = 1;
  r->prefix = prefix;
  if (have >= total) {
    /* the whole frame was buffered: skip all of it; the bytes after it stay */
    r->prefix = (size_t)total;
    return rh_reader_next(r, f);
  }
  /* the buffer now holds only the prefix */
  r->len = r->off + prefix;
  advance_segments(r);
  return 0;
}
