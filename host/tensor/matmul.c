/* matmul.c: matrix products through OpenBLAS's CBLAS (float32/float64), with
 * PyTorch's matmul shape rules: vector-vector (dot), matrix-vector, vector-matrix,
 * matrix-matrix, and batched with broadcast batch dimensions. Integer dtypes use
 * a plain loop (BLAS has no integer GEMM). On a CUDA device: cuBLAS through the
 * kernels library (device.c). */
#include <cblas.h>
#include <dlfcn.h>
#include <limits.h>
#include <string.h>

#include "tensor_internal.h"

/* One pool of threads in the process. OpenBLAS runs single-threaded; a
 * product of at least RH_BLAS_SPLIT multiply-adds is cut into one block of
 * rows (or columns) per rh_parallel_for thread instead. With OpenBLAS's own
 * threads the two pools took turns: its threads spin-yield (sched_yield)
 * between products while the pool runs im2col or elementwise work, and the
 * pool's threads wait while OpenBLAS runs, so each wasted the other's cores
 * (17% of a convolution's time in sched_yield); and OpenBLAS split products of
 * 2^18 multiply-adds, whose waiting cost more than the product. A product
 * called from inside a pool task (a convolution's part, a batch of small
 * products) runs whole in that task. */
#define RH_BLAS_SPLIT (1ll << 23) /* multiply-adds */

static void blas_single_threaded(void) {
  static int done = 0;
  if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) {
    openblas_set_num_threads(1);
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
  }
}

/* OpenBLAS's pthreads build starts its threads when the library loads, before
 * main, and each spins on sched_yield for its THREAD_TIMEOUT (2^28 TSC cycles,
 * about 0.1 s of wall clock) before it sleeps. rpchost never gives them work
 * (above), so they are stopped at once: a world of 1,024 ranks starting on two
 * cores made 1.8 million sched_yield calls (a context switch each, 1,700 per
 * rank; 15 -> 10 s for the world). blas_thread_shutdown_ is looked up, not
 * linked: another BLAS, or an OpenBLAS without it, just keeps its threads. */
void rh_blas_quiet(void) {
  blas_single_threaded();
  int (*shutdown)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "blas_thread_shutdown_");
  if (shutdown) shutdown();
}

static void blas_call(rh_dtype_t dt, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda,
                      const void *b, int64_t ldb, double beta, void *c, int64_t ldc) {
  if (dt == RH_F32)
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                1.0f, a, (int)lda, b, (int)ldb, (float)beta, c, (int)ldc);
  else
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                1.0, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

typedef struct {
  rh_dtype_t dt;
  int ta, tb, by_rows;
  int64_t m, n, k, lda, ldb, ldc, block;
  const char *a, *b;
  char *c;
  double beta;
} split_job_t;

static void split_blocks(void *ctx, int64_t lo, int64_t hi) {
  split_job_t *j = ctx;
  size_t es = rh_dtype_size(j->dt);
  for (int64_t i = lo; i < hi; i++) {
    int64_t s = i * j->block, len = j->block;
    if (j->by_rows) {
      if (s + len > j->m) len = j->m - s;
      if (len <= 0) continue;
      /* rows s.. of op(A) and of C */
      const char *a = j->a + (size_t)(j->ta ? s : s * j->lda) * es;
      blas_call(j->dt, j->ta, j->tb, len, j->n, j->k, a, j->lda, j->b, j->ldb, j->beta,
                j->c + (size_t)(s * j->ldc) * es, j->ldc);
    } else {
      if (s + len > j->n) len = j->n - s;
      if (len <= 0) continue;
      /* columns s.. of op(B) and of C */
      const char *b = j->b + (size_t)(j->tb ? s * j->ldb : s) * es;
      blas_call(j->dt, j->ta, j->tb, j->m, len, j->k, j->a, j->lda, b, j->ldb, j->beta, j->c + (size_t)s * es, j->ldc);
    }
  }
}

void rh__gemm(rh_dtype_t dt, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, const void *b,
              int64_t ldb, double beta, void *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  blas_single_threaded();
  int64_t parts = m * n * k < RH_BLAS_SPLIT ? 1 : rh_parallel_threads();
  if (parts <= 1) {
    blas_call(dt, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  /* blocks a multiple of 16 (whole register tiles) along the longer side */
  split_job_t j = {dt, ta, tb, m >= n, m, n, k, lda, ldb, ldc, 0, a, b, c, beta};
  int64_t len = j.by_rows ? m : n;
  j.block = ((len + parts - 1) / parts + 15) / 16 * 16;
  rh_parallel_for((len + j.block - 1) / j.block, 1, split_blocks, &j);
}

/* C[m,n] = A[m,k] @ B[k,n], all contiguous row-major, one dtype */
static void gemm(rh_dtype_t dt, int64_t m, int64_t n, int64_t k, const void *a, const void *b, void *c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    memset(c, 0, (size_t)(m * n) * rh_dtype_size(dt));
    return;
  }
  if (dt == RH_F32 || dt == RH_F64) {
    rh__gemm(dt, 0, 0, m, n, k, a, k, b, n, 0.0, c, n);
  } else {
    size_t es = rh_dtype_size(dt);
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        int64_t acc = 0;
        for (int64_t p = 0; p < k; p++)
          acc += (int64_t)rh__load(dt, (const char *)a + (size_t)(i * k + p) * es) *
                 (int64_t)rh__load(dt, (const char *)b + (size_t)(p * n + j) * es);
        rh__store(dt, (char *)c + (size_t)(i * n + j) * es, (double)acc);
      }
  }
}

