/* test_reduce.c: reductions and softmax (host/tensor/reduce.c), each on a
 * contiguous and a strided input, with exact values: sum, mean, max, min,
 * argmax, argmin and prod over one dimension (kept or not) and over everything;
 * the result dtypes (integers sum in int64, exactly past 2^53; argmax gives
 * int64; mean of integers is refused); NaN wins max and min; ties give the
 * first index; empty dimensions (sum 0, prod 1, mean NaN, max refused); rows
 * long enough to be summed in parts over the pool; softmax along either
 * dimension. */
#include <math.h>
#include <stdint.h>

#include "tensor_check.h"

/* op over dim of a, and of a strided copy of a, must hold want */
static int reduces_to(const char *what, rh_redop_t op, rh_tensor_t *a, int dim, int keepdim, rh_dtype_t dt, int ndim,
                      const int64_t *size, const double *want) {
  rh_tensor_t *as = strided(a);
  int ok = holds_r(what, rh_tensor_reduce(op, a, dim, keepdim), dt, ndim, size, want);
  ok = holds_r(what, rh_tensor_reduce(op, as, dim, keepdim), dt, ndim, size, want) && ok;
  rh_tensor_release(as);
  return ok;
}

static void matrix(void) {
  rh_tensor_t *m = mk(RH_F32, 2, SHAPE(2, 3), VALUES(1, 5, 2, 4, 0, 6));
  CHECK(reduces_to("sum", RH_RED_SUM, m, -1, 0, RH_F32, 0, NULL, VALUES(18)));
  CHECK(reduces_to("sum, keepdim ignored", RH_RED_SUM, m, -1, 1, RH_F32, 0, NULL, VALUES(18)));
  CHECK(reduces_to("sum 0", RH_RED_SUM, m, 0, 0, RH_F32, 1, SHAPE(3), VALUES(5, 5, 8)));
  CHECK(reduces_to("sum 1", RH_RED_SUM, m, 1, 0, RH_F32, 1, SHAPE(2), VALUES(8, 10)));
  CHECK(reduces_to("sum 0 keepdim", RH_RED_SUM, m, 0, 1, RH_F32, 2, SHAPE(1, 3), VALUES(5, 5, 8)));
  CHECK(reduces_to("sum 1 keepdim", RH_RED_SUM, m, 1, 1, RH_F32, 2, SHAPE(2, 1), VALUES(8, 10)));
  CHECK(reduces_to("mean", RH_RED_MEAN, m, -1, 0, RH_F32, 0, NULL, VALUES(3)));
  CHECK(reduces_to("mean 1", RH_RED_MEAN, m, 1, 0, RH_F32, 1, SHAPE(2), VALUES((float)(8.0 / 3), (float)(10.0 / 3))));
  CHECK(reduces_to("max", RH_RED_MAX, m, -1, 0, RH_F32, 0, NULL, VALUES(6)));
  CHECK(reduces_to("max 1", RH_RED_MAX, m, 1, 0, RH_F32, 1, SHAPE(2), VALUES(5, 6)));
  CHECK(reduces_to("min 0 keepdim", RH_RED_MIN, m, 0, 1, RH_F32, 2, SHAPE(1, 3), VALUES(1, 0, 2)));
  CHECK(reduces_to("argmax", RH_RED_ARGMAX, m, -1, 0, RH_I64, 0, NULL, VALUES(5)));
  CHECK(reduces_to("argmax 1", RH_RED_ARGMAX, m, 1, 0, RH_I64, 1, SHAPE(2), VALUES(1, 2)));
  CHECK(reduces_to("argmin 0", RH_RED_ARGMIN, m, 0, 0, RH_I64, 1, SHAPE(3), VALUES(0, 1, 0)));
  CHECK(reduces_to("prod 1", RH_RED_PROD, m, 1, 0, RH_F32, 1, SHAPE(2), VALUES(10, 0)));
  CHECK(reduces_to("prod 0", RH_RED_PROD, m, 0, 0, RH_F32, 1, SHAPE(3), VALUES(4, 0, 12)));
  /* a view's values: the transposed matrix, reduced along its rows */
  rh_tensor_t *t = rh_tensor_transpose(m, 0, 1);
  CHECK(reduces_to("sum 1 of transposed", RH_RED_SUM, t, 1, 0, RH_F32, 1, SHAPE(3), VALUES(5, 5, 8)));
  CHECK(reduces_to("argmax 0 of transposed", RH_RED_ARGMAX, t, 0, 0, RH_I64, 1, SHAPE(2), VALUES(1, 2)));
  /* the dimension is checked; a 0-d tensor reduces to itself */
  CHECK(rh_tensor_reduce(RH_RED_SUM, m, 2, 0) == NULL && says("sum: dimension 3 out of range (the tensor has 2"));
  rh_tensor_t *s = mk(RH_F64, 0, NULL, VALUES(2.5));
  CHECK(holds_r("0-d", rh_tensor_reduce(RH_RED_MAX, s, 0, 0), RH_F64, 0, NULL, VALUES(2.5)));
  rh_tensor_release(s);
  rh_tensor_release(t);
  rh_tensor_release(m);
}

