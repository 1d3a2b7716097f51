/* l_cuda.c: CUDA devices, the caching allocator's counters, events and NCCL
 * for Lua, through the kernels library (host/tensor/device.c loads it). Every
 * entry point raises a clear error when CUDA is unavailable; tensors handed to
 * NCCL must be contiguous and on a device. Communicators and events are light
 * userdata owned by the Lua code that made them (rpchost.dist.nccl_group). */
#include "rh_lua.h"
#include "tensor/cuda_api.h"
#include "tensor/tensor.h"

static const rhc_api_t *need_api(lua_State *L) {
  const rhc_api_t *api = rh_cuda_api();
  if (!api) luaL_error(L, "CUDA is not available: %s (tensor.cuda.is_available() is false)", rh_cuda_why());
  return api;
}

static int check_dev(lua_State *L, int i) {
  int dev = rh_lua_checkdevice(L, i);
  need_api(L);
  if (dev < 0 || dev >= rh_cuda_device_count())
    luaL_error(L, "CUDA device cuda:%d does not exist (this machine has %d)", dev, rh_cuda_device_count());
  return dev;
}

/* the library's message as a Lua error when rc != 0 */
static void check_rc(lua_State *L, const rhc_api_t *api, int rc) {
  if (rc) luaL_error(L, "%s", api->last_error());
}

static int l_count(lua_State *L) {
  lua_pushinteger(L, rh_cuda_device_count());
  lua_pushstring(L, rh_cuda_why());
  return 2;
}

static int l_sync(lua_State *L) {
  if (rh_cuda_synchronize(rh_lua_checkdevice(L, 1))) return luaL_error(L, "%s", rh_tensor_errmsg());
  return 0;
}

static int l_name(lua_State *L) {
  int dev = check_dev(L, 1);
  char buf[256];
  check_rc(L, rh_cuda_api(), rh_cuda_api()->device_name(dev, buf, sizeof buf));
  lua_pushstring(L, buf);
  return 1;
}

/* cuda_limits(dev) -> peak memory bandwidth (GB/s), SM count */
static int l_limits(lua_State *L) {
  int dev = check_dev(L, 1);
  double gbps = 0;
  int sms = 0;
  check_rc(L, rh_cuda_api(), rh_cuda_api()->device_limits(dev, &gbps, &sms));
  lua_pushnumber(L, gbps);
  lua_pushinteger(L, sms);
  return 2;
}

static int l_memstats(lua_State *L) {
  int dev = check_dev(L, 1);
  rhc_memstats_t m;
  check_rc(L, rh_cuda_api(), rh_cuda_api()->memstats(dev, &m));
  lua_createtable(L, 0, 4);
  lua_pushnumber(L, (double)m.allocated);
  lua_setfield(L, -2, "allocated");
  lua_pushnumber(L, (double)m.cached);
  lua_setfield(L, -2, "cached");
  lua_pushnumber(L, (double)m.peak);
  lua_setfield(L, -2, "peak");
  lua_pushnumber(L, (double)m.cuda_mallocs);
  lua_setfield(L, -2, "cuda_mallocs");
  return 1;
}

static int l_empty_cache(lua_State *L) {
  int dev = check_dev(L, 1);
  check_rc(L, rh_cuda_api(), rh_cuda_api()->empty_cache(dev));
  return 0;
}

static int l_bench_gemm(lua_State *L) {
  int dev = check_dev(L, 1);
  double ms = 0;
  check_rc(L, rh_cuda_api(),
           rh_cuda_api()->bench_cublas_gemm(dev, (int)luaL_checkinteger(L, 2), (int)luaL_checkinteger(L, 3), &ms));
  lua_pushnumber(L, ms);
  return 1;
}

/* A poll's answer (1 done, 0 not yet, -1 failed) as true | false | nil, message */
static int push_poll(lua_State *L, const rhc_api_t *api, int r) {
  if (r < 0) {
    lua_pushnil(L);
    lua_pushstring(L, api->last_error());
    return 2;
  }
  lua_pushboolean(L, r);
  return 1;
}

/* ---- events: completion of the work queued on a device so far */
static int l_event(lua_State *L) {
  int dev = check_dev(L, 1);
  void *ev = NULL;
  check_rc(L, rh_cuda_api(), rh_cuda_api()->event_record(dev, &ev));
  lua_pushlightuserdata(L, ev);
  return 1;
}

