/* atomic_file.c: saves that replace their target whole or not at all, and
 * reads into memory without an intermediate copy (atomic_file.h says what
 * each promises). One mechanism for every file rpchost writes for its user:
 * a checkpoint is the one thing a training job must never lose, and a killed
 * or failed save must leave the last good one where it was.
 *
 * Why each step: the temporary file sits in the target's directory so the
 * rename is within one file system (atomic); fallocate reserves the bytes up
 * front so a full disk fails before the first write and the message can say
 * how much was needed; writes are checked one by one (a short write is
 * retried, an error ends the save); writeback of what is written is started
 * as the save goes (sync_file_range), so the final fdatasync waits for the
 * tail only; the directory is synced after the rename so the new name itself
 * survives a power loss.
 *
 * Depends on the tensor core (its storages, narrow and device copies) and on
 * zlib's crc32; nothing here knows Lua. */
#include "io/atomic_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "rh.h"
#include "tensor/tensor.h"

/* the most one write, read or crc32 call handles at once (a crc'd chunk is
 * still in cache when it is written) */
#define CHUNK ((size_t)8 << 20)
/* how much is written before its writeback is started */
#define FLUSH_EVERY ((uint64_t)8 << 20)
/* the temporary file's name: "." name ".tmp-" host "-" pid "-" 8 hex digits */
#define TMP_TAG ".tmp-"
#define HOST_MAX 32

/* ---- messages */

static const char *err_name(int code) {
  if (code <= -5000) return "";
  const char *n = strerrorname_np(-code);
  return n ? n : "";
}

static const char *err_text(int code) { return code <= -5000 ? rh_strerror(code) : strerror(-code); }

/* "the save needs N bytes[ and M were free when it began]; " for the
 * message: N exactly, or at least what was written (up to the most it may
 * be), or up to that; nothing when no size is known */
static void need_clause(const rh_afile_t *f, uint64_t at_least, char *out, size_t len) {
  unsigned long long a = at_least, m = f->at_most;
  int n;
  *out = 0;
  if (f->expect) n = snprintf(out, len, "the save needs %llu bytes", (unsigned long long)f->expect);
  else if (a && m) n = snprintf(out, len, "the save needs at least %llu bytes (up to %llu)", a, m);
  else if (a) n = snprintf(out, len, "the save needs at least %llu bytes", a);
  else if (m) n = snprintf(out, len, "the save needs up to %llu bytes", m);
  else return;
  if (f->avail != UINT64_MAX && n > 0 && (size_t)n < len)
    n += snprintf(out + n, len - (size_t)n, " and %llu were free when it began", (unsigned long long)f->avail);
  if (n > 0 && (size_t)n < len) snprintf(out + n, len - (size_t)n, "; ");
}

/* Ends the save with a one-line message: "cannot save PATH: WHAT: ERROR (NAME);
 * the save needs N bytes ...; the old file is untouched". Returns code. */
static int fail(rh_afile_t *f, int code, uint64_t at_least, const char *fmt, ...) {
  char what[512], need[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  need_clause(f, at_least, need, sizeof need);
  const char *name = err_name(code);
  snprintf(f->msg, sizeof f->msg, "cannot save %s: %s: %s%s%s%s; %s%s", f->path ? f->path : "(no path)", what,
           err_text(code), *name ? " (" : "", name, *name ? ")" : "", need,
           f->existed ? "the old file is untouched" : "nothing was written there");
  rh_afile_abort(f);
  return code;
}

/* ---- names */

static char *dup_printf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
  if (!s) return NULL;
  va_start(ap, fmt);
  vsnprintf(s, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return s;
}

/* this host's name as it goes into temporary names: at most HOST_MAX bytes,
 * no '/' ('-' is fine: names are parsed from their end) */
static void host_tag(char *out, size_t len) {
  char h[256] = "";
  if (gethostname(h, sizeof h - 1) != 0 || !*h) snprintf(h, sizeof h, "host");
  size_t n = 0;
  for (const char *p = h; *p && n + 1 < len && n < HOST_MAX; p++) out[n++] = *p == '/' ? '_' : *p;
  out[n] = 0;
}

static uint32_t random_u32(void) {
  uint32_t r;
  if (getrandom(&r, sizeof r, GRND_NONBLOCK) == (ssize_t)sizeof r) return r;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint32_t)ts.tv_nsec ^ ((uint32_t)getpid() << 12);
}