static void three_d(void) {
  double v[24];
  for (int i = 0; i < 24; i++) v[i] = i;
  rh_tensor_t *x = mk(RH_F64, 3, SHAPE(2, 3, 4), v);
  CHECK(reduces_to("sum 1", RH_RED_SUM, x, 1, 0, RH_F64, 2, SHAPE(2, 4), VALUES(12, 15, 18, 21, 48, 51, 54, 57)));
  CHECK(reduces_to("sum 1 keepdim", RH_RED_SUM, x, 1, 1, RH_F64, 3, SHAPE(2, 1, 4),
                   VALUES(12, 15, 18, 21, 48, 51, 54, 57)));
  CHECK(reduces_to("sum 2", RH_RED_SUM, x, 2, 0, RH_F64, 2, SHAPE(2, 3), VALUES(6, 22, 38, 54, 70, 86)));
  CHECK(reduces_to("max 0", RH_RED_MAX, x, 0, 0, RH_F64, 2, SHAPE(3, 4), v + 12));
  CHECK(reduces_to("argmin 2", RH_RED_ARGMIN, x, 2, 1, RH_I64, 3, SHAPE(2, 3, 1), VALUES(0, 0, 0, 0, 0, 0)));
  CHECK(reduces_to("mean 0", RH_RED_MEAN, x, 0, 0, RH_F64, 2, SHAPE(3, 4),
                   VALUES(6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)));
  rh_tensor_release(x);
}

static void integers(void) {
  /* integers sum and multiply in int64, bools count */
  rh_tensor_t *i = mk(RH_I32, 1, SHAPE(3), VALUES(2147483647, 2147483647, 2));
  CHECK(reduces_to("int32 sum", RH_RED_SUM, i, -1, 0, RH_I64, 0, NULL, VALUES(4294967296.0)));
  CHECK(reduces_to("int32 prod", RH_RED_PROD, i, -1, 0, RH_I64, 0, NULL, VALUES(9223372028264841218.0)));
  CHECK(reduces_to("int32 max", RH_RED_MAX, i, -1, 0, RH_I32, 0, NULL, VALUES(2147483647)));
  CHECK(rh_tensor_reduce(RH_RED_MEAN, i, -1, 0) == NULL && says("mean(): could not infer output dtype") &&
        says("Got: int32"));
  rh_tensor_t *u = mk(RH_U8, 2, SHAPE(2, 2), VALUES(200, 100, 255, 1));
  CHECK(reduces_to("uint8 sum 1", RH_RED_SUM, u, 1, 0, RH_I64, 1, SHAPE(2), VALUES(300, 256)));
  rh_tensor_t *b = mk(RH_BOOL, 1, SHAPE(4), VALUES(1, 0, 1, 1));
  CHECK(reduces_to("bool sum", RH_RED_SUM, b, -1, 0, RH_I64, 0, NULL, VALUES(3)));
  /* exact past 2^53, where a double would round: sum and max of int64 */
  rh_tensor_t *big = rh_tensor_empty(RH_I64, 1, SHAPE(2));
  int64_t *p = rh_tensor_data(big);
  p[0] = (INT64_C(1) << 53) + 1;
  p[1] = 2;
  rh_tensor_t *r = rh_tensor_reduce(RH_RED_SUM, big, -1, 0);
  CHECK(r && r->dtype == RH_I64 && *(int64_t *)rh_tensor_data(r) == (INT64_C(1) << 53) + 3);
  rh_tensor_release(r);
  r = rh_tensor_reduce(RH_RED_MAX, big, 0, 0);
  CHECK(r && r->dtype == RH_I64 && *(int64_t *)rh_tensor_data(r) == (INT64_C(1) << 53) + 1);
  rh_tensor_release(r);
  /* int64 sums wrap like PyTorch's */
  p[0] = INT64_MAX;
  p[1] = 1;
  r = rh_tensor_reduce(RH_RED_SUM, big, -1, 0);
  CHECK(r && *(int64_t *)rh_tensor_data(r) == INT64_MIN);
  rh_tensor_release(r);
  rh_tensor_release(big);
  rh_tensor_release(b);
  rh_tensor_release(u);
  rh_tensor_release(i);
}

