/* l_conn.c: framed connections and listeners for Lua ("rpchost.Conn",
 * "rpchost.Listener").
 *
 * A userdata is a box around the C object. While the connection is open the box
 * is anchored in the registry (ref_self) so the GC cannot take it; when the C side
 * reports the end (on_close) the Lua close handler runs once, the anchors go, and
 * the box forgets the pointer: the C struct is freed later by libuv's close
 * callback and never touched from Lua again. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "net/frame.h"
#include "net/privdir.h"
#include "rh_lua.h"
#include "tensor/tensor.h"

#define CONN_MT "rpchost.Conn"
#define LISTENER_MT "rpchost.Listener"

typedef struct {
  rh_conn_t *c;
  int ref_self, ref_frame, ref_close, ref_connect;
  uint32_t lends; /* frame types whose bodies are lent (lend_bodies), a bit each */
} lconn_t;

typedef struct {
  rh_listener_t *l;
  int ref_self, ref_accept, ref_frame, ref_close;
} llistener_t;

static lconn_t *check_conn(lua_State *L, int i) { return luaL_checkudata(L, i, CONN_MT); }

static void on_frame(rh_conn_t *c, const rh_frame_t *f) {
  lconn_t *b = rh_conn_data(c);
  if (!b) return;
  lua_State *L = rh_ctx()->L;
  rh_pushref(L, b->ref_frame);
  rh_pushref(L, b->ref_self);
  lua_pushinteger(L, f->hdr.type);
  lua_pushinteger(L, f->hdr.flags);
  lua_pushnumber(L, (double)f->hdr.id);
  /* a lent body (l_body.c) takes its place once nothing below can raise: a
   * lend is ended only after the callback */
  int lend = f->hdr.type < 32 && (b->lends >> f->hdr.type & 1), body_at = 0;
  if (lend) {
    lua_pushnil(L);
    body_at = lua_gettop(L);
  } else {
    lua_pushlstring(L, (const char *)f->body, f->hdr.body_len);
  }
  const uint8_t *p = f->segs;
  /* the segments in one list (nil when there are none), not one argument each:
   * a Lua handler with fixed parameters is one that LuaJIT's traces can return
   * into (it cannot return into a vararg function's frame) */
  luaL_checkstack(L, 8, "a frame's arguments");
  if (f->hdr.nseg) lua_createtable(L, (int)f->hdr.nseg, 0);
  else lua_pushnil(L);
  double payload = (double)f->hdr.body_len; /* (the frame's bytes, for the byte counters) */
  for (uint32_t i = 0; i < f->hdr.nseg; i++) {
    /* every segment reaches Lua as a 1-D uint8 tensor, never as a string: a
     * tensor's bytes made a Lua string to intern (hashing, and a memcmp against
     * each earlier piece of a collective that looked alike) and were copied once
     * more into the tensor the decoder made of it */
    int64_t n = (int64_t)f->seg_len[i], one = 1;
    payload += (double)n;
    rh_storage_t *st;
    if (f->seg_owner) {
      st = f->seg_owner[i]; /* read straight into a storage */
    } else {
      /* a frame read whole (a ring's, a small one): its bytes go straight into
       * the storage of the tensor they become */
      st = rh_storage_new_uninit((size_t)n);
      if (!st) { /* out of memory: the frame is lost, so is its conversation */
        lua_settop(L, lua_gettop(L) - 7);
        if (b->c) rh_conn_close(b->c, 0);
        return;
      }
      if (n) memcpy(st->data, p, (size_t)n);
      p += n;
    }
    rh_tensor_t *t = rh_tensor_on_storage(st, RH_U8, 0, 1, &n, &one);
    rh_storage_release(st);
    rh_lua_pushframetensor(L, t);
    lua_rawseti(L, -2, (int)i + 1);
  }
  lua_pushnumber(L, payload);
  int lent = 0;
  if (lend) {
    lent = rh_lua_pushbody(L, f->body, f->hdr.body_len);
    lua_replace(L, body_at);
  }
  /* A frame we failed to handle leaves that conversation in an unknown state:
   * drop the connection, so whoever waits on it fails now instead of hanging. */
  int failed = rh_callback(7, 0) != 0;
  if (lent) rh_lua_endbody(L);
  if (failed && b->c) rh_conn_close(b->c, 0);
}

/* conn:lend_bodies(type...): frames of these types reach this connection's
 * frame callback with their bodies lent (l_body.c), for the callback alone:
 * for a callback that decodes them at once and keeps nothing of them
 * (rpchost.net.connections). None unless set. */
