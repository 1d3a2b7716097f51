/* test_ring.c: the shared-memory rings, alone and under a real connection.
 *
 * Alone (ring.c): bytes go round the end of the buffer intact; a full ring takes
 * what fits; the sleeping and want-space flags follow their handshake; and every
 * impossible value a peer can write (a tail past the data, a head ahead of the
 * tail, a counter that goes back, a header of another size) is RH_ERING, never
 * an access outside the mapping. An empty ring's writes start over at offset 0
 * (rewinding), the consumer skips what was jumped over, and a peer's jump record
 * that is not such a skip is ignored.
 *
 * Under a connection (conn_ring.c) over a Unix-domain socket in one process: a
 * burst of small frames (many more than the ring holds: the backlog) interleaved
 * with big ones and ones with a descriptor (which take the socket behind a
 * marker) arrives complete and in the order sent; a paused reader with frames
 * waiting in its ring lets the loop sleep, and reads them once resumed; then a
 * corrupt tail closes the reading side with RH_ERING, and the loop closes
 * cleanly. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "net/conn.h"
#include "net/ring.h"
#include "net/shm.h"
#include "test_check.h"

#define CAP 4096

static void ring_alone(void) {
  size_t size = rh_ring_file_size(CAP);
  uint8_t *m = calloc(1, size + 64);
  rh_ring_format(m, CAP);
  rh_ring_t atx, arx, btx, brx;
  CHECK(rh_ring_open(m, size, 1, &atx, &arx) == 0);
  CHECK(rh_ring_open(m, size, 0, &btx, &brx) == 0);
  CHECK(rh_ring_avail(&brx) == 0);
  /* round the end, many times, with odd sizes */
  uint8_t src[3000], dst[CAP];
  for (int i = 0; i < 3000; i++) src[i] = (uint8_t)(i * 7 + 1);
  for (int round = 0; round < 50; round++) {
    size_t n = 1 + (size_t)(round * 397) % 3000, put;
    CHECK(rh_ring_write(&atx, src, n, &put) == 0 && put == n);
    CHECK(rh_ring_avail(&brx) == (int64_t)n);
    memset(dst, 0, n);
    rh_ring_read(&brx, dst, n);
    CHECK(memcmp(src, dst, n) == 0);
  }
  /* full: what fits goes in */
  size_t put;
  CHECK(rh_ring_write(&btx, src, 3000, &put) == 0 && put == 3000);
  CHECK(rh_ring_write(&btx, src, 3000, &put) == 0 && put == CAP - 3000);
  CHECK(rh_ring_write(&btx, src, 1, &put) == 0 && put == 0);
  CHECK(rh_ring_wait_space(&btx) == 1); /* nothing freed: it may wait */
  rh_ring_read(&arx, dst, 10);
  CHECK(rh_ring_space_wanted(&arx) == 1);
  CHECK(rh_ring_space_wanted(&arx) == 0); /* once per wait */
  CHECK(rh_ring_wait_space(&btx) == 0);   /* space is there now */
  /* sleeping */
  CHECK(rh_ring_sleep(&arx) == 0); /* bytes are waiting: stay awake */
  rh_ring_read(&arx, dst, (size_t)rh_ring_avail(&arx));
  CHECK(rh_ring_sleep(&arx) == 1);
  CHECK(rh_ring_write(&btx, src, 5, &put) == 0 && put == 5);
  CHECK(rh_ring_wake_needed(&btx) == 1);
  CHECK(rh_ring_wake_needed(&btx) == 0);
  rh_ring_read(&arx, dst, 5);
  /* a peer's impossible counters */
  uint64_t keep = *brx.tail;
  *brx.tail = brx.pos + CAP + 1; /* more than the ring holds */
  CHECK(rh_ring_avail(&brx) == RH_ERING);
  *brx.tail = (uint64_t)-5; /* far behind our head, as a wrapped difference */
  CHECK(rh_ring_avail(&brx) == RH_ERING);
  *brx.tail = keep;
  CHECK(rh_ring_avail(&brx) >= 0);
  *brx.tail = keep - 1; /* goes back */
  CHECK(rh_ring_avail(&brx) == RH_ERING);
  *brx.tail = keep;
  keep = *atx.head;
  *atx.head = atx.pos + 1; /* the consumer claims to have read what was never written */
  CHECK(rh_ring_write(&atx, src, 1, &put) == RH_ERING && put == 0);
  *atx.head = keep;
  /* headers that do not describe this mapping */
  CHECK(rh_ring_open(m, size - 1, 0, &btx, &brx) == RH_ERING);
  CHECK(rh_ring_open(m, 100, 0, &btx, &brx) == RH_ERING);
  uint64_t bad = CAP + 1;
  memcpy(m + 8, &bad, 8);
  CHECK(rh_ring_open(m, size, 0, &btx, &brx) == RH_ERING);
  bad = (uint64_t)1 << 62;
  memcpy(m + 8, &bad, 8);
  CHECK(rh_ring_open(m, size, 0, &btx, &brx) == RH_ERING);
  rh_ring_format(m, CAP);
  m[0] ^= 1;
  CHECK(rh_ring_open(m, size, 0, &btx, &brx) == RH_ERING);
  free(m);
}