static void nan_and_ties(void) {
  rh_tensor_t *n = mk(RH_F32, 1, SHAPE(4), VALUES(1, NAN, 3, NAN));
  CHECK(reduces_to("max with NaN", RH_RED_MAX, n, 0, 0, RH_F32, 0, NULL, VALUES(NAN)));
  CHECK(reduces_to("min with NaN", RH_RED_MIN, n, 0, 0, RH_F32, 0, NULL, VALUES(NAN)));
  CHECK(reduces_to("argmax with NaN", RH_RED_ARGMAX, n, 0, 0, RH_I64, 0, NULL, VALUES(1)));
  CHECK(reduces_to("argmin with NaN", RH_RED_ARGMIN, n, 0, 0, RH_I64, 0, NULL, VALUES(1)));
  CHECK(reduces_to("sum with NaN", RH_RED_SUM, n, 0, 0, RH_F32, 0, NULL, VALUES(NAN)));
  rh_tensor_t *t = mk(RH_F64, 2, SHAPE(2, 3), VALUES(2, 5, 5, 7, 7, 1));
  CHECK(reduces_to("argmax ties", RH_RED_ARGMAX, t, 1, 0, RH_I64, 1, SHAPE(2), VALUES(1, 0)));
  CHECK(reduces_to("argmin ties", RH_RED_ARGMIN, t, 0, 0, RH_I64, 1, SHAPE(3), VALUES(0, 0, 1)));
  rh_tensor_release(t);
  rh_tensor_release(n);
}

static void empty(void) {
  rh_tensor_t *e = rh_tensor_empty(RH_F32, 2, SHAPE(2, 0));
  CHECK(reduces_to("sum over an empty dim", RH_RED_SUM, e, 1, 0, RH_F32, 1, SHAPE(2), VALUES(0, 0)));
  CHECK(reduces_to("sum keeping an empty dim", RH_RED_SUM, e, 0, 1, RH_F32, 2, SHAPE(1, 0), NULL));
  CHECK(reduces_to("sum of nothing", RH_RED_SUM, e, -1, 0, RH_F32, 0, NULL, VALUES(0)));
  CHECK(reduces_to("prod over an empty dim", RH_RED_PROD, e, 1, 1, RH_F32, 2, SHAPE(2, 1), VALUES(1, 1)));
  CHECK(reduces_to("mean over an empty dim", RH_RED_MEAN, e, 1, 0, RH_F32, 1, SHAPE(2), VALUES(NAN, NAN)));
  CHECK(reduces_to("max along the full dim", RH_RED_MAX, e, 0, 0, RH_F32, 1, SHAPE(0), NULL));
  CHECK(rh_tensor_reduce(RH_RED_MAX, e, 1, 0) == NULL && says("max(): cannot reduce an empty tensor"));
  CHECK(rh_tensor_reduce(RH_RED_ARGMIN, e, -1, 0) == NULL && says("argmin(): cannot reduce an empty tensor"));
  rh_tensor_t *ei = rh_tensor_empty(RH_I32, 1, SHAPE(0));
  CHECK(reduces_to("int32 sum of nothing", RH_RED_SUM, ei, -1, 0, RH_I64, 0, NULL, VALUES(0)));
  CHECK(reduces_to("int32 prod of nothing", RH_RED_PROD, ei, 0, 0, RH_I64, 0, NULL, VALUES(1)));
  rh_tensor_release(ei);
  rh_tensor_release(e);
}