/* a batch of products: operand i at a + i * sa elements (sa, sb: the batch
 * strides), read as BLAS may (ta/lda, tb/ldb; 0 and k / n when contiguous) */
typedef struct {
  rh_dtype_t dt;
  int64_t m, n, k, sa, sb;
  int ta, tb, lda, ldb;
  const char *a, *b;
  char *c;
} batch_job_t;

static void batch_gemms(void *ctx, int64_t lo, int64_t hi) {
  batch_job_t *j = ctx;
  size_t es = rh_dtype_size(j->dt);
  for (int64_t i = lo; i < hi; i++) {
    const char *a = j->a + (size_t)(i * j->sa) * es, *b = j->b + (size_t)(i * j->sb) * es;
    char *c = j->c + (size_t)(i * j->m * j->n) * es;
    if (j->ta || j->tb || j->lda != j->k || j->ldb != j->n)
      rh__gemm(j->dt, j->ta, j->tb, j->m, j->n, j->k, a, j->lda, b, j->ldb, 0.0, c, j->n);
    else gemm(j->dt, j->m, j->n, j->k, a, b, c);
  }
}

/* runs the batch: products too small to split go one per pool task */
static void run_batch(batch_job_t *j, int64_t nbatch) {
  if (nbatch > 1 && j->m * j->n * j->k < RH_BLAS_SPLIT) rh_parallel_for(nbatch, 1, batch_gemms, j);
  else batch_gemms(j, 0, nbatch);
}

/* How BLAS can read a rows x cols matrix in place: row-major with rows st[0]
 * apart (a slice of a wider matrix, or one head of [T, N*h, hd]), or the
 * transpose of such a matrix. 0 when it needs a copy. */
static int gemm_layout(const int64_t *st, int64_t rows, int64_t cols, int *trans, int *ld) {
  if (st[1] == 1 && (rows == 1 || (st[0] >= cols && st[0] <= INT_MAX))) {
    *trans = 0;
    *ld = (int)(rows == 1 ? (cols > 0 ? cols : 1) : st[0]);
    return 1;
  }
  if (st[0] == 1 && (cols == 1 || (st[1] >= rows && st[1] <= INT_MAX))) {
    *trans = 1;
    *ld = (int)(cols == 1 ? (rows > 0 ? rows : 1) : st[1]);
    return 1;
  }
  return 0;
}

