/* cuda_api.h: the C interface between the host and librpchost_cuda.so (kernels/).
 *
 * The host never links CUDA. When a tensor first asks for a device, device.c
 * dlopens the kernels library and asks it for this table with one symbol,
 * rhc_get_api(RHC_ABI_VERSION). The library itself links cudart and cuBLAS and
 * dlopens NCCL only when a process group asks for it, so a machine without a GPU
 * or without the CUDA runtime still runs the same rpchost binary.
 *
 * Conventions: every function returns 0 on success or -1 with a message that
 * last_error() returns (thread-local in the library). Shapes and strides come
 * from the host already broadcast: `nd` dims of `size`, strides in BYTES. Work is
 * queued on the device's stream; functions that hand data to the host (d2h,
 * synchronize) wait for it. dtype codes are rh_dtype_t's, op codes rh_binop_t's,
 * rh_unop_t's and rh_redop_t's. */
#ifndef RH_CUDA_API_H
#define RH_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

#define RHC_ABI_VERSION 3
#define RHC_MAXDIM 16

typedef struct {
  int64_t allocated;    /* bytes in live tensors */
  int64_t cached;       /* bytes kept by the caching allocator for reuse */
  int64_t peak;         /* highest `allocated` so far */
  int64_t cuda_mallocs; /* how many times the cache missed and called cudaMalloc */
} rhc_memstats_t;

/* the NCCL reduction ops the process group uses (same order as rh_redop_t's
 * first ones is not assumed: mapped in the library) */
typedef enum { RHC_SUM = 0, RHC_PROD, RHC_MIN, RHC_MAX, RHC_AVG } rhc_redop_t;

/* the geometry of a 2-d window sweep over `planes` contiguous [h, w] planes
 * (kernels/nn.cu): convolution's im2col/col2im and pooling. Sizes checked by
 * the host (host/tensor/nn/nn_cuda.c) before they get here. */
typedef struct {
  int64_t planes, h, w, oh, ow;
  int64_t k[2], stride[2], pad[2], dil[2];
  int count_include_pad; /* avg pooling */
  int64_t divisor;       /* avg pooling: 0 = the window's count */
} rhc_window_t;

/* the pooling kernels' ops (kernels/nn.cu) */
typedef enum {
  RHC_POOL_MAX = 0,  /* out, idx (int64 into each plane, -1 for a window of padding) */
  RHC_POOL_AVG,      /* out */
  RHC_POOL_ADAPTIVE, /* out (PyTorch's start/end windows; k, stride, pad unused) */
  RHC_POOL_MAX_BACK, /* in: the output's gradient, idx; out: the input's, zeroed first */
  RHC_POOL_AVG_BACK,
  RHC_POOL_ADAPTIVE_BACK
} rhc_pool_op_t;

