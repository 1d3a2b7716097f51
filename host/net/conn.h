/* conn.h: framed TCP connections and listeners over libuv.
 *
 * A connection owns its uv_tcp_t, a frame reader and an output queue. Frames sent
 * during one loop iteration are queued and written together with one vectored
 * write just before the loop polls (a prepare handle), so a burst of small calls
 * costs one system call. Small parts (header, body) are copied into an arena; large
 * parts (segments) are referenced, and their owner is told when the write is done.
 *
 * Lifetime (libuv's rule): the struct is freed only in the close callback; the
 * owner learns of the end through on_close, exactly once, before that. */
#ifndef RH_CONN_H
#define RH_CONN_H

#include <uv.h>

#include "frame.h"

typedef struct rh_conn_s rh_conn_t;
typedef struct rh_listener_s rh_listener_t;
typedef struct rh_net_s rh_net_t;

/* Called when the write holding a referenced segment is done (or dropped). */
typedef void (*rh_release_fn)(void *ctx);

typedef struct {
  /* A whole frame arrived; f points into the reader, valid during the call. */
  void (*on_frame)(rh_conn_t *c, const rh_frame_t *f);
  /* The connection is over: status 0 (peer closed or local close) or an error code;
   * peer_version is set for RH_EVERSION. Called once. */
  void (*on_close)(rh_conn_t *c, int status, int peer_version);
  /* Outgoing connection established (status 0) or failed. */
  void (*on_connect)(rh_conn_t *c, int status);
} rh_conn_cbs_t;

struct rh_net_s {
  uv_loop_t *loop;
  uv_prepare_t flush;    /* writes out queued frames before each poll */
  rh_conn_t *dirty;      /* connections with queued output */
  rh_conn_t *all;        /* every connection not yet freed */
  rh_conn_t *resumed;    /* resumed connections with frames still buffered */
  uv_timer_t sweep;      /* closes connections whose handshake is past its deadline */
  uint64_t handshake_ms; /* that deadline (default 10 s) */
  /* Seconds after which a TCP peer whose host acknowledges nothing is taken as
   * gone (RPCHOST_HEARTBEAT; 0: never, the kernel's own hours). The kernel
   * keeps it (keepalive probes on a quiet connection, a bound on unacknowledged
   * data, on SYNs too): no timer or byte of ours, so an idle rank stays idle
   * and a peer busy computing is not taken for dead (its kernel answers). */
  unsigned liveness_s;
  /* How many accepted connections one listener holds before they prove
   * themselves: at the cap a new one closes the oldest (0: no cap). A stranger
   * holding idle connections would otherwise fill the descriptor table and
   * keep real joiners out, who prove themselves within milliseconds. Default
   * (rh_net_init): a sixteenth of the descriptor limit, at most 256 and at
   * least 16; RPCHOST_MAX_UNPROVEN sets it (l_main.c). */
  int max_unproven;
  int spare_fd; /* a descriptor kept to give back when accept finds none (EMFILE) */
  uint64_t max_frame;
  uint8_t version; /* protocol version stamped on and expected in frames */
  /* where incoming segments are read to (NULL: into the frame buffer) */
  rh_seg_alloc_fn seg_alloc;
  rh_seg_free_fn seg_free;
  void *seg_ctx;
  uint64_t bytes_out, bytes_in;
  uint64_t writes; /* flushes that reached the socket (one vectored write each) */
  /* > 0 inside rh_conn_send and rh_net_flush_now, whose callers must not be
   * re-entered: a connection that fails there reports its end from libuv's
   * close callback instead of at once */
  int defer_close_reports;
  /* same-host shared-memory rings (conn_ring.c) */
  struct rh_conn_ring_s *rings; /* every connection that has one */
  uv_idle_t spin;               /* keeps the loop polling while rings are busy */
  uint64_t ring_last;           /* uv_hrtime of the last ring traffic */
  uint64_t ring_spin_ns;        /* how long to poll after it (RPCHOST_SPIN_US) */
  int spinning, ring_found;
  int ring_yielded; /* the rings' poll gave the core away this turn (sched_yield) */
  /* How a polling rank treats its core (conn_ring.c, rh_net_polite): it gives
   * the core away on every empty turn (sched_yield) when told to (ring_yield,
   * RPCHOST_SPIN_YIELD=1; l_main.c), or while the cores are wanted by others:
   * the thread was switched out involuntarily within the last CONTENTION_NS,
   * or (ring_auto, the default) the machine had more runnable tasks than
   * online CPUs (host_cpus) when last counted (/proc/loadavg; where it cannot
   * be read, ring_crowded says whether this host's ranks may outnumber its
   * cores); otherwise it polls the rings alone, without a system call, for
   * bursts. Counted, not assumed: four ranks on two cores of which two are
   * idle (asleep in epoll) leave a core to each of the other two. */
  int ring_yield, ring_auto, ring_crowded, host_cpus, contended;
  int loadavg_fd;            /* /proc/loadavg, kept open (-2: not opened yet, -1: unreadable) */
  uint64_t loop_turn_at;     /* uv_hrtime when the loop last began a turn (rh_net_ring_turn) */
  int sched_polls;           /* that turn is the scheduler's between its own polls of the rings
                              * (rh_net_ring_turn): the turn leaves the rings to them */
  int in_ring_turn;          /* rh_net_ring_turn is handing frames out (the loop must not run then) */
  uint64_t csw_at, csw_last; /* when the switches were last counted, and how many */
  /* Waking ahead (wake_ahead.c): a rank whose answers come regularly later
   * than its polling window sleeps until just before the next is due, then
   * polls the rings for ahead_spin_ns (ahead_until), so that the answer is
   * seen as it lands instead of a kernel wake-up after it. */
  int ahead_fd;           /* a timerfd (-1: none, waking ahead is off) */
  uv_poll_t ahead;        /* its readiness, in the loop */
  uint64_t ahead_at;      /* uv_hrtime it is armed for (0: not armed) */
  uint64_t ahead_spin_ns; /* how long to poll once it fires */
  uint64_t ahead_until;   /* polling lasts until then (0: not waking ahead) */
  uint64_t ahead_late;    /* how late the last firing woke the loop, ns */
};

