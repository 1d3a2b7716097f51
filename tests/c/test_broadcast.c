/* test_broadcast.c: numpy's broadcasting in the tensor core: the shape rule
 * (rh__broadcast_shape: trailing dimensions meet, a 1 stretches, anything else
 * is an error naming both shapes and the dimension), the byte strides of a
 * broadcast operand (0 along every stretched or new dimension), expand (a view
 * with strides of 0), and ops that broadcast their operands (ops.c), with the
 * promotion of mixed dtypes, an `out` that must have the broadcast shape, and
 * empty dimensions. Each op on contiguous and strided operands, exact values. */
#include <stdint.h>

#include "tensor/tensor_internal.h"
#include "tensor_check.h"

/* the broadcast shape of a and b is want (nw dims), either way round */
static int meets(int na, const int64_t *a, int nb, const int64_t *b, int nw, const int64_t *want) {
  int n1 = -1, n2 = -1;
  int64_t o1[RH_MAXDIM], o2[RH_MAXDIM];
  if (rh__broadcast_shape(na, a, nb, b, &n1, o1) || rh__broadcast_shape(nb, b, na, a, &n2, o2)) {
    fprintf(stderr, "  refused: %s\n", rh_tensor_errmsg());
    return 0;
  }
  int ok = n1 == nw && n2 == nw;
  for (int i = 0; ok && i < nw; i++) ok = o1[i] == want[i] && o2[i] == want[i];
  return ok;
}

static void shapes(void) {
  CHECK(meets(1, SHAPE(3), 2, SHAPE(2, 3), 2, SHAPE(2, 3)));
  CHECK(meets(2, SHAPE(2, 1), 2, SHAPE(1, 3), 2, SHAPE(2, 3)));
  CHECK(meets(3, SHAPE(5, 1, 4), 2, SHAPE(3, 1), 3, SHAPE(5, 3, 4)));
  CHECK(meets(0, NULL, 2, SHAPE(4, 2), 2, SHAPE(4, 2))); /* a 0-d operand meets anything */
  CHECK(meets(0, NULL, 0, NULL, 0, NULL));
  CHECK(meets(1, SHAPE(0), 1, SHAPE(1), 1, SHAPE(0))); /* a 1 stretches to 0, too */
  CHECK(meets(2, SHAPE(0, 3), 1, SHAPE(3), 2, SHAPE(0, 3)));
  int n;
  int64_t out[RH_MAXDIM];
  CHECK(rh__broadcast_shape(2, SHAPE(2, 3), 1, SHAPE(2), &n, out) == -1 &&
        says("shapes [2, 3] and [2] cannot be broadcast together (dimension 2: 3 vs 2)"));
  CHECK(rh__broadcast_shape(3, SHAPE(4, 2, 3), 2, SHAPE(3, 3), &n, out) == -1 && says("(dimension 2: 2 vs 3)"));
  CHECK(rh__broadcast_shape(1, SHAPE(0), 1, SHAPE(2), &n, out) == -1 && says("(dimension 1: 0 vs 2)"));
}

static void strides(void) {
  /* [3] of float32 seen as [2, 3]: the new leading dimension has stride 0 */
  rh_tensor_t *row = rh_tensor_full(RH_F32, 1, SHAPE(3), 1);
  int64_t st[RH_MAXDIM];
  rh__bcast_strides(row, 2, SHAPE(2, 3), st);
  CHECK(st[0] == 0 && st[1] == 4);
  /* [2, 1] of float64 seen as [4, 2, 5]: the stretched 1 and the new dimension are 0 */
  rh_tensor_t *col = rh_tensor_full(RH_F64, 2, SHAPE(2, 1), 1);
  rh__bcast_strides(col, 3, SHAPE(4, 2, 5), st);
  CHECK(st[0] == 0 && st[1] == 8 && st[2] == 0);
  /* a strided operand keeps its own strides, in bytes */
  rh_tensor_t *cs = strided(col);
  rh__bcast_strides(cs, 2, SHAPE(2, 7), st);
  CHECK(st[0] == 16 && st[1] == 0);
  /* expand: a view with strides of 0; -1 keeps a size */
  rh_tensor_t *e = rh_tensor_expand(col, 3, SHAPE(4, -1, 5));
  CHECK(e && e->storage == col->storage && e->stride[0] == 0 && e->stride[1] == 1 && e->stride[2] == 0);
  CHECK(e && rh_tensor_numel(e) == 40 && !rh_tensor_is_contiguous(e));
  rh_tensor_release(e);
  CHECK(rh_tensor_expand(col, 2, SHAPE(3, 5)) == NULL && says("expand: cannot expand shape [2, 1] to [3, 5]"));
  CHECK(rh_tensor_expand(col, 3, SHAPE(-1, 2, 5)) == NULL && says("-1 is not allowed in a new leading dimension"));
  CHECK(rh_tensor_expand(col, 1, SHAPE(2)) == NULL && says("must be at least the tensor's dimensions"));
  rh_tensor_release(cs);
  rh_tensor_release(col);
  rh_tensor_release(row);
}

/* a op b, each operand contiguous and strided (four runs), must hold want */
static int op_holds(const char *what, rh_binop_t op, rh_tensor_t *a, rh_tensor_t *b, rh_dtype_t dt, int ndim,
                    const int64_t *size, const double *want) {
  rh_tensor_t *as = strided(a), *bs = strided(b);
  rh_tensor_t *ops[2][2] = {{a, b}, {as, bs}};
  int ok = 1;
  for (int i = 0; i < 4; i++)
    ok = holds_r(what, rh_tensor_binary(op, ops[i & 1][0], ops[i >> 1][1], NULL), dt, ndim, size, want) && ok;
  rh_tensor_release(as);
  rh_tensor_release(bs);
  return ok;
}

