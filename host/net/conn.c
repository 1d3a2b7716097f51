/* conn.c: framed connections over TCP or Unix-domain sockets, listeners and the
 * batched writer (see conn.h). Both kinds are libuv streams; only creation,
 * connecting, binding and address queries differ.
 *
 * Descriptors are what a stranger can make a rank run out of: each listener
 * counts its accepted connections that have not proved themselves and closes
 * the oldest past net->max_unproven, and an accept that finds the descriptor
 * table full frees one rather than let libuv try again for ever. */
#include "conn_priv.h"

#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

struct rh_listener_s {
  rh_sock_t h;
  int local;
  char *path; /* a Unix-domain listener's socket file, removed when it closes */
  ino_t ino;  /* ... and which file that is (another may take the name later) */
  dev_t dev;
  rh_net_t *net;
  rh_conn_cbs_t cbs;
  rh_accept_fn on_accept;
  void *data;
  /* accepted connections not proven yet, oldest first (conn.c's cap) */
  rh_conn_t *unproven, *unproven_last;
  int nunproven;
  /* its connections' handshake deadline (0: net->handshake_ms): a store's
   * listener has its own (RPCHOST_STORE_HANDSHAKE_TIMEOUT) */
  uint64_t handshake_ms;
  /* takes a connection libuv accepted when no rh_conn_t could be made for it */
  rh_sock_t sink;
  int sink_busy, sink_wanted, freeing;
};

static void deliver(rh_conn_t *c);

/* The connection has proved itself, or is closing: its listener counts it no more. */
static void unproven_unlink(rh_conn_t *c) {
  rh_listener_t *l = c->listener;
  if (!l) return;
  if (c->prev_unproven) c->prev_unproven->next_unproven = c->next_unproven;
  else l->unproven = c->next_unproven;
  if (c->next_unproven) c->next_unproven->prev_unproven = c->prev_unproven;
  else l->unproven_last = c->prev_unproven;
  c->next_unproven = c->prev_unproven = NULL;
  c->listener = NULL;
  l->nunproven--;
}

/* Before each poll: frames that resumed connections had buffered go to their
 * owners (from the loop, never inside the owner's call to resume), then every
 * queued write goes out. */
static void flush_cb(uv_prepare_t *p) {
  rh_net_t *net = p->data;
  while (net->resumed) {
    rh_conn_t *c = net->resumed;
    net->resumed = c->next_resumed;
    c->resumed = 0;
    if (!c->closing) deliver(c);
  }
  /* (a turn of the scheduler's between its own polls of the rings leaves them
   * to those polls while they run: rh_net_ring_turn, rpchost.sched.frame_done) */
  if (!(net->sched_polls && net->spinning)) rh__rings_poll(net);
  rh_net_flush(net);
}

static void conn_end(rh_conn_t *c, int status, int peer_version);

/* Once a second: a connection whose peer has not proved itself within the
 * handshake deadline is closed (idle strangers, slowloris, a listener that
 * never answers), whichever side dialled. */
static void sweep_cb(uv_timer_t *t) {
  rh_net_t *net = t->data;
  uint64_t now = uv_now(net->loop);
  /* (the spare descriptor out_of_descriptors gave up, taken back) */
  if (net->spare_fd < 0) net->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (rh_conn_t *c = net->all, *next; c; c = next) {
    next = c->next_all;
    if (!c->closing && c->reader.gated && now - c->born > c->handshake_ms) conn_end(c, RH_EHANDSHAKE, 0);
  }
}

/* A sixteenth of the descriptor limit, within [16, 256]: a rank has a few
 * listeners (RPC over TCP and a Unix socket, the process group's, the store's),
 * and all of them together may hold only a part of its descriptors for
 * strangers. */
static int default_max_unproven(void) {
  struct rlimit rl;
  rlim_t n = getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ? 4096 : rl.rlim_cur / 16;
  return n < 16 ? 16 : n > 256 ? 256 : (int)n;
}

int rh_net_init(rh_net_t *net, uv_loop_t *loop, uint64_t max_frame, uint8_t version) {
  memset(net, 0, sizeof *net);
  net->ahead_fd = -1; /* (until rh__ahead_init: rh_net_close may come first) */
  net->loop = loop;
  net->max_frame = max_frame;
  net->version = version;
  net->handshake_ms = 10000;
  net->liveness_s = 10;
  net->max_unproven = default_max_unproven();
  net->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int rc = uv_prepare_init(loop, &net->flush);
  if (rc) return rc;
  net->flush.data = net;
  rc = uv_prepare_start(&net->flush, flush_cb);
  if (rc) return rc;
  rc = uv_timer_init(loop, &net->sweep);
  if (rc) return rc;
  net->sweep.data = net;
  rc = uv_timer_start(&net->sweep, sweep_cb, 1000, 1000);
  rh__rings_init(net);
  rh__ahead_init(net);
  /* Neither handle alone keeps the loop alive. */
  uv_unref((uv_handle_t *)&net->flush);
  uv_unref((uv_handle_t *)&net->sweep);
  return rc;
}

