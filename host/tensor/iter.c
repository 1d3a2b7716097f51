/* iter.c: the strided N-d iterator every element loop of the tensor core runs
 * under (Torch7's THTensorApply): operands given by base pointers and byte
 * strides (rh__bcast_strides, tensor_internal.h, makes a broadcast operand's),
 * dimensions of size one dropped and dimensions contiguous for every operand
 * merged, so the inner loop gets the longest runs it can; large iterations are
 * split across the thread pool (parallel.c).
 *
 * Depends on parallel.c alone; copy.c, ops.c and index.c run their loops
 * through it. */
#include "tensor_internal.h"

/* ---- the iterator */
typedef struct {
  int ndim;
  int64_t size[RH_MAXDIM];
  int64_t st[3][RH_MAXDIM];
  char *base[3];
  rh_loop_fn fn;
  void *ctx;
} iter_t;

static void iter_range(void *vit, int64_t lo, int64_t hi) {
  iter_t *it = vit;
  int nd = it->ndim, last = nd - 1;
  int64_t idx[RH_MAXDIM];
  int64_t rem = lo;
  for (int d = last; d >= 0; d--) {
    idx[d] = rem % it->size[d];
    rem /= it->size[d];
  }
  int64_t pos = lo;
  while (pos < hi) {
    char *p[3];
    for (int k = 0; k < 3; k++) {
      p[k] = it->base[k];
      if (!p[k]) continue;
      for (int d = 0; d < nd; d++) p[k] += idx[d] * it->st[k][d];
    }
    int64_t m = it->size[last] - idx[last];
    if (m > hi - pos) m = hi - pos;
    it->fn(m, p[0], it->st[0][last], p[1], it->st[1][last], p[2], it->st[2][last], it->ctx);
    pos += m;
    idx[last] += m;
    for (int d = last; d > 0 && idx[d] >= it->size[d]; d--) {
      idx[d] = 0;
      idx[d - 1]++;
    }
  }
}

static void iter_chunk(void *vit, int64_t lo, int64_t hi) { iter_range(vit, lo, hi); }

void rh__iterate(int ndim, const int64_t *size, char *o, const int64_t *ost, const char *a, const int64_t *ast,
                 const char *b, const int64_t *bst, rh_loop_fn fn, void *ctx) {
  iter_t it;
  const int64_t *sts[3] = {ost, ast, bst};
  it.base[0] = o;
  it.base[1] = (char *)a;
  it.base[2] = (char *)b;
  it.fn = fn;
  it.ctx = ctx;
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) numel *= size[d];
  if (numel == 0) return;
  /* drop size-1 dims, then merge dims that are contiguous for every operand */
  int n = 0;
  for (int d = 0; d < ndim; d++) {
    if (size[d] == 1) continue;
    it.size[n] = size[d];
    for (int k = 0; k < 3; k++) it.st[k][n] = sts[k] ? sts[k][d] : 0;
    if (n > 0) {
      int merge = 1;
      for (int k = 0; k < 3; k++)
        if (it.st[k][n - 1] != it.st[k][n] * it.size[n]) merge = 0;
      if (merge) {
        it.size[n - 1] *= it.size[n];
        for (int k = 0; k < 3; k++) it.st[k][n - 1] = it.st[k][n];
        continue;
      }
    }
    n++;
  }
  if (n == 0) {
    it.size[0] = 1;
    for (int k = 0; k < 3; k++) it.st[k][0] = 0;
    n = 1;
  }
  it.ndim = n;
  if (numel >= (1 << 16)) rh_parallel_for(numel, 1 << 15, iter_chunk, &it);
  else iter_range(&it, 0, numel);
}