static int l_lend_bodies(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  uint32_t mask = 0;
  for (int i = 2; i <= lua_gettop(L); i++) {
    lua_Integer t = luaL_checkinteger(L, i);
    luaL_argcheck(L, t >= 0 && t < 32, i, "a frame type below 32");
    mask |= (uint32_t)1 << t;
  }
  b->lends = mask;
  return 0;
}

static void forget(lua_State *L, lconn_t *b) {
  b->c = NULL;
  rh_unref(L, &b->ref_frame);
  rh_unref(L, &b->ref_close);
  rh_unref(L, &b->ref_connect);
  rh_unref(L, &b->ref_self);
}

static void on_close(rh_conn_t *c, int status, int peer_version) {
  lconn_t *b = rh_conn_data(c);
  if (!b) return;
  rh_conn_set_data(c, NULL);
  lua_State *L = rh_ctx()->L;
  int has_handler = b->ref_close != LUA_NOREF;
  if (has_handler) {
    rh_pushref(L, b->ref_close);
    rh_pushref(L, b->ref_self);
    lua_pushinteger(L, status);
    if (status) lua_pushstring(L, rh_strerror(status));
    else lua_pushnil(L);
    lua_pushinteger(L, peer_version);
  }
  forget(L, b);
  if (has_handler) rh_callback(4, 0);
}

static void on_connect(rh_conn_t *c, int status) {
  lconn_t *b = rh_conn_data(c);
  if (!b || b->ref_connect == LUA_NOREF) return;
  lua_State *L = rh_ctx()->L;
  rh_pushref(L, b->ref_connect);
  rh_pushref(L, b->ref_self);
  if (status) lua_pushstring(L, rh_strerror(status));
  else lua_pushnil(L);
  rh_callback(2, 0);
}

static const rh_conn_cbs_t conn_cbs = {on_frame, on_close, on_connect};

static int ref_field(lua_State *L, int t, const char *name) {
  lua_getfield(L, t, name);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return LUA_NOREF;
  }
  luaL_checktype(L, -1, LUA_TFUNCTION);
  return luaL_ref(L, LUA_REGISTRYINDEX);
}

static lconn_t *new_box(lua_State *L, rh_conn_t *c) {
  lconn_t *b = lua_newuserdata(L, sizeof *b);
  b->c = c;
  b->ref_frame = b->ref_close = b->ref_connect = LUA_NOREF;
  b->lends = 0;
  luaL_getmetatable(L, CONN_MT);
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  b->ref_self = luaL_ref(L, LUA_REGISTRYINDEX);
  rh_conn_set_data(c, b);
  return b;
}

static int parse_addr(const char *ip, int port, struct sockaddr_storage *ss) {
  if (strchr(ip, ':')) return uv_ip6_addr(ip, port, (struct sockaddr_in6 *)ss);
  return uv_ip4_addr(ip, port, (struct sockaddr_in *)ss);
}

/* "unix:/path" names a Unix-domain socket (this host only); anything else is an IP */
static const char *unix_path(const char *ip) { return strncmp(ip, "unix:", 5) == 0 ? ip + 5 : NULL; }

/* connect's and listen's first arguments (ip, port, {callbacks}): *ip, *port,
 * and either *path (a Unix socket) or the IP address in *ss. 0, or pushes nil,
 * the message and (with_code) libuv's name of the error and returns how many */
static int addr_args(lua_State *L, const char **ip, int *port, const char **path, struct sockaddr_storage *ss,
                     int with_code) {
  *ip = luaL_checkstring(L, 1);
  *port = (int)luaL_optinteger(L, 2, 0);
  luaL_checktype(L, 3, LUA_TTABLE);
  *path = unix_path(*ip);
  int rc = *path ? 0 : parse_addr(*ip, *port, ss);
  if (!rc) return 0;
  lua_pushnil(L);
  lua_pushfstring(L, "bad address %s: %s", *ip, uv_strerror(rc));
  if (!with_code) return 2;
  lua_pushstring(L, uv_err_name(rc));
  return 3;
}

/* connect(ip, port, {connect=, frame=, close=}) -> conn | nil, message
 * (ip "unix:/path": a Unix-domain socket; port is ignored) */
static int l_connect(lua_State *L) {
  const char *ip, *path;
  int port;
  struct sockaddr_storage ss;
  int bad = addr_args(L, &ip, &port, &path, &ss, 0);
  if (bad) return bad;
  rh_conn_t *c =
      path ? rh_conn_new_local(&rh_ctx()->net, &conn_cbs, NULL) : rh_conn_new(&rh_ctx()->net, &conn_cbs, NULL);
  if (!c) return luaL_error(L, "out of memory");
  lconn_t *b = new_box(L, c);
  b->ref_connect = ref_field(L, 3, "connect");
  b->ref_frame = ref_field(L, 3, "frame");
  b->ref_close = ref_field(L, 3, "close");
  int rc = path ? rh_conn_connect_local(c, path) : rh_conn_connect(c, (struct sockaddr *)&ss);
  if (rc) {
    rh_unref(L, &b->ref_close); /* nothing to report: the caller gets the error */
    rh_conn_close(c, 0);
    lua_pushnil(L);
    lua_pushstring(L, uv_strerror(rc));
    return 2;
  }
  return 1;
}

