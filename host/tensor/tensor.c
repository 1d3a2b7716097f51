/* tensor.c: tensor headers over storages (Torch7's THTensor): dtypes (sizes,
 * names, promotion, one element's load and store), lifetime, shapes and their
 * checked element counts, views that share storage (view, transpose, permute,
 * slice, narrow, select, expand, squeeze, unsqueeze), broadcasting's shape rule,
 * and access to one element.
 *
 * Depends on storage.c, device.c (one element of a device tensor travels by
 * itself) and errmsg.c. Nothing here copies elements: a reshape that cannot be a
 * view, contiguous() and the other copies are copy.c's, one floor up. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_internal.h"

/* ---- dtypes */
static const size_t dsize[RH_NDTYPES] = {4, 8, 4, 8, 1, 1};
static const char *dname[RH_NDTYPES] = {"float32", "float64", "int32", "int64", "uint8", "bool"};

size_t rh_dtype_size(rh_dtype_t t) { return dsize[t]; }
const char *rh_dtype_name(rh_dtype_t t) { return (unsigned)t < RH_NDTYPES ? dname[t] : "?"; }
int rh_dtype_is_float(rh_dtype_t t) { return t == RH_F32 || t == RH_F64; }

/* PyTorch's promotion for two tensors: bool < integers < floats, and within a
 * category the wider type (uint8 with a signed type gives the signed one). */
rh_dtype_t rh_dtype_promote(rh_dtype_t a, rh_dtype_t b) {
  if (a == b) return a;
  if (a == RH_BOOL) return b;
  if (b == RH_BOOL) return a;
  if (rh_dtype_is_float(a) || rh_dtype_is_float(b)) {
    if (a == RH_F64 || b == RH_F64) return RH_F64;
    return RH_F32;
  }
  if (a == RH_I64 || b == RH_I64) return RH_I64;
  if (a == RH_I32 || b == RH_I32) return RH_I32;
  return RH_U8;
}

/* ---- tensors */
int64_t rh_tensor_numel(const rh_tensor_t *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->size[i];
  return n;
}

int rh_shape_str(int ndim, const int64_t *size, char *buf, size_t len) {
  size_t off = 0;
  off += (size_t)snprintf(buf + off, len - off, "[");
  for (int i = 0; i < ndim && off < len; i++)
    off += (size_t)snprintf(buf + off, len - off, "%s%lld", i ? ", " : "", (long long)size[i]);
  if (off < len) snprintf(buf + off, len - off, "]");
  return 0;
}

static void contiguous_strides(int ndim, const int64_t *size, int64_t *stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= size[i] > 0 ? size[i] : 1;
  }
}

/* the bound keeps numel x the largest element size (16 bytes) inside int64 */
int rh_shape_numel(int ndim, const int64_t *size, int64_t *numel) {
  if (ndim < 0 || ndim > RH_MAXDIM)
    return rh_tensor_fail("a tensor has at most %d dimensions, got %d", RH_MAXDIM, ndim);
  int64_t n = 1;
  for (int i = 0; i < ndim; i++)
    if (size[i] < 0) return rh_tensor_fail("negative size %lld in dimension %d", (long long)size[i], i + 1);
  /* an empty tensor still gets strides (the products of the sizes after each
   * dimension, a zero counted as one): those are bounded as well */
  int empty = 0;
  for (int i = 0; i < ndim; i++) {
    if (size[i] == 0) {
      empty = 1;
      continue;
    }
    if (n > INT64_MAX / 16 / size[i]) {
      char shape[160];
      rh_shape_str(ndim, size, shape, sizeof shape);
      return rh_tensor_fail("a tensor of shape %s is too large (its element count overflows 64 bits)", shape);
    }
    n *= size[i];
  }
  *numel = empty ? 0 : n;
  return 0;
}

static int check_sizes(int ndim, const int64_t *size, int64_t *numel) { return rh_shape_numel(ndim, size, numel); }