/* rows of 2^18 elements and more are summed in 16 parts over the pool, added in
 * order: integers well inside a float's mantissa come out exact */
static void long_rows(void) {
  int64_t n = 300001;
  for (int k = 0; k < 2; k++) {
    rh_dtype_t dt = k ? RH_F64 : RH_F32;
    rh_tensor_t *x = rh_tensor_empty(dt, 1, SHAPE(n));
    double want = 0;
    for (int64_t i = 0; i < n; i++) {
      rh_tensor_set(x, SHAPE(i), (double)(i % 7));
      want += (double)(i % 7);
    }
    CHECK(reduces_to("long sum", RH_RED_SUM, x, -1, 0, dt, 0, NULL, VALUES(want)));
    CHECK(reduces_to("long mean", RH_RED_MEAN, x, 0, 0, dt, 0, NULL,
                     VALUES(dt == RH_F32 ? (float)(want / n) : want / n)));
    /* two long rows at once */
    rh_tensor_t *two = rh_tensor_full(dt, 2, SHAPE(2, n), 1);
    CHECK(reduces_to("long rows", RH_RED_SUM, two, 1, 0, dt, 1, SHAPE(2), VALUES((double)n, (double)n)));
    rh_tensor_release(two);
    rh_tensor_release(x);
  }
}

static void softmax(void) {
  rh_tensor_t *x = mk(RH_F32, 2, SHAPE(2, 2), VALUES(0, -INFINITY, 3, 3));
  for (int st = 0; st < 2; st++) {
    rh_tensor_t *a = st ? strided(x) : x;
    CHECK(holds_r("softmax 1", rh_tensor_softmax(a, 1, 0), RH_F32, 2, SHAPE(2, 2), VALUES(1, 0, 0.5, 0.5)));
    /* log_softmax: exact where the row's sum of exps is 1; -log 2 as libm rounds it */
    rh_tensor_t *l = rh_tensor_softmax(a, 1, 1);
    CHECK(l && l->dtype == RH_F32 && rh_tensor_get(l, SHAPE(0, 0)) == 0 && rh_tensor_get(l, SHAPE(0, 1)) == -INFINITY);
    CHECK(l && fabs(rh_tensor_get(l, SHAPE(1, 0)) + 0.6931471805599453) < 1e-7);
    CHECK(l && rh_tensor_get(l, SHAPE(1, 0)) == rh_tensor_get(l, SHAPE(1, 1)));
    rh_tensor_release(l);
    /* along dim 0: column 1 is (-inf, 3) -> (0, 1); column 0 is (0, 3), shares of 1 */
    rh_tensor_t *c = rh_tensor_softmax(a, 0, 0);
    CHECK(c && rh_tensor_get(c, SHAPE(0, 1)) == 0 && rh_tensor_get(c, SHAPE(1, 1)) == 1);
    CHECK(c && fabs(rh_tensor_get(c, SHAPE(0, 0)) + rh_tensor_get(c, SHAPE(1, 0)) - 1) < 1e-7);
    CHECK(c && rh_tensor_get(c, SHAPE(0, 0)) < rh_tensor_get(c, SHAPE(1, 0)));
    rh_tensor_release(c);
    if (st) rh_tensor_release(a);
  }
  /* integers give float32 */
  rh_tensor_t *i = mk(RH_I32, 1, SHAPE(4), VALUES(7, 7, 7, 7));
  CHECK(holds_r("softmax of int32", rh_tensor_softmax(i, 0, 0), RH_F32, 1, SHAPE(4), VALUES(0.25, 0.25, 0.25, 0.25)));
  CHECK(rh_tensor_softmax(i, 1, 0) == NULL && says("softmax: dimension 2 out of range"));
  rh_tensor_release(i);
  rh_tensor_release(x);
}

int main(void) {
  int64_t live0 = rh_storage_live_bytes();
  matrix();
  three_d();
  integers();
  nan_and_ties();
  empty();
  long_rows();
  softmax();
  CHECK(rh_storage_live_bytes() == live0);
  return TEST_RESULT();
}
