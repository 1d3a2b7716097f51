/* conn_ring.c: the same-host fast path of a connection. Once two ranks on one
 * host have proved each other over a Unix-domain socket, the server makes a
 * memory file holding two byte rings (ring.h), passes its descriptor with the
 * handshake's verdict, and both map it (rh_conn_ring_attach). From then on
 * small frames are copied into the ring and out of it, without a system call;
 * the socket stays for the connection's lifetime and carries descriptors, the
 * frames too big for the ring, and the doorbells.
 *
 * Order across the two paths: every frame that goes by the socket leaves a
 * marker frame (RH_FRAME_RING_MARK, header only) at its place in the ring, and
 * the reader takes exactly one socket frame for each marker it reads, at that
 * point (socket frames that arrive before their marker wait in the socket's
 * reader). So the peer sees frames in the order they were sent, whichever path
 * each took.
 *
 * Polling and sleeping, in one libuv loop, no threads: every ring is read before
 * each poll (the net's prepare handle). While there was ring traffic within the
 * last RPCHOST_SPIN_US, an idle handle keeps the loop from blocking, so a
 * reply is seen microseconds after it is written (uv_hrtime: uv_now's 1 ms is too
 * coarse). How a spin turn that finds nothing treats the core depends on who
 * else wants it (rh_net_polite): while the host has more runnable tasks than
 * cores (counted every 2 ms: /proc/loadavg's running tasks; four ranks on two
 * cores of which two sleep leave a core to each of the others), or while other
 * processes keep switching this one out, it yields (the
 * rank it waits for may need the core; and the kernel favours a task that used
 * less CPU, so a rank that polls on under contention is served last: a reply
 * waited a whole time slice). With a core to itself it polls the rings alone,
 * without a system call, for bursts of up to SPIN_BURST_NS between the loop's
 * turns (each an epoll_wait): a frame is seen nanoseconds after its write, not a
 * turn of the loop later. (Open MPI polls so, and yields when oversubscribed.)
 * Between the loop's turns the scheduler polls the rings alone too
 * (rh_net_ring_turn): the reply a task waits for is handed out without the rest
 * of a loop turn each time, the loop still turning every SPIN_BURST_NS.
 * After the window, each ring's `sleeping` flag is set and the
 * ring checked once more (ring.h), and the loop blocks in epoll; a producer that
 * sees the flag sends a doorbell: a header-only frame (RH_FRAME_RING_WAKE) on
 * the socket, which wakes the loop and is swallowed here. A doorbell goes out
 * once per sleep, with the flush that ends the loop turn, so an active world
 * makes no system call per frame and an idle rank costs nothing.
 *
 * Full ring: bytes that do not fit wait in a local backlog (in order, never
 * dropped, the loop never blocks) and go in as the peer frees space; a producer
 * about to sleep with a backlog sets `want_space` and the consumer rings back.
 *
 * Bad input: the ring's counters and contents come from another process and are
 * checked like bytes from the network (ring.c); its frames pass the socket's
 * gate (frame.c's decode_checked, through an rh_reader_t); a violation closes
 * the connection with RH_ERING. A dead peer is noticed by the socket's EOF, as
 * without rings, after the ring's last frames are read. */
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <string.h>
#include <unistd.h>

#include "conn_priv.h"

/* Bytes of data in each direction, and the largest frame prefix (header, body
 * and segment table) that goes through the ring. A frame's payload segments
 * stream through it up to ring_stream_max() in all, bigger than the ring
 * itself: what does not fit waits in the backlog and follows as the reader
 * frees space, and the reader copies segment bytes straight into the storage
 * they become (its allocator), so a payload costs one copy in and one out, with
 * no system call. Bigger frames take the socket (which reads them straight into
 * place), or, from rpchost.net.shm's threshold up, a shared-memory segment of
 * their own. (Through the socket, a frame of 16-128 KiB waited for the reader's
 * next loop turn and several reads: a 64 KiB tensor's echo took 85 us, through
 * a 64 KiB ring 31 us, through a 1 MiB one 24 us; 256 KiB gave 31 us. The file
 * is sparse: a pair's pages are made as its traffic first reaches them, TensorPipe's
 * rings are 2 MiB.) */