/* What one send keeps alive until its bytes are written. Most frames have a
 * few segments and use the hold's own array; one with more (a module's or a
 * state_dict's every tensor in one call) gets an array of its own. */
#define SMALL_SEGS 64
typedef struct {
  int ref; /* table anchoring string segments, or LUA_NOREF */
  int ntensors;
  rh_tensor_t **tensors; /* small, or a heap array of nseg */
  rh_tensor_t *small[SMALL_SEGS];
} seg_hold_t;

/* Holds are reused (a few kept on a free list): a send with payload segments
 * then costs no allocation. Only the loop thread touches the list. */
#define FREE_HOLDS 32
static seg_hold_t *free_holds[FREE_HOLDS];
static int nfree_holds;

static seg_hold_t *new_hold(int nseg) {
  seg_hold_t *h = nfree_holds > 0 ? free_holds[--nfree_holds] : malloc(sizeof *h);
  if (!h) return NULL;
  h->ref = LUA_NOREF;
  h->ntensors = 0;
  h->tensors = h->small;
  if (nseg > SMALL_SEGS && !(h->tensors = malloc((size_t)nseg * sizeof *h->tensors))) {
    free(h);
    return NULL;
  }
  return h;
}

static void release_hold(void *ctx) {
  seg_hold_t *h = ctx;
  if (h->ref != LUA_NOREF) luaL_unref(rh_ctx()->L, LUA_REGISTRYINDEX, h->ref);
  for (int i = 0; i < h->ntensors; i++) rh_tensor_release(h->tensors[i]);
  if (h->tensors != h->small) free(h->tensors);
  if (nfree_holds < FREE_HOLDS) free_holds[nfree_holds++] = h;
  else free(h);
}

/* conn:send(type, flags, id, body [, segments...]) -> the segments' bytes (a
 * number, 0 for none: true to Lua) | nil, message.
 * A segment is a string or a contiguous tensor, written from its own memory.
 * fd >= 0: a descriptor to pass along with the frame. */
