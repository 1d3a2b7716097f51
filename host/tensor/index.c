/* index.c: ops that address elements through index or mask tensors:
 * index_select, gather, scatter / scatter_add, index_put (index_add, t[idx] = v),
 * masked_fill, where, masked_select, masked_scatter and nonzero.
 *
 * Index tensors are int64 (or int32) holding indices counted from `base` (the Lua
 * face passes 1: its indices are 1-based; C callers pass 0). Every index is
 * checked against its dimension before anything is written, and a bad one is
 * named with the dimension and its size. Element bytes are moved by size, not by
 * type, so one loop serves every dtype; the work is split across the thread pool
 * where the order of results does not matter. On a device, the kernels library
 * (kernels/index.cu) does the same work with the same checks made here first. */
#include <string.h>

#include "tensor_internal.h"

static rh_tensor_t *contig(rh_tensor_t *t) { return rh_tensor_contiguous(t); }

static int check_index_dtype(const char *what, const rh_tensor_t *idx) {
  if (idx->dtype != RH_I64 && idx->dtype != RH_I32)
    return rh_tensor_fail("%s: the index must be an int64 (or int32) tensor, got %s (convert with :long())", what,
                          rh_dtype_name(idx->dtype));
  return 0;
}

/* a contiguous int64 host copy of idx (a new tensor the caller may write) */
static rh_tensor_t *index_copy(rh_tensor_t *idx) {
  rh_tensor_t *h = rh_tensor_to_device(idx, -1);
  rh_tensor_t *c = h ? rh_tensor_empty(RH_I64, h->ndim, h->size) : NULL;
  if (c && rh_tensor_copy_(c, h)) {
    rh_tensor_release(c);
    c = NULL;
  }
  rh_tensor_release(h);
  return c;
}

/* the one rule for an index counted from base: 0-based in [0, n), or -1 when
 * out of bounds; negative indices count from the end, as in PyTorch (-1 is the
 * last), and 0 .. base-1 are out of bounds */
static inline int64_t rebased(int64_t raw, int64_t n, int64_t base) {
  int64_t v = raw < 0 ? raw + n : raw - base;
  return v < 0 || v >= n || (raw >= 0 && raw < base) ? -1 : v;
}

static int out_of_bounds(const char *what, int64_t raw, int dim, int64_t n) {
  return rh_tensor_fail("%s: index %lld is out of bounds for dimension %d with size %lld", what, (long long)raw,
                        dim + 1, (long long)n);
}

/* a contiguous int64 host copy of idx, checked against [0, n) after removing base;
 * the result holds 0-based indices */
static rh_tensor_t *checked_index(const char *what, rh_tensor_t *idx, int64_t n, int dim, int64_t base) {
  if (check_index_dtype(what, idx)) return NULL;
  rh_tensor_t *c = index_copy(idx);
  if (!c) return NULL;
  int64_t *p = rh_tensor_data(c), m = rh_tensor_numel(c);
  for (int64_t i = 0; i < m; i++) {
    int64_t v = rebased(p[i], n, base);
    if (v < 0) {
      out_of_bounds(what, p[i], dim, n);
      rh_tensor_release(c);
      return NULL;
    }
    p[i] = v;
  }
  return c;
}

/* an index tensor that already lives where `on` is (a device copy when needed) */
static rh_tensor_t *index_on(rh_tensor_t *checked, const rh_tensor_t *on) {
  return rh_tensor_to_device(checked, rh_tensor_device(on));
}

/* ---- index_select: out[..., i, ...] = a[..., idx[i], ...] along dim, by slabs */
typedef struct {
  const char *src;
  char *dst;
  const int64_t *idx;
  int64_t outer, n_idx, src_dim, inner_bytes;
} isel_t;

static void isel_chunk(void *vj, int64_t lo, int64_t hi) {
  isel_t *j = vj;
  for (int64_t w = lo; w < hi; w++) {
    int64_t o = w / j->n_idx, i = w % j->n_idx;
    memcpy(j->dst + w * j->inner_bytes, j->src + (o * j->src_dim + j->idx[i]) * j->inner_bytes, (size_t)j->inner_bytes);
  }
}

