/* frame.h: the wire framing shared by every rpchost connection.
 *
 * A frame is a fixed 32-byte little-endian header, an encoded body (MessagePack,
 * produced by the codec), then `nseg` raw payload segments: first their lengths
 * (nseg x u64), then their bytes. Segments carry bulk data (tensor storage) so that
 * it can be written straight from memory and never goes through the codec.
 *
 *   0 u32 magic "RHF1"   4 u8 version   5 u8 type   6 u16 flags
 *   8 u64 id            16 u32 body_len 20 u32 nseg 24 u64 seg_bytes
 *
 * The reader accumulates bytes and hands out whole frames; it checks every length
 * against the configured maximum before trusting it (bytes from the network are
 * never asserted on). */
#ifndef RH_FRAME_H
#define RH_FRAME_H

#include "rh.h"

#define RH_FRAME_HDR 32
#define RH_FRAME_MAGIC 0x31464852u /* "RHF1" read as little-endian u32 */
#define RH_FRAME_MAX_SEGS 4096
/* The handshake frames keep their layout in every protocol version, so a peer of
 * another version is told so (naming both versions) instead of being cut off. */
#define RH_FRAME_HELLO 1
#define RH_FRAME_HELLO_ACK 2
/* The rest of the handshake: the client's proof, and the server's verdict. */
#define RH_FRAME_AUTH 6
#define RH_FRAME_READY 7
/* Until a connection's peer has proved itself (rh_reader_t.gate), only these four
 * types pass, each with a body of at most this many bytes and no segments:
 * anything else ends the connection before its body is read or buffered, and
 * nothing larger is ever allocated for a stranger. */
#define RH_FRAME_HANDSHAKE_MAX 4096
/* Header-only frames of the same-host rings (conn_ring.c), never handed to an
 * owner: a marker in a ring stands for the next frame on the socket; a doorbell
 * on the socket wakes a peer that sleeps on its rings. */
#define RH_FRAME_RING_MARK 30
#define RH_FRAME_RING_WAKE 31

typedef struct {
  uint8_t version;
  uint8_t type;
  uint16_t flags;
  uint64_t id;
  uint32_t body_len;
  uint32_t nseg;
  uint64_t seg_bytes;
} rh_frame_hdr_t;

/* Segment buffers: with an allocator set, the reader reads each segment straight
 * into memory it asks for (a tensor storage, say), so bulk bytes are never copied
 * through the frame buffer. alloc returns an owner handle and sets *data; free
 * drops an owner the frame's consumer never took (connection died mid-frame). */
typedef void *(*rh_seg_alloc_fn)(void *ctx, uint64_t len, uint8_t **data);
typedef void (*rh_seg_free_fn)(void *ctx, void *owner);

/* A complete frame; valid until the next reader call. */
typedef struct {
  rh_frame_hdr_t hdr;
  const uint8_t *body;
  const uint64_t *seg_len; /* nseg lengths */
  const uint8_t *segs;     /* without an allocator: the segment bytes, back to back */
  void **seg_owner;        /* with an allocator: one owner per segment, the consumer's now */
  uint8_t **seg_data;
} rh_frame_t;

typedef struct {
  uint8_t *buf;
  size_t len; /* bytes held */
  size_t off; /* bytes already handed out (compacted lazily) */
  size_t cap;
  uint64_t max_frame;    /* largest total frame accepted */
  uint8_t version;       /* the protocol version spoken here */
  int gated;             /* the peer has not proved itself: handshake frames only */
  uint64_t seglens[64];  /* lengths of the current frame's segments */
  uint64_t *seglens_big; /* used when a frame has more than 64 segments */
  /* segment mode: the prefix (header, body, lengths) is buffered at off, and the
   * segments are being read into their own buffers */
  rh_seg_alloc_fn alloc;
  rh_seg_free_fn free;
  void *alloc_ctx;
  int in_segs;
  rh_frame_hdr_t cur;
  size_t prefix;
  uint32_t seg_i;
  uint64_t seg_filled;
  void **owners;
  uint8_t **datas;
  void **handed_owners; /* arrays of the last frame handed out */
  uint8_t **handed_datas;
} rh_reader_t;

void rh_frame_encode_header(uint8_t out[RH_FRAME_HDR], const rh_frame_hdr_t *h);
/* Parses and validates a header. Returns 0, RH_EBADMAGIC, RH_EVERSION (h->version
 * then holds the peer's version; never for the handshake types), RH_ETOOBIG or
 * RH_EBADFRAME. */
int rh_frame_decode_header(const uint8_t in[RH_FRAME_HDR], rh_frame_hdr_t *h, uint64_t max_frame, uint8_t version);
/* Header + body + segment table + segments. */
uint64_t rh_frame_total(const rh_frame_hdr_t *h);

void rh_reader_init(rh_reader_t *r, uint64_t max_frame, uint8_t version);
void rh_reader_set_alloc(rh_reader_t *r, rh_seg_alloc_fn alloc, rh_seg_free_fn free, void *ctx);
void rh_reader_free(rh_reader_t *r);
/* Space to read into: at least `want` bytes. Returns RH_ENOMEM on failure. */
int rh_reader_space(rh_reader_t *r, size_t want, uint8_t **p, size_t *avail);
void rh_reader_commit(rh_reader_t *r, size_t n);
/* Opens the gate: the peer proved itself, every frame type passes from now on. */
void rh_reader_open_gate(rh_reader_t *r);
/* 1 with *h set when a whole header that passes the gate starts the buffered
 * bytes (at a frame boundary); 0 otherwise. Nothing is consumed. */
int rh_reader_peek(const rh_reader_t *r, rh_frame_hdr_t *h);
/* 1: *f holds a frame; 0: more bytes needed; <0: the stream is bad (close it).
 * A gated reader returns RH_EUNPROVEN for any header the gate does not pass.
 * On RH_EVERSION, f->hdr.version is the peer's version. */
int rh_reader_next(rh_reader_t *r, rh_frame_t *f);

#endif
