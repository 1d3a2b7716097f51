/* test_shape.c: rh_shape_numel, the one place a shape's element count is
 * computed from sizes that may come from the network. Every product is checked
 * before it is made (under -fsanitize=undefined an unchecked one aborts here). */
#include <stdint.h>
#include <string.h>

#include "test_check.h"
#include "tensor/tensor.h"

int main(void) {
  int64_t n = -1;
  CHECK(rh_shape_numel(0, NULL, &n) == 0 && n == 1); /* a scalar */
  int64_t a[] = {3, 4, 5};
  CHECK(rh_shape_numel(3, a, &n) == 0 && n == 60);
  int64_t empty[] = {0, 7};
  CHECK(rh_shape_numel(2, empty, &n) == 0 && n == 0);

  /* 2^32 x 2^32 overflows int64: refused, with the shape in the message */
  int64_t hostile[] = {INT64_C(1) << 32, INT64_C(1) << 32};
  CHECK(rh_shape_numel(2, hostile, &n) == -1);
  CHECK(strstr(rh_tensor_errmsg(), "[4294967296, 4294967296]") != NULL);
  CHECK(strstr(rh_tensor_errmsg(), "too large") != NULL);
  /* products that fit int64 but not int64 bytes of 16-byte elements */
  int64_t bytes[] = {INT64_C(1) << 31, INT64_C(1) << 31, 4};
  CHECK(rh_shape_numel(3, bytes, &n) == -1);
  /* a zero does not excuse the others: the strides are products of them */
  int64_t zero_huge[] = {0, INT64_C(1) << 62, INT64_C(1) << 62};
  CHECK(rh_shape_numel(3, zero_huge, &n) == -1);
  int64_t maxes[] = {INT64_MAX, INT64_MAX};
  CHECK(rh_shape_numel(2, maxes, &n) == -1);
  /* negative sizes and too many dimensions */
  int64_t neg[] = {2, -1};
  CHECK(rh_shape_numel(2, neg, &n) == -1 && strstr(rh_tensor_errmsg(), "negative size -1 in dimension 2"));
  int64_t many[RH_MAXDIM + 1];
  for (int i = 0; i <= RH_MAXDIM; i++) many[i] = 1;
  CHECK(rh_shape_numel(RH_MAXDIM + 1, many, &n) == -1);
  /* the largest accepted count still has addressable bytes */
  int64_t big[] = {INT64_C(1) << 29, INT64_C(1) << 29};
  CHECK(rh_shape_numel(2, big, &n) == 0 && n == INT64_C(1) << 58);
  return TEST_RESULT();
}
