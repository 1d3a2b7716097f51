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

/* destinations of at least this many bytes (more than the cores' L2 caches
 * together) are written around the caches */
#define RH_STREAM_BYTES (8u << 20)
#define TILE                                                                                                         \
  32 /* elements per tile side: 32 lines of the strided side stay in L1 even when a power-of-two stride maps them to \
        few sets */

typedef struct {
  int nouter; /* dimensions other than the two tiled ones */
  int64_t osize[RH_MAXDIM], odst[RH_MAXDIM], osrc[RH_MAXDIM];
  int64_t n_r, n_c;     /* r: the source's dense dim; c: the destination's */
  int64_t dst_r, src_c; /* the strides (bytes) that are not the element size */
  int64_t tile_r, tile_c, tiles_r, tiles_c;
  size_t es;
  int wide;   /* 4-byte elements on a CPU with AVX-512: 16 x 16 blocks */
  int stream; /* the destination is larger than the caches: non-temporal stores */
  char *dst;
  const char *src;
} tiled_t;

#define TILE_COPY(T)                                                                       \
  for (int64_t r = r0; r < r1; r++) {                                                      \
    T *o = (T *)(d + r * j->dst_r);                                                        \
    const T *a = (const T *)(s + r * (int64_t)sizeof(T));                                  \
    for (int64_t c = c0; c < c1; c++) o[c] = *(const T *)((const char *)a + c * j->src_c); \
  }

/* 4-byte elements (float32, int32), the common case, on x86-64 with AVX2: 8 x 8
 * blocks transposed in registers (eight 32-byte loads along the source's dense
 * dim, unpack/shuffle/permute, eight 32-byte stores along the destination's),
 * two blocks side by side so every destination line is written whole; a strip of
 * 16 columns is swept down the tile's rows so the 16 source lines stream. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_TR8 1
__attribute__((target("avx2"))) static inline void tr8(const float *s, int64_t ss, float *d, int64_t ds) {
  __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ss), r2 = _mm256_loadu_ps(s + 2 * ss),
         r3 = _mm256_loadu_ps(s + 3 * ss), r4 = _mm256_loadu_ps(s + 4 * ss), r5 = _mm256_loadu_ps(s + 5 * ss),
         r6 = _mm256_loadu_ps(s + 6 * ss), r7 = _mm256_loadu_ps(s + 7 * ss);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
         t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
         u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
         u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(d + ds, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(d + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(d + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(d + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(d + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(d + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(d + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
}

__attribute__((target("avx2"))) static void tile4_avx2(const tiled_t *j, char *d, const char *s, int64_t r0, int64_t r1,
                                                       int64_t c0, int64_t c1) {
  int64_t ss = j->src_c / 4, ds = j->dst_r / 4;
  int64_t rv = r0 + (r1 - r0) / 8 * 8, cv = c0 + (c1 - c0) / 16 * 16;
  for (int64_t c = c0; c < cv; c += 16)
    for (int64_t r = r0; r < rv; r += 8) {
      const float *a = (const float *)(s + c * j->src_c) + r;
      float *o = (float *)(d + r * j->dst_r) + c;
      tr8(a, ss, o, ds);
      tr8(a + 8 * ss, ss, o + 8, ds);
    }
  /* the edges element by element */
  for (int64_t r = r0; r < r1; r++) {
    uint32_t *o = (uint32_t *)(d + r * j->dst_r);
    for (int64_t c = r < rv ? cv : c0; c < c1; c++) o[c] = ((const uint32_t *)(s + c * j->src_c))[r];
  }
}

/* With AVX-512, 16 x 16 blocks: one 64-byte load per source line piece and one
 * 64-byte store per destination line, so every destination line is written whole
 * by a single store. A destination larger than the caches is written with
 * non-temporal stores: it would be evicted before anyone reads it anyway, and a
 * streaming store does not first read the line it overwrites, which is a third of
 * a copy's memory traffic (measured here on 4096 x 4096: 4.3x the cached stores). */