void rh_net_close(rh_net_t *net) {
  if (!uv_is_closing((uv_handle_t *)&net->flush)) uv_close((uv_handle_t *)&net->flush, NULL);
  if (!uv_is_closing((uv_handle_t *)&net->sweep)) uv_close((uv_handle_t *)&net->sweep, NULL);
  rh__rings_close(net);
  rh__ahead_close(net);
  if (net->spare_fd >= 0) close(net->spare_fd);
  net->spare_fd = -1;
}

static void release_all(rh_release_t *rel, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (rel[i].fn) rel[i].fn(rel[i].ctx);
}

static void drop_queue(rh_conn_t *c) {
  release_all(c->rel, c->nrel);
  c->nrel = 0;
  c->npieces = 0;
  c->alen = 0;
}

static void report_close(rh_conn_t *c, int status, int peer_version) {
  if (c->reported) return;
  c->reported = 1;
  if (c->cbs.on_close) c->cbs.on_close(c, status, peer_version);
}

static void unlink_resumed(rh_conn_t *c) {
  if (!c->resumed) return;
  rh_conn_t **pp = &c->net->resumed;
  while (*pp && *pp != c) pp = &(*pp)->next_resumed;
  if (*pp) *pp = c->next_resumed;
  c->resumed = 0;
}

static void unlink_dirty(rh_conn_t *c);

static void close_done(uv_handle_t *h) {
  rh_conn_t *c = h->data;
  report_close(c, c->end_status, c->end_version); /* when conn_end deferred it */
  /* (it may still be listed for the next flush: output queued before it ended) */
  unlink_dirty(c);
  unlink_resumed(c);
  if (c->prev_all) c->prev_all->next_all = c->next_all;
  else c->net->all = c->next_all;
  if (c->next_all) c->next_all->prev_all = c->prev_all;
  drop_queue(c);
  rh__ring_free(c);
  for (int i = 0; i < c->nfds; i++) close(c->fds[i]);
  if (c->send_fd >= 0) close(c->send_fd);
  rh_reader_free(&c->reader);
  free(c->arena);
  free(c->pieces);
  free(c->rel);
  free(c->bufs);
  free(c);
}

/* A TCP error that means the peer's host stopped acknowledging within the
 * liveness bound (the kernel's keepalive or user timeout gave up: ETIMEDOUT)
 * is named as that, not as libuv's bare "connection timed out". */
static int liveness_status(rh_conn_t *c, int status) {
  return status == UV_ETIMEDOUT && !c->local && c->net->liveness_s ? RH_ESILENT : status;
}

/* Ends the connection now; status says why (0: orderly). */
static void conn_end(rh_conn_t *c, int status, int peer_version) {
  if (c->closing) return;
  status = liveness_status(c, status);
  c->closing = 1;
  unproven_unlink(c);
  c->end_status = status;
  c->end_version = peer_version;
  if (!c->net->defer_close_reports) report_close(c, status, peer_version);
  uv_close(&c->h.handle, close_done);
}

static rh_conn_t *conn_new(rh_net_t *net, const rh_conn_cbs_t *cbs, void *data, int local) {
  rh_conn_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  /* Unix-domain connections are IPC pipes, so descriptors can travel on them */
  if ((local ? uv_pipe_init(net->loop, &c->h.pipe, 1) : uv_tcp_init(net->loop, &c->h.tcp)) != 0) {
    free(c);
    return NULL;
  }
  c->local = local;
  c->send_fd = -1;
  c->h.handle.data = c;
  c->net = net;
  c->next_all = net->all;
  if (net->all) net->all->prev_all = c;
  net->all = c;
  c->cbs = *cbs;
  c->data = data;
  c->born = uv_now(net->loop);
  c->handshake_ms = net->handshake_ms;
  rh_reader_init(&c->reader, net->max_frame, net->version);
  if (net->seg_alloc) rh_reader_set_alloc(&c->reader, net->seg_alloc, net->seg_free, net->seg_ctx);
  return c;
}

rh_conn_t *rh_conn_new(rh_net_t *net, const rh_conn_cbs_t *cbs, void *data) { return conn_new(net, cbs, data, 0); }

rh_conn_t *rh_conn_new_local(rh_net_t *net, const rh_conn_cbs_t *cbs, void *data) {
  return conn_new(net, cbs, data, 1);
}

int rh_conn_is_local(rh_conn_t *c) { return c->local; }

void *rh_conn_data(rh_conn_t *c) { return c->data; }
void rh_conn_set_data(rh_conn_t *c, void *data) { c->data = data; }
int rh_conn_is_open(rh_conn_t *c) { return !c->closing && !c->shutting; }
void rh_conn_prove(rh_conn_t *c) {
  rh_reader_open_gate(&c->reader);
  unproven_unlink(c);
}
int rh_conn_is_proven(rh_conn_t *c) { return !c->reader.gated; }
size_t rh_conn_queued(rh_conn_t *c) { return c->alen + c->inflight + rh__ring_backlog(c); }

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  rh_conn_t *c = h->data;
  uint8_t *p;
  size_t avail;
  (void)suggested;
  size_t want = c->reader.gated ? RH_FRAME_HDR + RH_FRAME_HANDSHAKE_MAX : 65536;
  if (rh_reader_space(&c->reader, want, &p, &avail) != 0) {
    buf->base = NULL;
    buf->len = 0;
    return;
  }
  buf->base = (char *)p;
  buf->len = avail;
}

static void free_handle(uv_handle_t *h) { free(h); }