/* event_done(ev) -> true | false | nil, message (the queued work failed) */
static int l_event_done(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  void *ev = lua_touserdata(L, 1);
  if (!ev) return luaL_error(L, "cuda_event_done: an event from cuda_event expected"); /* the library dereferences it */
  return push_poll(L, api, api->event_done(ev));
}

static int l_event_free(lua_State *L) {
  void *ev = lua_touserdata(L, 1);
  if (ev) need_api(L)->event_free(ev);
  return 0;
}

/* ---- NCCL */
static int l_nccl_available(lua_State *L) {
  const rhc_api_t *api = rh_cuda_api();
  char why[256] = "";
  if (!api) {
    lua_pushboolean(L, 0);
    lua_pushfstring(L, "CUDA is not available: %s", rh_cuda_why());
    return 2;
  }
  int ok = api->nccl_available(why, sizeof why);
  lua_pushboolean(L, ok);
  lua_pushstring(L, why);
  return 2;
}

static int l_nccl_unique_id(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  char id[128];
  check_rc(L, api, api->nccl_unique_id(id));
  lua_pushlstring(L, id, sizeof id);
  return 1;
}

/* nccl_init(dev, nranks, rank, id) -> comm (initialising; poll nccl_ready) */
static int l_nccl_init(lua_State *L) {
  int dev = check_dev(L, 1);
  int nranks = (int)luaL_checkinteger(L, 2), rank = (int)luaL_checkinteger(L, 3);
  size_t len;
  const char *id = luaL_checklstring(L, 4, &len);
  if (len != 128) return luaL_error(L, "nccl_init: the unique id must be 128 bytes, got %d", (int)len);
  void *comm = NULL;
  check_rc(L, rh_cuda_api(), rh_cuda_api()->nccl_init(dev, nranks, rank, id, &comm));
  lua_pushlightuserdata(L, comm);
  return 1;
}

static void *check_comm(lua_State *L, int i) {
  void *c = lua_touserdata(L, i);
  if (!c) luaL_error(L, "NCCL communicator expected");
  return c;
}

/* nccl_ready(comm) -> true | false | nil, message */
static int l_nccl_ready(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  return push_poll(L, api, api->nccl_ready(check_comm(L, 1)));
}

static int l_nccl_abort(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  check_rc(L, api, api->nccl_abort(check_comm(L, 1)));
  return 0;
}

/* a contiguous device tensor's data and element count */
static void *dev_data(lua_State *L, int i, int64_t *count, int *dtype) {
  rh_tensor_t *t = rh_lua_checktensor(L, i);
  if (rh_tensor_device(t) < 0) luaL_error(L, "NCCL needs CUDA tensors; this one is on the CPU (move it with :cuda())");
  if (!rh_tensor_is_contiguous(t)) luaL_error(L, "NCCL needs contiguous tensors");
  *count = rh_tensor_numel(t);
  *dtype = t->dtype;
  return rh_tensor_data(t);
}

/* The arguments of a one-buffer call (comm, tensor, root or peer). */
typedef struct {
  const rhc_api_t *api;
  void *comm, *buf;
  int64_t n;
  int dtype, arg;
} nccl_one_t;

static nccl_one_t nccl_one(lua_State *L) {
  nccl_one_t a;
  a.api = need_api(L);
  a.comm = check_comm(L, 1);
  a.buf = dev_data(L, 2, &a.n, &a.dtype);
  a.arg = (int)luaL_checkinteger(L, 3);
  return a;
}

/* The arguments of a call that reads `send` (index 2) and writes `recv` (index
 * 3). NCCL moves elements of ONE dtype through raw pointers, so a receive
 * buffer of another dtype or size than the call writes would corrupt device
 * memory: the counts must satisfy n_send * per_send == n_recv * per_recv
 * (all_gather: recv = nranks x send; reduce_scatter: send = nranks x recv). */
typedef struct {
  const rhc_api_t *api;
  void *comm, *send, *recv;
  int64_t n_send, n_recv;
  int dtype;
} nccl_pair_t;

static nccl_pair_t nccl_pair(lua_State *L, const char *what, int64_t per_send, int64_t per_recv) {
  nccl_pair_t a;
  int dt2;
  a.api = need_api(L);
  a.comm = check_comm(L, 1);
  a.send = dev_data(L, 2, &a.n_send, &a.dtype);
  a.recv = dev_data(L, 3, &a.n_recv, &dt2);
  if (a.dtype != dt2) luaL_error(L, "%s: the send and receive tensors must have the same dtype", what);
  if (a.n_send * per_send != a.n_recv * per_recv)
    luaL_error(L,
               "%s: a send tensor of %lld elements and a receive tensor of %lld do not fit this call (%lld x send = "
               "%lld x receive)",
               what, (long long)a.n_send, (long long)a.n_recv, (long long)per_send, (long long)per_recv);
  return a;
}

