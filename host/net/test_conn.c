/* test_conn.c: framed connections over a real loopback socket. Segments larger
 * than one write's buffer (1 GiB in use, lowered here to a few KiB so the test
 * is cheap) are split into several buffers and arrive intact, in order, with
 * the frames after them; a frame larger than the frame limit is refused before
 * a byte is queued, and the connection goes on. The loop closes cleanly. */
#include <stdlib.h>
#include <string.h>

#include "net/conn.h"
#include "test_check.h"

#define SPLIT 4099                 /* an odd size: buffers end mid-element */
#define BIG (3u * 1024 * 1024 + 5) /* past what one try_write takes: uv_write gets the rest */

static uv_loop_t loop;
static rh_net_t net;
static rh_listener_t *lis;
static rh_conn_t *server_side;
static int frames, bad_frames, closes;
static uint8_t *big, *small;

static void fill(uint8_t *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
}

static void on_frame(rh_conn_t *c, const rh_frame_t *f) {
  (void)c;
  frames++;
  int ok = 1;
  if (f->hdr.id == 1) { /* body "hello", segments big then small */
    ok = f->hdr.body_len == 5 && memcmp(f->body, "hello", 5) == 0 && f->hdr.nseg == 2 && f->seg_len[0] == BIG &&
         f->seg_len[1] == 10 && memcmp(f->segs, big, BIG) == 0 && memcmp(f->segs + BIG, small, 10) == 0;
  } else if (f->hdr.id == 2) { /* after the refused frame: a plain one */
    ok = f->hdr.body_len == 3 && memcmp(f->body, "end", 3) == 0 && f->hdr.nseg == 0;
    rh_conn_close(c, 1);
    rh_listener_close(lis);
  } else {
    ok = 0;
  }
  if (!ok) bad_frames++;
}

static void on_close(rh_conn_t *c, int status, int peer_version) {
  (void)c;
  (void)status;
  (void)peer_version;
  closes++;
}

static void on_connect(rh_conn_t *c, int status) {
  CHECK(status == 0);
  uv_buf_t segs[2];
  segs[0] = uv_buf_init((char *)big, 0);
  segs[0].len = BIG;
  segs[1] = uv_buf_init((char *)small, 10);
  CHECK(rh_conn_send(c, 7, 0, 1, "hello", 5, segs, 2, NULL, NULL) == 0);
  /* past the limit: refused at once, nothing queued, the connection stays open */
  uv_buf_t huge = uv_buf_init((char *)big, 0);
  huge.len = (size_t)net.max_frame;
  CHECK(rh_conn_send(c, 7, 0, 9, "x", 1, &huge, 1, NULL, NULL) == RH_ETOOBIG);
  CHECK(rh_conn_is_open(c));
  CHECK(rh_conn_send(c, 7, 0, 2, "end", 3, NULL, 0, NULL, NULL) == 0);
  rh_conn_close(c, 1);
}

static const rh_conn_cbs_t cbs = {on_frame, on_close, on_connect};

static void on_accept(rh_listener_t *l, rh_conn_t *c) {
  (void)l;
  server_side = c;
  rh_conn_prove(c); /* (no handshake in this test: the peer counts as proven) */
}

int main(void) {
  big = malloc(BIG);
  small = malloc(10);
  fill(big, BIG, 1);
  fill(small, 10, 2);
  rh__conn_set_write_split(SPLIT);
  CHECK(uv_loop_init(&loop) == 0);
  CHECK(rh_net_init(&net, &loop, 8u << 20, 1) == 0);
  lis = rh_listener_new(&net, &cbs, on_accept, NULL);
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  CHECK(rh_listener_bind(lis, (const struct sockaddr *)&a, 8) == 0);
  uv_ip4_addr("127.0.0.1", rh_listener_port(lis), &a);
  rh_conn_t *c = rh_conn_new(&net, &cbs, NULL);
  CHECK(rh_conn_connect(c, (const struct sockaddr *)&a) == 0);
  uv_run(&loop, UV_RUN_DEFAULT);
  CHECK(server_side != NULL);
  CHECK(frames == 2);
  CHECK(bad_frames == 0);
  CHECK(closes == 2);
  rh_net_close(&net);
  uv_run(&loop, UV_RUN_DEFAULT);
  CHECK(uv_loop_close(&loop) == 0);
  free(big);
  free(small);
  return TEST_RESULT();
}
