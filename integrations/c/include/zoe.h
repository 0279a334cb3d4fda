/* zoe.h: the stable C API of zoe, a heterogeneous-memory offload engine.
 *
 * Conventions
 *  1. Every function that can fail returns a zoe_status; ZOE_OK is 0. Codes are numbered
 *     explicitly and a number is never reused.
 *  2. After a failure, zoe_last_error() returns a message naming what was wrong; it is
 *     thread-local and valid until the same thread's next call into zoe.
 *  3. Handles are opaque; destroy functions accept NULL.
 *  4. Ownership is stated on every function: "borrowed" pointers stay owned by the caller;
 *     strings returned as "free with zoe_free" belong to the caller.
 *  5. No C++ exception and no abort crosses this boundary.
 *
 * Usage
 *     printf("zoe %s\n", zoe_version());
 *     if (zoe_some_call(...) != ZOE_OK) fprintf(stderr, "zoe: %s\n", zoe_last_error());
 */
#ifndef ZOE_H_
#define ZOE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(ZOE_BUILDING_LIBRARY)
#define ZOE_API __attribute__((visibility("default")))
#else
#define ZOE_API
#endif

#define ZOE_VERSION_MAJOR 0
#define ZOE_VERSION_MINOR 1
#define ZOE_VERSION_PATCH 0

typedef enum zoe_status {
  ZOE_OK = 0,
  ZOE_ERR_INVALID_ARGUMENT = 1,
  ZOE_ERR_NOT_FOUND = 2,
  ZOE_ERR_IO = 3,
  ZOE_ERR_NO_SPACE = 4,
  ZOE_ERR_CORRUPTION = 5,
  ZOE_ERR_OUT_OF_MEMORY = 6,
  ZOE_ERR_NOT_SUPPORTED = 7,
  ZOE_ERR_FAILED_PRECONDITION = 8,
  ZOE_ERR_BUSY = 9,
  ZOE_ERR_PERMISSION_DENIED = 10,
  ZOE_ERR_ABORTED = 11,
  ZOE_ERR_INTERNAL = 12
} zoe_status;

/* "MAJOR.MINOR.PATCH" of the loaded library. Static storage; never free. Thread-safe. */
ZOE_API const char* zoe_version(void);

/* A short constant name for a status ("IO error"); "unknown status" for numbers not in the
 * enum. Static storage; never free. Thread-safe. */
ZOE_API const char* zoe_status_string(zoe_status status);

/* The message of this thread's most recent failure, or "" if the last call succeeded. Borrowed:
 * valid until this thread's next call into zoe. Never NULL. */
ZOE_API const char* zoe_last_error(void);

/* Frees memory that zoe returned with "free with zoe_free". Accepts NULL. */
ZOE_API void zoe_free(void* ptr);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZOE_H_ */
