/* The plain-C test harness of the C API tests: CHECK counts a check and reports a failed one with
 * its file and line; finish_checks() prints the totals and gives main's exit status. Each test
 * program includes this once. */
#ifndef ZOE_TESTS_CAPI_CHECK_H_
#define ZOE_TESTS_CAPI_CHECK_H_

#include <stdio.h>

static int failures = 0;
static int checks = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++checks;                                                                  \
    if (!(cond)) {                                                             \
      ++failures;                                                              \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

static int finish_checks(void) {
  printf("%d passed, %d failed\n", checks - failures, failures);
  return failures == 0 ? 0 : 1;
}

#endif /* ZOE_TESTS_CAPI_CHECK_H_ */