/* The target with symbolic links followed (a save through "latest.npy ->
 * ck-100.npy" replaces ck-100.npy, as writing in place did), as a new string. */
static char *resolve_target(const char *path, int *existed) {
  struct stat st;
  *existed = lstat(path, &st) == 0;
  if (*existed && S_ISLNK(st.st_mode)) {
    char *real = realpath(path, NULL);
    if (real) return real;
    *existed = 0; /* (a dangling link: the new file replaces the link) */
  }
  return strdup(path);
}

/* splits path into its directory (a new string; "." for a bare name) and
 * its last component (pointing into path) */
static char *split_dir(const char *path, const char **name) {
  const char *slash = strrchr(path, '/');
  if (!slash) {
    *name = path;
    return strdup(".");
  }
  *name = slash + 1;
  if (slash == path) return strdup("/");
  return strndup(path, (size_t)(slash - path));
}

/* ".NAME.tmp-" with NAME cut so that a whole temporary name fits NAME_MAX */
static char *tmp_prefix(const char *name, const char *host) {
  size_t room = NAME_MAX - (1 + strlen(TMP_TAG) + strlen(host) + 1 + 10 + 1 + 8);
  size_t n = strlen(name);
  return dup_printf(".%.*s" TMP_TAG, (int)(n < room ? n : room), name);
}

/* ---- leftovers of killed saves */

/* Whether entry (a name in the directory that starts with prefix) is a
 * temporary file of a save on this host whose process is gone. */
static int dead_leftover(const char *entry, const char *prefix, const char *host) {
  const char *rest = entry + strlen(prefix);
  const char *rnd = strrchr(rest, '-');
  if (!rnd || strlen(rnd + 1) != 8 || strspn(rnd + 1, "0123456789abcdef") != 8) return 0;
  const char *pid_at = rnd;
  while (pid_at > rest && pid_at[-1] >= '0' && pid_at[-1] <= '9') pid_at--;
  if (pid_at == rnd || pid_at == rest || pid_at[-1] != '-' || rnd - pid_at > 10) return 0;
  size_t hlen = (size_t)(pid_at - 1 - rest);
  if (hlen != strlen(host) || memcmp(rest, host, hlen) != 0) return 0;
  long pid = strtol(pid_at, NULL, 10);
  if (pid <= 0 || pid > INT_MAX) return 0;
  return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* Removes dead saves' temporary files for this target (best effort: a
 * leftover that cannot be removed now is tried again by the next save). */
static void sweep(const char *dir, const char *prefix, const char *host) {
  DIR *d = opendir(dir);
  if (!d) return;
  size_t plen = strlen(prefix);
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, prefix, plen) != 0 || !dead_leftover(e->d_name, prefix, host)) continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
      unlinkat(dirfd(d), e->d_name, 0);
  }
  closedir(d);
}

/* ---- opening */

/* free bytes for this process on fd's file system (root may use the reserve) */
static uint64_t free_bytes(int fd) {
  struct statvfs sv;
  if (fstatvfs(fd, &sv) != 0) return UINT64_MAX;
  return (uint64_t)(geteuid() == 0 ? sv.f_bfree : sv.f_bavail) * sv.f_frsize;
}

/* Creates the temporary file beside the target (a fresh name each try). */
static int create_tmp(rh_afile_t *f, const char *dir, const char *prefix, const char *host, int mode) {
  for (int tries = 0; tries < 8; tries++) {
    free(f->tmp);
    f->tmp = dup_printf("%s/%s%s-%d-%08x", dir, prefix, host, (int)getpid(), random_u32());
    if (!f->tmp) return -ENOMEM;
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode < 0 ? 0666 : mode);
    if (f->fd >= 0) return 0;
    if (errno != EEXIST) return -errno;
  }
  return -EEXIST;
}

