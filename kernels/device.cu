// device.cu: errors, per-device state (stream, SM count), the caching
// allocator, copies and events.
//
// Allocator: cudaMalloc/cudaFree synchronise the device and cost tens of
// microseconds, so freed blocks are kept in per-device free lists keyed by size
// and handed out again. Sizes are rounded (512 B below 1 MiB, 2 MiB above) so
// blocks are reusable across nearby sizes. Every kernel and copy of a device
// runs on that device's one stream, so a block freed by the host and reused by
// the next op is stream-ordered: the old user's kernels are queued before the new
// user's. When cudaMalloc fails, the cache is released and the call tried again.
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "common.cuh"

namespace rhc {

static thread_local char errbuf[512];

const char *last_error() { return errbuf; }

int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(errbuf, sizeof errbuf, fmt, ap);
  va_end(ap);
  return -1;
}

int cuda_fail(cudaError_t e, const char *what) {
  // Every failed runtime call also sets the thread's "last error", which the
  // next launch_check() (cudaGetLastError) would then report as that launch's
  // failure. Reset it here; a sticky error (a faulted context) stays anyway.
  (void)cudaGetLastError();
  return fail("%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

int launch_check(const char *what) {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : cuda_fail(e, what);
}

struct DeviceState {
  bool ready = false;
  cudaStream_t stream = nullptr;
  int sms = 1;
  std::mutex mu;
  std::multimap<size_t, void *> free_blocks;  // size -> block
  std::unordered_map<void *, size_t> live;    // block -> size
  rhc_memstats_t stats = {0, 0, 0, 0};
};

static constexpr int kMaxDevices = 64;
static DeviceState devices[kMaxDevices];

static DeviceState *state(int dev) {
  if (dev < 0 || dev >= kMaxDevices) {
    fail("device index %d out of range", dev);
    return nullptr;
  }
  DeviceState &d = devices[dev];
  cudaError_t e = cudaSetDevice(dev);
  if (e != cudaSuccess) {
    cuda_fail(e, "cudaSetDevice");
    return nullptr;
  }
  if (!d.ready) {
    e = cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      cuda_fail(e, "cudaStreamCreate");
      return nullptr;
    }
    cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
    if (d.sms < 1) d.sms = 1;
    d.ready = true;
  }
  return &d;
}

cudaStream_t stream_for(int dev) {
  DeviceState *d = state(dev);
  return d ? d->stream : nullptr;
}

int sm_count(int dev) { return dev >= 0 && dev < kMaxDevices && devices[dev].ready ? devices[dev].sms : 1; }

static size_t round_size(size_t n) {
  if (n == 0) n = 1;
  const size_t small = 512, big = (size_t)2 << 20;
  if (n < ((size_t)1 << 20)) return (n + small - 1) / small * small;
  return (n + big - 1) / big * big;
}

static void release_cache(DeviceState &d) {
  for (auto &kv : d.free_blocks) {
    cudaFree(kv.second);
    d.stats.cached -= (int64_t)kv.first;
  }
  d.free_blocks.clear();
}

}  // namespace rhc

using namespace rhc;

extern "C" {

int rhc_device_count(int *n) {
  *n = 0;
  cudaError_t e = cudaGetDeviceCount(n);
  if (e == cudaSuccess) return 0;
  *n = 0;
  cudaGetLastError();  // clear the sticky error so later calls see a clean slate
  return cuda_fail(e, "cudaGetDeviceCount");
}

int rhc_device_name(int dev, char *buf, size_t len) {
  cudaDeviceProp p;
  RHC_CHECK(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  snprintf(buf, len, "%s", p.name);
  return 0;
}

int rhc_device_limits(int dev, double *peak_gbps, int *sms) {
  int khz = 0, bits = 0;
  RHC_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev), "memory clock");
  RHC_CHECK(cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev), "memory bus width");
  RHC_CHECK(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  // double data rate: two transfers per clock
  *peak_gbps = 2.0 * (double)khz * 1e3 * (double)(bits / 8) / 1e9;
  return 0;
}

// Before a host wait on the stream: a non-blocking NCCL call still being
// enqueued (see nccl_enqueue_state) is not on the stream yet, so a
// cudaStreamSynchronize would not wait for it. Spin until it is (it waits for
// the peers as a blocking communicator would).
static int wait_enqueued(int dev) {
  int st;
  while ((st = nccl_enqueue_state(dev)) == 0) std::this_thread::yield();
  return st < 0 ? -1 : 0;
}

int rhc_synchronize(int dev) {
  cudaStream_t s = stream_for(dev);
  if (!s || wait_enqueued(dev)) return -1;
  RHC_CHECK(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return 0;
}

int rhc_alloc(int dev, size_t nbytes, void **ptr) {
  DeviceState *d = state(dev);
  if (!d) return -1;
  size_t want = round_size(nbytes);
  std::lock_guard<std::mutex> g(d->mu);
  // the smallest cached block that fits, if it does not waste more than half of it
  auto it = d->free_blocks.lower_bound(want);
  if (it != d->free_blocks.end() && it->first <= want * 2) {
    *ptr = it->second;
    d->live[it->second] = it->first;
    d->stats.cached -= (int64_t)it->first;
    d->stats.allocated += (int64_t)it->first;
    want = it->first;
    d->free_blocks.erase(it);
  } else {
    cudaError_t e = cudaMalloc(ptr, want);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      cudaStreamSynchronize(d->stream);
      release_cache(*d);
      e = cudaMalloc(ptr, want);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t freeb = 0, total = 0;
      cudaMemGetInfo(&freeb, &total);
      return fail("out of memory on cuda:%d allocating %zu bytes (%zu of %zu bytes free, %lld in live tensors): %s",
                  dev, nbytes, freeb, total, (long long)d->stats.allocated, cudaGetErrorString(e));
    }
    d->live[*ptr] = want;
    d->stats.allocated += (int64_t)want;
    d->stats.cuda_mallocs++;
  }
  if (d->stats.allocated > d->stats.peak) d->stats.peak = d->stats.allocated;
  return 0;
}