rh_tensor_t *rh_tensor_on_storage(rh_storage_t *s, rh_dtype_t dt, int64_t offset, int ndim, const int64_t *size,
                                  const int64_t *stride) {
  int64_t numel = 0;
  if (check_sizes(ndim, size, &numel)) return NULL;
  /* the highest element addressed must lie inside the storage */
  int64_t hi = offset, lo = offset;
  if (numel > 0)
    for (int i = 0; i < ndim; i++) {
      if (stride[i] >= 0) hi += stride[i] * (size[i] - 1);
      else lo += stride[i] * (size[i] - 1);
    }
  if (numel > 0 && (lo < 0 || (uint64_t)(hi + 1) * rh_dtype_size(dt) > s->nbytes)) {
    rh_tensor_fail("view out of bounds of its storage (%zu bytes)", s->nbytes);
    return NULL;
  }
  rh_tensor_t *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->refcount = 1;
  t->dtype = dt;
  t->ndim = ndim;
  t->offset = offset;
  for (int i = 0; i < ndim; i++) {
    t->size[i] = size[i];
    t->stride[i] = stride[i];
  }
  t->storage = s;
  rh_storage_retain(s);
  return t;
}

rh_tensor_t *rh_tensor_empty(rh_dtype_t dt, int ndim, const int64_t *size) {
  return rh_tensor_empty_on(-1, dt, ndim, size);
}

rh_tensor_t *rh_tensor_empty_on(int device, rh_dtype_t dt, int ndim, const int64_t *size) {
  int64_t numel = 0;
  if (check_sizes(ndim, size, &numel)) return NULL;
  rh_storage_t *s = rh_storage_new_on(device, (size_t)numel * rh_dtype_size(dt));
  if (!s) return NULL;
  int64_t stride[RH_MAXDIM];
  contiguous_strides(ndim, size, stride);
  rh_tensor_t *t = rh_tensor_on_storage(s, dt, 0, ndim, size, stride);
  rh_storage_release(s);
  return t;
}

void rh_tensor_retain(rh_tensor_t *t) { __atomic_add_fetch(&t->refcount, 1, __ATOMIC_RELAXED); }

void rh_tensor_release(rh_tensor_t *t) {
  if (!t || __atomic_sub_fetch(&t->refcount, 1, __ATOMIC_ACQ_REL) > 0) return;
  rh_storage_release(t->storage);
  free(t);
}

/* A tensor with no elements is contiguous whatever its strides (as in PyTorch):
 * there is no element whose address could be out of order. */
int rh_tensor_is_contiguous(const rh_tensor_t *t) {
  for (int i = 0; i < t->ndim; i++)
    if (t->size[i] == 0) return 1;
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->size[i] != 1 && t->stride[i] != s) return 0;
    s *= t->size[i];
  }
  return 1;
}

void *rh_tensor_data(const rh_tensor_t *t) {
  return (char *)t->storage->data + t->offset * (int64_t)rh_dtype_size(t->dtype);
}

/* ---- scalar access */
double rh_dtype_load(rh_dtype_t dt, const void *p) {
  switch (dt) {
    case RH_F32: return *(const float *)p;
    case RH_F64: return *(const double *)p;
    case RH_I32: return *(const int32_t *)p;
    case RH_I64: return (double)*(const int64_t *)p;
    case RH_U8: return *(const uint8_t *)p;
    case RH_BOOL: return *(const uint8_t *)p != 0;
    default: return 0;
  }
}

void rh_dtype_store(rh_dtype_t dt, void *p, double v) {
  switch (dt) {
    case RH_F32: *(float *)p = (float)v; break;
    case RH_F64: *(double *)p = v; break;
    /* out-of-range and NaN conversions to integers are undefined in C: clamp */
    case RH_I32:
      *(int32_t *)p = isnan(v) ? 0 : v >= 2147483647.0 ? INT32_MAX : v <= -2147483648.0 ? INT32_MIN : (int32_t)v;
      break;
    case RH_I64:
      *(int64_t *)p = isnan(v)                      ? 0
                      : v >= 9.2233720368547758e18  ? INT64_MAX
                      : v <= -9.2233720368547758e18 ? INT64_MIN
                                                    : (int64_t)v;
      break;
    case RH_U8: *(uint8_t *)p = isnan(v) ? 0 : v >= 255 ? 255 : v <= 0 ? 0 : (uint8_t)v; break;
    case RH_BOOL: *(uint8_t *)p = v != 0; break;
    default: break;
  }
}

static char *elem_ptr(const rh_tensor_t *t, const int64_t *idx) {
  int64_t off = t->offset;
  for (int i = 0; i < t->ndim; i++) off += idx[i] * t->stride[i];
  return (char *)t->storage->data + off * (int64_t)rh_dtype_size(t->dtype);
}