static int send_frame(lua_State *L, int fd) {
  lconn_t *b = check_conn(L, 1);
  int type = (int)luaL_checkinteger(L, 2);
  int flags = (int)luaL_checkinteger(L, 3);
  double id = luaL_checknumber(L, 4);
  size_t blen;
  const char *body = luaL_checklstring(L, 5, &blen);
  if (!b->c || !rh_conn_is_open(b->c)) {
    lua_pushnil(L);
    lua_pushliteral(L, "connection closed");
    return 2;
  }
  int nseg = lua_gettop(L) - 5;
  if (nseg > RH_FRAME_MAX_SEGS) {
    return luaL_error(L, "a message with %d payload segments (tensors and large strings): one frame carries at most %d",
                      nseg, RH_FRAME_MAX_SEGS);
  }
  /* (the connection copies the list of segments: a bigger one lives only for this call) */
  uv_buf_t small_segs[SMALL_SEGS];
  uv_buf_t *segs = small_segs;
  if (nseg > SMALL_SEGS && !(segs = malloc((size_t)nseg * sizeof *segs))) return luaL_error(L, "out of memory");
  rh_release_fn rel = NULL;
  void *relctx = NULL;
  double payload = 0;
  if (nseg > 0) {
    seg_hold_t *h = new_hold(nseg);
    if (!h) {
      if (segs != small_segs) free(segs);
      return luaL_error(L, "out of memory");
    }
    int nstr = 0, bad = 0, dev = -1; /* bad: the 1-based segment that cannot be sent, and why (below) */
    const char *why = NULL;
    for (int i = 0; i < nseg && !bad; i++) {
      rh_tensor_t *t = rh_lua_totensor(L, 6 + i);
      if (t) {
        if ((dev = rh_tensor_device(t)) >= 0) {
          bad = i + 1, why = "(the wire takes host memory)";
        } else if (!rh_tensor_is_contiguous(t)) {
          bad = i + 1, why = "is a tensor that is not contiguous";
        } else {
          rh_tensor_retain(t);
          h->tensors[h->ntensors++] = t;
          segs[i] = uv_buf_init(rh_tensor_data(t), (unsigned)0);
          segs[i].len = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
          payload += (double)segs[i].len;
        }
      } else {
        size_t sl;
        const char *str = lua_tolstring(L, 6 + i, &sl);
        if (!str) {
          bad = i + 1, why = "must be a string or a tensor";
        } else {
          segs[i] = uv_buf_init((char *)str, 0);
          segs[i].len = sl;
          payload += (double)sl;
          nstr++;
        }
      }
    }
    if (bad) {
      release_hold(h);
      if (segs != small_segs) free(segs);
      if (dev >= 0) return luaL_error(L, "send: segment %d is a tensor on cuda:%d %s", bad, dev, why);
      return luaL_error(L, "send: segment %d %s", bad, why);
    }
    if (nstr > 0) {
      /* the strings stay alive (anchored in one table) until written */
      lua_createtable(L, nseg, 0);
      for (int i = 0; i < nseg; i++) {
        lua_pushvalue(L, 6 + i);
        lua_rawseti(L, -2, i + 1);
      }
      h->ref = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    relctx = h;
    rel = release_hold;
  }
  int rc = fd >= 0 ? rh_conn_send_fd(b->c, fd, (uint8_t)type, (uint16_t)flags, (uint64_t)id, body, (uint32_t)blen, segs,
                                     (uint32_t)nseg, rel, relctx)
                   : rh_conn_send(b->c, (uint8_t)type, (uint16_t)flags, (uint64_t)id, body, (uint32_t)blen, segs,
                                  (uint32_t)nseg, rel, relctx);
  if (segs != small_segs) free(segs);
  if (rc) return rh_lua_push_rc(L, rc);
  /* (the payload's bytes: what the byte counters add, without a pass over the
   * segments of their own) */
  lua_pushnumber(L, payload);
  return 1;
}

static int l_send(lua_State *L) { return send_frame(L, -1); }

/* payload_bytes(segments [, align]) -> the bytes of a frame's payload list (its
 * strings and contiguous tensors), each rounded up to a multiple of align when
 * given: what the frame limit, shared memory's threshold and the byte counters
 * ask of every frame, in one call rather than one per segment */
static int l_payload_bytes(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  double align = luaL_optnumber(L, 2, 1);
  luaL_argcheck(L, align >= 1 && align <= 4096, 2, "alignment out of range");
  size_t a = (size_t)align;
  int n = (int)lua_objlen(L, 1);
  double total = 0;
  for (int i = 1; i <= n; i++) {
    lua_rawgeti(L, 1, i);
    size_t len;
    if (lua_type(L, -1) == LUA_TSTRING) {
      len = lua_objlen(L, -1);
    } else {
      rh_tensor_t *t = rh_lua_totensor(L, -1);
      if (!t)
        return luaL_error(L, "payload_bytes: segment %d is a %s, not a string or a live tensor", i,
                          luaL_typename(L, -1));
      len = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
    }
    total += (double)((len + a - 1) / a * a);
    lua_pop(L, 1);
  }
  lua_pushnumber(L, total);
  return 1;
}

/* conn:send_raw(bytes) -> true | nil, message: bytes outside any frame (for
 * specs that play a peer which does not follow the protocol) */
static int raw_bytes(lua_State *L, int (*put)(rh_conn_t *, const void *, size_t)) {
  lconn_t *b = check_conn(L, 1);
  size_t len;
  const char *s = luaL_checklstring(L, 2, &len);
  return rh_lua_push_rc(L, b->c ? put(b->c, s, len) : RH_ECLOSED);
}

static int l_send_raw(lua_State *L) { return raw_bytes(L, rh_conn_send_raw); }

/* conn:send_shm(segment, type, flags, id, body [, segments...]): send, passing
 * the shared-memory segment's descriptor to the peer with the frame */
static int l_send_shm(lua_State *L) {
  rh_shm_t *s = rh_lua_checkshm(L, 2);
  if (s->fd < 0) return luaL_error(L, "send_shm: the segment is a peer's (only our own are passed on)");
  int fd = s->fd;
  lua_remove(L, 2);
  return send_frame(L, fd);
}

/* conn:take_shm(inode) -> segment | nil, message: maps the oldest descriptor
 * the peer passed, which must be the segment of that inode */
static int l_take_shm(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  double ino = luaL_checknumber(L, 2);
  int fd = b->c ? rh_conn_take_fd(b->c) : -1;
  if (fd < 0) {
    lua_pushnil(L);
    lua_pushliteral(L, "the frame announces a shared-memory segment, but no descriptor came with it");
    return 2;
  }
  char why[160] = "the frame does not name the segment whose descriptor came with it";
  int err = 0;
  rh_shm_t *s = ino < 0 ? (close(fd), NULL) : rh_shm_attach(fd, 0, (uint64_t)ino, why, sizeof why, &err);
  if (!s) {
    lua_pushnil(L);
    lua_pushstring(L, why);
    return 2;
  }
  rh_lua_pushshm(L, s);
  return 1;
}

/* ring_segment() -> segment | nil, message: a memory file with an empty pair
 * of same-host rings, to offer a peer (host/net/conn_ring.c) */
static int l_ring_segment(lua_State *L) {
  int err = 0;
  rh_shm_t *s = rh_conn_ring_segment(&err);
  if (!s) {
    lua_pushnil(L);
    lua_pushfstring(L, "cannot make a shared-memory ring: %s", strerror(-err));
    return 2;
  }
  rh_lua_pushshm(L, s);
  return 1;
}

/* conn:ring_attach(segment, creator) -> true | nil, message: small frames go
 * through the segment's rings from now on (both sides attach, the creator first) */
static int l_ring_attach(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  rh_shm_t *s = rh_lua_checkshm(L, 2);
  return rh_lua_push_rc(L, b->c ? rh_conn_ring_attach(b->c, s, lua_toboolean(L, 3)) : RH_ECLOSED);
}

/* conn:ring_raw(bytes) / conn:ring_poke(which, value): specs that play a broken
 * peer (raw bytes into our outgoing ring; a counter: 0 our tail, 1 our head) */
static int l_ring_raw(lua_State *L) { return raw_bytes(L, rh_conn_ring_raw); }

static int l_ring_poke(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  int which = (int)luaL_checkinteger(L, 2);
  uint64_t v = (uint64_t)luaL_checknumber(L, 3);
  return rh_lua_push_rc(L, b->c ? rh_conn_ring_poke(b->c, which, v) : RH_ECLOSED);
}

static int l_close(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  int graceful = lua_toboolean(L, 2);
  if (b->c) rh_conn_close(b->c, graceful);
  return 0;
}

/* Pushes ip, port of one end of the connection (nothing when closed). */
static int push_addr(lua_State *L, int (*which)(rh_conn_t *, char *, size_t, int *)) {
  lconn_t *b = check_conn(L, 1);
  char ip[64];
  int port;
  if (!b->c || which(b->c, ip, sizeof ip, &port) != 0) return 0;
  lua_pushstring(L, ip);
  lua_pushinteger(L, port);
  return 2;
}

static int l_peer(lua_State *L) { return push_addr(L, rh_conn_peer); }
static int l_local(lua_State *L) { return push_addr(L, rh_conn_local); }

/* conn:name() for a question about the connection (false once it is closed) */
static int push_flag(lua_State *L, int (*ask)(rh_conn_t *)) {
  lconn_t *b = check_conn(L, 1);
  lua_pushboolean(L, b->c && ask(b->c));
  return 1;
}

/* conn:name() for an order to the connection (nothing once it is closed) */
static int apply(lua_State *L, void (*order)(rh_conn_t *)) {
  lconn_t *b = check_conn(L, 1);
  if (b->c) order(b->c);
  return 0;
}

/* conn:has_ring() -> true while small frames go through shared-memory rings */
static int l_has_ring(lua_State *L) { return push_flag(L, rh_conn_has_ring); }

static int l_is_open(lua_State *L) { return push_flag(L, rh_conn_is_open); }
/* conn:is_local() -> true for a Unix-domain socket */
static int l_is_local(lua_State *L) { return push_flag(L, rh_conn_is_local); }
/* conn:prove(): the peer proved itself; every frame type is read from now on */
static int l_prove(lua_State *L) { return apply(L, rh_conn_prove); }
static int l_is_proven(lua_State *L) { return push_flag(L, rh_conn_is_proven); }
/* conn:pause() / conn:resume(): stop and restart reading (backpressure) */
static int l_pause(lua_State *L) { return apply(L, rh_conn_pause); }
static int l_resume(lua_State *L) { return apply(L, rh_conn_resume); }

/* conn:peer_uid() -> uid of the process at the other end (Unix-domain only) | nil */
static int l_peer_uid(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  long uid = b->c ? rh_conn_peer_uid(b->c) : -1;
  if (uid < 0) return 0;
  lua_pushnumber(L, (double)uid);
  return 1;
}

/* conn:ring_counts() -> frames sent through the ring, frames sent past it on
 * the socket (0, 0 without a ring) */
static int l_ring_counts(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  uint64_t r = 0, k = 0;
  if (b->c && rh_conn_has_ring(b->c)) rh_conn_ring_counts(b->c, &r, &k);
  lua_pushnumber(L, (double)r);
  lua_pushnumber(L, (double)k);
  return 2;
}

/* getuid() -> the user id this process runs as */
static int l_getuid(lua_State *L) {
  lua_pushnumber(L, (double)getuid());
  return 1;
}

static int l_queued(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  lua_pushnumber(L, b->c ? (double)rh_conn_queued(b->c) : 0);
  return 1;
}

static int l_conn_tostring(lua_State *L) {
  lconn_t *b = check_conn(L, 1);
  lua_pushfstring(L, "Conn(%s)", b->c ? "open" : "closed");
  return 1;
}

/* ---- listeners ---- */

static void on_accept(rh_listener_t *l, rh_conn_t *c) {
  llistener_t *lb = rh_listener_data(l);
  lua_State *L = rh_ctx()->L;
  lconn_t *b = new_box(L, c);
  rh_pushref(L, lb->ref_frame);
  b->ref_frame = lb->ref_frame == LUA_NOREF ? LUA_NOREF : luaL_ref(L, LUA_REGISTRYINDEX);
  if (lb->ref_frame == LUA_NOREF) lua_pop(L, 1);
  rh_pushref(L, lb->ref_close);
  b->ref_close = lb->ref_close == LUA_NOREF ? LUA_NOREF : luaL_ref(L, LUA_REGISTRYINDEX);
  if (lb->ref_close == LUA_NOREF) lua_pop(L, 1);
  /* stack: conn box */
  rh_pushref(L, lb->ref_accept);
  lua_insert(L, -2);
  rh_callback(1, 0);
}

/* listen(ip, port, {accept=, frame=, close=, handshake_timeout=}) -> listener | nil, message, code
 * (ip "unix:/path": a Unix-domain socket file, removed when the listener closes) */
static int l_listen(lua_State *L) {
  const char *ip, *path;
  int port;
  struct sockaddr_storage ss;
  int bad = addr_args(L, &ip, &port, &path, &ss, 1);
  if (bad) return bad;
  llistener_t *lb = lua_newuserdata(L, sizeof *lb);
  memset(lb, 0, sizeof *lb);
  lb->ref_self = lb->ref_accept = lb->ref_frame = lb->ref_close = LUA_NOREF;
  luaL_getmetatable(L, LISTENER_MT);
  lua_setmetatable(L, -2);
  lb->l = path ? rh_listener_new_local(&rh_ctx()->net, &conn_cbs, on_accept, lb)
               : rh_listener_new(&rh_ctx()->net, &conn_cbs, on_accept, lb);
  if (!lb->l) return luaL_error(L, "out of memory");
  int rc = path ? rh_listener_bind_local(lb->l, path, 511) : rh_listener_bind(lb->l, (struct sockaddr *)&ss, 511);
  if (rc) {
    rh_listener_close(lb->l);
    lb->l = NULL;
    lua_pushnil(L);
    lua_pushfstring(L, "cannot listen on %s:%d: %s", ip, port, uv_strerror(rc));
    lua_pushstring(L, uv_err_name(rc));
    return 3;
  }
  lb->ref_accept = ref_field(L, 3, "accept");
  lb->ref_frame = ref_field(L, 3, "frame");
  lb->ref_close = ref_field(L, 3, "close");
  /* opts.handshake_timeout: seconds its connections have to prove themselves
   * (default RPCHOST_HANDSHAKE_TIMEOUT's) */
  if (lua_type(L, 3) == LUA_TTABLE) {
    lua_getfield(L, 3, "handshake_timeout");
    double hs = lua_isnumber(L, -1) ? lua_tonumber(L, -1) : 0;
    lua_pop(L, 1);
    if (hs > 0) rh_listener_set_handshake_ms(lb->l, (uint64_t)(hs * 1000));
  }
  lua_pushvalue(L, -1);
  lb->ref_self = luaL_ref(L, LUA_REGISTRYINDEX);
  return 1;
}

static llistener_t *check_listener(lua_State *L) { return luaL_checkudata(L, 1, LISTENER_MT); }

static int l_listener_port(lua_State *L) {
  llistener_t *lb = check_listener(L);
  if (!lb->l) return 0;
  lua_pushinteger(L, rh_listener_port(lb->l));
  return 1;
}

static int l_listener_close(lua_State *L) {
  llistener_t *lb = check_listener(L);
  if (!lb->l) return 0;
  rh_listener_close(lb->l);
  lb->l = NULL;
  rh_unref(L, &lb->ref_accept);
  rh_unref(L, &lb->ref_frame);
  rh_unref(L, &lb->ref_close);
  rh_unref(L, &lb->ref_self);
  return 0;
}

/* socket_dir([sub]) -> path | nil, why: this user's private directory (mode
 * 0700) for Unix-domain sockets and the world secrets, or with sub (a plain
 * name) its subdirectory of that name: the bytecode cache keeps its thousands
 * of files out of the directory the sockets' sweep reads. Which directory, and
 * why none would do, is host/net/privdir.c's policy (rh_privdir_get). */
static int l_socket_dir(lua_State *L) {
  const char *sub = luaL_optstring(L, 1, NULL);
  if (sub && (!*sub || strspn(sub, "abcdefghijklmnopqrstuvwxyz0123456789-_") != strlen(sub)))
    return luaL_argerror(L, 1, "a subdirectory's plain name (a-z, 0-9, - and _)");
  char path[RH_PRIVDIR_PATH + 64], why[4096];
  if (rh_privdir_get(sub, path, sizeof path, why, sizeof why) == 0) {
    lua_pushstring(L, path);
    return 1;
  }
  lua_pushnil(L);
  lua_pushstring(L, why);
  return 2;
}

/* sweep_sockets(dir [, min_age]) -> removed: the dead ranks' socket files (and
 * dead stores' world secrets) in dir at least min_age seconds old (default 10),
 * removed (rh_privdir_sweep) */
static int l_sweep_sockets(lua_State *L) {
  const char *dir = luaL_checkstring(L, 1);
  double min_age = luaL_optnumber(L, 2, 10);
  lua_pushinteger(L, rh_privdir_sweep(dir, min_age));
  return 1;
}

/* hold_file(path) -> fd | nil, message: a world secret held while its store
 * runs (rh_privdir_hold); release_file(fd) lets it go */
static int l_hold_file(lua_State *L) {
  int fd = rh_privdir_hold(luaL_checkstring(L, 1));
  if (fd < 0) {
    lua_pushnil(L);
    lua_pushstring(L, strerror(-fd));
    return 2;
  }
  lua_pushinteger(L, fd);
  return 1;
}

static int l_release_file(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  if (fd >= 0) close(fd);
  return 0;
}

/* getaddrinfo of host (any family, stream sockets) into *req: 0, or pushes
 * nil and a message naming the host and returns 2 (what the caller returns).
 * Synchronous: resolve and resolve_all are used at start-up only. */
static int lookup(lua_State *L, const char *host, uv_getaddrinfo_t *req) {
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int rc = uv_getaddrinfo(rh_ctx()->loop, req, NULL, host, NULL, &hints);
  if (!rc) return 0;
  lua_pushnil(L);
  lua_pushfstring(L, "cannot resolve host '%s': %s", host, uv_strerror(rc));
  return 2;
}

/* resolve_all(host) -> {numeric ip, ...} (IPv4 first, each once) | nil, message */
static int l_resolve_all(lua_State *L) {
  const char *host = luaL_checkstring(L, 1);
  uv_getaddrinfo_t req;
  if (lookup(L, host, &req)) return 2;
  lua_newtable(L);
  int n = 0;
  for (int family = 0; family < 2; family++) /* (IPv4 first: resolve's order) */
    for (struct addrinfo *a = req.addrinfo; a; a = a->ai_next) {
      char ip[64] = "";
      if (family == 0 && a->ai_family == AF_INET) uv_ip4_name((struct sockaddr_in *)a->ai_addr, ip, sizeof ip);
      else if (family == 1 && a->ai_family == AF_INET6) uv_ip6_name((struct sockaddr_in6 *)a->ai_addr, ip, sizeof ip);
      if (!*ip) continue;
      int seen = 0;
      for (int i = 1; i <= n && !seen; i++) {
        lua_rawgeti(L, -1, i);
        seen = strcmp(lua_tostring(L, -1), ip) == 0;
        lua_pop(L, 1);
      }
      if (seen) continue;
      lua_pushstring(L, ip);
      lua_rawseti(L, -2, ++n);
    }
  uv_freeaddrinfo(req.addrinfo);
  return 1;
}

/* interfaces() -> {{name=, ip=, family=4|6, internal=bool, scope=}, ...}: this
 * host's addresses by interface (libuv's list, in its order), for choosing
 * the one a rank advertises (RPCHOST_SOCKET_IFNAME). scope: an IPv6 address's
 * scope id (link-local addresses need it), else 0. */
static int l_interfaces(lua_State *L) {
  uv_interface_address_t *ifs;
  int n;
  int rc = uv_interface_addresses(&ifs, &n);
  if (rc) {
    lua_pushnil(L);
    lua_pushstring(L, uv_strerror(rc));
    return 2;
  }
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    char ip[64] = "";
    int v6 = ifs[i].address.address4.sin_family == AF_INET6;
    if (v6) uv_ip6_name(&ifs[i].address.address6, ip, sizeof ip);
    else uv_ip4_name(&ifs[i].address.address4, ip, sizeof ip);
    lua_createtable(L, 0, 5);
    lua_pushstring(L, ifs[i].name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, ip);
    lua_setfield(L, -2, "ip");
    lua_pushinteger(L, v6 ? 6 : 4);
    lua_setfield(L, -2, "family");
    lua_pushboolean(L, ifs[i].is_internal);
    lua_setfield(L, -2, "internal");
    lua_pushinteger(L, v6 ? (lua_Integer)ifs[i].address.address6.sin6_scope_id : 0);
    lua_setfield(L, -2, "scope");
    lua_rawseti(L, -2, i + 1);
  }
  uv_free_interface_addresses(ifs, n);
  return 1;
}

