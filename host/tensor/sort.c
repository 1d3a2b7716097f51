/* sort.c: ops that order or accumulate along one dimension: sort (and with it
 * argsort and topk, which the Lua face builds on it) and the scans cumsum and
 * cumprod.
 *
 * Both move the dimension last and make rows contiguous, work row by row (rows
 * spread over the thread pool), and permute the result back. Sorting is a
 * stable LSD radix sort on keys that order like the values (floats with their
 * sign folded in, NaN after +inf as PyTorch puts it; descending order is the
 * complement of the keys, so ties keep their original order either way); short
 * rows use insertion sort. On a device the same keys go through CUB's segmented
 * radix sort and the scans run one thread per row (kernels/sort.cu). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

/* a's `dim` moved last and contiguous, where a lives; rows x len */
static rh_tensor_t *rows_last(rh_tensor_t *a, int dim, int64_t *rows, int64_t *len) {
  int perm[RH_MAXDIM], k = 0;
  for (int i = 0; i < a->ndim; i++)
    if (i != dim) perm[k++] = i;
  perm[k] = dim;
  rh_tensor_t *v = a->ndim ? rh_tensor_permute(a, perm) : (rh_tensor_retain(a), a);
  if (!v) return NULL;
  rh_tensor_t *c = rh_tensor_contiguous(v);
  rh_tensor_release(v);
  *len = a->ndim ? a->size[dim] : 1;
  int64_t n = rh_tensor_numel(a);
  *rows = *len ? n / *len : 0;
  return c;
}

/* res (rows-last layout of a's shape) permuted back to a's dim order, contiguous */
static rh_tensor_t *rows_back(rh_tensor_t *res, int ndim, int dim) {
  rh_tensor_t *back;
  if (ndim > 1) {
    int inv[RH_MAXDIM], k = 0;
    for (int i = 0; i < ndim; i++) inv[i] = i == dim ? ndim - 1 : k++;
    rh_tensor_t *p = rh_tensor_permute(res, inv);
    if (!p) return NULL;
    back = rh_tensor_contiguous(p);
    rh_tensor_release(p);
  } else {
    rh_tensor_retain(res);
    back = res;
  }
  return back;
}