/* one element of a device tensor travels by itself (item(), t[i] = v) */
double rh_tensor_get(const rh_tensor_t *t, const int64_t *idx) {
  if (!RH_ON_DEVICE(t)) return rh__load(t->dtype, elem_ptr(t, idx));
  union {
    char b[8];
    double d;
  } v = {{0}};
  if (rh__cuda_call(rh_cuda_api()->d2h(rh_tensor_device(t), v.b, elem_ptr(t, idx), rh_dtype_size(t->dtype))))
    return NAN;
  return rh__load(t->dtype, v.b);
}

void rh_tensor_set(rh_tensor_t *t, const int64_t *idx, double x) {
  if (!RH_ON_DEVICE(t)) {
    rh__store(t->dtype, elem_ptr(t, idx), x);
    return;
  }
  union {
    char b[8];
    double d;
  } v = {{0}};
  rh__store(t->dtype, v.b, x);
  rh__cuda_call(rh_cuda_api()->h2d(rh_tensor_device(t), elem_ptr(t, idx), v.b, rh_dtype_size(t->dtype)));
}

/* ---- creation (full() fills, so it is copy.c's) */
rh_tensor_t *rh_tensor_arange(rh_dtype_t dt, double start, double end, double step) {
  if (step == 0) {
    rh_tensor_fail("arange: step must be non-zero");
    return NULL;
  }
  if ((step > 0 && start > end) || (step < 0 && start < end)) {
    rh_tensor_fail("arange: upper bound and larger bound inconsistent with step sign");
    return NULL;
  }
  double nd = ceil((end - start) / step);
  int64_t n = nd > 0 ? (int64_t)nd : 0;
  rh_tensor_t *t = rh_tensor_empty(dt, 1, &n);
  if (!t) return NULL;
  char *p = rh_tensor_data(t);
  size_t es = rh_dtype_size(dt);
  for (int64_t i = 0; i < n; i++) rh__store(dt, p + (size_t)i * es, start + (double)i * step);
  return t;
}

/* the random generator, rand and randn live in random.c with the other random tensors */

/* ---- views */
int rh__check_dim(const char *what, int dim, int ndim) {
  if (dim < 0 || dim >= (ndim > 0 ? ndim : 1))
    return rh_tensor_fail("%s: dimension %d out of range (the tensor has %d dimension%s)", what, dim + 1, ndim,
                          ndim == 1 ? "" : "s");
  return 0;
}

/* Strides for viewing t with a new shape without copying, if possible (PyTorch's
 * computeStride): returns 0 and fills stride, or -1. */