/* host_identity() -> {boot=, mnt=, pid=, net=, ipc=, uts=, user=}: what tells
 * whether two processes share a kernel (the boot id: a fresh random one each
 * boot) and which of its namespaces (each namespace's inode under
 * /proc/self/ns): two ranks are on "one host" for a fast path only where the
 * parts it needs are the same (a Unix socket's path: the mount namespace;
 * cross-memory attach and pidfd_getfd: the PID namespace), never because
 * their addresses look alike. A part that cannot be read is absent. */
static int l_host_identity(lua_State *L) {
  lua_createtable(L, 0, 7);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    char id[64] = "";
    if (fgets(id, sizeof id, f)) {
      id[strcspn(id, "\n")] = 0;
      lua_pushstring(L, id);
      lua_setfield(L, -2, "boot");
    }
    fclose(f);
  }
  static const char *const ns[] = {"mnt", "pid", "net", "ipc", "uts", "user"};
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    char path[64];
    struct stat st;
    snprintf(path, sizeof path, "/proc/self/ns/%s", ns[i]);
    if (stat(path, &st) != 0) continue;
    lua_pushnumber(L, (double)st.st_ino);
    lua_setfield(L, -2, ns[i]);
  }
  return 1;
}

/* resolve(host) -> numeric ip (IPv4 where there is one) | nil, message */
static int l_resolve(lua_State *L) {
  const char *host = luaL_checkstring(L, 1);
  uv_getaddrinfo_t req;
  if (lookup(L, host, &req)) return 2;
  char ip[64] = "";
  struct addrinfo *best = req.addrinfo;
  for (struct addrinfo *a = req.addrinfo; a; a = a->ai_next)
    if (a->ai_family == AF_INET) {
      best = a;
      break;
    }
  if (best->ai_family == AF_INET6) uv_ip6_name((struct sockaddr_in6 *)best->ai_addr, ip, sizeof ip);
  else uv_ip4_name((struct sockaddr_in *)best->ai_addr, ip, sizeof ip);
  uv_freeaddrinfo(req.addrinfo);
  lua_pushstring(L, ip);
  return 1;
}

