/* test_conn.c: framed connections over a real loopback socket. Segments larger
 * than one write's buffer (1 GiB in use, lowered here to a few KiB so the test
 * is cheap) are split into several buffers and arrive intact, in order, with
 * the frames after them; a frame larger than the frame limit is refused before
 * a byte is queued, and the connection goes on. A listener holds at most
 * net->max_unproven connections that have not proved themselves (a new one
 * closes the oldest; proven ones are neither counted nor closed), never pauses
 * one, and an accept that finds the descriptor table full frees a descriptor
 * instead of spinning, and listens on. Each loop closes cleanly. */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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

/* ---- the cap on unproven connections, and accept without descriptors ---- */

#define MAXC 16
static uv_loop_t loop2;
static rh_net_t net2;
static rh_listener_t *lis2;
static rh_conn_t *acc[MAXC]; /* server sides, in accept order */
static int nacc;
static int acc_closed[MAXC], acc_status[MAXC];
static int cli_closed[MAXC];

static void acc_close(rh_conn_t *c, int status, int peer_version) {
  (void)peer_version;
  int i = (int)(intptr_t)rh_conn_data(c) - 1;
  acc_closed[i] = 1;
  acc_status[i] = status;
}

static void cli_close(rh_conn_t *c, int status, int peer_version) {
  (void)status;
  (void)peer_version;
  cli_closed[(int)(intptr_t)rh_conn_data(c) - 1] = 1;
}

static const rh_conn_cbs_t acc_cbs = {NULL, acc_close, NULL};
static const rh_conn_cbs_t cli_cbs = {NULL, cli_close, NULL};

static void on_accept2(rh_listener_t *l, rh_conn_t *c) {
  (void)l;
  rh_conn_set_data(c, (void *)(intptr_t)(nacc + 1));
  acc[nacc++] = c;
}

/* Runs the loop until *v reaches want (5 s at most); whether it did. */
static int until(const int *v, int want) {
  uint64_t end = uv_hrtime() + 5000000000ull;
  while (*v < want && uv_hrtime() < end) uv_run(&loop2, UV_RUN_ONCE);
  return *v >= want;
}

static void start2(int max_unproven) {
  memset(acc, 0, sizeof acc);
  nacc = 0;
  memset(acc_closed, 0, sizeof acc_closed);
  memset(cli_closed, 0, sizeof cli_closed);
  CHECK(uv_loop_init(&loop2) == 0);
  CHECK(rh_net_init(&net2, &loop2, 1u << 20, 1) == 0);
  net2.max_unproven = max_unproven;
  net2.handshake_ms = 60000; /* (no deadline in the way) */
  lis2 = rh_listener_new(&net2, &acc_cbs, on_accept2, NULL);
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  CHECK(rh_listener_bind(lis2, (const struct sockaddr *)&a, 64) == 0);
}

static void end2(void) {
  for (int i = 0; i < nacc; i++)
    if (!acc_closed[i]) rh_conn_close(acc[i], 0);
  rh_listener_close(lis2);
  rh_net_close(&net2);
  uv_run(&loop2, UV_RUN_DEFAULT);
  CHECK(uv_loop_close(&loop2) == 0);
}

/* Cap 3: a fourth unproven connection closes the first (the clients see it
 * end); proving one makes room; the proven are never closed; a gated
 * connection that is asked to pause still sees its peer's end. */
static void test_unproven_cap(void) {
  start2(3);
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", rh_listener_port(lis2), &a);
  rh_conn_t *cli[MAXC];
  for (int i = 0; i < 8; i++) {
    cli[i] = rh_conn_new(&net2, &cli_cbs, (void *)(intptr_t)(i + 1));
    CHECK(rh_conn_connect(cli[i], (const struct sockaddr *)&a) == 0);
    CHECK(until(&nacc, i + 1));
    if (i == 0) rh_conn_prove(acc[0]); /* proven at once: never counted */
    if (i == 4) {
      CHECK(until(&cli_closed[1], 1)); /* 4 closed 1, the oldest unproven */
      CHECK(acc_closed[1] && acc_status[1] == RH_ECROWDED);
      CHECK(!acc_closed[0] && !acc_closed[2] && !acc_closed[3] && !acc_closed[4]);
      rh_conn_prove(acc[2]); /* room for one more */
    }
    if (i == 5) {
      uv_run(&loop2, UV_RUN_NOWAIT);
      CHECK(!acc_closed[3] && !cli_closed[3]); /* 3, 4, 5: at the cap, not past it */
    }
  }
  /* 6 closed 3, 7 closed 4: the oldest unproven each time, never 0 or 2 */
  CHECK(until(&cli_closed[4], 1));
  CHECK(acc_closed[3] && acc_status[3] == RH_ECROWDED && acc_closed[4] && acc_status[4] == RH_ECROWDED);
  CHECK(!acc_closed[0] && !acc_closed[2] && !acc_closed[5] && !acc_closed[6] && !acc_closed[7]);
  CHECK(rh_listener_unproven(lis2) == 3);
  /* pausing a gated connection is ignored: its peer's end is still read */
  rh_conn_pause(acc[5]);
  rh_conn_close(cli[5], 0);
  CHECK(until(&acc_closed[5], 1));
  CHECK(acc_status[5] == 0);
  CHECK(rh_listener_unproven(lis2) == 2);
  /* (a client whose peer ended it was freed after its close callback) */
  for (int i = 0; i < 8; i++)
    if (!cli_closed[i]) rh_conn_close(cli[i], 0);
  end2();
}