#define RING_CAP (1u << 20)
#define RING_FRAME_MAX (RING_CAP / 4)
#define RING_REWIND_FRAME (16u << 10) /* frames up to this rewind an empty ring */
static uint64_t ring_stream_max(void) {
  static uint64_t v = 0;
  if (!v) {
    const char *e = getenv("RPCHOST_RING_STREAM");
    v = e && *e ? strtoull(e, NULL, 10) : 4 * (uint64_t)RING_CAP;
    if (v < RING_FRAME_MAX) v = RING_FRAME_MAX;
  }
  return v;
}
/* markers read whose socket frame has not arrived: an honest peer has at most
 * one per big frame in flight */
#define MAX_MARKS (1u << 20)
/* the longest a spin turn polls the rings alone (sockets and timers wait that
 * long at most, while a ring is busy) */
#define SPIN_BURST_NS 20000u
/* a thread switched out involuntarily within this long is contended */
#define CONTENTION_NS 2000000u

typedef struct rh_conn_ring_s {
  rh_conn_t *c;
  struct rh_conn_ring_s *next, *prev; /* on net->rings */
  rh_shm_t *seg;
  rh_ring_t tx, rx;
  rh_reader_t reader; /* frames out of rx */
  uint8_t *backlog;   /* bytes for tx that did not fit yet */
  size_t boff, blen, bcap;
  uint32_t marks; /* markers read whose socket frame is not handed out yet */
  int wake;       /* a doorbell is owed to the peer (with the next flush) */
} rh_conn_ring_t;

static void ring_fail(rh_conn_t *c, int rc) { rh__conn_end(c, rc == RH_ENOMEM ? rc : RH_ERING, 0); }

/* ---- spinning and sleeping ---- */

/* The host's runnable tasks now (the fourth field of /proc/loadavg, this
 * thread included), or -1 when it cannot be read. */
static int host_runnable(rh_net_t *net) {
  if (net->loadavg_fd == -2) net->loadavg_fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (net->loadavg_fd < 0) return -1;
  char b[128];
  ssize_t n = pread(net->loadavg_fd, b, sizeof b - 1, 0);
  if (n <= 0) return -1;
  b[n] = 0;
  /* "0.52 0.58 0.59 2/97 12345": the running count before the slash */
  const char *s = b;
  for (int k = 0; k < 3 && s; k++) {
    s = strchr(s, ' ');
    if (s) s++;
  }
  if (!s || *s < '0' || *s > '9') return -1;
  return atoi(s);
}

int rh_net_polite(rh_net_t *net, uint64_t now) {
  if (net->ring_yield) return 1;
  if (now - net->csw_at >= CONTENTION_NS) {
    /* (a yield that ran another process counts as an involuntary switch too:
     * polite turns keep finding out whether the contention lasts) */
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) == 0) {
      uint64_t n = (uint64_t)ru.ru_nivcsw;
      net->contended = net->csw_at != 0 && n != net->csw_last;
      net->csw_last = n;
    }
    if (!net->contended && net->ring_auto) {
      int n = host_runnable(net);
      net->contended = n < 0 ? net->ring_crowded : n > net->host_cpus;
    }
    net->csw_at = now;
  }
  return net->contended;
}

/* The end of a burst begun at `from`: SPIN_BURST_NS on, but never past the
 * polling window that the last ring traffic opened. */
static uint64_t window_end(const rh_net_t *net) {
  uint64_t end = net->ring_last + net->ring_spin_ns;
  return net->ahead_until > end ? net->ahead_until : end;
}
static uint64_t burst_end(const rh_net_t *net, uint64_t from) {
  uint64_t until = from + SPIN_BURST_NS, end = window_end(net);
  return end < until ? end : until;
}

/* A frame came through a ring: the polling window runs on from now, and a
 * wake-ahead's own window has done its job. */
static void traffic(rh_net_t *net, uint64_t now) {
  net->ring_found = 0;
  net->ring_last = now;
  net->ahead_until = 0;
}

/* Polls the rings alone until one has a frame or uv_hrtime() reaches until
 * (with once, a single look): 1 when one had, ring_last then being now. */
