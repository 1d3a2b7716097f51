/* shm.c: memfd segments (see shm.h). */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "tensor/tensor.h"

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#define MFD_ALLOW_SEALING 0x0002U
#endif

static size_t page_round(size_t n) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  return (n + pg - 1) / pg * pg;
}

static rh_shm_t *wrap(int fd, void *map, size_t size, int writable, int *err) {
  rh_shm_t *s = malloc(sizeof *s);
  if (!s) {
    if (map) munmap(map, size);
    if (fd >= 0) close(fd);
    *err = -ENOMEM;
    return NULL;
  }
  *s = (rh_shm_t){.fd = fd, .map = map, .size = size, .writable = writable, .refs = 1};
  return s;
}

static rh_shm_t *create(size_t size, int populate, int *err) {
  size = page_round(size ? size : 1);
  int fd = memfd_create("rpchost-payload", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *err = -errno;
    return NULL;
  }
  *err = 0;
  if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    *err = -errno;
  void *map = MAP_FAILED;
  /* pre-faulted: a segment is reused for many payloads, so its pages are made
   * once here instead of one fault at a time inside the first copy */
  if (!*err) map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (!*err && map == MAP_FAILED) *err = -errno;
  if (*err) {
    close(fd);
    return NULL;
  }
  return wrap(fd, map, size, 1, err);
}

rh_shm_t *rh_shm_create(size_t size, int *err) { return create(size, 1, err); }
rh_shm_t *rh_shm_create_sparse(size_t size, int *err) { return create(size, 0, err); }

rh_shm_t *rh_shm_attach(int fd, size_t need, uint64_t ino, char *why, size_t whylen, int *err) {
  struct stat st;
  int seals = fcntl(fd, F_GET_SEALS);
  const char *bad = NULL;
  *err = 0;
  if (fstat(fd, &st) != 0) *err = -errno, bad = "cannot stat the descriptor";
  else if (!S_ISREG(st.st_mode) || seals < 0) *err = -EINVAL, bad = "the descriptor is not a memory file";
  else if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    *err = -EPERM, bad = "the memory file is not sealed against resizing";
  else if ((uint64_t)st.st_ino != ino)
    *err = -EINVAL, bad = "the descriptor is not the segment its frame names (descriptors and frames out of step)";
  else if ((uint64_t)st.st_size < need) *err = -EINVAL, bad = "the memory file is smaller than the payload it carries";
  void *map = MAP_FAILED;
  /* not pre-faulted: the sender made the pages, and a sparse file from a peer
   * must not make this rank allocate its whole size */
  if (!*err && st.st_size > 0) {
    map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) *err = -errno, bad = "cannot map the memory file";
  }
  /* the mapping keeps the memory: the descriptor is not needed any more, and a
   * rank with many peers should not run out of them */
  close(fd);
  if (*err) {
    snprintf(why, whylen, "%s (%s)", bad, strerror(-*err));
    return NULL;
  }
  return wrap(-1, map == MAP_FAILED ? NULL : map, (size_t)st.st_size, 0, err);
}

void rh_shm_retain(rh_shm_t *s) { __atomic_add_fetch(&s->refs, 1, __ATOMIC_RELAXED); }

void rh_shm_release(rh_shm_t *s) {
  if (!s || __atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
  if (s->map) munmap(s->map, s->size);
  if (s->fd >= 0) close(s->fd);
  free(s);
}

uint64_t rh_shm_inode(const rh_shm_t *s) {
  struct stat st;
  return s->fd >= 0 && fstat(s->fd, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

int rh_shm_probe(void) {
  int err;
  rh_shm_t *s = rh_shm_create(1, &err);
  rh_shm_release(s);
  return s ? 0 : err;
}

/* Below two pieces a copy runs inline: handing work to the pool costs more. */
#define COPY_PIECE (2u << 20)

/* A payload is copied once on each side and read by another process (or much
 * later): stores that bypass the cache skip reading the destination lines first
 * and keep the caches for the work at hand (about 1.5x memcpy here for 16 MiB). */
static void stream_copy(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
  size_t head = (16 - ((uintptr_t)d & 15)) & 15;
  if (head > n) head = n;
  memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a);
    _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c);
    _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
#else
  memcpy(d, s, n);
#endif
}
typedef struct {
  char *dst;
  const char *src;
  size_t n;
  int stream;
} copy_job_t;

static void copy_chunk(void *vctx, int64_t lo, int64_t hi) {
  copy_job_t *j = vctx;
  size_t a = (size_t)lo * COPY_PIECE, b = (size_t)hi * COPY_PIECE;
  if (b > j->n) b = j->n;
  if (j->stream) stream_copy(j->dst + a, j->src + a, b - a);
  else memcpy(j->dst + a, j->src + a, b - a);
}

/* From half the last-level cache up, a payload would be evicted before the
 * other process reads it: stores that bypass the cache then save the reads of
 * the destination lines. Below, the reader on another core finds the bytes in
 * the shared cache: cached stores (a 4 MiB echo took 812 us with streaming
 * stores, the bytes going to memory and back, against a copy of 86 us). */
static size_t stream_min(void) {
  static size_t v = 0;
  if (!v) {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    v = l3 > 0 ? (size_t)l3 / 2 : (size_t)8 << 20;
    if (v < 2 * COPY_PIECE) v = 2 * COPY_PIECE;
  }
  return v;
}

void rh_copy_parallel(void *dst, const void *src, size_t n) {
  if (n < 2 * COPY_PIECE) {
    memcpy(dst, src, n);
    return;
  }
  copy_job_t j = {dst, src, n, n >= stream_min()};
  rh_parallel_for((int64_t)((n + COPY_PIECE - 1) / COPY_PIECE), 1, copy_chunk, &j);
}
