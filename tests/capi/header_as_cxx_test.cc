// Description: zoe.h compiles as C++ and its declarations have C linkage and the documented types.
#include <type_traits>

#include "zoe.h"

static_assert(std::is_same_v<decltype(&zoe_version), const char* (*)()>);
static_assert(std::is_same_v<decltype(&zoe_status_string), const char* (*)(zoe_status)>);
static_assert(static_cast<int>(ZOE_OK) == 0);
static_assert(static_cast<int>(ZOE_ERR_INTERNAL) == 12);

int main() { return zoe_version() != nullptr ? 0 : 1; }
