/* l_mpi.c: the host's MPI library for Lua (rpchost.dist.mpi_group), a thin layer
 * over host/mpi/mpi.c. Communicators are light userdata (Open MPI's handles are
 * pointers the library owns); a request is a userdata box that mpi_test
 * completes. Tensors handed to an operation are borrowed: the Lua caller keeps
 * them alive until mpi_test says the request is done (rpchost.dist.mpi_group keeps
 * those of a request it gave up on for the rest of the process). Every tensor
 * must be a contiguous host tensor: the wrapper stages the others. */
#include <stdint.h>
#include <string.h>

#include "mpi/mpi.h"
#include "rh_lua.h"
#include "tensor/tensor.h"

#define REQ_MT "rpchost.MpiRequest"

typedef struct {
  rh_mpi_req_t r;
  int done;
  rh_mpi_comm_t comm; /* what an MPI_Comm_idup makes */
  int ints[];         /* MPI_Ialltoallv's counts and displacements, read by MPI until done */
} req_t;

static int mpi_err(lua_State *L) { return luaL_error(L, "%s", rh_mpi_error()); }

static rh_mpi_comm_t check_comm(lua_State *L, int i) {
  if (!lua_islightuserdata(L, i) || !lua_touserdata(L, i)) luaL_argerror(L, i, "expected an MPI communicator");
  return lua_touserdata(L, i);
}

/* a contiguous host tensor's data, element count and dtype */
static void *span(lua_State *L, int i, size_t *count, rh_dtype_t *dt, const char *what) {
  rh_tensor_t *t = rh_lua_checkhostspan(L, i, what, NULL);
  *count = (size_t)rh_tensor_numel(t);
  *dt = t->dtype;
  return rh_tensor_data(t);
}

/* a request box with room for nints ints that live as long as it does */
static req_t *new_req_ints(lua_State *L, size_t nints) {
  size_t bytes = sizeof(req_t) + nints * sizeof(int);
  req_t *q = lua_newuserdata(L, bytes);
  memset(q, 0, bytes);
  luaL_getmetatable(L, REQ_MT);
  lua_setmetatable(L, -2);
  return q;
}

static req_t *new_req(lua_State *L) {
  req_t *q = lua_newuserdata(L, sizeof *q);
  memset(q, 0, sizeof *q);
  luaL_getmetatable(L, REQ_MT);
  lua_setmetatable(L, -2);
  return q;
}

/* pushes the request, or raises the failure */
static int started(lua_State *L, req_t *q, int rc) {
  if (rc) return mpi_err(L);
  (void)q;
  return 1;
}

static int l_available(lua_State *L) {
  if (rh_mpi_load() == 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushnil(L);
  lua_pushstring(L, rh_mpi_error());
  return 2;
}

static int l_init(lua_State *L) {
  int rank, size;
  if (rh_mpi_init(&rank, &size)) return mpi_err(L);
  lua_pushinteger(L, rank);
  lua_pushinteger(L, size);
  return 2;
}

static int l_initialized(lua_State *L) {
  lua_pushboolean(L, rh_mpi_initialized());
  return 1;
}

static int l_finalize(lua_State *L) {
  if (rh_mpi_finalize()) return mpi_err(L);
  return 0;
}

static int l_abort(lua_State *L) {
  rh_mpi_abort((int)luaL_optinteger(L, 1, 1));
  return 0;
}

static int l_world(lua_State *L) {
  lua_pushlightuserdata(L, rh_mpi_world());
  return 1;
}

static int l_split(lua_State *L) {
  rh_mpi_comm_t out;
  if (rh_mpi_comm_split(check_comm(L, 1), (int)luaL_checkinteger(L, 2), (int)luaL_checkinteger(L, 3), &out))
    return mpi_err(L);
  if (!out) return 0;
  lua_pushlightuserdata(L, out);
  return 1;
}

static int l_dup(lua_State *L) {
  rh_mpi_comm_t out;
  if (rh_mpi_comm_dup(check_comm(L, 1), &out)) return mpi_err(L);
  lua_pushlightuserdata(L, out);
  return 1;
}

/* mpi_idup(comm) -> request; mpi_req_comm(request) once it is done */
static int l_idup(lua_State *L) {
  rh_mpi_comm_t c = check_comm(L, 1);
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_comm_idup(c, &q->comm, &q->r));
}

static int l_req_comm(lua_State *L) {
  req_t *q = luaL_checkudata(L, 1, REQ_MT);
  if (!q->done || !q->comm) return luaL_error(L, "mpi_req_comm: the request has made no communicator (yet)");
  lua_pushlightuserdata(L, q->comm);
  return 1;
}

static int l_free(lua_State *L) {
  rh_mpi_comm_t c = check_comm(L, 1);
  rh_mpi_comm_free(&c);
  return 0;
}

static int l_processor_name(lua_State *L) {
  char name[512];
  if (rh_mpi_processor_name(name, sizeof name)) return mpi_err(L);
  lua_pushstring(L, name);
  return 1;
}

