# Applies ZOE_SANITIZE (e.g. "address,undefined" or "thread") to every target defined after it.
if(ZOE_SANITIZE)
  message(STATUS "zoe: sanitizers: ${ZOE_SANITIZE}")
  add_compile_options(-fsanitize=${ZOE_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${ZOE_SANITIZE})
endif()
