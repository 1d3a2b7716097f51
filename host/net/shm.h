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

typedef struct {
  int fd;
  void *map;
  size_t size;
  int writable; /* ours (created here) or a peer's (attached read-only) */
} rh_shm_t;

/* A new sealed segment of `size` bytes (rounded up to pages), mapped and
 * pre-faulted. Returns 0 or a negative errno. */
int rh_shm_create(rh_shm_t *s, size_t size);
/* Maps a descriptor received from a peer read-only, and closes it (on failure
 * too; the mapping is all that is kept, s->fd is -1). It must be a memory file
 * sealed against shrinking, at least `need` bytes long. Returns 0, or a negative
 * errno with why[] saying which rule failed. */
int rh_shm_attach(rh_shm_t *s, int fd, size_t need, char *why, size_t whylen);
void rh_shm_free(rh_shm_t *s);
/* Whether memory files can be made here at all (0) or why not (negative errno). */
int rh_shm_probe(void);
/* memcpy that splits large copies across the tensor thread pool. */
void rh_copy_parallel(void *dst, const void *src, size_t n);

#endif
