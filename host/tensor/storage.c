/* storage.c: refcounted byte buffers (rh_storage_t) and where they live: host
 * memory (malloc, or mappings of their own for big uninitialised buffers, with a
 * bounded cache of freed ones), memory wrapped from elsewhere (a received frame, a
 * shared-memory segment) and CUDA device memory (through device.c). It keeps the
 * count of live host bytes the Lua GC is fed with (Torch7's heap tracking).
 *
 * Depends on errmsg.c and device.c (device memory); knows nothing of
 * tensors: tensor.c puts headers over these buffers. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "tensor_internal.h"

static int64_t live_bytes, peak_bytes, max_alloc;

static void raise_to(int64_t *mark, int64_t v) {
  int64_t m = __atomic_load_n(mark, __ATOMIC_RELAXED);
  while (v > m && !__atomic_compare_exchange_n(mark, &m, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}

/* live_bytes += n, raising the high-water mark (what tensor.max_live_bytes() reports)
 * and the largest allocation since the GC trigger last looked (rh_storage_max_alloc) */
static void live_add(int64_t n) {
  raise_to(&max_alloc, n);
  raise_to(&peak_bytes, __atomic_add_fetch(&live_bytes, n, __ATOMIC_RELAXED));
}

/* Large buffers that are about to be written whole (received payloads, op
 * results) are mappings of their own on 2 MiB boundaries that ask for
 * transparent huge pages: 512x fewer page faults, and a peer's cross-memory
 * read walks and pins 512x fewer pages (16 MiB tensor round trips 8 -> 11
 * GiB/s). Their own mappings, not malloc's heap: a freed one goes back to the
 * system whole, where 2 MiB-aligned blocks freed into the heap fragmented it
 * (a BatchNorm2d loop grew to 6x its live set without the cache below).
 *
 * Freed ones are kept for reuse by size, up to HUGE_CACHE bytes: a fresh huge
 * page can be very slow to fault where a hypervisor reclaims free guest memory
 * (10x slower round trips after an idle pause were seen here), and tensors of
 * one shape come and go in a loop. The cache never raises the high-water mark:
 * a request it cannot serve first unmaps cached blocks until what is mapped
 * (in use + cached) plus the request fits under the most that was ever in use
 * at once, so a loop's peak is its live peak, as with PyTorch's munmap on free,
 * and its steady state still reuses what it freed. (Zeroed buffers keep calloc.) */
#define HUGE_MIN ((size_t)4 << 20)
#define HUGE_ALIGN ((size_t)2 << 20)
#define HUGE_CACHE ((size_t)256 << 20)
#define HUGE_SLOTS 32

static struct {
  pthread_mutex_t mu;
  void *ptr[HUGE_SLOTS];
  size_t len[HUGE_SLOTS];
  size_t total; /* bytes cached */
  size_t used;  /* bytes of big blocks handed out and not yet freed */
  size_t hwm;   /* the most that was ever in use at once */
} huge = {PTHREAD_MUTEX_INITIALIZER, {0}, {0}, 0, 0, 0};

static size_t huge_round(size_t n) { return (n + HUGE_ALIGN - 1) & ~(HUGE_ALIGN - 1); }