int rh_net_init(rh_net_t *net, uv_loop_t *loop, uint64_t max_frame, uint8_t version);
/* A turn of the rings alone, between the loop's turns (conn_ring.c): while they
 * are busy, write out what is queued and poll the rings (for a burst, where the
 * core is ours and the loop ran within the last SPIN_BURST_NS; a single look
 * otherwise); 1 when frames were handed out and the loop's turn is not due,
 * else -1: the caller runs a turn of the loop (which serves sockets and
 * timers, yields, or sleeps). The caller notes each turn of the loop in
 * loop_turn_at. */
int rh_net_ring_turn(rh_net_t *net);
/* Whether a ring's reader holds bytes it has not handed out yet (the frames
 * that came with the one being handed out, read in the same look): 1 or 0. */
int rh_net_rings_buffered(const rh_net_t *net);
/* Whether a rank that polls with nothing to do should give its core away now
 * (see ring_yield above); `now` is uv_hrtime(). */
int rh_net_polite(rh_net_t *net, uint64_t now);
/* Arms the wake-ahead timer for uv_hrtime `at` (ns) to poll the rings for
 * spin_ns from then: 0; where `at` has come already, the rings are polled
 * until at + spin_ns, with no timer: 1 (2 where that has passed too: nothing
 * to do). at = 0 disarms the timer and ends such polling (0). A
 * negative errno where it fails (-EINVAL: this net has no timer, or no rings
 * to poll; -EAGAIN: others want the cores now, rh_net_polite). */
int rh_net_wake_ahead(rh_net_t *net, uint64_t at, uint64_t spin_ns);
void rh_net_close(rh_net_t *net);
/* Writes all queued output now (also done automatically before each poll). */
void rh_net_flush(rh_net_t *net);
/* The same from outside a loop callback (a Lua task): a connection that fails
 * meanwhile reports its end later, from the loop, not inside this call. */
void rh_net_flush_now(rh_net_t *net);
/* Connections that still have bytes to write or a graceful close to finish. */
int rh_net_busy(rh_net_t *net);

/* Connections. `data` is the owner's pointer. */
rh_conn_t *rh_conn_new(rh_net_t *net, const rh_conn_cbs_t *cbs, void *data);
int rh_conn_connect(rh_conn_t *c, const struct sockaddr *addr);
/* the same over a Unix-domain socket at `path` (this host only) */
rh_conn_t *rh_conn_new_local(rh_net_t *net, const rh_conn_cbs_t *cbs, void *data);
int rh_conn_connect_local(rh_conn_t *c, const char *path);
int rh_conn_is_local(rh_conn_t *c);
void *rh_conn_data(rh_conn_t *c);
void rh_conn_set_data(rh_conn_t *c, void *data);
/* Queue one frame. body is copied; segments are referenced until written, then
 * release(release_ctx) runs (also when the connection dies first). A failure
 * here is returned; on_close runs later, from the loop. */
int rh_conn_send(rh_conn_t *c, uint8_t type, uint16_t flags, uint64_t id, const void *body, uint32_t body_len,
                 const uv_buf_t *segs, uint32_t nseg, rh_release_fn release, void *release_ctx);
