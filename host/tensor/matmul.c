/* matmul.c: matrix products through OpenBLAS's CBLAS (float32/float64), with
 * PyTorch's matmul shape rules: vector-vector (dot), matrix-vector, vector-matrix,
 * matrix-matrix, and batched with broadcast batch dimensions. Integer dtypes use
 * a plain loop (BLAS has no integer GEMM). On a CUDA device: cuBLAS through the
 * kernels library (device.c). */
#include <cblas.h>
#include <string.h>

#include "tensor_internal.h"

/* OpenBLAS's threads for one product: all of them for large ones, one for small
 * ones. OpenBLAS splits a product of more than 2^18 multiply-adds across its
 * threads, whose waiting (sched_yield spinning) then costs more than the product
 * itself: for an MLP's 32 x 64 x 256 layers it took half the step's time, and
 * far more when the cores are shared. (The process calls BLAS from one thread.) */
#define RH_BLAS_SMALL (1ll << 23) /* multiply-adds */

/* OpenBLAS's thread count is one process-wide setting, so every change goes
 * through here (the cached value must stay true): want <= 0 is all of them,
 * 1 is what callers that split work over rh_parallel_for themselves set, so
 * each pool thread runs its own single-threaded GEMM (nn_conv.c). */
void rh__blas_threads(int want) {
  static int all = 0, now = 0;
  if (!all) all = now = openblas_get_num_threads();
  if (want <= 0 || want > all) want = all;
  if (want != now) {
    openblas_set_num_threads(want);
    now = want;
  }
}

void rh__blas_threads_for(int64_t m, int64_t n, int64_t k) { rh__blas_threads(m * n * k < RH_BLAS_SMALL ? 1 : 0); }

/* C[m,n] = A[m,k] @ B[k,n], all contiguous row-major, one dtype. threads_set:
 * the caller chose OpenBLAS's threads (a pool task must not change them) */
static void gemm(rh_dtype_t dt, int64_t m, int64_t n, int64_t k, const void *a, const void *b, void *c,
                 int threads_set) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    memset(c, 0, (size_t)(m * n) * rh_dtype_size(dt));
    return;
  }
  if ((dt == RH_F32 || dt == RH_F64) && !threads_set) rh__blas_threads_for(m, n, k);
  if (dt == RH_F32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, a, (int)k, b, (int)n,
                0.0f, c, (int)n);
  } else if (dt == RH_F64) {
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0, a, (int)k, b, (int)n,
                0.0, c, (int)n);
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

/* C[m,n] = op(A) op(B) through BLAS (float32/float64), row-major */
static void blas_gemm(rh_dtype_t dt, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int lda,
                      const void *b, int ldb, void *c) {
  if (dt == RH_F32)
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                1.0f, a, lda, b, ldb, 0.0f, c, (int)n);
  else
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                1.0, a, lda, b, ldb, 0.0, c, (int)n);
}

/* a batch of products: operand i at a + i * sa elements (sa, sb: the batch
 * strides), read as BLAS may (ta/lda, tb/ldb; 0 and k / n when contiguous) */
typedef struct {
  rh_dtype_t dt;
  int64_t m, n, k, sa, sb;
  int ta, tb, lda, ldb, threads_set;
  const char *a, *b;
  char *c;
} batch_job_t;

static void batch_gemms(void *ctx, int64_t lo, int64_t hi) {
  batch_job_t *j = ctx;
  size_t es = rh_dtype_size(j->dt);
  for (int64_t i = lo; i < hi; i++) {
    const char *a = j->a + (size_t)(i * j->sa) * es, *b = j->b + (size_t)(i * j->sb) * es;
    char *c = j->c + (size_t)(i * j->m * j->n) * es;
    if (j->ta || j->tb || j->lda != j->k || j->ldb != j->n) {
      if (!j->threads_set) rh__blas_threads_for(j->m, j->n, j->k);
      blas_gemm(j->dt, j->ta, j->tb, j->m, j->n, j->k, a, j->lda, b, j->ldb, c);
    } else {
      gemm(j->dt, j->m, j->n, j->k, a, b, c, j->threads_set);
    }
  }
}

/* runs the batch: products too small for OpenBLAS's threads (attention's
 * per-head ones) go over the pool instead, one single-threaded product per task */
static void run_batch(batch_job_t *j, int64_t nbatch) {
  if (nbatch > 1 && j->m * j->n * j->k < RH_BLAS_SMALL && rh_parallel_threads() > 1) {
    rh__blas_threads(1);
    j->threads_set = 1;
    rh_parallel_for(nbatch, 1, batch_gemms, j);
  } else {
    batch_gemms(j, 0, nbatch);
  }
}

/* How BLAS can read a rows x cols matrix in place: row-major as is, or as the
 * transpose of a row-major matrix. 0 when it needs a copy. */
static int gemm_layout(const int64_t *st, int64_t rows, int64_t cols, int *trans, int *ld) {
  if (st[1] == 1 && (st[0] == cols || rows == 1)) {
    *trans = 0;
    *ld = (int)(cols > 0 ? cols : 1);
    return 1;
  }
  if (st[0] == 1 && (st[1] == rows || cols == 1)) {
    *trans = 1;
    *ld = (int)(rows > 0 ? rows : 1);
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
    rh_tensor_fail("matmul: shapes %s and %s cannot be multiplied (%lld != %lld)", sa, sb, (long long)k,
                   (long long)k2);
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
      rh__blas_threads_for(m, n, k);
      blas_gemm(a->dtype, ta, tb, m, n, k, rh_tensor_data(A), lda, rh_tensor_data(B), ldb, rh_tensor_data(out));
    }
    goto finish;
  }
  /* a 3-D batch of host float products (attention's bmm), each operand's
   * matrices readable in place (a transposed view of heads): no copies */
  if (dev < 0 && A->ndim == 3 && B->ndim == 3 && A->size[0] == B->size[0] && rh_dtype_is_float(a->dtype) &&
      k > 0 && m > 0 && n > 0 && gemm_layout(A->stride + 1, m, k, &ta, &lda) &&
      gemm_layout(B->stride + 1, k, n, &tb, &ldb)) {
    out = rh_tensor_empty(a->dtype, 3, (int64_t[]){A->size[0], m, n});
    if (!out) goto done;
    batch_job_t job = {a->dtype, m, n, k, A->stride[0], B->stride[0], ta, tb, lda, ldb, 0,
                       rh_tensor_data(A), rh_tensor_data(B), rh_tensor_data(out)};
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
    int rc = k == 0 ? rh_tensor_fill_(out, 0)
                    : rh__cuda_call(rh_cuda_api()->gemm(dev, a->dtype, 0, 0, m, n, k, rh_tensor_data(Ac), k, m * k,
                                                        rh_tensor_data(Bc), n, k * n, rh_tensor_data(out), m * n,
                                                        nbatch));
    if (rc) goto done;
    goto finish;
  }
  batch_job_t job = {a->dtype, m, n, k, m * k, k * n, 0, 0, (int)k, (int)n, 0,
                     rh_tensor_data(Ac), rh_tensor_data(Bc), rh_tensor_data(out)};
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