static int ring_burst(rh_net_t *net, uint64_t until, int once) {
  for (;;) {
    rh__rings_poll(net);
    if (net->ring_found) {
      traffic(net, uv_hrtime());
      return 1;
    }
    /* (no pause between looks, as in the arena's spin, bindings/l_arena.c:
     * a look at lines in this core's cache costs nothing until they change) */
    if (once || uv_hrtime() >= until) return 0;
  }
}

static void spin_cb(uv_idle_t *h) {
  rh_net_t *net = h->data;
  /* the rings first: what arrived is handed out before this turn yields
   * (unless the scheduler polls them itself right after this turn, where what
   * a frame makes ready may run at once: rpchost.sched.frame_done) */
  if (!net->sched_polls) rh__rings_poll(net);
  uint64_t now = uv_hrtime();
  if (net->ring_found) {
    traffic(net, now);
    return;
  }
  if (now < window_end(net)) {
    if (rh_net_polite(net, now)) {
      sched_yield(); /* nothing this turn: another rank on this core may have work */
      net->ring_yielded = 1;
      return;
    }
    /* a core of our own: the rings alone for a moment (see the top) */
    if (!net->sched_polls) ring_burst(net, burst_end(net, now), 0);
    return;
  }
  /* every ring must agree to sleep: set the flags, then look once more */
  int awake = 0;
  for (rh_conn_ring_t *r = net->rings, *next; r; r = next) {
    next = r->next;
    if (r->c->closing) continue;
    /* (every open ring gets its flag, so that its peer rings when it writes;
     * but bytes waiting in a paused connection's ring, or behind a marker whose
     * socket frame has not come, keep nobody polling: the resume, or the socket
     * bringing that frame, reads them) */
    int s = rh_ring_sleep(&r->rx);
    if (s < 0) {
      ring_fail(r->c, s);
      continue;
    }
    if (s == 0 && !r->c->paused && !r->marks) awake = 1;
    if (r->blen > r->boff && !rh_ring_wait_space(&r->tx)) awake = 1;
  }
  if (awake) {
    for (rh_conn_ring_t *r = net->rings; r; r = r->next) rh_ring_awake(&r->rx);
    net->ring_last = now;
    return;
  }
  uv_idle_stop(h);
  net->spinning = 0;
  net->ahead_until = 0;
}

/* The rings alone, from the scheduler between the loop's turns: a reply that
 * the last turn's poll found handed out, the task it wakes runs, its next
 * request goes into the ring, and the answer is polled for here, without the
 * rest of a loop turn (prepare and check hooks, an epoll_wait) each time. The
 * loop still turns at least every SPIN_BURST_NS, as while spin_cb's bursts
 * run: sockets and timers wait no longer than they would. */
int rh_net_ring_turn(rh_net_t *net) {
  if (!net->spinning || !net->rings) return -1;
  uint64_t now = uv_hrtime();
  /* (when the loop's turn is due, the rings still get one look first, and the
   * turn follows whatever it found: the scheduler's turns leave the rings to
   * this poll, "spin", so a loop kept busy by sockets and tasks past
   * SPIN_BURST_NS every time would otherwise never read them) */
  int due = now - net->loop_turn_at >= SPIN_BURST_NS || now >= window_end(net);
  rh_net_flush_now(net); /* (what the tasks queued, doorbells included: the prepare hook's job) */
  /* (a polite rank looks once: its core may be another's) */
  net->in_ring_turn = 1;
  int found = ring_burst(net, burst_end(net, net->loop_turn_at), due || rh_net_polite(net, now));
  net->in_ring_turn = 0;
  return found && !due ? 1 : -1;
}

int rh_net_rings_buffered(const rh_net_t *net) {
  for (const rh_conn_ring_t *r = net->rings; r; r = r->next)
    if (!r->c->closing && r->reader.len > r->reader.off) return 1;
  return 0;
}

void rh__rings_start_polling(rh_net_t *net) {
  if (net->spinning || !net->rings || uv_is_closing((uv_handle_t *)&net->spin)) return;
  net->spinning = 1;
  for (rh_conn_ring_t *r = net->rings; r; r = r->next) rh_ring_awake(&r->rx);
  uv_idle_start(&net->spin, spin_cb);
}