__attribute__((target("avx512f"))) static inline void tr16(const float *s, int64_t ss, float *d, int64_t ds, int nt) {
  __m512 r[16], t[16], u[16], v[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(s + i * ss);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; k++) {
      v[i + k] = _mm512_shuffle_f32x4(u[i + k], u[i + k + 4], 0x88);
      v[i + k + 4] = _mm512_shuffle_f32x4(u[i + k], u[i + k + 4], 0xDD);
    }
  for (int k = 0; k < 8; k++) {
    __m512 lo = _mm512_shuffle_f32x4(v[k], v[k + 8], 0x88), hi = _mm512_shuffle_f32x4(v[k], v[k + 8], 0xDD);
    if (nt) {
      _mm512_stream_ps(d + k * ds, lo);
      _mm512_stream_ps(d + (k + 8) * ds, hi);
    } else {
      _mm512_storeu_ps(d + k * ds, lo);
      _mm512_storeu_ps(d + (k + 8) * ds, hi);
    }
  }
}

__attribute__((target("avx512f"))) static void tile4_avx512(const tiled_t *j, char *d, const char *s, int64_t r0,
                                                            int64_t r1, int64_t c0, int64_t c1) {
  int64_t ss = j->src_c / 4, ds = j->dst_r / 4;
  int64_t rv = r0 + (r1 - r0) / 16 * 16, cv = c0 + (c1 - c0) / 16 * 16;
  /* streaming stores need 64-byte aligned lines: the tile's first one and the row stride */
  int nt = j->stream && ((uintptr_t)(d + r0 * j->dst_r + c0 * 4) % 64 == 0) && j->dst_r % 64 == 0;
  for (int64_t c = c0; c < cv; c += 16)
    for (int64_t r = r0; r < rv; r += 16)
      tr16((const float *)(s + c * j->src_c) + r, ss, (float *)(d + r * j->dst_r) + c, ds, nt);
  for (int64_t r = r0; r < r1; r++) {
    uint32_t *o = (uint32_t *)(d + r * j->dst_r);
    for (int64_t c = r < rv ? cv : c0; c < c1; c++) o[c] = ((const uint32_t *)(s + c * j->src_c))[r];
  }
  if (nt) _mm_sfence(); /* streamed lines are visible before the pool reports the chunk done */
}
#endif

static int have_avx512(void) {
#ifdef HAVE_TR8
  static int v = -1;
  if (v < 0) v = __builtin_cpu_supports("avx512f") ? 1 : 0;
  return v;
#else
  return 0;
#endif
}

static void tile4(const tiled_t *j, char *d, const char *s, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
#ifdef HAVE_TR8
  static int avx2 = -1;
  if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
  if (j->wide) {
    tile4_avx512(j, d, s, r0, r1, c0, c1);
    return;
  }
  if (avx2) {
    tile4_avx2(j, d, s, r0, r1, c0, c1);
    return;
  }
#endif
  for (int64_t r = r0; r < r1; r++) {
    uint32_t *o = (uint32_t *)(d + r * j->dst_r);
    for (int64_t c = c0; c < c1; c++) o[c] = ((const uint32_t *)(s + c * j->src_c))[r];
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
    int64_t r0 = tr * j->tile_r, r1 = r0 + j->tile_r < j->n_r ? r0 + j->tile_r : j->n_r;
    int64_t c0 = tc * j->tile_c, c1 = c0 + j->tile_c < j->n_c ? c0 + j->tile_c : j->n_c;
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
  /* 4-byte elements: strips of 32 rows swept across up to 4096 columns (best of
   * the shapes measured here, power-of-two strides included, where physically
   * contiguous huge pages alias every line of a column to a few cache sets);
   * other sizes: TILE x TILE squares */
  j.wide = es == 4 && have_avx512();
  j.stream = (size_t)numel * es >= RH_STREAM_BYTES;
  if (j.wide) /* 16 source lines streamed 4 KiB at a time; 1 MiB per tile */
    j.tile_r = 1024, j.tile_c = 256;
  else j.tile_r = es == 4 ? 32 : TILE, j.tile_c = es == 4 ? 4096 : TILE;
  j.tiles_r = (j.n_r + j.tile_r - 1) / j.tile_r, j.tiles_c = (j.n_c + j.tile_c - 1) / j.tile_c;
  j.es = es;
  j.dst = dst;
  j.src = src;
  int64_t outer = numel / (j.n_r * j.n_c);
  int64_t work = outer * j.tiles_r * j.tiles_c;
  /* tiles of about 64K elements per grain: enough to share, few enough to stay cheap */
  int64_t per_tile = j.tile_r * j.tile_c, grain = per_tile >= 65536 ? 1 : 65536 / per_tile;
  rh_parallel_for(work, numel >= (1 << 18) ? grain : work, tiled_chunk, &j);
  return 1;
}
