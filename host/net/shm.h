/* shm.h: shared-memory segments for large payloads between ranks on one host.
 *
 * A segment is an anonymous memory file (memfd) mapped by its creator for
 * writing. Its descriptor travels once over the Unix-domain socket to the peer
 * (SCM_RIGHTS, see rh_conn_send_fd), which maps it read-only; afterwards a
 * payload costs a copy in on one side and a copy out on the other, with no
 * socket buffers, no page faults (segments are reused) and no system call per
 * byte. The creator seals the file against shrinking and growing before it is
 * shared, so a peer's mapping can never lose pages under it (no SIGBUS), and an
 * attached descriptor that is not such a sealed file is refused. */
#ifndef RH_SHM_H
#define RH_SHM_H

#include <stddef.h>
#include <stdint.h>

/* Refcounted: the Lua object that names a segment holds one reference, and so
 * does every tensor that lives in it, so a mapping outlives whichever goes first. */
typedef struct rh_shm_s {
  int fd; /* -1 for a peer's segment: the mapping is all that is kept */
  void *map;
  size_t size;
  int writable; /* created here (ours to fill) */
  int refs;
} rh_shm_t;

/* A new sealed segment of `size` bytes (rounded up to pages), mapped and
 * pre-faulted. NULL with *err set (a negative errno) on failure. */
rh_shm_t *rh_shm_create(size_t size, int *err);
/* The same, not pre-faulted: pages are made as they are first touched (the
 * rings of a connection that carries little use a few of theirs). */
rh_shm_t *rh_shm_create_sparse(size_t size, int *err);
/* Maps a descriptor received from a peer, and closes it (on failure too). It
 * must be a memory file sealed against shrinking, at least `need` bytes long,
 * whose inode is `ino` (what the frame that announced it names).
 * The mapping is writable: tensors that live in a peer's segment (see
 * l_shm.c, adopt) are ordinary tensors. NULL with *err and why[] saying which
 * rule failed. */
rh_shm_t *rh_shm_attach(int fd, size_t need, uint64_t ino, char *why, size_t whylen, int *err);
/* The inode of one of our segments (its name in descriptors), 0 if unknown. */
uint64_t rh_shm_inode(const rh_shm_t *s);
void rh_shm_retain(rh_shm_t *s);
/* Drops a reference; the last one unmaps and closes. */
void rh_shm_release(rh_shm_t *s);
/* Whether memory files can be made here at all (0) or why not (negative errno). */
int rh_shm_probe(void);
/* memcpy that splits large copies across the tensor thread pool. */
void rh_copy_parallel(void *dst, const void *src, size_t n);

#endif