/* Ring traffic: keep the loop polling for a while. */
static void activity(rh_net_t *net) {
  net->ring_found = 1;
  if (net->spinning) return;
  net->ring_last = uv_hrtime();
  rh__rings_start_polling(net);
}

void rh__rings_init(rh_net_t *net) {
  net->rings = NULL;
  net->spinning = net->ring_found = 0;
  net->loadavg_fd = -2;
  if (!net->ring_spin_ns) net->ring_spin_ns = 60000; /* (RPCHOST_SPIN_US's default) */
  uv_idle_init(net->loop, &net->spin);
  net->spin.data = net;
  uv_unref((uv_handle_t *)&net->spin); /* polling alone keeps no loop alive */
}

void rh__rings_close(rh_net_t *net) {
  if (net->loadavg_fd >= 0) close(net->loadavg_fd);
  net->loadavg_fd = -1;
  if (!uv_is_closing((uv_handle_t *)&net->spin)) uv_close((uv_handle_t *)&net->spin, NULL);
}

/* ---- writing ---- */

static int backlog_put(rh_conn_ring_t *r, const uint8_t *p, size_t len) {
  if (r->boff == r->blen) r->boff = r->blen = 0;
  if (r->blen + len > r->bcap) {
    if (r->boff > 0) {
      memmove(r->backlog, r->backlog + r->boff, r->blen - r->boff);
      r->blen -= r->boff;
      r->boff = 0;
    }
    size_t ncap = r->bcap ? r->bcap : RING_CAP;
    while (ncap < r->blen + len) ncap *= 2;
    if (ncap > r->bcap) {
      uint8_t *nb = realloc(r->backlog, ncap);
      if (!nb) return RH_ENOMEM;
      r->backlog = nb;
      r->bcap = ncap;
    }
  }
  memcpy(r->backlog + r->blen, p, len);
  r->blen += len;
  return 0;
}

/* After bytes went into the ring: a sleeping peer gets a doorbell. */
static void published(rh_conn_ring_t *r) {
  if (rh_ring_wake_needed(&r->tx)) {
    r->wake = 1;
    rh__conn_mark_dirty(r->c);
  }
}

/* Bytes in stream order: into the ring when nothing waits before them. */
static int emit(rh_conn_ring_t *r, const void *p, size_t len) {
  size_t put = 0;
  if (r->boff == r->blen) {
    int rc = rh_ring_write(&r->tx, p, len, &put);
    if (rc) return rc;
  }
  return put < len ? backlog_put(r, (const uint8_t *)p + put, len - put) : 0;
}

/* The backlog into the ring, as far as it goes. */
static int drain(rh_conn_ring_t *r) {
  if (r->boff == r->blen) return 0;
  size_t put;
  int rc = rh_ring_write(&r->tx, r->backlog + r->boff, r->blen - r->boff, &put);
  if (rc) return rc;
  r->boff += put;
  if (put) published(r);
  if (r->boff == r->blen) {
    r->boff = r->blen = 0;
    if (r->bcap > RING_CAP) { /* a burst's buffer is not kept */
      free(r->backlog);
      r->backlog = NULL;
      r->bcap = 0;
    }
    if (r->c->shutting) rh__conn_mark_dirty(r->c); /* its shutdown waited for this */
  }
  return 0;
}