/* Rewinding (ring.h): an empty ring past CAP / 4 rewound, the next write starts
 * over at 0, the consumer skips the rest, and until it has, the bytes jumped over
 * are not held; a ring that holds bytes, or is near its start, is not rewound;
 * a stream of small writes read as they come stays in the buffer's first part;
 * a jump record that is not a skip from where the consumer stands to an offset 0
 * within the tail is ignored. */
static void ring_rewind(void) {
  size_t size = rh_ring_file_size(CAP);
  uint8_t *m = calloc(1, size + 64);
  rh_ring_format(m, CAP);
  rh_ring_t tx, rx, unused_rx, unused_tx; /* the creator writes ring 0, its peer reads it */
  CHECK(rh_ring_open(m, size, 1, &tx, &unused_rx) == 0);
  CHECK(rh_ring_open(m, size, 0, &unused_tx, &rx) == 0);
  uint8_t src[CAP], dst[CAP];
  for (int i = 0; i < CAP; i++) src[i] = (uint8_t)(i * 13 + 5);
  size_t put;
  /* 1500 bytes, read: the ring is empty at offset 1500 (past CAP / 4) */
  CHECK(rh_ring_write(&tx, src, 1500, &put) == 0 && put == 1500);
  CHECK(rh_ring_avail(&rx) == 1500);
  rh_ring_read(&rx, dst, 1500);
  /* rewound, 100 bytes land at offset 0, the producer's position is past the jump */
  CHECK(rh_ring_rewind(&tx) == 0);
  CHECK(rh_ring_write(&tx, src + 7, 100, &put) == 0 && put == 100);
  CHECK(tx.pos == CAP + 100 && *tx.jump_from == 1500 && *tx.jump_to == CAP);
  CHECK(memcmp(tx.data, src + 7, 100) == 0);
  /* the bytes jumped over are never held: before the consumer has skipped, the
   * whole buffer but those 100 bytes is free */
  CHECK(rh_ring_write(&tx, src, CAP, &put) == 0 && put == CAP - 100);
  CHECK(rh_ring_avail(&rx) == CAP && rx.pos == CAP && *rx.head == CAP);
  rh_ring_read(&rx, dst, CAP);
  CHECK(memcmp(dst, src + 7, 100) == 0 && memcmp(dst + 100, src, CAP - 100) == 0);
  /* empty at offset 0: no rewind; then 3000 bytes, read; the next 2000 rewind
   * (the consumer skips, then reads them at 0); a ring that holds bytes does not */
  CHECK(rh_ring_rewind(&tx) == 0);
  CHECK(rh_ring_write(&tx, src, 3000, &put) == 0 && put == 3000 && *tx.jump_from == 1500);
  CHECK(rh_ring_rewind(&tx) == 0 && tx.pos == 2 * CAP + 3000);
  CHECK(rh_ring_avail(&rx) == 3000);
  rh_ring_read(&rx, dst, 3000);
  CHECK(rh_ring_rewind(&tx) == 0);
  CHECK(rh_ring_write(&tx, src + 1, 2000, &put) == 0 && put == 2000);
  CHECK(*tx.jump_from == 2 * CAP + 3000 && tx.pos == 3 * CAP + 2000);
  CHECK(rh_ring_avail(&rx) == 2000);
  rh_ring_read(&rx, dst, 2000);
  CHECK(memcmp(dst, src + 1, 2000) == 0);
  /* a stream of small writes, each read as it comes: never past offset 1024 + 300 */
  uint64_t far = 0;
  for (int i = 0; i < 5000; i++) {
    size_t n = 1 + (size_t)(i * 37) % 300;
    CHECK(rh_ring_rewind(&tx) == 0);
    CHECK(rh_ring_write(&tx, src + i % 500, n, &put) == 0 && put == n);
    if (i > 10 && (tx.pos & (CAP - 1)) > far) far = tx.pos & (CAP - 1);
    CHECK(rh_ring_avail(&rx) == (int64_t)n);
    rh_ring_read(&rx, dst, n);
    CHECK(memcmp(dst, src + i % 500, n) == 0);
  }
  CHECK(far <= 1024 + 300);
  /* a peer's jump records that are not a skip to offset 0 within the tail are
   * ignored: the bytes are read as they are */
  for (int k = 0; k < 4; k++) {
    uint64_t at = rx.pos, end = at + CAP - (at & (CAP - 1)), jf = *tx.jump_from;
    size_t n = 200;
    uint64_t bogus[][2] = {{at, at + 100}, {at, at - 1}, {at, end + CAP}, {at + 1, end}};
    CHECK(rh_ring_write(&tx, src, n, &put) == 0 && put == n && *tx.jump_from == jf);
    *rx.jump_from = bogus[k][0];
    *rx.jump_to = bogus[k][1];
    CHECK(rh_ring_avail(&rx) == (int64_t)n && rx.pos == at);
    rh_ring_read(&rx, dst, n);
    CHECK(memcmp(dst, src, n) == 0);
  }
  free(m);
}

