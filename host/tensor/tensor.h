/* tensor.h: rpchost's C tensor core, with no Lua in it (Torch7's TH in spirit).
 *
 * A tensor is a refcounted header (dtype, sizes, strides in elements, offset) over
 * a refcounted storage (bytes). Views share storage; every op validates shapes
 * and dtypes first and reports errors through rh_tensor_errmsg(), so nothing is
 * ever read or written outside a storage.
 *
 *   rh_tensor_t *a = rh_tensor_full(RH_F32, 2, (int64_t[]){2, 3}, 1.0);
 *   rh_tensor_t *b = rh_tensor_binary(RH_OP_ADD, a, a, NULL);   // new reference
 *   rh_tensor_release(a); rh_tensor_release(b);
 *
 * Functions returning rh_tensor_t* return a new reference the caller owns, or NULL
 * with the message set. Dimensions are 0-based here; the Lua face makes them 1-based.
 *
 * One file per floor, each calling only the floors below it (Torch7's TH split):
 *   errmsg.c (the error message), parallel.c (the thread pool)
 *   <- device.c (the CUDA kernels library) <- storage.c (refcounted buffers)
 *   <- tensor.c (dtypes, headers, shapes, views), iter.c (the strided iterator)
 *   <- copy.c (copy_, casts, contiguous, fill, to_device) <- reduce.c (sum, max,
 *   ..., softmax) <- ops.c (elementwise) <- matmul.c, index.c, sort.c, random.c
 *   (with generator.c, its generator)
 *   <- nn/ (nn.h: the layers' kernels). */
#ifndef RH_TENSOR_H
#define RH_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#define RH_MAXDIM 16

typedef enum { RH_F32 = 0, RH_F64, RH_I32, RH_I64, RH_U8, RH_BOOL, RH_NDTYPES } rh_dtype_t;

typedef struct rh_storage_s {
  int refcount;
  size_t nbytes;
  void *data;
  /* how to free data: NULL means free() */
  void (*free_fn)(void *ctx, void *data);
  void *free_ctx;
  int device; /* -1: host memory; n: memory of CUDA device n (never read on the host) */
  int uninit; /* allocated by rh_storage_new_uninit: freed through its large-buffer cache */
  /* bumped by every in-place write to the storage (PyTorch's version counter):
   * views and detach() share storage, so they share it; autograd compares the
   * version a saved tensor had when saved with the one it has at backward */
  uint64_t version;
  /* data lies in the same block as this struct, right after it (a small
   * storage of rh_storage_new*: one allocation and one free, not two) */
  int inline_data;
} rh_storage_t;

typedef struct rh_tensor_s {
  int refcount;
  rh_dtype_t dtype;
  int ndim;
  int64_t size[RH_MAXDIM];
  int64_t stride[RH_MAXDIM]; /* in elements */
  int64_t offset;            /* in elements */
  rh_storage_t *storage;
} rh_tensor_t;

static inline int rh_tensor_device(const rh_tensor_t *t) { return t->storage->device; }

/* The version counter of t's storage. Every entry point that writes into an
 * existing tensor (an op's `out`, copy_, fill_, set, a collective's result)
 * calls rh_tensor_bump_version once, after the write. */
static inline uint64_t rh_tensor_version(const rh_tensor_t *t) { return t->storage->version; }
static inline void rh_tensor_bump_version(rh_tensor_t *t) { t->storage->version++; }

typedef enum {
  RH_OP_ADD,
  RH_OP_SUB,
  RH_OP_MUL,
  RH_OP_DIV,
  RH_OP_POW,
  RH_OP_MAXIMUM,
  RH_OP_MINIMUM,
  RH_OP_EQ,
  RH_OP_NE,
  RH_OP_LT,
  RH_OP_LE,
  RH_OP_GT,
  RH_OP_GE,
  RH_OP_REM,  /* remainder with the divisor's sign (Python's %), after the comparisons */
  RH_OP_BAND, /* bitwise and, or, xor: integer and bool tensors only */
  RH_OP_BOR,
  RH_OP_BXOR,
  RH_NBINOPS
} rh_binop_t;

typedef enum {
  RH_OP_NEG,
  RH_OP_EXP,
  RH_OP_LOG,
  RH_OP_SQRT,
  RH_OP_RELU,
  RH_OP_TANH,
  RH_OP_SIGMOID,
  RH_OP_ABS,
  RH_OP_FLOOR,
  RH_OP_CEIL,
  RH_OP_ROUND,
  RH_OP_SIGN,
  RH_OP_SIN,
  RH_OP_COS,
  RH_OP_LOG1P,
  RH_OP_EXPM1,
  RH_OP_RSQRT,
  RH_NUNOPS
} rh_unop_t;