static int l_iallreduce(lua_State *L) {
  size_t n;
  rh_dtype_t dt;
  void *p = span(L, 2, &n, &dt, "all_reduce");
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_iallreduce(check_comm(L, 1), p, n, dt, (int)luaL_checkinteger(L, 3), &q->r));
}

static int l_ireduce(lua_State *L) {
  size_t n;
  rh_dtype_t dt;
  void *p = span(L, 2, &n, &dt, "reduce");
  req_t *q = new_req(L);
  return started(L, q,
                 rh_mpi_ireduce(check_comm(L, 1), p, n, dt, (int)luaL_checkinteger(L, 3), (int)luaL_checkinteger(L, 4),
                                (int)luaL_checkinteger(L, 5), &q->r));
}

static int l_ibcast(lua_State *L) {
  size_t n;
  rh_dtype_t dt;
  void *p = span(L, 2, &n, &dt, "broadcast");
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_ibcast(check_comm(L, 1), p, n, dt, (int)luaL_checkinteger(L, 3), &q->r));
}

/* (comm, small, big): big has `size` times small's elements, same dtype (both
 * checked here); big may be nil where MPI ignores it */
static void two(lua_State *L, const char *what, void **a, void **b, size_t *n, rh_dtype_t *dt, int size) {
  size_t nb;
  rh_dtype_t dtb;
  *a = span(L, 2, n, dt, what);
  if (lua_isnoneornil(L, 3)) { /* (gather's and scatter's stacked buffer, away from the root) */
    *b = NULL;
    return;
  }
  *b = span(L, 3, &nb, &dtb, what);
  if (dtb != *dt) luaL_error(L, "%s: the buffers' dtypes differ", what);
  if (nb != *n * (size_t)size) luaL_error(L, "%s: the gathered buffer must hold %d x %d elements", what, size, (int)*n);
}

static int l_iallgather(lua_State *L) {
  void *a, *b;
  size_t n;
  rh_dtype_t dt;
  two(L, "all_gather", &a, &b, &n, &dt, (int)luaL_checkinteger(L, 4));
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_iallgather(check_comm(L, 1), a, b, n, dt, &q->r));
}

/* (comm, out, stacked_in, size, op) */
static int l_ireduce_scatter(lua_State *L) {
  void *a, *b;
  size_t n;
  rh_dtype_t dt;
  two(L, "reduce_scatter", &a, &b, &n, &dt, (int)luaL_checkinteger(L, 4));
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_ireduce_scatter(check_comm(L, 1), b, a, n, dt, (int)luaL_checkinteger(L, 5), &q->r));
}

/* (comm, t, stacked_or_t, size, root): the stacked buffer matters at the root only */
static int l_igather(lua_State *L) {
  void *a, *b;
  size_t n;
  rh_dtype_t dt;
  two(L, "gather", &a, &b, &n, &dt, (int)luaL_checkinteger(L, 4));
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_igather(check_comm(L, 1), a, b, n, dt, (int)luaL_checkinteger(L, 5), &q->r));
}

static int l_iscatter(lua_State *L) {
  void *a, *b;
  size_t n;
  rh_dtype_t dt;
  two(L, "scatter", &a, &b, &n, &dt, (int)luaL_checkinteger(L, 4));
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_iscatter(check_comm(L, 1), b, a, n, dt, (int)luaL_checkinteger(L, 5), &q->r));
}

/* (comm, send, recv, size): send and recv hold size x count elements each */
static int l_ialltoall(lua_State *L) {
  size_t ns, nr;
  rh_dtype_t ds, dr;
  void *s = span(L, 2, &ns, &ds, "all_to_all");
  void *r = span(L, 3, &nr, &dr, "all_to_all");
  lua_Integer size = luaL_checkinteger(L, 4);
  if (size < 1) return luaL_argerror(L, 4, "the group size must be positive");
  if (ds != dr) return luaL_error(L, "all_to_all: the buffers' dtypes differ");
  if (ns != nr || ns % (size_t)size)
    return luaL_error(L, "all_to_all: both buffers must hold %d blocks of the same number of elements", (int)size);
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_ialltoall(check_comm(L, 1), s, r, ns / (size_t)size, ds, &q->r));
}

/* a list of n element counts (Lua numbers) into out[n]; their sum */
static size_t counts(lua_State *L, int i, int n, size_t *out, const char *what) {
  luaL_checktype(L, i, LUA_TTABLE);
  if ((int)lua_objlen(L, i) != n) luaL_error(L, "all_to_all: %s must list %d counts, one per rank", what, n);
  size_t sum = 0;
  for (int k = 0; k < n; k++) {
    lua_rawgeti(L, i, k + 1);
    lua_Number v = lua_tonumber(L, -1);
    if (!lua_isnumber(L, -1) || !(v >= 0 && v <= 9007199254740992.0) || v != (lua_Number)(int64_t)v)
      luaL_error(L, "all_to_all: %s[%d] must be a count of elements (an integer >= 0)", what, k + 1);
    lua_pop(L, 1);
    out[k] = (size_t)v;
    sum += out[k];
  }
  return sum;
}

/* (comm, send, send_counts, recv, recv_counts): segments back to back in rank
 * order; the counts must add up to the buffers' elements, so MPI never reads
 * or writes past them */
