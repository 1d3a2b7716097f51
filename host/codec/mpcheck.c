/* mpcheck.c: see mpcheck.h. One pass, no allocation, an explicit stack. */
#include "mpcheck.h"

#define MAX_STACK 256

static uint64_t be(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v = (v << 8) | p[i];
  return v;
}

const char *rh_mp_strerror(int code) {
  switch (code) {
    case RH_MP_OK: return "ok";
    case RH_MP_TRUNCATED: return "truncated";
    case RH_MP_BADTYPE: return "not MessagePack (reserved type byte)";
    case RH_MP_TOODEEP: return "nested too deeply";
    case RH_MP_TOOMANY: return "a container claims more elements than the message has bytes";
    case RH_MP_TOOCOSTLY: return "its values would cost more than the decoder allows";
    default: return "malformed";
  }
}

int rh_mp_check(const uint8_t *p, size_t len, int max_depth, size_t *nvalues) {
  return rh_mp_check_where(p, len, max_depth, nvalues, NULL);
}

int rh_mp_check_where(const uint8_t *p, size_t len, int max_depth, size_t *nvalues, rh_mp_where_t *where) {
  return rh_mp_measure(p, len, max_depth, NULL, nvalues, where);
}

/* what a value is, as far as its cost in Lua goes */
enum { K_SCALAR, K_MAP, K_ARRAY, K_STRING, K_EXT, K_BAD };

/* What each header byte says, read from a table (one load, where a chain of
 * range tests took a fifth of the walk): its kind; `len`, the bytes of the
 * length field that follows it (0, 1, 2 or 4); `fix`, the count it carries
 * itself (b & fix: a fixmap's entries, a fixarray's elements, a fixstr's
 * bytes); `skip`, the bytes after it that a scalar or a fixext takes (its type
 * byte included). */
typedef struct {
  uint8_t kind, len, fix, skip;
} head_t;

#define H(k, l, f, s) \
  { k, l, f, s }
#define X4(...) __VA_ARGS__, __VA_ARGS__, __VA_ARGS__, __VA_ARGS__
#define X16(...) X4(__VA_ARGS__), X4(__VA_ARGS__), X4(__VA_ARGS__), X4(__VA_ARGS__)
#define SCALAR H(K_SCALAR, 0, 0, 0)
static const head_t HEAD[] = {
    /* 0x00-0x7f positive fixint */
    X16(SCALAR),
    X16(SCALAR),
    X16(SCALAR),
    X16(SCALAR),
    X16(SCALAR),
    X16(SCALAR),
    X16(SCALAR),
    X16(SCALAR),
    X16(H(K_MAP, 0, 0x0f, 0)),    /* 0x80-0x8f fixmap */
    X16(H(K_ARRAY, 0, 0x0f, 0)),  /* 0x90-0x9f fixarray */
    X16(H(K_STRING, 0, 0x1f, 0)), /* 0xa0-0xbf fixstr */
    X16(H(K_STRING, 0, 0x1f, 0)),
    SCALAR,            /* 0xc0 nil */
    H(K_BAD, 0, 0, 0), /* 0xc1 never used */
    SCALAR,
    SCALAR,               /* 0xc2, 0xc3 false, true */
    H(K_STRING, 1, 0, 0), /* 0xc4 bin8 */
    H(K_STRING, 2, 0, 0), /* 0xc5 bin16 */
    H(K_STRING, 4, 0, 0), /* 0xc6 bin32 */
    H(K_EXT, 1, 0, 1),    /* 0xc7 ext8: length, then type + data */
    H(K_EXT, 2, 0, 1),    /* 0xc8 ext16 */
    H(K_EXT, 4, 0, 1),    /* 0xc9 ext32 */
    H(K_SCALAR, 0, 0, 4), /* 0xca float32 */
    H(K_SCALAR, 0, 0, 8), /* 0xcb float64 */
    H(K_SCALAR, 0, 0, 1), /* 0xcc uint8 */
    H(K_SCALAR, 0, 0, 2), /* 0xcd uint16 */
    H(K_SCALAR, 0, 0, 4), /* 0xce uint32 */
    H(K_SCALAR, 0, 0, 8), /* 0xcf uint64 */
    H(K_SCALAR, 0, 0, 1), /* 0xd0 int8 */
    H(K_SCALAR, 0, 0, 2), /* 0xd1 int16 */
    H(K_SCALAR, 0, 0, 4), /* 0xd2 int32 */
    H(K_SCALAR, 0, 0, 8), /* 0xd3 int64 */
    H(K_EXT, 0, 0, 2),    /* 0xd4 fixext1: type + 1 */
    H(K_EXT, 0, 0, 3),    /* 0xd5 fixext2 */
    H(K_EXT, 0, 0, 5),    /* 0xd6 fixext4 */
    H(K_EXT, 0, 0, 9),    /* 0xd7 fixext8 */
    H(K_EXT, 0, 0, 17),   /* 0xd8 fixext16 */
    H(K_STRING, 1, 0, 0), /* 0xd9 str8 */
    H(K_STRING, 2, 0, 0), /* 0xda str16 */
    H(K_STRING, 4, 0, 0), /* 0xdb str32 */
    H(K_ARRAY, 2, 0, 0),  /* 0xdc array16 */
    H(K_ARRAY, 4, 0, 0),  /* 0xdd array32 */
    H(K_MAP, 2, 0, 0),    /* 0xde map16 */
    H(K_MAP, 4, 0, 0),    /* 0xdf map32 */
    X16(SCALAR),
    X16(SCALAR) /* 0xe0-0xff negative fixint */
};
/* (sized by its entries: one missing or extra is a build error, not a zeroed byte) */
_Static_assert(sizeof HEAD / sizeof HEAD[0] == 256, "one entry per header byte");

