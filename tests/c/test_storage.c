/* test_storage.c: refcounted storages and the tensor headers over them
 * (host/tensor/storage.c, tensor.c). A storage starts with one reference and is
 * freed (its free function called exactly once) when the last goes; the live
 * host bytes count every host storage while it lives; big uninitialised buffers
 * are 2 MiB-aligned mappings that a freed one of the same size is reused for; a
 * header retains its storage, views share it and its version counter, and a view
 * that would reach outside its storage is refused. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_check.h"

static int freed_calls;
static void *freed_data, *freed_ctx;
static void count_free(void *ctx, void *data) {
  freed_calls++;
  freed_ctx = ctx;
  freed_data = data;
  free(data);
}

static void refcounts(void) {
  int64_t live0 = rh_storage_live_bytes();
  rh_storage_t *s = rh_storage_new(24);
  CHECK(s && s->refcount == 1 && s->nbytes == 24 && s->device == RH_CPU && s->version == 0);
  CHECK(rh_storage_live_bytes() == live0 + 24);
  static const char zero[24];
  CHECK(memcmp(s->data, zero, 24) == 0); /* rh_storage_new zeroes */
  rh_storage_retain(s);
  CHECK(s->refcount == 2);
  rh_storage_release(s);
  CHECK(s->refcount == 1 && rh_storage_live_bytes() == live0 + 24);
  rh_storage_release(s);
  CHECK(rh_storage_live_bytes() == live0);
  rh_storage_release(NULL); /* a no-op */

  /* no bytes is still a storage with a valid pointer */
  rh_storage_t *e = rh_storage_new(0);
  CHECK(e && e->data != NULL && e->nbytes == 0);
  rh_storage_release(e);
  e = rh_storage_new_uninit(0);
  CHECK(e && e->data != NULL && e->nbytes == 0);
  rh_storage_release(e);

  /* wrapped memory: counted while it lives, given back once, on the last release */
  void *mem = malloc(40);
  int ctx;
  rh_storage_t *w = rh_storage_wrap(mem, 40, count_free, &ctx);
  CHECK(w && w->data == mem && w->refcount == 1 && w->device == RH_CPU);
  CHECK(rh_storage_live_bytes() == live0 + 40);
  rh_storage_retain(w);
  rh_storage_release(w);
  CHECK(freed_calls == 0);
  rh_storage_release(w);
  CHECK(freed_calls == 1 && freed_data == mem && freed_ctx == &ctx);
  CHECK(rh_storage_live_bytes() == live0);

  /* a host storage by device number; any other negative is refused */
  rh_storage_t *h = rh_storage_new_on(RH_CPU, 8);
  CHECK(h && h->device == RH_CPU && h->nbytes == 8);
  rh_storage_release(h);
  CHECK(rh_storage_new_on(-2, 8) == NULL && says("invalid device -2"));
}

/* the high-water mark and the largest allocation, as tensor.max_live_bytes() and
 * the GC trigger read them */
static void marks(void) {
  rh_storage_max_alloc(1);
  rh_storage_reset_peak();
  int64_t live0 = rh_storage_live_bytes();
  CHECK(rh_storage_peak_bytes() == live0);
  rh_storage_t *a = rh_storage_new(1000), *b = rh_storage_new(3000);
  rh_storage_release(a);
  rh_storage_release(b);
  CHECK(rh_storage_peak_bytes() == live0 + 4000);
  CHECK(rh_storage_max_alloc(0) == 3000);
  CHECK(rh_storage_max_alloc(1) == 3000 && rh_storage_max_alloc(0) == 0);
  rh_storage_reset_peak();
  CHECK(rh_storage_peak_bytes() == live0);
}

/* big uninitialised buffers: their own 2 MiB-aligned mappings, kept for reuse by size */
static void big_buffers(void) {
  size_t n = (size_t)6 << 20;
  int64_t live0 = rh_storage_live_bytes(), cached0 = rh_storage_cached_bytes();
  rh_storage_t *s = rh_storage_new_uninit(n);
  CHECK(s && s->uninit && ((uintptr_t)s->data & ((2u << 20) - 1)) == 0);
  CHECK(rh_storage_live_bytes() == live0 + (int64_t)n);
  memset(s->data, 7, n);
  void *p = s->data;
  rh_storage_release(s);
  CHECK(rh_storage_live_bytes() == live0);
  CHECK(rh_storage_cached_bytes() == cached0 + (int64_t)((size_t)6 << 20));
  rh_storage_t *again = rh_storage_new_uninit(n - 100); /* (rounds to the same 2 MiB multiple) */
  CHECK(again && again->data == p && rh_storage_cached_bytes() == cached0);
  rh_storage_release(again);
  /* below 4 MiB: the heap */
  rh_storage_t *small = rh_storage_new_uninit(1000);
  CHECK(small && small->uninit && small->nbytes == 1000);
  rh_storage_release(small);
}

