/* tensor_internal.h: what the tensor core's files (and nn/) share and nothing
 * else sees: scalar load/store by dtype, broadcasting, the strided N-d iterator,
 * the device helpers, and the vector builds of element loops (RH_VEC_CLONES).
 * Each declaration names the file that defines it; the files depend one way
 * (errmsg.c, parallel.c <- device.c <- storage.c <- tensor.c, iter.c <- copy.c <-
 * reduce.c <- ops.c <- matmul.c, index.c, sort.c, random.c and generator.c <- nn/). */
#ifndef RH_TENSOR_INTERNAL_H
#define RH_TENSOR_INTERNAL_H

#include "cuda_api.h"
#include "tensor.h"

#define rh__load rh_dtype_load
#define rh__store rh_dtype_store

/* tensor.c: broadcast shape of a and b (numpy rules); -1 with a message naming both shapes */
int rh__broadcast_shape(int na, const int64_t *a, int nb, const int64_t *b, int *nout, int64_t *out);
/* tensor.c: the shape `size` (one -1 inferred) for t's elements, into out; else
 * -1 with "what: shape ... is invalid for input of size ..." */
int rh__infer_shape(const rh_tensor_t *t, int ndim, const int64_t *size, int64_t *out, const char *what);
/* tensor.c: strides viewing t as shape (ndim, size) without a copy (PyTorch's
 * computeStride): 0 with stride filled, or -1 when only a copy can have that shape */
int rh__view_strides(const rh_tensor_t *t, int ndim, const int64_t *size, int64_t *stride);

/* iter.c: an inner loop over n elements of up to three operands with byte strides. */
typedef void (*rh_loop_fn)(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                           void *ctx);

/* iter.c: runs fn over every element of `size`, operands given by base pointers and byte
 * strides (b may be NULL). Large iterations are split across the thread pool. */
void rh__iterate(int ndim, const int64_t *size, char *o, const int64_t *ost, const char *a, const int64_t *ast,
                 const char *b, const int64_t *bst, rh_loop_fn fn, void *ctx);

/* Byte strides of t viewed (broadcast) as shape (ndim, size). Inline: every op
 * makes these for each operand before its loop. */
static inline void rh__bcast_strides(const rh_tensor_t *t, int ndim, const int64_t *size, int64_t *out) {
  int off = ndim - t->ndim;
  int64_t es = (int64_t)rh_dtype_size(t->dtype);
  for (int d = 0; d < ndim; d++) {
    if (d < off || t->size[d - off] == 1 || size[d] == 1) out[d] = 0;
    else out[d] = t->stride[d - off] * es;
  }
}

/* copy.c: t itself (retained) when it has dtype dt, else a cast copy */
static inline rh_tensor_t *rh__as_dtype(rh_tensor_t *t, rh_dtype_t dt) {
  if (t->dtype == dt) {
    rh_tensor_retain(t);
    return t;
  }
  return rh_tensor_cast(t, dt);
}

/* devices (device.c) */
const rhc_api_t *rh_cuda_api(void); /* NULL when unavailable */
int rh__check_device(int device);   /* -1 with the message when it can't be used */
int rh__cuda_call(int rc);          /* rc != 0: copies the library's message, -1 */
/* storage.c: a storage over memory of `device` that free_fn gives back */
rh_storage_t *rh__storage_wrap_on(int device, void *data, size_t nbytes, void (*free_fn)(void *, void *), void *ctx);
/* tensor.c: 0 when a and b are on one device, else -1 with "what: ... found at least two devices" */
int rh__same_device(const char *what, const rh_tensor_t *a, const rh_tensor_t *b);
/* C[m,n] = op(A) op(B) + beta C, row-major float32/float64 through OpenBLAS
 * (matmul.c): large products split over the thread pool, whole inside a pool task */
void rh__gemm(rh_dtype_t dt, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, const void *b,
              int64_t ldb, double beta, void *c, int64_t ldc);
#define RH_ON_DEVICE(t) (rh_tensor_device(t) >= 0)
/* releases the tensors of a list (a function's temporaries; NULL entries are no-ops) */
static inline void rh__nn_release(rh_tensor_t **ts, int n) {
  for (int i = 0; i < n; i++) rh_tensor_release(ts[i]);
}
/* dim (0-based) names a dimension of a tensor of ndim (a 0-d one has dim 0);
 * else -1 with "what: dimension d out of range (...)" (tensor.c) */
int rh__check_dim(const char *what, int dim, int ndim);

/* Element loops built for AVX-512 and AVX2 as well as the x86-64 baseline, the
 * widest the CPU has picked when the program loads (GCC's function
 * multi-versioning; clang and other targets get the one plain build). Every
 * clone runs the same operations in the same order, so each gives the same
 * bits: only the vector width differs. RH_VEC_CLONES_AVX2 leaves AVX-512 out,
 * for loops it does not speed up. RH_VEC_X86 guards the hand-written
 * intrinsics (immintrin.h) that go with them; copy.c keeps its own wider
 * guard, since clang too accepts its target("avx2") functions. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RH_VEC_X86 1
#define RH_VEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define RH_VEC_CLONES_AVX2 __attribute__((target_clones("avx2", "default")))
/* x86-64-v3 (AVX2 and FMA): for loops written with fma()/fmaf(), which are one
 * rounding in every clone, an instruction here and a libm call in the baseline */
#define RH_VEC_CLONES_FMA __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RH_VEC_X86 0
#define RH_VEC_CLONES
#define RH_VEC_CLONES_AVX2
#define RH_VEC_CLONES_FMA
#endif

#endif
