/* copy.c: every write of a whole tensor from another or from a constant
 * (Torch7's THTensorCopy): copy_ (broadcast, any pair of dtypes, any layouts,
 * across devices), cast, clone, contiguous, reshape when it cannot be a view,
 * fill_ and full, and to_device (host <-> CUDA device, device <-> device).
 *
 * Same-dtype copies of permuted layouts run at memory speed: a copy of a
 * permuted view (contiguous(), clone(), copy_ between layouts) reads one operand
 * with a large stride: element by element, every read touches a new cache line
 * and the copy runs at a fraction of memcpy. Here the two dimensions along which
 * the source and the destination are dense are copied in square tiles that fit
 * in L1, so both sides move whole cache lines; the tiles are spread over the
 * thread pool. Copies whose innermost dimension is dense on both sides stay with
 * the iterator (a memcpy per row), which is already at speed. Other copies go
 * through the iterator with one inlined loop per (from, to) pair of dtypes.
 *
 * Depends on tensor.c (headers, views, broadcasting), iter.c, storage.c and
 * device.c; reduce.c, ops.c and everything above use it. */
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
static int copy_tiled(int ndim, const int64_t *size, char *dst, const int64_t *dst_st, const char *src,
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

/* ---- copies between dtypes */
typedef struct {
  rh_dtype_t from, to;
} cast_ctx_t;

static void cast_loop(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                      void *vctx) {
  cast_ctx_t *c = vctx;
  (void)b;
  (void)bs;
  if (c->from == c->to) {
    size_t es = rh_dtype_size(c->to);
    if (os == (int64_t)es && as == (int64_t)es) {
      memcpy(o, a, (size_t)n * es);
      return;
    }
    /* strided copies element by element, typed */
    switch (es) {
      case 8:
        for (int64_t i = 0; i < n; i++) *(uint64_t *)(o + i * os) = *(const uint64_t *)(a + i * as);
        break;
      case 4:
        for (int64_t i = 0; i < n; i++) *(uint32_t *)(o + i * os) = *(const uint32_t *)(a + i * as);
        break;
      default:
        for (int64_t i = 0; i < n; i++) o[i * os] = a[i * as];
        break;
    }
    return;
  }
  if (c->from == RH_I64 && c->to != RH_F32 && c->to != RH_F64) {
    /* integer to integer without going through double */
    for (int64_t i = 0; i < n; i++) {
      int64_t v = *(const int64_t *)(a + i * as);
      char *p = o + i * os;
      switch (c->to) {
        case RH_I32: *(int32_t *)p = (int32_t)v; break;
        case RH_U8: *(uint8_t *)p = (uint8_t)v; break;
        case RH_BOOL: *(uint8_t *)p = v != 0; break;
        default: break;
      }
    }
    return;
  }
  /* every (from, to) pair as its own inlined loop: a load and a store call per
   * element made casts (relu's backward, masks) several times slower than a copy */
#define LD_F32(p) ((double)*(const float *)(p))
#define LD_F64(p) (*(const double *)(p))
#define LD_I32(p) ((double)*(const int32_t *)(p))
#define LD_I64(p) ((double)*(const int64_t *)(p))
#define LD_U8(p) ((double)*(const uint8_t *)(p))
#define LD_BOOL(p) ((double)(*(const uint8_t *)(p) != 0))
#define ST_F32(p, v) (*(float *)(p) = (float)(v))
#define ST_F64(p, v) (*(double *)(p) = (v))
#define ST_ANY(p, v) rh__store(c->to, (p), (v)) /* integers: clamped as rh_dtype_store does */
#define ST_BOOL(p, v) (*(uint8_t *)(p) = (v) != 0)
/* dense runs with constant strides, so the compiler vectorizes them */
#define CAST_LOOP(LD, ST, FS, TS)                                       \
  if (as == (FS) && os == (TS)) {                                       \
    for (int64_t i = 0; i < n; i++) ST(o + i * (TS), LD(a + i * (FS))); \
  } else {                                                              \
    for (int64_t i = 0; i < n; i++) ST(o + i * os, LD(a + i * as));     \
  }
#define CAST_TO(LD, FS)                                 \
  switch (c->to) {                                      \
    case RH_F32: CAST_LOOP(LD, ST_F32, FS, 4); break;   \
    case RH_F64: CAST_LOOP(LD, ST_F64, FS, 8); break;   \
    case RH_BOOL: CAST_LOOP(LD, ST_BOOL, FS, 1); break; \
    default: CAST_LOOP(LD, ST_ANY, FS, os); break;      \
  }
  switch (c->from) {
    case RH_F32: CAST_TO(LD_F32, 4); break;
    case RH_F64: CAST_TO(LD_F64, 8); break;
    case RH_I32: CAST_TO(LD_I32, 4); break;
    case RH_I64: CAST_TO(LD_I64, 8); break;
    case RH_U8: CAST_TO(LD_U8, 1); break;
    case RH_BOOL: CAST_TO(LD_BOOL, 1); break;
    default:
      for (int64_t i = 0; i < n; i++) rh__store(c->to, o + i * os, rh__load(c->from, a + i * as));
      break;
  }
#undef CAST_TO
#undef CAST_LOOP
#undef ST_BOOL
#undef ST_ANY
#undef ST_F64
#undef ST_F32
#undef LD_BOOL
#undef LD_U8
#undef LD_I64
#undef LD_I32
#undef LD_F64
#undef LD_F32
}

int rh_tensor_copy_(rh_tensor_t *dst, rh_tensor_t *src) {
  int nd;
  int64_t shape[RH_MAXDIM];
  if (rh__broadcast_shape(dst->ndim, dst->size, src->ndim, src->size, &nd, shape)) return -1;
  if (nd != dst->ndim || memcmp(shape, dst->size, sizeof(int64_t) * (size_t)nd) != 0) {
    char a[256], b[256];
    rh_shape_str(src->ndim, src->size, a, sizeof a);
    rh_shape_str(dst->ndim, dst->size, b, sizeof b);
    return rh_tensor_fail("cannot copy a tensor of shape %s into one of shape %s", a, b);
  }
  if (rh_tensor_device(src) != rh_tensor_device(dst)) {
    /* across devices: a contiguous copy of src where dst lives, then a local copy */
    rh_tensor_t *moved = rh_tensor_to_device(src, rh_tensor_device(dst));
    if (!moved) return -1;
    int rc = rh_tensor_copy_(dst, moved);
    rh_tensor_release(moved);
    return rc;
  }
  int64_t ost[RH_MAXDIM], ast[RH_MAXDIM];
  rh__bcast_strides(dst, nd, shape, ost);
  for (int d = 0; d < nd; d++) ost[d] = dst->stride[d] * (int64_t)rh_dtype_size(dst->dtype);
  rh__bcast_strides(src, nd, shape, ast);
  if (RH_ON_DEVICE(dst))
    return rh__cuda_call(rh_cuda_api()->cast(rh_tensor_device(dst), src->dtype, dst->dtype, nd, shape,
                                             rh_tensor_data(dst), ost, rh_tensor_data(src), ast));
  if (src->dtype == dst->dtype &&
      copy_tiled(nd, shape, rh_tensor_data(dst), ost, rh_tensor_data(src), ast, rh_dtype_size(dst->dtype)))
    return 0;
  cast_ctx_t c = {src->dtype, dst->dtype};
  rh__iterate(nd, shape, rh_tensor_data(dst), ost, rh_tensor_data(src), ast, NULL, NULL, cast_loop, &c);
  return 0;
}

/* ---- fills */
typedef struct {
  rh_dtype_t dt;
  union { /* aligned for any element type */
    char bytes[8];
    int64_t i;
    double d;
  } v;
} fill_ctx_t;

/* one store per element, typed (a memcpy call per element was the slow part) */
#define FILL_AS(T)                                            \
  do {                                                        \
    T v;                                                      \
    memcpy(&v, f->v.bytes, sizeof v);                         \
    if (os == (int64_t)sizeof(T)) {                           \
      T *O = (T *)o;                                          \
      for (int64_t i = 0; i < n; i++) O[i] = v;               \
    } else {                                                  \
      for (int64_t i = 0; i < n; i++) *(T *)(o + i * os) = v; \
    }                                                         \
  } while (0)

static void fill_loop(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                      void *vctx) {
  fill_ctx_t *f = vctx;
  (void)a, (void)as, (void)b, (void)bs;
  switch (rh_dtype_size(f->dt)) {
    case 8: FILL_AS(uint64_t); break;
    case 4: FILL_AS(uint32_t); break;
    default: FILL_AS(uint8_t); break;
  }
}

int rh_tensor_fill_(rh_tensor_t *t, double v) {
  if (RH_ON_DEVICE(t)) {
    int64_t ost[RH_MAXDIM];
    for (int d = 0; d < t->ndim; d++) ost[d] = t->stride[d] * (int64_t)rh_dtype_size(t->dtype);
    return rh__cuda_call(
        rh_cuda_api()->fill(rh_tensor_device(t), t->dtype, t->ndim, t->size, rh_tensor_data(t), ost, v));
  }
  if (v == 0 && rh_tensor_is_contiguous(t)) {
    memset(rh_tensor_data(t), 0, (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype));
    return 0;
  }
  fill_ctx_t f;
  f.dt = t->dtype;
  rh__store(t->dtype, f.v.bytes, v);
  int64_t ost[RH_MAXDIM];
  for (int d = 0; d < t->ndim; d++) ost[d] = t->stride[d] * (int64_t)rh_dtype_size(t->dtype);
  rh__iterate(t->ndim, t->size, rh_tensor_data(t), ost, NULL, NULL, NULL, NULL, fill_loop, &f);
  return 0;
}

rh_tensor_t *rh_tensor_full(rh_dtype_t dt, int ndim, const int64_t *size, double value) {
  rh_tensor_t *t = rh_tensor_empty(dt, ndim, size);
  if (t) rh_tensor_fill_(t, value);
  return t;
}

/* ---- copies */
rh_tensor_t *rh_tensor_contiguous(rh_tensor_t *t) {
  if (rh_tensor_is_contiguous(t)) {
    rh_tensor_retain(t);
    return t;
  }
  return rh_tensor_clone(t);
}

rh_tensor_t *rh_tensor_clone(rh_tensor_t *t) { return rh_tensor_cast(t, t->dtype); }

rh_tensor_t *rh_tensor_cast(rh_tensor_t *t, rh_dtype_t dtype) {
  rh_tensor_t *o = rh_tensor_empty_on(rh_tensor_device(t), dtype, t->ndim, t->size);
  if (!o) return NULL;
  if (rh_tensor_copy_(o, t)) {
    rh_tensor_release(o);
    return NULL;
  }
  return o;
}

/* a view when the strides allow one (tensor.c's rule), else a contiguous copy viewed */
rh_tensor_t *rh_tensor_reshape(rh_tensor_t *t, int ndim, const int64_t *size) {
  int64_t shape[RH_MAXDIM], stride[RH_MAXDIM];
  if (rh__infer_shape(t, ndim, size, shape, "reshape")) return NULL;
  if (rh__view_strides(t, ndim, shape, stride) == 0)
    return rh_tensor_on_storage(t->storage, t->dtype, t->offset, ndim, shape, stride);
  rh_tensor_t *c = rh_tensor_contiguous(t);
  if (!c) return NULL;
  rh_tensor_t *v = rh_tensor_view(c, ndim, shape);
  rh_tensor_release(c);
  return v;
}

/* ---- across devices: a contiguous copy where the tensor is wanted */
rh_tensor_t *rh_tensor_to_device(rh_tensor_t *t, int device) {
  int from = rh_tensor_device(t);
  if (from == device) {
    rh_tensor_retain(t);
    return t;
  }
  if (rh__check_device(device) || rh__check_device(from)) return NULL;
  const rhc_api_t *api = rh_cuda_api(); /* not NULL: one of the two is a device, checked */
  rh_tensor_t *c = rh_tensor_contiguous(t);
  if (!c) return NULL;
  rh_tensor_t *o = rh_tensor_empty_on(device, t->dtype, t->ndim, t->size);
  size_t nbytes = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
  int rc = 0;
  if (o && nbytes) {
    if (from == RH_CPU) rc = api->h2d(device, rh_tensor_data(o), rh_tensor_data(c), nbytes);
    else if (device == RH_CPU) rc = api->d2h(from, rh_tensor_data(o), rh_tensor_data(c), nbytes);
    else rc = api->d2d(device, rh_tensor_data(o), from, rh_tensor_data(c), nbytes);
  }
  rh_tensor_release(c);
  if (o && rh__cuda_call(rc)) {
    rh_tensor_release(o);
    return NULL;
  }
  return o;
}
