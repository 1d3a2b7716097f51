/* test_check.h: the C unit tests' one assertion: a failed CHECK is printed with
 * its place and counted, and the test goes on; TEST_RESULT() ends main. */
#ifndef RH_TEST_CHECK_H
#define RH_TEST_CHECK_H

#include <stdio.h>

static int failures;
#define CHECK(c)                                                            \
  do {                                                                      \
    if (!(c)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c); \
      failures++;                                                           \
    }                                                                       \
  } while (0)

#define TEST_RESULT() (printf("%s: %d failures\n", failures ? "FAIL" : "ok", failures), failures ? 1 : 0)

#endif