int rh__ring_send(rh_conn_t *c, const uint8_t *hdr, const void *body, uint32_t body_len, const uv_buf_t *segs,
                  uint32_t nseg, const rh_frame_hdr_t *h, int by_socket) {
  rh_conn_ring_t *r = c->ring;
  activity(c->net);
  /* a small frame into an empty ring starts over at its first pages (ring.h,
   * "Rewinding"): a connection that carries small frames keeps a few of its
   * pages resident and in the cache, not all of them */
  uint64_t total = rh_frame_total(h);
  if (r->boff == r->blen && total <= RING_REWIND_FRAME) {
    int rc = rh_ring_rewind(&r->tx);
    if (rc) return rc;
  }
  uint64_t prefix = RH_FRAME_HDR + (uint64_t)h->body_len + 8ull * h->nseg;
  if (by_socket || prefix > RING_FRAME_MAX || total > ring_stream_max()) {
    /* the frame takes the socket; its place in the stream is kept here */
    c->by_socket++;
    rh_frame_hdr_t m = {.version = c->net->version, .type = RH_FRAME_RING_MARK};
    uint8_t mh[RH_FRAME_HDR];
    rh_frame_encode_header(mh, &m);
    int rc = emit(r, mh, sizeof mh);
    if (!rc) published(r);
    return rc ? rc : 0;
  }
  int rc = emit(r, hdr, RH_FRAME_HDR);
  if (!rc && body_len) rc = emit(r, body, body_len);
  for (uint32_t i = 0; !rc && i < nseg; i++) {
    uint8_t l[8];
    for (int k = 0; k < 8; k++) l[k] = (uint8_t)((uint64_t)segs[i].len >> (8 * k));
    rc = emit(r, l, 8);
  }
  for (uint32_t i = 0; !rc && i < nseg; i++)
    if (segs[i].len) rc = emit(r, segs[i].base, segs[i].len);
  if (rc) return rc;
  published(r);
  c->by_ring++;
  return 1;
}

void rh__ring_flush(rh_conn_t *c) {
  rh_conn_ring_t *r = c->ring;
  if (!r || c->closing) return;
  int rc = drain(r);
  if (rc) {
    ring_fail(c, rc);
    return;
  }
  if (r->wake) {
    r->wake = 0;
    rh_frame_hdr_t w = {.version = c->net->version, .type = RH_FRAME_RING_WAKE};
    uint8_t wh[RH_FRAME_HDR];
    rh_frame_encode_header(wh, &w);
    if (rh__conn_arena_put(c, wh, sizeof wh)) rh__conn_end(c, RH_ENOMEM, 0);
  }
}

size_t rh__ring_backlog(const rh_conn_t *c) { return c->ring ? c->ring->blen - c->ring->boff : 0; }

/* ---- reading ---- */

int rh__ring_swallow(rh_conn_t *c) {
  rh_frame_hdr_t h;
  if (rh_reader_peek(&c->reader, &h) != 1 || h.type != RH_FRAME_RING_WAKE || h.body_len || h.nseg) return 0;
  rh_frame_t f;
  rh_reader_next(&c->reader, &f);
  activity(c->net);
  return 1;
}

int rh__ring_announced(rh_conn_t *c) { return c->ring->marks > 0; }
void rh__ring_took(rh_conn_t *c) { c->ring->marks--; }

void rh__ring_poll(rh_conn_t *c) {
  rh_conn_ring_t *r = c->ring;
  rh_frame_t f;
  for (;;) {
    if (c->closing || c->paused) return;
    if (r->marks) {
      /* the socket's frame comes first */
      rh__conn_deliver(c);
      if (c->closing || r->marks) return;
      continue;
    }
    int rc = rh_reader_next(&r->reader, &f);
    if (rc < 0) {
      ring_fail(c, rc);
      return;
    }
    if (rc == 1) {
      if (f.hdr.type == RH_FRAME_RING_MARK || f.hdr.type == RH_FRAME_RING_WAKE) {
        if (f.hdr.type == RH_FRAME_RING_WAKE || f.hdr.body_len || f.hdr.nseg || r->marks >= MAX_MARKS) {
          ring_fail(c, RH_ERING);
          return;
        }
        r->marks++;
        continue;
      }
      c->net->ring_found = 1;
      rh__conn_hand_out(c, &f);
      continue;
    }
    int64_t n = rh_ring_avail(&r->rx);
    if (n < 0) {
      ring_fail(c, (int)n);
      return;
    }
    if (n == 0) return;
    uint8_t *p;
    size_t room;
    size_t want = n < RING_CAP ? (size_t)n : RING_CAP;
    if (rh_reader_space(&r->reader, want, &p, &room) != 0) {
      ring_fail(c, RH_ENOMEM);
      return;
    }
    size_t k = (uint64_t)n < room ? (size_t)n : room;
    rh_ring_read(&r->rx, p, k);
    rh_reader_commit(&r->reader, k);
    activity(c->net);
    if (rh_ring_space_wanted(&r->rx)) {
      r->wake = 1;
      rh__conn_mark_dirty(c);
    }
  }
}

