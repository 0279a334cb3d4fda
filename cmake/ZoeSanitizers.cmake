# Applies ZOE_SANITIZE (e.g. "address,undefined" or "thread") to every target defined after it.
if(ZOE_SANITIZE)
  message(STATUS "zoe: sanitizers: ${ZOE_SANITIZE}")
  add_compile_options(-fsanitize=${ZOE_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  if(ZOE_SANITIZE MATCHES "thread")
    # Boost.Asio uses std::atomic_thread_fence, which TSan does not model; GCC warns per use.
    add_compile_options(-Wno-tsan)
  endif()
  add_link_options(-fsanitize=${ZOE_SANITIZE})
endif()