/* The permission bits the new file gets: mode when given, else the old
 * file's (a private checkpoint stays private); -1: the umask's default. */
static int wanted_mode(const rh_afile_t *f, int mode) {
  struct stat st;
  if (mode >= 0) return mode & 07777;
  if (f->existed && stat(f->path, &st) == 0) return (int)(st.st_mode & 07777);
  return -1;
}

/* Reserves the bytes the save will write (kept at size 0: the file grows as
 * it is written), so a full disk fails before anything is written. */
static int reserve(rh_afile_t *f) {
  if (!f->expect) return 0;
  if (fallocate(f->fd, FALLOC_FL_KEEP_SIZE, 0, (off_t)f->expect) == 0) {
    f->reserved = f->expect;
    return 0;
  }
  int e = errno;
  if (e == EOPNOTSUPP || e == ENOSYS || e == EINVAL) return 0; /* (the writes are checked anyway) */
  return fail(f, -e, 0, "reserving %llu bytes in %s failed", (unsigned long long)f->expect, f->tmp);
}

/* The old file's cached pages are of no use once the save replaces it:
 * dropped now (clean ones only), the new file's pages take their place
 * instead of doubling the page cache, and reuse memory the kernel has at
 * hand (fresh memory is slow to touch in a VM whose host reclaims it: the
 * first 256 MiB save in a process went from 0.6 s to 0.15 s here). */