static void headers(void) {
  int64_t live0 = rh_storage_live_bytes();
  rh_storage_t *s = rh_storage_new(12 * sizeof(float));
  /* a header retains its storage; releasing the header gives that reference back */
  rh_tensor_t *t = rh_tensor_on_storage(s, RH_F32, 0, 2, SHAPE(3, 4), SHAPE(4, 1));
  CHECK(t && t->refcount == 1 && s->refcount == 2 && rh_tensor_numel(t) == 12 && rh_tensor_is_contiguous(t));
  CHECK(rh_tensor_data(t) == s->data);
  rh_tensor_retain(t);
  CHECK(t->refcount == 2);
  rh_tensor_release(t);
  /* views share the storage (and so its version) */
  rh_tensor_t *tr = rh_tensor_transpose(t, 0, 1);
  rh_tensor_t *row = rh_tensor_select(t, 0, 2);
  CHECK(tr && row && tr->storage == s && row->storage == s && s->refcount == 4);
  CHECK(!rh_tensor_is_contiguous(tr) && tr->stride[0] == 1 && tr->stride[1] == 4);
  CHECK(row->offset == 8 && (char *)rh_tensor_data(row) == (char *)s->data + 8 * sizeof(float));
  rh_tensor_bump_version(row);
  CHECK(rh_tensor_version(t) == 1 && rh_tensor_version(tr) == 1);
  rh_tensor_set(tr, SHAPE(1, 2), 5.5); /* t[2][1] */
  CHECK(((float *)s->data)[9] == 5.5f && rh_tensor_get(row, SHAPE(1)) == 5.5);
  rh_tensor_release(tr);
  rh_tensor_release(row);
  rh_tensor_release(t);
  CHECK(s->refcount == 1);

  /* a view is refused when it would address past either end of its storage */
  CHECK(rh_tensor_on_storage(s, RH_F32, 1, 2, SHAPE(3, 4), SHAPE(4, 1)) == NULL && says("view out of bounds"));
  CHECK(rh_tensor_on_storage(s, RH_F64, 0, 1, SHAPE(7), SHAPE(1)) == NULL && says("(48 bytes)"));
  rh_tensor_t *back = rh_tensor_on_storage(s, RH_F32, 11, 1, SHAPE(12), SHAPE(-1)); /* reversed */
  CHECK(back != NULL);
  rh_tensor_release(back);
  CHECK(rh_tensor_on_storage(s, RH_F32, 10, 1, SHAPE(12), SHAPE(-1)) == NULL);
  /* no elements: any offset and strides */
  rh_tensor_t *none = rh_tensor_on_storage(s, RH_F32, 100, 2, SHAPE(0, 4), SHAPE(1000, 1));
  CHECK(none && rh_tensor_numel(none) == 0 && rh_tensor_is_contiguous(none));
  rh_tensor_release(none);
  rh_storage_release(s);

  /* an empty tensor's strides count a size 0 as 1; size-1 dims do not break contiguity */
  rh_tensor_t *z = rh_tensor_empty(RH_I64, 3, SHAPE(2, 0, 3));
  CHECK(z && z->stride[0] == 3 && z->stride[1] == 3 && z->stride[2] == 1 && rh_tensor_numel(z) == 0);
  CHECK(z && z->storage->nbytes == 0);
  rh_tensor_release(z);
  rh_storage_t *s1 = rh_storage_new(3 * sizeof(double));
  rh_tensor_t *odd = rh_tensor_on_storage(s1, RH_F64, 0, 3, SHAPE(1, 3, 1), SHAPE(99, 1, 7));
  CHECK(odd && rh_tensor_is_contiguous(odd));
  rh_tensor_release(odd);
  rh_storage_release(s1);
  /* element sizes and the bytes of a new tensor */
  static const size_t es[RH_NDTYPES] = {4, 8, 4, 8, 1, 1};
  for (int dt = 0; dt < RH_NDTYPES; dt++) {
    rh_tensor_t *x = rh_tensor_empty((rh_dtype_t)dt, 2, SHAPE(5, 3));
    CHECK(x && rh_dtype_size((rh_dtype_t)dt) == es[dt] && x->storage->nbytes == 15 * es[dt]);
    rh_tensor_release(x);
  }
  CHECK(rh_tensor_empty(RH_F32, 2, SHAPE(2, -1)) == NULL && says("negative size -1 in dimension 2"));
  CHECK(rh_storage_live_bytes() == live0);
}

int main(void) {
  int64_t live0 = rh_storage_live_bytes();
  refcounts();
  marks();
  big_buffers();
  headers();
  CHECK(rh_storage_live_bytes() == live0);
  return TEST_RESULT();
}