typedef enum { RH_RED_SUM, RH_RED_MEAN, RH_RED_MAX, RH_RED_MIN, RH_RED_ARGMAX, RH_RED_ARGMIN, RH_RED_PROD } rh_redop_t;

/* errors (errmsg.c) */
const char *rh_tensor_errmsg(void);
int rh_tensor_fail(const char *fmt, ...);

/* dtypes (tensor.c) */
size_t rh_dtype_size(rh_dtype_t t);
const char *rh_dtype_name(rh_dtype_t t);
int rh_dtype_is_float(rh_dtype_t t);
rh_dtype_t rh_dtype_promote(rh_dtype_t a, rh_dtype_t b);

/* storage (storage.c) */
rh_storage_t *rh_storage_new(size_t nbytes);        /* zeroed */
rh_storage_t *rh_storage_new_uninit(size_t nbytes); /* for memory about to be overwritten */
rh_storage_t *rh_storage_wrap(void *data, size_t nbytes, void (*free_fn)(void *, void *), void *ctx);
rh_storage_t *rh_storage_new_on(int device, size_t nbytes); /* uninitialised; device -1: host */
void rh_storage_retain(rh_storage_t *s);
void rh_storage_release(rh_storage_t *s);
int64_t rh_storage_live_bytes(void); /* host memory only */
/* the largest host storage allocation since the last call with reset set */
int64_t rh_storage_max_alloc(int reset);
int64_t rh_storage_peak_bytes(void);   /* live bytes' high-water mark since the last reset */
void rh_storage_reset_peak(void);      /* the high-water mark := the live bytes now */
int64_t rh_storage_cached_bytes(void); /* freed big buffers kept for reuse */

/* devices (device.c): -1 is the CPU, n >= 0 CUDA device n. Every op runs where
 * its operands are; operands on different devices are an error naming both.
 * Any other number (-2, a device not present) is an error wherever a device is
 * taken: storages, empty_on, to_device, synchronize. */
#define RH_CPU (-1)
int rh_cuda_device_count(void); /* 0 when CUDA is unavailable */
const char *rh_cuda_why(void);  /* why it is unavailable ("" when it is) */
int rh_cuda_synchronize(int device);
const char *rh_device_str(int device, char *buf, size_t len);
/* the kernels library's entry points (cuda_api.h), NULL when unavailable */
const struct rhc_api_s *rh_cuda_api(void);

/* tensors: lifetime and shape (tensor.c) */
rh_tensor_t *rh_tensor_empty(rh_dtype_t t, int ndim, const int64_t *size); /* uninitialised */
rh_tensor_t *rh_tensor_empty_on(int device, rh_dtype_t t, int ndim, const int64_t *size);
/* a contiguous copy on `device` (t itself, retained, when it is there already; copy.c) */
rh_tensor_t *rh_tensor_to_device(rh_tensor_t *t, int device);
rh_tensor_t *rh_tensor_on_storage(rh_storage_t *s, rh_dtype_t t, int64_t offset, int ndim, const int64_t *size,
                                  const int64_t *stride); /* retains s */
void rh_tensor_retain(rh_tensor_t *t);
void rh_tensor_release(rh_tensor_t *t);
int64_t rh_tensor_numel(const rh_tensor_t *t);
int rh_tensor_is_contiguous(const rh_tensor_t *t);
void *rh_tensor_data(const rh_tensor_t *t); /* address of the first element */
int rh_shape_str(int ndim, const int64_t *size, char *buf, size_t len);
/* The element count of a shape, every product checked before it is computed:
 * 0 with *numel set, or -1 (message in rh_tensor_errmsg) for a negative size or a
 * count whose bytes could not be addressed (sizes from the network are hostile). */
int rh_shape_numel(int ndim, const int64_t *size, int64_t *numel);

/* The random generator (generator.c): PyTorch 1.13's CPU generator, a 32-bit
 * Mersenne Twister seeded as torch.manual_seed seeds it, and the normal sample
 * randn keeps for its next call. Plain data: whoever holds one owns it. */
enum { RH_RNG_MT_N = 624, RH_RNG_STATE_BYTES = 5056 };
/* torch's default_rng_seed_val: a new torch.Generator()'s seed, and here the
 * default generator's too (torch seeds its default one from the OS) */
