/* l_cuda.c: CUDA devices, the caching allocator's counters, events and NCCL
 * for Lua, through the kernels library (host/tensor/device.c loads it). Every
 * entry point raises a clear error when CUDA is unavailable; tensors handed to
 * NCCL must be contiguous and on a device. Communicators and events are light
 * userdata owned by the Lua code that made them (rpchost.nccl_group). */
#include "rh_lua.h"
#include "tensor/cuda_api.h"
#include "tensor/tensor.h"

static const rhc_api_t *need_api(lua_State *L) {
  const rhc_api_t *api = rh_cuda_api();
  if (!api) luaL_error(L, "CUDA is not available: %s (tensor.cuda.is_available() is false)", rh_cuda_why());
  return api;
}

static int check_dev(lua_State *L, int i) {
  int dev = (int)luaL_checkinteger(L, i);
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
  if (rh_cuda_synchronize((int)luaL_checkinteger(L, 1))) return luaL_error(L, "%s", rh_tensor_errmsg());
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
  check_rc(L, rh_cuda_api(), rh_cuda_api()->bench_cublas_gemm(dev, (int)luaL_checkinteger(L, 2),
                                                             (int)luaL_checkinteger(L, 3), &ms));
  lua_pushnumber(L, ms);
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
  int r = api->event_done(ev);
  if (r < 0) {
    lua_pushnil(L);
    lua_pushstring(L, api->last_error());
    return 2;
  }
  lua_pushboolean(L, r);
  return 1;
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
  int r = api->nccl_ready(check_comm(L, 1));
  if (r < 0) {
    lua_pushnil(L);
    lua_pushstring(L, api->last_error());
    return 2;
  }
  lua_pushboolean(L, r);
  return 1;
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

/* NCCL reads and writes `count` elements of ONE dtype through raw pointers: a
 * receive buffer smaller than NCCL writes, or of another dtype, would corrupt
 * device memory. want_recv: how many elements recv must hold, from the send
 * count (n) and the receive count (m) as the call defines them. */
static void check_pair(lua_State *L, const char *what, int dt, int dt2, int64_t m, int64_t want_recv) {
  if (dt != dt2) luaL_error(L, "%s: the send and receive tensors must have the same dtype", what);
  if (m != want_recv)
    luaL_error(L, "%s: the receive tensor has %lld elements, the call needs %lld", what, (long long)m,
               (long long)want_recv);
}

static int l_nccl_all_reduce(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n, m;
  int dt, dt2;
  void *s = dev_data(L, 2, &n, &dt), *r = dev_data(L, 3, &m, &dt2);
  check_pair(L, "nccl_all_reduce", dt, dt2, m, n);
  check_rc(L, api, api->nccl_all_reduce(check_comm(L, 1), s, r, n, dt, (int)luaL_checkinteger(L, 4)));
  return 0;
}

static int l_nccl_broadcast(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n;
  int dt;
  void *b = dev_data(L, 2, &n, &dt);
  check_rc(L, api, api->nccl_broadcast(check_comm(L, 1), b, n, dt, (int)luaL_checkinteger(L, 3)));
  return 0;
}

static int l_nccl_reduce(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n, m;
  int dt, dt2;
  void *s = dev_data(L, 2, &n, &dt), *r = dev_data(L, 3, &m, &dt2);
  check_pair(L, "nccl_reduce", dt, dt2, m, n);
  check_rc(L, api, api->nccl_reduce(check_comm(L, 1), s, r, n, dt, (int)luaL_checkinteger(L, 4),
                                    (int)luaL_checkinteger(L, 5)));
  return 0;
}

/* all_gather(comm, send, recv, nranks): recv holds nranks x numel(send) */
static int l_nccl_all_gather(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n, m;
  int dt, dt2;
  void *s = dev_data(L, 2, &n, &dt), *r = dev_data(L, 3, &m, &dt2);
  int64_t nranks = (int64_t)luaL_checkinteger(L, 4);
  check_pair(L, "nccl_all_gather", dt, dt2, m, nranks * n);
  check_rc(L, api, api->nccl_all_gather(check_comm(L, 1), s, r, n, dt));
  return 0;
}

/* reduce_scatter(comm, send, recv, op, nranks): send holds nranks x numel(recv) */
static int l_nccl_reduce_scatter(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n, m;
  int dt, dt2;
  void *s = dev_data(L, 2, &n, &dt), *r = dev_data(L, 3, &m, &dt2);
  int64_t nranks = (int64_t)luaL_checkinteger(L, 5);
  /* NCCL reads nranks x m elements from send */
  if (dt != dt2) return luaL_error(L, "nccl_reduce_scatter: the send and receive tensors must have the same dtype");
  if (n != nranks * m)
    return luaL_error(L, "nccl_reduce_scatter: the send tensor has %lld elements, the call needs %lld", (long long)n,
                      (long long)(nranks * m));
  check_rc(L, api, api->nccl_reduce_scatter(check_comm(L, 1), s, r, m, dt, (int)luaL_checkinteger(L, 4)));
  return 0;
}

static int l_nccl_send(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n;
  int dt;
  void *b = dev_data(L, 2, &n, &dt);
  check_rc(L, api, api->nccl_send(check_comm(L, 1), b, n, dt, (int)luaL_checkinteger(L, 3)));
  return 0;
}

static int l_nccl_recv(lua_State *L) {
  const rhc_api_t *api = need_api(L);
  int64_t n;
  int dt;
  void *b = dev_data(L, 2, &n, &dt);
  check_rc(L, api, api->nccl_recv(check_comm(L, 1), b, n, dt, (int)luaL_checkinteger(L, 3)));
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
  static const luaL_Reg fns[] = {
      {"cuda_count", l_count},          {"cuda_sync", l_sync},
      {"cuda_name", l_name},            {"cuda_limits", l_limits},
      {"cuda_memstats", l_memstats},    {"cuda_empty_cache", l_empty_cache},
      {"cuda_bench_gemm", l_bench_gemm}, {"cuda_event", l_event},
      {"cuda_event_done", l_event_done}, {"cuda_event_free", l_event_free},
      {"nccl_available", l_nccl_available}, {"nccl_unique_id", l_nccl_unique_id},
      {"nccl_init", l_nccl_init},       {"nccl_ready", l_nccl_ready},
      {"nccl_abort", l_nccl_abort},     {"nccl_all_reduce", l_nccl_all_reduce},
      {"nccl_broadcast", l_nccl_broadcast}, {"nccl_reduce", l_nccl_reduce},
      {"nccl_all_gather", l_nccl_all_gather}, {"nccl_reduce_scatter", l_nccl_reduce_scatter},
      {"nccl_send", l_nccl_send},       {"nccl_recv", l_nccl_recv},
      {"nccl_group_start", l_nccl_group_start}, {"nccl_group_end", l_nccl_group_end},
      {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