/* a fresh mapping of len bytes on a HUGE_ALIGN boundary (len is a multiple of it) */
static void *map_big(size_t len) {
  size_t span = len + HUGE_ALIGN;
  char *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  char *a = (char *)(((uintptr_t)p + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
  if (a > p) munmap(p, (size_t)(a - p));
  if (p + span > a + len) munmap(a + len, (size_t)(p + span - (a + len)));
  madvise(a, len, MADV_HUGEPAGE); /* a hint: failure is harmless */
  return a;
}

static void *alloc_uninit(size_t nbytes) {
  if (nbytes < HUGE_MIN) return malloc(nbytes ? nbytes : 1);
  size_t len = huge_round(nbytes);
  void *drop[HUGE_SLOTS];
  size_t drop_len[HUGE_SLOTS];
  int ndrop = 0;
  pthread_mutex_lock(&huge.mu);
  for (int i = 0; i < HUGE_SLOTS; i++) {
    if (huge.ptr[i] && huge.len[i] == len) {
      void *p = huge.ptr[i];
      huge.ptr[i] = NULL;
      huge.total -= len;
      huge.used += len;
      pthread_mutex_unlock(&huge.mu);
      return p;
    }
  }
  /* a miss: make room under the high-water mark by unmapping cached blocks */
  for (int i = 0; i < HUGE_SLOTS && huge.used + huge.total + len > huge.hwm; i++) {
    if (huge.ptr[i]) {
      drop[ndrop] = huge.ptr[i];
      drop_len[ndrop++] = huge.len[i];
      huge.total -= huge.len[i];
      huge.ptr[i] = NULL;
    }
  }
  huge.used += len;
  if (huge.used > huge.hwm) huge.hwm = huge.used;
  pthread_mutex_unlock(&huge.mu);
  for (int i = 0; i < ndrop; i++) munmap(drop[i], drop_len[i]);
  void *p = map_big(len);
  if (!p) {
    pthread_mutex_lock(&huge.mu);
    huge.used -= len;
    pthread_mutex_unlock(&huge.mu);
  }
  return p;
}

static void free_data(void *p, size_t nbytes) {
  if (nbytes < HUGE_MIN) {
    free(p);
    return;
  }
  size_t len = huge_round(nbytes);
  pthread_mutex_lock(&huge.mu);
  huge.used -= len;
  if (huge.total + len <= HUGE_CACHE) {
    for (int i = 0; i < HUGE_SLOTS; i++) {
      if (!huge.ptr[i]) {
        huge.ptr[i] = p;
        huge.len[i] = len;
        huge.total += len;
        pthread_mutex_unlock(&huge.mu);
        return;
      }
    }
  }
  pthread_mutex_unlock(&huge.mu);
  munmap(p, len);
}

/* Storages up to this size carry their bytes in the struct's own block: a
 * received message makes one per tensor, and so does nearly every small op (a
 * malloc and a free of ~100 ns each way saved). The bytes start at a 16-byte
 * boundary, as malloc's would. */
#define INLINE_MAX ((size_t)64 << 10)
#define INLINE_HEAD ((sizeof(rh_storage_t) + 15) & ~(size_t)15)

static rh_storage_t *storage_alloc(size_t nbytes, int zero) {
  rh_storage_t *s;
  if (nbytes <= INLINE_MAX) {
    s = zero ? calloc(1, INLINE_HEAD + nbytes) : malloc(INLINE_HEAD + nbytes);
    if (!s) {
      rh_tensor_fail("out of memory allocating %zu bytes", nbytes);
      return NULL;
    }
    s->data = (char *)s + INLINE_HEAD;
    s->inline_data = 1;
  } else {
    s = malloc(sizeof *s);
    if (!s) {
      rh_tensor_fail("out of memory allocating %zu bytes", nbytes);
      return NULL;
    }
    s->data = zero ? calloc(nbytes, 1) : alloc_uninit(nbytes);
    if (!s->data) {
      free(s);
      rh_tensor_fail("out of memory allocating %zu bytes", nbytes);
      return NULL;
    }
    s->inline_data = 0;
  }
  s->refcount = 1;
  s->nbytes = nbytes;
  s->free_fn = NULL;
  s->free_ctx = NULL;
  s->device = -1;
  s->uninit = !zero;
  s->version = 0;
  live_add((int64_t)nbytes);
  return s;
}

rh_storage_t *rh_storage_new(size_t nbytes) { return storage_alloc(nbytes, 1); }
rh_storage_t *rh_storage_new_uninit(size_t nbytes) { return storage_alloc(nbytes, 0); }

rh_storage_t *rh_storage_wrap(void *data, size_t nbytes, void (*free_fn)(void *, void *), void *ctx) {
  return rh__storage_wrap_on(-1, data, nbytes, free_fn, ctx);
}

rh_storage_t *rh__storage_wrap_on(int device, void *data, size_t nbytes, void (*free_fn)(void *, void *), void *ctx) {
  rh_storage_t *s = malloc(sizeof *s);
  if (!s) return NULL;
  s->refcount = 1;
  s->nbytes = nbytes;
  s->data = data;
  s->free_fn = free_fn;
  s->free_ctx = ctx;
  s->device = device;
  s->uninit = 0;
  s->version = 0;
  s->inline_data = 0;
  if (device < 0) live_add((int64_t)nbytes);
  return s;
}

void rh_storage_retain(rh_storage_t *s) { __atomic_add_fetch(&s->refcount, 1, __ATOMIC_RELAXED); }

void rh_storage_release(rh_storage_t *s) {
  if (!s || __atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) > 0) return;
  if (s->device < 0) __atomic_sub_fetch(&live_bytes, (int64_t)s->nbytes, __ATOMIC_RELAXED);
  if (s->inline_data) {
    /* (the bytes go with the struct) */
  } else if (s->free_fn) {
    s->free_fn(s->free_ctx, s->data);
  } else if (s->device < 0 && s->uninit) {
    free_data(s->data, s->nbytes);
  } else {
    free(s->data);
  }
  free(s);
}

/* ---- device storages */
static void device_free(void *ctx, void *data) {
  const rhc_api_t *api = rh_cuda_api(); /* loaded: this storage was allocated through it */
  if (api) api->free((int)(intptr_t)ctx, data);
}

rh_storage_t *rh_storage_new_on(int device, size_t nbytes) {
  if (rh__check_device(device)) return NULL;
  if (device == RH_CPU) return rh_storage_new_uninit(nbytes);
  const rhc_api_t *api = rh_cuda_api(); /* not NULL: the device was checked */
  void *p = NULL;
  if (api->alloc(device, nbytes, &p)) {
    rh_tensor_fail("%s", api->last_error());
    return NULL;
  }
  rh_storage_t *s = rh__storage_wrap_on(device, p, nbytes, device_free, (void *)(intptr_t)device);
  if (!s) api->free(device, p);
  return s;
}

int64_t rh_storage_live_bytes(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }
int64_t rh_storage_max_alloc(int reset) {
  return reset ? __atomic_exchange_n(&max_alloc, 0, __ATOMIC_RELAXED) : __atomic_load_n(&max_alloc, __ATOMIC_RELAXED);
}
int64_t rh_storage_peak_bytes(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }
void rh_storage_reset_peak(void) { __atomic_store_n(&peak_bytes, rh_storage_live_bytes(), __ATOMIC_RELAXED); }
int64_t rh_storage_cached_bytes(void) {
  pthread_mutex_lock(&huge.mu);
  int64_t n = (int64_t)huge.total;
  pthread_mutex_unlock(&huge.mu);
  return n;
}
