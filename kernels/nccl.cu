// nccl.cu: NCCL for the process group's "nccl" backend, loaded with dlopen on
// first use so that neither rpchost nor this library needs libnccl to load.
// Communicators are non-blocking (config.blocking = 0): initialisation and
// collectives return at once and the host polls nccl_ready / event_done from
// its event loop, so a rank waiting for NCCL still serves RPCs and timeouts.
#include <dlfcn.h>
#include <nccl.h>

#include "common.cuh"

namespace rhc {

struct NcclLib {
  void *h = nullptr;
  bool tried = false;
  char why[256] = "";
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*CommAbort)(ncclComm_t);
  const char *(*GetErrorString)(ncclResult_t);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
};

static NcclLib lib;

template <typename F>
static bool sym(F &f, const char *name) {
  f = (F)dlsym(lib.h, name);
  if (!f) snprintf(lib.why, sizeof lib.why, "libnccl has no symbol %s (NCCL 2.14 or newer is needed)", name);
  return f != nullptr;
}

static bool load() {
  if (lib.tried) return lib.h != nullptr;
  lib.tried = true;
  const char *names[] = {"libnccl.so.2", "libnccl.so"};
  for (const char *n : names)
    if ((lib.h = dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
  if (!lib.h) {
    snprintf(lib.why, sizeof lib.why, "cannot load NCCL: %s", dlerror());
    return false;
  }
  bool ok = sym(lib.GetUniqueId, "ncclGetUniqueId") && sym(lib.CommInitRankConfig, "ncclCommInitRankConfig") &&
            sym(lib.CommGetAsyncError, "ncclCommGetAsyncError") && sym(lib.CommAbort, "ncclCommAbort") &&
            sym(lib.GetErrorString, "ncclGetErrorString") && sym(lib.AllReduce, "ncclAllReduce") &&
            sym(lib.Broadcast, "ncclBroadcast") && sym(lib.Reduce, "ncclReduce") &&
            sym(lib.AllGather, "ncclAllGather") && sym(lib.ReduceScatter, "ncclReduceScatter") &&
            sym(lib.Send, "ncclSend") && sym(lib.Recv, "ncclRecv") && sym(lib.GroupStart, "ncclGroupStart") &&
            sym(lib.GroupEnd, "ncclGroupEnd");
  if (!ok) {
    dlclose(lib.h);
    lib.h = nullptr;
  }
  return ok;
}

struct Comm {
  ncclComm_t comm;
  int dev;
};

static int nccl_fail(ncclResult_t r, const char *what) {
  return fail("%s: %s", what, lib.GetErrorString ? lib.GetErrorString(r) : "NCCL error");
}

// ncclInProgress is success for a non-blocking communicator
static int check(ncclResult_t r, const char *what) {
  return (r == ncclSuccess || r == ncclInProgress) ? 0 : nccl_fail(r, what);
}

// A non-blocking call that returns ncclInProgress may still be putting its
// kernels on the stream in the background; until ncclCommGetAsyncError says
// ncclSuccess, CUDA work queued behind it (an event, a synchronize) does not
// wait for the collective. The last such communicator per device is kept here
// and device.cu's events defer their record until it is enqueued. Calls inside
// ncclGroupStart/End are enqueued by ncclGroupEnd, so the communicators used in
// a group are remembered and marked at the end. (The host drives NCCL from one
// thread, its event loop; this state is not locked.)
static Comm *pending[64];
static Comm *in_group[64];
static int group_depth;

static int enqueued(Comm *c, ncclResult_t r, const char *what) {
  if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(r, what);
  if (c->dev >= 0 && c->dev < 64) {
    if (group_depth > 0) in_group[c->dev] = c;
    else if (r == ncclInProgress) pending[c->dev] = c;
  }
  return 0;
}

// the device's stream, or the error (a NULL stream would be the legacy one)
#define STREAM_OR_FAIL(c)                 \
  cudaStream_t s_ = stream_for((c)->dev); \
  if (!s_) return -1;

static bool nccl_type(int dt, ncclDataType_t *t) {
  switch (dt) {
    case F32: *t = ncclFloat32; return true;
    case F64: *t = ncclFloat64; return true;
    case I32: *t = ncclInt32; return true;
    case I64: *t = ncclInt64; return true;
    case U8:
    case BOOL: *t = ncclUint8; return true;
  }
  return false;
}

static bool nccl_op(int op, int dt, ncclRedOp_t *o) {
  switch (op) {
    // bool: sum is "or" (max) and product is "and" (min), as on the CPU
    case RHC_SUM: *o = dt == BOOL ? ncclMax : ncclSum; return true;
    case RHC_PROD: *o = dt == BOOL ? ncclMin : ncclProd; return true;
    case RHC_MIN: *o = ncclMin; return true;
    case RHC_MAX: *o = ncclMax; return true;
    case RHC_AVG: *o = ncclAvg; return dt == F32 || dt == F64;
  }
  return false;
}

#define TYPES_OR_FAIL(dt, op)                                                       \
  ncclDataType_t t_;                                                                \
  ncclRedOp_t o_ = ncclSum;                                                         \
  if (!nccl_type(dt, &t_)) return fail("NCCL: dtype code %d is not supported", dt); \
  if ((op) >= 0 && !nccl_op(op, dt, &o_)) return fail("NCCL: AVG needs a float tensor");

int nccl_enqueue_state(int dev) {
  if (dev < 0 || dev >= 64 || !pending[dev]) return 1;
  ncclResult_t st;
  ncclResult_t r = lib.CommGetAsyncError(pending[dev]->comm, &st);
  if (r != ncclSuccess) return nccl_fail(r, "ncclCommGetAsyncError");
  if (st == ncclInProgress) return 0;
  if (st != ncclSuccess) return nccl_fail(st, "NCCL communicator");
  pending[dev] = nullptr;
  return 1;
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_nccl_available(char *why, size_t len) {
  if (load()) return 1;
  snprintf(why, len, "%s", lib.why);
  return 0;
}

int rhc_nccl_unique_id(void *id128) {
  if (!load()) return fail("%s", lib.why);
  ncclUniqueId id;
  ncclResult_t r = lib.GetUniqueId(&id);
  if (r != ncclSuccess) return nccl_fail(r, "ncclGetUniqueId");
  memcpy(id128, id.internal, NCCL_UNIQUE_ID_BYTES);
  return 0;
}

int rhc_nccl_init(int dev, int nranks, int rank, const void *id128, void **out) {
  if (!load()) return fail("%s", lib.why);
  if (!stream_for(dev)) return -1;
  ncclUniqueId id;
  memcpy(id.internal, id128, NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  Comm *c = new Comm{nullptr, dev};
  ncclResult_t r = lib.CommInitRankConfig(&c->comm, nranks, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    delete c;
    return nccl_fail(r, "ncclCommInitRank");
  }
  *out = c;
  return 0;
}

int rhc_nccl_ready(void *vc) {
  Comm *c = (Comm *)vc;
  ncclResult_t st;
  ncclResult_t r = lib.CommGetAsyncError(c->comm, &st);
  if (r != ncclSuccess) return nccl_fail(r, "ncclCommGetAsyncError");
  if (st == ncclInProgress) return 0;
  if (st != ncclSuccess) return nccl_fail(st, "NCCL communicator");
  if (c->dev >= 0 && c->dev < 64 && pending[c->dev] == c) pending[c->dev] = nullptr;
  return 1;
}

int rhc_nccl_abort(void *vc) {
  Comm *c = (Comm *)vc;
  ncclResult_t r = c->comm ? lib.CommAbort(c->comm) : ncclSuccess;
  // forget it everywhere before it is freed: events must not poll it later
  for (int d = 0; d < 64; d++) {
    if (pending[d] == c) pending[d] = nullptr;
    if (in_group[d] == c) in_group[d] = nullptr;
  }
  delete c;
  return check(r, "ncclCommAbort");
}

int rhc_nccl_all_reduce(void *vc, const void *send, void *recv, int64_t count, int dtype, int op) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, op);
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.AllReduce(send, recv, (size_t)count, t_, o_, c->comm, s_), "ncclAllReduce");
}

int rhc_nccl_broadcast(void *vc, void *buf, int64_t count, int dtype, int root) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, -1);
  (void)o_;
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.Broadcast(buf, buf, (size_t)count, t_, root, c->comm, s_), "ncclBroadcast");
}

