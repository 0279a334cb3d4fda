# Finds every dependency as an imported target. Required ones stop the configure with the Debian
# package to install; CUDA and NCCL are detected and used only when present.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)

function(zoe_require_pkg target module debian_package)
  pkg_check_modules(${target} REQUIRED IMPORTED_TARGET GLOBAL ${module})
  if(NOT ${target}_FOUND)
    message(FATAL_ERROR "zoe: ${module} not found: apt-get install ${debian_package}")
  endif()
endfunction()

zoe_require_pkg(URING liburing liburing-dev)
zoe_require_pkg(HWLOC hwloc libhwloc-dev)
zoe_require_pkg(XXHASH libxxhash libxxhash-dev)

# libaio ships no pkg-config file on Debian 12.
find_path(AIO_INCLUDE_DIR libaio.h)
find_library(AIO_LIBRARY aio)
if(NOT AIO_INCLUDE_DIR OR NOT AIO_LIBRARY)
  message(FATAL_ERROR "zoe: libaio not found: apt-get install libaio-dev")
endif()
add_library(zoe::aio UNKNOWN IMPORTED GLOBAL)
set_target_properties(zoe::aio PROPERTIES IMPORTED_LOCATION ${AIO_LIBRARY}
  INTERFACE_INCLUDE_DIRECTORIES ${AIO_INCLUDE_DIR})

find_package(Boost 1.74 REQUIRED)          # header-only Asio
find_package(nlohmann_json 3.10 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)

if(ZOE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(ZOE_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# CUDA: looked for in the usual places (/usr/local/cuda, PATH). Built in when found.
set(ZOE_HAVE_CUDA OFF)
if(NOT ZOE_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(ZOE_HAVE_CUDA ON)
  elseif(ZOE_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "zoe: ZOE_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "zoe: CUDA device backend: ${ZOE_HAVE_CUDA}")

# NCCL: only its header is needed to build; libnccl.so.2 is looked up at run time in the process
# (offload/distributed/nccl_library.h), so libzoe neither links nor ships it.
set(ZOE_HAVE_NCCL OFF)
if(NOT ZOE_WITH_NCCL STREQUAL "OFF")
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include ${CUDAToolkit_INCLUDE_DIRS})
  if(NCCL_INCLUDE_DIR)
    add_library(zoe::nccl INTERFACE IMPORTED GLOBAL)
    set_target_properties(zoe::nccl PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR}
      INTERFACE_LINK_LIBRARIES "${CMAKE_DL_LIBS}")
    set(ZOE_HAVE_NCCL ON)
  elseif(ZOE_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "zoe: ZOE_WITH_NCCL=ON but nccl.h was not found")
  endif()
endif()
message(STATUS "zoe: NCCL: ${ZOE_HAVE_NCCL}")
