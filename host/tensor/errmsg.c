/* errmsg.c: the floor of the tensor core: the one error message per thread that
 * every function of the core reports through (rh_tensor_fail) and the binding
 * reads right after a failure (rh_tensor_errmsg). It calls nothing: every other
 * file of the core depends on it (Torch7's THGeneral).
 *
 * The core's files depend one way, never back (THGeneral <- THStorage <-
 * THTensor <- THTensorCopy <- THTensorMath):
 *   errmsg.c, parallel.c  <-  device.c  <-  storage.c  <-  tensor.c, iter.c
 *   <-  copy.c  <-  reduce.c  <-  ops.c  <-  matmul.c, index.c, sort.c, random.c
 *   <-  nn/ */
#include <stdarg.h>
#include <stdio.h>

#include "tensor.h"

static _Thread_local char errmsg[512];

const char *rh_tensor_errmsg(void) { return errmsg; }

int rh_tensor_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(errmsg, sizeof errmsg, fmt, ap);
  va_end(ap);
  return -1;
}