#define RH_RNG_DEFAULT_SEED 67280421310721ull
typedef struct rh_rng_s {
  uint64_t seed; /* what it was seeded with (initial_seed) */
  uint32_t mt[RH_RNG_MT_N];
  int32_t left;   /* draws until the next twist, 1..624 */
  uint32_t next;  /* the word of mt the next draw tempers */
  int has_normal; /* randn's second sample, kept for its next call */
  double normal;
  int has_normal_f32; /* torch's float sample: only carried by get/set_state */
  float normal_f32;
} rh_rng_t;
rh_rng_t *rh_rng_default(void); /* what every random op without a generator uses */
void rh_rng_seed(rh_rng_t *g, uint64_t seed);
/* seeds g from the OS with 53 random bits, stored in *seed; -1 if the OS has none */
int rh_rng_seed_random(rh_rng_t *g, uint64_t *seed);
uint32_t rh_rng_u32(rh_rng_t *g); /* torch's random() */
uint64_t rh_rng_u64(rh_rng_t *g); /* torch's random64(): two draws, the first high */
/* g's state in the layout of torch's Generator.get_state(), and back (-1 with a
 * message for bytes that are not such a state) */
void rh_rng_get_state(const rh_rng_t *g, uint8_t out[RH_RNG_STATE_BYTES]);
int rh_rng_set_state(rh_rng_t *g, const uint8_t *in, size_t n);

/* creation: full (copy.c), arange (tensor.c), rand/randn (random.c: g NULL is
 * the default generator) */
rh_tensor_t *rh_tensor_full(rh_dtype_t t, int ndim, const int64_t *size, double value);
rh_tensor_t *rh_tensor_arange(rh_dtype_t t, double start, double end, double step);
rh_tensor_t *rh_tensor_rand(rh_dtype_t t, int ndim, const int64_t *size, int normal, rh_rng_t *g);

/* one element of dtype t at p, as a double (int64 beyond 2^53 rounds; tensor.c) */
double rh_dtype_load(rh_dtype_t t, const void *p);
void rh_dtype_store(rh_dtype_t t, void *p, double v); /* clamps out-of-range integers */

/* element access by index tuple */
double rh_tensor_get(const rh_tensor_t *t, const int64_t *idx);
void rh_tensor_set(rh_tensor_t *t, const int64_t *idx, double v);

/* views: share storage (tensor.c; reshape copies when it must: copy.c) */
rh_tensor_t *rh_tensor_view(rh_tensor_t *t, int ndim, const int64_t *size); /* -1 infers one dim */
rh_tensor_t *rh_tensor_reshape(rh_tensor_t *t, int ndim, const int64_t *size);
rh_tensor_t *rh_tensor_transpose(rh_tensor_t *t, int d0, int d1);
rh_tensor_t *rh_tensor_permute(rh_tensor_t *t, const int *dims);
rh_tensor_t *rh_tensor_narrow(rh_tensor_t *t, int dim, int64_t start, int64_t length);
rh_tensor_t *rh_tensor_select(rh_tensor_t *t, int dim, int64_t index);
rh_tensor_t *rh_tensor_slice(rh_tensor_t *t, int dim, int64_t start, int64_t stop, int64_t step);
rh_tensor_t *rh_tensor_expand(rh_tensor_t *t, int ndim, const int64_t *size);
rh_tensor_t *rh_tensor_squeeze(rh_tensor_t *t, int dim); /* dim -1: all */
rh_tensor_t *rh_tensor_unsqueeze(rh_tensor_t *t, int dim);

/* copies (copy.c) */
rh_tensor_t *rh_tensor_contiguous(rh_tensor_t *t); /* t itself (retained) if already */
rh_tensor_t *rh_tensor_clone(rh_tensor_t *t);
rh_tensor_t *rh_tensor_cast(rh_tensor_t *t, rh_dtype_t dtype); /* always a new tensor */
int rh_tensor_copy_(rh_tensor_t *dst, rh_tensor_t *src);       /* broadcast src into dst */
int rh_tensor_fill_(rh_tensor_t *t, double v);

/* elementwise ops (ops.c). out NULL: a new tensor; out given: written in place
 * (returns out retained). */
rh_tensor_t *rh_tensor_binary(rh_binop_t op, rh_tensor_t *a, rh_tensor_t *b, rh_tensor_t *out);
/* a[i] op b[i] (or b[0] when b_scalar) over n contiguous elements, on this thread (no
 * pool, no checks of shapes): for callers that cut work into cache-sized pieces */
int rh_binary_flat(rh_binop_t op, rh_dtype_t dt, int64_t n, void *out, const void *a, const void *b, int b_scalar);
/* 0 when rh_binary_flat has a kernel for op on dt, else -1 with the message set:
 * for callers that must refuse before they start moving bytes */
int rh_binary_flat_check(rh_binop_t op, rh_dtype_t dt);
/* the same for a reduction: op, and the division of AVG when divided (the
 * collectives' one check before any byte moves) */
