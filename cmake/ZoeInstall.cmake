# Installs libzoe.so, zoe.h, the zoe CLI, a CMake package (zoe::zoe) and zoe.pc.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS zoe EXPORT zoeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  PUBLIC_HEADER DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET zoe_cli)
  install(TARGETS zoe_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT zoeTargets NAMESPACE zoe:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/zoe)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/zoeConfig.cmake.in
  ${PROJECT_BINARY_DIR}/zoeConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/zoe)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/zoeConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/zoeConfig.cmake ${PROJECT_BINARY_DIR}/zoeConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/zoe)

configure_file(${PROJECT_SOURCE_DIR}/cmake/zoe.pc.in ${PROJECT_BINARY_DIR}/zoe.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/zoe.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