/* the cost of a value with this header (see rh_mp_costs_t), and what it is */
static uint64_t value_cost(const rh_mp_costs_t *c, int kind, uint64_t skip, uint64_t children, const char **what,
                           const char **unit, uint64_t *count) {
  switch (kind) {
    case K_MAP: {
      uint64_t n = children / 2, nodes = 2;
      while (nodes < n) nodes <<= 1;
      *what = "a map of", *unit = "entries", *count = n;
      return c->table + (n ? c->node * nodes : 0);
    }
    case K_ARRAY:
      *what = "an array of", *unit = "elements", *count = children;
      return c->table + (children ? c->slot * (children + 1) : 0);
    case K_STRING: *what = "a string of", *unit = "bytes", *count = skip; return skip;
    case K_EXT:
      *what = "an extension value of", *unit = "bytes", *count = skip - 1; /* (less its type byte) */
      return c->ext + skip - 1;
    default: return 0; /* numbers, nil, booleans live in their slot */
  }
}

/* An array of k values costs table + slot (k + 1): table + slot to its header
 * byte, slot to each value's first byte. A map of n entries costs table + node
 * * nodes, with nodes <= 2n: table to its header, node to each of its 2n
 * values' first bytes. A string costs a byte per byte; an extension ext to its
 * header and a byte per byte. A byte is at most a header (table + slot, or
 * ext), one value of a container (slot or node) and, or else, a payload byte. */
uint64_t rh_mp_cost_bound(size_t len, const rh_mp_costs_t *c) {
  uint64_t per_byte = (uint64_t)c->table + c->slot + c->ext + c->slot + c->node + 1;
  return len > UINT64_MAX / per_byte ? UINT64_MAX : (uint64_t)len * per_byte;
}

int rh_mp_measure(const uint8_t *p, size_t len, int max_depth, const rh_mp_costs_t *costs, size_t *nvalues,
                  rh_mp_where_t *where) {
  /* stack[d] = values still expected in the container open at depth d */
  uint64_t stack[MAX_STACK];
  int depth = 0;
  size_t off = 0, top = 0;
  uint64_t cost = 0;
  if (max_depth > MAX_STACK - 1) max_depth = MAX_STACK - 1;
  while (off < len || depth > 0) {
    if (off >= len) return RH_MP_TRUNCATED;
    uint8_t b = p[off++];
    const head_t h = HEAD[b];
    size_t left = len - off;
    uint64_t n = b & h.fix; /* the count or length: in the byte, or in the field after it */
    if (h.len) {
      if (left < h.len) return RH_MP_TRUNCATED;
      n = be(p + off, h.len);
      off += h.len;
      left -= h.len;
    }
    uint64_t skip = h.skip, children = 0; /* payload bytes after the header; values inside */
    switch (h.kind) {
      case K_MAP: children = 2 * n; break;
      case K_ARRAY: children = n; break;
      case K_STRING: skip = n; break;
      case K_EXT: skip += n; break; /* (ext 8-32: the length, then a type byte; fixext: n is 0) */
      case K_BAD: return RH_MP_BADTYPE;
      default: break;
    }
    if (skip > left) return RH_MP_TRUNCATED;
    off += (size_t)skip;
    if (costs) {
      const char *what = NULL, *unit = NULL;
      uint64_t count = 0;
      /* (children and skip are bounded by len here, so the sum cannot wrap) */
      uint64_t c = children > len - off ? 0 : value_cost(costs, h.kind, skip, children, &what, &unit, &count);
      if (c > costs->limit - cost) { /* (cost never passes the limit) */
        if (where) where->what = what, where->unit = unit, where->count = count, where->cost = cost;
        return RH_MP_TOOCOSTLY;
      }
      cost += c;
    }
    if (children > 0) {
      /* every element takes at least one byte */
      if (children > len - off) {
        if (where) {
          where->is_map = h.kind == K_MAP;
          where->count = where->is_map ? children / 2 : children;
          where->left = len - off;
        }
        return RH_MP_TOOMANY;
      }
      if (depth >= max_depth) return RH_MP_TOODEEP;
      /* this value fills one slot of the enclosing container; its own open now */
      if (depth > 0) stack[depth - 1]--;
      else top++;
      stack[depth++] = children;
      continue; /* (an open container is never complete yet) */
    }
    /* a value with nothing inside: it fills one slot, which may close containers */
    if (depth == 0) {
      top++;
      continue;
    }
    if (--stack[depth - 1] > 0) continue;
    do depth--;
    while (depth > 0 && stack[depth - 1] == 0);
  }
  if (nvalues) *nvalues = top;
  if (where) where->cost = cost;
  return RH_MP_OK;
}