/* ---- under a connection ---- */

#define NFRAMES 400
#define BIGLEN (100u << 10)

static uv_loop_t loop;
static rh_net_t net;
static rh_listener_t *lis;
static rh_conn_t *server_side, *client;
static int next_id = 1, bad, server_status = 1, client_closed;
static uint8_t *payload;
static uv_timer_t pause_timer;
#define EXTRA 10
static void paused_cb(uv_timer_t *t);
static char path[64];

static uint32_t len_of(int id) { return id % 7 == 3 ? BIGLEN : (uint32_t)(id * 131) % 3000; }
/* (small frames with a descriptor: these take the socket too) */
static int has_fd(int id) { return id % 50 == 25; }

static void on_server_frame(rh_conn_t *c, const rh_frame_t *f) {
  if (f->hdr.type == 1) { /* the "handshake": rings offered with the verdict */
    rh_conn_prove(c);
    int err;
    rh_shm_t *seg = rh_conn_ring_segment(&err);
    CHECK(seg != NULL);
    char ino[32];
    int n = snprintf(ino, sizeof ino, "%llu", (unsigned long long)rh_shm_inode(seg));
    CHECK(rh_conn_send_fd(c, seg->fd, 7, 0, 0, ino, (uint32_t)n, NULL, 0, NULL, NULL) == 0);
    CHECK(rh_conn_ring_attach(c, seg, 1) == 0);
    rh_shm_release(seg);
    return;
  }
  /* frames arrive in the order sent, whole, descriptors with theirs */
  uint32_t want = next_id > NFRAMES ? len_of(next_id) % 1000 : len_of(next_id);
  if (f->hdr.id != (uint64_t)next_id || f->hdr.body_len != want || memcmp(f->body, payload, want) != 0) bad++;
  if (has_fd(next_id)) { /* (a frame takes a descriptor when it says it has one, as shm.lua's do) */
    int fd = rh_conn_take_fd(c);
    if (fd < 0) bad++;
    else close(fd);
  }
  next_id++;
  if (f->hdr.id == NFRAMES) {
    CHECK(rh_conn_take_fd(c) == -1); /* every descriptor went with its frame */
    /* paused with frames waiting in its ring, this side must not keep the loop
     * polling: it sleeps, and reads them when resumed */
    rh_conn_pause(c);
    for (int id = NFRAMES + 1; id <= NFRAMES + EXTRA; id++)
      CHECK(rh_conn_send(client, 5, 0, (uint64_t)id, payload, len_of(id) % 1000, NULL, 0, NULL, NULL) == 0);
    uv_timer_start(&pause_timer, paused_cb, 50, 0);
  }
  if (f->hdr.id == NFRAMES + EXTRA) {
    /* now a corrupt tail from the client: this side must close with RH_ERING */
    CHECK(rh_conn_ring_poke(client, 0, (uint64_t)1 << 40) == 0);
  }
}