int rh__view_strides(const rh_tensor_t *t, int ndim, const int64_t *size, int64_t *stride) {
  int64_t numel = rh_tensor_numel(t);
  if (numel == 0 || t->ndim == 0) {
    contiguous_strides(ndim, size, stride);
    return 0;
  }
  int view_d = ndim - 1;
  int64_t chunk_base_stride = t->ndim ? t->stride[t->ndim - 1] : 1;
  int64_t tensor_numel = 1, view_numel = 1;
  for (int td = t->ndim - 1; td >= 0; td--) {
    tensor_numel *= t->size[td];
    if (td == 0 || (t->size[td - 1] != 1 && t->stride[td - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || size[view_d] == 1)) {
        stride[view_d] = view_numel * chunk_base_stride;
        view_numel *= size[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return -1;
      if (td > 0) {
        chunk_base_stride = t->stride[td - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return -1;
  return 0;
}

int rh__infer_shape(const rh_tensor_t *t, int ndim, const int64_t *in, int64_t *out, const char *what) {
  int infer = -1;
  int64_t known = 1;
  if (ndim > RH_MAXDIM) return rh_tensor_fail("%s: at most %d dimensions", what, RH_MAXDIM);
  for (int i = 0; i < ndim; i++) {
    out[i] = in[i];
    if (in[i] == -1) {
      if (infer >= 0) return rh_tensor_fail("%s: only one dimension can be inferred (-1)", what);
      infer = i;
    } else if (in[i] < 0) {
      return rh_tensor_fail("%s: invalid size %lld", what, (long long)in[i]);
    } else {
      known *= in[i];
    }
  }
  int64_t numel = rh_tensor_numel(t);
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) goto bad;
    out[infer] = numel / known;
  } else if (known != numel) {
    goto bad;
  }
  return 0;
bad : {
  char a[256], b[256];
  rh_shape_str(t->ndim, t->size, a, sizeof a);
  rh_shape_str(ndim, in, b, sizeof b);
  return rh_tensor_fail("%s: shape %s is invalid for input of size %lld (shape %s)", what, b, (long long)numel, a);
}
}

rh_tensor_t *rh_tensor_view(rh_tensor_t *t, int ndim, const int64_t *size) {
  int64_t shape[RH_MAXDIM], stride[RH_MAXDIM];
  if (rh__infer_shape(t, ndim, size, shape, "view")) return NULL;
  if (rh__view_strides(t, ndim, shape, stride)) {
    rh_tensor_fail("view: size is not compatible with the input's strides (use reshape, or contiguous first)");
    return NULL;
  }
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset, ndim, shape, stride);
}

rh_tensor_t *rh_tensor_transpose(rh_tensor_t *t, int d0, int d1) {
  if (t->ndim == 0 && d0 == 0 && d1 == 0) return rh_tensor_on_storage(t->storage, t->dtype, t->offset, 0, NULL, NULL);
  if (rh__check_dim("transpose", d0, t->ndim) || rh__check_dim("transpose", d1, t->ndim)) return NULL;
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  memcpy(size, t->size, sizeof size);
  memcpy(stride, t->stride, sizeof stride);
  size[d0] = t->size[d1];
  size[d1] = t->size[d0];
  stride[d0] = t->stride[d1];
  stride[d1] = t->stride[d0];
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset, t->ndim, size, stride);
}

rh_tensor_t *rh_tensor_permute(rh_tensor_t *t, const int *dims) {
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  int seen[RH_MAXDIM] = {0};
  for (int i = 0; i < t->ndim; i++) {
    if (rh__check_dim("permute", dims[i], t->ndim)) return NULL;
    if (seen[dims[i]]++) {
      rh_tensor_fail("permute: dimension %d repeats", dims[i] + 1);
      return NULL;
    }
    size[i] = t->size[dims[i]];
    stride[i] = t->stride[dims[i]];
  }
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset, t->ndim, size, stride);
}

rh_tensor_t *rh_tensor_slice(rh_tensor_t *t, int dim, int64_t start, int64_t stop, int64_t step) {
  if (rh__check_dim("slice", dim, t->ndim)) return NULL;
  int64_t n = t->size[dim];
  if (step <= 0) {
    rh_tensor_fail("slice: step must be positive, got %lld", (long long)step);
    return NULL;
  }
  if (start < 0) start += n;
  if (stop < 0) stop += n;
  if (start < 0) start = 0;
  if (stop > n) stop = n;
  if (start > n) start = n;
  int64_t len = stop > start ? (stop - start + step - 1) / step : 0;
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  memcpy(size, t->size, sizeof size);
  memcpy(stride, t->stride, sizeof stride);
  size[dim] = len;
  stride[dim] = t->stride[dim] * step;
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset + (len ? start * t->stride[dim] : 0), t->ndim, size,
                              stride);
}

rh_tensor_t *rh_tensor_narrow(rh_tensor_t *t, int dim, int64_t start, int64_t length) {
  if (rh__check_dim("narrow", dim, t->ndim)) return NULL;
  if (start < 0 || length < 0 || start + length > t->size[dim]) {
    rh_tensor_fail("narrow: start %lld + length %lld exceeds dimension %d of size %lld", (long long)start + 1,
                   (long long)length, dim + 1, (long long)t->size[dim]);
    return NULL;
  }
  return rh_tensor_slice(t, dim, start, start + length, 1);
}

rh_tensor_t *rh_tensor_select(rh_tensor_t *t, int dim, int64_t index) {
  if (rh__check_dim("select", dim, t->ndim)) return NULL;
  int64_t n = t->size[dim];
  if (index < -n || index >= n) {
    rh_tensor_fail("index %lld is out of bounds for dimension %d with size %lld",
                   (long long)(index >= 0 ? index + 1 : index), dim + 1, (long long)n);
    return NULL;
  }
  if (index < 0) index += n;
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  int k = 0;
  for (int i = 0; i < t->ndim; i++)
    if (i != dim) {
      size[k] = t->size[i];
      stride[k] = t->stride[i];
      k++;
    }
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset + index * t->stride[dim], k, size, stride);
}

