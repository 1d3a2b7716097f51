/* fuzz_shape.c: libFuzzer harness for the shape arithmetic applied to sizes from
 * the network (a tensor descriptor): rh_shape_numel must refuse every shape whose
 * element count, byte count or contiguous strides would overflow, so that what it
 * accepts can be multiplied out without undefined behaviour (-fsanitize=undefined
 * aborts on a signed overflow). Input: one byte of ndim, then 8 bytes per size. */
#include <stdint.h>
#include <string.h>

#include "tensor/tensor.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  int ndim = data[0] % (RH_MAXDIM + 2); /* one past the limit, to see it refused */
  int64_t sizes[RH_MAXDIM + 1];
  for (int i = 0; i < ndim; i++) {
    uint64_t v = 0;
    for (int b = 0; b < 8; b++) {
      size_t at = 1 + (size_t)i * 8 + (size_t)b;
      v = (v << 8) | (at < size ? data[at] : 0);
    }
    /* mostly small or near powers of two, where overflows hide */
    sizes[i] = (int64_t)(v >> (data[0] >> 4));
  }
  int64_t numel = 0;
  if (rh_shape_numel(ndim, sizes, &numel) != 0) return 0;
  /* what callers then compute from an accepted shape */
  int64_t bytes = numel * 16, stride = 1;
  for (int i = ndim - 1; i >= 0; i--) stride *= sizes[i] > 0 ? sizes[i] : 1;
  return (int)((bytes ^ stride) & 0);
}
