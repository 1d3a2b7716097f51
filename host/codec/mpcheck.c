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

/* the cost of a value with this header (see rh_mp_costs_t), and what it is */
/* what a value is, as far as its cost in Lua goes (the walk classifies each
 * header byte once) */
enum { K_SCALAR, K_MAP, K_ARRAY, K_STRING, K_EXT };

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
    size_t left = len - off;
    uint64_t skip = 0;     /* payload bytes after the header */
    uint64_t children = 0; /* values inside, for containers */
    int hdr = 0;           /* length-field bytes following the type byte */
    int kind = K_SCALAR;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      /* fixint, nil, bool */
    } else if (b >= 0x80 && b <= 0x8f) {
      children = 2ull * (b & 0x0f), kind = K_MAP;
    } else if (b >= 0x90 && b <= 0x9f) {
      children = b & 0x0f, kind = K_ARRAY;
    } else if (b >= 0xa0 && b <= 0xbf) {
      skip = b & 0x1f, kind = K_STRING;
    } else {
      switch (b) {
        case 0xc4:
        case 0xd9: hdr = 1, kind = K_STRING; break; /* bin8, str8 */
        case 0xc5:
        case 0xda: hdr = 2, kind = K_STRING; break; /* bin16, str16 */
        case 0xc6:
        case 0xdb: hdr = 4, kind = K_STRING; break; /* bin32, str32 */
        case 0xc7: hdr = 1, kind = K_EXT; break;    /* ext8 (+type) */
        case 0xc8: hdr = 2, kind = K_EXT; break;    /* ext16 */
        case 0xc9: hdr = 4, kind = K_EXT; break;    /* ext32 */
        case 0xca: skip = 4; break;                 /* float32 */
        case 0xcb: skip = 8; break;                 /* float64 */
        case 0xcc:
        case 0xd0: skip = 1; break;
        case 0xcd:
        case 0xd1: skip = 2; break;
        case 0xce:
        case 0xd2: skip = 4; break;
        case 0xcf:
        case 0xd3: skip = 8; break;
        case 0xd4: skip = 2, kind = K_EXT; break; /* fixext1: type + 1 */
        case 0xd5: skip = 3, kind = K_EXT; break;
        case 0xd6: skip = 5, kind = K_EXT; break;
        case 0xd7: skip = 9, kind = K_EXT; break;
        case 0xd8: skip = 17, kind = K_EXT; break;
        case 0xdc: hdr = 2, kind = K_ARRAY; break; /* array16 */
        case 0xdd: hdr = 4, kind = K_ARRAY; break; /* array32 */
        case 0xde: hdr = 2, kind = K_MAP; break;   /* map16 */
        case 0xdf: hdr = 4, kind = K_MAP; break;   /* map32 */
        default: return RH_MP_BADTYPE;             /* 0xc1 */
      }
      if (hdr) {
        if (left < (size_t)hdr) return RH_MP_TRUNCATED;
        uint64_t n = be(p + off, hdr);
        off += (size_t)hdr;
        left -= (size_t)hdr;
        if (kind == K_ARRAY) children = n;
        else if (kind == K_MAP) children = 2 * n;
        else if (kind == K_EXT) skip = n + 1; /* ext: type byte + data */
        else skip = n;
      }
    }
    if (skip > left) return RH_MP_TRUNCATED;
    off += (size_t)skip;
    if (costs) {
      const char *what = NULL, *unit = NULL;
      uint64_t count = 0;
      /* (children and skip are bounded by len here, so the sum cannot wrap) */
      uint64_t c = children > len - off ? 0 : value_cost(costs, kind, skip, children, &what, &unit, &count);
      if (c > costs->limit - cost) { /* (cost never passes the limit) */
        if (where) where->what = what, where->unit = unit, where->count = count, where->cost = cost;
        return RH_MP_TOOCOSTLY;
      }
      cost += c;
    }
    /* this value fills one slot of the enclosing container */
    if (depth > 0) stack[depth - 1]--;
    else top++;
    if (children > 0) {
      /* every element takes at least one byte */
      if (children > len - off) {
        if (where) {
          where->is_map = kind == K_MAP;
          where->count = where->is_map ? children / 2 : children;
          where->left = len - off;
        }
        return RH_MP_TOOMANY;
      }
      if (depth >= max_depth) return RH_MP_TOODEEP;
      stack[depth++] = children;
    }
    while (depth > 0 && stack[depth - 1] == 0) depth--;
  }
  if (nvalues) *nvalues = top;
  if (where) where->cost = cost;
  return RH_MP_OK;
}