void rh__rings_poll(rh_net_t *net) {
  for (rh_conn_ring_t *r = net->rings, *next; r; r = next) {
    next = r->next;
    if (r->c->closing) continue;
    int rc = drain(r);
    if (rc) {
      ring_fail(r->c, rc);
      continue;
    }
    rh__ring_poll(r->c);
  }
}

/* ---- set-up and end ---- */

rh_shm_t *rh_conn_ring_segment(int *err) {
  rh_shm_t *s = rh_shm_create_sparse(rh_ring_file_size(RING_CAP), err);
  if (s) rh_ring_format(s->map, RING_CAP);
  return s;
}

int rh_conn_ring_attach(rh_conn_t *c, rh_shm_t *seg, int creator) {
  if (c->closing || c->shutting) return RH_ECLOSED;
  if (c->ring || !c->local) return UV_EINVAL;
  rh_conn_ring_t *r = calloc(1, sizeof *r);
  if (!r) return RH_ENOMEM;
  int rc = rh_ring_open(seg->map, seg->size, creator, &r->tx, &r->rx);
  if (rc) {
    free(r);
    return rc;
  }
  r->c = c;
  r->seg = seg;
  rh_shm_retain(seg);
  /* the mapping is all the connection needs: the creator's descriptor has been
   * passed (sent as a duplicate), and a rank with many peers should not hold
   * one per connection */
  if (seg->fd >= 0) {
    close(seg->fd);
    seg->fd = -1;
  }
  rh_net_t *net = c->net;
  /* (a ring carries no frame above ring_stream_max: a header in it announcing
   * more is a corrupt ring, and nothing bigger is ever allocated for one) */
  rh_reader_init(&r->reader, ring_stream_max(), net->version);
  rh_reader_open_gate(&r->reader); /* (only proven peers get a ring) */
  if (net->seg_alloc) rh_reader_set_alloc(&r->reader, net->seg_alloc, net->seg_free, net->seg_ctx);
  r->next = net->rings;
  if (net->rings) net->rings->prev = r;
  net->rings = r;
  c->ring = r;
  activity(net); /* the peer may have written already */
  return 0;
}

int rh_conn_has_ring(rh_conn_t *c) { return c->ring != NULL; }

void rh_conn_ring_counts(const rh_conn_t *c, uint64_t *by_ring, uint64_t *by_socket) {
  *by_ring = c->by_ring;
  *by_socket = c->by_socket;
}

void rh__ring_free(rh_conn_t *c) {
  rh_conn_ring_t *r = c->ring;
  if (!r) return;
  rh_net_t *net = c->net;
  if (r->prev) r->prev->next = r->next;
  else net->rings = r->next;
  if (r->next) r->next->prev = r->prev;
  rh_reader_free(&r->reader);
  free(r->backlog);
  rh_shm_release(r->seg);
  free(r);
  c->ring = NULL;
  if (!net->rings && net->spinning) {
    uv_idle_stop(&net->spin);
    net->spinning = 0;
  }
}

/* ---- for specs that play a broken or hostile peer ---- */

int rh_conn_ring_raw(rh_conn_t *c, const void *data, size_t len) {
  if (!c->ring || c->closing) return RH_ECLOSED;
  int rc = emit(c->ring, data, len);
  if (!rc) published(c->ring);
  return rc;
}

int rh_conn_ring_poke(rh_conn_t *c, int which, uint64_t value) {
  if (!c->ring || c->closing) return RH_ECLOSED;
  /* (our own position too: a broken peer stays broken, its next write does not
   * put the right value back) */
  rh_ring_t *r = which == 0 ? &c->ring->tx : &c->ring->rx;
  r->pos = value;
  __atomic_store_n(which == 0 ? r->tail : r->head, value, __ATOMIC_RELEASE);
  if (which == 0) {
    c->ring->wake = 1; /* make sure the peer looks */
    rh__conn_mark_dirty(c);
  }
  return 0;
}