rh_tensor_t *rh_tensor_matmul(rh_tensor_t *a, rh_tensor_t *b) {
  if (a->ndim == 0 || b->ndim == 0) {
    rh_tensor_fail("matmul: both arguments need at least 1 dimension, got %dD and %dD", a->ndim, b->ndim);
    return NULL;
  }
  if (a->dtype != b->dtype) {
    rh_tensor_fail("matmul: expected both tensors to have the same dtype, got %s and %s", rh_dtype_name(a->dtype),
                   rh_dtype_name(b->dtype));
    return NULL;
  }
  if (rh__same_device("matmul", a, b)) return NULL;
  if (a->dtype == RH_BOOL) {
    rh_tensor_fail("matmul: not implemented for bool tensors");
    return NULL;
  }
  /* promote vectors to matrices, remembering to drop the added dims */
  int drop_m = a->ndim == 1, drop_n = b->ndim == 1;
  rh_tensor_t *A = drop_m ? rh_tensor_unsqueeze(a, 0) : (rh_tensor_retain(a), a);
  rh_tensor_t *B = drop_n ? rh_tensor_unsqueeze(b, 1) : (rh_tensor_retain(b), b);
  rh_tensor_t *res = NULL, *Ac = NULL, *Bc = NULL, *out = NULL;
  if (!A || !B) goto done;
  int64_t m = A->size[A->ndim - 2], k = A->size[A->ndim - 1];
  int64_t k2 = B->size[B->ndim - 2], n = B->size[B->ndim - 1];
  if (k != k2) {
    char sa[256], sb[256];
    rh_shape_str(a->ndim, a->size, sa, sizeof sa);
    rh_shape_str(b->ndim, b->size, sb, sizeof sb);
    rh_tensor_fail("matmul: shapes %s and %s cannot be multiplied (%lld != %lld)", sa, sb, (long long)k, (long long)k2);
    goto done;
  }
  /* a plain 2-D product of float matrices, either of which may be a transposed
   * contiguous matrix (x:matmul(w:t())): BLAS reads it transposed, no copy */
  int ta, tb, lda, ldb, dev = rh_tensor_device(a);
  if (A->ndim == 2 && B->ndim == 2 && rh_dtype_is_float(a->dtype) && k > 0 && m > 0 && n > 0 &&
      gemm_layout(A->stride, m, k, &ta, &lda) && gemm_layout(B->stride, k, n, &tb, &ldb)) {
    int64_t osz2[2] = {m, n};
    out = rh_tensor_empty_on(dev, a->dtype, 2, osz2);
    if (!out) goto done;
    if (dev >= 0) {
      if (rh__cuda_call(rh_cuda_api()->gemm(dev, a->dtype, ta, tb, m, n, k, rh_tensor_data(A), lda, 0,
                                            rh_tensor_data(B), ldb, 0, rh_tensor_data(out), 0, 1)))
        goto done;
    } else {
      rh__gemm(a->dtype, ta, tb, m, n, k, rh_tensor_data(A), lda, rh_tensor_data(B), ldb, 0.0, rh_tensor_data(out), n);
    }
    goto finish;
  }
  /* a 3-D batch of host float products (attention's bmm), each operand's
   * matrices readable in place (a transposed view of heads): no copies */
  if (dev < 0 && A->ndim == 3 && B->ndim == 3 && A->size[0] == B->size[0] && rh_dtype_is_float(a->dtype) && k > 0 &&
      m > 0 && n > 0 && gemm_layout(A->stride + 1, m, k, &ta, &lda) && gemm_layout(B->stride + 1, k, n, &tb, &ldb)) {
    out = rh_tensor_empty(a->dtype, 3, (int64_t[]){A->size[0], m, n});
    if (!out) goto done;
    batch_job_t job = {
        a->dtype,           m, n, k, A->stride[0], B->stride[0], ta, tb, lda, ldb, rh_tensor_data(A), rh_tensor_data(B),
        rh_tensor_data(out)};
    run_batch(&job, A->size[0]);
    goto finish;
  }
  /* broadcast the batch dimensions */
  int nba, nbb, nb;
  int64_t batch[RH_MAXDIM];
  nba = A->ndim - 2;
  nbb = B->ndim - 2;
  if (rh__broadcast_shape(nba, A->size, nbb, B->size, &nb, batch)) goto done;
  int64_t ea[RH_MAXDIM], eb[RH_MAXDIM], osz[RH_MAXDIM];
  memcpy(ea, batch, sizeof(int64_t) * (size_t)nb);
  memcpy(eb, batch, sizeof(int64_t) * (size_t)nb);
  ea[nb] = m, ea[nb + 1] = k;
  eb[nb] = k, eb[nb + 1] = n;
  rh_tensor_t *Ae = rh_tensor_expand(A, nb + 2, ea), *Be = rh_tensor_expand(B, nb + 2, eb);
  if (Ae) Ac = rh_tensor_contiguous(Ae);
  if (Be) Bc = rh_tensor_contiguous(Be);
  rh_tensor_release(Ae);
  rh_tensor_release(Be);
  if (!Ac || !Bc) goto done;
  memcpy(osz, batch, sizeof(int64_t) * (size_t)nb);
  osz[nb] = m, osz[nb + 1] = n;
  out = rh_tensor_empty_on(dev, a->dtype, nb + 2, osz);
  if (!out) goto done;
  int64_t nbatch = 1;
  for (int i = 0; i < nb; i++) nbatch *= batch[i];
  if (dev >= 0) {
    /* one strided-batched call; k == 0 is a product of empty sums: zeros */
    int rc = k == 0
                 ? rh_tensor_fill_(out, 0)
                 : rh__cuda_call(rh_cuda_api()->gemm(dev, a->dtype, 0, 0, m, n, k, rh_tensor_data(Ac), k, m * k,
                                                     rh_tensor_data(Bc), n, k * n, rh_tensor_data(out), m * n, nbatch));
    if (rc) goto done;
    goto finish;
  }
  batch_job_t job = {
      a->dtype,           m, n, k, m * k, k * n, 0, 0, (int)k, (int)n, rh_tensor_data(Ac), rh_tensor_data(Bc),
      rh_tensor_data(out)};
  run_batch(&job, nbatch);
finish:
  /* drop the dims that came from vectors */
  if (drop_m || drop_n) {
    int64_t fsz[RH_MAXDIM];
    int f = 0;
    for (int i = 0; i < out->ndim - 2; i++) fsz[f++] = out->size[i];
    if (!drop_m) fsz[f++] = m;
    if (!drop_n) fsz[f++] = n;
    res = rh_tensor_view(out, f, fsz);
  } else {
    rh_tensor_retain(out);
    res = out;
  }
done:
  rh_tensor_release(A);
  rh_tensor_release(B);
  rh_tensor_release(Ac);
  rh_tensor_release(Bc);
  rh_tensor_release(out);
  return res;
}