void rhc_free(int dev, void *ptr) {
  if (!ptr || dev < 0 || dev >= kMaxDevices) return;
  DeviceState &d = devices[dev];
  std::lock_guard<std::mutex> g(d.mu);
  auto it = d.live.find(ptr);
  if (it == d.live.end()) return;  // not ours: never free what we did not allocate
  d.free_blocks.emplace(it->second, ptr);
  d.stats.allocated -= (int64_t)it->second;
  d.stats.cached += (int64_t)it->second;
  d.live.erase(it);
}

int rhc_memstats(int dev, rhc_memstats_t *out) {
  if (dev < 0 || dev >= kMaxDevices) return fail("device index %d out of range", dev);
  std::lock_guard<std::mutex> g(devices[dev].mu);
  *out = devices[dev].stats;
  return 0;
}

int rhc_empty_cache(int dev) {
  DeviceState *d = state(dev);
  if (!d) return -1;
  RHC_CHECK(cudaStreamSynchronize(d->stream), "cudaStreamSynchronize");
  std::lock_guard<std::mutex> g(d->mu);
  release_cache(*d);
  return 0;
}

int rhc_h2d(int dev, void *dst, const void *src, size_t n) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  // from pageable memory the copy is staged before this returns, so the host
  // buffer may be reused at once
  RHC_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s), "copy to device");
  return 0;
}

int rhc_d2h(int dev, void *dst, const void *src, size_t n) {
  cudaStream_t s = stream_for(dev);
  if (!s || wait_enqueued(dev)) return -1;
  RHC_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s), "copy to host");
  RHC_CHECK(cudaStreamSynchronize(s), "copy to host (waiting for the device)");
  return 0;
}

int rhc_d2d(int dst_dev, void *dst, int src_dev, const void *src, size_t n) {
  cudaStream_t s = stream_for(src_dev);
  if (!s) return -1;
  if (dst_dev == src_dev) {
    RHC_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s), "device copy");
    return 0;
  }
  // the destination's stream may have queued work on dst: wait for it first,
  // then copy on the source's stream and wait, so both orders hold
  cudaStream_t ds = stream_for(dst_dev);
  if (!ds) return -1;
  RHC_CHECK(cudaStreamSynchronize(ds), "waiting for the destination device");
  RHC_CHECK(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, n, s), "copy between devices");
  RHC_CHECK(cudaStreamSynchronize(s), "copy between devices (waiting)");
  return 0;
}

// An event is recorded on the device's stream. When a non-blocking NCCL call
// on this device is still being enqueued (it returned ncclInProgress), its
// kernels may not be on the stream yet and an event recorded now could complete
// before them; the record is then deferred until NCCL says the call is enqueued
// (nccl_enqueue_state), and event_done reports "not yet" until it is.
struct Event {
  cudaEvent_t ev;
  int dev;
  bool recorded;
};

static int record_now(Event *e) {
  cudaStream_t s = stream_for(e->dev);
  if (!s) return -1;
  RHC_CHECK(cudaEventRecord(e->ev, s), "cudaEventRecord");
  e->recorded = true;
  return 0;
}

int rhc_event_record(int dev, void **event) {
  cudaStream_t s = stream_for(dev);
  if (!s) return -1;
  Event *e = new Event{nullptr, dev, false};
  cudaError_t ce = cudaEventCreateWithFlags(&e->ev, cudaEventDisableTiming);
  if (ce != cudaSuccess) {
    delete e;
    return cuda_fail(ce, "cudaEventCreate");
  }
  int st = nccl_enqueue_state(dev);
  if (st < 0 || (st == 1 && record_now(e))) {
    cudaEventDestroy(e->ev);
    delete e;
    return -1;
  }
  *event = e;
  return 0;
}

int rhc_event_done(void *event) {
  Event *e = (Event *)event;
  if (!e->recorded) {
    int st = nccl_enqueue_state(e->dev);
    if (st <= 0) return st;  // still being enqueued, or failed (message set)
    if (record_now(e)) return -1;
  }
  cudaError_t ce = cudaEventQuery(e->ev);
  if (ce == cudaSuccess) return 1;
  if (ce == cudaErrorNotReady) {
    (void)cudaGetLastError();  // in case "not ready" was also recorded as the last error
    return 0;
  }
  return cuda_fail(ce, "a device operation failed");
}

void rhc_event_free(void *event) {
  Event *e = (Event *)event;
  if (!e) return;
  cudaEventDestroy(e->ev);
  delete e;
}

}  // extern "C"