int rhc_nccl_reduce(void *vc, const void *send, void *recv, int64_t count, int dtype, int op, int root) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, op);
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.Reduce(send, recv, (size_t)count, t_, o_, root, c->comm, s_), "ncclReduce");
}

int rhc_nccl_all_gather(void *vc, const void *send, void *recv, int64_t count, int dtype) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, -1);
  (void)o_;
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.AllGather(send, recv, (size_t)count, t_, c->comm, s_), "ncclAllGather");
}

int rhc_nccl_reduce_scatter(void *vc, const void *send, void *recv, int64_t count, int dtype, int op) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, op);
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.ReduceScatter(send, recv, (size_t)count, t_, o_, c->comm, s_), "ncclReduceScatter");
}

int rhc_nccl_send(void *vc, const void *buf, int64_t count, int dtype, int peer) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, -1);
  (void)o_;
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.Send(buf, (size_t)count, t_, peer, c->comm, s_), "ncclSend");
}

int rhc_nccl_recv(void *vc, void *buf, int64_t count, int dtype, int peer) {
  Comm *c = (Comm *)vc;
  TYPES_OR_FAIL(dtype, -1);
  (void)o_;
  STREAM_OR_FAIL(c);
  return enqueued(c, lib.Recv(buf, (size_t)count, t_, peer, c->comm, s_), "ncclRecv");
}

int rhc_nccl_group_start(void) {
  if (!load()) return fail("%s", lib.why);
  if (check(lib.GroupStart(), "ncclGroupStart")) return -1;
  group_depth++;
  return 0;
}

int rhc_nccl_group_end(void) {
  if (!load()) return fail("%s", lib.why);
  ncclResult_t r = lib.GroupEnd();
  if (group_depth > 0) group_depth--;
  if (group_depth == 0) {
    // the group's calls are enqueued now, or (ncclInProgress) in the background
    for (int d = 0; d < 64; d++) {
      if (in_group[d] && r == ncclInProgress) pending[d] = in_group[d];
      in_group[d] = nullptr;
    }
  }
  return check(r, "ncclGroupEnd");
}

}  // extern "C"
