/* test_device.c: the tensor core's device check, the one every device number
 * passes before it is used (it may come from the network, in a tensor's
 * descriptor). -1 is the CPU; 0..n-1 the CUDA devices present; every other
 * number, -2 and INT_MIN included, is refused with a message, never taken for
 * the host or handed to the CUDA table (NULL without a GPU).
 *
 * Without an argument the kernels library is made unavailable (a path that does
 * not exist); with one (the emulated library, kernels/emulated.cpp) a device is
 * present, and the first index past the last one is refused. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor.h"
#include "test_check.h"

/* every number that is neither the CPU nor a device present fails, naming it */
static void refused_everywhere(int dev, const char *want) {
  int64_t size[] = {2, 3};
  rh_tensor_t *t = rh_tensor_full(RH_F32, 2, size, 1.0);
  CHECK(t != NULL);
  CHECK(rh_tensor_to_device(t, dev) == NULL && strstr(rh_tensor_errmsg(), want));
  CHECK(rh_tensor_empty_on(dev, RH_F32, 2, size) == NULL && strstr(rh_tensor_errmsg(), want));
  CHECK(rh_storage_new_on(dev, 24) == NULL && strstr(rh_tensor_errmsg(), want));
  CHECK(rh_cuda_synchronize(dev) == -1 && strstr(rh_tensor_errmsg(), want));
  rh_tensor_release(t);
}

int main(int argc, char **argv) {
  setenv("RPCHOST_CUDA_LIB", argc > 1 ? argv[1] : "/nonexistent/librpchost_cuda.so", 1);
  int n = rh_cuda_device_count();
  CHECK(argc > 1 ? n >= 1 : n == 0);

  /* the CPU: -1, and a tensor already there is itself */
  int64_t size[] = {2, 3};
  rh_tensor_t *t = rh_tensor_full(RH_F32, 2, size, 1.0);
  rh_tensor_t *same = rh_tensor_to_device(t, RH_CPU);
  CHECK(same == t);
  rh_tensor_release(same);
  rh_tensor_t *e = rh_tensor_empty_on(RH_CPU, RH_F32, 2, size);
  CHECK(e != NULL && rh_tensor_device(e) == RH_CPU);
  rh_tensor_release(e);
  /* synchronize needs a CUDA device: the CPU is refused in words, not a call
   * through the (NULL) CUDA table */
  CHECK(rh_cuda_synchronize(RH_CPU) == -1 && strstr(rh_tensor_errmsg(), "not a CUDA device"));

  /* negatives other than the CPU's: -2 is what 2^32 - 2 from the wire was cast to */
  refused_everywhere(-2, "invalid device -2");
  refused_everywhere(-3, "invalid device -3");
  refused_everywhere(INT_MIN, "invalid device -2147483648");

  /* device indices not present */
  if (n == 0) {
    refused_everywhere(0, "CUDA is not available");
    refused_everywhere(INT_MAX, "CUDA is not available");
  } else {
    refused_everywhere(n, "does not exist");
    refused_everywhere(INT_MAX, "does not exist");
    /* the last device present works, and back */
    rh_tensor_t *d = rh_tensor_to_device(t, n - 1);
    CHECK(d != NULL && rh_tensor_device(d) == n - 1);
    CHECK(d && rh_cuda_synchronize(n - 1) == 0);
    rh_tensor_t *h = d ? rh_tensor_to_device(d, RH_CPU) : NULL;
    CHECK(h != NULL && rh_tensor_device(h) == RH_CPU && ((float *)rh_tensor_data(h))[5] == 1.0f);
    /* a device tensor's copy to a bad device is refused too */
    CHECK(d && rh_tensor_to_device(d, -2) == NULL && strstr(rh_tensor_errmsg(), "invalid device -2"));
    rh_tensor_release(h);
    rh_tensor_release(d);
  }
  rh_tensor_release(t);
  return TEST_RESULT();
}
