/* test_copy.c: every write of a whole tensor (host/tensor/copy.c): copy_ between
 * layouts (contiguous, strided, permuted: the tiled path for 8-, 4- and 1-byte
 * elements, large enough to be split over the pool and, for float32, to stream
 * past the caches), between every pair of dtypes with their conversions (float
 * to integer truncates toward zero and clamps, NaN gives 0; int64 to a narrower
 * integer wraps; anything non-zero is true), with a broadcast source, and the
 * errors for a source that does not fit; contiguous, clone, cast, reshape
 * (a view when the strides allow, else a copy), fill_ and full, to_device on the
 * CPU. Each on contiguous and strided operands, with exact values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "tensor_check.h"

/* src (any layout) copied into a contiguous and into a strided destination of
 * dtype dt must hold want */
static int copies_to(const char *what, rh_tensor_t *src, rh_dtype_t dt, const double *want) {
  rh_tensor_t *d1 = rh_tensor_empty(dt, src->ndim, src->size);
  rh_tensor_t *d2 = strided(d1);
  int ok = rh_tensor_copy_(d1, src) == 0 && rh_tensor_copy_(d2, src) == 0;
  ok = ok && holds(what, d1, dt, src->ndim, src->size, want) && holds(what, d2, dt, src->ndim, src->size, want);
  rh_tensor_release(d1);
  rh_tensor_release(d2);
  return ok;
}

static void layouts(void) {
  static const double v[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  rh_tensor_t *a = mk(RH_F32, 2, SHAPE(3, 4), v), *as = strided(a);
  CHECK(copies_to("contiguous", a, RH_F32, v));
  CHECK(copies_to("strided", as, RH_F32, v));
  /* a transposed view, and a slice with a step: the values of the view */
  rh_tensor_t *t = rh_tensor_transpose(a, 0, 1), *ts = rh_tensor_transpose(as, 0, 1);
  static const double tv[] = {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11};
  CHECK(copies_to("transposed", t, RH_F32, tv));
  CHECK(copies_to("strided transposed", ts, RH_F32, tv));
  rh_tensor_t *sl = rh_tensor_slice(a, 1, 1, 4, 2), *sls = rh_tensor_slice(as, 1, 1, 4, 2);
  static const double slv[] = {1, 3, 5, 7, 9, 11};
  CHECK(copies_to("slice", sl, RH_F32, slv));
  CHECK(copies_to("strided slice", sls, RH_F32, slv));
  /* contiguous: t itself when it is; a new contiguous tensor when not */
  rh_tensor_t *c = rh_tensor_contiguous(a);
  CHECK(c == a && a->refcount == 2);
  rh_tensor_release(c);
  c = rh_tensor_contiguous(ts);
  CHECK(c != ts && c->storage != as->storage && rh_tensor_is_contiguous(c));
  CHECK(holds_r("contiguous of strided", c, RH_F32, 2, SHAPE(4, 3), tv));
  /* clone: new storage, same values, even of a contiguous tensor */
  c = rh_tensor_clone(a);
  CHECK(c && c->storage != a->storage);
  CHECK(holds_r("clone", c, RH_F32, 2, SHAPE(3, 4), v));
  /* 3-d permutations of every element size */
  static const rh_dtype_t dts[] = {RH_F64, RH_I32, RH_U8};
  double v24[24], p24[24];
  for (int i = 0; i < 24; i++) v24[i] = i;
  for (int k = 0; k < 3; k++) {
    rh_tensor_t *x = mk(dts[k], 3, SHAPE(2, 3, 4), v24), *xs = strided(x);
    rh_tensor_t *p = rh_tensor_permute(x, (const int[]){2, 0, 1}), *ps = rh_tensor_permute(xs, (const int[]){2, 0, 1});
    int n = 0;
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 2; j++)
        for (int l = 0; l < 3; l++) p24[n++] = j * 12 + l * 4 + i;
    CHECK(copies_to("permuted", p, dts[k], p24));
    CHECK(copies_to("strided permuted", ps, dts[k], p24));
    rh_tensor_release(p);
    rh_tensor_release(ps);
    rh_tensor_release(x);
    rh_tensor_release(xs);
  }
  rh_tensor_release(t);
  rh_tensor_release(ts);
  rh_tensor_release(sl);
  rh_tensor_release(sls);
  rh_tensor_release(a);
  rh_tensor_release(as);
}