rh_tensor_t *rh_tensor_index_select(rh_tensor_t *a, int dim, rh_tensor_t *idx, int64_t base) {
  if (rh__check_dim("index_select", dim, a->ndim)) return NULL;
  if (idx->ndim > 1) {
    rh_tensor_fail("index_select: the index must be 1-dimensional, got %d dimensions", idx->ndim);
    return NULL;
  }
  int64_t n = a->ndim ? a->size[dim] : 1;
  rh_tensor_t *ci = checked_index("index_select", idx, n, dim, base);
  if (!ci) return NULL;
  int64_t size[RH_MAXDIM];
  for (int d = 0; d < a->ndim; d++) size[d] = a->size[d];
  int64_t m = rh_tensor_numel(ci);
  if (a->ndim) size[dim] = m;
  else if (m != 1) {
    rh_tensor_release(ci);
    rh_tensor_fail("index_select: a 0-dimensional tensor takes an index of one element, got %lld", (long long)m);
    return NULL;
  }
  rh_tensor_t *out = rh_tensor_empty_on(rh_tensor_device(a), a->dtype, a->ndim, size);
  rh_tensor_t *ca = out ? contig(a) : NULL;
  if (!ca) goto fail;
  int64_t inner = 1, outer = 1;
  for (int d = dim + 1; d < a->ndim; d++) inner *= a->size[d];
  for (int d = 0; d < dim; d++) outer *= a->size[d];
  size_t es = rh_dtype_size(a->dtype);
  if (RH_ON_DEVICE(a)) {
    rh_tensor_t *di = index_on(ci, a);
    int rc =
        di ? rh__cuda_call(rh_cuda_api()->index_select(rh_tensor_device(a), (int)es, outer, n, inner,
                                                       rh_tensor_data(ca), rh_tensor_data(di), m, rh_tensor_data(out)))
           : -1;
    rh_tensor_release(di);
    if (rc) goto fail;
  } else {
    isel_t j = {rh_tensor_data(ca), rh_tensor_data(out), rh_tensor_data(ci), outer, m, n, inner * (int64_t)es};
    int64_t work = outer * m;
    rh_parallel_for(work, j.inner_bytes >= 4096 ? 8 : (1 << 16) / (j.inner_bytes + 1) + 1, isel_chunk, &j);
  }
  rh_tensor_release(ca);
  rh_tensor_release(ci);
  return out;
fail:
  rh_tensor_release(ca);
  rh_tensor_release(ci);
  rh_tensor_release(out);
  return NULL;
}

/* ---- gather / scatter: out and idx share a shape; along dim the index picks */
/* The shape rules of PyTorch: idx has a's number of dims and idx.size(d) <=
 * a.size(d) for d != dim (for scatter, also <= src.size(d)). */
static int check_gather_shape(const char *what, const rh_tensor_t *a, const rh_tensor_t *idx, const rh_tensor_t *src,
                              int dim) {
  char sa[256], si[256];
  if (idx->ndim != a->ndim && !(a->ndim == 0 && idx->ndim <= 1)) {
    rh_shape_str(a->ndim, a->size, sa, sizeof sa);
    rh_shape_str(idx->ndim, idx->size, si, sizeof si);
    return rh_tensor_fail("%s: the index (shape %s) must have as many dimensions as the input (shape %s)", what, si,
                          sa);
  }
  for (int d = 0; d < a->ndim; d++) {
    if ((d != dim && idx->size[d] > a->size[d]) || (src && src->ndim == idx->ndim && idx->size[d] > src->size[d])) {
      rh_shape_str(a->ndim, a->size, sa, sizeof sa);
      rh_shape_str(idx->ndim, idx->size, si, sizeof si);
      return rh_tensor_fail("%s: the index (shape %s) is larger than the input (shape %s)%s in dimension %d", what, si,
                            sa, src ? " or the source" : "", d + 1);
    }
  }
  if (src && src->ndim != idx->ndim && rh_tensor_numel(idx) > 0) {
    rh_shape_str(src->ndim, src->size, sa, sizeof sa);
    rh_shape_str(idx->ndim, idx->size, si, sizeof si);
    return rh_tensor_fail("%s: the source (shape %s) must have as many dimensions as the index (shape %s)", what, sa,
                          si);
  }
  return 0;
}

/* walks every position of idx's shape; calls fn with the byte offsets of the
 * element in the indexed tensor (along dim: the index) and in the other */
typedef struct {
  int ndim, dim, mode; /* mode: 0 gather (out <- a), 1 scatter (a <- src), 2 scatter_add, 3 scatter value */
  rh_dtype_t dt;
  int64_t size[RH_MAXDIM];
  int64_t ast[RH_MAXDIM]; /* indexed tensor, bytes */
  int64_t ost[RH_MAXDIM]; /* other tensor (out for gather, src for scatter), bytes */
  const int64_t *idx;
  int64_t idx_off; /* idx[w - idx_off] is position w's index */
  char *abase, *obase;
  char value[8];
} gs_t;

/* element moves by size, typed (a memcpy call per element was the slow part) */
#define GS_MOVE(T)                                                                                          \
  do {                                                                                                      \
    for (int64_t k = k0; k < k1; k++, w++) {                                                                \
      char *pa = abase + j->idx[w - j->idx_off] * j->ast[j->dim] + (last == j->dim ? 0 : k * j->ast[last]); \
      char *po = obase + k * j->ost[last];                                                                  \
      if (j->mode == 0) *(T *)po = *(const T *)pa;                                                          \
      else if (j->mode == 1) *(T *)pa = *(const T *)po;                                                     \
      else if (j->mode == 3) memcpy(pa, j->value, sizeof(T));                                               \
      else rh__store(j->dt, pa, rh__load(j->dt, pa) + rh__load(j->dt, po));                                 \
    }                                                                                                       \
  } while (0)