/* A process that dials the listener when told (a byte: how many), and holds
 * what it dialled until its pipe closes: the descriptors it costs the
 * listener's side are the only ones this process spends. */
static pid_t dialler(int port, int *cmd) {
  int p[2];
  CHECK(pipe(p) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[1]);
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", port, &a);
    unsigned char n;
    while (read(p[0], &n, 1) == 1)
      for (int i = 0; i < n; i++) {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) _exit(2);
      }
    _exit(0);
  }
  close(p[0]);
  *cmd = p[1];
  return pid;
}

static void dial(int cmd, unsigned char n) { CHECK(write(cmd, &n, 1) == 1); }

/* Runs the loop for about ms milliseconds (a loop that spins never returns). */
static void run_for(int ms) {
  uint64_t end = uv_hrtime() + (uint64_t)ms * 1000000u;
  while (uv_hrtime() < end) {
    uv_run(&loop2, UV_RUN_NOWAIT);
    usleep(2000);
  }
}

/* The descriptor table full and libuv's own spare descriptor gone (as when
 * another thread took its place): each new connection closes the oldest
 * unproven one and is accepted (the turn's last accept, which finds no
 * descriptor either, may close one more); with none unproven, our spare
 * descriptor goes first. The proven are never closed, and the loop goes on
 * (it would spin in accept for ever); once descriptors are free again the
 * listener accepts as before. */
static void test_out_of_descriptors(void) {
  start2(0);
  int cmd;
  pid_t child = dialler(rh_listener_port(lis2), &cmd);
  dial(cmd, 4);
  CHECK(until(&nacc, 4));
  struct rlimit old, low;
  CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0);
  low = old;
  low.rlim_cur = 512;
  CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0);
  close(loop2.emfile_fd);
  loop2.emfile_fd = -1;
  int pad[512], npad = 0;
  while (npad < 512 && (pad[npad] = fcntl(0, F_DUPFD_CLOEXEC, 0)) >= 0) npad++;
  CHECK(npad < 512); /* the table is full */
  dial(cmd, 3);
  CHECK(until(&nacc, 7));
  run_for(100);
  CHECK(acc_closed[0] && acc_closed[1] && acc_closed[2] && acc_status[0] == RH_ECROWDED &&
        acc_status[1] == RH_ECROWDED && acc_status[2] == RH_ECROWDED);
  CHECK(!acc_closed[5] && !acc_closed[6]); /* the newest stay */
  for (int i = 3; i < 7; i++)
    if (!acc_closed[i]) rh_conn_prove(acc[i]);
  while (npad < 512 && (pad[npad] = fcntl(0, F_DUPFD_CLOEXEC, 0)) >= 0) npad++; /* full again */
  CHECK(npad < 512);
  dial(cmd, 2); /* nothing unproven: the spare goes, then each newcomer makes room for the next */
  CHECK(until(&nacc, 9));
  run_for(100);
  CHECK(net2.spare_fd == -1);
  for (int i = 3; i < 7; i++) CHECK(!acc_closed[i] || acc_status[i] == RH_ECROWDED);
  CHECK(!acc_closed[5] && !acc_closed[6]); /* proven: never closed */
  CHECK(acc_closed[7] && acc_status[7] == RH_ECROWDED);
  for (int i = 0; i < npad; i++) close(pad[i]);
  dial(cmd, 1);
  CHECK(until(&nacc, 10)); /* listening still */
  run_for(1100);           /* (the sweep takes the spare back) */
  CHECK(net2.spare_fd >= 0);
  CHECK(!acc_closed[9]);
  CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0);
  close(cmd);
  int st;
  CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0);
  end2();
}

int main(void) {
  alarm(25); /* (a loop that spins in accept fails here, not at ctest's timeout) */
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
  test_unproven_cap();
  test_out_of_descriptors();
  return TEST_RESULT();
}