/* Takes the descriptors that arrived with the bytes just read (libuv holds them
 * as pending handles) into the connection's queue. A frame that announces one
 * takes it with rh_conn_take_fd; they arrive no later than the frame's bytes. */
static int take_fds(rh_conn_t *c) {
  while (uv_pipe_pending_count(&c->h.pipe) > 0) {
    uv_pipe_t *tmp = malloc(sizeof *tmp);
    if (!tmp || uv_pipe_init(c->net->loop, tmp, 0) != 0) {
      free(tmp);
      return RH_ENOMEM;
    }
    int fd = -1;
    uv_os_fd_t ofd;
    if (uv_accept(&c->h.stream, (uv_stream_t *)tmp) == 0 && uv_fileno((uv_handle_t *)tmp, &ofd) == 0)
      fd = fcntl(ofd, F_DUPFD_CLOEXEC, 3);
    uv_close((uv_handle_t *)tmp, free_handle);
    if (fd < 0) return RH_EFDS;
    if (c->nfds == MAX_HELD_FDS) {
      close(fd);
      return RH_EFDS;
    }
    c->fds[c->nfds++] = fd;
  }
  return 0;
}

int rh_conn_take_fd(rh_conn_t *c) {
  if (c->nfds == 0) return -1;
  int fd = c->fds[0];
  memmove(c->fds, c->fds + 1, (size_t)(--c->nfds) * sizeof(int));
  return fd;
}

static void read_cb(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  rh_conn_t *c = s->data;
  (void)buf;
  if (c->local && n > 0) {
    int rc = take_fds(c);
    if (rc) {
      conn_end(c, rc, 0);
      return;
    }
  }
  if (n == UV_ENOBUFS) {
    conn_end(c, RH_ENOMEM, 0);
    return;
  }
  if (n < 0) {
    /* what the peer put in the ring before it closed is read first */
    if (c->ring && n == UV_EOF) rh__ring_poll(c);
    conn_end(c, n == UV_EOF ? 0 : (int)n, 0);
    return;
  }
  rh_reader_commit(&c->reader, (size_t)n);
  c->net->bytes_in += (uint64_t)n;
  deliver(c);
  /* (in ring mode socket frames wait for their markers: the ring says when) */
  if (c->ring) rh__ring_poll(c);
}

void rh__conn_hand_out(rh_conn_t *c, const rh_frame_t *f) {
  if (c->reported) {
    /* the owner is gone (a graceful close draining the peer): drop the frame */
    for (uint32_t i = 0; f->seg_owner && i < f->hdr.nseg; i++)
      if (c->net->seg_free) c->net->seg_free(c->net->seg_ctx, f->seg_owner[i]);
    return;
  }
  if (c->cbs.on_frame) c->cbs.on_frame(c, f);
}

/* Hands out every whole frame the reader holds, until the owner pauses. With a
 * ring, only as many as its markers announced (conn_ring.c), and doorbells are
 * swallowed. */
static void deliver(rh_conn_t *c) {
  rh_frame_t f;
  for (;;) {
    /* (a stranger being refused is read no further: its refusal goes out first) */
    if (c->closing || c->paused || (c->shutting && c->reader.gated)) return;
    if (c->ring) {
      if (rh__ring_swallow(c)) continue;
      if (!rh__ring_announced(c)) return;
    }
    int rc = rh_reader_next(&c->reader, &f);
    if (rc == 0) return;
    if (rc < 0) {
      conn_end(c, rc, rc == RH_EVERSION ? f.hdr.version : 0);
      return;
    }
    if (c->ring) rh__ring_took(c);
    rh__conn_hand_out(c, &f);
  }
}

void rh__conn_deliver(rh_conn_t *c) { deliver(c); }

/* Liveness through the kernel (net->liveness_s, see conn.h). TCP_USER_TIMEOUT
 * bounds how long bytes sent (a SYN among them) may go unacknowledged; on an
 * established connection, keepalive probes begin after a third of the bound
 * of quiet and repeat every tenth of it, and with the user timeout set the
 * kernel gives up once nothing came back for the whole bound. So a peer host
 * that went away (power, a cut link) is found within the bound whether or not
 * anything was being sent, a link back before then loses nothing (TCP
 * retransmits), and nothing of ours runs meanwhile: no timer, no frame, no
 * cost on a call's path. Best effort: a socket that refuses an option keeps
 * the kernel's defaults. */
