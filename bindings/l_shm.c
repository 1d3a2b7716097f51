/* l_shm.c: shared-memory segments for Lua ("rpchost.Shm"): the transport's pool
 * of memfd segments (rpchost.net.shm) fills ours and reads the peers'. Every offset
 * and length is checked against the segment, since they come from the wire.
 *
 * A payload in a peer's segment is either copied out (get) or adopted: the
 * tensors are made to live in the segment itself (no copy), on a loan that ends
 * when the last of them is freed. Ended loans queue up here, and the transport
 * drains them once per loop turn (shm_released) to hand the segments back. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rh_lua.h"
#include "tensor/tensor.h"

#define SHM_MT "rpchost.Shm"

typedef struct {
  rh_shm_t *s; /* NULL once closed */
} box_t;

static box_t *check_box(lua_State *L, int i) { return luaL_checkudata(L, i, SHM_MT); }

rh_shm_t *rh_lua_checkshm(lua_State *L, int i) {
  box_t *b = check_box(L, i);
  if (!b->s) luaL_error(L, "the shared-memory segment is closed");
  return b->s;
}

void rh_lua_pushshm(lua_State *L, rh_shm_t *s) {
  box_t *b = lua_newuserdata(L, sizeof *b);
  b->s = s;
  luaL_getmetatable(L, SHM_MT);
  lua_setmetatable(L, -2);
}

/* The byte span [off, off + len) of s, or an error naming what is out of range. */
static size_t check_span(lua_State *L, rh_shm_t *s, double off, double len) {
  if (off < 0 || len < 0 || off != (double)(size_t)off || len != (double)(size_t)len || off + len > (double)s->size)
    return (size_t)luaL_error(L, "shared-memory span [%f, %f) is outside the %f-byte segment", off, off + len,
                              (double)s->size);
  return (size_t)off;
}

/* shm_create(bytes) -> segment | nil, message */
static int l_create(lua_State *L) {
  double n = luaL_checknumber(L, 1);
  if (n < 0) return luaL_error(L, "shm_create: negative size");
  int err;
  rh_shm_t *s = rh_shm_create((size_t)n, &err);
  if (!s) {
    lua_pushnil(L);
    lua_pushfstring(L, "cannot make a shared-memory segment: %s", strerror(-err));
    return 2;
  }
  rh_lua_pushshm(L, s);
  return 1;
}