/* positions lo..hi of idx's shape, a row (the last dim) at a time: the offsets
 * of the other dims are computed once per row; along `dim` the index decides */
static void gs_range(gs_t *j, int64_t lo, int64_t hi) {
  size_t es = rh_dtype_size(j->dt);
  int last = j->ndim - 1;
  int64_t n_last = j->size[last];
  int64_t w = lo;
  while (w < hi) {
    int64_t row = w / n_last, k0 = w % n_last;
    int64_t k1 = n_last - k0 <= hi - w ? n_last : k0 + (hi - w);
    int64_t rem = row, aoff = 0, ooff = 0;
    for (int d = last - 1; d >= 0; d--) {
      int64_t i = rem % j->size[d];
      rem /= j->size[d];
      if (d != j->dim) aoff += i * j->ast[d];
      ooff += i * j->ost[d];
    }
    char *abase = j->abase + aoff, *obase = j->obase ? j->obase + ooff : j->abase;
    switch (es) {
      case 8: GS_MOVE(uint64_t); break;
      case 4: GS_MOVE(uint32_t); break;
      default: GS_MOVE(uint8_t); break;
    }
  }
}

static void strides_bytes(const rh_tensor_t *t, int64_t *out) {
  for (int d = 0; d < t->ndim; d++) out[d] = t->stride[d] * (int64_t)rh_dtype_size(t->dtype);
}

/* the walk over idx's shape of `mode` on a along dim, with `other` (out for a
 * gather, src for a scatter, NULL for a scatter of a value); the index is the
 * caller's to set. Its strides are also what the device kernels take. */
static void gs_setup(gs_t *j, int mode, rh_tensor_t *a, int dim, const rh_tensor_t *idx, rh_tensor_t *other) {
  memset(j, 0, sizeof *j);
  j->ndim = idx->ndim ? idx->ndim : 1, j->dim = a->ndim ? dim : 0, j->mode = mode, j->dt = a->dtype;
  j->size[0] = 1;
  for (int d = 0; d < idx->ndim; d++) j->size[d] = idx->size[d];
  strides_bytes(a, j->ast);
  if (other) strides_bytes(other, j->ost);
  j->abase = rh_tensor_data(a), j->obase = other ? rh_tensor_data(other) : NULL;
}

/* A host gather reads the raw index (a contiguous int64 one as it is, any
 * other as such a copy): each thread checks and rebases its indices a block at
 * a time into a buffer on its stack, then moves that block, instead of one
 * thread first checking a copy of the whole index (for 16M indices, a 128 MB
 * copy as long as the gather itself). A bad index stops its thread before it
 * is used; the lowest bad position is reported, the one checked_index() would
 * name. (out is new: what was written before the error is thrown away with it.) */
typedef struct {
  gs_t g;
  const int64_t *raw;
  int64_t n, base;
  int64_t bad; /* lowest position holding a bad index, INT64_MAX when none */
} gather_t;

#define GATHER_BLOCK 1024