int rh_reduce_flat_check(rh_binop_t op, rh_dtype_t dt, int divided);
rh_tensor_t *rh_tensor_binary_scalar(rh_binop_t op, rh_tensor_t *a, double s, int s_is_float, int scalar_first,
                                     rh_tensor_t *out);
rh_tensor_t *rh_tensor_unary(rh_unop_t op, rh_tensor_t *a, rh_tensor_t *out);
/* reductions (reduce.c). dim < 0: over all elements (keepdim ignored).
 * ARGMAX/ARGMIN give int64; SUM/PROD of integers give int64; MEAN wants floats. */
rh_tensor_t *rh_tensor_reduce(rh_redop_t op, rh_tensor_t *a, int dim, int keepdim);
rh_tensor_t *rh_tensor_softmax(rh_tensor_t *a, int dim, int log);
/* matrix products (matmul.c) */
rh_tensor_t *rh_tensor_matmul(rh_tensor_t *a, rh_tensor_t *b);

/* indexing (index.c). Index tensors are int64 or int32 holding indices counted
 * from `base` (Lua passes 1); negative ones count from the end. */
rh_tensor_t *rh_tensor_index_select(rh_tensor_t *a, int dim, rh_tensor_t *idx, int64_t base);
rh_tensor_t *rh_tensor_gather(rh_tensor_t *a, int dim, rh_tensor_t *idx, int64_t base);
/* src NULL: scatter `value`; accumulate: add (scatter_add_) */
int rh_tensor_scatter_(rh_tensor_t *a, int dim, rh_tensor_t *idx, rh_tensor_t *src, double value, int accumulate,
                       int64_t base);
/* a[..., idx[i], ...] = (accumulate: +=) src[..., i, ...] */
int rh_tensor_index_put_(rh_tensor_t *a, int dim, rh_tensor_t *idx, rh_tensor_t *src, int accumulate, int64_t base);
int rh_tensor_masked_fill_(rh_tensor_t *t, rh_tensor_t *mask, double v);
rh_tensor_t *rh_tensor_where(rh_tensor_t *cond, rh_tensor_t *a, rh_tensor_t *b);
rh_tensor_t *rh_tensor_masked_select(rh_tensor_t *t, rh_tensor_t *mask);
int rh_tensor_masked_scatter_(rh_tensor_t *t, rh_tensor_t *mask, rh_tensor_t *src);
rh_tensor_t *rh_tensor_nonzero(rh_tensor_t *t, int64_t base); /* int64 [count, ndim] */

/* ordering and scans along a dimension (sort.c) */
int rh_tensor_sort(rh_tensor_t *a, int dim, int descending, int64_t base, rh_tensor_t **values,
                   rh_tensor_t **indices);                      /* stable */
rh_tensor_t *rh_tensor_scan(rh_tensor_t *a, int dim, int prod); /* cumsum (0) / cumprod (1) */

/* random (random.c), drawn from g (NULL: the default generator) as PyTorch's
 * CPU kernels draw; bernoulli and multinomial always from the default one */
rh_tensor_t *rh_tensor_randint(rh_dtype_t t, int64_t low, int64_t high, int ndim, const int64_t *size, rh_rng_t *g);
rh_tensor_t *rh_tensor_randperm(rh_dtype_t t, int64_t n, int64_t base, rh_rng_t *g);
rh_tensor_t *rh_tensor_bernoulli(rh_tensor_t *p);
rh_tensor_t *rh_tensor_multinomial(rh_tensor_t *w, int64_t k, int replacement, int64_t base);

/* stops the BLAS library's own threads, which rpchost never uses (matmul.c):
 * called once at start */
void rh_blas_quiet(void);

/* a pool of threads for large elementwise work (parallel.c) */
void rh_parallel_for(int64_t n, int64_t grain, void (*fn)(void *ctx, int64_t lo, int64_t hi), void *ctx);
/* how many threads a rh_parallel_for job runs on (the workers and the caller) */
int rh_parallel_threads(void);
/* the cores this process may run on; the ranks on this host (LOCAL_WORLD_SIZE,
 * which `rpchost run` sets, or Open MPI's local size, else what
 * rh_parallel_hint said), 0 when not known */
int rh_host_cpus(void);
int rh_local_ranks(void);
/* What a launcher whose variables C does not read says (a Slurm step, read by
 * rpchost.env): the ranks on this host and the CPUs it gave each (0: not
 * said). Takes effect for a pool not started yet. */
void rh_parallel_hint(int local_ranks, int cpus_per_rank);
/* a grain in items for items of `item_work` elements each: enough items that a
 * piece is worth waking a thread for (RH_PARALLEL_MIN_WORK elements) */
#define RH_PARALLEL_MIN_WORK (1 << 15)
int64_t rh_parallel_grain(int64_t item_work);

#endif