/* shm_probe() -> true | nil, why: whether segments can be made here */
static int l_probe(lua_State *L) {
  int rc = rh_shm_probe();
  if (rc == 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushnil(L);
  lua_pushfstring(L, "memfd_create fails: %s", strerror(-rc));
  return 2;
}

static int l_inode(lua_State *L) {
  lua_pushnumber(L, (double)rh_shm_inode(rh_lua_checkshm(L, 1)));
  return 1;
}

static int l_size(lua_State *L) {
  lua_pushnumber(L, (double)rh_lua_checkshm(L, 1)->size);
  return 1;
}

/* seg:put(offset, tensor): the contiguous host tensor's bytes, copied in */
static int l_put(lua_State *L) {
  rh_shm_t *s = rh_lua_checkshm(L, 1);
  size_t len;
  rh_tensor_t *t = rh_lua_checkhostspan(L, 3, "shm put", &len);
  size_t off = check_span(L, s, luaL_checknumber(L, 2), (double)len);
  if (!s->writable) return luaL_error(L, "shm put: the segment is a peer's");
  if (len) rh_copy_parallel((char *)s->map + off, rh_tensor_data(t), len);
  return 0;
}

/* seg:get(offset, len) -> a new 1-D uint8 tensor holding a copy of those bytes */
static int l_get(lua_State *L) {
  rh_shm_t *s = rh_lua_checkshm(L, 1);
  double len = luaL_checknumber(L, 3);
  size_t off = check_span(L, s, luaL_checknumber(L, 2), len);
  int64_t n = (int64_t)len;
  rh_tensor_t *t = rh_tensor_empty(RH_U8, 1, &n);
  if (!t) return luaL_error(L, "%s", rh_tensor_errmsg());
  if (n) rh_copy_parallel(rh_tensor_data(t), (const char *)s->map + off, (size_t)n);
  return rh_lua_pushtensor(L, t);
}

/* ---- loans ---- */

typedef struct {
  rh_shm_t *seg;
  int left; /* tensors of the payload still alive */
  double rank, sid;
} loan_t;

/* ended loans: (rank, segment) pairs. Storages are freed on the loop thread in
 * practice, but a lock keeps the queue right wherever one is freed. */
static pthread_mutex_t ended_mu = PTHREAD_MUTEX_INITIALIZER;
static double *ended;
static size_t nended, cended;

static void loan_storage_freed(void *ctx, void *data) {
  loan_t *l = ctx;
  (void)data;
  if (__atomic_sub_fetch(&l->left, 1, __ATOMIC_ACQ_REL) > 0) return;
  pthread_mutex_lock(&ended_mu);
  if (nended + 2 > cended) {
    size_t n = cended ? cended * 2 : 64;
    double *q = realloc(ended, n * sizeof *q);
    if (q) ended = q, cended = n;
  }
  /* (without room the segment is never handed back: the sender's pool shrinks
   * by one, which is safe) */
  if (nended + 2 <= cended) {
    ended[nended++] = l->rank;
    ended[nended++] = l->sid;
  }
  pthread_mutex_unlock(&ended_mu);
  rh_shm_release(l->seg);
  free(l);
}

/* seg:adopt(rank, sid, off1, len1, off2, len2, ...) -> one 1-D uint8 tensor per
 * span, living in the segment; when all are freed, (rank, sid) is queued for
 * shm_released */
static int l_adopt(lua_State *L) {
  rh_shm_t *s = rh_lua_checkshm(L, 1);
  double rank = luaL_checknumber(L, 2), sid = luaL_checknumber(L, 3);
  int nspan = (lua_gettop(L) - 3) / 2;
  if (nspan < 1 || lua_gettop(L) != 3 + 2 * nspan) return luaL_error(L, "adopt: expected offset, length pairs");
  size_t offs[64], lens[64];
  if (nspan > 64) return luaL_error(L, "adopt: too many spans (%d > 64)", nspan);
  for (int i = 0; i < nspan; i++) {
    lens[i] = (size_t)luaL_checknumber(L, 5 + 2 * i);
    offs[i] = check_span(L, s, luaL_checknumber(L, 4 + 2 * i), luaL_checknumber(L, 5 + 2 * i));
  }
  loan_t *l = malloc(sizeof *l);
  if (!l) return luaL_error(L, "out of memory");
  *l = (loan_t){s, nspan, rank, sid};
  rh_shm_retain(s);
  luaL_checkstack(L, nspan, "adopt");
  for (int i = 0; i < nspan; i++) {
    rh_storage_t *st = rh_storage_wrap((char *)s->map + offs[i], lens[i], loan_storage_freed, l);
    int64_t n = (int64_t)lens[i], one = 1;
    rh_tensor_t *t = st ? rh_tensor_on_storage(st, RH_U8, 0, 1, &n, &one) : NULL;
    if (st) rh_storage_release(st); /* the tensor holds it (or it is gone) */
    if (!t) {
      /* the spans not made yet will never be freed: count them off */
      for (int k = i + (st ? 1 : 0); k < nspan; k++) loan_storage_freed(l, NULL);
      if (!st) loan_storage_freed(l, NULL);
      return luaL_error(L, "adopt: out of memory");
    }
    rh_lua_pushtensor(L, t);
  }
  return nspan;
}

/* shm_released() -> {rank, sid, rank, sid, ...} of the loans that ended, or nil.
 * The queue is taken whole under the lock and the table made after: making it
 * may run the collector, whose finalisers end more loans (loan_storage_freed
 * takes the lock: made under it, a rank deadlocked on itself, found by kill -9
 * of a peer in the middle of an all_gather loop). */
static int l_released(lua_State *L) {
  pthread_mutex_lock(&ended_mu);
  double *q = ended;
  size_t n = nended;
  if (n) ended = NULL, nended = cended = 0;
  pthread_mutex_unlock(&ended_mu);
  if (n == 0) return 0;
  lua_createtable(L, (int)n, 0);
  for (size_t i = 0; i < n; i++) {
    lua_pushnumber(L, q[i]);
    lua_rawseti(L, -2, (int)i + 1);
  }
  free(q);
  return 1;
}

static int l_close(lua_State *L) {
  box_t *b = check_box(L, 1);
  rh_shm_release(b->s);
  b->s = NULL;
  return 0;
}

int rh_open_shm(lua_State *L) {
  static const luaL_Reg methods[] = {{"size", l_size},   {"put", l_put},     {"get", l_get}, {"adopt", l_adopt},
                                     {"close", l_close}, {"inode", l_inode}, {NULL, NULL}};
  rh_lua_class(L, SHM_MT, methods, l_close, NULL);
  static const luaL_Reg fns[] = {
      {"shm_create", l_create}, {"shm_probe", l_probe}, {"shm_released", l_released}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
