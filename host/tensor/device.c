/* device.c: CUDA devices for the tensor core, through librpchost_cuda.so.
 *
 * The kernels library is loaded with dlopen the first time anything asks about
 * devices, from $RPCHOST_CUDA_LIB, else next to the executable (build tree),
 * else <exe>/../<libdir>/rpchost (installed tree). When it is missing, cannot
 * load (no CUDA runtime), or finds no device, the count is 0 and rh_cuda_why()
 * says which, so every GPU call can fail with the reason.
 *
 * It owns the library and the device numbers (the one check every number passes,
 * the library's messages) and nothing else: device storages are storage.c's,
 * copies to and from a device copy.c's. Depends on errmsg.c alone. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "tensor_internal.h"

#ifndef RPCHOST_INSTALL_CUDA_REL
#define RPCHOST_INSTALL_CUDA_REL "lib/rpchost"
#endif
#define CUDA_LIB_NAME "librpchost_cuda.so"

static const rhc_api_t *api;
static int tried, ndev;
static char why[768] = "";

static char lib_path[4200];

static void *open_lib(void) {
  const char *env = getenv("RPCHOST_CUDA_LIB");
  if (env && *env) {
    snprintf(lib_path, sizeof lib_path, "%s", env);
    void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    if (!h) snprintf(why, sizeof why, "cannot load $RPCHOST_CUDA_LIB: %s", dlerror());
    return h;
  }
  char exe[4096];
  size_t n = sizeof exe;
  if (uv_exepath(exe, &n) != 0) {
    snprintf(why, sizeof why, "cannot find the executable's folder to look for " CUDA_LIB_NAME);
    return NULL;
  }
  char *slash = strrchr(exe, '/');
  if (slash) *slash = 0;
  char path[2][4200];
  snprintf(path[0], sizeof path[0], "%s/" CUDA_LIB_NAME, exe);
  snprintf(path[1], sizeof path[1], "%s/../" RPCHOST_INSTALL_CUDA_REL "/" CUDA_LIB_NAME, exe);
  for (int i = 0; i < 2; i++) {
    FILE *f = fopen(path[i], "rb");
    if (!f) continue;
    fclose(f);
    snprintf(lib_path, sizeof lib_path, "%s", path[i]);
    void *h = dlopen(path[i], RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    snprintf(why, sizeof why, "cannot load %.300s: %.400s", path[i], dlerror());
    return NULL;
  }
  snprintf(why, sizeof why,
           "rpchost was built without CUDA (no " CUDA_LIB_NAME
           " next to the binary; "
           "rebuild where nvcc is installed)");
  return NULL;
}

/* Whether this machine shows an NVIDIA GPU to this process: the driver's
 * control device or its /proc entry. Without either, the CUDA runtime still
 * answers, but with "CUDA driver version is insufficient for CUDA runtime
 * version" (there is no driver at all, so none is new enough), which sends a
 * user looking for a driver upgrade on a machine that has no GPU. */
static int nvidia_present(void) {
  return access("/dev/nvidiactl", F_OK) == 0 || access("/dev/nvidia0", F_OK) == 0 ||
         access("/proc/driver/nvidia/version", F_OK) == 0;
}

static void no_device(const char *runtime_says) {
  if (!nvidia_present())
    snprintf(why, sizeof why,
             "no GPU found: this machine shows no NVIDIA device (no /dev/nvidiactl, no NVIDIA driver loaded)");
  else if (runtime_says) snprintf(why, sizeof why, "no usable GPU: %s", runtime_says);
  else snprintf(why, sizeof why, "no GPU found: the CUDA driver found no device");
}

static void load(void) {
  if (tried) return;
  tried = 1;
  void *h = open_lib();
  if (!h) return;
  rhc_get_api_fn get = (rhc_get_api_fn)dlsym(h, "rhc_get_api");
  const rhc_api_t *a = get ? get(RHC_ABI_VERSION) : NULL;
  if (!a) {
    snprintf(why, sizeof why,
             "%.600s is not the CUDA kernels library of this rpchost (no rhc_get_api for ABI %d); "
             "rebuild both from one source tree",
             lib_path, RHC_ABI_VERSION);
    dlclose(h);
    return;
  }
  int n = 0;
  if (a->device_count(&n) != 0) {
    no_device(a->last_error());
    return;
  }
  if (n == 0) {
    no_device(NULL);
    return;
  }
  api = a;
  ndev = n;
}

int rh_cuda_device_count(void) {
  load();
  return ndev;
}

const char *rh_cuda_why(void) {
  load();
  return api ? "" : why;
}

const rhc_api_t *rh_cuda_api(void) {
  load();
  return api;
}

/* The one check every device number passes before the tensor core uses it: -1
 * is the CPU, 0..n-1 the CUDA devices present. A device number may come from
 * the network (a tensor's descriptor), so any other negative is refused here
 * too: "device < 0 means the host" would let -2 through to the CUDA table,
 * which is NULL without a GPU. */
int rh__check_device(int device) {
  if (device == RH_CPU) return 0;
  if (device < 0)
    return rh_tensor_fail("invalid device %d: a device is -1 (the CPU) or the index of a CUDA device (0, 1, ...)",
                          device);
  load();
  if (!api) return rh_tensor_fail("CUDA is not available: %s (tensor.cuda.is_available() is false)", why);
  if (device >= ndev)
    return rh_tensor_fail("CUDA device cuda:%d does not exist: this machine has %d device%s (cuda:0%s)", device, ndev,
                          ndev == 1 ? "" : "s", ndev > 1 ? " to cuda:N-1" : "");
  return 0;
}

int rh__cuda_call(int rc) { return rc ? rh_tensor_fail("%s", api->last_error()) : 0; }

const char *rh_device_str(int device, char *buf, size_t len) {
  if (device < 0) snprintf(buf, len, "cpu");
  else snprintf(buf, len, "cuda:%d", device);
  return buf;
}

int rh_cuda_synchronize(int device) {
  if (rh__check_device(device)) return -1;
  if (device == RH_CPU) return rh_tensor_fail("synchronize: cpu is not a CUDA device (give cuda:N or N)");
  return rh__cuda_call(api->synchronize(device));
}