typedef struct rhc_api_s {
  int abi_version;
  const char *(*last_error)(void);

  /* devices */
  int (*device_count)(int *n); /* 0 and n = 0 when the driver finds none */
  int (*device_name)(int dev, char *buf, size_t len);
  int (*synchronize)(int dev);
  /* peak memory bandwidth in GB/s and the number of SMs, from the device's attributes */
  int (*device_limits)(int dev, double *peak_gbps, int *sm_count);

  /* memory: a caching allocator with one stream per device */
  int (*alloc)(int dev, size_t nbytes, void **ptr);
  void (*free)(int dev, void *ptr);
  int (*memstats)(int dev, rhc_memstats_t *out);
  int (*empty_cache)(int dev);
  int (*h2d)(int dev, void *dst, const void *src, size_t nbytes);
  int (*d2h)(int dev, void *dst, const void *src, size_t nbytes); /* waits */
  int (*d2d)(int dst_dev, void *dst, int src_dev, const void *src, size_t nbytes);

  /* elementwise (strided, broadcast by the host) */
  int (*cast)(int dev, int from, int to, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
              const int64_t *ast);
  int (*fill)(int dev, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, double value);
  int (*binary)(int dev, int op, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
                const int64_t *ast, const void *b, const int64_t *bst);
  int (*unary)(int dev, int op, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, const void *a,
               const int64_t *ast);
  /* any element < 0 in a contiguous int64 vector (pow's negative-exponent check) */
  int (*any_negative_i64)(int dev, const int64_t *a, int64_t n, int *out);

  /* reductions over `rows` contiguous rows of `len` elements; out holds `rows`
   * elements of out_dtype (int64 for argmax/argmin, int64 for integer sums) */
  int (*reduce_rows)(int dev, int op, int in_dtype, int out_dtype, int64_t rows, int64_t len, const void *in,
                     void *out);
  /* softmax / log_softmax over contiguous rows; float32 or float64 */
  int (*softmax_rows)(int dev, int dtype, int log_, int64_t rows, int64_t len, const void *in, void *out);

  /* C[b] = op(A[b]) @ op(B[b]) for b < batch, row-major, float32/float64 through
   * cuBLAS; an integer product through a tiled kernel */
  int (*gemm)(int dev, int dtype, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *a, int64_t lda,
              int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b, void *c, int64_t stride_c, int64_t batch);

  /* NCCL, loaded on first use. The unique id is 128 bytes. */
  int (*nccl_available)(char *why, size_t len);
  int (*nccl_unique_id)(void *id128);
  /* starts a non-blocking ncclCommInitRank; poll with nccl_ready */
  int (*nccl_init)(int dev, int nranks, int rank, const void *id128, void **comm);
  /* 1 ready, 0 still initialising or running, -1 failed (message set) */
  int (*nccl_ready)(void *comm);
  int (*nccl_abort)(void *comm);
  /* collectives on the device's stream; complete when event_done says so */
  int (*nccl_all_reduce)(void *comm, const void *send, void *recv, int64_t count, int dtype, int op);
  int (*nccl_broadcast)(void *comm, void *buf, int64_t count, int dtype, int root);
  int (*nccl_reduce)(void *comm, const void *send, void *recv, int64_t count, int dtype, int op, int root);
  int (*nccl_all_gather)(void *comm, const void *send, void *recv, int64_t count, int dtype);
  int (*nccl_reduce_scatter)(void *comm, const void *send, void *recv, int64_t count, int dtype, int op);
  int (*nccl_send)(void *comm, const void *buf, int64_t count, int dtype, int peer);
  int (*nccl_recv)(void *comm, void *buf, int64_t count, int dtype, int peer);
  /* fuse the point-to-point calls between them into one (gather, scatter) */
  int (*nccl_group_start)(void);
  int (*nccl_group_end)(void);
  /* an event recorded on the device's stream now; event_done: 1 done, 0 not yet, -1 error */
  int (*event_record)(int dev, void **event);
  int (*event_done)(void *event);
  void (*event_free)(void *event);

  /* indexing (kernels/index.cu); indices arrive checked and 0-based, int64, on the device.
   * index_select: out[o][i][k] = src[o][idx[i]][k] over contiguous (outer, n, inner)
   * elements of `esize` bytes, m indices. */
  int (*index_select)(int dev, int esize, int64_t outer, int64_t n, int64_t inner, const void *src, const int64_t *idx,
                      int64_t m, void *out);
  /* over idx's shape (contiguous): mode 0 gather o <- a, 1 scatter a <- o, 2 scatter-add
   * a += o, 3 scatter `value` into a; a's and o's strides in bytes */
  int (*gather_scatter)(int dev, int mode, int dtype, int nd, int dim, const int64_t *size, const int64_t *idx, void *a,
                        const int64_t *ast, void *o, const int64_t *ost, double value);
  /* o = (src ? src : value) where mask; broadcast strides in bytes */
  int (*masked_fill)(int dev, int dtype, int nd, const int64_t *size, void *o, const int64_t *ost, const void *mask,
                     const int64_t *mst, const void *src, const int64_t *sst, double value);

  /* masks with results whose size depends on the data (kernels/index.cu), over n
   * contiguous elements: mask_scan gives each set element its place among the set
   * ones (pos, int64) and their count (waits for it); mask_compact: dst[pos[i]] =
   * src[i] where set; mask_expand: dst[i] = src[pos[i]] where set; nonzero_write:
   * out[pos[i]][d] = coordinate d of i (in `size`) + base where set */
  int (*mask_scan)(int dev, int64_t n, const void *mask, int64_t *pos, int64_t *count);
  int (*mask_compact)(int dev, int esize, int64_t n, const void *mask, const int64_t *pos, const void *src, void *dst);
  int (*mask_expand)(int dev, int esize, int64_t n, const void *mask, const int64_t *pos, const void *src, void *dst);
  int (*nonzero_write)(int dev, int64_t n, int nd, const int64_t *size, const void *mask, const int64_t *pos,
                       int64_t *out, int64_t base);

  /* ordering and scans over `rows` contiguous rows of `len` (kernels/sort.cu).
   * sort_rows: a stable sort of each row; values in dtype, positions (plus base) in
   * int64. scan_rows: cumsum (prod 0) / cumprod (1); out_dtype is the input's for
   * floats and int64 otherwise. */
  int (*sort_rows)(int dev, int dtype, int descending, int64_t rows, int64_t len, const void *in, void *vals,
                   int64_t *idx, int64_t base);
  int (*scan_rows)(int dev, int in_dtype, int out_dtype, int prod, int64_t rows, int64_t len, const void *in,
                   void *out);

  /* nn (kernels/nn.cu), float32/float64. im2col: n samples x [c, h, w] (w->planes
   * is c) to columns [n][c * k0 * k1][oh * ow]; to_image: the reverse, each image
   * element the sum of the columns that read it (written whole, no atomics). The
   * GEMMs around it are the host's, through gemm. */
  int (*nn_im2col)(int dev, int dtype, const rhc_window_t *w, int64_t n, void *image, void *cols, int to_image);
  /* pooling over w->planes planes [h, w] <-> [oh, ow]; `in` the forward's input
   * (or, backward, the output's gradient), `out` its result; idx int64 or NULL */
  int (*nn_pool)(int dev, int dtype, int op, const rhc_window_t *w, const void *in, void *out, int64_t *idx);

  /* normalisation and friends (kernels/norm.cu), float32/float64, contiguous
   * operands; statistics in float64. batch norm over x [n][c][inner]: training
   * uses the batch's mean and biased variance and updates rm/rv (when given) with
   * the unbiased one; eval uses rm/rv. w, b may be NULL; so may gx, gw, gb. */
  int (*nn_batch_norm)(int dev, int dtype, int64_t n, int64_t c, int64_t inner, const void *x, const void *w,
                       const void *b, void *rm, void *rv, int training, double momentum, double eps, void *y,
                       double *mean, double *invstd);
  int (*nn_batch_norm_backward)(int dev, int dtype, int64_t n, int64_t c, int64_t inner, const void *gy, const void *x,
                                const void *w, const double *mean, const double *invstd, int training, void *gx,
                                void *gw, void *gb);
  /* layer norm over `rows` rows of d: y, and each row's mean and 1/sqrt(var + eps) */
  int (*nn_layer_norm)(int dev, int dtype, int64_t rows, int64_t d, const void *x, const void *w, const void *b,
                       double eps, void *y, double *mean, double *rstd);
  int (*nn_layer_norm_backward)(int dev, int dtype, int64_t rows, int64_t d, const void *gy, const void *x,
                                const void *w, const double *mean, const double *rstd, void *gx, void *gw, void *gb);
  /* (log-)softmax's gradient over rows from its output y and the gradient g */
  int (*nn_softmax_backward)(int dev, int dtype, int log_, int64_t rows, int64_t len, const void *y, const void *g,
                             void *gx);
  /* the LSTM cell's pointwise part (host/tensor/nn.h): gates [b, 4h], c_prev [b, h]
   * to h, c [b, h] and ws [b, 5h]; backward: gh, gc (NULL: zero) to ggates, gc_prev */
  int (*nn_lstm_cell)(int dev, int dtype, int64_t b, int64_t h, const void *gates, const void *c_prev, void *h_out,
                      void *c_out, void *ws);
  int (*nn_lstm_cell_backward)(int dev, int dtype, int64_t b, int64_t h, const void *gh, const void *gc,
                               const void *c_prev, const void *ws, void *ggates, void *gc_prev);

  /* benchmark support for bench/gpu: time `iters` raw cuBLAS GEMMs of n x n
   * (float32) and return the milliseconds per GEMM */
  int (*bench_cublas_gemm)(int dev, int n, int iters, double *ms);
} rhc_api_t;

typedef const rhc_api_t *(*rhc_get_api_fn)(int abi_version);

#endif