static void gather_chunk(void *vj, int64_t lo, int64_t hi) {
  gather_t *j = vj;
  int64_t buf[GATHER_BLOCK];
  for (int64_t b = lo; b < hi; b += GATHER_BLOCK) {
    int64_t e = hi - b < GATHER_BLOCK ? hi : b + GATHER_BLOCK;
    for (int64_t w = b; w < e; w++) {
      int64_t v = rebased(j->raw[w], j->n, j->base);
      if (v < 0) {
        int64_t seen = __atomic_load_n(&j->bad, __ATOMIC_RELAXED);
        while (w < seen && !__atomic_compare_exchange_n(&j->bad, &seen, w, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
        return;
      }
      buf[w - b] = v;
    }
    gs_t g = j->g;
    g.idx = buf;
    g.idx_off = b;
    gs_range(&g, b, e);
  }
}

static rh_tensor_t *gather_host(rh_tensor_t *a, int dim, rh_tensor_t *idx, int64_t n, int64_t base) {
  int as_is = !RH_ON_DEVICE(idx) && idx->dtype == RH_I64 && rh_tensor_is_contiguous(idx);
  rh_tensor_t *ri = as_is ? (rh_tensor_retain(idx), idx) : index_copy(idx);
  rh_tensor_t *out = ri ? rh_tensor_empty(a->dtype, idx->ndim, idx->size) : NULL;
  if (!out) {
    rh_tensor_release(ri);
    return NULL;
  }
  gather_t j;
  gs_setup(&j.g, 0, a, dim, idx, out);
  j.raw = rh_tensor_data(ri), j.n = n, j.base = base, j.bad = INT64_MAX;
  rh_parallel_for(rh_tensor_numel(idx), 1 << 14, gather_chunk, &j);
  if (j.bad != INT64_MAX) {
    out_of_bounds("gather", j.raw[j.bad], dim, n);
    rh_tensor_release(out);
    out = NULL;
  }
  rh_tensor_release(ri);
  return out;
}

rh_tensor_t *rh_tensor_gather(rh_tensor_t *a, int dim, rh_tensor_t *idx, int64_t base) {
  if (rh__check_dim("gather", dim, a->ndim) || check_gather_shape("gather", a, idx, NULL, dim) ||
      check_index_dtype("gather", idx))
    return NULL;
  int64_t n = a->ndim ? a->size[dim] : 1;
  if (!RH_ON_DEVICE(a)) return gather_host(a, dim, idx, n, base);
  /* on a device: the index checked here, moved there */
  rh_tensor_t *ci = checked_index("gather", idx, n, dim, base);
  rh_tensor_t *out = ci ? rh_tensor_empty_on(rh_tensor_device(a), a->dtype, idx->ndim, idx->size) : NULL;
  rh_tensor_t *di = out ? index_on(ci, a) : NULL;
  int rc = -1;
  if (di) {
    gs_t j;
    gs_setup(&j, 0, a, dim, idx, out);
    rc = rh__cuda_call(rh_cuda_api()->gather_scatter(rh_tensor_device(a), 0, a->dtype, idx->ndim, j.dim, idx->size,
                                                     rh_tensor_data(di), rh_tensor_data(a), j.ast, rh_tensor_data(out),
                                                     j.ost, 0));
  }
  rh_tensor_release(di);
  rh_tensor_release(ci);
  if (rc) {
    rh_tensor_release(out);
    return NULL;
  }
  return out;
}

/* Two positions of idx's shape write the same element only when they agree on
 * every dim but `dim`, so a scatter splits across threads along another dim: that
 * dim is moved first (idx copied in that order), and each thread takes a range of
 * it. Colliding positions stay in one thread in their original order, so the
 * last store wins as it does serially. */
typedef struct {
  gs_t base;
  int64_t per; /* positions per index of the first dim */
} gs_split_t;

static void scatter_chunk(void *vctx, int64_t lo, int64_t hi) {
  gs_split_t *sp = vctx;
  gs_t j = sp->base;
  j.size[0] = hi - lo;
  j.idx += lo * sp->per;
  j.abase += lo * j.ast[0];
  if (j.obase) j.obase += lo * j.ost[0];
  gs_range(&j, 0, (hi - lo) * sp->per);
}

static int scatter_host(gs_t *j, rh_tensor_t *ci) {
  int64_t n = rh_tensor_numel(ci);
  int dp = -1;
  for (int d = 0; d < j->ndim; d++)
    if (d != j->dim && j->size[d] > 1 && (dp < 0 || j->size[d] > j->size[dp])) dp = d;
  if (n < (1 << 16) || dp < 0 || j->ndim < 2) {
    gs_range(j, 0, n);
    return 0;
  }
  int perm[RH_MAXDIM], k = 0;
  perm[k++] = dp;
  for (int d = 0; d < j->ndim; d++)
    if (d != dp) perm[k++] = d;
  rh_tensor_t *pv = rh_tensor_permute(ci, perm);
  rh_tensor_t *pc = pv ? rh_tensor_clone(pv) : NULL;
  rh_tensor_release(pv);
  if (!pc) return -1;
  gs_split_t sp;
  sp.base = *j;
  for (int d = 0; d < j->ndim; d++) {
    sp.base.size[d] = j->size[perm[d]];
    sp.base.ast[d] = j->ast[perm[d]];
    sp.base.ost[d] = j->ost[perm[d]];
    if (perm[d] == j->dim) sp.base.dim = d;
  }
  sp.base.idx = rh_tensor_data(pc);
  sp.per = n / sp.base.size[0];
  rh_parallel_for(sp.base.size[0], 1, scatter_chunk, &sp);
  rh_tensor_release(pc);
  return 0;
}

/* scatter_(a, dim, idx, src | value): in place on a. accumulate: add instead of
 * store (scatter_add_). Stores to one place from several index entries keep the
 * last in idx's order, every time (see scatter_host). */
int rh_tensor_scatter_(rh_tensor_t *a, int dim, rh_tensor_t *idx, rh_tensor_t *src, double value, int accumulate,
                       int64_t base) {
  const char *what = accumulate ? "scatter_add" : "scatter";
  if (rh__check_dim(what, dim, a->ndim) || check_gather_shape(what, a, idx, src, dim)) return -1;
  if (src && src->dtype != a->dtype)
    return rh_tensor_fail("%s: the source's dtype %s must match the input's %s", what, rh_dtype_name(src->dtype),
                          rh_dtype_name(a->dtype));
  if (src && rh__same_device(what, a, src)) return -1;
  rh_tensor_t *ci = checked_index(what, idx, a->ndim ? a->size[dim] : 1, dim, base);
  if (!ci) return -1;
  int mode = src ? (accumulate ? 2 : 1) : 3;
  int rc = 0;
  gs_t j;
  gs_setup(&j, mode, a, dim, idx, src);
  if (RH_ON_DEVICE(a)) {
    rh_tensor_t *di = index_on(ci, a);
    rc = di ? rh__cuda_call(rh_cuda_api()->gather_scatter(
                  rh_tensor_device(a), mode, a->dtype, idx->ndim, j.dim, idx->size, rh_tensor_data(di),
                  rh_tensor_data(a), j.ast, src ? rh_tensor_data(src) : rh_tensor_data(a), src ? j.ost : j.ast, value))
            : -1;
    rh_tensor_release(di);
  } else {
    j.idx = rh_tensor_data(ci);
    rh__store(a->dtype, j.value, value);
    rc = scatter_host(&j, ci);
  }
  rh_tensor_release(ci);
  return rc;
}

typedef struct {
  const char *src;
  char *dst;
  const int64_t *idx;
  int64_t m, n, inner;
  rh_dtype_t dt;
  int accumulate;
} iput_t;

#define IPUT_ADD(T) \
  for (int64_t k = 0; k < j->inner; k++) ((T *)d)[k] += ((const T *)s)[k]

static void iput_chunk(void *vj, int64_t lo, int64_t hi) {
  iput_t *j = vj;
  size_t es = rh_dtype_size(j->dt);
  int64_t slab = j->inner * (int64_t)es;
  for (int64_t o = lo; o < hi; o++)
    for (int64_t i = 0; i < j->m; i++) {
      char *d = j->dst + (o * j->n + j->idx[i]) * slab;
      const char *s = j->src + (o * j->m + i) * slab;
      if (!j->accumulate) {
        memcpy(d, s, (size_t)slab);
        continue;
      }
      switch (j->dt) {
        case RH_F32: IPUT_ADD(float); break;
        case RH_F64: IPUT_ADD(double); break;
        case RH_I32: IPUT_ADD(uint32_t); break; /* unsigned: wraps, as the reductions do */
        case RH_I64: IPUT_ADD(uint64_t); break;
        case RH_U8: IPUT_ADD(uint8_t); break;
        default: /* bool: an add is an or */
          for (int64_t k = 0; k < j->inner; k++) d[k] = d[k] || s[k];
          break;
      }
    }
}

/* index_put_(a, dim, idx, src, accumulate): a[..., idx[i], ...] = (or +=) src[..., i, ...];
 * src has a's shape with idx's length along dim (the caller broadcasts it). */
int rh_tensor_index_put_(rh_tensor_t *a, int dim, rh_tensor_t *idx, rh_tensor_t *src, int accumulate, int64_t base) {
  const char *what = accumulate ? "index_add" : "index_copy";
  if (rh__check_dim(what, dim, a->ndim)) return -1;
  if (idx->ndim > 1) return rh_tensor_fail("%s: the index must be 1-dimensional, got %d dimensions", what, idx->ndim);
  int64_t m = rh_tensor_numel(idx);
  int ok = src->ndim == (a->ndim ? a->ndim : 1) || (a->ndim == 0 && src->ndim == 0);
  for (int d = 0; ok && d < a->ndim; d++) ok = src->size[d] == (d == dim ? m : a->size[d]);
  if (!ok) {
    char sa[256], ss[256];
    rh_shape_str(a->ndim, a->size, sa, sizeof sa);
    rh_shape_str(src->ndim, src->size, ss, sizeof ss);
    return rh_tensor_fail("%s: the source (shape %s) must have the input's shape %s with %lld along dimension %d", what,
                          ss, sa, (long long)m, dim + 1);
  }
  if (src->dtype != a->dtype)
    return rh_tensor_fail("%s: the source's dtype %s must match the input's %s", what, rh_dtype_name(src->dtype),
                          rh_dtype_name(a->dtype));
  if (rh__same_device(what, a, src)) return -1;
  rh_tensor_t *ci = checked_index(what, idx, a->ndim ? a->size[dim] : 1, dim, base);
  if (!ci) return -1;
  if (!RH_ON_DEVICE(a) && rh_tensor_is_contiguous(a) && a->ndim > 0) {
    /* contiguous on the host: slab by slab (no index of src's size) */
    rh_tensor_t *cs = rh_tensor_contiguous(src);
    if (!cs) {
      rh_tensor_release(ci);
      return -1;
    }
    int64_t inner = 1, outer = 1;
    for (int d = dim + 1; d < a->ndim; d++) inner *= a->size[d];
    for (int d = 0; d < dim; d++) outer *= a->size[d];
    iput_t j = {rh_tensor_data(cs), rh_tensor_data(a), rh_tensor_data(ci), m, a->size[dim], inner,
                a->dtype,           accumulate};
    /* whole outer slices per thread: repeated indices within one are applied in order */
    rh_parallel_for(outer, outer * m * inner >= (1 << 16) ? 1 : outer, iput_chunk, &j);
    rh_tensor_release(cs);
    rh_tensor_release(ci);
    return 0;
  }
  /* as a scatter whose index is idx broadcast over src's shape */
  int64_t isz[RH_MAXDIM], ist[RH_MAXDIM];
  int nd = a->ndim;
  for (int d = 0; d < nd; d++) {
    isz[d] = src->size[d];
    ist[d] = d == dim ? 1 : 0;
  }
  rh_tensor_t *bi = nd ? rh_tensor_on_storage(ci->storage, RH_I64, 0, nd, isz, ist) : NULL;
  rh_tensor_t *full = bi ? rh_tensor_contiguous(bi) : ci;
  if (!bi) rh_tensor_retain(ci);
  rh_tensor_release(bi);
  rh_tensor_release(ci);
  if (!full) return -1;
  /* the indices are 0-based now */
  int rc = rh_tensor_scatter_(a, dim, full, src, 0, accumulate, 0);
  rh_tensor_release(full);
  return rc;
}

/* ---- masks */
static int check_mask(const char *what, const rh_tensor_t *mask) {
  if (mask->dtype != RH_BOOL && mask->dtype != RH_U8)
    return rh_tensor_fail("%s: the mask must be a bool tensor, got %s", what, rh_dtype_name(mask->dtype));
  return 0;
}

typedef struct {
  size_t es;
  char value[8];
} mfill_t;

/* o = value where the mask (a) is set; with b: o = b where the mask is set */
static void mfill_loop(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                       void *ctx) {
  mfill_t *f = ctx;
  for (int64_t i = 0; i < n; i++)
    if (a[i * as]) memcpy(o + i * os, b ? b + i * bs : f->value, f->es);
}

/* the mask broadcasts to t's shape (it may not widen t): that shape, its *nd
 * dims, into shape */
static int mask_broadcasts(const char *what, const rh_tensor_t *t, const rh_tensor_t *mask, int *nd, int64_t *shape) {
  if (rh__broadcast_shape(t->ndim, t->size, mask->ndim, mask->size, nd, shape)) return -1;
  if (*nd != t->ndim || memcmp(shape, t->size, sizeof(int64_t) * (size_t)*nd)) {
    char st[256], sm[256];
    rh_shape_str(t->ndim, t->size, st, sizeof st);
    rh_shape_str(mask->ndim, mask->size, sm, sizeof sm);
    return rh_tensor_fail("%s: the mask (shape %s) does not broadcast to the tensor's shape %s", what, sm, st);
  }
  return 0;
}

/* masked_fill_(t, mask, v): the mask broadcasts to t */
int rh_tensor_masked_fill_(rh_tensor_t *t, rh_tensor_t *mask, double v) {
  if (check_mask("masked_fill", mask) || rh__same_device("masked_fill", t, mask)) return -1;
  int nd;
  int64_t shape[RH_MAXDIM];
  if (mask_broadcasts("masked_fill", t, mask, &nd, shape)) return -1;
  int64_t ost[RH_MAXDIM], mst[RH_MAXDIM];
  strides_bytes(t, ost);
  rh__bcast_strides(mask, nd, shape, mst);
  if (RH_ON_DEVICE(t))
    return rh__cuda_call(rh_cuda_api()->masked_fill(rh_tensor_device(t), t->dtype, nd, shape, rh_tensor_data(t), ost,
                                                    rh_tensor_data(mask), mst, NULL, NULL, v));
  mfill_t f = {rh_dtype_size(t->dtype), {0}};
  rh__store(t->dtype, f.value, v);
  rh__iterate(nd, shape, rh_tensor_data(t), ost, rh_tensor_data(mask), mst, NULL, NULL, mfill_loop, &f);
  return 0;
}

/* where(cond, a, b): a where cond, else b; broadcast, promoted */
rh_tensor_t *rh_tensor_where(rh_tensor_t *cond, rh_tensor_t *a, rh_tensor_t *b) {
  if (check_mask("where", cond) || rh__same_device("where", cond, a) || rh__same_device("where", a, b)) return NULL;
  int n1, nd;
  int64_t s1[RH_MAXDIM], shape[RH_MAXDIM];
  if (rh__broadcast_shape(a->ndim, a->size, b->ndim, b->size, &n1, s1) ||
      rh__broadcast_shape(cond->ndim, cond->size, n1, s1, &nd, shape))
    return NULL;
  rh_dtype_t dt = rh_dtype_promote(a->dtype, b->dtype);
  rh_tensor_t *out = rh_tensor_empty_on(rh_tensor_device(a), dt, nd, shape);
  if (!out) return NULL;
  rh_tensor_t *ac = NULL;
  if (rh_tensor_copy_(out, b)) goto fail;
  ac = a->dtype == dt ? (rh_tensor_retain(a), a) : rh_tensor_cast(a, dt);
  if (!ac) goto fail;
  int64_t ost[RH_MAXDIM], cst[RH_MAXDIM], ast[RH_MAXDIM];
  strides_bytes(out, ost);
  rh__bcast_strides(cond, nd, shape, cst);
  rh__bcast_strides(ac, nd, shape, ast);
  if (RH_ON_DEVICE(out)) {
    if (rh__cuda_call(rh_cuda_api()->masked_fill(rh_tensor_device(out), dt, nd, shape, rh_tensor_data(out), ost,
                                                 rh_tensor_data(cond), cst, rh_tensor_data(ac), ast, 0)))
      goto fail;
  } else {
    mfill_t f = {rh_dtype_size(dt), {0}};
    rh__iterate(nd, shape, rh_tensor_data(out), ost, rh_tensor_data(cond), cst, rh_tensor_data(ac), ast, mfill_loop,
                &f);
  }
  rh_tensor_release(ac);
  return out;
fail:
  rh_tensor_release(ac);
  rh_tensor_release(out);
  return NULL;
}

/* contiguous copies of t and of mask broadcast to t's shape, on the host or
 * (keep_device) where t lives */
static int mask_pair(const char *what, rh_tensor_t *t, rh_tensor_t *mask, rh_tensor_t **ht, rh_tensor_t **hm,
                     int keep_device) {
  *ht = *hm = NULL;
  if (check_mask(what, mask)) return -1;
  int nd;
  int64_t shape[RH_MAXDIM];
  if (mask_broadcasts(what, t, mask, &nd, shape)) return -1;
  int dev = keep_device ? rh_tensor_device(t) : -1;
  rh_tensor_t *me = rh_tensor_expand(mask, nd, shape);
  rh_tensor_t *mh = me ? rh_tensor_to_device(me, dev) : NULL;
  rh_tensor_release(me);
  *hm = mh ? rh_tensor_contiguous(mh) : NULL;
  rh_tensor_release(mh);
  rh_tensor_t *th = *hm ? rh_tensor_to_device(t, dev) : NULL;
  *ht = th ? rh_tensor_contiguous(th) : NULL;
  rh_tensor_release(th);
  if (!*hm || !*ht) {
    rh_tensor_release(*hm);
    rh_tensor_release(*ht);
    *hm = *ht = NULL;
    return -1;
  }
  return 0;
}

/* on a device: each set element's place among the set ones, and their count */
static rh_tensor_t *device_places(const rh_tensor_t *m, int64_t *count) {
  int64_t n = rh_tensor_numel(m);
  rh_tensor_t *pos = rh_tensor_empty_on(rh_tensor_device(m), RH_I64, 1, &n);
  if (pos &&
      rh__cuda_call(rh_cuda_api()->mask_scan(rh_tensor_device(m), n, rh_tensor_data(m), rh_tensor_data(pos), count))) {
    rh_tensor_release(pos);
    return NULL;
  }
  return pos;
}

static int64_t count_set(const rh_tensor_t *m) {
  const uint8_t *p = rh_tensor_data(m);
  int64_t n = rh_tensor_numel(m), c = 0;
  for (int64_t i = 0; i < n; i++) c += p[i] != 0;
  return c;
}

/* masked_select(t, mask): the elements where mask is set, in order, as 1-D.
 * The result's size depends on the data: on a device a prefix sum places each
 * element, and its count comes back to the host to size the result. */
rh_tensor_t *rh_tensor_masked_select(rh_tensor_t *t, rh_tensor_t *mask) {
  if (rh__same_device("masked_select", t, mask)) return NULL;
  rh_tensor_t *ht, *hm;
  if (mask_pair("masked_select", t, mask, &ht, &hm, 1)) return NULL;
  int64_t c = 0, n = rh_tensor_numel(hm);
  size_t es = rh_dtype_size(t->dtype);
  rh_tensor_t *out = NULL;
  if (RH_ON_DEVICE(t)) {
    rh_tensor_t *pos = device_places(hm, &c);
    out = pos ? rh_tensor_empty_on(rh_tensor_device(t), t->dtype, 1, &c) : NULL;
    if (out &&
        rh__cuda_call(rh_cuda_api()->mask_compact(rh_tensor_device(t), (int)es, n, rh_tensor_data(hm),
                                                  rh_tensor_data(pos), rh_tensor_data(ht), rh_tensor_data(out)))) {
      rh_tensor_release(out);
      out = NULL;
    }
    rh_tensor_release(pos);
  } else {
    c = count_set(hm);
    out = rh_tensor_empty(t->dtype, 1, &c);
    if (out) {
      const uint8_t *m = rh_tensor_data(hm);
      const char *src = rh_tensor_data(ht);
      char *dst = rh_tensor_data(out);
      for (int64_t i = 0, k = 0; i < n; i++)
        if (m[i]) memcpy(dst + (k++) * es, src + i * es, es);
    }
  }
  rh_tensor_release(ht);
  rh_tensor_release(hm);
  return out;
}

/* masked_scatter_(t, mask, src): t's elements where mask is set take src's
 * elements in order; src needs at least as many elements as the mask sets */
int rh_tensor_masked_scatter_(rh_tensor_t *t, rh_tensor_t *mask, rh_tensor_t *src) {
  if (rh__same_device("masked_scatter", t, mask) || rh__same_device("masked_scatter", t, src)) return -1;
  if (src->dtype != t->dtype)
    return rh_tensor_fail("masked_scatter: the source's dtype %s must match the tensor's %s", rh_dtype_name(src->dtype),
                          rh_dtype_name(t->dtype));
  rh_tensor_t *ht, *hm;
  if (mask_pair("masked_scatter", t, mask, &ht, &hm, 1)) return -1;
  int on_dev = RH_ON_DEVICE(t);
  int64_t c = 0, n = rh_tensor_numel(hm);
  rh_tensor_t *pos = NULL, *cs = NULL, *work = NULL;
  int rc = -1;
  if (on_dev) {
    pos = device_places(hm, &c);
    if (!pos) goto done;
  } else {
    c = count_set(hm);
  }
  if (rh_tensor_numel(src) < c) {
    rh_tensor_fail("masked_scatter: the mask selects %lld elements but the source has only %lld", (long long)c,
                   (long long)rh_tensor_numel(src));
    goto done;
  }
  cs = rh_tensor_contiguous(src);
  /* ht may be t itself (contiguous already): write into a copy, then copy back */
  work = cs ? rh_tensor_clone(ht) : NULL;
  if (!work) goto done;
  size_t es = rh_dtype_size(t->dtype);
  if (on_dev) {
    if (rh__cuda_call(rh_cuda_api()->mask_expand(rh_tensor_device(t), (int)es, n, rh_tensor_data(hm),
                                                 rh_tensor_data(pos), rh_tensor_data(cs), rh_tensor_data(work))))
      goto done;
  } else {
    const uint8_t *m = rh_tensor_data(hm);
    const char *s = rh_tensor_data(cs);
    char *d = rh_tensor_data(work);
    for (int64_t i = 0, k = 0; i < n; i++)
      if (m[i]) memcpy(d + i * es, s + (k++) * es, es);
  }
  rc = rh_tensor_copy_(t, work); /* back into t's own layout */
done:
  rh_tensor_release(pos);
  rh_tensor_release(cs);
  rh_tensor_release(work);
  rh_tensor_release(ht);
  rh_tensor_release(hm);
  return rc;
}

/* nonzero(t): int64 [count, ndim], the positions (plus base) of non-zero elements */
rh_tensor_t *rh_tensor_nonzero(rh_tensor_t *t, int64_t base) {
  if (RH_ON_DEVICE(t)) {
    /* the set elements (NaN counts: it is not 0), placed by a prefix sum */
    rh_tensor_t *m = rh_tensor_binary_scalar(RH_OP_NE, t, 0, 0, 0, NULL);
    int64_t c = 0;
    rh_tensor_t *pos = m ? device_places(m, &c) : NULL;
    int64_t size[2] = {c, t->ndim};
    rh_tensor_t *out = pos ? rh_tensor_empty_on(rh_tensor_device(t), RH_I64, 2, size) : NULL;
    if (out && rh__cuda_call(rh_cuda_api()->nonzero_write(rh_tensor_device(t), rh_tensor_numel(m), t->ndim, t->size,
                                                          rh_tensor_data(m), rh_tensor_data(pos), rh_tensor_data(out),
                                                          base))) {
      rh_tensor_release(out);
      out = NULL;
    }
    rh_tensor_release(pos);
    rh_tensor_release(m);
    return out;
  }
  rh_tensor_t *h = rh_tensor_to_device(t, -1);
  rh_tensor_t *ct = h ? rh_tensor_contiguous(h) : NULL;
  rh_tensor_release(h);
  if (!ct) return NULL;
  int64_t n = rh_tensor_numel(ct), c = 0;
  size_t es = rh_dtype_size(t->dtype);
  const char *p = rh_tensor_data(ct);
  for (int64_t i = 0; i < n; i++)
    c += rh__load(t->dtype, p + i * es) != 0 || rh__load(t->dtype, p + i * es) != rh__load(t->dtype, p + i * es);
  int64_t size[2] = {c, t->ndim};
  rh_tensor_t *out = rh_tensor_empty(RH_I64, 2, size);
  if (out) {
    int64_t *o = rh_tensor_data(out), idx[RH_MAXDIM] = {0};
    for (int64_t i = 0; i < n; i++) {
      double v = rh__load(t->dtype, p + i * es);
      if (v != 0 || v != v)
        for (int d = 0; d < t->ndim; d++) *o++ = idx[d] + base;
      for (int d = t->ndim - 1; d >= 0; d--) {
        if (++idx[d] < t->size[d]) break;
        idx[d] = 0;
      }
    }
  }
  rh_tensor_release(ct);
  return out;
}