/* The tiled transposes (4096 elements and more whose dense dimensions differ):
 * every element checked, for 8-, 4- and 1-byte elements, with edges that are not
 * whole tiles or vector blocks; float32 also at 8 MiB and more, where the pool
 * splits it and wide CPUs write past the caches. */
static void tiled(rh_dtype_t dt, int64_t rows, int64_t cols) {
  rh_tensor_t *a = rh_tensor_empty(dt, 2, SHAPE(rows, cols));
  int64_t mod = dt == RH_U8 ? 251 : INT64_C(1) << 24; /* exact in every dtype used */
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) rh_tensor_set(a, SHAPE(i, j), (double)((i * cols + j) % mod));
  rh_tensor_t *t = rh_tensor_transpose(a, 0, 1);
  rh_tensor_t *c = rh_tensor_contiguous(t);
  CHECK(c && rh_tensor_is_contiguous(c) && c->size[0] == cols && c->size[1] == rows);
  int bad = 0;
  for (int64_t j = 0; c && j < cols && !bad; j++)
    for (int64_t i = 0; i < rows && !bad; i++)
      if (rh_tensor_get(c, SHAPE(j, i)) != (double)((i * cols + j) % mod)) {
        fprintf(stderr, "  tiled %s %lldx%lld: [%lld, %lld] is %g\n", rh_dtype_name(dt), (long long)rows,
                (long long)cols, (long long)j, (long long)i, rh_tensor_get(c, SHAPE(j, i)));
        bad = 1;
      }
  CHECK(!bad);
  /* and back into a transposed destination (the other direction of the tiles) */
  rh_tensor_t *back = rh_tensor_empty(dt, 2, SHAPE(rows, cols));
  rh_tensor_t *bt = rh_tensor_transpose(back, 0, 1);
  CHECK(rh_tensor_copy_(bt, c) == 0);
  CHECK(memcmp(rh_tensor_data(back), rh_tensor_data(a), (size_t)(rows * cols) * rh_dtype_size(dt)) == 0);
  rh_tensor_release(bt);
  rh_tensor_release(back);
  rh_tensor_release(c);
  rh_tensor_release(t);
  rh_tensor_release(a);
}

