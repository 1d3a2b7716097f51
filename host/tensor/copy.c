/* copy.c: same-dtype strided copies on the host at memory speed.
 *
 * A copy of a permuted view (contiguous(), clone(), copy_ between layouts) reads
 * one operand with a large stride: element by element, every read touches a new
 * cache line and the copy runs at a fraction of memcpy. Here the two dimensions
 * along which the source and the destination are dense are copied in square
 * tiles that fit in L1, so both sides move whole cache lines; the tiles are
 * spread over the thread pool. Copies whose innermost dimension is dense on both
 * sides stay with the iterator (a memcpy per row), which is already at speed. */
#include <string.h>

#include "tensor_internal.h"

#define TILE 32 /* elements per tile side: 32 lines of the strided side stay in L1 even when a power-of-two stride maps them to few sets */

typedef struct {
  int nouter; /* dimensions other than the two tiled ones */
  int64_t osize[RH_MAXDIM], odst[RH_MAXDIM], osrc[RH_MAXDIM];
  int64_t n_r, n_c;     /* r: the source's dense dim; c: the destination's */
  int64_t dst_r, src_c; /* the strides (bytes) that are not the element size */
  int64_t tiles_r, tiles_c;
  size_t es;
  char *dst;
  const char *src;
} tiled_t;

#define TILE_COPY(T)                                                                 \
  for (int64_t r = r0; r < r1; r++) {                                                \
    T *o = (T *)(d + r * j->dst_r);                                                  \
    const T *a = (const T *)(s + r * (int64_t)sizeof(T));                           \
    for (int64_t c = c0; c < c1; c++) o[c] = *(const T *)((const char *)a + c * j->src_c); \
  }

/* 8 x 8 blocks of 4-byte elements through registers: eight dense loads from the
 * source, a transpose the compiler does with shuffles, eight dense stores */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COPY_TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define COPY_TARGETS
#endif
COPY_TARGETS static void tile4(const tiled_t *j, char *d, const char *s, int64_t r0, int64_t r1, int64_t c0,
                                int64_t c1) {
  int64_t r = r0;
  for (; r + 8 <= r1; r += 8) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
      uint32_t tmp[8][8];
      for (int cc = 0; cc < 8; cc++) {
        const uint32_t *a = (const uint32_t *)(s + (c + cc) * j->src_c) + r;
        for (int rr = 0; rr < 8; rr++) tmp[rr][cc] = a[rr];
      }
      for (int rr = 0; rr < 8; rr++) {
        uint32_t *o = (uint32_t *)(d + (r + rr) * j->dst_r) + c;
        for (int cc = 0; cc < 8; cc++) o[cc] = tmp[rr][cc];
      }
    }
    for (int64_t rr = r; rr < r + 8; rr++) {
      uint32_t *o = (uint32_t *)(d + rr * j->dst_r);
      for (int64_t cc = c; cc < c1; cc++) o[cc] = ((const uint32_t *)(s + cc * j->src_c))[rr];
    }
  }
  for (; r < r1; r++) {
    uint32_t *o = (uint32_t *)(d + r * j->dst_r);
    for (int64_t cc = c0; cc < c1; cc++) o[cc] = ((const uint32_t *)(s + cc * j->src_c))[r];
  }
}

static void tiled_chunk(void *vj, int64_t lo, int64_t hi) {
  tiled_t *j = vj;
  int64_t per_outer = j->tiles_r * j->tiles_c;
  for (int64_t w = lo; w < hi; w++) {
    int64_t outer = w / per_outer, t = w % per_outer;
    int64_t tr = t / j->tiles_c, tc = t % j->tiles_c;
    char *d = j->dst;
    const char *s = j->src;
    for (int k = j->nouter - 1; k >= 0; k--) {
      int64_t i = outer % j->osize[k];
      outer /= j->osize[k];
      d += i * j->odst[k];
      s += i * j->osrc[k];
    }
    int64_t r0 = tr * TILE, r1 = r0 + TILE < j->n_r ? r0 + TILE : j->n_r;
    int64_t c0 = tc * TILE, c1 = c0 + TILE < j->n_c ? c0 + TILE : j->n_c;
    switch (j->es) {
      case 8: TILE_COPY(uint64_t); break;
      case 4: tile4(j, d, s, r0, r1, c0, c1); break;
      case 2: TILE_COPY(uint16_t); break;
      default: TILE_COPY(uint8_t); break;
    }
  }
}

/* Copies `size` elements of es bytes from src to dst (byte strides) when the
 * layouts call for tiles; returns 1 when it did, 0 to leave it to the iterator. */
int rh__copy_tiled(int ndim, const int64_t *size, char *dst, const int64_t *dst_st, const char *src,
                   const int64_t *src_st, size_t es) {
  /* drop size-1 dims; a broadcast source (stride 0) is not a permutation */
  int64_t sz[RH_MAXDIM], ds[RH_MAXDIM], ss[RH_MAXDIM];
  int n = 0;
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) {
    numel *= size[d];
    if (size[d] == 1) continue;
    if (src_st[d] == 0) return 0;
    sz[n] = size[d], ds[n] = dst_st[d], ss[n] = src_st[d];
    n++;
  }
  if (n < 2 || numel < 4096) return 0;
  /* c: the destination's dense dim; r: the source's */
  int c = -1, r = -1;
  for (int d = 0; d < n; d++) {
    if (ds[d] == (int64_t)es) c = d;
    if (ss[d] == (int64_t)es) r = d;
  }
  if (c < 0 || r < 0 || c == r) return 0;
  tiled_t j;
  j.nouter = 0;
  for (int d = 0; d < n; d++) {
    if (d == r || d == c) continue;
    j.osize[j.nouter] = sz[d], j.odst[j.nouter] = ds[d], j.osrc[j.nouter] = ss[d];
    j.nouter++;
  }
  j.n_r = sz[r], j.n_c = sz[c];
  j.dst_r = ds[r], j.src_c = ss[c];
  j.tiles_r = (j.n_r + TILE - 1) / TILE, j.tiles_c = (j.n_c + TILE - 1) / TILE;
  j.es = es;
  j.dst = dst;
  j.src = src;
  int64_t outer = numel / (j.n_r * j.n_c);
  int64_t work = outer * j.tiles_r * j.tiles_c;
  /* about 16 tiles per grain: enough to share, few enough to stay cheap */
  rh_parallel_for(work, numel >= (1 << 18) ? 16 : work, tiled_chunk, &j);
  return 1;
}