static void ops(void) {
  rh_tensor_t *m = mk(RH_F32, 2, SHAPE(2, 3), VALUES(0, 1, 2, 3, 4, 5));
  rh_tensor_t *row = mk(RH_F32, 1, SHAPE(3), VALUES(10, 20, 30));
  rh_tensor_t *col = mk(RH_F32, 2, SHAPE(2, 1), VALUES(100, 200));
  rh_tensor_t *one = mk(RH_F32, 0, NULL, VALUES(0.5));
  CHECK(op_holds("[2, 3] + [3]", RH_OP_ADD, m, row, RH_F32, 2, SHAPE(2, 3), VALUES(10, 21, 32, 13, 24, 35)));
  CHECK(op_holds("[3] - [2, 3]", RH_OP_SUB, row, m, RH_F32, 2, SHAPE(2, 3), VALUES(10, 19, 28, 7, 16, 25)));
  CHECK(op_holds("[2, 1] * [3]", RH_OP_MUL, col, row, RH_F32, 2, SHAPE(2, 3),
                 VALUES(1000, 2000, 3000, 2000, 4000, 6000)));
  CHECK(op_holds("[2, 3] * 0-d", RH_OP_MUL, m, one, RH_F32, 2, SHAPE(2, 3), VALUES(0, 0.5, 1, 1.5, 2, 2.5)));
  rh_tensor_t *lim = mk(RH_F32, 2, SHAPE(2, 1), VALUES(1, 4));
  CHECK(op_holds("[2, 3] > [2, 1]", RH_OP_GT, m, lim, RH_BOOL, 2, SHAPE(2, 3), VALUES(0, 0, 1, 0, 0, 1)));

  /* the transposed view of m meets a column: [3, 2] + [3, 1] */
  rh_tensor_t *t = rh_tensor_transpose(m, 0, 1);
  rh_tensor_t *c3 = mk(RH_F32, 2, SHAPE(3, 1), VALUES(1, 2, 3));
  CHECK(op_holds("transposed + [3, 1]", RH_OP_ADD, t, c3, RH_F32, 2, SHAPE(3, 2), VALUES(1, 4, 3, 6, 5, 8)));

  /* mixed dtypes promote, and the int32 operand broadcasts */
  rh_tensor_t *irow = mk(RH_I32, 1, SHAPE(3), VALUES(1, 2, 3));
  rh_tensor_t *dcol = mk(RH_F64, 2, SHAPE(2, 1), VALUES(0.25, 0.5));
  CHECK(op_holds("int32 [3] + float64 [2, 1]", RH_OP_ADD, irow, dcol, RH_F64, 2, SHAPE(2, 3),
                 VALUES(1.25, 2.25, 3.25, 1.5, 2.5, 3.5)));
  rh_tensor_t *i64 = mk(RH_I64, 2, SHAPE(2, 1), VALUES(-7, 7));
  CHECK(op_holds("int32 [3] * int64 [2, 1]", RH_OP_MUL, irow, i64, RH_I64, 2, SHAPE(2, 3),
                 VALUES(-7, -14, -21, 7, 14, 21)));

  /* empty dimensions broadcast to empty results */
  rh_tensor_t *none = rh_tensor_empty(RH_F32, 2, SHAPE(0, 3));
  CHECK(holds_r("[0, 3] + [3]", rh_tensor_binary(RH_OP_ADD, none, row, NULL), RH_F32, 2, SHAPE(0, 3), NULL));

  /* refused: shapes that do not meet; an out that is not the broadcast shape */
  rh_tensor_t *two = mk(RH_F32, 1, SHAPE(2), VALUES(1, 2));
  CHECK(rh_tensor_binary(RH_OP_ADD, m, two, NULL) == NULL &&
        says("shapes [2, 3] and [2] cannot be broadcast together"));
  CHECK(rh_tensor_binary(RH_OP_ADD, m, row, row) == NULL &&
        says("add_: output with shape [3] doesn't match the broadcast shape [2, 3]"));
  /* an out of the broadcast shape, strided, is written in place */
  rh_tensor_t *o = rh_tensor_full(RH_F32, 2, SHAPE(2, 3), 0), *os = strided(o);
  rh_tensor_t *r = rh_tensor_binary(RH_OP_ADD, col, row, os);
  CHECK(r == os);
  CHECK(holds("out", os, RH_F32, 2, SHAPE(2, 3), VALUES(110, 120, 130, 210, 220, 230)));
  rh_tensor_release(r);
  rh_tensor_release(os);
  rh_tensor_release(o);

  rh_tensor_release(two);
  rh_tensor_release(lim);
  rh_tensor_release(none);
  rh_tensor_release(i64);
  rh_tensor_release(dcol);
  rh_tensor_release(irow);
  rh_tensor_release(c3);
  rh_tensor_release(t);
  rh_tensor_release(one);
  rh_tensor_release(col);
  rh_tensor_release(row);
  rh_tensor_release(m);
}

int main(void) {
  int64_t live0 = rh_storage_live_bytes();
  shapes();
  strides();
  ops();
  CHECK(rh_storage_live_bytes() == live0);
  return TEST_RESULT();
}
