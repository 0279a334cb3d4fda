/* Description: the C API's basics from plain C: version, status names, last-error, zoe_free. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi_check.h"
#include "zoe.h"

static void test_version(void) {
  char expected[32];
  snprintf(expected, sizeof expected, "%d.%d.%d", ZOE_VERSION_MAJOR, ZOE_VERSION_MINOR,
           ZOE_VERSION_PATCH);
  CHECK(strcmp(zoe_version(), expected) == 0);
}

static void test_status_strings(void) {
  CHECK(strcmp(zoe_status_string(ZOE_OK), "OK") == 0);
  CHECK(strcmp(zoe_status_string(ZOE_ERR_IO), "IO error") == 0);
  CHECK(strcmp(zoe_status_string(ZOE_ERR_NO_SPACE), "no space") == 0);
  CHECK(strcmp(zoe_status_string(ZOE_ERR_INTERNAL), "internal error") == 0);
  CHECK(strcmp(zoe_status_string((zoe_status)9999), "unknown status") == 0);
  CHECK(strcmp(zoe_status_string((zoe_status)-1), "unknown status") == 0);
}

static void test_last_error_and_free(void) {
  CHECK(zoe_last_error() != NULL);
  zoe_free(NULL);
  zoe_free(malloc(16));
}

int main(void) {
  test_version();
  test_status_strings();
  test_last_error_and_free();
  return finish_checks();
}