static int l_nccl_all_reduce(lua_State *L) {
  nccl_pair_t a = nccl_pair(L, "nccl_all_reduce", 1, 1);
  check_rc(L, a.api, a.api->nccl_all_reduce(a.comm, a.send, a.recv, a.n_send, a.dtype, (int)luaL_checkinteger(L, 4)));
  return 0;
}

static int l_nccl_reduce(lua_State *L) {
  nccl_pair_t a = nccl_pair(L, "nccl_reduce", 1, 1);
  check_rc(L, a.api,
           a.api->nccl_reduce(a.comm, a.send, a.recv, a.n_send, a.dtype, (int)luaL_checkinteger(L, 4),
                              (int)luaL_checkinteger(L, 5)));
  return 0;
}

/* all_gather(comm, send, recv, nranks): recv holds nranks x numel(send) */
static int l_nccl_all_gather(lua_State *L) {
  nccl_pair_t a = nccl_pair(L, "nccl_all_gather", (int64_t)luaL_checkinteger(L, 4), 1);
  check_rc(L, a.api, a.api->nccl_all_gather(a.comm, a.send, a.recv, a.n_send, a.dtype));
  return 0;
}

/* reduce_scatter(comm, send, recv, op, nranks): send holds nranks x numel(recv) */
static int l_nccl_reduce_scatter(lua_State *L) {
  nccl_pair_t a = nccl_pair(L, "nccl_reduce_scatter", 1, (int64_t)luaL_checkinteger(L, 5));
  check_rc(L, a.api,
           a.api->nccl_reduce_scatter(a.comm, a.send, a.recv, a.n_recv, a.dtype, (int)luaL_checkinteger(L, 4)));
  return 0;
}

static int l_nccl_broadcast(lua_State *L) {
  nccl_one_t a = nccl_one(L);
  check_rc(L, a.api, a.api->nccl_broadcast(a.comm, a.buf, a.n, a.dtype, a.arg));
  return 0;
}

static int l_nccl_send(lua_State *L) {
  nccl_one_t a = nccl_one(L);
  check_rc(L, a.api, a.api->nccl_send(a.comm, a.buf, a.n, a.dtype, a.arg));
  return 0;
}

static int l_nccl_recv(lua_State *L) {
  nccl_one_t a = nccl_one(L);
  check_rc(L, a.api, a.api->nccl_recv(a.comm, a.buf, a.n, a.dtype, a.arg));
  return 0;
}

static int l_nccl_group_start(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  check_rc(L, api, api->nccl_group_start());
  return 0;
}

static int l_nccl_group_end(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  check_rc(L, api, api->nccl_group_end());
  return 0;
}

int rh_open_cuda(lua_State *L) {
  static const luaL_Reg fns[] = {{"cuda_count", l_count},
                                 {"cuda_sync", l_sync},
                                 {"cuda_name", l_name},
                                 {"cuda_limits", l_limits},
                                 {"cuda_memstats", l_memstats},
                                 {"cuda_empty_cache", l_empty_cache},
                                 {"cuda_bench_gemm", l_bench_gemm},
                                 {"cuda_event", l_event},
                                 {"cuda_event_done", l_event_done},
                                 {"cuda_event_free", l_event_free},
                                 {"nccl_available", l_nccl_available},
                                 {"nccl_unique_id", l_nccl_unique_id},
                                 {"nccl_init", l_nccl_init},
                                 {"nccl_ready", l_nccl_ready},
                                 {"nccl_abort", l_nccl_abort},
                                 {"nccl_all_reduce", l_nccl_all_reduce},
                                 {"nccl_broadcast", l_nccl_broadcast},
                                 {"nccl_reduce", l_nccl_reduce},
                                 {"nccl_all_gather", l_nccl_all_gather},
                                 {"nccl_reduce_scatter", l_nccl_reduce_scatter},
                                 {"nccl_send", l_nccl_send},
                                 {"nccl_recv", l_nccl_recv},
                                 {"nccl_group_start", l_nccl_group_start},
                                 {"nccl_group_end", l_nccl_group_end},
                                 {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
