/* conn_priv.h: the inside of a connection, shared by conn.c (sockets, the
 * batched writer) and conn_ring.c (the shared-memory rings that carry small
 * frames between ranks on one host). Nothing outside host/net includes it. */
#ifndef RH_CONN_PRIV_H
#define RH_CONN_PRIV_H

#include "conn.h"
#include "ring.h"
#include "shm.h"

/* One queued piece of output: either a span of the arena or an external segment. */
typedef struct {
  size_t off; /* arena offset, when ext == NULL */
  size_t len;
  const void *ext;
} rh_piece_t;

typedef struct {
  rh_release_fn fn;
  void *ctx;
} rh_release_t;

/* Everything one uv_write owns until its callback. */
typedef struct {
  uv_write_t req;
  uint8_t *arena;
  rh_release_t *rel;
  size_t nrel;
  uv_pipe_t *fd_handle; /* a descriptor travelling with this write, closed after */
  uv_buf_t bufs[];
} rh_write_t;

/* Descriptors a peer may have sent us that no frame has taken yet: a peer that
 * sends more is not speaking our protocol. */
#define MAX_HELD_FDS 64

/* a TCP socket or a Unix-domain socket: both are uv_stream_t underneath */
typedef union {
  uv_handle_t handle;
  uv_stream_t stream;
  uv_tcp_t tcp;
  uv_pipe_t pipe;
} rh_sock_t;

struct rh_conn_s {
  rh_sock_t h;
  int local; /* a Unix-domain socket */
  rh_net_t *net;
  rh_conn_cbs_t cbs;
  void *data;
  rh_reader_t reader;
  /* output queued since the last flush */
  uint8_t *arena;
  size_t alen, acap;
  rh_piece_t *pieces;
  size_t npieces, cpieces;
  rh_release_t *rel;
  size_t nrel, crel;
  uv_buf_t *bufs; /* iovecs for a flush, reused (the fast path allocates nothing) */
  size_t cbufs;
  rh_conn_t *next_dirty;
  rh_conn_t *next_all, *prev_all;
  int dirty;
  int closing;  /* uv_close requested */
  int reported; /* on_close already called */
  int shutting; /* graceful close in progress */
  uv_connect_t connect_req;
  uv_shutdown_t shutdown_req;
  size_t inflight;       /* bytes handed to uv_write, not yet done */
  int send_fd;           /* a descriptor to attach to the next flush (-1: none) */
  int fds[MAX_HELD_FDS]; /* received descriptors, oldest first */
  int nfds;
  int end_status, end_version; /* why it ended, for a deferred report */
  uint64_t born;               /* loop time (ms) it was made: its handshake's deadline counts from here */
  uint64_t handshake_ms;       /* that deadline: net->handshake_ms, or its listener's own */
  int paused;                  /* the owner asked for no frames for now (rh_conn_pause) */
  rh_conn_t *next_resumed;     /* on net->resumed: buffered frames to hand out */
  int resumed;
  struct rh_conn_ring_s *ring; /* same-host shared-memory rings (conn_ring.c), or NULL */
  uint64_t by_ring, by_socket; /* frames sent through the ring, and (with a ring) past it on the socket */
  /* while an accepted connection is unproven: its listener, which counts it
   * (oldest first) to close the oldest at net->max_unproven; NULL otherwise */
  rh_listener_t *listener;
  rh_conn_t *next_unproven, *prev_unproven;
};

/* conn.c, for conn_ring.c */
void rh__conn_end(rh_conn_t *c, int status, int peer_version);
void rh__conn_mark_dirty(rh_conn_t *c);
int rh__conn_arena_put(rh_conn_t *c, const void *src, size_t len);
/* hands out socket frames (in ring mode: those the ring announced) */
void rh__conn_deliver(rh_conn_t *c);
/* one frame to the owner (or dropped, when the owner is gone) */
void rh__conn_hand_out(rh_conn_t *c, const rh_frame_t *f);

/* conn_ring.c, for conn.c */
/* Sends a frame through the ring when it fits there and by_socket is 0 (1), or
 * announces it with a marker so that it may go through the socket in order (0),
 * or fails (<0). */
int rh__ring_send(rh_conn_t *c, const uint8_t *hdr, const void *body, uint32_t body_len, const uv_buf_t *segs,
                  uint32_t nseg, const rh_frame_hdr_t *h, int by_socket);
/* reads what the ring holds and hands it out */
void rh__ring_poll(rh_conn_t *c);
/* at a flush: the backlog into the ring, a doorbell to the peer if it sleeps */
void rh__ring_flush(rh_conn_t *c);
/* bytes waiting for ring space */
size_t rh__ring_backlog(const rh_conn_t *c);
/* a socket frame of the ring's own (a doorbell): swallowed; 1 if it was one */
int rh__ring_swallow(rh_conn_t *c);
/* socket frames may be handed out now (a marker announced them) */
int rh__ring_announced(rh_conn_t *c);
void rh__ring_took(rh_conn_t *c);
void rh__ring_free(rh_conn_t *c);
void rh__rings_init(rh_net_t *net);
void rh__rings_close(rh_net_t *net);
/* every ring of the net, before each poll */
void rh__rings_poll(rh_net_t *net);
/* the loop polls the rings from now on, until the window (ring_last +
 * ring_spin_ns, or ahead_until) ends; the peers write without a doorbell */
void rh__rings_start_polling(rh_net_t *net);
void rh__ahead_init(rh_net_t *net);
void rh__ahead_close(rh_net_t *net);

#endif