/* ---- keys that order like the values */
static uint64_t key_of(rh_dtype_t dt, const char *p) {
  switch (dt) {
    case RH_F32: {
      float f = *(const float *)p;
      uint32_t u;
      if (f != f) return 0xFFFFFFFFull; /* every NaN after +inf */
      if (f == 0) f = 0;                /* -0 ties with 0, as a comparison does */
      memcpy(&u, &f, 4);
      return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    case RH_F64: {
      double f = *(const double *)p;
      uint64_t u;
      if (f != f) return ~0ull;
      if (f == 0) f = 0;
      memcpy(&u, &f, 8);
      return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
    }
    case RH_I32: return (uint32_t)(*(const int32_t *)p) ^ 0x80000000u;
    case RH_I64: return (uint64_t)(*(const int64_t *)p) ^ 0x8000000000000000ull;
    default: return *(const uint8_t *)p;
  }
}

static int key_bytes(rh_dtype_t dt) { return dt == RH_F64 || dt == RH_I64 ? 8 : dt == RH_U8 || dt == RH_BOOL ? 1 : 4; }

typedef struct {
  rh_dtype_t dt;
  int descending;
  int64_t len;
  const char *in;
  char *vals;
  int64_t *idx;
  int64_t base;
} sort_job_t;

/* sorts one row: fills order[] with the positions of the row in sorted order */
static void sort_row(const sort_job_t *j, const char *row, int64_t *order, uint64_t *keys, uint64_t *ktmp,
                     int64_t *otmp) {
  int64_t n = j->len;
  size_t es = rh_dtype_size(j->dt);
  int kb = key_bytes(j->dt);
  uint64_t mask = kb == 8 ? ~0ull : ((1ull << (8 * kb)) - 1);
  for (int64_t i = 0; i < n; i++) {
    uint64_t k = key_of(j->dt, row + i * es);
    keys[i] = j->descending ? (~k & mask) : k;
    order[i] = i;
  }
  if (n <= 32) { /* insertion sort: stable */
    for (int64_t i = 1; i < n; i++) {
      uint64_t k = keys[i];
      int64_t o = order[i], p = i - 1;
      while (p >= 0 && keys[p] > k) {
        keys[p + 1] = keys[p];
        order[p + 1] = order[p];
        p--;
      }
      keys[p + 1] = k;
      order[p + 1] = o;
    }
    return;
  }
  /* LSD radix, 8 bits a pass; passes where every key has the same digit are skipped */
  for (int shift = 0; shift < 8 * kb; shift += 8) {
    int64_t count[257] = {0};
    for (int64_t i = 0; i < n; i++) count[((keys[i] >> shift) & 0xFF) + 1]++;
    int trivial = 0;
    for (int b = 1; b <= 256; b++)
      if (count[b] == n) trivial = 1;
    if (trivial) continue;
    for (int b = 1; b <= 256; b++) count[b] += count[b - 1];
    for (int64_t i = 0; i < n; i++) {
      int64_t at = count[(keys[i] >> shift) & 0xFF]++;
      ktmp[at] = keys[i];
      otmp[at] = order[i];
    }
    memcpy(keys, ktmp, (size_t)n * sizeof *keys);
    memcpy(order, otmp, (size_t)n * sizeof *order);
  }
}

static void sort_chunk(void *vj, int64_t lo, int64_t hi) {
  sort_job_t *j = vj;
  int64_t n = j->len;
  size_t es = rh_dtype_size(j->dt);
  uint64_t *keys = malloc((size_t)(n ? n : 1) * 2 * sizeof(uint64_t));
  int64_t *otmp = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  int64_t *order = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  if (!keys || !otmp || !order) {
    /* leave the job's error flag: the caller checks idx[0] sentinel */
    free(keys), free(otmp), free(order);
    j->base = INT64_MIN;
    return;
  }
  for (int64_t r = lo; r < hi; r++) {
    const char *row = j->in + r * n * (int64_t)es;
    sort_row(j, row, order, keys, keys + n, otmp);
    char *vrow = j->vals + r * n * (int64_t)es;
    int64_t *irow = j->idx + r * n;
    for (int64_t i = 0; i < n; i++) {
      memcpy(vrow + i * es, row + order[i] * es, es);
      irow[i] = order[i] + j->base;
    }
  }
  free(keys), free(otmp), free(order);
}

int rh_tensor_sort(rh_tensor_t *a, int dim, int descending, int64_t base, rh_tensor_t **values, rh_tensor_t **indices) {
  *values = *indices = NULL;
  if (rh__check_dim("sort", dim, a->ndim)) return -1;
  int64_t rows, len;
  rh_tensor_t *src = rows_last(a, dim, &rows, &len);
  if (!src) return -1;
  int dev = rh_tensor_device(a);
  rh_tensor_t *v = rh_tensor_empty_on(dev, a->dtype, src->ndim, src->size);
  rh_tensor_t *ix = v ? rh_tensor_empty_on(dev, RH_I64, src->ndim, src->size) : NULL;
  int rc = -1;
  if (ix && dev >= 0) {
    if (rh__cuda_call(rh_cuda_api()->sort_rows(dev, a->dtype, descending, rows, len, rh_tensor_data(src),
                                               rh_tensor_data(v), rh_tensor_data(ix), base)) == 0) {
      *values = rows_back(v, a->ndim, dim);
      *indices = *values ? rows_back(ix, a->ndim, dim) : NULL;
      rc = *indices ? 0 : -1;
    }
  } else if (ix) {
    sort_job_t j = {a->dtype, descending, len, rh_tensor_data(src), rh_tensor_data(v), rh_tensor_data(ix), base};
    /* one row per grain when rows are long; many short rows per grain otherwise */
    int64_t grain = len >= 4096 ? 1 : (1 << 14) / (len + 1) + 1;
    rh_parallel_for(rows, grain, sort_chunk, &j);
    if (j.base == INT64_MIN) rh_tensor_fail("sort: out of memory");
    else {
      *values = rows_back(v, a->ndim, dim);
      *indices = *values ? rows_back(ix, a->ndim, dim) : NULL;
      rc = *indices ? 0 : -1;
    }
  }
  rh_tensor_release(src);
  rh_tensor_release(v);
  rh_tensor_release(ix);
  if (rc) {
    rh_tensor_release(*values);
    *values = NULL;
  }
  return rc;
}

/* ---- scans: cumsum / cumprod. Floats stay in their dtype (accumulated in
 * double); integers and bools give int64, as in PyTorch. */
typedef struct {
  rh_dtype_t in_dt, out_dt;
  int prod;
  int64_t len;
  const char *in;
  char *out;
} scan_job_t;

static void scan_chunk(void *vj, int64_t lo, int64_t hi) {
  scan_job_t *j = vj;
  size_t ies = rh_dtype_size(j->in_dt), oes = rh_dtype_size(j->out_dt);
  for (int64_t r = lo; r < hi; r++) {
    const char *row = j->in + r * j->len * (int64_t)ies;
    char *orow = j->out + r * j->len * (int64_t)oes;
    if (j->out_dt == RH_I64) {
      /* exact and wrapping, as the integer reductions are */
      uint64_t acc = j->prod ? 1 : 0;
      for (int64_t i = 0; i < j->len; i++) {
        uint64_t v = j->in_dt == RH_I64 ? (uint64_t)((const int64_t *)row)[i]
                                        : (uint64_t)(int64_t)rh__load(j->in_dt, row + i * ies);
        acc = j->prod ? acc * v : acc + v;
        ((int64_t *)orow)[i] = (int64_t)acc;
      }
    } else {
      double acc = j->prod ? 1 : 0;
      for (int64_t i = 0; i < j->len; i++) {
        double v = rh__load(j->in_dt, row + i * ies);
        acc = j->prod ? acc * v : acc + v;
        rh__store(j->out_dt, orow + i * oes, acc);
      }
    }
  }
}

rh_tensor_t *rh_tensor_scan(rh_tensor_t *a, int dim, int prod) {
  if (rh__check_dim(prod ? "cumprod" : "cumsum", dim, a->ndim)) return NULL;
  int64_t rows, len;
  rh_tensor_t *src = rows_last(a, dim, &rows, &len);
  if (!src) return NULL;
  rh_dtype_t odt = rh_dtype_is_float(a->dtype) ? a->dtype : RH_I64;
  int dev = rh_tensor_device(a);
  rh_tensor_t *res = rh_tensor_empty_on(dev, odt, src->ndim, src->size), *out = NULL;
  if (res && dev >= 0) {
    if (rh__cuda_call(rh_cuda_api()->scan_rows(dev, a->dtype, odt, prod, rows, len, rh_tensor_data(src),
                                               rh_tensor_data(res))) == 0)
      out = rows_back(res, a->ndim, dim);
  } else if (res) {
    scan_job_t j = {a->dtype, odt, prod, len, rh_tensor_data(src), rh_tensor_data(res)};
    rh_parallel_for(rows, len >= 4096 ? 1 : (1 << 14) / (len + 1) + 1, scan_chunk, &j);
    out = rows_back(res, a->ndim, dim);
  }
  rh_tensor_release(src);
  rh_tensor_release(res);
  return out;
}