static void drop_old_cache(rh_afile_t *f) {
  if (!f->existed) return;
  int fd = open(f->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

int rh_afile_open(rh_afile_t *f, const char *path, const rh_afile_opts_t *opts) {
  static const rh_afile_opts_t none = {0, 0, 0};
  if (!opts) opts = &none;
  memset(f, 0, sizeof *f);
  f->fd = -1;
  f->expect = opts->size;
  f->at_most = opts->size_max;
  int mode = opts->mode > 0 ? opts->mode : -1;
  f->avail = UINT64_MAX;
  f->state = RH_AFILE_OPEN;
  f->path = resolve_target(path, &f->existed);
  if (!f->path) return fail(f, -ENOMEM, 0, "out of memory");
  const char *name;
  char host[HOST_MAX + 1];
  host_tag(host, sizeof host);
  char *dir = split_dir(f->path, &name);
  char *prefix = dir && *name ? tmp_prefix(name, host) : NULL;
  int rc = !dir ? -ENOMEM : !*name ? -EISDIR : !prefix ? -ENOMEM : 0;
  if (rc == 0) {
    sweep(dir, prefix, host);
    int m = wanted_mode(f, mode);
    rc = create_tmp(f, dir, prefix, host, m);
    if (rc == 0 && m >= 0 && fchmod(f->fd, (mode_t)m) != 0) rc = -errno;
  }
  if (rc) rc = fail(f, rc, 0, "cannot create a temporary file in %s", dir ? dir : ".");
  free(dir);
  free(prefix);
  if (rc) return rc;
  f->avail = free_bytes(f->fd);
  drop_old_cache(f);
  return reserve(f);
}

/* ---- writing */

static int check_open(rh_afile_t *f) {
  if (f->state == RH_AFILE_OPEN) return 0;
  snprintf(f->msg, sizeof f->msg, "the save is already %s", f->state == RH_AFILE_COMMITTED ? "committed" : "over");
  return -EBADF;
}

/* Starts writeback of what was written since the last time (the final sync
 * then waits for the tail only); errors surface at that sync. */
static void start_writeback(rh_afile_t *f) {
  if (f->offset - f->flushed < FLUSH_EVERY) return;
  sync_file_range(f->fd, (off_t)f->flushed, (off_t)(f->offset - f->flushed), SYNC_FILE_RANGE_WRITE);
  f->flushed = f->offset;
}

/* writes n bytes at off whole (short writes retried) */
static int pwrite_all(int fd, uint64_t off, const char *p, size_t n, size_t *done) {
  *done = 0;
  while (*done < n) {
    ssize_t w = pwrite(fd, p + *done, n - *done, (off_t)(off + *done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -errno;
    if (w == 0) return -EIO;
    *done += (size_t)w;
  }
  return 0;
}

/* appends n bytes, continuing *crc over them when crc is not NULL */
static int append(rh_afile_t *f, const char *p, size_t n, uint32_t *crc) {
  while (n) {
    size_t k = n < CHUNK ? n : CHUNK, done;
    if (crc) *crc = (uint32_t)crc32_z(*crc, (const unsigned char *)p, k);
    int rc = pwrite_all(f->fd, f->offset, p, k, &done);
    if (rc)
      return fail(f, rc, f->offset + k, "writing %s failed at byte %llu", f->tmp,
                  (unsigned long long)(f->offset + done));
    f->offset += k;
    p += k;
    n -= k;
    start_writeback(f);
  }
  return 0;
}

int rh_afile_write(rh_afile_t *f, const void *buf, size_t n) {
  int rc = check_open(f);
  return rc ? rc : append(f, buf, n, NULL);
}

int rh_afile_write_at(rh_afile_t *f, uint64_t off, const void *buf, size_t n) {
  int rc = check_open(f);
  if (rc) return rc;
  if (off > f->offset || n > f->offset - off)
    return fail(f, -EINVAL, f->offset, "rewriting bytes [%llu, %llu) that were not written yet (the file has %llu)",
                (unsigned long long)off, (unsigned long long)(off + n), (unsigned long long)f->offset);
  size_t done;
  rc = pwrite_all(f->fd, off, buf, n, &done);
  if (rc) return fail(f, rc, f->offset, "rewriting %s at byte %llu failed", f->tmp, (unsigned long long)off);
  return 0;
}

static size_t tensor_nbytes(const rh_tensor_t *t) { return (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype); }

/* a contiguous host copy of t (a new reference), or NULL with the message set */
static rh_tensor_t *host_copy(rh_afile_t *f, rh_tensor_t *t) {
  rh_tensor_t *h = rh_tensor_to_device(t, -1);
  rh_tensor_t *c = h ? rh_tensor_contiguous(h) : NULL;
  rh_tensor_release(h);
  if (!c) fail(f, RH_ENOMEM, f->offset, "copying a piece of the tensor to host memory failed (%s)", rh_tensor_errmsg());
  return c;
}

/* Writes t: straight from its storage when it is one host span, else in
 * slabs along its first dimension of more than one element, each at most
 * RH_AFILE_PIECE bytes once copied (or split further). */
static int write_piece(rh_afile_t *f, rh_tensor_t *t, uint32_t *crc) {
  size_t nbytes = tensor_nbytes(t);
  if (nbytes == 0) return 0;
  if (rh_tensor_device(t) < 0 && rh_tensor_is_contiguous(t)) return append(f, rh_tensor_data(t), nbytes, crc);
  if (nbytes <= RH_AFILE_PIECE) {
    rh_tensor_t *c = host_copy(f, t);
    if (!c) return RH_ENOMEM;
    int rc = append(f, rh_tensor_data(c), nbytes, crc);
    rh_tensor_release(c);
    return rc;
  }
  int d = 0;
  while (t->size[d] == 1) d++; /* (some dimension is above 1: nbytes > one element) */
  int64_t per = (int64_t)(nbytes / (size_t)t->size[d]);
  int64_t k = per >= (int64_t)RH_AFILE_PIECE ? 1 : (int64_t)RH_AFILE_PIECE / per;
  for (int64_t i = 0; i < t->size[d]; i += k) {
    rh_tensor_t *p = rh_tensor_narrow(t, d, i, t->size[d] - i < k ? t->size[d] - i : k);
    if (!p) return fail(f, RH_ENOMEM, f->offset, "taking a piece of the tensor failed (%s)", rh_tensor_errmsg());
    int rc = write_piece(f, p, crc);
    rh_tensor_release(p);
    if (rc) return rc;
  }
  return 0;
}

int rh_afile_write_tensor(rh_afile_t *f, rh_tensor_t *t, uint32_t *crc) {
  int rc = check_open(f);
  return rc ? rc : write_piece(f, t, crc);
}

/* ---- committing */

/* syncs the directory holding path (a file system that cannot sync
 * directories says EINVAL: nothing more can be done there) */
static int sync_dir(const char *path) {
  const char *name;
  char *dir = split_dir(path, &name);
  if (!dir) return -ENOMEM;
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  free(dir);
  if (fd < 0) return -errno;
  int rc = fsync(fd) == 0 || errno == EINVAL ? 0 : -errno;
  close(fd);
  return rc;
}

int rh_afile_commit(rh_afile_t *f) {
  int rc = check_open(f);
  if (rc) return rc;
  if (f->reserved > f->offset && ftruncate(f->fd, (off_t)f->offset) != 0)
    return fail(f, -errno, f->offset, "releasing the unused reservation of %s failed", f->tmp);
  if (fdatasync(f->fd) != 0) return fail(f, -errno, f->offset, "syncing %s to disk failed", f->tmp);
  int fd = f->fd;
  f->fd = -1;
  if (close(fd) != 0) return fail(f, -errno, f->offset, "closing %s failed", f->tmp);
  if (rename(f->tmp, f->path) != 0) return fail(f, -errno, f->offset, "renaming %s over it failed", f->tmp);
  f->state = RH_AFILE_COMMITTED;
  rc = sync_dir(f->path);
  if (rc)
    snprintf(f->msg, sizeof f->msg,
             "%s was replaced, but syncing its directory failed: %s: the new file may not survive a power loss",
             f->path, err_text(rc));
  rh_afile_abort(f); /* (frees the names) */
  return rc;
}

void rh_afile_abort(rh_afile_t *f) {
  if (f->state == RH_AFILE_OPEN) {
    if (f->fd >= 0) close(f->fd);
    if (f->tmp) unlink(f->tmp);
    f->state = RH_AFILE_ABORTED;
  }
  f->fd = -1;
  free(f->path);
  free(f->tmp);
  f->path = f->tmp = NULL;
}

/* ---- reading */

int rh_afile_read(int fd, uint64_t off, void *buf, size_t n, uint32_t *crc) {
  char *p = buf;
  while (n) {
    ssize_t r = pread(fd, p, n < CHUNK ? n : CHUNK, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r == 0) return RH_ETRUNCATED;
    if (crc) *crc = (uint32_t)crc32_z(*crc, (const unsigned char *)p, (size_t)r);
    p += r;
    off += (uint64_t)r;
    n -= (size_t)r;
  }
  return 0;
}

/* reverses the bytes of each es-byte element of p */
static void byteswap(unsigned char *p, size_t n, size_t es) {
  for (size_t i = 0; i + es <= n; i += es)
    for (size_t a = 0, b = es - 1; a < b; a++, b--) {
      unsigned char c = p[i + a];
      p[i + a] = p[i + b];
      p[i + b] = c;
    }
}

/* ---- mapping */

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* (Linux 5.14; older kernels say EINVAL: the pages then map as they are touched) */
#endif

typedef struct {
  void *base;
  size_t len;
} mapping_t;

static void unmap_storage(void *ctx, void *data) {
  mapping_t *m = ctx;
  (void)data;
  munmap(m->base, m->len);
  free(m);
}

int rh_afile_map_tensor(int fd, uint64_t off, int dtype, int ndim, const int64_t *size, rh_tensor_t **out) {
  int64_t numel, stride[RH_MAXDIM];
  *out = NULL;
  if (ndim < 0 || ndim > RH_MAXDIM || rh_shape_numel(ndim, size, &numel)) return -EINVAL;
  size_t n = (size_t)numel * rh_dtype_size((rh_dtype_t)dtype);
  if (n == 0 || off % 64) return -EINVAL;
  uint64_t base = off - off % (uint64_t)sysconf(_SC_PAGESIZE);
  mapping_t *m = malloc(sizeof *m);
  if (!m) return -ENOMEM;
  m->len = (size_t)(off - base) + n;
  m->base = mmap(NULL, m->len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, (off_t)base);
  if (m->base == MAP_FAILED) {
    free(m);
    return -errno;
  }
  madvise(m->base, m->len, MADV_POPULATE_READ); /* (the page tables at once, from the page cache) */
  rh_storage_t *s = rh_storage_wrap((char *)m->base + (off - base), n, unmap_storage, m);
  if (!s) {
    unmap_storage(m, NULL);
    return -ENOMEM;
  }
  for (int d = ndim - 1; d >= 0; d--) stride[d] = d == ndim - 1 ? 1 : stride[d + 1] * size[d + 1];
  *out = rh_tensor_on_storage(s, (rh_dtype_t)dtype, 0, ndim, size, stride);
  rh_storage_release(s); /* (the tensor holds it, or it is gone) */
  return *out ? 0 : -ENOMEM;
}

/* A big read in parts, one per CHUNK, spread over the tensor thread pool: the
 * kernel's copy out of the page cache and the faults of fresh pages are most
 * of a load's time, and each thread does its share of both (a part's CRC is
 * computed by its thread and the parts' combined in order, crc32_combine). */
typedef struct {
  int fd;
  uint64_t off;
  char *dst;
  size_t n;
  uint32_t *crcs; /* one per part, or NULL */
  int rc;         /* the first error (any part's) */
} pread_job_t;

static void pread_parts(void *ctx, int64_t lo, int64_t hi) {
  pread_job_t *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    size_t at = (size_t)i * CHUNK, len = j->n - at < CHUNK ? j->n - at : CHUNK;
    uint32_t c = 0;
    int rc = rh_afile_read(j->fd, j->off + at, j->dst + at, len, j->crcs ? &c : NULL);
    if (j->crcs) j->crcs[i] = c;
    if (rc) __atomic_compare_exchange_n(&j->rc, &(int){0}, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
}

static int read_parallel(int fd, uint64_t off, char *dst, size_t n, uint32_t *crc) {
  int64_t parts = (int64_t)((n + CHUNK - 1) / CHUNK);
  if (parts < 2 || rh_parallel_threads() < 2) return rh_afile_read(fd, off, dst, n, crc);
  pread_job_t j = {fd, off, dst, n, NULL, 0};
  if (crc && !(j.crcs = malloc(sizeof *j.crcs * (size_t)parts))) return -ENOMEM;
  rh_parallel_for(parts, 1, pread_parts, &j);
  if (!j.rc && crc)
    for (int64_t i = 0; i < parts; i++) {
      size_t at = (size_t)i * CHUNK, len = n - at < CHUNK ? n - at : CHUNK;
      *crc = (uint32_t)crc32_combine(*crc, j.crcs[i], (z_off_t)len);
    }
  free(j.crcs);
  return j.rc;
}

int rh_afile_read_tensor(int fd, uint64_t off, rh_tensor_t *t, uint32_t *crc, int swap) {
  if (rh_tensor_device(t) >= 0 || !rh_tensor_is_contiguous(t)) return -EINVAL;
  size_t n = tensor_nbytes(t);
  if (n >= CHUNK) posix_fadvise(fd, (off_t)off, (off_t)n, POSIX_FADV_SEQUENTIAL);
  int rc = read_parallel(fd, off, rh_tensor_data(t), n, crc);
  if (rc) return rc;
  if (swap && rh_dtype_size(t->dtype) > 1) byteswap(rh_tensor_data(t), n, rh_dtype_size(t->dtype));
  rh_tensor_bump_version(t);
  return 0;
}