static void dtypes(void) {
  static const double f[] = {2.75, -2.75, 300, -5, 0.5, NAN, 0, 1e10};
  const int64_t *s8 = SHAPE(8);
  for (int k = 0; k < 2; k++) {
    rh_tensor_t *x = mk(k ? RH_F32 : RH_F64, 1, s8, f), *xs = strided(x);
    for (int st = 0; st < 2; st++) {
      rh_tensor_t *src = st ? xs : x;
      CHECK(copies_to("float to int32", src, RH_I32, VALUES(2, -2, 300, -5, 0, 0, 0, 2147483647)));
      CHECK(copies_to("float to int64", src, RH_I64, VALUES(2, -2, 300, -5, 0, 0, 0, 1e10)));
      CHECK(copies_to("float to uint8", src, RH_U8, VALUES(2, 0, 255, 0, 0, 0, 0, 255)));
      CHECK(copies_to("float to bool", src, RH_BOOL, VALUES(1, 1, 1, 1, 1, 1, 0, 1)));
    }
    rh_tensor_release(x);
    rh_tensor_release(xs);
  }
  /* float64 to float32 rounds to nearest */
  rh_tensor_t *d = mk(RH_F64, 1, SHAPE(2), VALUES(0.1, 16777217));
  CHECK(copies_to("float64 to float32", d, RH_F32, VALUES((float)0.1, 16777216)));
  rh_tensor_release(d);
  /* int64 to narrower integers wraps (no trip through double); to floats rounds */
  static const double big[] = {4294967301.0, -1, 257, 0};
  rh_tensor_t *i = mk(RH_I64, 1, SHAPE(4), big), *is = strided(i);
  for (int st = 0; st < 2; st++) {
    rh_tensor_t *src = st ? is : i;
    CHECK(copies_to("int64 to int32", src, RH_I32, VALUES(5, -1, 257, 0)));
    CHECK(copies_to("int64 to uint8", src, RH_U8, VALUES(5, 255, 1, 0)));
    CHECK(copies_to("int64 to bool", src, RH_BOOL, VALUES(1, 1, 1, 0)));
    CHECK(copies_to("int64 to float64", src, RH_F64, big));
  }
  rh_tensor_release(i);
  rh_tensor_release(is);
  /* exact int64 beyond 2^53 survives an int64 copy */
  rh_tensor_t *h = rh_tensor_empty(RH_I64, 1, SHAPE(1));
  ((int64_t *)rh_tensor_data(h))[0] = (INT64_C(1) << 53) + 1;
  rh_tensor_t *hc = rh_tensor_clone(h);
  CHECK(hc && ((int64_t *)rh_tensor_data(hc))[0] == (INT64_C(1) << 53) + 1);
  rh_tensor_release(hc);
  rh_tensor_release(h);
  /* small integers and bools widen exactly */
  rh_tensor_t *u = mk(RH_U8, 1, SHAPE(3), VALUES(0, 200, 255)), *us = strided(u);
  CHECK(copies_to("uint8 to float32", u, RH_F32, VALUES(0, 200, 255)));
  CHECK(copies_to("strided uint8 to int32", us, RH_I32, VALUES(0, 200, 255)));
  rh_tensor_t *b = mk(RH_BOOL, 1, SHAPE(3), VALUES(1, 0, 1));
  CHECK(copies_to("bool to float32", b, RH_F32, VALUES(1, 0, 1)));
  CHECK(copies_to("bool to int64", b, RH_I64, VALUES(1, 0, 1)));
  /* cast: always a new tensor, contiguous */
  rh_tensor_t *c = rh_tensor_cast(us, RH_F64);
  CHECK(c && rh_tensor_is_contiguous(c) && c->storage != us->storage);
  CHECK(holds_r("cast", c, RH_F64, 1, SHAPE(3), VALUES(0, 200, 255)));
  c = rh_tensor_cast(u, RH_U8);
  CHECK(c && c != u && c->storage != u->storage);
  rh_tensor_release(c);
  rh_tensor_release(u);
  rh_tensor_release(us);
  rh_tensor_release(b);
}

static void broadcasts(void) {
  rh_tensor_t *row = mk(RH_F32, 1, SHAPE(3), VALUES(1, 2, 3)), *rows = strided(row);
  rh_tensor_t *col = mk(RH_I32, 2, SHAPE(2, 1), VALUES(7, 8)), *cols = strided(col);
  rh_tensor_t *one = mk(RH_F64, 0, NULL, VALUES(9));
  for (int st = 0; st < 2; st++) {
    CHECK(copies_to("row", st ? rows : row, RH_F32, VALUES(1, 2, 3)));
    rh_tensor_t *d = rh_tensor_empty(RH_F32, 2, SHAPE(2, 3)), *ds = strided(d);
    rh_tensor_t *dst = st ? ds : d;
    CHECK(rh_tensor_copy_(dst, st ? rows : row) == 0);
    CHECK(holds("row into [2, 3]", dst, RH_F32, 2, SHAPE(2, 3), VALUES(1, 2, 3, 1, 2, 3)));
    CHECK(rh_tensor_copy_(dst, st ? cols : col) == 0);
    CHECK(holds("column into [2, 3]", dst, RH_F32, 2, SHAPE(2, 3), VALUES(7, 7, 7, 8, 8, 8)));
    CHECK(rh_tensor_copy_(dst, one) == 0);
    CHECK(holds("0-d into [2, 3]", dst, RH_F32, 2, SHAPE(2, 3), VALUES(9, 9, 9, 9, 9, 9)));
    /* the source must broadcast to the destination's shape, not the other way */
    CHECK(rh_tensor_copy_(row, dst) == -1 && says("cannot copy a tensor of shape [2, 3] into one of shape [3]"));
    rh_tensor_t *two = rh_tensor_empty(RH_F32, 1, SHAPE(2));
    CHECK(rh_tensor_copy_(dst, two) == -1 &&
          says("shapes [2, 3] and [2] cannot be broadcast together (dimension 2: 3 vs 2)"));
    rh_tensor_release(two);
    rh_tensor_release(d);
    rh_tensor_release(ds);
  }
  rh_tensor_release(row);
  rh_tensor_release(rows);
  rh_tensor_release(col);
  rh_tensor_release(cols);
  rh_tensor_release(one);
}