static void tcp_liveness(rh_conn_t *c, int established) {
  unsigned s = c->net->liveness_s;
  uv_os_fd_t fd;
  if (c->local || s == 0 || uv_fileno(&c->h.handle, &fd) != 0) return;
  if (s > 32767u) s = 32767u; /* (the kernel's largest keepalive interval) */
  unsigned ms = s * 1000u;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
  if (!established) return;
  int on = 1, idle = s >= 3 ? (int)s / 3 : 1, intvl = s >= 10 ? (int)s / 10 : 1;
  int cnt = (int)s / intvl + 1; /* (the user timeout ends it first; at most 11) */
  (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

static int start_reading(rh_conn_t *c) {
  if (!c->local) {
    uv_tcp_nodelay(&c->h.tcp, 1);
    tcp_liveness(c, 1);
  }
  return uv_read_start(&c->h.stream, alloc_cb, read_cb);
}

/* Backpressure: while paused nothing is read from the socket (the peer's writes
 * wait in the kernel, then in its own queue) and buffered frames stay put. */
void rh_conn_pause(rh_conn_t *c) {
  /* (never a gated one: see conn.h) */
  if (c->closing || c->paused || c->reader.gated) return;
  c->paused = 1;
  uv_read_stop(&c->h.stream);
}

void rh_conn_resume(rh_conn_t *c) {
  if (c->closing || !c->paused) return;
  c->paused = 0;
  if (uv_read_start(&c->h.stream, alloc_cb, read_cb) != 0) {
    conn_end(c, RH_ECLOSED, 0);
    return;
  }
  if (!c->resumed) {
    c->resumed = 1;
    c->next_resumed = c->net->resumed;
    c->net->resumed = c;
  }
}

static void connect_cb(uv_connect_t *req, int status) {
  rh_conn_t *c = req->data;
  if (c->closing) return;
  if (status == 0) status = start_reading(c);
  status = liveness_status(c, status);
  if (c->cbs.on_connect) c->cbs.on_connect(c, status);
  if (status != 0) conn_end(c, status, 0);
}

int rh_conn_connect(rh_conn_t *c, const struct sockaddr *addr) {
  c->connect_req.data = c;
  int rc = uv_tcp_connect(&c->connect_req, &c->h.tcp, addr, connect_cb);
  /* (the SYN is out, but its retries read the bound when they are due: a
   * host that is gone is given up on within it, not after the kernel's two
   * minutes) */
  if (rc == 0) tcp_liveness(c, 0);
  return rc;
}

int rh_conn_connect_local(rh_conn_t *c, const char *path) {
  if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) return UV_ENAMETOOLONG;
  c->connect_req.data = c;
  uv_pipe_connect(&c->connect_req, &c->h.pipe, path, connect_cb); /* failures arrive in connect_cb */
  return 0;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap : 16;
  while (n < need) n *= 2;
  void *q = realloc(*p, n * elem);
  if (!q) return RH_ENOMEM;
  *p = q;
  *cap = n;
  return 0;
}

/* The connection has output for the next flush (before the loop polls). */
static void mark_dirty(rh_conn_t *c) {
  if (c->dirty) return;
  c->dirty = 1;
  c->next_dirty = c->net->dirty;
  c->net->dirty = c;
}

static int arena_put(rh_conn_t *c, const void *src, size_t len);
void rh__conn_mark_dirty(rh_conn_t *c) { mark_dirty(c); }
int rh__conn_arena_put(rh_conn_t *c, const void *src, size_t len) { return arena_put(c, src, len); }
void rh__conn_end(rh_conn_t *c, int status, int peer_version) { conn_end(c, status, peer_version); }

static int arena_put(rh_conn_t *c, const void *src, size_t len) {
  if (grow((void **)&c->arena, &c->acap, c->alen + len, 1)) return RH_ENOMEM;
  if (grow((void **)&c->pieces, &c->cpieces, c->npieces + 1, sizeof(rh_piece_t))) return RH_ENOMEM;
  memcpy(c->arena + c->alen, src, len);
  /* Adjacent arena spans merge into one piece, so a burst is one iovec. */
  if (c->npieces > 0) {
    rh_piece_t *last = &c->pieces[c->npieces - 1];
    if (!last->ext && last->off + last->len == c->alen) {
      last->len += len;
      c->alen += len;
      return 0;
    }
  }
  c->pieces[c->npieces++] = (rh_piece_t){.off = c->alen, .len = len, .ext = NULL};
  c->alen += len;
  return 0;
}

static int conn_send(rh_conn_t *c, uint8_t type, uint16_t flags, uint64_t id, const void *body, uint32_t body_len,
                     const uv_buf_t *segs, uint32_t nseg, rh_release_fn release, void *release_ctx);

int rh_conn_send(rh_conn_t *c, uint8_t type, uint16_t flags, uint64_t id, const void *body, uint32_t body_len,
                 const uv_buf_t *segs, uint32_t nseg, rh_release_fn release, void *release_ctx) {
  rh_net_t *net = c->net;
  net->defer_close_reports++;
  int rc = conn_send(c, type, flags, id, body, body_len, segs, nseg, release, release_ctx);
  net->defer_close_reports--;
  return rc;
}

static void conn_flush(rh_conn_t *c);

/* The frame goes out in a write of its own that carries the descriptor, after
 * everything queued before it (so the peer gets fds in frame order). */
int rh_conn_send_fd(rh_conn_t *c, int fd, uint8_t type, uint16_t flags, uint64_t id, const void *body,
                    uint32_t body_len, const uv_buf_t *segs, uint32_t nseg, rh_release_fn release, void *release_ctx) {
  if (!c->local) {
    if (release) release(release_ctx);
    return UV_EINVAL;
  }
  rh_net_t *net = c->net;
  net->defer_close_reports++;
  conn_flush(c);
  int rc = RH_ECLOSED;
  int own = c->closing || c->shutting ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (own >= 0) {
    c->send_fd = own; /* (set first: a frame with a descriptor never takes the ring) */
    rc = conn_send(c, type, flags, id, body, body_len, segs, nseg, release, release_ctx);
    if (rc == 0) {
      conn_flush(c);
    } else if (c->send_fd == own) {
      c->send_fd = -1;
      close(own);
    }
  } else if (release) {
    release(release_ctx);
  }
  net->defer_close_reports--;
  return rc;
}

static int conn_send(rh_conn_t *c, uint8_t type, uint16_t flags, uint64_t id, const void *body, uint32_t body_len,
                     const uv_buf_t *segs, uint32_t nseg, rh_release_fn release, void *release_ctx) {
  if (c->closing || c->shutting) {
    if (release) release(release_ctx);
    return RH_ECLOSED;
  }
  rh_frame_hdr_t h = {.version = c->net->version,
                      .type = type,
                      .flags = flags,
                      .id = id,
                      .body_len = body_len,
                      .nseg = nseg,
                      .seg_bytes = 0};
  for (uint32_t i = 0; i < nseg; i++) h.seg_bytes += segs[i].len;
  /* A frame the peer would refuse is refused here, before a byte is queued: the
   * connection stays usable (the caller reports the size and the limit). */
  if (nseg > RH_FRAME_MAX_SEGS || rh_frame_total(&h) > c->net->max_frame) {
    if (release) release(release_ctx);
    return RH_ETOOBIG;
  }
  uint8_t hdr[RH_FRAME_HDR];
  rh_frame_encode_header(hdr, &h);
  int rc;
  if (c->ring) {
    /* small frames go through shared memory (copied: the caller's buffers are
     * free at once); others, and one with a descriptor, leave a marker there
     * and take the socket below */
    rc = rh__ring_send(c, hdr, body, body_len, segs, nseg, &h, c->send_fd >= 0);
    if (rc == 1) {
      if (release) release(release_ctx);
      return 0;
    }
    if (rc < 0) {
      if (release) release(release_ctx);
      conn_end(c, rc == RH_ENOMEM ? rc : RH_ERING, 0);
      return rc;
    }
  }
  rc = arena_put(c, hdr, sizeof hdr);
  if (!rc && body_len) rc = arena_put(c, body, body_len);
  for (uint32_t i = 0; !rc && i < nseg; i++) {
    uint8_t l[8];
    for (int k = 0; k < 8; k++) l[k] = (uint8_t)((uint64_t)segs[i].len >> (8 * k));
    rc = arena_put(c, l, 8);
  }
  for (uint32_t i = 0; !rc && i < nseg; i++) {
    if (segs[i].len == 0) continue;
    rc = grow((void **)&c->pieces, &c->cpieces, c->npieces + 1, sizeof(rh_piece_t));
    if (!rc) c->pieces[c->npieces++] = (rh_piece_t){.off = 0, .len = segs[i].len, .ext = segs[i].base};
  }
  if (!rc && release) {
    rc = grow((void **)&c->rel, &c->crel, c->nrel + 1, sizeof(rh_release_t));
    if (!rc) c->rel[c->nrel++] = (rh_release_t){release, release_ctx};
    else release(release_ctx);
  } else if (rc && release) {
    release(release_ctx);
  }
  if (rc) {
    conn_end(c, rc, 0);
    return rc;
  }
  mark_dirty(c);
  return 0;
}

int rh_conn_send_raw(rh_conn_t *c, const void *data, size_t len) {
  if (c->closing || c->shutting) return RH_ECLOSED;
  int rc = arena_put(c, data, len);
  if (rc) {
    conn_end(c, rc, 0);
    return rc;
  }
  mark_dirty(c);
  return 0;
}

static void write_free(rh_write_t *w) {
  if (w->fd_handle) uv_close((uv_handle_t *)w->fd_handle, free_handle);
  release_all(w->rel, w->nrel);
  free(w->rel);
  free(w->arena);
  free(w);
}

static void write_cb(uv_write_t *req, int status) {
  rh_write_t *w = req->data;
  rh_conn_t *c = req->handle->data;
  size_t bytes = 0;
  for (size_t i = 0; w->bufs[i].base || w->bufs[i].len; i++) bytes += w->bufs[i].len;
  c->inflight -= bytes;
  write_free(w);
  if (status < 0 && status != UV_ECANCELED) conn_end(c, status, 0);
}

/* Our side is shut down (FIN sent). Closing now could reset the connection if
 * the peer still sends, and a reset can make the peer lose bytes we already sent;
 * so keep reading, and close when the peer's EOF arrives (it closes on ours). */
static void shutdown_cb(uv_shutdown_t *req, int status) {
  rh_conn_t *c = req->data;
  /* (a refused stranger is not read again: done once our bytes are out) */
  if (status != 0 || c->reader.gated) conn_end(c, 0, 0);
}

/* An arena above this stays with a write that needs it and is not kept for reuse. */
#define KEEP_ARENA (256u << 10)

/* The largest buffer handed to one write. uv_buf_init takes an unsigned length
 * and the kernel writes at most ~2 GiB per call: a bigger piece (a segment of
 * 4 GiB or more) becomes several buffers of this size, or its length would be
 * cut to 32 bits and the stream would no longer match its frame header. */
static size_t write_split = (size_t)1 << 30;

void rh__conn_set_write_split(size_t bytes) { write_split = bytes ? bytes : (size_t)1 << 30; }

static void conn_flush(rh_conn_t *c) {
  if (c->ring) rh__ring_flush(c);
  if (c->closing || c->npieces == 0) return;
  size_t nbufs = 0;
  for (size_t i = 0; i < c->npieces; i++) nbufs += (c->pieces[i].len + write_split - 1) / write_split;
  if (nbufs > UINT_MAX - 1 || grow((void **)&c->bufs, &c->cbufs, nbufs + 1, sizeof(uv_buf_t))) {
    conn_end(c, RH_ENOMEM, 0);
    return;
  }
  size_t bytes = 0, k = 0;
  for (size_t i = 0; i < c->npieces; i++) {
    rh_piece_t *p = &c->pieces[i];
    char *base = p->ext ? (char *)p->ext : (char *)c->arena + p->off;
    for (size_t done = 0; done < p->len; done += write_split) {
      size_t len = p->len - done < write_split ? p->len - done : write_split;
      c->bufs[k] = uv_buf_init(base + done, 0);
      c->bufs[k++].len = len; /* (set after: uv_buf_init's length is unsigned) */
    }
    bytes += p->len;
  }
  c->net->bytes_out += bytes;
  c->net->writes++;
  uv_buf_t *bufs = c->bufs;
  unsigned n = (unsigned)k;
  /* a descriptor travels inside a libuv handle (uv_write2 sends a handle's fd) */
  uv_pipe_t *fdh = NULL;
  if (c->send_fd >= 0) {
    fdh = malloc(sizeof *fdh);
    int rc = fdh ? uv_pipe_init(c->net->loop, fdh, 0) : RH_ENOMEM;
    if (!rc) rc = uv_pipe_open(fdh, c->send_fd);
    if (rc) {
      close(c->send_fd);
      c->send_fd = -1;
      if (fdh) uv_close((uv_handle_t *)fdh, free_handle);
      drop_queue(c);
      conn_end(c, rc, 0);
      return;
    }
    c->send_fd = -1; /* the handle owns it now */
  }
  /* Write what the socket takes now: when it takes everything (the usual case for
   * small messages) no allocation, write request, callback or extra loop turn is
   * needed, and the queue's buffers stay with the connection for the next flush. */
  if (uv_stream_get_write_queue_size(&c->h.stream) == 0) {
    int done = uv_try_write2(&c->h.stream, bufs, n, (uv_stream_t *)fdh);
    if (done > 0 && fdh) {
      uv_close((uv_handle_t *)fdh, free_handle); /* sent with the first byte */
      fdh = NULL;
    }
    if (done > 0) {
      size_t left = (size_t)done;
      while (n > 0 && left >= bufs->len) {
        left -= bufs->len;
        bufs++;
        n--;
      }
      if (n > 0) {
        bufs->base += left;
        bufs->len -= left;
      }
      bytes -= (size_t)done;
    } else if (done != UV_EAGAIN && done != UV_ENOSYS) {
      if (fdh) uv_close((uv_handle_t *)fdh, free_handle);
      drop_queue(c);
      conn_end(c, done, 0);
      return;
    }
  }
  if (n == 0) {
    drop_queue(c); /* everything is in the kernel: release the tensors now */
    if (c->acap > KEEP_ARENA) {
      free(c->arena);
      c->arena = NULL;
      c->acap = 0;
    }
    return;
  }
  /* The rest goes through uv_write, which needs the bytes until write_cb: hand the
   * arena and releases to the request (one extra zeroed buf ends write_cb's count). */
  rh_write_t *w = calloc(1, sizeof *w + (n + 1) * sizeof(uv_buf_t));
  if (!w) {
    if (fdh) uv_close((uv_handle_t *)fdh, free_handle);
    drop_queue(c);
    conn_end(c, RH_ENOMEM, 0);
    return;
  }
  w->fd_handle = fdh;
  memcpy(w->bufs, bufs, n * sizeof(uv_buf_t));
  w->arena = c->arena;
  w->rel = c->rel;
  w->nrel = c->nrel;
  w->req.data = w;
  c->arena = NULL;
  c->alen = c->acap = 0;
  c->rel = NULL;
  c->nrel = c->crel = 0;
  c->npieces = 0;
  c->inflight += bytes;
  int rc = uv_write2(&w->req, &c->h.stream, w->bufs, n, (uv_stream_t *)fdh, write_cb);
  if (rc) {
    c->inflight -= bytes;
    write_free(w);
    conn_end(c, rc, 0);
  }
}

void rh_net_flush(rh_net_t *net) {
  while (net->dirty) {
    rh_conn_t *c = net->dirty;
    net->dirty = c->next_dirty;
    c->dirty = 0;
    c->next_dirty = NULL;
    conn_flush(c);
    /* (a backlog for the ring goes in before the end: conn_ring.c marks the
     * connection again when it has) */
    if (c->shutting && !c->closing && rh__ring_backlog(c) == 0) {
      c->shutdown_req.data = c;
      if (uv_shutdown(&c->shutdown_req, &c->h.stream, shutdown_cb) != 0) conn_end(c, 0, 0);
    }
  }
}

void rh_net_flush_now(rh_net_t *net) {
  net->defer_close_reports++;
  rh_net_flush(net);
  net->defer_close_reports--;
}

int rh_net_busy(rh_net_t *net) {
  int n = 0;
  for (rh_conn_t *c = net->all; c; c = c->next_all)
    if (!c->closing && (c->shutting || c->inflight > 0 || c->npieces > 0 || rh__ring_backlog(c) > 0)) n++;
  return n;
}

static void unlink_dirty(rh_conn_t *c) {
  if (!c->dirty) return;
  rh_conn_t **pp = &c->net->dirty;
  while (*pp && *pp != c) pp = &(*pp)->next_dirty;
  if (*pp) *pp = c->next_dirty;
  c->dirty = 0;
}

void rh_conn_close(rh_conn_t *c, int graceful) {
  if (c->closing || c->shutting) return;
  if (graceful && uv_is_writable(&c->h.stream)) {
    /* Report now (the owner is done with it); the bytes still go out. A peer
     * that never proved itself is not read again: it ends once its refusal
     * is written (see shutdown_cb). */
    c->shutting = 1;
    if (c->reader.gated) uv_read_stop(&c->h.stream);
    report_close(c, 0, 0);
    mark_dirty(c);
    return;
  }
  unlink_dirty(c);
  conn_end(c, 0, 0);
}

static int addr_name(struct sockaddr_storage *ss, char *ip, size_t iplen, int *port);

/* A Unix-domain socket reaches only this host: it reports as loopback (port 0),
 * so every loopback rule (who may send closures, who may read whose memory)
 * applies to it unchanged. */
static int local_name(char *ip, size_t iplen, int *port) {
  *port = 0;
  snprintf(ip, iplen, "127.0.0.1");
  return 0;
}

/* The user id of the process at the other end of a Unix-domain connection
 * (SO_PEERCRED, as the kernel recorded it at connect); -1 for TCP or unknown. */
long rh_conn_peer_uid(rh_conn_t *c) {
  if (!c->local) return -1;
  uv_os_fd_t fd;
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (uv_fileno(&c->h.handle, &fd) != 0 || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return -1;
  return (long)cred.uid;
}

int rh_conn_peer(rh_conn_t *c, char *ip, size_t iplen, int *port) {
  if (c->local) return local_name(ip, iplen, port);
  struct sockaddr_storage ss;
  int len = sizeof ss;
  int rc = uv_tcp_getpeername(&c->h.tcp, (struct sockaddr *)&ss, &len);
  return rc ? rc : addr_name(&ss, ip, iplen, port);
}

int rh_conn_local(rh_conn_t *c, char *ip, size_t iplen, int *port) {
  if (c->local) return local_name(ip, iplen, port);
  struct sockaddr_storage ss;
  int len = sizeof ss;
  int rc = uv_tcp_getsockname(&c->h.tcp, (struct sockaddr *)&ss, &len);
  return rc ? rc : addr_name(&ss, ip, iplen, port);
}

static int addr_name(struct sockaddr_storage *ss, char *ip, size_t iplen, int *port) {
  if (ss->ss_family == AF_INET6) {
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
    *port = ntohs(a->sin6_port);
    return uv_ip6_name(a, ip, iplen);
  }
  struct sockaddr_in *a = (struct sockaddr_in *)ss;
  *port = ntohs(a->sin_port);
  return uv_ip4_name(a, ip, iplen);
}

/* ---- listeners ---- */

static void listener_closed(uv_handle_t *h) {
  rh_listener_t *l = h->data;
  if (l->sink_busy) {
    l->freeing = 1; /* (sink_closed frees it) */
    return;
  }
  free(l->path);
  free(l);
}

static void sink_take(rh_listener_t *l);

static void sink_closed(uv_handle_t *h) {
  rh_listener_t *l = h->data;
  l->sink_busy = 0;
  if (l->freeing) {
    free(l->path);
    free(l);
  } else if (l->sink_wanted) {
    sink_take(l);
  }
}

/* libuv stops listening until the connection it accepted is taken: one that no
 * rh_conn_t could be made for (out of memory) is taken into the sink and closed.
 * The sink is one handle; a connection that comes while it closes is taken once
 * it has closed. */
static void sink_take(rh_listener_t *l) {
  if (uv_is_closing(&l->h.handle)) return;
  if (l->sink_busy) {
    l->sink_wanted = 1;
    return;
  }
  l->sink_wanted = 0;
  uv_loop_t *loop = l->net->loop;
  if ((l->local ? uv_pipe_init(loop, &l->sink.pipe, 0) : uv_tcp_init(loop, &l->sink.tcp)) != 0) return;
  l->sink_busy = 1;
  l->sink.handle.data = l;
  (void)uv_accept(&l->h.stream, &l->sink.stream);
  uv_close(&l->sink.handle, sink_closed);
}

/* accept found the descriptor table full (EMFILE, ENFILE) and libuv could not
 * shed the waiting connections itself (it does, with a spare descriptor of its
 * own, and calls us only when that is gone): libuv calls accept again at once,
 * and again, until it says EAGAIN, which takes a free descriptor (Linux looks
 * for one before it looks at the queue). So one is freed here, or the loop
 * would spin for ever: the oldest unproven connection's (a flood of them is
 * what fills a table; each newcomer takes the place of the oldest, and the
 * turn's last accept may cost one more), else our spare, which the sweep takes
 * back once a descriptor is free. Only another thread taking the freed
 * descriptor first could still make it spin, as with libuv's own spare. */
static void out_of_descriptors(rh_listener_t *l) {
  rh_net_t *net = l->net;
  rh_conn_t *oldest = NULL;
  for (rh_conn_t *c = net->all; c; c = c->next_all) /* (newest first) */
    if (c->listener && !c->closing) oldest = c;
  if (oldest) {
    conn_end(oldest, RH_ECROWDED, 0); /* (uv_close closes its descriptor at once) */
  } else if (net->spare_fd >= 0) {
    close(net->spare_fd);
    net->spare_fd = -1;
  }
}

/* Removes a Unix-domain listener's socket file, if it is still the one it made:
 * once our TCP port is released another process may take the same port and
 * bind a file of the same name, which must not be removed. */
static void unlink_own(rh_listener_t *l) {
  struct stat st;
  if (l->path && stat(l->path, &st) == 0 && st.st_ino == l->ino && st.st_dev == l->dev) unlink(l->path);
}

static void connection_cb(uv_stream_t *server, int status) {
  rh_listener_t *l = server->data;
  if (status == UV_EMFILE || status == UV_ENFILE) out_of_descriptors(l);
  if (status < 0) return;
  rh_conn_t *c = conn_new(l->net, &l->cbs, NULL, l->local);
  if (!c) {
    sink_take(l);
    return;
  }
  if (uv_accept(server, &c->h.stream) != 0 || start_reading(c) != 0) {
    c->reported = 1; /* never handed out: nobody to tell */
    conn_end(c, 0, 0);
    return;
  }
  /* at the cap, the oldest unproven connection makes room for this one: a
   * stranger's idle connections cannot keep out a joiner, who proves itself
   * within milliseconds */
  if (l->net->max_unproven > 0 && l->nunproven >= l->net->max_unproven) {
    conn_end(l->unproven, RH_ECROWDED, 0);
    if (uv_is_closing(&l->h.handle)) { /* (its owner closed the listener when told) */
      c->reported = 1;
      conn_end(c, 0, 0);
      return;
    }
  }
  c->listener = l;
  if (l->handshake_ms) c->handshake_ms = l->handshake_ms;
  c->prev_unproven = l->unproven_last;
  if (l->unproven_last) l->unproven_last->next_unproven = c;
  else l->unproven = c;
  l->unproven_last = c;
  l->nunproven++;
  l->on_accept(l, c);
}

static rh_listener_t *listener_new(rh_net_t *net, const rh_conn_cbs_t *cbs, rh_accept_fn on_accept, void *data,
                                   int local) {
  rh_listener_t *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  if ((local ? uv_pipe_init(net->loop, &l->h.pipe, 0) : uv_tcp_init(net->loop, &l->h.tcp)) != 0) {
    free(l);
    return NULL;
  }
  l->local = local;
  l->h.handle.data = l;
  l->net = net;
  l->cbs = *cbs;
  l->on_accept = on_accept;
  l->data = data;
  return l;
}

rh_listener_t *rh_listener_new(rh_net_t *net, const rh_conn_cbs_t *cbs, rh_accept_fn on_accept, void *data) {
  return listener_new(net, cbs, on_accept, data, 0);
}

rh_listener_t *rh_listener_new_local(rh_net_t *net, const rh_conn_cbs_t *cbs, rh_accept_fn on_accept, void *data) {
  return listener_new(net, cbs, on_accept, data, 1);
}

void rh_listener_set_handshake_ms(rh_listener_t *l, uint64_t ms) { l->handshake_ms = ms; }

int rh_listener_bind(rh_listener_t *l, const struct sockaddr *addr, int backlog) {
  int rc = uv_tcp_bind(&l->h.tcp, addr, 0);
  if (!rc) rc = uv_listen(&l->h.stream, backlog, connection_cb);
  return rc;
}

/* The socket file is made by bind and removed when the listener closes. A file
 * left there by a process that died is replaced: the caller names its file after
 * something it holds (its TCP port), so no live listener can own that name. */
int rh_listener_bind_local(rh_listener_t *l, const char *path, int backlog) {
  if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) return UV_ENAMETOOLONG;
  unlink(path);
  int rc = uv_pipe_bind(&l->h.pipe, path);
  if (!rc) {
    struct stat st;
    l->path = strdup(path);
    if (l->path && stat(path, &st) == 0) {
      l->ino = st.st_ino;
      l->dev = st.st_dev;
    }
    rc = uv_listen(&l->h.stream, backlog, connection_cb);
  }
  return rc;
}

int rh_listener_port(rh_listener_t *l) {
  if (l->local) return 0;
  struct sockaddr_storage ss;
  int len = sizeof ss;
  if (uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&ss, &len) != 0) return -1;
  if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  return ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

void *rh_listener_data(rh_listener_t *l) { return l->data; }

int rh_listener_unproven(rh_listener_t *l) { return l->nunproven; }

void rh_listener_close(rh_listener_t *l) {
  if (uv_is_closing(&l->h.handle)) return;
  /* its unproven connections stay (until their proof or deadline), uncounted */
  while (l->unproven) unproven_unlink(l->unproven);
  unlink_own(l); /* now, while the caller still holds the TCP port the name is made of */
  uv_close(&l->h.handle, listener_closed);
}
