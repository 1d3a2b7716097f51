/* test_shm.c: memfd segments (what a receiver accepts and refuses) and file
 * descriptors passed with frames over a real Unix-domain connection. */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/conn.h"
#include "net/shm.h"
#include "test_check.h"

static int attach_fails_with(int fd, size_t need, uint64_t ino, const char *words) {
  char why[160] = "";
  int err = 0;
  rh_shm_t *s = rh_shm_attach(fd, need, ino, why, sizeof why, &err);
  rh_shm_release(s);
  return !s && err != 0 && strstr(why, words) != NULL;
}

static void segments(void) {
  char why[160];
  int err;
  CHECK(rh_shm_probe() == 0);
  rh_shm_t *a = rh_shm_create(10000, &err), *b;
  CHECK(a && a->size >= 10000 && a->writable && a->refs == 1);
  if (!a) return;
  memset(a->map, 0x5a, a->size);
  /* the peer's view: the same bytes, no descriptor kept */
  uint64_t ino = rh_shm_inode(a);
  CHECK(ino != 0);
  b = rh_shm_attach(dup(a->fd), 10000, ino, why, sizeof why, &err);
  CHECK(b && !b->writable && b->size == a->size && b->fd < 0);
  if (!b) return;
  CHECK(((unsigned char *)b->map)[9999] == 0x5a);
  ((unsigned char *)a->map)[5] = 7;
  CHECK(((unsigned char *)b->map)[5] == 7);
  /* a reference keeps the mapping after its first owner lets go */
  rh_shm_retain(b);
  rh_shm_release(b);
  CHECK(((unsigned char *)b->map)[5] == 7);
  rh_shm_release(b);
  /* refused: a payload larger than the file, a pipe, a file that may shrink */
  CHECK(attach_fails_with(dup(a->fd), a->size + 1, ino, "smaller than the payload"));
  /* a descriptor that is not the one its frame names: out of step */
  CHECK(attach_fails_with(dup(a->fd), 1, ino + 1, "out of step"));
  int p[2];
  CHECK(pipe(p) == 0);
  CHECK(attach_fails_with(p[0], 1, 0, "not a memory file"));
  close(p[1]);
  int loose = memfd_create("loose", MFD_CLOEXEC);
  CHECK(loose >= 0 && ftruncate(loose, 4096) == 0);
  CHECK(attach_fails_with(loose, 1, 0, "not sealed"));
  /* the creator's seals hold: the file cannot shrink under a reader */
  CHECK(ftruncate(a->fd, 0) != 0);
  rh_shm_release(a);
  /* copies split across threads land whole */
  size_t n = (9u << 20) + 13;
  char *src = malloc(n), *dst = malloc(n);
  for (size_t i = 0; i < n; i++) src[i] = (char)(i * 31 + 7);
  rh_copy_parallel(dst, src, n);
  CHECK(memcmp(src, dst, n) == 0);
  free(src);
  free(dst);
}

/* ---- a frame with a descriptor, through a listener and a connection ---- */
static rh_conn_t *server_side;
static int got_frames, got_fd_ok, sent_fd;

static void on_frame(rh_conn_t *c, const rh_frame_t *f) {
  got_frames++;
  if (f->hdr.type == 9) {
    int fd = rh_conn_take_fd(c);
    struct stat a, b;
    got_fd_ok = fd >= 0 && fstat(fd, &a) == 0 && fstat(sent_fd, &b) == 0 && a.st_ino == b.st_ino;
    if (fd >= 0) close(fd);
    CHECK(rh_conn_take_fd(c) == -1); /* one descriptor per frame that sent one */
  }
  if (got_frames == 3) rh_conn_close(c, 0);
}
static void on_close(rh_conn_t *c, int status, int v) { (void)c, (void)status, (void)v; }
static void on_connect(rh_conn_t *c, int status) {
  CHECK(status == 0);
  const char *body = "x";
  uv_buf_t seg = uv_buf_init((char *)"payload", 7);
  CHECK(rh_conn_send(c, 8, 0, 1, body, 1, NULL, 0, NULL, NULL) == 0);
  CHECK(rh_conn_send_fd(c, sent_fd, 9, 0, 2, body, 1, &seg, 1, NULL, NULL) == 0);
  CHECK(rh_conn_send(c, 8, 0, 3, body, 1, NULL, 0, NULL, NULL) == 0);
  rh_conn_close(c, 1);
}
static void on_accept(rh_listener_t *l, rh_conn_t *c) {
  server_side = c;
  rh_conn_prove(c); /* (no handshake in this test: the peer counts as proven) */
  rh_listener_close(l);
}

static void passing(void) {
  uv_loop_t loop;
  rh_net_t net;
  uv_loop_init(&loop);
  CHECK(rh_net_init(&net, &loop, 1 << 20, RH_PROTOCOL_VERSION) == 0);
  int err;
  rh_shm_t *seg = rh_shm_create(4096, &err);
  CHECK(seg != NULL);
  if (!seg) return;
  sent_fd = seg->fd;
  char path[64];
  snprintf(path, sizeof path, "/tmp/rh-test-shm-%d.sock", (int)getpid());
  rh_conn_cbs_t cbs = {on_frame, on_close, on_connect};
  rh_listener_t *l = rh_listener_new_local(&net, &cbs, on_accept, NULL);
  CHECK(rh_listener_bind_local(l, path, 8) == 0);
  rh_conn_t *c = rh_conn_new_local(&net, &cbs, NULL);
  CHECK(rh_conn_connect_local(c, path) == 0);
  /* a TCP connection cannot carry descriptors: refused, not silently dropped */
  rh_conn_t *tcp = rh_conn_new(&net, &cbs, NULL);
  CHECK(rh_conn_send_fd(tcp, sent_fd, 9, 0, 1, "x", 1, NULL, 0, NULL, NULL) == UV_EINVAL);
  rh_conn_close(tcp, 0);
  for (int i = 0; i < 2000 && got_frames < 3; i++) uv_run(&loop, UV_RUN_ONCE);
  CHECK(got_frames == 3);
  CHECK(got_fd_ok);
  rh_net_close(&net);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  rh_shm_release(seg);
  unlink(path);
}

int main(void) {
  segments();
  passing();
  return TEST_RESULT();
}