/* Broadcast shape of a and b (numpy rules); -1 with a message naming both shapes. */
int rh__broadcast_shape(int na, const int64_t *a, int nb, const int64_t *b, int *nout, int64_t *out) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int64_t x = i < n - na ? 1 : a[i - (n - na)];
    int64_t y = i < n - nb ? 1 : b[i - (n - nb)];
    if (x != y && x != 1 && y != 1) {
      char sa[256], sb[256];
      rh_shape_str(na, a, sa, sizeof sa);
      rh_shape_str(nb, b, sb, sizeof sb);
      return rh_tensor_fail("shapes %s and %s cannot be broadcast together (dimension %d: %lld vs %lld)", sa, sb, i + 1,
                            (long long)x, (long long)y);
    }
    out[i] = x == 1 ? y : x;
  }
  *nout = n;
  return 0;
}

rh_tensor_t *rh_tensor_expand(rh_tensor_t *t, int ndim, const int64_t *size) {
  if (ndim < t->ndim) {
    rh_tensor_fail("expand: the number of sizes (%d) must be at least the tensor's dimensions (%d)", ndim, t->ndim);
    return NULL;
  }
  int64_t osize[RH_MAXDIM], ostride[RH_MAXDIM];
  int off = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    int64_t want = size[i];
    if (i < off) {
      if (want < 0) {
        rh_tensor_fail("expand: -1 is not allowed in a new leading dimension");
        return NULL;
      }
      osize[i] = want;
      ostride[i] = 0;
    } else {
      int64_t have = t->size[i - off];
      if (want == -1) want = have;
      if (have == want) {
        osize[i] = have;
        ostride[i] = t->stride[i - off];
      } else if (have == 1) {
        osize[i] = want;
        ostride[i] = 0;
      } else {
        char sa[256], sb[256];
        rh_shape_str(t->ndim, t->size, sa, sizeof sa);
        rh_shape_str(ndim, size, sb, sizeof sb);
        rh_tensor_fail("expand: cannot expand shape %s to %s", sa, sb);
        return NULL;
      }
    }
  }
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset, ndim, osize, ostride);
}

rh_tensor_t *rh_tensor_squeeze(rh_tensor_t *t, int dim) {
  if (dim >= 0 && rh__check_dim("squeeze", dim, t->ndim)) return NULL;
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  int k = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (t->size[i] == 1 && (dim < 0 || dim == i)) continue;
    size[k] = t->size[i];
    stride[k] = t->stride[i];
    k++;
  }
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset, k, size, stride);
}

rh_tensor_t *rh_tensor_unsqueeze(rh_tensor_t *t, int dim) {
  if (dim < 0 || dim > t->ndim) {
    rh_tensor_fail("unsqueeze: dimension %d out of range (1..%d)", dim + 1, t->ndim + 1);
    return NULL;
  }
  if (t->ndim >= RH_MAXDIM) {
    rh_tensor_fail("unsqueeze: at most %d dimensions", RH_MAXDIM);
    return NULL;
  }
  int64_t size[RH_MAXDIM], stride[RH_MAXDIM];
  int k = 0;
  for (int i = 0; i <= t->ndim; i++) {
    if (i == dim) {
      size[k] = 1;
      stride[k] = i < t->ndim ? t->stride[i] * t->size[i] : 1;
      k++;
    }
    if (i < t->ndim) {
      size[k] = t->size[i];
      stride[k] = t->stride[i];
      k++;
    }
  }
  return rh_tensor_on_storage(t->storage, t->dtype, t->offset, k, size, stride);
}

/* operands of one op live on one device; else an error naming both */
int rh__same_device(const char *what, const rh_tensor_t *a, const rh_tensor_t *b) {
  int da = rh_tensor_device(a), db = rh_tensor_device(b);
  if (da == db) return 0;
  char sa[16], sb[16];
  return rh_tensor_fail(
      "%s: expected all tensors to be on the same device, but found at least two devices, %s "
      "and %s (move one with :to())",
      what, rh_device_str(da, sa, sizeof sa), rh_device_str(db, sb, sizeof sb));
}
