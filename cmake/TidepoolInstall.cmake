# Install and export so that a C++ trainer can find_package(tidepool).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(_tidepool_targets tidepool)
if(TARGET tidepool_optim)
  list(APPEND _tidepool_targets tidepool_optim)
endif()
install(TARGETS ${_tidepool_targets} EXPORT tidepoolTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT tidepoolTargets NAMESPACE tidepool:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tidepool)
configure_package_config_file(cmake/tidepoolConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tidepool)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tidepool)