/* The same, with a file descriptor passed to the peer alongside (SCM_RIGHTS;
 * Unix-domain connections only). fd stays the caller's: a duplicate travels. */
int rh_conn_send_fd(rh_conn_t *c, int fd, uint8_t type, uint16_t flags, uint64_t id, const void *body,
                    uint32_t body_len, const uv_buf_t *segs, uint32_t nseg, rh_release_fn release, void *release_ctx);
/* Queues bytes as they are, outside any frame (specs that play a hostile peer). */
int rh_conn_send_raw(rh_conn_t *c, const void *data, size_t len);
/* The oldest descriptor the peer sent that no frame has taken, now the
 * caller's to close; -1 when there is none. */
int rh_conn_take_fd(rh_conn_t *c);
/* Graceful: queued output is written first, then the stream is shut down. */
void rh_conn_close(rh_conn_t *c, int graceful);
int rh_conn_peer(rh_conn_t *c, char *ip, size_t iplen, int *port);
/* The local address of the connection (the interface that reaches the peer). */
int rh_conn_local(rh_conn_t *c, char *ip, size_t iplen, int *port);
int rh_conn_is_open(rh_conn_t *c);
/* Every connection starts gated: until its owner calls rh_conn_prove (the peer
 * has proved itself), only small handshake frames are read (see frame.h), and
 * the connection is closed if that has not happened within net->handshake_ms
 * (or its listener's own deadline: rh_listener_set_handshake_ms).
 * An accepted one also counts towards its listener's net->max_unproven until
 * then (the oldest is closed, with RH_ECROWDED, when a new one would pass it). */
void rh_conn_prove(rh_conn_t *c);
int rh_conn_is_proven(rh_conn_t *c);
/* Stops reading (backpressure) / starts again; buffered frames are handed out
 * from the loop after a resume. A connection still gated is never paused: it
 * may hold only small handshake frames, and a paused stranger's EOF would go
 * unread (it would sit in CLOSE-WAIT, holding its descriptor). */
void rh_conn_pause(rh_conn_t *c);
void rh_conn_resume(rh_conn_t *c);
/* The peer process's uid on a Unix-domain connection, -1 otherwise. */
long rh_conn_peer_uid(rh_conn_t *c);
size_t rh_conn_queued(rh_conn_t *c);
/* Tests only: the largest buffer one write is given (0: the default, 1 GiB), so
 * that the splitting of big segments can be exercised with small ones. */
void rh__conn_set_write_split(size_t bytes);

/* Same-host rings (conn_ring.c): a memory file with a pair of empty rings, made
 * by the side that offers them (NULL with *err, a negative errno, on failure);
 * attaching it makes small frames of a proven Unix-domain connection travel
 * through shared memory, in order with those that still take the socket. The
 * connection keeps a reference to seg; creator: 1 on the side that made it. */
struct rh_shm_s;
struct rh_shm_s *rh_conn_ring_segment(int *err);
int rh_conn_ring_attach(rh_conn_t *c, struct rh_shm_s *seg, int creator);
int rh_conn_has_ring(rh_conn_t *c);
/* Frames this side sent through its ring, and past it on the socket (too big
 * for the ring, or carrying a descriptor), since the ring was attached. */
void rh_conn_ring_counts(const rh_conn_t *c, uint64_t *by_ring, uint64_t *by_socket);
/* Specs that play a broken peer: raw bytes into our outgoing ring; a value
 * stored in our ring's tail (which 0) or our incoming ring's head (which 1). */
int rh_conn_ring_raw(rh_conn_t *c, const void *data, size_t len);
int rh_conn_ring_poke(rh_conn_t *c, int which, uint64_t value);

/* Listeners: accept connections and hand each one to on_accept (with cbs to use). */
typedef void (*rh_accept_fn)(rh_listener_t *l, rh_conn_t *c);
rh_listener_t *rh_listener_new(rh_net_t *net, const rh_conn_cbs_t *cbs, rh_accept_fn on_accept, void *data);
int rh_listener_bind(rh_listener_t *l, const struct sockaddr *addr, int backlog);
rh_listener_t *rh_listener_new_local(rh_net_t *net, const rh_conn_cbs_t *cbs, rh_accept_fn on_accept, void *data);
int rh_listener_bind_local(rh_listener_t *l, const char *path, int backlog);
int rh_listener_port(rh_listener_t *l);
/* The handshake deadline of the connections l accepts from now on, instead of
 * net->handshake_ms (0: that again). */
void rh_listener_set_handshake_ms(rh_listener_t *l, uint64_t ms);
/* Accepted connections of l that have not proved themselves yet (and are open). */
int rh_listener_unproven(rh_listener_t *l);
void *rh_listener_data(rh_listener_t *l);
void rh_listener_close(rh_listener_t *l);

#endif