int rh_open_conn(lua_State *L) {
  static const luaL_Reg conn_methods[] = {{"send", l_send},
                                          {"lend_bodies", l_lend_bodies},
                                          {"close", l_close},
                                          {"peer", l_peer},
                                          {"is_open", l_is_open},
                                          {"local_addr", l_local},
                                          {"queued", l_queued},
                                          {"is_local", l_is_local},
                                          {"send_shm", l_send_shm},
                                          {"take_shm", l_take_shm},
                                          {"prove", l_prove},
                                          {"is_proven", l_is_proven},
                                          {"pause", l_pause},
                                          {"resume", l_resume},
                                          {"peer_uid", l_peer_uid},
                                          {"send_raw", l_send_raw},
                                          {"ring_attach", l_ring_attach},
                                          {"has_ring", l_has_ring},
                                          {"ring_counts", l_ring_counts},
                                          {"ring_raw", l_ring_raw},
                                          {"ring_poke", l_ring_poke},
                                          {NULL, NULL}};
  static const luaL_Reg listener_methods[] = {{"port", l_listener_port}, {"close", l_listener_close}, {NULL, NULL}};
  rh_lua_class(L, CONN_MT, conn_methods, NULL, l_conn_tostring);
  rh_lua_class(L, LISTENER_MT, listener_methods, NULL, NULL);

  static const luaL_Reg fns[] = {{"connect", l_connect},
                                 {"listen", l_listen},
                                 {"payload_bytes", l_payload_bytes},
                                 {"resolve", l_resolve},
                                 {"socket_dir", l_socket_dir},
                                 {"getuid", l_getuid},
                                 {"sweep_sockets", l_sweep_sockets},
                                 {"ring_segment", l_ring_segment},
                                 {"hold_file", l_hold_file},
                                 {"release_file", l_release_file},
                                 {"resolve_all", l_resolve_all},
                                 {"interfaces", l_interfaces},
                                 {"host_identity", l_host_identity},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  /* the words a connection ends with when its peer's host went silent (what
   * the close and connect callbacks pass on): a host cut off, not a process gone */
  lua_pushstring(L, rh_strerror(RH_ESILENT));
  lua_setfield(L, -2, "silent_message");
  return 1;
}
