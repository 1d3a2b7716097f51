/* atomic_file.h: files replaced whole or not at all, written straight from
 * tensors and read straight into them. Every save of a user's data in rpchost
 * (tensor.save, nn.save, traces, the error file, shipped scripts, the world
 * secret) goes through here; the Lua face is rpchost.atomic_file.
 *
 * A save writes a temporary file beside its target, named
 * ".<name>.tmp-<host>-<pid>-<random>", checks every write, and on commit
 * syncs its data, renames it over the target and syncs the directory: a crash
 * at any instant leaves the old file or the new one, complete, and a
 * failure (a full disk, EIO, no permission) removes the temporary file, leaves
 * the old file untouched and says in one line what failed, where, and how many
 * bytes the save needed. Opening a save clears the temporary files that
 * earlier saves to the same path left when their process died (this host's,
 * whose pid is gone), so a killed save leaves nothing behind for long.
 *
 *   rh_afile_t f;
 *   rh_afile_opts_t o = {.size = header_len + data_len};
 *   if (rh_afile_open(&f, "ck.npy", &o) ||
 *       rh_afile_write(&f, header, header_len) || rh_afile_write_tensor(&f, t, NULL) ||
 *       rh_afile_commit(&f))
 *     fprintf(stderr, "%s\n", f.msg);   // the temporary file is already gone
 *   rh_afile_abort(&f);                  // (frees what open allocated; harmless after commit)
 *
 * Functions return 0 or a negative code (-errno, or an RH_E* code); on failure
 * f->msg holds the line and the save is over (aborted). Reads: rh_afile_read
 * and rh_afile_read_tensor fill memory or a tensor's storage from a byte range
 * of a file, without an intermediate copy. */
#ifndef RH_ATOMIC_FILE_H
#define RH_ATOMIC_FILE_H

#include <stddef.h>
#include <stdint.h>

struct rh_tensor_s;

enum { RH_AFILE_OPEN = 1, RH_AFILE_COMMITTED, RH_AFILE_ABORTED };

typedef struct {
  int state;         /* 0 (never opened), or one of the RH_AFILE_* above */
  int fd;            /* the temporary file while open, else -1 */
  int existed;       /* whether the target existed when the save began */
  char *path;        /* the target, symbolic links followed (owned) */
  char *tmp;         /* the temporary file beside it (owned) */
  uint64_t offset;   /* bytes written so far: the temporary file's size */
  uint64_t expect;   /* the bytes the caller said it would write (0: not said) */
  uint64_t at_most;  /* the most it said it could write (0: not said), for messages */
  uint64_t avail;    /* bytes free for this process where the save began */
  uint64_t flushed;  /* where background writeback was last started */
  uint64_t reserved; /* bytes reserved with fallocate (0 when it is not supported) */
  char msg[1024];    /* the last failure, one line */
} rh_afile_t;

/* What a save may be told when it starts (all zero: nothing). */
typedef struct {
  uint64_t size;     /* the bytes it will write: reserved up front, so a full disk fails before any write */
  uint64_t size_max; /* or the most it may write (a compressed save), named in messages only */
  int mode;          /* permission bits; 0: the old file's, else 0666 less the umask */
} rh_afile_opts_t;

/* Starts a save to path: clears dead saves' leftovers, creates the temporary
 * file and reserves opts->size bytes (opts may be NULL). */
int rh_afile_open(rh_afile_t *f, const char *path, const rh_afile_opts_t *opts);
/* Appends n bytes. */
int rh_afile_write(rh_afile_t *f, const void *buf, size_t n);
/* Overwrites n bytes already written at off (a header patched once the data
 * behind it is known): off + n must not pass the offset. */
int rh_afile_write_at(rh_afile_t *f, uint64_t off, const void *buf, size_t n);
/* Appends t's elements in logical order (any layout, host or device): a
 * contiguous host tensor straight from its storage, anything else through
 * copies of at most RH_AFILE_PIECE bytes. When crc is not NULL it is
 * continued (zlib's crc32) over the bytes written. */
int rh_afile_write_tensor(rh_afile_t *f, struct rh_tensor_s *t, uint32_t *crc);
/* Syncs the data, renames the temporary file over the target, syncs the
 * directory. */
int rh_afile_commit(rh_afile_t *f);
/* Ends a save that is not committed (removing its temporary file) and frees
 * what open allocated; harmless on a committed, aborted or unopened one. */
void rh_afile_abort(rh_afile_t *f);

/* the most a non-contiguous or device tensor is copied by at once */
#define RH_AFILE_PIECE ((size_t)4 << 20)

/* Reads n bytes at off of fd into buf (continuing *crc over them when crc is
 * not NULL). RH_ETRUNCATED when the file ends first. */
int rh_afile_read(int fd, uint64_t off, void *buf, size_t n, uint32_t *crc);
/* Fills the contiguous host tensor t with its bytes from off of fd; byteswap:
 * the file holds them in the other byte order. */
int rh_afile_read_tensor(int fd, uint64_t off, struct rh_tensor_s *t, uint32_t *crc, int byteswap);
/* A new host tensor of that dtype and shape over the file's bytes at off,
 * mapped copy-on-write (writes to it never reach the file; its pages are the
 * page cache's until written): no allocation and no copy. -EINVAL when off is
 * not a multiple of 64 (the kernels' alignment) or there are no bytes: read
 * instead. The mapping lives as long as the tensor's storage; a program that
 * truncates or rewrites the file in place meanwhile changes it, or faults. */
int rh_afile_map_tensor(int fd, uint64_t off, int dtype, int ndim, const int64_t *size, struct rh_tensor_s **out);

#endif