static void fills_and_shapes(void) {
  rh_tensor_t *a = rh_tensor_full(RH_I32, 2, SHAPE(2, 3), -4);
  CHECK(holds("full", a, RH_I32, 2, SHAPE(2, 3), VALUES(-4, -4, -4, -4, -4, -4)));
  /* fill_ of a strided view writes only its elements */
  rh_tensor_t *col = rh_tensor_select(a, 1, 1);
  CHECK(rh_tensor_fill_(col, 6) == 0);
  CHECK(holds("fill_ of a column", a, RH_I32, 2, SHAPE(2, 3), VALUES(-4, 6, -4, -4, 6, -4)));
  /* ... and leaves the gaps of a strided one as they were (elements at 1, 3, ..., 11) */
  rh_tensor_t *as = strided(a);
  CHECK(rh_tensor_fill_(as, 5) == 0);
  CHECK(holds("fill_ of strided", as, RH_I32, 2, SHAPE(2, 3), VALUES(5, 5, 5, 5, 5, 5)));
  const int32_t *raw = as->storage->data;
  CHECK(raw[0] == 0 && raw[1] == 5 && raw[2] == 0 && raw[11] == 5 && raw[12] == 0);
  CHECK(rh_tensor_fill_(as, 0) == 0); /* (zero on a strided tensor: not a memset) */
  CHECK(holds("zero fill_ of strided", as, RH_I32, 2, SHAPE(2, 3), VALUES(0, 0, 0, 0, 0, 0)));
  CHECK(rh_tensor_fill_(a, 2.9) == 0);
  CHECK(holds("fill_ converts like a store", a, RH_I32, 2, SHAPE(2, 3), VALUES(2, 2, 2, 2, 2, 2)));
  rh_tensor_t *u = rh_tensor_full(RH_U8, 1, SHAPE(2), 1000);
  CHECK(holds_r("full clamps", u, RH_U8, 1, SHAPE(2), VALUES(255, 255)));
  rh_tensor_release(col);
  rh_tensor_release(as);
  rh_tensor_release(a);

  /* reshape: a view when the strides allow it, else a copy */
  static const double v[] = {0, 1, 2, 3, 4, 5};
  rh_tensor_t *x = mk(RH_F64, 2, SHAPE(2, 3), v);
  rh_tensor_t *r = rh_tensor_reshape(x, 2, SHAPE(3, -1));
  CHECK(r && r->storage == x->storage);
  CHECK(holds_r("reshape as a view", r, RH_F64, 2, SHAPE(3, 2), v));
  rh_tensor_t *t = rh_tensor_transpose(x, 0, 1);
  CHECK(rh_tensor_view(t, 1, SHAPE(6)) == NULL && says("view: size is not compatible"));
  r = rh_tensor_reshape(t, 1, SHAPE(6));
  CHECK(r && r->storage != x->storage);
  CHECK(holds_r("reshape as a copy", r, RH_F64, 1, SHAPE(6), VALUES(0, 3, 1, 4, 2, 5)));
  CHECK(rh_tensor_reshape(t, 1, SHAPE(4)) == NULL && says("reshape: shape [4] is invalid for input of size 6"));
  /* to_device on the CPU is the tensor itself */
  rh_tensor_t *same = rh_tensor_to_device(t, RH_CPU);
  CHECK(same == t);
  rh_tensor_release(same);
  rh_tensor_release(t);
  rh_tensor_release(x);
}

int main(void) {
  int64_t live0 = rh_storage_live_bytes();
  layouts();
  tiled(RH_F32, 67, 131);
  tiled(RH_F64, 70, 90);
  tiled(RH_U8, 129, 67);
  tiled(RH_I32, 99, 100);
  tiled(RH_F32, 1504, 1500); /* 9 MB: split over the pool, streamed where the CPU can (rows of 64-byte lines) */
  dtypes();
  broadcasts();
  fills_and_shapes();
  CHECK(rh_storage_live_bytes() == live0);
  return TEST_RESULT();
}