static void paused_cb(uv_timer_t *t) {
  (void)t;
  CHECK(!net.spinning);
  CHECK(next_id == NFRAMES + 1);
  rh_conn_resume(server_side);
}

static void on_client_frame(rh_conn_t *c, const rh_frame_t *f) {
  CHECK(f->hdr.type == 7);
  rh_conn_prove(c);
  int fd = rh_conn_take_fd(c);
  CHECK(fd >= 0);
  char why[160];
  int err;
  rh_shm_t *seg = rh_shm_attach(fd, 0, strtoull((const char *)f->body, NULL, 10), why, sizeof why, &err);
  CHECK(seg != NULL);
  CHECK(rh_conn_ring_attach(c, seg, 0) == 0);
  rh_shm_release(seg);
  CHECK(rh_conn_has_ring(c));
  for (int id = 1; id <= NFRAMES; id++) {
    if (has_fd(id)) CHECK(rh_conn_send_fd(c, 0, 5, 0, (uint64_t)id, payload, len_of(id), NULL, 0, NULL, NULL) == 0);
    else CHECK(rh_conn_send(c, 5, 0, (uint64_t)id, payload, len_of(id), NULL, 0, NULL, NULL) == 0);
  }
}

static void on_close(rh_conn_t *c, int status, int peer_version) {
  (void)peer_version;
  if (c == server_side) {
    server_status = status;
    rh_listener_close(lis);
  } else {
    client_closed = 1;
  }
}

static void on_connect(rh_conn_t *c, int status) {
  CHECK(status == 0);
  CHECK(rh_conn_send(c, 1, 0, 0, "hi", 2, NULL, 0, NULL, NULL) == 0);
}

static const rh_conn_cbs_t server_cbs = {on_server_frame, on_close, NULL};
static const rh_conn_cbs_t client_cbs = {on_client_frame, on_close, on_connect};

static void on_accept(rh_listener_t *l, rh_conn_t *c) {
  (void)l;
  server_side = c;
}

static void ring_under_conn(void) {
  payload = malloc(BIGLEN);
  for (uint32_t i = 0; i < BIGLEN; i++) payload[i] = (uint8_t)(i * 2654435761u >> 11);
  snprintf(path, sizeof path, "/tmp/rh-test-ring-%d.sock", (int)getpid());
  CHECK(uv_loop_init(&loop) == 0);
  CHECK(rh_net_init(&net, &loop, 8u << 20, 1) == 0);
  uv_timer_init(&loop, &pause_timer);
  lis = rh_listener_new_local(&net, &server_cbs, on_accept, NULL);
  CHECK(rh_listener_bind_local(lis, path, 8) == 0);
  client = rh_conn_new_local(&net, &client_cbs, NULL);
  CHECK(rh_conn_connect_local(client, path) == 0);
  uv_run(&loop, UV_RUN_DEFAULT);
  CHECK(next_id == NFRAMES + EXTRA + 1);
  CHECK(bad == 0);
  CHECK(server_status == RH_ERING);
  CHECK(client_closed); /* (the reader's close reached the writer as EOF) */
  rh_net_close(&net);
  uv_close((uv_handle_t *)&pause_timer, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  CHECK(uv_loop_close(&loop) == 0);
  free(payload);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN); /* (as rpchost does: a closed peer is an error code) */
  ring_alone();
  ring_rewind();
  ring_under_conn();
  return TEST_RESULT();
}
