/* tensor_internal.h: what the tensor core's files share and nothing else sees:
 * scalar load/store by dtype, broadcasting, the strided N-d iterator, and the
 * vector builds of element loops (RH_VEC_CLONES). */
#ifndef RH_TENSOR_INTERNAL_H
#define RH_TENSOR_INTERNAL_H

#include "cuda_api.h"
#include "tensor.h"

#define rh__load rh_dtype_load
#define rh__store rh_dtype_store
int rh__broadcast_shape(int na, const int64_t *a, int nb, const int64_t *b, int *nout, int64_t *out);

/* An inner loop over n elements of up to three operands with byte strides. */
typedef void (*rh_loop_fn)(int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs,
                           void *ctx);

/* Runs fn over every element of `size`, operands given by base pointers and byte
 * strides (b may be NULL). Large iterations are split across the thread pool. */
void rh__iterate(int ndim, const int64_t *size, char *o, const int64_t *ost, const char *a, const int64_t *ast,
                 const char *b, const int64_t *bst, rh_loop_fn fn, void *ctx);

/* Byte strides of t viewed (broadcast) as shape (ndim, size). */
void rh__bcast_strides(const rh_tensor_t *t, int ndim, const int64_t *size, int64_t *out);

/* copy.c: a same-dtype copy of permuted layouts in cache-sized tiles; 1 when it
 * did the copy, 0 when the layouts are better served by rh__iterate */
int rh__copy_tiled(int ndim, const int64_t *size, char *dst, const int64_t *dst_st, const char *src,
                   const int64_t *src_st, size_t es);

/* devices (device.c) */
rh_storage_t *rh__storage_wrap_on(int device, void *data, size_t nbytes, void (*free_fn)(void *, void *), void *ctx);
const rhc_api_t *rh_cuda_api(void); /* NULL when unavailable */
int rh__check_device(int device);   /* -1 with the message when it can't be used */
int rh__cuda_call(int rc);          /* rc != 0: copies the library's message, -1 */
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
#else
#define RH_VEC_X86 0
#define RH_VEC_CLONES
#define RH_VEC_CLONES_AVX2
#endif

#endif