static int l_ialltoallv(lua_State *L) {
  size_t ns, nr;
  rh_dtype_t ds, dr;
  rh_mpi_comm_t c = check_comm(L, 1);
  void *s = span(L, 2, &ns, &ds, "all_to_all");
  void *r = span(L, 4, &nr, &dr, "all_to_all");
  if (ds != dr) return luaL_error(L, "all_to_all: the buffers' dtypes differ");
  int n = (int)lua_objlen(L, 3);
  if (n < 1) return luaL_argerror(L, 3, "expected a list of counts, one per rank");
  size_t *sc = lua_newuserdata(L, 2 * (size_t)n * sizeof *sc); /* (garbage, even when a check raises) */
  size_t *rc = sc + n;
  size_t ss = counts(L, 3, n, sc, "the send counts"), rs = counts(L, 5, n, rc, "the receive counts");
  if (ss != ns)
    return luaL_error(L, "all_to_all: the send counts add up to %zu elements but the buffer has %zu", ss, ns);
  if (rs != nr)
    return luaL_error(L, "all_to_all: the receive counts add up to %zu elements but the buffer has %zu", rs, nr);
  req_t *q = new_req_ints(L, 4 * (size_t)n);
  return started(L, q, rh_mpi_ialltoallv(c, s, sc, r, rc, n, ds, q->ints, &q->r));
}

static int l_ibarrier(lua_State *L) {
  rh_mpi_comm_t c = check_comm(L, 1);
  req_t *q = new_req(L);
  return started(L, q, rh_mpi_ibarrier(c, &q->r));
}

static int l_isend(lua_State *L) {
  size_t n;
  rh_dtype_t dt;
  void *p = span(L, 2, &n, &dt, "send");
  req_t *q = new_req(L);
  return started(L, q,
                 rh_mpi_isend(check_comm(L, 1), p, n * rh_dtype_size(dt), (int)luaL_checkinteger(L, 3),
                              (int)luaL_checkinteger(L, 4), &q->r));
}

/* (comm, t, src, tag): src nil receives from any rank */
static int l_irecv(lua_State *L) {
  size_t n;
  rh_dtype_t dt;
  void *p = span(L, 2, &n, &dt, "recv");
  int src = lua_isnoneornil(L, 3) ? RH_MPI_ANY_SOURCE : (int)luaL_checkinteger(L, 3);
  if (src < 0 && src != RH_MPI_ANY_SOURCE) return luaL_argerror(L, 3, "expected a rank >= 0 or nil (any rank)");
  req_t *q = new_req(L);
  return started(L, q,
                 rh_mpi_irecv(check_comm(L, 1), p, n * rh_dtype_size(dt), src, (int)luaL_checkinteger(L, 4), &q->r));
}

/* mpi_test(req) -> true, bytes_received, source | false; a failed request is
 * nil, MPI's message, source (the sender when MPI says, else -1): a receive
 * from any rank that was too small has no other way to say who sent */
static int l_test(lua_State *L) {
  req_t *q = luaL_checkudata(L, 1, REQ_MT);
  size_t got = 0;
  int source = -1;
  if (!q->done) {
    int done = 0;
    if (rh_mpi_test(&q->r, &done, &got, &source)) {
      q->done = 1; /* (a failed request is not tested again) */
      lua_pushnil(L);
      lua_pushstring(L, rh_mpi_error());
      lua_pushinteger(L, source);
      return 3;
    }
    q->done = done;
    if (!done) {
      lua_pushboolean(L, 0);
      return 1;
    }
  }
  lua_pushboolean(L, 1);
  lua_pushnumber(L, (double)got);
  lua_pushinteger(L, source);
  return 3;
}

int rh_open_mpi(lua_State *L) {
  rh_lua_class(L, REQ_MT, NULL, NULL, NULL);
  static const luaL_Reg fns[] = {{"mpi_available", l_available},
                                 {"mpi_init", l_init},
                                 {"mpi_initialized", l_initialized},
                                 {"mpi_finalize", l_finalize},
                                 {"mpi_abort", l_abort},
                                 {"mpi_world", l_world},
                                 {"mpi_split", l_split},
                                 {"mpi_dup", l_dup},
                                 {"mpi_idup", l_idup},
                                 {"mpi_req_comm", l_req_comm},
                                 {"mpi_free", l_free},
                                 {"mpi_processor_name", l_processor_name},
                                 {"mpi_iallreduce", l_iallreduce},
                                 {"mpi_ireduce", l_ireduce},
                                 {"mpi_ibcast", l_ibcast},
                                 {"mpi_iallgather", l_iallgather},
                                 {"mpi_ireduce_scatter", l_ireduce_scatter},
                                 {"mpi_igather", l_igather},
                                 {"mpi_iscatter", l_iscatter},
                                 {"mpi_ialltoall", l_ialltoall},
                                 {"mpi_ialltoallv", l_ialltoallv},
                                 {"mpi_ibarrier", l_ibarrier},
                                 {"mpi_isend", l_isend},
                                 {"mpi_irecv", l_irecv},
                                 {"mpi_test", l_test},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
