# Warning flags shared by every zoe target (not by third-party code).
add_library(zoe_warnings INTERFACE)
target_compile_options(zoe_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX,C>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
    -Wno-missing-field-initializers>)

# zoe_add_module(<name> [DEPS targets...] [SUBDIRS folders...]): a static, position-independent
# library made of every .cc file in the calling folder and the SUBDIRS below it (new files are
# picked up at the next build), with the repository
# root as its include root so headers are included as "core/status.h", "io/engine.h", ...
function(zoe_add_module name)
  cmake_parse_arguments(ARG "" "" "DEPS;PRIVATE_DEPS;SUBDIRS" ${ARGN})
  set(patterns ${CMAKE_CURRENT_SOURCE_DIR}/*.cc)
  foreach(subdir IN LISTS ARG_SUBDIRS)
    list(APPEND patterns ${CMAKE_CURRENT_SOURCE_DIR}/${subdir}/*.cc)
  endforeach()
  file(GLOB sources CONFIGURE_DEPENDS ${patterns})
  if(NOT sources)  # a folder whose code has not been written yet
    add_library(${name} INTERFACE)
    target_link_libraries(${name} INTERFACE ${ARG_DEPS})
    return()
  endif()
  add_library(${name} STATIC ${sources})
  target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE zoe_warnings ${ARG_PRIVATE_DEPS})
endfunction()
