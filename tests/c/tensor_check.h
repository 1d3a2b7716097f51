/* tensor_check.h: what the tensor core's C tests share: tensors made from a
 * list of values, the same values in a strided layout, and an exact comparison
 * of a result with the values it must hold.
 *
 * Torch7's rule: every op is run on contiguous and on strided operands. strided()
 * makes the strided one without the copy machinery under test: a column-major
 * layout (dimensions reversed) with a gap after every element and an offset,
 * written element by element through rh_tensor_set. Comparisons are exact (==,
 * NaN equal to NaN): the expected values are chosen to be representable. Each
 * test ends by proving it left no tensor bytes live, as libuv's tests end by
 * proving the loop closed. */
#ifndef RH_TENSOR_CHECK_H
#define RH_TENSOR_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "tensor/tensor.h"
#include "test_check.h"

/* the next index of shape (ndim, size) in row-major order; 0 after the last */
static inline int next_index(int ndim, const int64_t *size, int64_t *idx) {
  for (int d = ndim - 1; d >= 0; d--) {
    if (++idx[d] < size[d]) return 1;
    idx[d] = 0;
  }
  return 0;
}

/* a contiguous tensor of shape (ndim, size) holding v in row-major order (new reference) */
static inline rh_tensor_t *mk(rh_dtype_t dt, int ndim, const int64_t *size, const double *v) {
  rh_tensor_t *t = rh_tensor_empty(dt, ndim, size);
  CHECK(t != NULL);
  if (!t || rh_tensor_numel(t) == 0) return t;
  int64_t idx[RH_MAXDIM] = {0}, k = 0;
  do rh_tensor_set(t, idx, v[k++]);
  while (next_index(ndim, size, idx));
  return t;
}

/* t's values in a strided layout: column-major, every other element, offset 1 (new reference) */
static inline rh_tensor_t *strided(rh_tensor_t *t) {
  int64_t n = rh_tensor_numel(t), stride[RH_MAXDIM], s = 2;
  for (int d = 0; d < t->ndim; d++) {
    stride[d] = s;
    s *= t->size[d] > 0 ? t->size[d] : 1;
  }
  rh_storage_t *st = rh_storage_new((size_t)(2 * n + 2) * rh_dtype_size(t->dtype));
  rh_tensor_t *o = rh_tensor_on_storage(st, t->dtype, 1, t->ndim, t->size, stride);
  rh_storage_release(st);
  CHECK(o != NULL);
  if (!o || n == 0) return o;
  CHECK(t->ndim < 2 || !rh_tensor_is_contiguous(o));
  int64_t idx[RH_MAXDIM] = {0};
  do rh_tensor_set(o, idx, rh_tensor_get(t, idx));
  while (next_index(t->ndim, t->size, idx));
  return o;
}

/* 1 when t has dtype dt, shape (ndim, size) and exactly the values want
 * (row-major); else 0, saying what differs first */
static inline int holds(const char *what, const rh_tensor_t *t, rh_dtype_t dt, int ndim, const int64_t *size,
                        const double *want) {
  if (!t) {
    fprintf(stderr, "  %s: no tensor (%s)\n", what, rh_tensor_errmsg());
    return 0;
  }
  char a[128], b[128];
  rh_shape_str(t->ndim, t->size, a, sizeof a);
  rh_shape_str(ndim, size, b, sizeof b);
  if (t->dtype != dt || strcmp(a, b) != 0) {
    fprintf(stderr, "  %s: %s %s, want %s %s\n", what, rh_dtype_name(t->dtype), a, rh_dtype_name(dt), b);
    return 0;
  }
  if (rh_tensor_numel(t) == 0) return 1;
  int64_t idx[RH_MAXDIM] = {0}, k = 0;
  do {
    double got = rh_tensor_get(t, idx), w = want[k];
    if (!(got == w || (isnan(got) && isnan(w)))) {
      fprintf(stderr, "  %s: element %lld is %.17g, want %.17g\n", what, (long long)k, got, w);
      return 0;
    }
    k++;
  } while (next_index(ndim, size, idx));
  return 1;
}

/* holds() for a result the caller is done with: releases it */
static inline int holds_r(const char *what, rh_tensor_t *t, rh_dtype_t dt, int ndim, const int64_t *size,
                          const double *want) {
  int ok = holds(what, t, dt, ndim, size, want);
  rh_tensor_release(t);
  return ok;
}

/* 1 when the last failure's message contains part; else 0, printing it */
static inline int says(const char *part) {
  if (strstr(rh_tensor_errmsg(), part)) return 1;
  fprintf(stderr, "  \"%s\" does not say \"%s\"\n", rh_tensor_errmsg(), part);
  return 0;
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define VALUES(...) ((const double[]){__VA_ARGS__})

#endif
